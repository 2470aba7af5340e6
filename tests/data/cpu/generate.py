"""Regenerate the real CPU traces of this folder (torch 2.13 CPU wheel, where they were made).

    python tests/data/cpu/generate.py

Each variant runs in a fresh process with a fresh Inductor cache, is profiled the way the
timeline pass profiles (a schedule that drops one warm step, each call inside an
``opprof::iteration#<i>`` mark), and is written trimmed: only complete events, without the
per-input type, stride and value lists. Compiled variants also keep the wrapper module Inductor
generated and ``collect_inductor_provenance()``'s answer for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("eager", "inductor", "inductor_kernel_profile", "graph_break", "dynamic_shapes")
DROPPED_ARGS = ("Input type", "Input Strides", "Concrete Inputs")


def main() -> None:
    if len(sys.argv) == 2:
        _capture(sys.argv[1])
        return
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            subprocess.run([sys.executable, __file__, variant], check=True, env=env)


def _capture(variant: str) -> None:
    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from pytest_opprof.capture.provenance import collect_inductor_provenance
    from pytest_opprof.capture.trace import ITERATION_MARK

    class ConvMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv(x)).mean(dim=(2, 3))
            y = torch.relu(self.fc1(y))
            if variant == "graph_break":
                torch._dynamo.graph_break()
            return self.fc2(y) + 1.0

    torch.manual_seed(0)
    model = ConvMlp().eval()
    profiled = variant in ("inductor_kernel_profile", "graph_break")
    inductor_config.cpp.enable_kernel_profile = profiled  # cpp_fused_* kernels record events
    compiled = profiled or variant == "inductor"
    fn = torch.compile(model) if compiled else model
    batches = [2, 2, 2, 2] if variant != "dynamic_shapes" else [2, 2, 3, 5]
    path = HERE / f"{variant}.trace.json"
    inputs = [torch.randn(batch, 3, 8, 8) for batch in batches]
    with torch.no_grad():
        for _ in range(3):
            fn(inputs[0])
        steps = schedule(wait=0, warmup=1, active=3, repeat=1)
        with profile(activities=[ProfilerActivity.CPU], schedule=steps, record_shapes=True) as p:
            for i, x in enumerate(inputs):
                with record_function(f"{ITERATION_MARK}#{i}"):
                    fn(x)
                p.step()
        p.export_chrome_trace(str(path))
    _trim(path)
    if compiled:
        provenance = collect_inductor_provenance()
        (HERE / f"{variant}.provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
        from torch._inductor.codecache import PyCodeCache

        sources = [Path(str(m.__file__)).read_text() for m in PyCodeCache.modules]
        source = "\n".join(s for s in sources if "def call(" in s)
        (HERE / f"{variant}.output_code.txt").write_text(source)


def _trim(path: Path) -> None:
    trace = json.loads(path.read_text())
    events = []
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or event.get("cat") == "Trace":
            continue
        for key in DROPPED_ARGS:
            event.get("args", {}).pop(key, None)
        events.append(event)
    trace["traceEvents"] = events
    trace["traceName"] = path.name  # not the absolute path of the machine that made it
    text = json.dumps(trace, separators=(",", ":"))
    path.write_text(text.replace('},{"ph"', '},\n{"ph"') + "\n")


if __name__ == "__main__":
    main()
