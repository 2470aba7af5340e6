"""Stage 5: what people read — the per-workload and session ``report.md``, plots, the terminal
summary and the stage-level JUnit file.

Pure Python: no torch. matplotlib is optional (the ``plots`` extra) and imported only when a plot
is drawn. Every number in a report comes from an artifact of an earlier stage; a missing artifact
gives a "not available (stage X did not run: reason)" line in its section, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from pytest_opprof.errors import ArtifactError
from pytest_opprof.report.junit import StageResultRecord, user_properties, write_stage_junit
from pytest_opprof.report.markdown import render_workload_report, write_workload_report
from pytest_opprof.report.session import (
    COMMENT_MARKER,
    render_comment_body,
    render_session_report,
)
from pytest_opprof.report.terminal import terminal_summary_lines
from pytest_opprof.schema import (
    BackendSelection,
    Optimizations,
    Profile,
    ValidationReport,
    WorkloadSummary,
    read_artifact,
)

__all__ = [
    "ARTIFACT_FILES",
    "COMMENT_MARKER",
    "StageResultRecord",
    "WorkloadArtifacts",
    "load_workload_artifacts",
    "render_comment_body",
    "render_session_report",
    "render_workload_report",
    "terminal_summary_lines",
    "user_properties",
    "write_stage_junit",
    "write_workload_report",
]

ARTIFACT_FILES: dict[str, tuple[str, str]] = {
    # field of WorkloadArtifacts: (stage that writes it, path under <out>/<workload>/)
    "profile": ("capture", "profile.json"),
    "optimizations": ("propose", "optimizations.json"),
    "selection": ("backend", "profiler_output/backend_selection.json"),
    "implementation_notes": ("backend", "profiler_output/implementation_notes.md"),
    "validation": ("validate", "profiler_output/validation_report.json"),
    "optimized": ("recapture", "profile_optimized.json"),
}
"""Where :func:`load_workload_artifacts` looks for each input of the report."""


@dataclass(kw_only=True)
class WorkloadArtifacts:
    """Everything the report of one workload reads. Only ``summary`` is always there: each
    artifact is ``None`` when its stage did not run, with the reason in ``stage_errors``."""

    name: str
    path: str
    """The workload file, relative to where pytest ran (used in the reproduction commands)."""
    out_dir: Path
    """``<out>/<workload>/``: report.md is written here, plots under ``profiler_output/``."""
    summary: WorkloadSummary
    profile: Profile | None = None
    optimizations: Optimizations | None = None
    selection: BackendSelection | None = None
    validation: ValidationReport | None = None
    optimized: Profile | None = None
    """``profile_optimized.json``."""
    implementation_notes: str | None = None
    stage_errors: dict[str, str] = field(default_factory=dict)
    """stage name -> the message it failed (or was blocked) with."""
    min_speedup: float = 1.0
    gate_baseline: str = "best"
    """The option value (eager, compile or best); ``summary.baseline`` is what it resolved to."""
    strict_gate: bool = False
    gate_on_cpu: bool = False


def load_workload_artifacts(
    out_dir: Path,
    summary: WorkloadSummary,
    *,
    stage_errors: dict[str, str] | None = None,
    min_speedup: float = 1.0,
    gate_baseline: str = "best",
    strict_gate: bool = False,
    gate_on_cpu: bool = False,
) -> WorkloadArtifacts:
    """Read whatever artifacts of one workload are on disk. A missing file stays ``None``; a file
    that does not validate stays ``None`` too, and its message goes to ``stage_errors`` (unless
    the stage already has one), so the report says why instead of failing."""
    out_dir = Path(out_dir)
    a = WorkloadArtifacts(
        name=summary.name,
        path=summary.path,
        out_dir=out_dir,
        summary=summary,
        stage_errors=dict(stage_errors or {}),
        min_speedup=min_speedup,
        gate_baseline=gate_baseline,
        strict_gate=strict_gate,
        gate_on_cpu=gate_on_cpu,
    )
    models: dict[str, type[BaseModel]] = {
        "profile": Profile,
        "optimizations": Optimizations,
        "selection": BackendSelection,
        "validation": ValidationReport,
        "optimized": Profile,
    }
    for attr, (stage, rel) in ARTIFACT_FILES.items():
        file = out_dir / rel
        if not file.is_file():
            continue
        try:
            if attr == "implementation_notes":
                value: object = file.read_text(encoding="utf-8")
            else:
                value = read_artifact(file, models[attr])
        except (ArtifactError, OSError, UnicodeDecodeError) as exc:
            a.stage_errors.setdefault(stage, str(exc))
            continue
        setattr(a, attr, value)
    return a
