from __future__ import annotations

import math
import statistics
from unittest import mock

import pytest

from pytest_opprof import measure
from pytest_opprof.measure import (
    Replica,
    between_processes,
    bootstrap_median_ci,
    gate_verdict,
    geometric_mean,
    latency_stats,
    pooled_timing,
    speedup,
)
from pytest_opprof.schema import Speedup, Timing


def test_latency_stats() -> None:
    s = latency_stats([1.0, 2.0, 3.0, 4.0, 100.0], calls_per_round=10)
    assert s.median_ms == 3.0 and s.min_ms == 1.0 and s.rounds == 5
    assert s.ci_low_ms <= 3.0 <= s.ci_high_ms


def test_bootstrap_is_deterministic_and_brackets_the_median() -> None:
    data = [1.0 + 0.01 * i for i in range(30)]
    assert bootstrap_median_ci(data) == bootstrap_median_ci(data)
    lo, hi = bootstrap_median_ci(data)
    assert lo < 1.145 < hi


def test_paired_speedup() -> None:
    base = [2.0, 2.1, 1.9, 2.0, 2.05]
    cand = [1.0, 1.05, 0.95, 1.0, 1.02]
    s = speedup("compile", base, "optimized", cand)
    assert s.ratio == pytest.approx(2.0)
    assert s.ci_low <= s.ratio <= s.ci_high
    with pytest.raises(ValueError):
        speedup("a", [1.0], "b", [1.0, 2.0])


@pytest.mark.parametrize(
    ("lo", "hi", "minimum", "strict", "ok"),
    [
        (0.9, 1.1, 1.0, False, True),  # straddles: noise alone never fails
        (0.8, 0.95, 1.0, False, False),  # wholly below
        (0.9, 1.1, 1.0, True, False),  # strict needs wholly above
        (1.05, 1.2, 1.0, True, True),
    ],
)
def test_gate(lo: float, hi: float, minimum: float, strict: bool, ok: bool) -> None:
    s = Speedup(
        baseline="compile", candidate="optimized", ratio=(lo + hi) / 2, ci_low=lo, ci_high=hi
    )
    verdict, why = gate_verdict(s, minimum, strict=strict)
    assert verdict is ok
    assert "compile" in why


def test_geometric_mean() -> None:
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)


# ------------------------------------------------------------------ several timing processes


def _one_process(base: list[float], cand: list[float]) -> Timing:
    from pytest_opprof.measure import latency_stats as stats

    return Timing(
        device="cuda",
        clock="cuda_event",
        variants={"compile": stats(base, 20), "optimized": stats(cand, 20)},
        speedups=[speedup("compile", base, "optimized", cand)],
    )


def test_pooled_timing_resamples_processes_and_widens_to_cover_them() -> None:
    """What the H200 showed: a host-bound baseline steady within a process (here 1.0 ms, then
    1.5 ms) while the optimized call does not move; one process's interval excludes the other
    process's ratio, the pooled interval covers both processes' ratios' middle."""
    first = _one_process([1.0, 1.01, 0.99, 1.0, 1.02, 0.98], [0.5] * 6)
    alone = first.speedups[0]
    assert alone.ci_high < 2.5  # the second process's ratio (3.0) is far outside
    replica = {"compile": [1.5, 1.51, 1.49, 1.5, 1.52, 1.48], "optimized": [0.5] * 6}
    pooled = pooled_timing(first, [Replica(replica)])
    s = pooled.speedups[0]
    assert s.process_ratios == pytest.approx([2.0, 3.0])
    assert s.ci_low <= 2.02 and s.ci_high >= 2.98
    v = pooled.variants["compile"]
    assert v.processes == 2 and v.samples_per_process == [6, 6] and v.rounds == 12
    assert v.samples_ms[6:] == replica["compile"]
    assert v.ci_low_ms <= 1.01 and v.ci_high_ms >= 1.49
    # Pooling more is order-preserving: a third process extends the groups.
    third = pooled_timing(pooled, [Replica({"compile": [1.2] * 6, "optimized": [0.5] * 6})])
    assert third.variants["compile"].samples_per_process == [6, 6, 6]
    assert third.speedups[0].process_ratios == pytest.approx([2.0, 3.0, 2.4])


