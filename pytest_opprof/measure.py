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


def _split(samples: Sequence[float], groups: Sequence[int] | None) -> list[list[float]]:
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


def _blocks(groups: Sequence[int] | None, n: int) -> list[list[int]]:
    sizes = list(groups) if groups else [n]
    out, at = [], 0
    for g in sizes:
        out.append(list(range(at, at + g)))
        at += g
    return out


def latency_stats(
    samples_ms: Sequence[float],
    calls_per_round: int,
    groups: Sequence[int] | None = None,
    *,
    cpu_share: Sequence[float] = (),
    preempted: Sequence[int] = (),
) -> LatencyStats:
    """Summarise per-call times, one sample per round; ``groups`` gives the rounds of each
    timing process when there were several (the interval then resamples processes too).
    ``cpu_share`` and ``preempted``, per round where measured, are kept beside the samples."""
    if not samples_ms:
        raise ValueError("no timing samples")
    _split(samples_ms, groups)  # checks the split
    n = len(samples_ms)
    if groups and len(groups) > 1:
        rng = random.Random(0)
        blocks = _blocks(groups, len(samples_ms))
        medians = sorted(
            statistics.median(samples_ms[i] for i in _resample_indices(rng, blocks))
            for _ in range(BOOTSTRAP_RESAMPLES)
        )
        alpha = (1 - CONFIDENCE) / 2
        lo, hi = _percentile(medians, alpha), _percentile(medians, 1 - alpha)
    else:
        lo, hi = bootstrap_median_ci(samples_ms)
    return LatencyStats(
        median_ms=statistics.median(samples_ms),
        ci_low_ms=lo,
        ci_high_ms=hi,
        mean_ms=statistics.fmean(samples_ms),
        stdev_ms=statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0,
        min_ms=min(samples_ms),
        rounds=len(samples_ms),
        calls_per_round=calls_per_round,
        samples_ms=[float(s) for s in samples_ms],
        processes=len(groups) if groups else 1,
        samples_per_process=list(groups) if groups and len(groups) > 1 else [],
        cpu_share=[float(x) for x in cpu_share] if len(cpu_share) == n else [],
        preempted=[int(x) for x in preempted] if len(preempted) == n else [],
    )


def speedup(
    baseline_name: str,
    baseline: Sequence[float],
    candidate_name: str,
    candidate: Sequence[float],
    *,
    groups: Sequence[int] | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians ``baseline / candidate`` with a paired bootstrap interval.

    Rounds were interleaved (A B A B …), so round ``i`` of both saw the same machine state; the
    bootstrap resamples round indices, keeping the pairs, which is what makes the interval
    honest about drift (clock changes hit both sides of a pair). With ``groups`` (rounds per
    timing process, several processes) it resamples processes first and rounds within each:
    a host-bound baseline's speed moves between processes more than between rounds of one, and
    an interval from one process's rounds would not cover the next run.
    """
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("speedup needs the same, non-zero number of rounds on both sides")
    ratio = statistics.median(baseline) / statistics.median(candidate)
    parts = list(zip(_split(baseline, groups), _split(candidate, groups), strict=True))
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
    return Speedup(
        baseline=baseline_name,
        candidate=candidate_name,
        ratio=ratio,
        ci_low=_percentile(ratios, alpha),
        ci_high=_percentile(ratios, 1 - alpha),
        process_ratios=per_process,
    )


@dataclass(frozen=True)
class Replica:
    """What one more timing process measured: per variant its samples, and per round its
    launching thread's CPU share and preemptions; the host while it timed."""

    samples: Mapping[str, Sequence[float]]
    cpu_share: Mapping[str, Sequence[float]] = field(default_factory=dict)
    preempted: Mapping[str, Sequence[int]] = field(default_factory=dict)
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
                host=HostWindow.model_validate(host) if host else None,
            )
        except (KeyError, TypeError, AttributeError, ValidationError) as exc:
            raise ValueError(f"not a timing process's result: {exc}") from None


def pooled_timing(timing: Timing, replicas: Sequence[Replica]) -> Timing:
    """``timing`` (one process's) with the samples of more timing processes added: each
    variant's samples pooled in process order, its statistics and every speedup recomputed
    across processes. A replica lacking a variant adds nothing to it (or to its pairs). The
    per-round CPU shares pool where every process measured them; the host windows follow the
    processes' order."""
    if not replicas:
        return timing
    variants, groups = {}, {}
    for name, stats in timing.variants.items():
        own = _split(stats.samples_ms, stats.samples_per_process or None)
        timed = [r for r in replicas if r.samples.get(name)]
        runs = [*own, *(list(r.samples[name]) for r in timed)]
        groups[name] = [len(run) for run in runs]
        pooled = [x for run in runs for x in run]

        def joined(mine: Sequence[Any], theirs: list[Sequence[Any] | None]) -> list[Any]:
            parts = [mine, *theirs]
            return [x for p in parts for x in p or ()] if all(parts) else []

        variants[name] = latency_stats(
            pooled,
            stats.calls_per_round,
            groups[name],
            cpu_share=joined(stats.cpu_share, [r.cpu_share.get(name) for r in timed]),
            preempted=joined(stats.preempted, [r.preempted.get(name) for r in timed]),
        )
    speedups = []
    for s in timing.speedups:
        a, b = variants[s.baseline], variants[s.candidate]
        if groups[s.baseline] != groups[s.candidate]:  # a replica timed one side only
            speedups.append(s)
            continue
        speedups.append(
            speedup(s.baseline, a.samples_ms, s.candidate, b.samples_ms, groups=groups[s.baseline])
        )
    theirs = [r.host for r in replicas]
    hosts = [*timing.host, *theirs] if timing.host and None not in theirs else []
    return timing.model_copy(update={"variants": variants, "speedups": speedups, "host": hosts})


def geometric_mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no values")
    return math.exp(statistics.fmean(math.log(v) for v in values))


def gate_verdict(s: Speedup, min_speedup: float, *, strict: bool) -> tuple[bool, str]:
    """Whether a speedup passes the gate, and why (DESIGN §2.5).

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
