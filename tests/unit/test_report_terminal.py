"""The terminal summary table."""

from __future__ import annotations

from pathlib import Path

from pytest_opprof.report import terminal_summary_lines
from pytest_opprof.report.terminal import HEADERS
from pytest_opprof.schema import CPU_NOT_ENFORCED, SessionSummary, WorkloadSummary, read_artifact

DATA = Path(__file__).resolve().parents[1] / "data" / "report"


def test_one_row_per_workload_with_the_figures() -> None:
    session = read_artifact(DATA / "session.json", SessionSummary)
    lines = terminal_summary_lines(session.workloads)
    assert len(lines) == 2 + len(session.workloads)  # header, rule, rows
    for title in HEADERS:
        assert title in lines[0]
    assert set(lines[1]) <= {"-", " "}
    conv = lines[2].split()
    assert conv[:4] == ["conv_block", "torch.compile", "0.254", "0.183"]
    assert "1.39× (95% CI 1.36–1.42)" in lines[2]
    assert "bn_fold, dtype_promotion, memory_layout" in lines[2]
    assert lines[2].rstrip().endswith("passed")
    assert lines[3].rstrip().endswith("failed (speedup)")
    assert "0.97× (95% CI 0.93–0.99)" in lines[3]
    assert lines[4].rstrip().endswith("error (capture)")
    assert lines[4].split()[1:6] == ["—"] * 5
    assert terminal_summary_lines([]) == []


def test_a_cpu_fallback_row_says_the_gate_was_not_enforced() -> None:
    cpu = WorkloadSummary(
        name="tiny",
        path="tiny.py",
        status="passed",
        stage="report",
        speedup=1.05,
        ci_low=0.98,
        ci_high=1.12,
        enforced=False,
    )
    failed = cpu.model_copy(update={"name": "slow", "status": "failed", "stage": "speedup"})
    rows = terminal_summary_lines([cpu, failed])[2:]
    assert rows[0].rstrip().endswith(CPU_NOT_ENFORCED)
    assert "1.05× (95% CI 0.98–1.12)" in rows[0]  # measured, shown, not gated
    assert "passed" not in rows[0]
    assert rows[1].rstrip().endswith("failed (speedup)")  # a failure keeps its own word