def test_pooled_timing_keeps_a_pair_a_replica_timed_on_one_side_only() -> None:
    first = _one_process([1.0, 1.1, 0.9], [0.5, 0.55, 0.45])
    pooled = pooled_timing(first, [Replica({"compile": [1.0, 1.0, 1.0]})])
    assert pooled.variants["compile"].processes == 2
    assert pooled.variants["optimized"].processes == 1
    assert pooled.speedups[0] == first.speedups[0]
    assert pooled_timing(first, []) is first


def test_groups_must_split_the_samples() -> None:
    with pytest.raises(ValueError, match="do not split"):
        latency_stats([1.0, 2.0, 3.0], 10, groups=[2, 2])
    with pytest.raises(ValueError, match="do not split"):
        speedup("a", [1.0, 2.0], "b", [1.0, 2.0], groups=[1, 0, 1])
    one = speedup("a", [2.0, 2.2, 1.8], "b", [1.0, 1.0, 1.0], groups=[3])
    assert one == speedup("a", [2.0, 2.2, 1.8], "b", [1.0, 1.0, 1.0])  # one group: as before


def test_pooled_timing_keeps_each_rounds_cpu_share_and_each_process_host() -> None:
    """The per-round CPU shares pool in process order beside the samples; where one process
    did not measure them (a result from before they existed) none is kept, so a share never
    sits beside another round's sample."""
    from pytest_opprof.schema import HostWindow

    def host(busy: float) -> HostWindow:
        return HostWindow(
            seconds=0.5,
            own_cpus=2,
            own_busy=busy,
            own_steal=0.0,
            other_cpus=14,
            other_busy=1.0,
            other_steal=0.0,
        )

    base = [1.0, 1.0, 1.0]
    first = _one_process(base, [0.5] * 3)
    first = first.model_copy(
        update={
            "variants": {
                k: v.model_copy(update={"cpu_share": [1.0] * 3, "preempted": [0] * 3})
                for k, v in first.variants.items()
            },
            "host": [host(1.0)],
        }
    )
    slow = Replica(
        {"compile": [2.0] * 3, "optimized": [0.5] * 3},
        cpu_share={"compile": [0.5] * 3, "optimized": [0.99] * 3},
        preempted={"compile": [40] * 3, "optimized": [1] * 3},
        host=host(2.0),
    )
    pooled = pooled_timing(first, [slow])
    v = pooled.variants["compile"]
    assert v.cpu_share == [1.0] * 3 + [0.5] * 3 and v.preempted == [0] * 3 + [40] * 3
    assert [h.own_busy for h in pooled.host] == [1.0, 2.0]
    bare = pooled_timing(first, [Replica({"compile": [2.0] * 3, "optimized": [0.5] * 3})])
    assert bare.variants["compile"].cpu_share == [] and bare.variants["compile"].preempted == []
    assert bare.host == []


def test_slow_host_rounds_are_those_whose_reference_ran_slowed() -> None:
    """The H200 host's CPU ran its reference work at ~3 µs a call, and for seconds at a time
    nearer 6 µs: those rounds, and only those, are set aside."""
    from pytest_opprof.measure import MIN_KEPT, SLOW_HOST, slow_host_rounds

    fast = [3.0, 3.1, 2.9, 3.05, 3.0, 3.2, 2.95, 3.1, 3.0, 3.05]
    assert slow_host_rounds(fast) == []  # noise of a few percent sets nothing aside
    host = [*fast, 6.2, 5.9, 6.0, 3.0 * SLOW_HOST * 1.01, 3.0 * SLOW_HOST * 0.99]
    assert slow_host_rounds(host) == [10, 11, 12, 13]
    # Too few fast rounds to speak for the rest: the figures stand as measured.
    assert slow_host_rounds([3.0] * 3 + [6.0] * 12) == []
    assert slow_host_rounds([3.0] * (MIN_KEPT - 1) + [6.0]) == []
    assert slow_host_rounds([]) == [] and slow_host_rounds([0.0] * 8) == []


