"""The first screen of a workload's ``report.md``: the verdict with its figure and CI, the gate
it was held to, a table of the speedup against each baseline (with and without the dtype
change), what the backend applied, and the plots.

Each part is bounded (the message and the applied list are cut, prose is wrapped) so that it
fits in ``FIRST_SCREEN`` lines and a reader sees the outcome before scrolling; every detail
behind it follows in the later sections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_opprof import ITEM_NAMES
from pytest_opprof.report.figures import figure_lines
from pytest_opprof.report.format import (
    BASELINE_LABELS,
    DASH,
    LINE_LIMIT,
    clip,
    code,
    fmt_dtype,
    fmt_ms,
    fmt_speedup,
    fmt_x,
    one_line,
    para,
    table,
    verdict,
    wrap,
)
from pytest_opprof.report.lookups import (
    applied_changes,
    dtype_change,
    gate_baseline,
    gate_enforced,
    gate_figures,
    not_available,
)
from pytest_opprof.schema import CPU_NOT_ENFORCED, Speedup

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

FIRST_SCREEN = 60
"""Lines the title block and the headline take at most (issue #41)."""
MESSAGE = 400
"""Characters of the summary's message quoted under the verdict."""
APPLIED = 12
"""Changes the applied line names; the implementation notes give the chosen plan whole."""


def _label(baseline: str | None, missing: str = "the baseline") -> str:
    return BASELINE_LABELS.get(baseline or "", baseline or missing)


def gate_line(a: WorkloadArtifacts) -> str:
    base = gate_baseline(a)
    against = f"`{a.gate_baseline}`"
    if a.gate_baseline == "best" and base:
        against += f" (the faster baseline: {_label(base)})"
    if a.strict_gate:
        rule = f"passes only when the 95% CI lies wholly above {a.min_speedup:.2f}×"
    else:
        rule = f"fails only when the 95% CI lies wholly below {a.min_speedup:.2f}×"
    return f"Gate: at least {a.min_speedup:.2f}× against {against}; {rule}."


def title_block(a: WorkloadArtifacts) -> list[str]:
    """The title, the verdict with the gate's figure and CI, the gate, and why a workload did
    not pass."""
    s = a.summary
    base = gate_baseline(a)
    ratio, low, high, base_ms, opt_ms = gate_figures(a)
    status = verdict(s)
    if ratio is not None:
        word = "faster than" if ratio >= 1 else "against"
        lines = [clip(f"# {a.name}: {fmt_x(ratio)} {word} {_label(base)}", LINE_LIMIT), ""]
        figure = (
            f"{fmt_speedup(ratio, low, high)} against {_label(base)}, "
            f"{fmt_ms(base_ms)} → {fmt_ms(opt_ms)} per call"
        )
    else:
        lines = [clip(f"# {a.name}: no speedup measured", LINE_LIMIT), ""]
        figure = f"no speedup measured (stopped at {ITEM_NAMES.get(s.stage, s.stage)})"
    lines += para(f"**{status}** · {figure}")
    lines += para(f"Workload {code(a.path)}, last stage: {s.stage}.")
    lines += para(gate_line(a))
    if not gate_enforced(a):
        lines += para(
            f"**{CPU_NOT_ENFORCED}**: measured on the CPU, not a GPU figure; "
            "`--opprof-gate-on-cpu` enforces it."
        )
    if s.message and status != "passed":
        lines += [*wrap(one_line(s.message, MESSAGE), first="> ", rest="> "), ""]
    return lines


def _records(a: WorkloadArtifacts) -> list[Speedup]:
    return list(a.optimized.timing.speedups if a.optimized else a.summary.speedups)


def _latencies(a: WorkloadArtifacts) -> dict[str, float | None]:
    if a.optimized is not None:
        return {n: v.median_ms for n, v in a.optimized.timing.variants.items()}
    s = a.summary
    return {"eager": s.eager_ms, "compile": s.compile_ms, "optimized": s.optimized_ms}


def _sp(r: Speedup | None) -> str:
    return DASH if r is None else fmt_speedup(r.ratio, r.ci_low, r.ci_high)


def headline_table(a: WorkloadArtifacts) -> list[str]:
    """One row per baseline, the gate's first: its latency and the optimized backend's speedup
    over it — at the baseline dtype and with the dtype change, in columns of their own where
    the backend changed the dtype."""
    base = gate_baseline(a)
    before, after = dtype_change(a)
    records = _records(a)
    ms = _latencies(a)
    split = after is not None and ms.get("optimized_baseline_dtype") is not None
    found = {(r.baseline, r.candidate): r for r in records}
    names = [base, *(b for b in ("stock", "compile", "eager") if b != base)]
    names += sorted({r.baseline for r in records} - {*names, "optimized"})
    rows = []
    for b in (n for n in names if n is not None):
        with_dtype = found.get((b, "optimized"))
        at_dtype = found.get((b, "optimized_baseline_dtype"))
        if with_dtype is None and at_dtype is None:
            continue
        row = [_label(b) + (" (gate)" if b == base else ""), fmt_ms(ms.get(b))]
        if split:
            row += [fmt_ms(ms.get("optimized_baseline_dtype")), _sp(at_dtype)]
        row += [fmt_ms(ms.get("optimized")), _sp(with_dtype)]
        rows.append(row)
    if not rows:
        ratio, low, high, base_ms, opt_ms = gate_figures(a)
        if ratio is None:
            return []
        rows = [[f"{_label(base)} (gate)", fmt_ms(base_ms), fmt_ms(opt_ms)]]
        rows[0].append(fmt_speedup(ratio, low, high))
        after = None
    heads = ["against", "baseline latency"]
    if split:
        heads += [f"optimized at {fmt_dtype(before)}", "speedup (95% CI)"]
    if after:
        heads += [f"optimized, {fmt_dtype(before)} → {fmt_dtype(after)}", "speedup (95% CI)"]
    else:
        heads += ["optimized", "speedup (95% CI)"]
    return table(heads, rows)


def _precision_line(a: WorkloadArtifacts) -> str:
    before, after = dtype_change(a)
    if not after:
        return (
            f"Precision: the backend keeps the baseline dtype ({fmt_dtype(before)}); every "
            "figure above is at the baseline dtype."
        )
    if _latencies(a).get("optimized_baseline_dtype") is None:
        stock = a.selection is not None and a.selection.plan.stock_recipe is not None
        why = (
            "it ships the stock recipe, whose graph changes are stock PyTorch's, not the "
            "backend's; at that dtype it would be a max-autotune compile of its own"
            if stock
            else "that variant was not timed"
        )
        return (
            f"Precision: the backend runs {fmt_dtype(after)} where the model is "
            f"{fmt_dtype(before)}; it is not timed at {fmt_dtype(before)} apart: {why}."
        )
    return (
        f"Precision is reported apart from graph changes: the backend runs {fmt_dtype(after)} "
        f"where the model is {fmt_dtype(before)}; the columns at {fmt_dtype(before)} time the "
        "same plan without the dtype change (graph changes only)."
    )


def _stock_line(a: WorkloadArtifacts) -> str:
    """What the stock baseline was, and whether its ratio is at the backend's precision."""
    s = a.summary
    if s.stock is None:
        return f" Stock PyTorch: {s.stock_note}." if s.stock_note else ""
    same = (s.dtype or "float32") == s.stock_dtype
    return f" Stock PyTorch: {s.stock}" + (
        ", the backend's precision: the ratio over it is graph changes alone." if same else "."
    )


def _applied_line(a: WorkloadArtifacts) -> str:
    applied = applied_changes(a)
    if applied is None:
        return f"Applied: {not_available(a, 'backend')}"
    if a.selection is None:
        return "Applied (from the session summary): " + ", ".join(code(x) for x in applied) + "."
    if not applied:
        chosen = code(a.selection.chosen)
        return f"Applied: nothing; the chosen variant {chosen} is the reference itself."
    shown = ", ".join(code(x) for x in applied[:APPLIED])
    if len(applied) > APPLIED:
        shown += f" and {len(applied) - APPLIED} more (the plan in full: Implementation notes)"
    return f"Applied in the chosen variant: {shown}."


def section_headline(a: WorkloadArtifacts, plots: bool) -> list[str]:
    lines = ["## Headline", ""]
    found = headline_table(a)
    if a.optimized is None:
        lines += para(not_available(a, "recapture"))
        s = a.summary
        if not found and (s.speedup_vs_eager is not None or s.speedup_vs_compile is not None):
            lines += para(
                f"From the session summary: {fmt_x(s.speedup_vs_eager)} against eager, "
                f"{fmt_x(s.speedup_vs_compile)} against torch.compile."
            )
    elif not found:
        lines += ["_No interleaved speedup was recorded in `profile_optimized.json`._", ""]
    lines += found
    between = next(
        (r for r in _records(a) if (r.baseline, r.candidate) == ("eager", "compile")), None
    )
    note = f"torch.compile over eager: {_sp(between)}. " if between else ""
    if found:
        lines += para(
            note + "Latencies are medians per call, each baseline timed interleaved with the "
            "backend (Timing, below, says how). " + _precision_line(a) + _stock_line(a)
        )
    lines += para(_applied_line(a))
    lines += figure_lines(a, plots)
    return lines
