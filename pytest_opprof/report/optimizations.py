"""The report's sections about proposals: what the propose stage found, with its evidence and
what became of each; how its estimates compare with the savings selection measured; and what
is left to gain.

Estimates come from ``optimizations.json``, measurements from ``backend_selection.json``'s
waterfall, statuses from validation and selection (``lookups.proposal_status``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pytest_opprof.report.format import (
    DASH,
    bullet,
    code,
    fmt_count,
    fmt_pct,
    fmt_us,
    fmt_x,
    one_line,
    para,
    table,
)
from pytest_opprof.report.lookups import (
    is_applied,
    not_available,
    on_cpu,
    op_time,
    per_iter_divisor,
    proposal_status,
    selection_additions,
    step_proposals,
    waterfall_steps,
)
from pytest_opprof.report.selection import paired_ms
from pytest_opprof.schema import Proposal

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

TARGETS_CELL = 60
STATUS_CELL = 90
"""Characters of a proposal's targets and status in the table; its details give them whole."""


def _targets(p: Proposal) -> str:
    return ", ".join(code(t) for t in p.targets) or DASH


def _details(a: WorkloadArtifacts, p: Proposal) -> list[str]:
    """One proposal in full: status, targets, estimate, evidence, steps and rationale."""
    lines = [f"### {p.id} · {p.type}", ""]
    lines += bullet(f"**Status:** {proposal_status(a, p)}")
    lines += bullet(f"**Targets:** {_targets(p)}")
    lines += bullet(f"**Confidence:** {p.confidence} (source: {p.source})")
    lines += bullet(
        f"**Estimated impact:** {fmt_us(p.impact.estimated_saving_us)} per iteration, "
        f"{fmt_x(p.impact.estimated_speedup)} — {one_line(p.impact.basis)}"
    )
    if p.depends_on:
        lines += bullet(f"**Depends on:** {', '.join(p.depends_on)}")
    if p.evidence:
        lines.append("- **Evidence:**")
        for e in p.evidence:
            value = f"{e.value:g}" if isinstance(e.value, float) else str(e.value)
            unit = f" {e.unit}" if e.unit else ""
            lines += bullet(
                f"{code(e.metric)} = {code(value + unit, 90)} ({code(e.source, 120)})", level=1
            )
    if p.fx_steps:
        lines.append("- **Steps:**")
        for i, step in enumerate(p.fx_steps, 1):
            lines += bullet(one_line(step), marker=f"{i}. ", level=1)
    if p.rationale:
        lines += bullet(f"**Rationale:** {one_line(p.rationale, 1000)}")
    return [*lines, ""]


