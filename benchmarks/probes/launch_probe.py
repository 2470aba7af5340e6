"""Probe: where does a launch-bound call's speed change between processes?

On the H200 host, the same eager conv_block call ran at 0.28 ms in some fresh processes and
0.36-0.54 ms in others, steady within each (benchmarks/probes/affinity_probe.py). On a quiet
CPU machine the same model's dispatch, on CPU tensors, stays within 2% across processes. This
probe splits the call's host path in each of N fresh processes:

- ``cpu_dispatch_us``: the model on tiny CPU tensors (Python + ATen dispatch, no CUDA);
- ``launch_us``: host time per empty CUDA launch (``torch.cuda._sleep(0)``, the driver path);
- ``eager_ms`` / ``graph_ms``: conv_block eager per call (CUDA events), and the same call
  replayed from a CUDA graph (no host path at all: the GPU's own speed);
- ``compiled_ms``: the same call through ``torch.compile`` (Inductor, warm caches), the
  baseline whose speed wandered most between processes.

Whichever of these moves with ``eager_ms`` across processes is where the variance lives. The
processes alternate between address-space randomisation on and off (``setarch -R``): where the
per-process speed is the memory layout a process happened to get (cache-set and TLB conflicts
of the dispatcher's hot data), the processes without it agree with each other. (A first run
grouped them by ``PYTHONHASHSEED`` instead: processes of one seed differed as much as any, so
string hashing is not it; benchmarks/results/h200x2-2026-11-30f.) Each line also names the
CPU the process ended on and how many it may use. One JSON line per process.

    python benchmarks/probes/launch_probe.py [N]
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys

PRELUDE = r"""
import importlib.util, json, statistics, sys, time, torch

def median_of(fn, rounds=15, calls=200):
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)

spec = importlib.util.spec_from_file_location("conv_block", "examples/conv_block/conv_block.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
model, x = mod.get_model_and_input()
"""
"""A child's start: the imports, ``median_of`` (host seconds per call of ``fn``, the median of
``rounds``) and conv_block's ``model, x``. benchmarks/probes/host_probe.py starts from it too."""

CHILD = (
    PRELUDE
    + r"""
row = {}
with torch.no_grad():
    cpu_model = model.to("cpu"); tiny = torch.randn(1, *x.shape[1:2], 8, 8)
    try:
        cpu_model(tiny)
        row["cpu_dispatch_us"] = round(median_of(lambda: cpu_model(tiny), calls=50) * 1e6, 1)
    except Exception as exc:  # a model whose head needs the full spatial size
        row["cpu_dispatch_error"] = str(exc)[:120]
    model = cpu_model.to("cuda")
    for _ in range(100):
        torch.cuda._sleep(0)
    torch.cuda.synchronize()
    row["launch_us"] = round(median_of(lambda: torch.cuda._sleep(0), calls=500) * 1e6, 2)
    torch.cuda.synchronize()

    def events(fn, rounds=15, calls=20):
        out = []
        for _ in range(rounds):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                fn()
            e.record(); e.synchronize()
            out.append(s.elapsed_time(e) / calls)
        return round(statistics.median(out), 4)

    for _ in range(20):
        model(x)
    row["eager_ms"] = events(lambda: model(x))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    row["graph_ms"] = events(graph.replay)
    compiled = torch.compile(model)
    for _ in range(5):
        compiled(x)
    row["compiled_ms"] = events(lambda: compiled(x))
import os
row["cpu"] = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])
row["cpus_allowed"] = len(os.sched_getaffinity(0))
print(json.dumps(row))
"""
)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    setarch = shutil.which("setarch")
    for i in range(n):
        fixed = setarch is not None and i % 2 == 1
        cmd = [sys.executable, "-c", CHILD]
        if fixed:
            cmd = [setarch, platform.machine(), "-R", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1:] or [json.dumps({"error": done.stderr[-300:]})]
        row = {"process": i, "aslr": "off" if fixed else "on", **json.loads(line[0])}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
