"""A selection process that dies loses none of the ladder's work (a CUDA error leaves a process
unusable). Where it died timing the stock recipe, the backend stage times the two again in a
fresh process (``stages.backend.selected``), and where that fails too keeps the selection
written before the stock rung and records why the recipe was not compared
(``stages.backend.ladder_kept``). Where it died on a rung of the ladder, a fresh process takes
the ladder over from the progress written before that rung (``stages.backend.recovered``), at
most ``MAX_RESUMES`` times; the fresh process's side, the rung dropped and the ladder climbed
on, runs end to end in ``tests/acceptance/test_selection_resume.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof.errors import StageError, StageTimedOut
from pytest_opprof.schema import (
    BackendPlan,
    BackendSelection,
    LadderProgress,
    read_artifact,
    write_artifact,
)
from pytest_opprof.stages.backend import (
    MAX_RESUMES,
    PROGRESS_FILE,
    RESUMED_LOG,
    SELECTION_FILE,
    STOCK_RUNG_LOG,
    STOCK_RUNG_PENDING,
    ladder_kept,
    rung_under_way,
    selected,
)

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


def no_warmer(name: str) -> Any:
    """``WorkloadRun.setting`` as far as ``selected`` asks: without --opprof-warm-rungs."""
    return {"warm_rungs": False}[name]


class Selections:
    """What ``selected`` uses of a ``WorkloadRun``: selection's process writes the ladder's
    selection and dies timing the stock recipe; a process resumed at the stock rung then keeps
    the recipe (``again="wins"``) or dies too (``again="dies"``)."""

    def __init__(self, out: Path, again: str) -> None:
        self.out_dir, self.again = out, again
        self.calls: list[dict[str, Any]] = []

    def setting(self, name: str) -> Any:
        return no_warmer(name)

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert (task, stage) == ("backend", "backend")
        self.calls.append(extra)
        if not extra.get("stock_rung_only"):
            ladder(self.out_dir)
            (self.out_dir / STOCK_RUNG_PENDING).touch()
            raise FAILURE
        if self.again == "dies":
            raise StageError("w.py: the backend process failed (exit 1)\nRuntimeError: again")
        selection = read_artifact(self.out_dir / SELECTION_FILE, BackendSelection)
        selection.chosen, selection.plan = "stock-recipe", BackendPlan(stock_recipe="cast")
        write_artifact(self.out_dir / SELECTION_FILE, selection)
        (self.out_dir / STOCK_RUNG_PENDING).unlink()


def test_a_fresh_process_times_the_stock_recipe_again_where_selection_died_on_it(
    tmp_path: Path,
) -> None:
    run = Selections(tmp_path, again="wins")
    chosen = selected(run, shares_cpus=True)  # type: ignore[arg-type]
    assert chosen.plan.stock_recipe == "cast" and not chosen.dropped
    first, again = run.calls
    assert first == {"shares_cpus": True}  # beside the stock task, as asked
    assert again == {"log_name": STOCK_RUNG_LOG, "stock_rung_only": True}  # alone, its own log


def test_where_the_fresh_process_dies_too_the_ladder_stands_with_both_failures(
    tmp_path: Path,
) -> None:
    run = Selections(tmp_path, again="dies")
    kept = selected(run)  # type: ignore[arg-type]
    assert kept.plan.proposals == ["dtype_promotion-1"]
    (dropped,) = kept.dropped
    assert dropped.reason.startswith("not compared: the selection process failed timing it")
    assert "unspecified launch failure" in dropped.reason
    assert "and so did a fresh process alone (RuntimeError: again)" in dropped.reason
    assert not (tmp_path / STOCK_RUNG_PENDING).exists()


def test_a_selection_that_dies_elsewhere_is_not_tried_again(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def run_child(task: str, stage: str, **extra: Any) -> None:
        calls.append(extra)
        raise FAILURE

    run = SimpleNamespace(out_dir=tmp_path, run_child=run_child, setting=no_warmer)
    with pytest.raises(StageError, match="unspecified launch failure"):
        selected(run)  # type: ignore[arg-type]
    assert calls == [{}]


def test_a_selection_out_of_time_on_the_stock_rung_keeps_the_ladder_untried_again(
    tmp_path: Path,
) -> None:
    calls: list[dict[str, Any]] = []

    def run_child(task: str, stage: str, **extra: Any) -> None:
        calls.append(extra)
        ladder(tmp_path)
        (tmp_path / STOCK_RUNG_PENDING).touch()
        raise StageTimedOut("w.py: backend did not finish within 600 s and was stopped")

    run = SimpleNamespace(out_dir=tmp_path, run_child=run_child, setting=no_warmer)
    kept = selected(run)  # type: ignore[arg-type]
    assert calls == [{}]
    (dropped,) = kept.dropped
    assert "did not finish within 600 s" in dropped.reason


# ------------------------------------------------------------------ a death on a ladder rung

ON_A_RUNG = StageError(
    "w.py: the backend process failed (exit 1); this is likely a bug in pytest-opprof or "
    "torch. Last lines of backend.log:\n  File ...\n"
    "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
)


def so_far(plan: list[str]) -> BackendSelection:
    return BackendSelection(
        workload="w",
        reference="compile",
        reference_ms=1.0,
        variants=[],
        chosen="+".join(plan) or "compile",
        plan=BackendPlan(proposals=plan),
    )


def died_on(out: Path, rung: str | None) -> None:
    """Selection's progress as a process leaves it: ``rung`` under way (None: climbed)."""
    (out / "profiler_output").mkdir(parents=True, exist_ok=True)
    write_artifact(
        out / PROGRESS_FILE,
        LadderProgress(
            selection=so_far(["dtype_promotion-1"]),
            first_pass=[True],
            under_way=rung,
        ),
    )


