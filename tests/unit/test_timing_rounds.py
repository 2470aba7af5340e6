"""The timing pass's rounds: as many calls as asked, fewer for a callable slow enough that a
round of its calls would outlast ``ROUND_SECONDS`` (a 6 ms baseline on the H200, a 100 ms call
on the CPU fallback), each callable sized by its own first call."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_opprof.capture import timing
from pytest_opprof.capture.system import cpu_times, host_window
from pytest_opprof.measure import Replica
from pytest_opprof.schema import HostWindow


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


@pytest.fixture
def steady_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that never slows: exactly the rounds asked for (a shared CI machine's reference
    does slow at times, and each slowed round earns one more)."""
    monkeypatch.setattr(timing, "host_reference_us", lambda *a: 1.0)


@pytest.mark.usefixtures("steady_host")
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


@pytest.mark.usefixtures("steady_host")
def test_the_rounds_stop_once_enough_says_they_settle_it() -> None:
    """Selection stops timing a rung that ran over twice as slow in each of its first rounds
    (``selection.over_twice_as_slow``): asked after every round, here with the real rule."""
    from pytest_opprof.backend.selection import EARLY_ROUNDS, over_twice_as_slow

    def current(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.001)
        return x

    def candidate(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.008)  # 8x: a busy CI machine's late wake-ups stay far from 2x
        return x

    def run(calls: dict[str, timing.Call]) -> timing.RoundSamples:
        return timing.time_interleaved(
            calls,
            (torch.zeros(2),),
            device="cpu",
            warmup=1,
            calls_per_round=3,
            rounds=7,
            warmup_seconds=0.0,
            enough=over_twice_as_slow,
        )

    slow = run({"current": current, "candidate": candidate})
    assert {k: len(v) for k, v in slow.items()} == {"current": 3, "candidate": 3}
    assert EARLY_ROUNDS == 3
    even = run({"current": current, "candidate": current})  # never twice as slow: all rounds
    assert {k: len(v) for k, v in even.items()} == {"current": 7, "candidate": 7}


