"""Stage 5, report: the workload's ``report.md``, its summary, and the gate's verdict, which
the ``::speedup`` item asserts. It runs in the parent (no user code) and needs the session
(the options, the stored run of ``--opprof-compare``, where the summaries are kept), so it is
called by ``session.OpprofSession`` rather than registered with the stages that take only
the workload's run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pytest_opprof import STAGES
from pytest_opprof.errors import ArtifactError, OpprofError, StageError
from pytest_opprof.measure import gate_verdict
from pytest_opprof.options import OpprofOptions
from pytest_opprof.pipeline import STOCK_FILE, StageOutcome, WorkloadRun, rel_path
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
    BackendSelection,
    Optimizations,
    Profile,
    Speedup,
    StockBaseline,
    ValidationReport,
    WorkloadSummary,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages.capture import await_counters

if TYPE_CHECKING:
    from pytest_opprof.session import OpprofSession

NAME = "report"
SUMMARY_FILE = "workload_summary.json"


def run(session: OpprofSession, wr: WorkloadRun) -> StageOutcome:
    """Stage 5: the workload's report and the gate's verdict, as the outcome of its
    ``::speedup`` item; the summary is kept in ``session.summaries``."""
    start = time.perf_counter()
    try:
        summary = summarize(session, wr)
        write_report(wr, summary, session.options)
        session.summaries[wr.name] = summary
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


def gate_baseline(wr: WorkloadRun, optimized: Profile) -> str:
    """``pytest_opprof_select_baseline``: eager or compile, measured in ``optimized``."""
    timing = optimized.timing
    choice = wr.hooks.pytest_opprof_select_baseline(workload=wr, timing=timing)
    usable = sorted(
        s.baseline for s in timing.speedups if s.candidate == "optimized" and s.baseline
    )
    if choice == "stock" and choice not in usable:
        raise StageError(
            f"the gate's baseline is stock, which was not measured: {_why_no_stock(wr)}"
        )
    if choice not in usable:
        raise StageError(
            f"pytest_opprof_select_baseline returned {choice!r}; the baselines measured "
            f"against the optimized model are {', '.join(usable) or 'none'}"
        )
    return str(choice)


def _why_no_stock(wr: WorkloadRun) -> str:
    if not wr.measures_stock():
        return "run with --opprof-stock"
    found = maybe_artifact(wr.out_dir / STOCK_FILE, StockBaseline)
    return found.message if found else f"{STOCK_FILE} is missing; see the recapture's log"


def summarize(session: OpprofSession, wr: WorkloadRun) -> WorkloadSummary:
    """The gate's verdict and figures for ``wr`` from its stage outcomes and artifacts: the
    first stage that did not pass fails it, and so does a missing or unreadable recapture.
    It first waits for the counters pass run beside the stages, whose counters it reports."""
    await_counters(wr)
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
        path=rel_path(wr.spec.path),
        status=status,
        stage=stage_reached,
        message=message,
        report=rel_path(out / "report.md"),
    )
    selection = maybe_artifact(wr.profiler_output / "backend_selection.json", BackendSelection)
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
    baseline = gate_baseline(wr, optimized)
    ratio = find_speedup(t.speedups, baseline, "optimized")
    summary.baseline = baseline
    summary.baseline_ms = t.variants[baseline].median_ms
    summary.optimized_ms = t.variants["optimized"].median_ms
    summary.eager_ms = t.variants["eager"].median_ms
    summary.compile_ms = t.variants["compile"].median_ms
    vs_eager = find_speedup(t.speedups, "eager", "optimized")
    vs_compile = find_speedup(t.speedups, "compile", "optimized")
    summary.speedup_vs_eager = vs_eager.ratio if vs_eager else None
    summary.speedup_vs_compile = vs_compile.ratio if vs_compile else None
    vs_stock = find_speedup(t.speedups, "stock", "optimized")
    if vs_stock is not None:
        chosen = maybe_artifact(wr.out_dir / STOCK_FILE, StockBaseline)
        summary.stock_ms = t.variants["stock"].median_ms
        summary.speedup_vs_stock = vs_stock.ratio
        summary.stock = chosen.description if chosen else None
        summary.stock_dtype = chosen.dtype if chosen else None
    elif wr.measures_stock():
        summary.stock_note = _why_no_stock(wr)
    summary.speedups = list(t.speedups)
    if ratio is None:
        summary.status, summary.message = "error", "no interleaved speedup was measured"
        return summary
    summary.speedup, summary.ci_low, summary.ci_high = ratio.ratio, ratio.ci_low, ratio.ci_high
    min_speedup = float(wr.setting("min_speedup"))
    ok, why = gate_verdict(ratio, min_speedup, strict=session.options.strict_gate)
    on_cpu = optimized.capture_metadata.device_type == "cpu"
    if on_cpu and not session.options.gate_on_cpu:
        summary.enforced = False
        summary.message = f"{CPU_NOT_ENFORCED} ({why}; --opprof-gate-on-cpu enforces it)"
    elif not ok:
        summary.status = "failed"
        summary.message = f"{why}; see {summary.report}"
    else:
        summary.message = why
    if session.compare_with is not None:  # across commits: may fail it (history.judge)
        from pytest_opprof.history import judge

        judge(summary, out, session.compare_with, session.options.compare_fail, optimized)
    return summary


def write_report(wr: WorkloadRun, summary: WorkloadSummary, options: OpprofOptions) -> None:
    """``report.md`` (with the hooks' sections) and ``workload_summary.json``."""
    from pytest_opprof.report import WorkloadArtifacts, render_workload_report

    out = wr.out_dir
    notes = wr.profiler_output / "implementation_notes.md"
    artifacts = WorkloadArtifacts(
        name=wr.name,
        path=rel_path(wr.spec.path),
        out_dir=out,
        profile=_classified(maybe_artifact(out / "profile.json", Profile)),
        optimizations=maybe_artifact(out / "optimizations.json", Optimizations),
        selection=maybe_artifact(wr.profiler_output / "backend_selection.json", BackendSelection),
        validation=maybe_artifact(wr.profiler_output / "validation_report.json", ValidationReport),
        optimized=_classified(maybe_artifact(out / "profile_optimized.json", Profile)),
        summary=summary,
        implementation_notes=notes.read_text(encoding="utf-8") if notes.exists() else None,
        stage_errors={s: o.message for s, o in wr.outcomes.items() if o.status != "passed"},
        min_speedup=float(wr.setting("min_speedup")),
        gate_baseline=summary.baseline or str(wr.setting("baseline")),
        strict_gate=options.strict_gate,
        gate_on_cpu=options.gate_on_cpu,
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
    write_text_atomic(out / "report.md", render_workload_report(artifacts, extra_sections=sections))
    write_artifact(out / SUMMARY_FILE, summary)


def find_speedup(speedups: list[Speedup], baseline: str, candidate: str) -> Speedup | None:
    return next((s for s in speedups if s.baseline == baseline and s.candidate == candidate), None)


def maybe_artifact(path: Path, model: Any) -> Any:
    """The artifact at ``path``, or None where it is missing or does not validate."""
    try:
        return read_artifact(path, model) if path.exists() else None
    except ArtifactError:
        return None


def _classified(profile: Profile | None) -> Profile | None:
    """The profile with each operator's bottleneck class (the propose stage's classifier), so
    the report's operator tables show it; profile.json itself stays as captured."""
    if profile is None:
        return None
    from pytest_opprof.propose.classify import classify

    return classify(profile)
