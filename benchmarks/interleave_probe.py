"""Probe: does timing a whole-model graph beside a float32 one slow its replays?

In three runs of four (benchmarks/results/h200-2026-11-30j), gpt2's optimized graph replayed
at 0.539-0.548 ms in the recapture process and 0.505-0.511 ms in the two other timing
processes, with the same kernel time. The recapture process alone also times the plan at float32
(``optimized_baseline_dtype``) in the same interleaved rounds. This probe records gpt2 (eager)
as one graph in bf16 and one in float32, and times the bf16 graph's replays with the timing
pass (capture.timing.time_interleaved, 15 rounds): alone, beside the float32 graph, and alone
again, then its GPU time with the host hidden after each. One JSON line per setting.

    python benchmarks/interleave_probe.py
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

import torch

from pytest_opprof import workload
from pytest_opprof.backend.model_graph import ModelGraph
from pytest_opprof.capture import timing


def main() -> int:
    w = workload.load(Path("examples/gpt2/gpt2.py"), "cuda")
    model, ids = w.model, w.inputs[0]
    with torch.no_grad():
        fp32 = ModelGraph(model)
        bf16 = ModelGraph(copy.deepcopy(model).to(torch.bfloat16))
        for fn in (fp32, bf16):
            for _ in range(5):
                fn(ids)
        torch.cuda.synchronize()
    settings = [("alone", {"bf16": bf16}), ("beside fp32", {"bf16": bf16, "fp32": fp32})]
    for name, calls in [*settings, *settings]:
        s = timing.time_interleaved(
            calls, (ids,), device="cuda", warmup=3, calls_per_round=30, rounds=15
        )
        row = {k: round(statistics.median(v), 4) for k, v in s.items()}
        gpu = timing.gpu_time(calls, (ids,), device="cuda", calls_per_sample=s.calls)
        print(
            json.dumps(
                {
                    "setting": name,
                    "latency_ms": row,
                    "gpu_time_ms": {k: round(v, 4) for k, v in gpu.items()},
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
