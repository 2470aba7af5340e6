"""The timing pass's rounds: as many calls as asked, fewer for a callable slow enough that a
round of them would outlast ``ROUND_SECONDS`` (a 100 ms call on the CPU fallback)."""

from __future__ import annotations

import time

import torch

from pytest_opprof.capture import timing


def test_calls_per_round_stay_as_asked_for_short_calls() -> None:
    assert timing.calls_for(0.05, 30) == 30  # a CUDA-graph replay
    assert timing.calls_for(6.5, 30) == 30  # the slowest H200 example: 195 ms a round
    assert timing.calls_for(0.0, 30) == 30


def test_a_slow_call_gets_fewer_calls_never_under_the_minimum() -> None:
    assert timing.calls_for(20.0, 30) == 13  # 250 ms / 20 ms, rounded up
    assert timing.calls_for(105.0, 30) == timing.MIN_CALLS  # conv_block on two CPU cores
    assert timing.calls_for(105.0, 2) == 2  # never more than asked
    assert timing.calls_for(20.0, 30, round_seconds=1.0) == 30


def test_interleaved_rounds_are_sized_by_the_slowest_callable() -> None:
    made = {"fast": 0, "slow": 0}

    def fast(x: torch.Tensor) -> torch.Tensor:
        made["fast"] += 1
        return x + 1

    def slow(x: torch.Tensor) -> torch.Tensor:
        made["slow"] += 1
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
    assert samples.calls_per_round == timing.MIN_CALLS  # ceil(10 / ~4 ms) is under it
    assert {k: len(v) for k, v in samples.items()} == {"fast": 3, "slow": 3}
    # warmup (1) + sizing (1) + three rounds of the same count, for both: still paired
    assert made["fast"] == made["slow"] == 2 + 3 * timing.MIN_CALLS
    assert min(samples["slow"]) >= 4.0  # milliseconds per call, not per round