class Ladder:
    """What ``selected`` uses of a ``WorkloadRun``: each of the first ``deaths`` processes dies
    on a rung (its progress names it under way); the next writes the selection."""

    def __init__(self, out: Path, deaths: int) -> None:
        self.out_dir, self.deaths = out, deaths
        self.calls: list[dict[str, Any]] = []

    def setting(self, name: str) -> Any:
        return no_warmer(name)

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert (task, stage) == ("backend", "backend")
        self.calls.append(extra)
        if len(self.calls) <= self.deaths:
            died_on(self.out_dir, "graph")
            raise ON_A_RUNG
        write_artifact(self.out_dir / SELECTION_FILE, so_far(["dtype_promotion-1", "graph-1"]))


def test_a_fresh_process_climbs_on_where_selection_died_on_a_rung(tmp_path: Path) -> None:
    run = Ladder(tmp_path, deaths=1)
    chosen = selected(run, shares_cpus=True)  # type: ignore[arg-type]
    assert chosen.plan.proposals == ["dtype_promotion-1", "graph-1"]
    first, again = run.calls
    assert first == {"shares_cpus": True}
    # as the first was asked (beside the stock task, say), its own log, and why the first died
    assert again == {
        "shares_cpus": True,
        "log_name": f"{RESUMED_LOG}1",
        "resume_ladder": "torch.AcceleratorError: CUDA error: an illegal memory access was "
        "encountered",
    }


def test_each_death_on_a_rung_gets_a_fresh_process_up_to_the_limit(tmp_path: Path) -> None:
    run = Ladder(tmp_path, deaths=MAX_RESUMES)
    assert selected(run).plan.proposals == ["dtype_promotion-1", "graph-1"]  # type: ignore[arg-type]
    assert [c.get("log_name") for c in run.calls] == [
        None,
        *(f"{RESUMED_LOG}{i}" for i in range(1, MAX_RESUMES + 1)),
    ]

    run = Ladder(tmp_path, deaths=MAX_RESUMES + 1)
    with pytest.raises(StageError, match="illegal memory access"):
        selected(run)  # type: ignore[arg-type]
    assert len(run.calls) == 1 + MAX_RESUMES


def test_a_process_out_of_time_on_a_rung_is_not_resumed(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def run_child(task: str, stage: str, **extra: Any) -> None:
        calls.append(extra)
        died_on(tmp_path, "graph")
        raise StageTimedOut("w.py: backend did not finish within 600 s and was stopped")

    run = SimpleNamespace(out_dir=tmp_path, run_child=run_child, setting=no_warmer)
    with pytest.raises(StageTimedOut):
        selected(run)  # type: ignore[arg-type]
    assert calls == [{}]


@pytest.mark.parametrize("progress", ["ladder climbed", "none"])
def test_a_death_past_the_ladder_or_before_it_is_not_a_rungs(tmp_path: Path, progress: str) -> None:
    """Progress with no rung under way (the ladder climbed, then the process died), or none
    at all (it died before its first rung): the failure stands."""
    calls: list[dict[str, Any]] = []

    def run_child(task: str, stage: str, **extra: Any) -> None:
        calls.append(extra)
        if progress == "ladder climbed":
            died_on(tmp_path, None)
        raise ON_A_RUNG

    run = SimpleNamespace(out_dir=tmp_path, run_child=run_child, setting=no_warmer)
    with pytest.raises(StageError, match="illegal memory access"):
        selected(run)  # type: ignore[arg-type]
    assert calls == [{}]


def test_a_progress_file_that_does_not_validate_names_no_rung(tmp_path: Path) -> None:
    died_on(tmp_path, "graph")
    assert rung_under_way(tmp_path)
    assert read_artifact(tmp_path / PROGRESS_FILE, LadderProgress).under_way == "graph"
    (tmp_path / PROGRESS_FILE).write_text('{"schema_version": "9.0"}')
    assert not rung_under_way(tmp_path)
