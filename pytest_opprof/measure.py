"""Statistics of the timing pass: medians, bootstrap confidence intervals, speedup ratios.

Pure Python (the pipeline's numbers must be checkable without torch). The bootstrap uses a
fixed seed so the same samples always give the same interval.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pytest_opprof.schema import HostWindow, LatencyStats, Speedup, Timing

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_median_ci(
    samples: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median."""
    if len(samples) < 2:
        only = float(samples[0])
        return only, only
    rng = random.Random(seed)
    n = len(samples)
    medians = sorted(statistics.median(rng.choices(samples, k=n)) for _ in range(resamples))
    alpha = (1 - CONFIDENCE) / 2
    return _percentile(medians, alpha), _percentile(medians, 1 - alpha)


def split_processes(samples: Sequence[float], groups: Sequence[int] | None) -> list[list[float]]:
    """``samples`` cut into its processes' runs of rounds (``groups``: rounds per process)."""
    if not groups:
        return [list(samples)]
    if sum(groups) != len(samples) or any(g < 1 for g in groups):
        raise ValueError(f"{len(samples)} samples do not split into processes of {list(groups)}")
    out, at = [], 0
    for g in groups:
        out.append(list(samples[at : at + g]))
        at += g
    return out


def _resample_indices(rng: random.Random, blocks: list[list[int]]) -> list[int]:
    """One hierarchical resample: processes drawn with replacement, then rounds within each.
    With one process it is the plain bootstrap over rounds."""
    chosen = rng.choices(blocks, k=len(blocks)) if len(blocks) > 1 else blocks
    return [i for block in chosen for i in rng.choices(block, k=len(block))]


T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
"""Student's t, two-sided 95%, for 1 to 30 degrees of freedom (beyond: the normal quantile
with its first two corrections in ``1 / df``, within 0.01% there)."""


def _t_975(df: int) -> float:
    if df < 1:
        raise ValueError("no degrees of freedom")
    return T_975[df - 1] if df <= len(T_975) else 1.96 + 2.372 / df + 2.823 / df**2


def between_processes(estimate: float, per_process: Sequence[float]) -> tuple[float, float]:
    """The 95% interval that several timing processes' own estimates give ``estimate`` (the
    pooled one): Student's t over their logarithms with one degree of freedom fewer than
    processes, centred on ``estimate``. Each process's estimate already carries its own
    rounds' noise, so their spread is the pooled estimate's whole uncertainty, and t allows
    for how little a few processes say about that spread.

    The hierarchical bootstrap alone is too sure of itself with three processes: it can only
    redraw those three, so its interval hardly reaches past the outermost; this one covers a
    retiming a minute later where the bootstrap's did not
    (docs/reproducibility.md#run-by-run)."""
    logs = [math.log(x) for x in per_process if x > 0]
    if len(logs) < 2 or estimate <= 0:
        return estimate, estimate
    half = _t_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return estimate * math.exp(-half), estimate * math.exp(half)


def _widened(
    lo: float, hi: float, estimate: float, per_process: Sequence[float]
) -> tuple[float, float]:
    """The bootstrap's interval ``lo``-``hi``, widened to :func:`between_processes`'s where
    that reaches further (several processes; one process: as it is)."""
    if len(per_process) < 2:
        return lo, hi
    low, high = between_processes(estimate, per_process)
    return min(lo, low), max(hi, high)


def _blocks(groups: Sequence[int] | None, n: int) -> list[list[int]]:
    sizes = list(groups) if groups else [n]
    out, at = [], 0
    for g in sizes:
        out.append(list(range(at, at + g)))
        at += g
    return out


SLOW_HOST = 1.25
"""A round whose host reference (``capture.timing.host_reference_us``) took this many times
the host's fast rounds' (their 10th percentile) ran on a slowed host; the timing pass moves to
a faster CPU past it (``capture.timing.time_interleaved``)."""
MIN_KEPT = 5
"""Rounds never set aside below this many, nor below a quarter of them: a host slowed for most
of a measurement has no fast rounds to speak for it, and its figures stand as measured."""


