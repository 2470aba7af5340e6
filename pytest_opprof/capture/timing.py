"""The timing pass: no profiler attached, rounds of back-to-back calls, interleaved.

Callables are timed A B C A B C … so every round of each sees the same machine state; on CUDA
with events around each round, on the CPU with ``time.perf_counter``. Each round's input is a
fresh random tensor of the workload's shape, made before the round starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pytest_opprof.workload import fresh_inputs

Call = Callable[..., Any]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    calls: Mapping[str, Call],
    template: tuple[torch.Tensor, ...],
    *,
    device: str,
    warmup: int,
    calls_per_round: int,
    rounds: int,
    seed: int = 1000,
    warmup_seconds: float = 0.5,
) -> dict[str, list[float]]:
    """Per-call milliseconds of each callable, one sample per round.

    Warmup runs at least ``warmup`` calls of each and at least ``warmup_seconds`` in all: an
    idle GPU starts at a low clock (an H200 read 345 MHz idle) and the first rounds of a short
    workload otherwise measure the clock ramp, not the code.
    """
    with torch.no_grad():
        warm = fresh_inputs(template, seed)
        deadline = time.perf_counter() + warmup_seconds
        first = True
        while first or time.perf_counter() < deadline:
            for fn in calls.values():
                for _ in range(warmup):
                    fn(*warm)
            synchronize(device)
            first = False
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(rounds):
            inputs = fresh_inputs(template, seed + 1 + r)
            for name, fn in calls.items():
                samples[name].append(_one_round(fn, inputs, device, calls_per_round))
    return samples


def _one_round(fn: Call, inputs: Sequence[torch.Tensor], device: str, n: int) -> float:
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn(*inputs)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*inputs)
    return (time.perf_counter() - t0) * 1000.0 / n