def section_optimizations(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Optimizations", ""]
    opts = a.optimizations
    if opts is None:
        return [*lines, *para(not_available(a, "propose"))]
    if not opts.proposals:
        lines += ["No proposal: the rules found nothing to change in this profile.", ""]
    else:
        rows = [
            [
                p.id,
                p.type,
                p.ir_level,
                _targets(p),
                p.confidence,
                f"{fmt_us(p.impact.estimated_saving_us)}, {fmt_x(p.impact.estimated_speedup)}",
                proposal_status(a, p),
            ]
            for p in opts.proposals
        ]
        lines += table(
            ["id", "type", "IR level", "targets", "confidence", "estimated", "status"],
            rows,
            caps={3: TARGETS_CELL, 6: STATUS_CELL},
            elsewhere=True,  # each proposal's details below give its targets and status whole
        )
        lines += ["Each proposal in full follows the table.", ""]
    added = selection_additions(a)
    if added:
        lines += ["Added by measured selection (tried on every GPU workload, not proposed):", ""]
        for pid, status in added:
            lines += bullet(f"`{pid}`: {status}")
        lines.append("")
    for p in opts.proposals:
        lines += _details(a, p)
    if opts.global_notes:
        lines += ["Notes from the propose stage:", ""]
        for n in opts.global_notes:
            lines += bullet(one_line(n, 1000))
        lines.append("")
    return lines


def section_estimated_vs_measured(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Estimated vs measured impact", ""]
    if a.optimizations is None:
        return [*lines, *para(not_available(a, "propose"))]
    if a.selection is None:
        return [*lines, *para(not_available(a, "backend"))]
    proposals = a.optimizations.proposals
    if not proposals:
        return [*lines, "No proposal, so nothing to compare.", ""]
    steps = waterfall_steps(a.selection)
    rows = []
    measured: set[str] = set()
    prev_ms = a.selection.reference_ms
    for step in steps:
        group = step_proposals(step, proposals)
        measured.update(p.id for p in group)
        est_us = sum(p.impact.estimated_saving_us for p in group)
        est_x = math.prod(p.impact.estimated_speedup for p in group) if group else None
        # in the step's own rounds where recorded (schema 1.4 on), else chained latencies
        after_ms, above_ms = paired_ms(step) or (step.latency_ms, prev_ms)
        saved_us = (above_ms - after_ms) * 1000
        prev_ms = step.latency_ms
        rows.append(
            [
                ", ".join(f"{p.id} {p.type}" for p in group) or step.step,
                fmt_us(est_us) if group else DASH,
                fmt_x(est_x),
                fmt_us(saved_us),
                fmt_x(step.speedup_added),
                f"{saved_us / est_us:.2f}" if est_us > 0 else DASH,
            ]
        )
    for p in proposals:
        if p.id not in measured:
            rows.append(
                [
                    f"{p.id} {p.type}",
                    fmt_us(p.impact.estimated_saving_us),
                    fmt_x(p.impact.estimated_speedup),
                    f"not measured ({proposal_status(a, p)})",
                    DASH,
                    DASH,
                ]
            )
    lines += table(
        [
            "proposals",
            "estimated saving",
            "estimated speedup",
            "measured saving",
            "measured speedup (added)",
            "measured / estimated",
        ],
        rows,
        caps={0: 80, 3: STATUS_CELL},
    )
    lines += para(
        "Estimated: `optimizations.json` (`impact`, from the roofline model; summed over the "
        "proposals a step carried). Measured: that step of the waterfall, the plan above's "
        "latency minus the step's in the same interleaved rounds"
        + (
            " (a selection written before schema 1.4: the difference of chained latencies, "
            "an estimate)"
            if any(paired_ms(s) is None for s in steps)
            else ""
        )
        + ". A ratio well below 1 means the model was optimistic."
    )
    return lines


def section_remaining(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Remaining opportunities", ""]
    found = False
    if a.optimizations is not None:
        for p in a.optimizations.proposals:
            status = proposal_status(a, p)
            if not is_applied(status):
                found = True
                lines += bullet(
                    f"{p.id} {p.type} on {', '.join(code(t) for t in p.targets)}: "
                    f"{status}; estimated {fmt_us(p.impact.estimated_saving_us)}, "
                    f"{fmt_x(p.impact.estimated_speedup)}."
                )
    else:
        lines += bullet(f"Proposals: {not_available(a, 'propose')}")
    prof, artifact = (a.optimized, "optimized") if a.optimized else (a.profile, "baseline")
    if prof is not None and prof.timelines:
        t = prof.primary
        cpu = on_cpu(a)
        div = per_iter_divisor(t, cpu)
        dominant = [
            op for op in sorted(t.aggregated, key=lambda op: -op.share)[:3] if op.share >= 0.1
        ]
        for op in dominant:
            found = True
            lines += bullet(
                f"{code(op.name)} still takes {fmt_pct(op.share)} of the {artifact} "
                f"timeline ({fmt_us(op_time(op, cpu) / div)} per iteration, "
                f"{fmt_count(op.kernel_count / div)} kernels), bottleneck "
                f"{op.bottleneck or 'not classified'}."
            )
        s = t.summary
        if s.idle_time_per_iter_us and s.device_time_per_iter_us and s.wall_time_per_iter_us:
            idle = s.idle_time_per_iter_us / s.wall_time_per_iter_us
            if idle >= 0.2:
                found = True
                lines += bullet(
                    f"The GPU is idle {fmt_pct(idle)} of the {artifact} iteration "
                    f"({fmt_us(s.idle_time_per_iter_us)}): launch-bound."
                )
    if not found:
        lines.append(
            "None: every proposal was applied and no operator takes 10% or more of "
            "the optimized timeline."
        )
    return [*lines, ""]
