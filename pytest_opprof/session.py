"""One run's state: the workloads found, their stage outcomes, and the session-level outputs.

Shared by the pytest plugin (kept in ``config.stash``) and the ``opprof`` command, so both run
the same code. Pure Python: torch is imported only by the child processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof import STAGES
from pytest_opprof.errors import ArtifactError, OpprofError
from pytest_opprof.options import OpprofOptions
from pytest_opprof.pipeline import StageOutcome, WorkloadRun, rel_path
from pytest_opprof.schema import (
    BackendSelection,
    Optimizations,
    Profile,
    SessionSummary,
    Speedup,
    ValidationReport,
    WorkloadSummary,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages import report as report_stage
from pytest_opprof.stages import run_stage
from pytest_opprof.stages.report import SUMMARY_FILE, find_speedup, maybe_artifact
from pytest_opprof.workload import WorkloadSpec

if TYPE_CHECKING:
    from pytest_opprof.history import StoredRun


@dataclass
class OpprofSession:
    options: OpprofOptions
    runs: dict[Path, WorkloadRun] = field(default_factory=dict)
    summaries: dict[str, WorkloadSummary] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    compare_with: StoredRun | None = None
    """The stored run of ``--opprof-compare``, read when the session starts (a bad name is a
    usage error then, not at the first workload's report)."""

    def __post_init__(self) -> None:
        if self.options.compare is not None and self.compare_with is None:
            from pytest_opprof.history import find_run

            self.compare_with = find_run(self.options.compare, self.options.storage)[1]

    def workload(self, spec: WorkloadSpec, hook: Any = None) -> WorkloadRun:
        """The run of ``spec``; ``hook``: the ``pytest_opprof_*`` hooks that apply to it
        (pytest's hook proxy for its path), kept from the first call that gives them."""
        key = spec.path.resolve()
        if key not in self.runs:
            taken = {r.name for r in self.runs.values()}
            name = spec.stem if spec.stem not in taken else f"{spec.path.parent.name}_{spec.stem}"
            self.runs[key] = WorkloadRun(spec=spec, options=self.options, name=name, hook=hook)
        elif hook is not None and self.runs[key].hook is None:
            self.runs[key].hook = hook
        return self.runs[key]

    def run(self, spec: WorkloadSpec, stage: str, hook: Any = None) -> StageOutcome:
        """Run ``stage`` after any earlier stage not yet run in this session (deselected
        items still get their stage computed or read from disk)."""
        wr = self.workload(spec, hook)
        for earlier in STAGES[: STAGES.index(stage)]:
            if earlier not in wr.outcomes and earlier != "report":
                run_stage(wr, earlier)
        if stage == "report":
            outcome = self.report(wr)
            wr.hooks.pytest_opprof_stage_finished(workload=wr, stage=stage, outcome=outcome)
            return outcome
        return wr.outcomes.get(stage) or run_stage(wr, stage)

    # --------------------------------------------------------------------------- report

    def report(self, wr: WorkloadRun) -> StageOutcome:
        """Stage 5 for ``wr`` (``stages.report``)."""
        return report_stage.run(self, wr)

    def summarize(self, wr: WorkloadRun) -> WorkloadSummary:
        """The gate's verdict for ``wr`` without writing the report (``stages.report``)."""
        return report_stage.summarize(self, wr)

    # -------------------------------------------------------------------------- session

    def collect_summaries(self) -> list[WorkloadSummary]:
        """This process's summaries plus those other workers wrote during this session."""
        found = dict(self.summaries)
        out = self.options.out
        if out.is_dir():
            for path in sorted(out.glob(f"*/{SUMMARY_FILE}")):
                if path.stat().st_mtime + 1 < self.started:
                    continue
                try:
                    s = read_artifact(path, WorkloadSummary)
                except ArtifactError:
                    continue
                found.setdefault(s.name, s)
        return [found[k] for k in sorted(found)]

    def write_session(
        self,
        summaries: list[WorkloadSummary],
        device: str,
        seconds: Mapping[str, float] | None = None,
    ) -> tuple[Path, SessionSummary]:
        """``session.json`` and the session ``report.md``: the report's path and the verdict;
        ``seconds``: each workload's stage seconds in all, for a stored run."""
        from pytest_opprof.history import record_session
        from pytest_opprof.report import render_session_report

        out = self.options.out
        verdict = session_summary(summaries, device)
        # the commit measured; with --opprof-save the stored run; the section across runs
        across = record_session(self.options, self.compare_with, verdict, summaries, seconds)
        write_artifact(out / "session.json", verdict)
        path = out / "report.md"
        report = render_session_report(summaries, device=device, out_dir=out)
        write_text_atomic(path, report + across)
        return path, verdict


# --------------------------------------------------------------------------- the fixture


@dataclass(frozen=True)
class Result:
    """What ``opprof.optimize`` returns: one workload's artifacts, typed. An artifact is
    ``None`` when its stage did not run (``outcomes`` says why)."""

    name: str
    summary: WorkloadSummary
    """The gate's verdict and numbers (``status``, ``speedup``, ``ci_low``, ``message``, …)."""
    profile: Profile | None
    optimizations: Optimizations | None
    selection: BackendSelection | None
    validation: ValidationReport | None
    optimized: Profile | None
    """``profile_optimized.json``."""
    speedup: Speedup | None
    """Optimized against the gate's baseline (``ratio``, ``ci_low``, ``ci_high``)."""
    report: Path
    out_dir: Path
    outcomes: dict[str, StageOutcome]

    @property
    def passed(self) -> bool:
        """The gate passed (on the CPU fallback: unless ``gate_on_cpu``, it is not enforced)."""
        return self.summary.status == "passed"


class OptimizeFailed(OpprofError):
    """A stage before the gate failed; ``result`` holds what was produced."""

    def __init__(self, message: str, result: Result) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Optimizer:
    """The ``opprof`` fixture: the pipeline of ``pytest --opprof`` on one workload."""

    options: OpprofOptions
    hook: Any = None

    def optimize(self, path: str | Path, **options: Any) -> Result:
        """Run every stage on the workload at ``path`` (the usual stage cache applies) and
        return its artifacts. ``options`` override the session's by field name. Raises
        ``OptimizeFailed`` when a stage before the gate fails; a failed gate is
        ``result.passed`` false, for the test to assert on."""
        __tracebackhide__ = True
        from pytest_opprof.workload import discover

        session = OpprofSession(options=self.with_options(options))
        target = Path(path)
        spec = discover(target) if target.is_file() else None
        if spec is None:
            raise OpprofError(f"{target}: not a workload (no top-level def get_model_and_input)")
        wr = session.workload(spec, self.hook)
        for stage in STAGES:
            session.run(spec, stage, self.hook)
        out = wr.out_dir
        summary = session.summaries.get(wr.name)
        if summary is None:  # the report stage failed before it wrote one
            report = wr.outcomes["report"]
            summary = WorkloadSummary(
                name=wr.name,
                path=rel_path(spec.path),
                status="error",
                stage="report",
                message=report.message,
            )
        optimized = maybe_artifact(out / "profile_optimized.json", Profile)
        result = Result(
            name=wr.name,
            summary=summary,
            profile=maybe_artifact(out / "profile.json", Profile),
            optimizations=maybe_artifact(out / "optimizations.json", Optimizations),
            selection=maybe_artifact(
                wr.profiler_output / "backend_selection.json", BackendSelection
            ),
            validation=maybe_artifact(
                wr.profiler_output / "validation_report.json", ValidationReport
            ),
            optimized=optimized,
            speedup=find_speedup(optimized.timing.speedups, summary.baseline, "optimized")
            if optimized is not None and summary.baseline
            else None,
            report=out / "report.md",
            out_dir=out,
            outcomes=dict(wr.outcomes),
        )
        broken = next(
            (
                o
                for s, o in wr.outcomes.items()
                if s != "report" and o.status in ("failed", "error")
            ),
            None,
        )
        if broken is not None:
            raise OptimizeFailed(
                f"{wr.name}: {broken.stage} {broken.status}: {broken.message}", result
            )
        return result

    def with_options(self, overrides: dict[str, Any]) -> OpprofOptions:
        """The fixture's options with ``overrides`` (field names), parsed like the flags."""
        import dataclasses

        from pytest_opprof.options import BY_FIELD

        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            name = "from" if key == "from_" else key
            if name not in BY_FIELD:
                raise TypeError(
                    f"optimize() got an unknown option {key!r}; options: "
                    + ", ".join(sorted(f.replace("from", "from_") for f in BY_FIELD))
                )
            parsed = None if value is None else BY_FIELD[name].parse(str(value))
            changes["from_" if name == "from" else name] = parsed
        return dataclasses.replace(self.options, **changes)


def session_device(summaries: Iterable[WorkloadSummary], out: Path, device: str) -> str:
    """The device the session's profiles name; where none has a profile (every workload
    stopped before its capture finished), the device this session would have measured on,
    named the way a profile names it."""
    for s in summaries:
        prof = maybe_artifact(out / s.name / "profile.json", Profile)
        if prof is not None:
            return prof.capture_metadata.device_name
    from pytest_opprof.capture.system import environment, resolve_device

    try:
        resolved = resolve_device(device)
    except OpprofError:
        return "unknown"
    if resolved == "cuda":  # not torch.cuda here: this process never starts CUDA
        from pytest_opprof.gpus import nvidia_smi_query

        return nvidia_smi_query("name") or "unknown"
    return str(environment("cpu")["device_name"])


def session_summary(summaries: list[WorkloadSummary], device: str) -> SessionSummary:
    """The session's verdict: it passes only when every workload's gate passed (a workload
    that stopped before its speedup was measured fails it, whatever was selected)."""
    return SessionSummary(
        device=device,
        workloads=summaries,
        gate_passed=all(s.status == "passed" for s in summaries),
        gate_enforced=all(s.enforced for s in summaries),
    )


def merge_sessions(dirs: list[Path], out: Path) -> SessionSummary:
    """Combine the results of shards (each an ``--opprof-out`` folder) into one session:
    ``session.json``, ``report.md`` and the pull-request comment body, written under ``out``.

    Workload folders are copied into ``out`` (when it is not the shard itself) so the links of
    the merged report resolve. A workload found in two shards is an error: shards are disjoint.
    """
    import shutil

    from pytest_opprof.errors import OpprofError
    from pytest_opprof.report import render_comment_body, render_session_report

    found: dict[str, WorkloadSummary] = {}
    devices: list[str] = []
    for folder in dirs:
        session_file = folder / "session.json"
        if not session_file.exists():
            raise OpprofError(f"{folder}: no session.json; is it an --opprof-out folder?")
        shard = read_artifact(session_file, SessionSummary)
        devices.append(shard.device)
        for w in shard.workloads:
            if w.name in found:
                raise OpprofError(
                    f"workload {w.name!r} is in two shards ({folder} and another); shards must "
                    "be disjoint: run them with --opprof-shard=K/N and the same N"
                )
            src, dst = folder / w.name, out / w.name
            if src.is_dir() and src.resolve() != dst.resolve():
                shutil.copytree(src, dst, dirs_exist_ok=True)
            if w.report and (dst / "report.md").exists():
                # the shard's paths become the merged folder's, in the message too
                report = rel_path(dst / "report.md")
                message = w.message.replace(w.report, report) if w.message else w.message
                w = w.model_copy(update={"report": report, "message": message})
            found[w.name] = w
    summaries = [found[k] for k in sorted(found)]
    device = devices[0] if len(set(devices)) == 1 else " / ".join(sorted(set(devices)))
    merged = session_summary(summaries, device)
    write_artifact(out / "session.json", merged)
    report = render_session_report(summaries, device=device, out_dir=out)
    write_text_atomic(out / "report.md", report)
    write_text_atomic(out / "comment.md", render_comment_body(report))
    return merged
