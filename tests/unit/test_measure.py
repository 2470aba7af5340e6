from __future__ import annotations

import pytest

from pytest_opprof.measure import (
    bootstrap_median_ci,
    gate_verdict,
    geometric_mean,
    latency_stats,
    speedup,
)
from pytest_opprof.schema import Speedup


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