def slow_host_rounds(host_us: Sequence[float]) -> list[int]:
    """The rounds (indices) that ran while the host's CPU was slowed: their reference work
    took more than :data:`SLOW_HOST` times what the fast rounds' did. Empty where too few
    rounds would be left (:data:`MIN_KEPT`). On a shared host a launch-bound call runs at the
    speed of the CPU that launches it, and that speed moved by up to 2x for seconds at a time
    with the timing thread on its CPU throughout; such rounds are set aside alike for every
    callable timed in them (the rounds stay paired)."""
    n = len(host_us)
    if n < MIN_KEPT or min(host_us) <= 0:
        return []
    fast = _percentile(sorted(host_us), 0.1)
    slow = [i for i, x in enumerate(host_us) if x > SLOW_HOST * fast]
    if n - len(slow) < max(MIN_KEPT, math.ceil(n / 4)):
        return []
    return slow


def _kept(
    samples: Sequence[float], groups: Sequence[int] | None, set_aside: Sequence[int]
) -> tuple[list[float], list[int] | None]:
    """The samples not set aside, and the rounds each process keeps (processes that keep
    none dropped)."""
    if not set_aside:
        return list(samples), list(groups) if groups else None
    out = set(set_aside)
    blocks = _blocks(groups, len(samples))
    kept_blocks = [[i for i in block if i not in out] for block in blocks]
    kept = [samples[i] for block in kept_blocks for i in block]
    sizes = [len(b) for b in kept_blocks if b]
    return kept, sizes if groups else None


def processes_set_aside(timing: Timing) -> list[int]:
    """The timing processes (indices in pooled order) whose every round was set aside: exactly
    the processes :func:`_kept` drops, from which no statistic, and no process's own estimate
    in :func:`between_processes`, comes. Read in the variant timed in the most processes;
    every variant timed in all of them shares its set-aside rounds (:func:`pooled_timing`)."""
    if not timing.variants:
        return []
    fullest = max(timing.variants.values(), key=lambda v: v.processes)
    aside = set(fullest.set_aside)
    blocks = _blocks(fullest.samples_per_process or None, len(fullest.samples_ms))
    return [p for p, block in enumerate(blocks) if aside.issuperset(block)]


def processes_kept(timing: Timing) -> int:
    """How many timing processes keep rounds after the set-aside: those whose own estimates
    give the pooled interval its degrees of freedom (:func:`between_processes`). A process
    that keeps even a few rounds counts, as in the statistics: those rounds ran on a fast
    host, where a call's speed is steady within a process, so they give its level."""
    processes = max((v.processes for v in timing.variants.values()), default=0)
    return processes - len(processes_set_aside(timing))


def latency_stats(
    samples_ms: Sequence[float],
    calls_per_round: int,
    groups: Sequence[int] | None = None,
    *,
    cpu_share: Sequence[float] = (),
    preempted: Sequence[int] = (),
    set_aside: Sequence[int] = (),
) -> LatencyStats:
    """Summarise per-call times, one sample per round; ``groups`` gives the rounds of each
    timing process when there were several (the interval then resamples processes too, and
    reaches at least as far as the processes' own medians allow: :func:`between_processes`).
    ``cpu_share`` and ``preempted``, per round where measured, are kept beside the samples.
    The rounds in ``set_aside`` (on a slowed host: :func:`slow_host_rounds`) stay in
    ``samples_ms`` but count in none of the statistics."""
    if not samples_ms:
        raise ValueError("no timing samples")
    split_processes(samples_ms, groups)  # checks the split
    n = len(samples_ms)
    all_ms, all_groups = samples_ms, groups
    set_aside = sorted({i for i in set_aside if 0 <= i < n})
    if len(set_aside) >= n:
        set_aside = []
    samples_ms, groups = _kept(all_ms, all_groups, set_aside)
    if groups and len(groups) > 1:
        rng = random.Random(0)
        blocks = _blocks(groups, len(samples_ms))
        medians = sorted(
            statistics.median(samples_ms[i] for i in _resample_indices(rng, blocks))
            for _ in range(BOOTSTRAP_RESAMPLES)
        )
        alpha = (1 - CONFIDENCE) / 2
        lo, hi = _percentile(medians, alpha), _percentile(medians, 1 - alpha)
        per_process = [statistics.median(p) for p in split_processes(samples_ms, groups)]
        lo, hi = _widened(lo, hi, statistics.median(samples_ms), per_process)
    else:
        lo, hi = bootstrap_median_ci(samples_ms)
    return LatencyStats(
        median_ms=statistics.median(samples_ms),
        ci_low_ms=lo,
        ci_high_ms=hi,
        mean_ms=statistics.fmean(samples_ms),
        stdev_ms=statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0,
        min_ms=min(samples_ms),
        rounds=n,
        calls_per_round=calls_per_round,
        samples_ms=[float(s) for s in all_ms],
        processes=len(all_groups) if all_groups else 1,
        samples_per_process=list(all_groups) if all_groups and len(all_groups) > 1 else [],
        cpu_share=[float(x) for x in cpu_share] if len(cpu_share) == n else [],
        preempted=[int(x) for x in preempted] if len(preempted) == n else [],
        set_aside=set_aside,
    )


