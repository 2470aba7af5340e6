"""What the report's sections read off a workload's artifacts: the gate's baseline and figures,
per-iteration operator time, the dtype change, waterfall steps and each proposal's status.

Every answer is copied or derived (ratios, per-iteration division) from an artifact; where the
artifact is missing, :func:`not_available` says which stage did not run and why.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_opprof import STAGES
from pytest_opprof.backend.plan import replaced_by_model_graph
from pytest_opprof.report.format import fmt_dtype, one_line
from pytest_opprof.schema import (
    BackendSelection,
    OperatorAggregate,
    Profile,
    Proposal,
    Speedup,
    Timeline,
    WaterfallStep,
)

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

TIMELINE_LABELS = {"eager": ("eager",), "compile": ("compiled", "compile")}
WHOLE_GRAPH = "whole-model CUDA graph"
SUPERSEDED = (
    "superseded: its gain was kept, then one CUDA graph of the whole call (cuda_graphs-model) "
    "replaced Inductor's per-graph CUDA graphs"
)


def not_available(a: WorkloadArtifacts, stage: str) -> str:
    """``_Not available (stage X did not run: why)._``: the stage's own error, else the earlier
    stage that blocked it, else the summary's message."""
    reason = a.stage_errors.get(stage)
    if reason is None:
        for earlier in STAGES[: STAGES.index(stage)]:
            if earlier in a.stage_errors:
                reason = f"blocked by {earlier}: {a.stage_errors[earlier]}"
                break
    blocked = a.validation is not None and a.validation.overall == "BLOCKED"
    if reason is None and stage == "recapture" and a.validation is not None and blocked:
        reason = f"validation BLOCKED: {a.validation.message or 'see Validation'}"
    if reason is None and a.summary.stage == stage and a.summary.message:
        reason = a.summary.message
    if reason is None:
        reason = "its artifact was not found"
    return f"_Not available (stage {stage} did not run: {one_line(reason)})._"


def gate_baseline(a: WorkloadArtifacts) -> str | None:
    """The baseline the gate compared against, resolved (eager, compile or stock)."""
    if a.summary.baseline:
        return a.summary.baseline
    if a.gate_baseline in ("eager", "compile", "stock"):
        return a.gate_baseline
    for prof in (a.optimized, a.profile):
        variants = prof.timing.variants if prof else {}
        if "eager" in variants and "compile" in variants:
            faster = variants["compile"].median_ms < variants["eager"].median_ms
            return "compile" if faster else "eager"
    return None


def baseline_timeline(profile: Profile, baseline: str | None) -> Timeline | None:
    for label in TIMELINE_LABELS.get(baseline or "eager", ()):
        found = profile.timeline(label)
        if found is not None:
            return found
    return profile.primary if (baseline or "eager") == "eager" and profile.timelines else None


def find_speedup(profile: Profile | None, baseline: str, candidate: str) -> Speedup | None:
    if profile is None:
        return None
    return next(
        (s for s in profile.timing.speedups if (s.baseline, s.candidate) == (baseline, candidate)),
        None,
    )


def gate_figures(
    a: WorkloadArtifacts,
) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """(speedup, CI low, CI high, baseline ms, optimized ms) against the gate's baseline: the
    session summary's figures, else the recapture's own interleaved measurement."""
    s = a.summary
    if s.speedup is not None:
        return s.speedup, s.ci_low, s.ci_high, s.baseline_ms, s.optimized_ms
    base = gate_baseline(a)
    r = find_speedup(a.optimized, base, "optimized") if base else None
    if r is None or a.optimized is None:
        return None, None, None, None, None
    variants = a.optimized.timing.variants
    b, o = variants.get(r.baseline), variants.get(r.candidate)
    return (r.ratio, r.ci_low, r.ci_high, b.median_ms if b else None, o.median_ms if o else None)


def gate_enforced(a: WorkloadArtifacts) -> bool:
    """False where the gate does not hold a CPU figure to account: the summary says so once the
    gate ran, the profile before it (a workload that stopped at an earlier stage)."""
    cpu = a.profile is not None and a.profile.capture_metadata.cpu_fallback
    return a.summary.enforced and not (cpu and not a.gate_on_cpu)


def on_cpu(a: WorkloadArtifacts) -> bool:
    """CPU fallback: operator time is then the CPU time, and there are no GPU kernels."""
    prof = a.profile or a.optimized
    return prof is not None and prof.capture_metadata.device_type == "cpu"


def op_time(op: OperatorAggregate, cpu: bool) -> float:
    return op.cpu_time_us if cpu else op.gpu_time_us


def time_label(cpu: bool) -> str:
    return "CPU time" if cpu else "GPU time"


def per_iter_divisor(t: Timeline, cpu: bool = False) -> float:
    """What turns the timeline's aggregates into per-iteration figures.

    ``aggregated[]`` may hold totals over the profiled iterations or per-iteration values; the
    summary's device time per iteration tells which (their sum matches one or the other).
    """
    n = t.summary.iterations
    per_iter = t.summary.device_time_per_iter_us
    total = sum(op_time(op, cpu) for op in t.aggregated)
    total += sum(k.duration_us for k in t.unattributed_kernels)
    if n <= 1 or per_iter <= 0 or total <= 0:
        return 1.0
    return float(n) if abs(total / n - per_iter) < abs(total - per_iter) else 1.0


