"""The six stages, one module each, holding both halves of the stage: the parent's (``run``,
in the pytest or CLI process) and the child's (the ``TASKS`` that ``runner`` dispatches in the
stage process). This package also sequences them for one workload (:func:`run_stage`): reuse
from disk, ``--opprof-from`` / ``--opprof-stage``, and each outcome's message.

The report stage's parent half needs the session (``session.py``): ``stages.report``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pytest_opprof import STAGES
from pytest_opprof.capture.counters import pending
from pytest_opprof.errors import ArtifactError, OpprofError, StageBlocked, StageError, WorkloadError
from pytest_opprof.pipeline import StageOutcome, WorkloadRun, file_sha256
from pytest_opprof.schema import (
    BackendSelection,
    ChildSpec,
    FxGraphSummary,
    Optimizations,
    Profile,
    ValidationReport,
    read_artifact,
)
from pytest_opprof.stages import backend, capture, propose, recapture, validate

MODULES = (capture, propose, backend, validate, recapture)

PARENT: dict[str, Callable[[WorkloadRun], str]] = {m.NAME: m.run for m in MODULES}
"""Each stage's parent half by the stage's name (the report stage's is ``stages.report``)."""

TASKS: dict[str, Callable[[ChildSpec], None]] = {
    task: fn for m in MODULES for task, fn in m.TASKS.items()
}
"""Every child half by its task name, as a spec names it."""


def run_stage(run: WorkloadRun, stage: str) -> StageOutcome:
    """Run (or reuse) one stage; the outcome carries the user-facing message. The hooks hear
    of it through ``pytest_opprof_stage_finished``."""
    outcome = _run_stage(run, stage)
    run.hooks.pytest_opprof_stage_finished(workload=run, stage=stage, outcome=outcome)
    return outcome


def _run_stage(run: WorkloadRun, stage: str) -> StageOutcome:
    index = STAGES.index(stage)
    for earlier in STAGES[:index]:
        prior = run.outcomes.get(earlier)
        if prior is not None and prior.status != "passed":
            if run.options.stage == stage and prior.status != "skipped":
                # The one stage asked for cannot run: say why as its own failure.
                outcome = StageOutcome(stage, "error", f"needs {earlier}: {prior.message}")
            else:
                outcome = StageOutcome(stage, "skipped", f"blocked by {earlier}")
            run.outcomes[stage] = outcome
            return outcome
    if run.spec.override_error:
        outcome = StageOutcome(stage, "error", run.spec.override_error)
        run.outcomes[stage] = outcome
        return outcome
    start = time.perf_counter()
    opts = run.options
    # --opprof-from=F recomputes F and later stages; --opprof-stage=S runs S alone, reading
    # what comes before it from disk (or F..S when both are given).
    first = STAGES.index(opts.from_) if opts.from_ else None
    if opts.stage is not None:
        only = STAGES.index(opts.stage)
        first = only if first is None else min(first, only)
    forced = first is not None and index >= first
    reuse_only = first is not None and index < first
    if reuse_only and stage == "validate" and validate.edited_since_validation(run):
        reuse_only = False  # an edited file is validated again before anything times it
    try:
        if reuse_only:
            for path in run.artifact_paths(stage):
                if not path.exists():
                    raise ArtifactError(
                        f"{path}: not found, and this run reuses the {stage} stage's files "
                        f"instead of running it; run it first (opprof {stage} WORKLOAD, or "
                        f"pytest --opprof --opprof-from={stage})"
                    )
            _check_artifacts(run, stage)
            outcome = StageOutcome(stage, "passed", "reused from disk", cached=True)
        elif not forced and run.cached(stage) and _artifacts_valid(run, stage):
            outcome = StageOutcome(stage, "passed", "unchanged inputs: read from disk", cached=True)
        else:
            run.invalidate_from(stage)
            if stage != "recapture":
                recapture.warm_timing_servers(run)
            message = PARENT[stage](run)
            run.mark_done(stage)
            outcome = StageOutcome(stage, "passed", message)
    except StageBlocked as exc:
        outcome = StageOutcome(stage, "skipped", str(exc))
    except WorkloadError as exc:
        outcome = StageOutcome(stage, "error", str(exc))
    except OpprofError as exc:
        outcome = StageOutcome(stage, "failed", str(exc))
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        outcome = StageOutcome(
            stage,
            "error",
            f"{where}{exc.strerror or exc}; check that "
            f"--opprof-out ({run.options.out}) is writable",
        )
    outcome.seconds = time.perf_counter() - start
    run.outcomes[stage] = outcome
    return outcome


def _artifacts_valid(run: WorkloadRun, stage: str) -> bool:
    """A cached stage whose artifacts no longer validate (truncated by a crash, edited by hand)
    is recomputed rather than failed: its inputs are all still there."""
    try:
        _check_artifacts(run, stage)
    except ArtifactError:
        return False
    return True


def _check_artifacts(run: WorkloadRun, stage: str) -> None:
    models: dict[str, Any] = {
        "profile.json": Profile,
        "graph.json": FxGraphSummary,
        "optimizations.json": Optimizations,
        "backend_selection.json": BackendSelection,
        "validation_report.json": ValidationReport,
        "profile_optimized.json": Profile,
    }
    for path in run.artifact_paths(stage):
        model = models.get(path.name)
        if model is not None:
            found = read_artifact(path, model)
            if stage == "capture" and isinstance(found, Profile) and pending(found):
                raise ArtifactError(
                    f"{path}: its counters pass, run beside the later stages, never ended; "
                    "run the capture again (opprof capture WORKLOAD, or pytest --opprof "
                    "--opprof-from=capture)"
                )
    if stage == "backend" and not run.generated.exists():
        raise ArtifactError(
            f"{run.generated}: the generated backend is missing; run the backend stage again "
            "(opprof backend WORKLOAD, or pytest --opprof --opprof-from=backend)"
        )
    if stage == "validate":
        report = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
        if report.sha256 != file_sha256(run.generated):
            raise ArtifactError(
                f"{run.generated.name} changed since validation_report.json was written"
            )
        if report.overall != "READY_FOR_PROFILING":
            raise StageError(f"{run.generated.name}: {report.message}")
