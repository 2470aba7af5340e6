"""The one table pytest prints at the end of an ``--opprof`` session (docs/usage.md#what-runs)."""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate

from pytest_opprof import ITEM_NAMES
from pytest_opprof.report.format import BASELINE_LABELS, DASH, fmt_ms, fmt_speedup, verdict
from pytest_opprof.schema import WorkloadSummary

HEADERS = (
    "workload",
    "baseline",
    "baseline ms",
    "optimized ms",
    "speedup [95% CI]",
    "passes applied",
    "status",
)


def _status(s: WorkloadSummary) -> str:
    """The verdict, with the item that stopped a workload which did not pass."""
    if s.status == "passed" or not s.stage:
        return verdict(s)
    return f"{s.status} ({ITEM_NAMES.get(s.stage, s.stage)})"


def terminal_summary_lines(items: Sequence[WorkloadSummary]) -> list[str]:
    """Lines of one plain-text table, a row per workload; empty when there is none."""
    if not items:
        return []
    rows = [
        [
            s.name,
            BASELINE_LABELS.get(s.baseline or "", s.baseline or DASH),
            fmt_ms(s.baseline_ms, unit=False),
            fmt_ms(s.optimized_ms, unit=False),
            fmt_speedup(s.speedup, s.ci_low, s.ci_high),
            ", ".join(s.passes) or DASH,
            _status(s),
        ]
        for s in items
    ]
    return tabulate(
        rows, headers=list(HEADERS), tablefmt="simple", disable_numparse=True
    ).splitlines()
