"""Probe: does a CUDA-graph replay take longer on the GPU when many are queued?

gpt2's optimized call (one CUDA graph of the whole model, backend.model_graph) came out at
0.544 ms of GPU time with the host hidden — its replays queued behind a spin kernel
(capture.timing.gpu_time) — against 0.507 ms of latency for back-to-back calls, on some hosts
and not on others; the GPU's own time cannot exceed the latency. This probe records gpt2 and
conv_block (bf16, eager) as whole-model graphs and times each replay three ways: back-to-back
calls between two events (the latency), the GPU-time pass queueing ``n`` replays behind a spin
for n = 1 … 30, and, for each n, one event pair around each replay of the queue (where in the
queue the time goes). One JSON line per model.

    python benchmarks/graph_queue_probe.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from pytest_opprof import workload
from pytest_opprof.backend.model_graph import ModelGraph
from pytest_opprof.capture import timing

DEPTHS = (1, 2, 4, 8, 16, 30)


def load(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    w = workload.load(Path(f"examples/{name}/{name}.py"), "cuda")
    model = w.model.to(torch.bfloat16)
    inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in w.inputs)
    return model, inputs


def latency_ms(fn: ModelGraph, inputs: tuple[torch.Tensor, ...], calls: int = 30) -> float:
    rounds = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(*inputs)
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / calls)
    return statistics.median(rounds)


def each_in_queue(fn: ModelGraph, inputs: tuple[torch.Tensor, ...], n: int) -> list[float]:
    """Queue ``n`` replays behind a spin long enough to hide the host, an event pair around
    each: each replay's own GPU time, in queue order (median of 5 queues)."""
    per: list[list[float]] = [[] for _ in range(n)]
    for _ in range(5):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        torch.cuda.synchronize()
        torch.cuda._sleep(int((2.0 * n + 5.0) * timing._sleep_cycles_per_ms()))
        for start, end in events:
            start.record()
            fn(*inputs)
            end.record()
        events[-1][1].synchronize()
        for i, (start, end) in enumerate(events):
            per[i].append(start.elapsed_time(end))
    return [round(statistics.median(p), 4) for p in per]


def main() -> int:
    with torch.no_grad():
        for name in ("gpt2", "conv_block"):
            model, inputs = load(name)
            fn = ModelGraph(model)
            for _ in range(20):
                fn(*inputs)
            torch.cuda.synchronize()
            row: dict[str, object] = {"model": name, "latency_ms": round(latency_ms(fn, inputs), 4)}
            gpu = {}
            for n in DEPTHS:
                got = timing.gpu_time_of(fn, inputs, n, 5, None)
                gpu[n] = round(got, 4) if got is not None else None
            row["gpu_time_ms_by_depth"] = gpu
            row["each_in_queue_ms"] = {n: each_in_queue(fn, inputs, n) for n in (8, 30)}
            row["latency_ms_after"] = round(latency_ms(fn, inputs), 4)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
