"""A selection process that dies timing the stock recipe loses none of the ladder's work: the
backend stage keeps the selection written before the stock rung and records why the recipe
was not compared (``stages.backend.ladder_kept``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_opprof.errors import StageError
from pytest_opprof.schema import BackendPlan, BackendSelection, read_artifact, write_artifact
from pytest_opprof.stages.backend import SELECTION_FILE, STOCK_RUNG_PENDING, ladder_kept

FAILURE = StageError(
    "w.py: the backend process failed (exit 1); this is likely a bug in pytest-opprof or "
    "torch. Last lines of backend.log:\n  File ...\n"
    "torch.AcceleratorError: CUDA error: unspecified launch failure\nSearch for ..."
)


def ladder(out: Path) -> BackendSelection:
    selection = BackendSelection(
        workload="w",
        reference="compile",
        reference_ms=1.0,
        variants=[],
        chosen="dtype_promotion-1",
        plan=BackendPlan(proposals=["dtype_promotion-1"], dtype="bfloat16"),
    )
    (out / "profiler_output").mkdir(parents=True)
    write_artifact(out / SELECTION_FILE, selection)
    return selection


def test_the_ladder_s_plan_stands_where_the_stock_rung_killed_the_process(
    tmp_path: Path,
) -> None:
    written = ladder(tmp_path)
    (tmp_path / STOCK_RUNG_PENDING).touch()
    kept = ladder_kept(tmp_path, FAILURE)
    assert kept.plan == written.plan and kept.chosen == "dtype_promotion-1"
    (dropped,) = kept.dropped
    assert dropped.id == "stock-recipe"
    assert "not compared" in dropped.reason and "unspecified launch failure" in dropped.reason
    assert read_artifact(tmp_path / SELECTION_FILE, BackendSelection) == kept  # on disk too
    assert not (tmp_path / STOCK_RUNG_PENDING).exists()


def test_any_other_failure_of_selection_fails_the_stage(tmp_path: Path) -> None:
    ladder(tmp_path)  # a selection without the pending stock rung: written after it, or stale
    with pytest.raises(StageError, match="unspecified launch failure"):
        ladder_kept(tmp_path, FAILURE)
    (tmp_path / SELECTION_FILE).unlink()
    (tmp_path / STOCK_RUNG_PENDING).touch()  # died before the ladder's selection was written
    with pytest.raises(StageError):
        ladder_kept(tmp_path, FAILURE)
