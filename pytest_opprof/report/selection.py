"""The report's sections about the backend stage and its check: the variants selection timed
and the one it chose, validation's steps, and the per-pass waterfall of what drove the speedup.

Figures come from ``backend_selection.json``, ``validation_report.json`` and the notes the
backend stage wrote; the recapture's latency (``profile_optimized.json``) is set beside
selection's brief timings, because that is the gate's figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_opprof.report import plots as _plots
from pytest_opprof.report.format import (
    BASELINE_LABELS,
    DASH,
    bullet,
    code,
    fit_markdown,
    fmt_dtype,
    fmt_ms,
    fmt_speedup,
    fmt_x,
    one_line,
    para,
    table,
)
from pytest_opprof.report.lookups import gate_baseline, gate_figures, not_available, waterfall_steps
from pytest_opprof.schema import (
    VALIDATION_STEPS,
    BackendPlan,
    BackendSelection,
    LatencyStats,
    VariantResult,
    WaterfallStep,
)

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

PLAN_CELL = 70
DETAIL_CELL = 120
"""Characters of a plan or a detail in a table; the full text follows the table."""


def plan_text(plan: BackendPlan) -> str:
    parts = []
    if plan.dtype:
        parts.append(f"dtype {fmt_dtype(plan.dtype)}")
    if plan.channels_last:
        parts.append("channels_last")
    if plan.pad_batch_to:
        parts.append(f"batch padded to {plan.pad_batch_to}")
    if plan.functional:
        parts.append("functional passes " + ", ".join(plan.functional))
    if plan.aten:
        parts.append("aten passes " + ", ".join(plan.aten))
    if plan.config_patches:
        parts.append(
            "Inductor config "
            + ", ".join(f"{k}={v}" for k, v in sorted(plan.config_patches.items()))
        )
    if plan.cuda_graph_model:
        parts.append("one CUDA graph of the whole call")
    return "; ".join(parts) or "no change (the reference itself)"


def _demote(markdown: str) -> list[str]:
    """Nest the notes' own headings under this section's (``#`` → ``###``), outside code."""
    out, fenced = [], False
    for line in markdown.strip("\n").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        out.append("##" + line if not fenced and line.startswith("#") else line)
    return out


def _paired_text(v: VariantResult) -> str:
    """A rung's measured ratio over the plan below it, with that plan's latency in the same
    rounds: ``1.53× (95% CI 1.50–1.56) over `compile` at 4.401 ms``."""
    p = v.paired
    if p is None:
        return DASH
    at = f" at {fmt_ms(v.paired_baseline_ms)}" if v.paired_baseline_ms is not None else ""
    return f"{fmt_speedup(p.ratio, p.ci_low, p.ci_high)} over {code(p.baseline)}{at}"


def _vs_reference(v: VariantResult) -> str:
    """Eager's and torch.compile's speedup over the reference was measured in their one run; a
    rung's is chained from the paired ratios (before schema 1.4 too), and says so."""
    if v.speedup is None:
        return DASH
    return fmt_x(v.speedup) if v.name in BASELINE_LABELS else f"{fmt_x(v.speedup)} (chained, est.)"


def _variants(sel: BackendSelection) -> list[str]:
    rows = [
        [
            i,
            code(v.name),
            plan_text(v.plan),
            fmt_ms(v.latency.median_ms) if v.latency else DASH,
            _paired_text(v),
            _vs_reference(v),
            DASH if v.numerics is None else ("ok" if v.numerics.ok else "out of tolerance"),
            one_line(v.error, 400) if v.error else "",
        ]
        for i, v in enumerate(sel.variants, 1)
    ]
    lines = table(
        [
            "#",
            "variant",
            "plan",
            "latency (measured)",
            "against the plan below, same rounds (measured)",
            "vs reference",
            "numerics",
            "error",
        ],
        rows,
        caps={2: PLAN_CELL, 7: DETAIL_CELL},
    )
    return lines + para(
        "Latency: the median per call; eager and torch.compile as the capture timed them, "
        "in one interleaved run, each rung in its own brief run in selection, paired with "
        "the plan below it; the plan below's latency in those rounds over the rung's is its "
        "paired ratio. A rung's speedup over the reference is chained from the paired "
        "ratios (est.), not its latency over the reference's: those were timed in "
        "different runs."
    )


def section_implementation(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Implementation notes", ""]
    sel = a.selection
    if sel is None:
        lines += para(not_available(a, "backend"))
    else:
        lines += para(
            f"Chosen variant {code(sel.chosen)}: {plan_text(sel.plan)}. Reference "
            f"{BASELINE_LABELS.get(sel.reference, sel.reference)} at {fmt_ms(sel.reference_ms)} "
            "(brief timing during selection, `backend_selection.json`)."
        )
        if sel.variants:
            lines += _variants(sel)
        if sel.dropped:
            lines += ["Dropped by measurement (never ship slower):", ""]
            for d in sel.dropped:
                lines += bullet(f"{d.id} ({d.type}): {one_line(d.reason, 400)}")
            lines.append("")
    if a.implementation_notes:
        lines += ["From `profiler_output/implementation_notes.md`:", ""]
        lines += [*fit_markdown("\n".join(_demote(a.implementation_notes))), ""]
    elif sel is not None:
        lines += ["_`profiler_output/implementation_notes.md` was not written._", ""]
    return lines


def section_validation(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Validation", ""]
    v = a.validation
    if v is None:
        return [*lines, *para(not_available(a, "validate"))]
    lines += para(
        f"**{v.overall}**"
        + (f" — {one_line(v.message, 600)}" if v.message else "")
        + f" (backend {code(v.backend)}, file {code(v.file)})"
    )
    names = [s for s in VALIDATION_STEPS if s in v.steps] + [
        s for s in v.steps if s not in VALIDATION_STEPS
    ]
    lines += table(
        ["#", "step", "status", "detail"],
        [
            [i, n, v.steps[n].status, one_line(v.steps[n].detail, 600)]
            for i, n in enumerate(names, 1)
        ],
        caps={3: DETAIL_CELL},
        key=1,
    )
    if v.passes:
        lines += table(
            ["pass", "status", "matches", "detail"],
            [[p.name, p.status, p.matches, one_line(p.detail, 600)] for p in v.passes],
            caps={3: DETAIL_CELL},
        )
    if v.numerics is not None:
        n = v.numerics
        lines += para(
            f"Numerics ({fmt_dtype(n.dtype)}): max abs error {n.max_abs_err:.3g}, "
            f"relative error {n.rel_err:.3g} (rtol {n.rtol:g}, atol {n.atol:g}) — "
            f"{'within' if n.ok else 'OUT OF'} tolerance."
        )
    if v.checks:
        lines += table(
            ["check", "status", "detail"],
            [[k, c.status, one_line(c.detail, 600)] for k, c in v.checks.items()],
            caps={2: DETAIL_CELL},
        )
    return lines


def paired_ms(s: WaterfallStep) -> tuple[float, float] | None:
    """A step's measured latency and the plan above's in the same rounds (schema 1.4 on)."""
    if s.measured_ms is None or s.paired_baseline_ms is None:
        return None
    return s.measured_ms, s.paired_baseline_ms


def _waterfall_row(s: WaterfallStep) -> list[str]:
    """A step's row: its measured latency, the plan above's in the same rounds and their ratio;
    a step written before schema 1.4 has only a chained latency, marked as the estimate it is."""
    measured = paired_ms(s)
    if measured is None:
        latency, above, added = f"{fmt_ms(s.latency_ms)} (est.)", DASH, fmt_x(s.speedup_added)
    else:
        latency, above = fmt_ms(measured[0]), fmt_ms(measured[1])
        p = s.paired
        added = fmt_speedup(s.speedup_added, p.ci_low if p else None, p.ci_high if p else None)
    return [s.step, latency, above, added, fmt_x(s.speedup_cumulative)]


def section_waterfall(a: WorkloadArtifacts) -> list[str]:
    lines = ["## What drove the speedup (per-pass waterfall)", ""]
    sel = a.selection
    if sel is None:
        return [*lines, *para(not_available(a, "backend"))]
    steps = waterfall_steps(sel)
    ref = BASELINE_LABELS.get(sel.reference, sel.reference)
    if not steps:
        return [
            *lines,
            *para(
                f"_No step: no proposal made the backend faster, so it is the reference ({ref}) "
                "itself._"
            ),
        ]
    rows = [[f"{ref} (reference)", fmt_ms(sel.reference_ms), DASH, DASH, fmt_x(1.0)]]
    rows += [_waterfall_row(s) for s in steps]
    lines += table(
        [
            "step",
            "latency (measured in selection's brief timing)",
            "plan above, same rounds (measured)",
            "added by this step (paired, 95% CI)",
            "cumulative (chained from paired ratios, estimate)",
        ],
        rows,
        caps={0: 80},
    )
    chained = any(paired_ms(s) is None for s in steps)
    lines += para(
        "Each step adds its passes to the plan above it and is timed interleaved with that plan "
        "(`backend_selection.json`): its latency and the plan above's are medians of the same "
        "rounds, and the step's ratio is one over the other. A plan's latency moves from one "
        "run to the next, so the cumulative speedup is the product of the paired ratios, an "
        "estimate, not the reference's latency over a step's."
        + (
            " This selection was written before schema 1.4: its step latencies are chained "
            "from the ratios too, marked (est.)."
            if chained
            else ""
        )
    )
    return lines + para(_recapture_note(a, sel))


def waterfall_bars(a: WorkloadArtifacts) -> list[_plots.WaterfallBar]:
    """The waterfall plot's bars: the reference, each step, and the recapture's latency of
    the chosen plan where there is one; empty without a step."""
    sel = a.selection
    steps = waterfall_steps(sel) if sel is not None else []
    if sel is None or not steps:
        return []
    bars = [
        _plots.WaterfallBar(BASELINE_LABELS.get(sel.reference, sel.reference), sel.reference_ms),
        *(
            _plots.WaterfallBar(
                s.step,
                s.latency_ms if s.measured_ms is None else s.measured_ms,
                measured=s.measured_ms is not None,
                speedup=s.speedup_cumulative,
            )
            for s in steps
        ),
    ]
    opt_ms = gate_figures(a)[4]
    if opt_ms is not None:
        bars.append(_plots.WaterfallBar("recapture (gate)", opt_ms, recapture=True))
    return bars


def _rounds(stats: LatencyStats) -> str:
    """How long one latency was timed: ``9 rounds of 50 calls`` (per process, where several)."""
    text = f"{stats.rounds} rounds of {stats.calls_per_round} calls"
    return f"{text} over {stats.processes} processes" if stats.processes > 1 else text


def _recapture_note(a: WorkloadArtifacts, sel: BackendSelection) -> str:
    """Where the headline's latency of the chosen plan comes from, beside selection's: the
    recapture times it again, longer, and that is the figure the gate holds."""
    ratio, low, high, base_ms, opt_ms = gate_figures(a)
    if opt_ms is None:
        return (
            "_The recapture measured no latency of the chosen plan: the figures above are "
            "selection's only._"
        )
    base = gate_baseline(a)
    label = BASELINE_LABELS.get(base or "", base or "the baseline")
    opt = a.optimized.timing.variants.get("optimized") if a.optimized else None
    brief = next((v.latency for v in sel.variants if v.name == sel.chosen and v.latency), None)
    how = []
    if brief is not None:
        how.append(f"selection timed each plan for {_rounds(brief)}")
    if opt is not None:
        how.append(f"the recapture for {_rounds(opt)}")
    return (
        f"**Recapture of the chosen plan: {fmt_ms(opt_ms)}** per call, measured against "
        f"{label} at {fmt_ms(base_ms)} in the same rounds, "
        f"{fmt_speedup(ratio, low, high)} (`profile_optimized.json`): the headline's and the "
        "gate's figure. Selection's latencies above come from brief runs"
        + (f" ({'; '.join(how)})" if how else "")
        + ", so they can differ from it."
    )
