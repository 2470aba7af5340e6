"""What the reports say across runs: a workload against a stored run (its ``report.md``), the
session report's section across runs, and ``opprof trend``'s page with its plots.

Every figure is copied from a stored run or a comparison (``history.py``); a plot is drawn only
where matplotlib is installed, and its absence is said in a line, never an exception.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof.report import plots as _plots
from pytest_opprof.report.format import DASH, code, fmt_ms, fmt_speedup, table
from pytest_opprof.schema import Change, Comparison, WorkloadSummary, write_text_atomic

if TYPE_CHECKING:
    from pytest_opprof.history import StoredRun, StoredWorkload

TREND_RUNS = 10
"""Stored runs the session report's trend shows (the latest)."""
TREND_VARIANTS = ("eager", "compile", "optimized")


def figure_name(c: Change) -> str:
    if c.metric == "latency":
        return f"{c.name} latency"
    return f"speedup vs {c.name}" + (" (gate)" if c.gate else "")


def _figure_value(c: Change, value: float) -> str:
    return fmt_ms(value) if c.metric == "latency" else f"{value:.2f}×"


def verdict_text(c: Change) -> str:
    """``❌ regressed, past 1.05×`` where a rule fails it; else the verdict, and the limit it
    was held to."""
    held = f"; limit {c.limit:.2f}× ({c.rule})" if c.limit is not None else ""
    if c.failed:
        return f"❌ {c.verdict}, wholly past {c.limit:.2f}× ({c.rule})"
    word = {"regressed": "regressed", "improved": "improved", "unchanged": "within noise"}
    return word[c.verdict] + held


def comparison_lines(rows: Sequence[tuple[str, Comparison]], *, who: str = "this run") -> list[str]:
    """A table of every change of the given workloads, then their warnings and notes."""
    body = [
        [
            name,
            figure_name(c),
            _figure_value(c, c.before),
            _figure_value(c, c.after),
            fmt_speedup(c.ratio, c.ci_low, c.ci_high),
            verdict_text(c),
        ]
        for name, comp in rows
        for c in comp.changes
    ]
    lines: list[str] = []
    if body:
        lines += table(
            ["workload", "figure", "stored run", who, f"{who} / stored (95% CI)", "verdict"], body
        )
    warnings = [w for _, comp in rows for w in comp.warnings]
    notes = [f"{name}: {n}" for name, comp in rows for n in comp.notes]
    lines += [f"- ⚠️ {w}" for w in warnings]
    lines += [f"- {n}" for n in notes]
    if warnings or notes:
        lines.append("")
    if any(not comp.gated for _, comp in rows):
        lines += [
            "Measured on another device than the stored run: the changes are shown, and "
            "`--opprof-compare-fail` does not fail them.",
            "",
        ]
    return lines


def comparison_section(summary: WorkloadSummary) -> tuple[str, str]:
    """The workload report's section: its figures against the stored run."""
    comp = summary.comparison
    assert comp is not None
    lines = [
        f"Against stored run {code(comp.label)}: each figure of this run over the stored "
        "run's, with a 95% CI resampled from both runs' rounds (unpaired). A rule of "
        "`--opprof-compare-fail` fails the gate only where the whole CI lies past its limit.",
        "",
        *comparison_lines([(summary.name, comp)]),
    ]
    return "Across runs", "\n".join(lines).rstrip("\n")


def _latency(w: StoredWorkload, variant: str) -> tuple[float, float, float] | None:
    v = w.variants.get(variant)
    return None if v is None else (v.median_ms, v.ci_low_ms, v.ci_high_ms)


def _ms_ci(x: tuple[float, float, float] | None) -> str:
    if x is None:
        return DASH
    return f"{fmt_ms(x[0])} ({fmt_ms(x[1], unit=False)}–{fmt_ms(x[2], unit=False)})"


def _gate_speedup(w: StoredWorkload) -> tuple[float, float, float] | None:
    s = w.speedup(w.gate_baseline) if w.gate_baseline else None
    return None if s is None else (s.ratio, s.ci_low, s.ci_high)