def test_the_warmup_lasts_tens_of_milliseconds_not_half_a_second() -> None:
    """The GPU's clock is up within a millisecond of work (benchmarks/probes/clock_ramp_probe.py):
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


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.usefixtures("steady_host")
def test_each_round_records_how_much_of_it_the_launching_thread_had_its_cpu() -> None:
    """A call that keeps the CPU (a launch, a spin-wait on the GPU) has a share near 1; one whose
    thread is off its CPU for most of the round (here asleep; on a host, preempted by another
    task or the hypervisor) has a share well under it. The host window covers the rounds."""

    def busy(x: torch.Tensor) -> torch.Tensor:
        _spin(0.002)
        return x

    def away(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return x

    samples = timing.time_interleaved(
        {"busy": busy, "away": away},
        (torch.zeros(2),),
        device="cpu",
        warmup=1,
        calls_per_round=5,
        rounds=4,
        warmup_seconds=0.0,
    )
    assert {k: len(v) for k, v in samples.cpu_share.items()} == {"busy": 4, "away": 4}
    assert {k: len(v) for k, v in samples.preempted.items()} == {"busy": 4, "away": 4}
    # Two shared CI cores: the busy call can lose half its CPU to the other test worker, so
    # its share is compared with the sleeping call's, which stays near 0 whatever the load.
    assert max(samples.cpu_share["away"]) < 0.3
    assert statistics.median(samples.cpu_share["busy"]) > max(
        0.4, 3 * max(samples.cpu_share["away"])
    )
    assert all(n >= 0 for v in samples.preempted.values() for n in v)
    if Path("/proc/stat").exists():
        host = samples.host
        assert host is not None and host.seconds > 0.05
        assert host.own_cpus + host.other_cpus == len(cpu_times() or {})
        assert host.own_busy >= 0 and host.other_busy >= 0


def test_a_timing_process_result_round_trips_to_its_parent() -> None:
    samples = timing.RoundSamples(
        {"compile": [], "optimized": []}, {"compile": 30, "optimized": 30}
    )
    for ms, share in ((0.25, 0.99), (0.45, 0.52)):
        samples.add("compile", timing.Round(ms, share, 3))
        samples.add("optimized", timing.Round(0.1, 1.0, 0))
    samples.host = HostWindow(
        seconds=0.5,
        own_cpus=2,
        own_busy=1.9,
        own_steal=0.0,
        other_cpus=14,
        other_busy=3.2,
        other_steal=0.1,
    )
    replica = Replica.from_json(json.loads(json.dumps(samples.to_json())))
    assert replica.samples == {"compile": [0.25, 0.45], "optimized": [0.1, 0.1]}
    assert replica.cpu_share["compile"] == [0.99, 0.52]
    assert replica.preempted == {"compile": [3, 3], "optimized": [0, 0]}
    assert replica.host == samples.host
    # A result from before the CPU shares (or a fake timing process) still pools.
    assert Replica.from_json({"samples": {"compile": [1.0]}}).cpu_share == {}
    bad: Any  # results of the wrong shape, as a broken process may write
    for bad in ({}, {"samples": [1.0]}, {"samples": {"a": [1.0]}, "host": {"seconds": "x"}}, []):
        with pytest.raises(ValueError, match="not a timing process's result"):
            Replica.from_json(bad)


def test_host_window_splits_the_hosts_cpus_into_the_processes_own_and_the_others() -> None:
    own = sorted(os.sched_getaffinity(0))
    other = max(own) + 1
    before = {c: (10.0, 1.0) for c in [*own, other]}
    after = {**{c: (10.5, 1.0) for c in own}, other: (11.0, 1.25)}
    w = host_window(before, after, 0.5)
    assert w is not None
    assert (w.own_cpus, w.other_cpus) == (len(own), 1)
    assert w.own_busy == pytest.approx(len(own) * 1.0)  # each own CPU busy all along
    assert (w.other_busy, w.other_steal, w.own_steal) == (pytest.approx(2.0), 0.5, 0.0)
    assert host_window(None, after, 0.5) is None and host_window(before, after, 0.0) is None


def _time_one(rounds: int) -> timing.RoundSamples:
    """A trivial callable timed on the CPU: two calls a round, no warmup time."""
    return timing.time_interleaved(
        {"f": lambda x: x + 1},
        (torch.zeros(2),),
        device="cpu",
        warmup=1,
        calls_per_round=2,
        rounds=rounds,
        warmup_seconds=0.0,
    )


def test_every_round_starts_with_the_host_reference() -> None:
    assert 0 < timing.host_reference_us() < 1000.0
    samples = _time_one(rounds=5)
    # five rounds, and one more for each a slowed host ran (a shared CI machine slows too)
    assert 5 <= len(samples.host_us) == len(samples["f"]) <= 10
    assert all(x > 0 for x in samples.host_us)
    assert Replica.from_json(samples.to_json()).host_us == samples.host_us


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_fast_cpu_moves_the_thread_to_one_cpu_and_gives_its_own_back() -> None:
    home = os.sched_getaffinity(0)
    cpu = timing.FastCpu(any_cpu=True)
    assert set(cpu.cpus) >= home and len(cpu.cpus) == max(os.cpu_count() or 0, len(home))
    try:
        us = cpu.move()
        if len(cpu.cpus) > 1:
            assert 0 < us < math.inf
            assert len(os.sched_getaffinity(0)) == 1
            assert os.sched_getaffinity(0) <= set(cpu.cpus)
    finally:
        cpu.restore()
    assert os.sched_getaffinity(0) == home
    assert timing.FastCpu(any_cpu=False).cpus == sorted(home)


def test_a_round_on_a_slowed_host_earns_one_more_round_at_most_as_many_as_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host reference at 1.2 µs, slowed to 2.5 µs in two rounds: two more rounds are timed
    after the four planned, every round with its reference; a host slowed throughout adds no
    more than the rounds planned."""
    refs = iter([1.2, 2.5, 2.5, 1.2, 1.2, 1.2, 9.9])
    monkeypatch.setattr(timing, "host_reference_us", lambda *a: next(refs))

    samples = _time_one(rounds=4)
    assert samples.host_us == [1.2, 2.5, 2.5, 1.2, 1.2, 1.2] and len(samples["f"]) == 6
    refs = iter([1.0] + [5.0] * 20)
    assert len(_time_one(rounds=4)["f"]) == 4 + 4  # slowed from the second on: capped at 4 more


