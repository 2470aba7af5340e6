"""An extra section in every workload's ``report.md``: the latency budget.

Each team owns a latency budget per model (here a dict; it could be read from a file kept
with the models). The section compares the optimized latency measured in the recapture with
the budget, so a reviewer sees it next to the speedup.
"""

from __future__ import annotations

LATENCY_BUDGET_MS = {"conv_block": 0.25, "mlp_activations": 0.10}


def pytest_opprof_report_sections(artifacts):
    budget = LATENCY_BUDGET_MS.get(artifacts.name)
    if budget is None:
        return []
    if artifacts.optimized is None:
        return [("Latency budget", f"Budget {budget:.3f} ms: _no optimized timing measured._")]
    optimized = artifacts.optimized.timing.variants["optimized"]
    verdict = "within" if optimized.ci_high_ms <= budget else "OVER"
    body = "\n".join(
        [
            "| budget | optimized median | 95% CI | verdict |",
            "|---|---|---|---|",
            f"| {budget:.3f} ms | {optimized.median_ms:.3f} ms | "
            f"{optimized.ci_low_ms:.3f}–{optimized.ci_high_ms:.3f} ms | **{verdict}** |",
        ]
    )
    return [("Latency budget", body)]