def trend_lines(
    runs: Sequence[StoredRun], out_dir: Path, *, plots: bool = True, heading: str = "###"
) -> list[str]:
    """Per workload, oldest run first: a plot (``trend/<workload>.png`` under ``out_dir``)
    and a table of each run's latencies and the gate's speedup with their CIs."""
    names = list(dict.fromkeys(w.name for r in runs for w in r.workloads if w.variants))
    if not names:
        return ["_No stored run holds a timed workload._", ""]
    draw = plots and _plots.have_matplotlib()
    lines = [] if draw or not plots else [f"_No plots: {_plots.PLOTS_MISSING}._", ""]
    for name in names:
        timed = [(r, w) for r in runs if (w := r.workload(name)) is not None and w.variants]
        lines += [f"{heading} {name}", ""]
        if draw:
            points = [
                _plots.TrendPoint(
                    label=r.label if r.number else "this run",
                    latencies={v: x for v in TREND_VARIANTS if (x := _latency(w, v)) is not None},
                    speedup=_gate_speedup(w),
                )
                for r, w in timed
            ]
            png = Path(out_dir) / "trend" / f"{name}.png"
            try:
                _plots.trend(png, name, points)
            except (OSError, ValueError, RuntimeError) as exc:
                lines += [f"_Plot {png.name} not drawn: {type(exc).__name__}: {exc}._", ""]
            else:
                lines += [f"![{name} across runs](trend/{png.name.replace(' ', '%20')})", ""]
        rows = []
        for r, w in timed:
            gate = _gate_speedup(w)
            rows.append(
                [
                    r.label if r.number else "this run",
                    (r.created or "")[:10] or DASH,
                    *[_ms_ci(_latency(w, v)) for v in TREND_VARIANTS],
                    (fmt_speedup(*gate) + f" vs {w.gate_baseline}") if gate else DASH,
                    w.status if w.enforced or w.status != "passed" else "not enforced (CPU)",
                ]
            )
        lines += table(
            [
                "run",
                "saved",
                *(f"{v} (95% CI)" for v in TREND_VARIANTS),
                "speedup (gate)",
                "status",
            ],
            rows,
        )
    return lines


def history_section(
    summaries: Sequence[WorkloadSummary],
    stored: Sequence[StoredRun],
    *,
    current: StoredRun,
    out_dir: Path,
    saved: bool,
    plots: bool = True,
) -> str:
    """The session report's section across runs: the comparison with the stored run (where
    there was one), then the trend over the latest stored runs and this one."""
    lines = ["", "## Across runs", ""]
    compared = [(s.name, s.comparison) for s in summaries if s.comparison is not None]
    if saved:
        lines += [f"This run was saved as {code(current.label)}.", ""]
    if compared:
        label = compared[0][1].label
        lines += [f"Compared with stored run {code(label)}:", ""]
        lines += comparison_lines(compared)
    recent = [r for r in stored if not saved or r.number != current.number][-TREND_RUNS:]
    runs = [*recent, current]
    lines += [f"### Trend over {len(recent)} stored run(s) and this one", ""]
    lines += trend_lines(runs, out_dir, plots=plots, heading="####")
    return "\n".join(lines).rstrip("\n") + "\n"


def trend_page(runs: Sequence[StoredRun], out_dir: Path, *, plots: bool = True) -> str:
    """``opprof trend``'s ``trend.md``: every workload over the given runs."""
    lines = [
        "# pytest-opprof trend",
        "",
        f"{len(runs)} stored run(s), oldest first: "
        + ", ".join(code(r.label) for r in runs)
        + ". Latencies in ms with their 95% CI; the speedup is the optimized backend's "
        "against the gate's baseline.",
        "",
    ]
    lines += trend_lines(runs, out_dir, plots=plots, heading="##")
    return "\n".join(lines).rstrip("\n") + "\n"


EXPORT_FILES = {"latency": "benchmark-latency.json", "speedup": "benchmark-speedup.json"}
"""github-action-benchmark's inputs, one per tool: ``customSmallerIsBetter`` (latencies) and
``customBiggerIsBetter`` (speedups). A saved session writes them beside session.json;
``opprof export`` writes them for any stored run."""


def benchmark_action_entries(run: StoredRun) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run in github-action-benchmark's custom format: ``customSmallerIsBetter`` entries
    (each variant's median latency, ms) and ``customBiggerIsBetter`` entries (each speedup of
    the optimized backend, ×): ``{name, unit, value, range, extra}``, ``range`` the half-width
    of the 95% CI as ``± x`` (the form that action reads), ``extra`` the CI and the context."""
    smaller, bigger = [], []
    for w in run.workloads:
        where = w.fingerprint.device_name if w.fingerprint else run.device
        for name in sorted(w.variants, key=_plots.variant_rank):
            v = w.variants[name]
            smaller.append(
                {
                    "name": f"{w.name}/{name}",
                    "unit": "ms",
                    "value": v.median_ms,
                    "range": f"± {(v.ci_high_ms - v.ci_low_ms) / 2:.4g}",
                    "extra": f"95% CI {v.ci_low_ms:.4g}–{v.ci_high_ms:.4g} ms\n"
                    f"{v.rounds} rounds × {v.calls_per_round} calls\n{where}\nrun {run.label}",
                }
            )
        for s in w.speedups:
            if s.candidate not in ("optimized", "optimized_baseline_dtype"):
                continue
            same = " at the baseline dtype" if s.candidate != "optimized" else ""
            gate = " (gate)" if s.baseline == w.gate_baseline and not same else ""
            bigger.append(
                {
                    "name": f"{w.name}/speedup vs {s.baseline}{same}",
                    "unit": "x",
                    "value": s.ratio,
                    "range": f"± {(s.ci_high - s.ci_low) / 2:.4g}",
                    "extra": f"95% CI {s.ci_low:.3f}–{s.ci_high:.3f}{gate}\n"
                    f"dtype {w.dtype or w.baseline_dtype or '—'}\n"
                    f"passes {', '.join(w.passes) or '—'}\n{where}\nrun {run.label}",
                }
            )
    return smaller, bigger


def write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
