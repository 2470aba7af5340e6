"""Probe: which host reference, taken beside each timing round, tracks a launch-bound call?

The timing pass takes ``capture.timing.host_reference_us`` (a tiny CPU ``torch.add``) at each
round's start and sets aside the rounds where it ran slow. On the H200 host the torch.compile
baselines still moved 15-50% between processes and runs while that reference moved 10%. This
probe times, in each of N fresh processes, rounds of conv_block's torch.compile call (30 calls
between CUDA events, as the timing pass does) and beside each round, before and after it:

- ``cpu_us``: ``host_reference_us()``, the reference the timing pass takes now;
- ``launch_us``: host µs per launch of 32 tiny CUDA ``add_`` calls (Python, ATen dispatch and
  the driver's launch path, the host work of a launch-bound call), then a synchronize.

One JSON line per round: process, round, ``ms`` (per call), and the references. Pearson's r of
``ms`` against each reference, over all rounds and over the processes' medians, at the end.

    python benchmarks/round_reference_probe.py [processes, default 2] [rounds, default 1500]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LAUNCHES = 32


def launch_us(x: torch.Tensor) -> float:
    """Best of three: host µs per ``x.add_(1)`` on a one-element CUDA tensor."""
    import torch

    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(LAUNCHES):
            x.add_(1)
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return round(best * 1e6 / LAUNCHES, 3)


def child(process: int, rounds: int) -> None:
    """One fresh process's rounds (torch is imported here: the parent only starts and reads
    them)."""
    import importlib.util

    import torch

    from pytest_opprof.capture.timing import host_reference_us

    spec = importlib.util.spec_from_file_location("conv_block", "examples/conv_block/conv_block.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, x = mod.get_model_and_input()
    model, x = model.cuda().eval(), x.cuda()
    fn = torch.compile(model)
    tiny = torch.zeros(1, device="cuda")
    with torch.no_grad():
        for _ in range(50):
            fn(x)
        torch.cuda.synchronize()
        for r in range(rounds):
            before = {"cpu_us": host_reference_us(), "launch_us": launch_us(tiny)}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(30):
                fn(x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 30
            after = {"cpu_us_after": host_reference_us(), "launch_us_after": launch_us(tiny)}
            row = {"process": process, "round": r, "ms": round(ms, 4)} | before | after
            print(json.dumps(row), flush=True)


def pearson(xs: list[float], ys: list[float]) -> float:
    try:
        return round(statistics.correlation(xs, ys), 3)
    except statistics.StatisticsError:  # a constant series
        return float("nan")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return
    processes = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    rows: list[dict[str, Any]] = []
    for p in range(processes):
        out = subprocess.run(
            [sys.executable, __file__, "child", str(p), str(rounds)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in out.splitlines():
            print(line, flush=True)
            rows.append(json.loads(line))
    ms = [r["ms"] for r in rows]
    summary: dict[str, Any] = {"rounds": len(rows)}
    for key in ("cpu_us", "launch_us", "cpu_us_after", "launch_us_after"):
        summary[f"r_{key}"] = pearson([r[key] for r in rows], ms)
    worst = [max(r["launch_us"], r["launch_us_after"]) for r in rows]
    summary["r_launch_worst"] = pearson(worst, ms)
    per = [[r for r in rows if r["process"] == p] for p in range(processes)]
    summary["process_medians"] = [
        {k: statistics.median(r[k] for r in rs) for k in ("ms", "cpu_us", "launch_us")}
        for rs in per
    ]
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
