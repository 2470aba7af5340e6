"""One run's state: the workloads found, their stage outcomes, and the session-level outputs.

Shared by the pytest plugin (kept in ``config.stash``) and the ``opprof`` command, so both run
the same code. Pure Python: torch is imported only by the child processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pytest_opprof import STAGES
from pytest_opprof.errors import ArtifactError, OpprofError, StageError
from pytest_opprof.measure import gate_verdict
from pytest_opprof.options import OpprofOptions
from pytest_opprof.pipeline import StageOutcome, WorkloadRun
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
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
from pytest_opprof.stages import run_stage
from pytest_opprof.workload import WorkloadSpec

if TYPE_CHECKING:
    from pytest_opprof.history import StoredRun

SUMMARY_FILE = "workload_summary.json"


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
        """Stage 5: the report and the gate's verdict (raised as ``GateFailed``)."""
        start = time.perf_counter()
        try:
            summary = self.summarize(wr)
            self.write_report(wr, summary)
        except OSError as exc:
            outcome = StageOutcome("report", "error", f"cannot write the report: {exc}")
            wr.outcomes["report"] = outcome
            return outcome
        except OpprofError as exc:  # a hook's answer that does not check out
            outcome = StageOutcome("report", "error", str(exc))
            wr.outcomes["report"] = outcome
            return outcome
        # Fail closed: a workload that did not reach a measured speedup fails its gate item
        # (never skips it), so `-k speedup` or a node id alone cannot turn a broken stage
        # into a green run.
        if summary.status == "passed":
            outcome = StageOutcome("report", "passed", summary.message)
        else:
            outcome = StageOutcome("report", "failed", f"gate not passed: {summary.message}")
        blocked = any(o.status != "passed" for s, o in wr.outcomes.items() if s != "report")
        outcome.seconds = time.perf_counter() - start
        wr.outcomes["report"] = outcome
        if not blocked:
            wr.hooks.pytest_opprof_gate_decided(
                workload=wr, summary=summary, passed=summary.status == "passed"
            )
        return outcome

    def gate_baseline(self, wr: WorkloadRun, optimized: Profile) -> str:
        """``pytest_opprof_select_baseline``: eager or compile, measured in ``optimized``."""
        timing = optimized.timing
        choice = wr.hooks.pytest_opprof_select_baseline(workload=wr, timing=timing)
        usable = sorted(
            s.baseline for s in timing.speedups if s.candidate == "optimized" and s.baseline
        )
        if choice not in usable:
            raise StageError(
                f"pytest_opprof_select_baseline returned {choice!r}; the baselines measured "
                f"against the optimized model are {', '.join(usable) or 'none'}"
            )
        return str(choice)

    def summarize(self, wr: WorkloadRun) -> WorkloadSummary:
        out = wr.out_dir
        status: Literal["passed", "failed", "error"] = "passed"
        message, stage_reached = "", "capture"
        for s in STAGES[:-1]:
            o = wr.outcomes.get(s)
            if o is None:
                continue
            stage_reached = s
            if o.status != "passed":
                # the first stage that did not pass is the cause; later ones were blocked by it
                status = "error" if o.status == "error" else "failed"
                message = f"{s}: {o.message}"
                break
        summary = WorkloadSummary(
            name=wr.name,
            path=_display(wr.spec.path),
            status=status,
            stage=stage_reached,
            message=message,
            report=_display(out / "report.md"),
        )
        selection = _maybe(wr.profiler_output / "backend_selection.json", BackendSelection)
        if selection is not None:
            summary.passes = list(selection.plan.proposals)
            summary.dtype = selection.plan.dtype or None
        if status != "passed":
            return summary
        try:
            optimized = read_artifact(out / "profile_optimized.json", Profile)
        except ArtifactError as exc:
            # a passed recapture without its profile is no speedup: never a green gate
            summary.status, summary.stage = "error", "recapture"
            summary.message = f"recapture: {exc}"
            return summary
        t = optimized.timing
        baseline = self.gate_baseline(wr, optimized)
        ratio = _find(t.speedups, baseline, "optimized")
        summary.baseline = baseline
        summary.baseline_ms = t.variants[baseline].median_ms
        summary.optimized_ms = t.variants["optimized"].median_ms
        summary.eager_ms = t.variants["eager"].median_ms
        summary.compile_ms = t.variants["compile"].median_ms
        vs_eager = _find(t.speedups, "eager", "optimized")
        vs_compile = _find(t.speedups, "compile", "optimized")
        summary.speedup_vs_eager = vs_eager.ratio if vs_eager else None
        summary.speedup_vs_compile = vs_compile.ratio if vs_compile else None
        summary.speedups = list(t.speedups)
        if ratio is None:
            summary.status, summary.message = "error", "no interleaved speedup was measured"
            return summary
        summary.speedup, summary.ci_low, summary.ci_high = ratio.ratio, ratio.ci_low, ratio.ci_high
        min_speedup = float(wr.setting("min_speedup"))
        ok, why = gate_verdict(ratio, min_speedup, strict=self.options.strict_gate)
        on_cpu = optimized.capture_metadata.device_type == "cpu"
        if on_cpu and not self.options.gate_on_cpu:
            summary.enforced = False
            summary.message = f"{CPU_NOT_ENFORCED} ({why}; --opprof-gate-on-cpu enforces it)"
        elif not ok:
            summary.status = "failed"
            summary.message = f"{why}; see {summary.report}"
        else:
            summary.message = why
        if self.compare_with is not None:  # across commits: may fail it (history.judge)
            from pytest_opprof.history import judge

            judge(summary, out, self.compare_with, self.options.compare_fail, optimized)
        return summary

    def write_report(self, wr: WorkloadRun, summary: WorkloadSummary) -> None:
        from pytest_opprof.report import WorkloadArtifacts, render_workload_report

        out = wr.out_dir
        notes = wr.profiler_output / "implementation_notes.md"
        artifacts = WorkloadArtifacts(
            name=wr.name,
            path=_display(wr.spec.path),
            out_dir=out,
            profile=_classified(_maybe(out / "profile.json", Profile)),
            optimizations=_maybe(out / "optimizations.json", Optimizations),
            selection=_maybe(wr.profiler_output / "backend_selection.json", BackendSelection),
            validation=_maybe(wr.profiler_output / "validation_report.json", ValidationReport),
            optimized=_classified(_maybe(out / "profile_optimized.json", Profile)),
            summary=summary,
            implementation_notes=notes.read_text(encoding="utf-8") if notes.exists() else None,
            stage_errors={s: o.message for s, o in wr.outcomes.items() if o.status != "passed"},
            min_speedup=float(wr.setting("min_speedup")),
            gate_baseline=summary.baseline or str(wr.setting("baseline")),
            strict_gate=self.options.strict_gate,
            gate_on_cpu=self.options.gate_on_cpu,
        )
        found = wr.hooks.pytest_opprof_report_sections(artifacts=artifacts)
        sections = [section for batch in found for section in batch or ()]
        for section in sections:
            if not (
                isinstance(section, tuple)
                and len(section) == 2
                and all(isinstance(x, str) for x in section)
            ):
                raise StageError(
                    f"pytest_opprof_report_sections returned {section!r}; each section is a "
                    "(title, markdown) pair of strings"
                )
        if summary.comparison is not None:
            from pytest_opprof.report.trend import comparison_section

            sections.append(comparison_section(summary))
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            out / "report.md", render_workload_report(artifacts, extra_sections=sections)
        )
        self.summaries[wr.name] = summary
        write_artifact(out / SUMMARY_FILE, summary)

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
        self, summaries: list[WorkloadSummary], device: str
    ) -> tuple[Path, SessionSummary]:
        """``session.json`` and the session ``report.md``: the report's path and the verdict."""
        from pytest_opprof.history import record_session
        from pytest_opprof.report import render_session_report

        out = self.options.out
        verdict = session_summary(summaries, device)
        # the commit measured; with --opprof-save the stored run; the section across runs
        across = record_session(self.options, self.compare_with, verdict, summaries)
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
                path=_display(spec.path),
                status="error",
                stage="report",
                message=report.message,
            )
        optimized = _maybe(out / "profile_optimized.json", Profile)
        result = Result(
            name=wr.name,
            summary=summary,
            profile=_maybe(out / "profile.json", Profile),
            optimizations=_maybe(out / "optimizations.json", Optimizations),
            selection=_maybe(wr.profiler_output / "backend_selection.json", BackendSelection),
            validation=_maybe(wr.profiler_output / "validation_report.json", ValidationReport),
            optimized=optimized,
            speedup=_find(optimized.timing.speedups, summary.baseline, "optimized")
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
        prof = _maybe(out / s.name / "profile.json", Profile)
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


def _find(speedups: list[Speedup], baseline: str, candidate: str) -> Speedup | None:
    return next((s for s in speedups if s.baseline == baseline and s.candidate == candidate), None)


def _classified(profile: Profile | None) -> Profile | None:
    """The profile with each operator's bottleneck class (the propose stage's classifier), so
    the report's operator tables show it; profile.json itself stays as captured."""
    if profile is None:
        return None
    from pytest_opprof.propose.classify import classify

    return classify(profile)


def _maybe(path: Path, model: Any) -> Any:
    try:
        return read_artifact(path, model) if path.exists() else None
    except ArtifactError:
        return None


def _display(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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
                report = _display(dst / "report.md")
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