def unattributed_us(t: Timeline, cpu: bool = False) -> float:
    return sum(k.duration_us for k in t.unattributed_kernels) / per_iter_divisor(t, cpu)


def has_counters(profile: Profile) -> bool:
    for t in profile.timelines:
        for op in t.operators:
            for k in op.kernels:
                if any(v is not None for v in k.metrics.values()):
                    return True
        if any(any(v is not None for v in agg.metrics.values()) for agg in t.aggregated):
            return True
    return False


def dtype_change(a: WorkloadArtifacts) -> tuple[str | None, str | None]:
    """(the baseline's dtype, the backend's where it changed it, else None)."""
    before = a.profile.capture_metadata.dtype if a.profile else None
    after: str | None = None
    if a.selection is not None and a.selection.plan.dtype:
        after = a.selection.plan.dtype
    elif a.optimized is not None:
        after = a.optimized.capture_metadata.dtype
    if before and after and fmt_dtype(before) == fmt_dtype(after):
        after = None
    return before, after


def waterfall_steps(sel: BackendSelection) -> list[WaterfallStep]:
    """The steps after the reference: selection may record the reference itself as step 0."""
    steps = list(sel.waterfall)
    if steps and steps[0].step == sel.reference and steps[0].speedup_added == 1.0:
        steps = steps[1:]
    return steps


def step_proposals(step: WaterfallStep, proposals: Sequence[Proposal]) -> list[Proposal]:
    """Proposals a waterfall step applied: its name is a proposal id or type, or ends with the
    ids it carried in parentheses (``+layout (P1, P2)``)."""
    exact = [p for p in proposals if step.step in (p.id, p.type)]
    if exact:
        return exact[:1]
    found = re.search(r"\(([^()]*)\)\s*$", step.step)
    ids = [x.strip() for x in found.group(1).split(",")] if found else []
    by_id = {p.id: p for p in proposals}
    return [by_id[i] for i in dict.fromkeys(ids) if i in by_id]


def proposal_status(a: WorkloadArtifacts, p: Proposal) -> str:
    """APPLIED / NOT_APPLIED / FAILED from validation, or why selection left it out."""
    checked = next(
        (c for c in (a.validation.llm_passes if a.validation else []) if c.name == p.id), None
    )
    if checked is not None:
        return (
            f"LLM-written code, not in the backend; stage 3 ran it apart: {checked.status} "
            f"({one_line(checked.detail, 200)})"
        )
    if a.selection is not None:
        for d in a.selection.dropped:
            if d.id == p.id:
                return f"dropped: {one_line(d.reason, 200)}"
    in_plan = a.selection is not None and p.id in a.selection.plan.proposals
    if (
        in_plan
        and a.selection is not None
        and replaced_by_model_graph(a.selection.plan, p.type, p.params.get("scope"))
    ):
        return SUPERSEDED
    if a.validation is not None:
        for ps in a.validation.passes:
            if ps.name in (p.id, p.type):
                return ps.status + (f" ({one_line(ps.detail, 160)})" if ps.detail else "")
        if in_plan:
            return "in the chosen plan (non-graph change, no pass record)"
    if a.selection is None:
        return "unknown (stage backend did not run)"
    if in_plan:
        return "in the chosen plan (not validated)"
    return f"not in the chosen variant ({a.selection.chosen})"


def is_applied(status: str) -> bool:
    """A :func:`proposal_status` of a change the optimized backend carries."""
    return status.startswith(("APPLIED", "in the chosen plan"))


def selection_additions(a: WorkloadArtifacts) -> list[tuple[str, str]]:
    """Variants selection tried that no proposal asked for (CUDA graphs on a GPU), kept or
    dropped, with what validation recorded for them."""
    if a.selection is None or a.optimizations is None:
        return []
    proposed = {p.id for p in a.optimizations.proposals}
    out: list[tuple[str, str]] = []
    dropped = {d.id: d.reason for d in a.selection.dropped}
    for pid in [*a.selection.plan.proposals, *dropped]:
        if pid in proposed or pid in {x for x, _ in out}:
            continue
        if pid in dropped:
            out.append((pid, f"dropped: {one_line(dropped[pid], 200)}"))
            continue
        record = next(
            (
                ps
                for ps in (a.validation.passes if a.validation else [])
                # Validation reports of earlier versions named this record by its type.
                if ps.name == pid or (ps.detail.startswith(WHOLE_GRAPH) and pid.endswith("-model"))
            ),
            None,
        )
        status = "in the chosen plan"
        kind, _, scope = pid.rpartition("-")
        if replaced_by_model_graph(a.selection.plan, kind, scope):
            status = SUPERSEDED
        elif record is not None:
            status = record.status + (f" ({one_line(record.detail, 160)})" if record.detail else "")
        out.append((pid, status))
    return out


def applied_changes(a: WorkloadArtifacts) -> list[str] | None:
    """The ids of the chosen plan that the optimized backend carries, in the plan's order: its
    proposals and selection's own additions, less those dropped, superseded or not applied.
    The session summary's passes where selection did not run; None where neither says."""
    if a.selection is None:
        return list(a.summary.passes) if a.summary.passes else None
    by_id = {p.id: p for p in (a.optimizations.proposals if a.optimizations else [])}
    added = dict(selection_additions(a))
    applied = []
    for pid in a.selection.plan.proposals:
        p = by_id.get(pid)
        status = proposal_status(a, p) if p is not None else added.get(pid, "in the chosen plan")
        if is_applied(status):
            applied.append(pid)
    return applied