def test_a_slowed_round_moves_the_thread_and_is_timed_at_the_new_cpus_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path, with a CPU that can be moved: slowed at the second round's start, the
    thread moves, the reference is taken anew on the fast CPU, and that round is neither
    recorded as slowed nor repeated; where the move finds no faster CPU the round counts as
    slowed and earns one more."""
    moves: list[str] = []

    class Movable:
        def __init__(self, speeds: list[float]) -> None:
            self.speeds = iter(speeds)

        def move(self) -> float:
            moves.append("move")
            return next(self.speeds)

        def restore(self) -> None:
            moves.append("restore")

    def run(refs: list[float], speeds: list[float]) -> timing.RoundSamples:
        moves.clear()
        it = iter(refs)
        monkeypatch.setattr(timing, "host_reference_us", lambda *a: next(it))
        monkeypatch.setattr(timing, "_launching_cpu", lambda device, any_cpu: Movable(speeds))
        return _time_one(rounds=3)

    samples = run([1.2, 2.5, 1.25, 1.2], [1.2, 1.2])
    assert samples.host_us == [1.2, 1.25, 1.2] and len(samples["f"]) == 3
    assert moves == ["move", "move", "restore"]
    # Every CPU slowed: the round stays slowed and one more is timed.
    samples = run([1.2, 2.5, 2.5, 1.2, 1.2], [1.2, 2.4])
    assert samples.host_us == [1.2, 2.5, 1.2, 1.2] and len(samples["f"]) == 4


def test_where_threads_cannot_be_pinned_nothing_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing, "_CAN_PIN", False)
    cpu = timing.FastCpu(any_cpu=True)
    assert cpu.cpus == [] and cpu.move() == math.inf
    cpu.restore()


class _Cache:
    """A cache that one program's data fills: its first call of a round runs slow where the
    cache holds another's (as a GPU's L2 does after another model's round)."""

    def __init__(self) -> None:
        self.holds: str | None = None
        self.flushes = 0

    def program(self, name: str, cold_s: float, warm_s: float) -> timing.Call:
        def call(x: torch.Tensor) -> torch.Tensor:
            time.sleep(cold_s if self.holds != name else warm_s)
            self.holds = name
            return x

        return call

    def flush(self) -> None:
        self.flushes += 1
        self.holds = None


def _same_program_twice(cache: _Cache, flush: timing.Call | None) -> timing.RoundSamples:
    """The stock recipe shipped: one program timed under two names, after another program."""
    model = cache.program("model", 0.008, 0.001)
    calls = {"compile": cache.program("other", 0.001, 0.001), "optimized": model, "stock": model}
    return timing.time_interleaved(
        calls,
        (torch.zeros(2),),
        device="cpu",
        warmup=1,
        calls_per_round=2,
        rounds=5,
        warmup_seconds=0.0,
        flush=flush,
    )


@pytest.mark.usefixtures("steady_host")
def test_every_callables_round_starts_from_the_flush_not_from_the_last_ones_cache() -> None:
    """Unflushed, the program's second name inherits the cache its first name filled and
    measures several times faster than itself; flushed before every round, the two names
    measure alike."""
    warm = _same_program_twice(_Cache(), flush=None)
    ratio = statistics.median(warm["optimized"]) / statistics.median(warm["stock"])
    assert ratio > 2.0  # (8 + 1) / 2 ms against 1 ms a call

    cache = _Cache()
    flushed = _same_program_twice(cache, flush=cache.flush)
    ratio = statistics.median(flushed["optimized"]) / statistics.median(flushed["stock"])
    assert 0.7 < ratio < 1.4
    assert cache.flushes == 3 * 5  # each callable's round, none for the warmup or sizing


def test_the_l2_flush_is_the_gpus_only() -> None:
    assert timing.l2_flush("cpu") is None