def test_rounds_set_aside_count_in_no_statistic_but_stay_in_the_samples() -> None:
    samples = [1.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    s = latency_stats(samples, calls_per_round=10, set_aside=[2, 4])
    assert s.median_ms == 1.0 and s.ci_high_ms == 1.0 and s.min_ms == 1.0
    assert s.samples_ms == samples and s.rounds == 6 and s.set_aside == [2, 4]
    # Setting every round aside would leave nothing: none is.
    assert latency_stats([1.0, 2.0], 10, set_aside=[0, 1]).set_aside == []
    r = speedup("compile", samples, "optimized", [0.5] * 6, set_aside=[2, 4])
    assert r.ratio == pytest.approx(2.0) and r.ci_low == pytest.approx(2.0)
    # A process whose every round was set aside has no ratio of its own.
    two = speedup(
        "compile", [2.0, 2.0, 1.0, 1.0], "optimized", [0.5] * 4, groups=[2, 2], set_aside=[0, 1]
    )
    assert two.ratio == pytest.approx(2.0) and two.process_ratios == []


def test_selection_judges_a_rung_without_the_rounds_of_a_slowed_host() -> None:
    """Selection's rounds are set aside like the timing pass's: a rung 2x faster in every round
    of a steady host, slower in the rounds of a slowed one, is kept on a tight interval (on a
    shared CPU such rounds gave a 6.6x fold a 0.62-22.95x interval, and selection dropped it)."""
    from pytest_opprof.measure import paired_gain

    current = [2.0, 2.02, 1.98, 2.01, 1.99, 2.03, 1.97, 2.0, 1.5, 1.4, 1.6, 1.5]
    candidate = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 3.0, 2.8, 3.1, 2.9]
    host_us = [1.2] * 8 + [2.6, 2.4, 2.5, 2.7]
    samples = {"current": current, "candidate": candidate}
    gain, cand, base = paired_gain(samples, {"current": 5, "candidate": 5}, host_us, *samples)
    assert gain.ratio == pytest.approx(2.0, rel=0.01) and gain.ci_low > 1.95
    assert cand.set_aside == [8, 9, 10, 11] and cand.median_ms == pytest.approx(1.0)
    assert cand.calls_per_round == 5
    # the plan below's latency over the same rounds: the ratio divides out of the two
    assert base.set_aside == cand.set_aside
    assert base.median_ms / cand.median_ms == pytest.approx(gain.ratio, rel=1e-12)
    # A steady host sets nothing aside: the same rounds widen the interval.
    wide, _, _ = paired_gain(samples, {"current": 5, "candidate": 5}, [1.2] * 12, *samples)
    assert wide.ci_low < 1.0


def test_pooling_sets_aside_a_slowed_processes_rounds_for_every_variant_timed_in_them() -> None:
    """What the H200 showed: one timing process's launch-bound baseline at 1.6x the others'
    while the host reference ran 1.6x slower in it; the optimized replay unmoved. The pooled
    ratio is the unslowed processes', and a variant timed in the first process only keeps its
    own rounds' verdict."""

    def one(compile_ms: float, host: float) -> Replica:
        return Replica(
            {"compile": [compile_ms] * 6, "optimized": [0.1] * 6},
            host_us=[host] * 6,
        )

    first = _one_process([0.25] * 6, [0.1] * 6)
    twin = latency_stats([0.15] * 6, 20)
    first = first.model_copy(
        update={"host_us": [3.0] * 6, "variants": {**first.variants, "twin": twin}}
    )
    pooled = pooled_timing(first, [one(0.40, 4.8), one(0.25, 3.05)])
    v = pooled.variants["compile"]
    assert v.set_aside == list(range(6, 12)) and v.samples_per_process == [6, 6, 6]
    assert v.median_ms == pytest.approx(0.25)
    s = pooled.speedups[0]
    assert s.ratio == pytest.approx(2.5) and s.ci_high == pytest.approx(2.5)
    assert s.process_ratios == pytest.approx([2.5, 2.5])
    assert pooled.variants["twin"].set_aside == [] and pooled.host_us[6] == 4.8
    # Without the references (a process from before them) nothing is set aside.
    bare = pooled_timing(first, [Replica({"compile": [0.4] * 6, "optimized": [0.1] * 6})])
    assert bare.variants["compile"].set_aside == [] and bare.host_us == []