def speedup(
    baseline_name: str,
    baseline: Sequence[float],
    candidate_name: str,
    candidate: Sequence[float],
    *,
    groups: Sequence[int] | None = None,
    set_aside: Sequence[int] = (),
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians ``baseline / candidate`` with a paired bootstrap interval.

    Rounds were interleaved (A B A B …), so round ``i`` of both saw the same machine state; the
    bootstrap resamples round indices, keeping the pairs, which is what makes the interval
    honest about drift (clock changes hit both sides of a pair). With ``groups`` (rounds per
    timing process, several processes) it resamples processes first and rounds within each:
    a host-bound baseline's speed moves between processes more than between rounds of one, and
    an interval from one process's rounds would not cover the next run. The interval is then
    widened to what the processes' own ratios allow (:func:`between_processes`), where that
    reaches further. The rounds in ``set_aside`` (a slowed host) count on neither side.
    """
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("speedup needs the same, non-zero number of rounds on both sides")
    if set_aside and len(set(set_aside)) < len(baseline):
        baseline, kept_groups = _kept(baseline, groups, set_aside)
        candidate, _ = _kept(candidate, groups, set_aside)
        groups = kept_groups
    ratio = statistics.median(baseline) / statistics.median(candidate)
    parts = list(
        zip(split_processes(baseline, groups), split_processes(candidate, groups), strict=True)
    )
    per_process = (
        [statistics.median(b) / statistics.median(c) for b, c in parts] if len(parts) > 1 else []
    )
    n = len(baseline)
    if n < 2:
        return Speedup(
            baseline=baseline_name,
            candidate=candidate_name,
            ratio=ratio,
            ci_low=ratio,
            ci_high=ratio,
        )
    rng = random.Random(seed)
    blocks = _blocks(groups, n)
    ratios = []
    for _ in range(resamples):
        idx = _resample_indices(rng, blocks)
        b = statistics.median(baseline[i] for i in idx)
        c = statistics.median(candidate[i] for i in idx)
        ratios.append(b / c)
    ratios.sort()
    alpha = (1 - CONFIDENCE) / 2
    lo, hi = _widened(
        _percentile(ratios, alpha), _percentile(ratios, 1 - alpha), ratio, per_process
    )
    return Speedup(
        baseline=baseline_name,
        candidate=candidate_name,
        ratio=ratio,
        ci_low=lo,
        ci_high=hi,
        process_ratios=per_process,
    )


def paired_gain(
    samples: Mapping[str, Sequence[float]],
    calls: Mapping[str, int],
    host_us: Sequence[float],
    baseline: str,
    candidate: str,
) -> tuple[Speedup, LatencyStats, LatencyStats]:
    """Selection's verdict on one rung: ``candidate`` against ``baseline`` (the plan below it)
    over the same interleaved rounds, then the candidate's latency and the baseline's in those
    rounds (the one's median over the other's is the ratio); the rounds whose host reference
    says the host was slowed count on neither side, as in the timing pass."""
    aside = slow_host_rounds(host_us)
    gain = speedup(baseline, samples[baseline], candidate, samples[candidate], set_aside=aside)
    return (
        gain,
        latency_stats(samples[candidate], calls[candidate], set_aside=aside),
        latency_stats(samples[baseline], calls[baseline], set_aside=aside),
    )


@dataclass(frozen=True)
class Replica:
    """What one more timing process measured: per variant its samples, and per round its
    launching thread's CPU share and preemptions; per round the host reference; the host's
    CPUs while it timed."""

    samples: Mapping[str, Sequence[float]]
    cpu_share: Mapping[str, Sequence[float]] = field(default_factory=dict)
    preempted: Mapping[str, Sequence[int]] = field(default_factory=dict)
    host_us: Sequence[float] = ()
    host: HostWindow | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Replica:
        """A timing process's result (``RoundSamples.to_json``); ValueError where malformed."""
        try:
            host = data.get("host")
            return cls(
                samples={k: [float(x) for x in v] for k, v in data["samples"].items()},
                cpu_share={k: [float(x) for x in v] for k, v in data.get("cpu_share", {}).items()},
                preempted={k: [int(x) for x in v] for k, v in data.get("preempted", {}).items()},
                host_us=[float(x) for x in data.get("host_us", [])],
                host=HostWindow.model_validate(host) if host else None,
            )
        except (KeyError, TypeError, AttributeError, ValidationError) as exc:
            raise ValueError(f"not a timing process's result: {exc}") from None


def pooled_timing(timing: Timing, replicas: Sequence[Replica]) -> Timing:
    """``timing`` (one process's) with the samples of more timing processes added: each
    variant's samples pooled in process order, its statistics and every speedup recomputed
    across processes. A replica lacking a variant adds nothing to it (or to its pairs). The
    per-round CPU shares and host references pool where every process measured them; the
    host windows follow the processes' order. Rounds on a slowed host are found over all the
    processes' rounds (:func:`slow_host_rounds`) and set aside alike for every variant timed
    in them."""
    if not replicas:
        return timing

    def joined(mine: Sequence[Any], theirs: list[Sequence[Any] | None]) -> list[Any]:
        parts = [mine, *theirs]
        return [x for p in parts for x in p or ()] if all(parts) else []

    runs, groups = {}, {}
    for name, stats in timing.variants.items():
        own = split_processes(stats.samples_ms, stats.samples_per_process or None)
        timed = [r for r in replicas if r.samples.get(name)]
        runs[name] = (timed, [*own, *(list(r.samples[name]) for r in timed)])
        groups[name] = [len(run) for run in runs[name][1]]
    full = max(groups.values(), key=len)
    host_us = joined(timing.host_us, [r.host_us for r in replicas])
    if len(host_us) != sum(full):  # not one reference per round: none
        host_us = []
    slow = slow_host_rounds(host_us)
    variants = {}
    for name, stats in timing.variants.items():
        timed, parts = runs[name]
        mine = groups[name]
        # timed in every process, or in the first ones only: the same rounds as host_us's
        same_rounds = mine == full[: len(mine)]
        aside = [i for i in slow if i < sum(mine)] if same_rounds else []
        variants[name] = latency_stats(
            [x for run in parts for x in run],
            stats.calls_per_round,
            mine,
            cpu_share=joined(stats.cpu_share, [r.cpu_share.get(name) for r in timed]),
            preempted=joined(stats.preempted, [r.preempted.get(name) for r in timed]),
            set_aside=aside,
        )
    speedups = []
    for s in timing.speedups:
        a, b = variants[s.baseline], variants[s.candidate]
        if groups[s.baseline] != groups[s.candidate]:  # a replica timed one side only
            speedups.append(s)
            continue
        speedups.append(
            speedup(
                s.baseline,
                a.samples_ms,
                s.candidate,
                b.samples_ms,
                groups=groups[s.baseline],
                set_aside=a.set_aside,
            )
        )
    theirs = [r.host for r in replicas]
    hosts = [*timing.host, *theirs] if timing.host and None not in theirs else []
    return timing.model_copy(
        update={"variants": variants, "speedups": speedups, "host": hosts, "host_us": host_us}
    )


@dataclass(frozen=True)
class RunRounds:
    """One run's rounds of one figure, for a comparison between runs: one series (a latency:
    its median) or two timed interleaved (a speedup: the first's median over the second's),
    with the rounds of each timing process (``groups``) and the rounds set aside."""

    series: tuple[Sequence[float], ...]
    groups: Sequence[int] | None = None
    set_aside: Sequence[int] = ()

    def kept(self) -> tuple[list[list[float]], list[int] | None]:
        n = len(self.series[0])
        if not n or any(len(s) != n for s in self.series):
            raise ValueError("a run's series need the same, non-zero number of rounds")
        aside = self.set_aside if len(set(self.set_aside)) < n else ()
        parts = [_kept(s, self.groups, aside) for s in self.series]
        return [p[0] for p in parts], parts[0][1]


def _figure_of(series: Sequence[Sequence[float]], idx: Sequence[int] | None = None) -> float:
    picked = [s if idx is None else [s[i] for i in idx] for s in series]
    value = statistics.median(picked[0])
    return value if len(picked) == 1 else value / statistics.median(picked[1])


def _welch_log_interval(
    estimate: float, before: Sequence[float], after: Sequence[float]
) -> tuple[float, float]:
    """The 95% interval of ``after / before`` that the processes' own figures of each run
    give: Welch's t over their logarithms, centred on ``estimate``."""
    lb = [math.log(x) for x in before if x > 0]
    la = [math.log(x) for x in after if x > 0]
    if len(lb) < 2 or len(la) < 2 or estimate <= 0:
        return estimate, estimate
    vb, va = statistics.variance(lb) / len(lb), statistics.variance(la) / len(la)
    if vb + va == 0:
        return estimate, estimate
    df = (vb + va) ** 2 / (vb**2 / (len(lb) - 1) + va**2 / (len(la) - 1))
    half = _t_975(max(1, int(df))) * math.sqrt(vb + va)
    return estimate * math.exp(-half), estimate * math.exp(half)


def between_runs(
    before: RunRounds,
    after: RunRounds,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``after``'s figure over ``before``'s (two runs, say two commits), with a 95% bootstrap
    interval: ``(ratio, ci_low, ci_high)``.

    Unpaired: a round of one run has no partner in the other (they ran at different times, on
    a machine in a different state), so each run is resampled on its own, by processes then
    rounds as in :func:`speedup`; within a run the two series of a speedup keep their pairs.
    With several timing processes in both runs the interval reaches at least as far as the
    processes' own figures allow (Welch's t over their logarithms). Between-run drift that no
    run's rounds show (another driver state, a warmer machine) is not in the interval: a
    threshold on the ratio is what allows for it."""
    b_series, b_groups = before.kept()
    a_series, a_groups = after.kept()
    ratio = _figure_of(a_series) / _figure_of(b_series)
    rng = random.Random(seed)
    b_blocks = _blocks(b_groups, len(b_series[0]))
    a_blocks = _blocks(a_groups, len(a_series[0]))
    ratios = sorted(
        _figure_of(a_series, _resample_indices(rng, a_blocks))
        / _figure_of(b_series, _resample_indices(rng, b_blocks))
        for _ in range(resamples)
    )
    alpha = (1 - CONFIDENCE) / 2
    lo, hi = _percentile(ratios, alpha), _percentile(ratios, 1 - alpha)
    if b_groups and a_groups and len(b_groups) > 1 and len(a_groups) > 1:

        def per_process(series: list[list[float]], groups: list[int]) -> list[float]:
            parts = [split_processes(s, groups) for s in series]
            return [_figure_of([p[i] for p in parts]) for i in range(len(groups))]

        low, high = _welch_log_interval(
            ratio, per_process(b_series, b_groups), per_process(a_series, a_groups)
        )
        lo, hi = min(lo, low), max(hi, high)
    return ratio, lo, hi


def geometric_mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no values")
    return math.exp(statistics.fmean(math.log(v) for v in values))


def gate_verdict(s: Speedup, min_speedup: float, *, strict: bool) -> tuple[bool, str]:
    """Whether a speedup passes the gate, and why (docs/how-it-works.md).

    By default only a CI wholly below the threshold fails (noise alone never fails a run);
    ``strict`` demands the CI wholly above it.
    """
    shown = f"{s.ratio:.2f}x (95% CI {s.ci_low:.2f}–{s.ci_high:.2f}) against {s.baseline}"
    if strict:
        if s.ci_low > min_speedup:
            return True, f"{shown}: CI wholly above {min_speedup:.2f}"
        return False, f"{shown}: strict gate needs the CI wholly above {min_speedup:.2f}"
    if s.ci_high < min_speedup:
        return False, f"{shown}: CI wholly below the minimum {min_speedup:.2f}"
    return True, f"{shown}: meets the minimum {min_speedup:.2f}"
