"""Statistics of the timing pass: medians, bootstrap confidence intervals, speedup ratios.

Pure Python (the pipeline's numbers must be checkable without torch). The bootstrap uses a
fixed seed so the same samples always give the same interval.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from pytest_opprof.schema import LatencyStats, Speedup

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


def latency_stats(samples_ms: Sequence[float], calls_per_round: int) -> LatencyStats:
    """Summarise per-call times, one sample per round."""
    if not samples_ms:
        raise ValueError("no timing samples")
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
    )


def speedup(
    baseline_name: str,
    baseline: Sequence[float],
    candidate_name: str,
    candidate: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians ``baseline / candidate`` with a paired bootstrap interval.

    Rounds were interleaved (A B A B …), so round ``i`` of both saw the same machine state; the
    bootstrap resamples round indices, keeping the pairs, which is what makes the interval
    honest about drift (clock changes hit both sides of a pair).
    """
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("speedup needs the same, non-zero number of rounds on both sides")
    ratio = statistics.median(baseline) / statistics.median(candidate)
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
    ratios = []
    for _ in range(resamples):
        idx = rng.choices(range(n), k=n)
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
    )


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