def test_processes_kept_are_those_with_a_round_not_set_aside() -> None:
    """The processes whose every round was set aside are the ones the statistics drop: the
    pooled speedup has a ratio of its own for each process kept, and none for them."""
    from pytest_opprof.measure import processes_kept, processes_set_aside

    def one(host: float, slow_from: int = 6) -> Replica:
        host_us = [3.0] * slow_from + [host] * (6 - slow_from)
        return Replica({"compile": [0.25] * 6, "optimized": [0.1] * 6}, host_us=host_us)

    first = _one_process([0.25] * 6, [0.1] * 6).model_copy(update={"host_us": [3.0] * 6})
    twin = latency_stats([0.15] * 6, 20)  # timed in the first process only
    first = first.model_copy(update={"variants": {**first.variants, "twin": twin}})
    assert processes_kept(first) == 1 and processes_set_aside(first) == []
    whole = pooled_timing(first, [one(4.8, slow_from=0), one(3.05)])
    assert processes_set_aside(whole) == [1] and processes_kept(whole) == 2
    assert len(whole.speedups[0].process_ratios) == processes_kept(whole)
    # A process that keeps a round counts: its estimate enters the interval.
    part = pooled_timing(first, [one(4.8, slow_from=2), one(3.05)])
    assert part.variants["compile"].set_aside == [8, 9, 10, 11]
    assert processes_set_aside(part) == [] and processes_kept(part) == 3
    assert len(part.speedups[0].process_ratios) == 3
    # Set aside whole in the middle, and last: indices in pooled order.
    both = pooled_timing(first, [one(3.05), one(4.8, slow_from=0), one(4.8, slow_from=0)])
    assert processes_set_aside(both) == [2, 3] and processes_kept(both) == 2
    # Without the host references nothing is set aside: every process keeps its rounds.
    bare = pooled_timing(
        first.model_copy(update={"host_us": []}), [one(4.8, slow_from=0), one(3.05)]
    )
    assert processes_set_aside(bare) == [] and processes_kept(bare) == 3


# ------------------------------------------------------------------ the interval across processes


def test_between_processes_is_students_t_over_the_processes_logarithms() -> None:
    """Three processes at 2.46x, 2.66x and 2.78x (conv_block's, second-n7): t with two degrees
    of freedom (4.303) times their logarithms' standard error, either side of the pooled
    ratio; one process, or processes that agree, give no width."""
    ratios = [2.46, 2.66, 2.78]
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    lo, hi = between_processes(2.66, ratios)
    assert lo == pytest.approx(2.66 * math.exp(-half)) and hi == pytest.approx(
        2.66 * math.exp(half)
    )
    assert lo < 2.46 and hi > 2.78  # three processes say little about their spread
    assert between_processes(2.0, [2.0]) == (2.0, 2.0)
    assert between_processes(2.0, [2.0, 2.0, 2.0]) == pytest.approx((2.0, 2.0))
    many = between_processes(2.0, [1.9, 2.1] * 20)  # 39 degrees of freedom: near 1.96
    assert many[1] / 2.0 == pytest.approx(
        math.exp(2.024 * statistics.stdev([math.log(1.9), math.log(2.1)] * 20) / math.sqrt(40)),
        rel=1e-3,
    )


def test_several_processes_widen_the_bootstrap_where_their_ratios_disagree() -> None:
    """Three processes whose rounds are tight but whose levels differ (a host-bound baseline at
    1.0, 1.1 and 1.2 ms): the bootstrap can only redraw those three, the widened interval
    reaches past them. Processes that agree leave the bootstrap's interval as it was."""
    base = [1.0, 1.01, 0.99, 1.0, 1.1, 1.11, 1.09, 1.1, 1.2, 1.21, 1.19, 1.2]
    cand = [0.5] * 12
    s = speedup("compile", base, "optimized", cand, groups=[4, 4, 4])
    assert s.ci_low < 1.9 and s.ci_high > 2.5
    v = latency_stats(base, 10, groups=[4, 4, 4])
    assert v.ci_low_ms < 0.95 and v.ci_high_ms > 1.25
    same = [1.0, 1.02, 0.98, 1.01] * 3
    agreeing = speedup("compile", same, "optimized", cand, groups=[4, 4, 4])
    with mock.patch.object(measure, "_widened", lambda lo, hi, _e, _p: (lo, hi)):
        assert speedup("compile", same, "optimized", cand, groups=[4, 4, 4]) == agreeing
        assert speedup("compile", base, "optimized", cand, groups=[4, 4, 4]).ci_high < 2.5
