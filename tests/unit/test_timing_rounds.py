"""The timing pass's rounds: as many calls as asked, fewer for a callable slow enough that a
round of its calls would outlast ``ROUND_SECONDS`` (a 6 ms baseline on the H200, a 100 ms call
on the CPU fallback), each callable sized by its own first call."""

from __future__ import annotations

import time

import torch

from pytest_opprof.capture import timing


def test_calls_per_round_stay_as_asked_for_short_calls() -> None:
    assert timing.calls_for(0.05, 30) == 30  # a CUDA-graph replay
    assert timing.calls_for(1.6, 30) == 30  # 48 ms a round
    assert timing.calls_for(0.0, 30) == 30


def test_a_slow_call_gets_fewer_calls_never_under_the_minimum() -> None:
    assert timing.calls_for(6.5, 30) == 8  # the slowest H200 example: 50 ms / 6.5 ms, rounded up
    assert timing.calls_for(20.0, 30, round_seconds=0.25) == 13
    assert timing.calls_for(105.0, 30) == timing.MIN_CALLS  # conv_block on two CPU cores
    assert timing.calls_for(105.0, 2) == 2  # never more than asked
    assert timing.calls_for(20.0, 30, round_seconds=1.0) == 30


def test_each_callable_gets_its_own_calls_per_round_and_rounds_stay_paired() -> None:
    made = {"fast": 0, "slow": 0}
    order: list[str] = []

    def fast(x: torch.Tensor) -> torch.Tensor:
        made["fast"] += 1
        order.append("fast")
        return x + 1

    def slow(x: torch.Tensor) -> torch.Tensor:
        made["slow"] += 1
        order.append("slow")
        time.sleep(0.004)
        return x + 1

    template = (torch.zeros(2),)
    samples = timing.time_interleaved(
        {"fast": fast, "slow": slow},
        template,
        device="cpu",
        warmup=1,
        calls_per_round=30,
        rounds=3,
        warmup_seconds=0.0,
        round_seconds=0.01,
    )
    # ceil(10 ms / ~4 ms) is under the minimum; the fast one keeps the 30 asked for
    assert samples.calls == {"fast": 30, "slow": timing.MIN_CALLS}
    assert {k: len(v) for k, v in samples.items()} == {"fast": 3, "slow": 3}
    # warmup (1) + sizing (1) + three rounds
    assert made == {"fast": 2 + 3 * 30, "slow": 2 + 3 * timing.MIN_CALLS}
    # round by round, one callable's calls after the other's: A A … B B B, A A … B B B
    timed = order[4:]
    one_round = ["fast"] * 30 + ["slow"] * timing.MIN_CALLS
    assert timed == one_round * 3
    assert min(samples["slow"]) >= 4.0  # milliseconds per call, not per round


def test_the_warmup_lasts_tens_of_milliseconds_not_half_a_second() -> None:
    """The GPU's clock is up within a millisecond of work (benchmarks/clock_ramp_probe.py):
    past its warmup calls, the warmup stops after 50 ms, where it ran 0.5 s before."""
    made = [0]

    def call(x: torch.Tensor) -> torch.Tensor:
        made[0] += 1
        time.sleep(0.001)
        return x

    t0 = time.perf_counter()
    timing.time_interleaved(
        {"f": call}, (torch.zeros(2),), device="cpu", warmup=1, calls_per_round=1, rounds=1
    )
    assert time.perf_counter() - t0 < 0.3
    assert made[0] >= 10  # warm for ~50 ms: tens of 1 ms calls, not the one asked for
