"""``report.md`` of one workload and of the session (DESIGN §2.5).

Each section is a function from the artifacts to Markdown lines; a section whose artifact is
missing says which stage did not run and why, and the rest of the report still renders. Numbers
are only ever copied or derived (ratios, per-iteration division, differences) from the artifacts,
with the artifact named where the reader might want to check.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tabulate import tabulate

from pytest_opprof import ITEM_NAMES, STAGES
from pytest_opprof.backend.plan import replaced_by_model_graph
from pytest_opprof.measure import SLOW_HOST
from pytest_opprof.report import plots as _plots
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
    VALIDATION_STEPS,
    BackendPlan,
    BackendSelection,
    CaptureMetadata,
    LatencyStats,
    OperatorAggregate,
    Profile,
    Proposal,
    Speedup,
    Timeline,
    Timing,
    VariantResult,
    WaterfallStep,
    WorkloadSummary,
    timing_variant,
    write_text_atomic,
)

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

COMMENT_MARKER = "<!-- pytest-opprof -->"
"""Hidden first line of the pull-request comment; ci/post_comment.py finds the comment by it."""
TOP_OPERATORS = 15
BEFORE_AFTER_ROWS = 25
DASH = "—"
CPU_CAVEAT = "measured on the CPU; not a GPU figure; gate not enforced unless --opprof-gate-on-cpu"
BASELINE_LABELS = {"eager": "eager", "compile": "torch.compile"}
TIMELINE_LABELS = {"eager": ("eager",), "compile": ("compiled", "compile")}
CANDIDATE_ORDER = ("optimized", "optimized_baseline_dtype")

# ------------------------------------------------------------------------------ formatting


def verdict(s: WorkloadSummary) -> str:
    """The status a reader is shown: never ``passed`` where the gate was not enforced (the CPU
    fallback, issue 37); a failure or an error keeps its own word."""
    return CPU_NOT_ENFORCED if s.status == "passed" and not s.enforced else s.status


def fmt_ms(value: float | None, *, unit: bool = True) -> str:
    """Milliseconds with three decimals (three significant digits below 0.1 ms)."""
    if value is None:
        return DASH
    text = f"{value:.3f}" if value == 0 or abs(value) >= 0.1 else f"{value:.3g}"
    return f"{text} ms" if unit else text


def fmt_us(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:,.1f} µs" if abs(value) >= 1 else f"{value:.2f} µs"


def fmt_x(value: float | None) -> str:
    return DASH if value is None else f"{value:.2f}×"


def fmt_speedup(ratio: float | None, low: float | None = None, high: float | None = None) -> str:
    """``1.23× (95% CI 1.20–1.26)``; the bare ratio when no interval was measured."""
    if ratio is None:
        return DASH
    if low is None or high is None:
        return fmt_x(ratio)
    return f"{ratio:.2f}× (95% CI {low:.2f}–{high:.2f})"


def fmt_pct(share: float | None) -> str:
    return DASH if share is None else f"{share * 100:.1f}%"


def fmt_count(value: float) -> str:
    return f"{value:.0f}" if abs(value - round(value)) < 1e-9 else f"{value:.1f}"


def fmt_dtype(dtype: str | None) -> str:
    return DASH if not dtype else dtype.removeprefix("torch.")


def code(text: str, limit: int = 0) -> str:
    if limit and len(text) > limit:
        text = text[: limit - 1] + "…"
    return "`" + text.replace("`", "'") + "`"


def one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _cell(value: object) -> str:
    return str(value).replace("\n", " ").replace("|", "\\|")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A GitHub Markdown table; cells are escaped so a ``|`` in a name cannot break it."""
    text = tabulate(
        [[_cell(c) for c in row] for row in rows],
        headers=[_cell(h) for h in headers],
        tablefmt="github",
        disable_numparse=True,
    )
    return [*text.splitlines(), ""]


# ----------------------------------------------------------------------- artifact look-ups


def _not_available(a: WorkloadArtifacts, stage: str) -> str:
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
    """The baseline the gate compared against, resolved (eager or compile)."""
    if a.summary.baseline:
        return a.summary.baseline
    if a.gate_baseline in ("eager", "compile"):
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


def _find_speedup(profile: Profile | None, baseline: str, candidate: str) -> Speedup | None:
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
    r = _find_speedup(a.optimized, base, "optimized") if base else None
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


def _unattributed_us(t: Timeline, cpu: bool = False) -> float:
    return sum(k.duration_us for k in t.unattributed_kernels) / per_iter_divisor(t, cpu)


def _has_counters(profile: Profile) -> bool:
    for t in profile.timelines:
        for op in t.operators:
            for k in op.kernels:
                if any(v is not None for v in k.metrics.values()):
                    return True
        if any(any(v is not None for v in agg.metrics.values()) for agg in t.aggregated):
            return True
    return False


def _dtype_change(a: WorkloadArtifacts) -> tuple[str | None, str | None]:
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


WHOLE_GRAPH = "whole-model CUDA graph"
SUPERSEDED = (
    "superseded: its gain was kept, then one CUDA graph of the whole call (cuda_graphs-model) "
    "replaced Inductor's per-graph CUDA graphs"
)


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


def _is_applied(status: str) -> bool:
    return status.startswith(("APPLIED", "in the chosen plan"))


def _figure(
    a: WorkloadArtifacts, plots: bool, filename: str, alt: str, draw: Callable[[Path], object]
) -> list[str]:
    """Draw one PNG beside the report and link it; a missing extra is a note, not an error."""
    if not plots:
        return []
    if not _plots.have_matplotlib():
        return [f"_{_plots.PLOTS_MISSING}._", ""]
    target = a.out_dir / "profiler_output" / filename
    try:
        draw(target)
    except (OSError, ValueError, RuntimeError) as exc:
        return [f"_Plot {filename} not drawn: {type(exc).__name__}: {one_line(str(exc))}._", ""]
    return [f"![{alt}](profiler_output/{filename})", ""]


# --------------------------------------------------------------------------------- sections


def _title(a: WorkloadArtifacts) -> list[str]:
    s = a.summary
    base = gate_baseline(a)
    label = BASELINE_LABELS.get(base or "", base or "the baseline")
    ratio = gate_figures(a)[0]
    if ratio is not None:
        word = "faster than" if ratio >= 1 else "against"
        title = f"# {a.name}: {fmt_x(ratio)} {word} {label}"
    else:
        title = f"# {a.name}: no speedup measured"
    status = verdict(s)
    lines = [title, "", f"Workload {code(a.path)} · status **{status}** (last stage: {s.stage})"]
    if s.message and status != "passed":
        lines += ["", f"> {one_line(s.message, 1000)}"]
    return [*lines, ""]


def _gate_line(a: WorkloadArtifacts) -> str:
    base = gate_baseline(a)
    against = f"`{a.gate_baseline}`"
    if a.gate_baseline == "best" and base:
        against += f" (the faster baseline: {BASELINE_LABELS.get(base, base)})"
    if a.strict_gate:
        rule = f"passes only when the 95% CI lies wholly above {a.min_speedup:.2f}×"
    else:
        rule = f"fails only when the 95% CI lies wholly below {a.min_speedup:.2f}×"
    line = f"Gate: at least {a.min_speedup:.2f}× against {against}; {rule}."
    if not gate_enforced(a):
        line += (
            f" **{CPU_NOT_ENFORCED}**: measured on the CPU, not a GPU figure; "
            "`--opprof-gate-on-cpu` enforces it."
        )
    return line


def _timing_note(timing: Timing) -> str:
    """How the headline figures were timed: one process, or several pooled (with how far the
    processes' own ratios spread)."""
    head = "Median latency per call from `profile_optimized.json` (`timing`)"
    processes = timing.processes
    if processes <= 1:
        return (
            f"{head}, baseline and candidate timed interleaved in one process; the CI is a "
            "paired bootstrap." + _slow_host_note(timing) + _host_speed_note(timing)
        )
    spread = [
        f"{BASELINE_LABELS.get(r.baseline, r.baseline)} → {r.candidate}: "
        + ", ".join(f"{x:.2f}×" for x in r.process_ratios)
        for r in timing.speedups
        if r.process_ratios and r.candidate == "optimized"
    ]
    note = (
        f"{head}, baseline and candidate timed interleaved in each of {processes} fresh "
        "processes, pooled; the CI is a paired bootstrap that resamples processes, then rounds "
        "within each, widened to Student's t over the processes' own ratios where that reaches "
        "further."
    )
    if spread:
        note += " Each process's own ratio: " + "; ".join(spread) + "."
    bound = _host_bound_note(timing)
    note += _slow_host_note(timing) + bound + _host_speed_note(timing, said=bool(bound))
    alone = [n for n, v in timing.variants.items() if v.processes < processes]
    if alone:
        note += (
            " Timed in the first process only: "
            + ", ".join(
                "the plan at the baseline dtype"
                if n == "optimized_baseline_dtype"
                else BASELINE_LABELS.get(n, n)
                for n in alone
            )
            + "."
        )
    return note


def _slow_host_note(timing: Timing) -> str:
    """How many rounds were set aside because the host's CPU ran slowed during them."""
    most = max(timing.variants.values(), key=lambda v: v.rounds, default=None)
    if most is None or not most.set_aside:
        return ""
    us = sorted(timing.host_us)
    fast = f" (fast rounds: {us[len(us) // 10]:.1f} µs)" if us else ""
    return (
        f" {len(most.set_aside)} of {most.rounds} rounds are set aside: the host's CPU ran a "
        f"fixed piece of work more than {SLOW_HOST:.2f}× slower at their start than in its "
        f"fast rounds{fast}, which slows a launch-bound call alike (`timing.host_us`, each "
        "variant's `set_aside`)."
    )


HOST_BOUND_SHARE = 0.8
"""A baseline whose GPU time (host hidden) is below this share of its latency waits on the host."""
PROCESS_SPREAD = 1.1
"""Processes' ratios further apart than this (max / min) are explained where the host can be."""


def _host_speed_note(timing: Timing, *, said: bool = False) -> str:
    """The host's speed the figures were measured at, where a baseline is host-bound: its
    ratio moves with that speed between hosts (10-20% on the lent H200 hosts), so two runs
    compare at the same reference. ``said``: the note before already called it host-bound."""
    if not timing.host_us:
        return ""
    bound = []
    for name in ("compile", "eager"):
        if (split := _host_bound(timing, name)) is not None:
            label = BASELINE_LABELS.get(name, name)
            bound.append(f"{label} (GPU {fmt_ms(split[0])} of {fmt_ms(split[1])})")
    if not bound:
        return ""
    us = statistics.median(timing.host_us)
    if said:
        return (
            f" The host ran its reference CPU work at a median {us:.2f} µs per call "
            "(`timing.host_us`): compare runs at the same reference."
        )
    return (
        f" The host ran its reference CPU work at a median {us:.2f} µs per call "
        f"(`timing.host_us`); {' and '.join(bound)} {'is' if len(bound) == 1 else 'are'} "
        "host-bound, so a ratio against it moves with the host's speed: compare runs at "
        "the same reference."
    )


def _host_bound(timing: Timing, name: str) -> tuple[float, float] | None:
    """A baseline's GPU time and latency (ms) where its call is host-bound: the GPU works less
    than ``HOST_BOUND_SHARE`` of it. None where it is not, or either figure is missing."""
    gpu_ms, base = timing.gpu_time_ms.get(name), timing.variants.get(name)
    if not gpu_ms or base is None or gpu_ms >= HOST_BOUND_SHARE * base.median_ms:
        return None
    return gpu_ms, base.median_ms


def _host_bound_note(timing: Timing) -> str:
    """Why the processes' ratios disagree, where the baseline's call is host-bound: its latency
    is the host CPU's speed in that process, and that speed differs between processes on a
    shared host (benchmarks/probes/launch_probe.py), while the GPU's does not."""
    parts = []
    for r in timing.speedups:
        if r.candidate != "optimized" or len(r.process_ratios) < 2 or min(r.process_ratios) <= 0:
            continue
        if max(r.process_ratios) / min(r.process_ratios) <= PROCESS_SPREAD:
            continue
        if (split := _host_bound(timing, r.baseline)) is not None:
            gpu_ms, base_ms = split
            label = BASELINE_LABELS.get(r.baseline, r.baseline)
            parts.append(
                f"{fmt_ms(gpu_ms)} of {label}'s {fmt_ms(base_ms)} ({gpu_ms / base_ms:.0%})"
            )
    if not parts:
        return ""
    one = len(parts) == 1
    return (
        f" The processes disagree because the baseline{'' if one else 's'} "
        f"{'is' if one else 'are'} host-bound: the GPU works {'; '.join(parts)}, so "
        f"{'its latency' if one else 'their latencies'}, and the ratio, follow the speed of "
        "the CPU each process ran on."
    )


def section_headline(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Headline", ""]
    s = a.summary
    base = gate_baseline(a)
    before, after = _dtype_change(a)
    ratio, low, high, base_ms, opt_ms = gate_figures(a)
    if ratio is not None:
        label = BASELINE_LABELS.get(base or "", base or "baseline")
        lines += [
            f"**{fmt_speedup(ratio, low, high)}** against {label} "
            f"({fmt_ms(base_ms)} → {fmt_ms(opt_ms)} per call).",
            "",
        ]
    lines += [_gate_line(a), ""]
    opt = a.optimized
    if opt is None:
        lines.append(_not_available(a, "recapture"))
        if s.speedup_vs_eager is not None or s.speedup_vs_compile is not None:
            lines += [
                "",
                f"From the session summary: {fmt_x(s.speedup_vs_eager)} against eager, "
                f"{fmt_x(s.speedup_vs_compile)} against torch.compile.",
            ]
        return [*lines, ""]
    variants = opt.timing.variants
    order = [base, *(b for b in ("compile", "eager") if b != base)]
    records = sorted(
        opt.timing.speedups,
        key=lambda r: (
            order.index(r.baseline) if r.baseline in order else len(order),
            CANDIDATE_ORDER.index(r.candidate) if r.candidate in CANDIDATE_ORDER else 9,
            r.baseline,
            r.candidate,
        ),
    )
    rows = []
    for r in records:
        who = BASELINE_LABELS.get(r.baseline, r.baseline) + (
            " (gate)" if r.baseline == base else ""
        )
        if r.candidate == "optimized_baseline_dtype":
            what = f"optimized at {fmt_dtype(before)} (graph changes only)"
        elif r.candidate == "optimized" and after:
            what = f"optimized, {fmt_dtype(before)} → {fmt_dtype(after)}"
        else:
            what = BASELINE_LABELS.get(r.candidate, r.candidate)
        b, c = variants.get(r.baseline), variants.get(r.candidate)
        rows.append(
            [
                who,
                what,
                fmt_ms(b.median_ms if b else None),
                fmt_ms(c.median_ms if c else None),
                fmt_speedup(r.ratio, r.ci_low, r.ci_high),
            ]
        )
    if rows:
        lines += table(
            ["against", "candidate", "baseline", "candidate latency", "speedup (95% CI)"], rows
        )
        lines.append(_timing_note(opt.timing))
        lines.append("")
    else:
        lines += ["_No interleaved speedup was recorded in `profile_optimized.json`._", ""]
    lines += _dtype_lines(a, base, before, after)
    return lines


def _dtype_lines(
    a: WorkloadArtifacts, base: str | None, before: str | None, after: str | None
) -> list[str]:
    if not after:
        return [
            f"Precision: the backend keeps the baseline dtype ({fmt_dtype(before)}); every "
            "figure above is at the baseline dtype.",
            "",
        ]
    lines = [
        f"Precision is reported apart from graph changes ({fmt_dtype(before)} → "
        f"{fmt_dtype(after)}):",
        "",
    ]
    for b in (base, *(x for x in ("compile", "eager") if x != base)):
        if b is None:
            continue
        label = BASELINE_LABELS.get(b, b)
        with_dtype = _find_speedup(a.optimized, b, "optimized")
        without = _find_speedup(a.optimized, b, "optimized_baseline_dtype")
        if with_dtype is None and without is None:
            continue
        lines.append(
            f"- against {label}: with the dtype change "
            f"{_sp(with_dtype)}; at the baseline dtype {_sp(without, 'not measured')}"
        )
    return [*lines, ""]


def _sp(r: Speedup | None, missing: str = DASH) -> str:
    return missing if r is None else fmt_speedup(r.ratio, r.ci_low, r.ci_high)


def _iterations(m: CaptureMetadata, timing: Timing) -> str:
    text = f"{m.warmup_iters} warmup, {m.rounds} rounds × {m.measure_iters} calls"
    processes = timing.processes
    return text + (f", in each of {processes} processes" if processes > 1 else "")


def _gpu_identity(m: CaptureMetadata) -> str:
    """Which GPU the measuring process used and how many it saw (one per xdist worker)."""
    if m.device_count is None:
        return DASH
    visible = m.visible_devices if m.visible_devices is not None else "unset"
    return f"{m.device_uuid or DASH}; {m.device_count} visible (CUDA_VISIBLE_DEVICES={visible})"


def section_hardware(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Hardware context", ""]
    prof = a.profile or a.optimized
    if prof is None:
        return [*lines, _not_available(a, "capture"), ""]
    m = prof.capture_metadata
    inputs = ", ".join(
        f"{tuple(shape)} {fmt_dtype(dt)}"
        for shape, dt in zip(m.input_shapes, m.input_dtypes, strict=False)
    )
    rows: list[list[object]] = [
        ["device", f"{m.device_name} ({m.device_type})"],
        ["GPU", _gpu_identity(m)],
        ["SMs", m.sm_count if m.sm_count is not None else DASH],
        ["compute capability", m.compute_capability or DASH],
        ["driver", m.driver or DASH],
        [
            "torch / CUDA / Triton",
            f"{m.torch_version} / {m.cuda_version or DASH} / {m.triton_version or DASH}",
        ],
        ["Python", m.python_version],
        ["model dtype", fmt_dtype(m.dtype)],
        ["inputs", inputs or DASH],
        ["iterations", _iterations(m, prof.timing)],
        ["compile mode", m.compile_mode],
        ["timing clock", prof.timing.clock],
        ["hardware counters", "collected" if _has_counters(prof) else "not collected"],
        ["captured", m.timestamp],
        ["environment fingerprint", code(m.environment_fingerprint)],
    ]
    if m.cpu_fallback:
        rows.insert(1, ["CPU fallback", CPU_CAVEAT])
    lines += table(["", "value"], rows)
    if a.profile is None:
        lines += ["_From `profile_optimized.json`: " + _not_available(a, "capture")[1:], ""]
    elif a.optimized is not None:
        o = a.optimized.capture_metadata
        if (o.device_name, o.torch_version) != (m.device_name, m.torch_version):
            lines += [
                f"The recapture ran on {o.device_name} with torch {o.torch_version}: the "
                "two profiles do not compare.",
                "",
            ]
    return lines


def _timeline_line(t: Timeline, artifact: str, index: int, timing: Timing) -> str:
    s = t.summary
    idle = f", idle {fmt_us(s.idle_time_per_iter_us)}" if s.idle_time_per_iter_us else ""
    line = (
        f"{t.label} timeline (`{artifact}` → `timelines[{index}]`, compile mode {t.compile_mode}): "
        f"{fmt_us(s.device_time_per_iter_us)} of device time per iteration over "
        f"{s.iterations} profiled iterations, {fmt_count(s.kernels_per_iter)} kernels per "
        f"iteration{idle}; {fmt_pct(s.attributed_share)} of that time attributed to operators "
        f"({fmt_pct(s.high_share)} at high confidence)."
    )
    return line + _gpu_time_agreement(t, timing)


def _gpu_time_agreement(t: Timeline, timing: Timing) -> str:
    """The timeline's kernel time against the timing pass's GPU time with the host hidden: an
    independent check that the timeline saw every kernel of the call, and only those."""
    gpu_ms = timing.gpu_time_ms.get(timing_variant(t.label))
    if not gpu_ms:
        return ""
    return (
        f" The timing pass measured {fmt_us(gpu_ms * 1000.0)} of GPU time per {t.label} call "
        f"with the host hidden (`timing.gpu_time_ms`); the timeline's kernels add up to "
        f"{fmt_pct(t.summary.device_time_per_iter_us / (gpu_ms * 1000.0))} of it."
    )


def section_operators(a: WorkloadArtifacts, plots: bool) -> list[str]:
    lines = ["## Operator summary", ""]
    if a.profile is None or not a.profile.timelines:
        return [*lines, _not_available(a, "capture"), ""]
    t = a.profile.primary
    cpu = on_cpu(a)
    div = per_iter_divisor(t, cpu)
    lines += [_timeline_line(t, "profile.json", 0, a.profile.timing), ""]
    ranked = sorted(t.aggregated, key=lambda op: -op_time(op, cpu))
    rows = [
        [
            i,
            code(op.name),
            fmt_count(op.calls / div),
            fmt_us(op_time(op, cpu) / div),
            fmt_pct(op.share),
            fmt_count(op.kernel_count / div),
            op.bottleneck or DASH,
            code(op.kernel_names[0], 60) if op.kernel_names else DASH,
        ]
        for i, op in enumerate(ranked[:TOP_OPERATORS], 1)
    ]
    rest = ranked[TOP_OPERATORS:]
    if rest:
        rows.append(
            [
                "",
                f"… {len(rest)} more operators",
                "",
                fmt_us(sum(op_time(op, cpu) for op in rest) / div),
                fmt_pct(sum(op.share for op in rest)),
                fmt_count(sum(op.kernel_count for op in rest) / div),
                "",
                "",
            ]
        )
    if t.unattributed_kernels:
        rows.append(
            [
                "",
                "(unattributed kernels)",
                "",
                fmt_us(_unattributed_us(t, cpu)),
                fmt_pct(1 - t.summary.attributed_share),
                fmt_count(len(t.unattributed_kernels) / div),
                "",
                "",
            ]
        )
    lines += table(
        [
            "#",
            "operator",
            "calls/iter",
            f"{time_label(cpu)}/iter",
            "time %",
            "kernels/iter",
            "bottleneck",
            "main kernel",
        ],
        rows,
    )
    compiled = a.profile.timeline("compiled")
    if compiled is not None and compiled is not t:
        index = a.profile.timelines.index(compiled)
        lines += [_timeline_line(compiled, "profile.json", index, a.profile.timing), ""]
    series = {"baseline": _plots.roofline_points(a.profile.timelines)}
    if a.optimized is not None:
        series["optimized"] = _plots.roofline_points(a.optimized.timelines[:1])
    if not any(series.values()):
        if plots:
            lines += ["_No roofline: no kernel carries both FLOP and DRAM-byte counters._", ""]
    else:
        peak_flops, peak_bw = _plots.roofline_peaks(a.profile.counters)
        lines += _figure(
            a,
            plots,
            "roofline.png",
            "roofline of the measured kernels",
            lambda p: _plots.roofline(p, series, peak_flops, peak_bw),
        )
    return lines


def section_optimizations(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Optimizations", ""]
    opts = a.optimizations
    if opts is None:
        return [*lines, _not_available(a, "propose"), ""]
    if not opts.proposals:
        lines += ["No proposal: the rules found nothing to change in this profile.", ""]
    else:
        rows = [
            [
                p.id,
                p.type,
                p.ir_level,
                ", ".join(code(t) for t in p.targets) or DASH,
                p.confidence,
                f"{fmt_us(p.impact.estimated_saving_us)}, {fmt_x(p.impact.estimated_speedup)}",
                proposal_status(a, p),
            ]
            for p in opts.proposals
        ]
        lines += table(
            ["id", "type", "IR level", "targets", "confidence", "estimated", "status"], rows
        )
    added = _selection_additions(a)
    if added:
        lines += [
            "",
            "Added by measured selection (tried on every GPU workload, not proposed):",
            "",
        ]
        lines += [f"- `{pid}`: {status}" for pid, status in added]
        lines.append("")
    for p in opts.proposals:
        lines += [f"### {p.id} · {p.type}", ""]
        lines.append(f"- **Status:** {proposal_status(a, p)}")
        lines.append(f"- **Confidence:** {p.confidence} (source: {p.source})")
        lines.append(
            f"- **Estimated impact:** {fmt_us(p.impact.estimated_saving_us)} per iteration, "
            f"{fmt_x(p.impact.estimated_speedup)} — {one_line(p.impact.basis)}"
        )
        if p.depends_on:
            lines.append(f"- **Depends on:** {', '.join(p.depends_on)}")
        if p.evidence:
            lines.append("- **Evidence:**")
            for e in p.evidence:
                value = f"{e.value:g}" if isinstance(e.value, float) else str(e.value)
                unit = f" {e.unit}" if e.unit else ""
                lines.append(
                    f"  - {code(e.metric)} = {code(value + unit, 90)} ({code(e.source, 120)})"
                )
        if p.fx_steps:
            lines.append("- **Steps:**")
            lines += [f"  {i}. {one_line(step)}" for i, step in enumerate(p.fx_steps, 1)]
        if p.rationale:
            lines.append(f"- **Rationale:** {one_line(p.rationale, 1000)}")
        lines.append("")
    if opts.global_notes:
        lines += ["Notes from the propose stage:", ""]
        lines += [f"- {one_line(n, 1000)}" for n in opts.global_notes]
        lines.append("")
    return lines


def _selection_additions(a: WorkloadArtifacts) -> list[tuple[str, str]]:
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
                # Validation reports of 2026-11-30 named this record by its type.
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


def _plan_text(plan: BackendPlan) -> str:
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


def section_implementation(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Implementation notes", ""]
    sel = a.selection
    if sel is None:
        lines += [_not_available(a, "backend"), ""]
    else:
        lines += [
            f"Chosen variant {code(sel.chosen)}: {_plan_text(sel.plan)}. Reference "
            f"{BASELINE_LABELS.get(sel.reference, sel.reference)} at {fmt_ms(sel.reference_ms)} "
            "(brief timing during selection, `backend_selection.json`).",
            "",
        ]
        if sel.variants:
            rows = [
                [
                    code(v.name),
                    _plan_text(v.plan),
                    fmt_ms(v.latency.median_ms) if v.latency else DASH,
                    _paired_text(v),
                    _vs_reference(v),
                    DASH if v.numerics is None else ("ok" if v.numerics.ok else "out of tolerance"),
                    one_line(v.error, 160) if v.error else "",
                ]
                for v in sel.variants
            ]
            lines += table(
                [
                    "variant",
                    "plan",
                    "latency (measured)",
                    "against the plan below, same rounds (measured)",
                    "vs reference",
                    "numerics",
                    "error",
                ],
                rows,
            )
            lines += [
                "Latency: the median per call in selection's brief timing, eager and "
                "torch.compile in one interleaved run, each rung in its own run paired with the "
                "plan below it; the plan below's latency in those rounds over the rung's is its "
                "paired ratio. A rung's speedup over the reference is chained from the paired "
                "ratios (est.), not its latency over the reference's: those were timed in "
                "different runs.",
                "",
            ]
        if sel.dropped:
            lines += ["Dropped by measurement (never ship slower):", ""]
            lines += [f"- {d.id} ({d.type}): {one_line(d.reason, 400)}" for d in sel.dropped]
            lines.append("")
    if a.implementation_notes:
        lines += ["From `profiler_output/implementation_notes.md`:", ""]
        lines += [*_demote(a.implementation_notes), ""]
    elif sel is not None:
        lines += ["_`profiler_output/implementation_notes.md` was not written._", ""]
    return lines


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


def section_validation(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Validation", ""]
    v = a.validation
    if v is None:
        return [*lines, _not_available(a, "validate"), ""]
    lines += [
        f"**{v.overall}**"
        + (f" — {one_line(v.message, 600)}" if v.message else "")
        + f" (backend {code(v.backend)}, file {code(v.file)})",
        "",
    ]
    names = [s for s in VALIDATION_STEPS if s in v.steps] + [
        s for s in v.steps if s not in VALIDATION_STEPS
    ]
    lines += table(
        ["#", "step", "status", "detail"],
        [
            [i, n, v.steps[n].status, one_line(v.steps[n].detail, 200)]
            for i, n in enumerate(names, 1)
        ],
    )
    if v.passes:
        lines += table(
            ["pass", "status", "matches", "detail"],
            [[p.name, p.status, p.matches, one_line(p.detail, 200)] for p in v.passes],
        )
    if v.numerics is not None:
        n = v.numerics
        lines += [
            f"Numerics ({fmt_dtype(n.dtype)}): max abs error {n.max_abs_err:.3g}, "
            f"relative error {n.rel_err:.3g} (rtol {n.rtol:g}, atol {n.atol:g}) — "
            f"{'within' if n.ok else 'OUT OF'} tolerance.",
            "",
        ]
    if v.checks:
        lines += table(
            ["check", "status", "detail"],
            [[k, c.status, one_line(c.detail, 200)] for k, c in v.checks.items()],
        )
    return lines


def _by_name(t: Timeline) -> dict[str, OperatorAggregate]:
    return {op.name: op for op in t.aggregated}


def section_before_after(a: WorkloadArtifacts, plots: bool) -> list[str]:
    lines = ["## Before and after, per operator", ""]
    base = gate_baseline(a)
    before = baseline_timeline(a.profile, base) if a.profile else None
    if before is None:
        return [*lines, _not_available(a, "capture"), ""]
    if a.optimized is None or not a.optimized.timelines:
        return [*lines, _not_available(a, "recapture"), ""]
    after = a.optimized.primary
    cpu = on_cpu(a)
    db, da = per_iter_divisor(before, cpu), per_iter_divisor(after, cpu)
    b_ops, a_ops = _by_name(before), _by_name(after)
    names = sorted(b_ops, key=lambda n: -op_time(b_ops[n], cpu))
    names += sorted((n for n in a_ops if n not in b_ops), key=lambda n: -op_time(a_ops[n], cpu))
    rows = []
    chart: list[tuple[str, float, float]] = []
    for name in names:
        b, o = b_ops.get(name), a_ops.get(name)
        bt = op_time(b, cpu) / db if b else 0.0
        at = op_time(o, cpu) / da if o else 0.0
        if b is None:
            change = "new overhead"
        elif o is None:
            change = "removed"
        else:
            change = f"{(at - bt) / bt * 100:+.1f}%" if bt else DASH
        rows.append(
            [
                code(name),
                fmt_us(bt) if b else DASH,
                fmt_count(b.kernel_count / db) if b else DASH,
                fmt_us(at) if o else DASH,
                fmt_count(o.kernel_count / da) if o else DASH,
                change,
            ]
        )
        chart.append((name, bt, at))
    if len(rows) > BEFORE_AFTER_ROWS:
        # keep every "new overhead" row: those are what a reader must not miss
        keep = [r for i, r in enumerate(rows) if i < BEFORE_AFTER_ROWS or r[-1] == "new overhead"]
        rows = [*keep, ["", f"… {len(rows) - len(keep)} smaller operators", "", "", "", ""]]
    ub, ua = _unattributed_us(before, cpu), _unattributed_us(after, cpu)
    if ub or ua:
        rows.append(
            [
                "(unattributed kernels)",
                fmt_us(ub),
                fmt_count(len(before.unattributed_kernels) / db),
                fmt_us(ua),
                fmt_count(len(after.unattributed_kernels) / da),
                "",
            ]
        )
    sb, sa = before.summary, after.summary
    total_change = (
        f"{(sa.device_time_per_iter_us - sb.device_time_per_iter_us) / sb.device_time_per_iter_us * 100:+.1f}%"  # noqa: E501
        if sb.device_time_per_iter_us
        else DASH
    )
    rows.append(
        [
            "**device time per iteration**",
            fmt_us(sb.device_time_per_iter_us),
            fmt_count(sb.kernels_per_iter),
            fmt_us(sa.device_time_per_iter_us),
            fmt_count(sa.kernels_per_iter),
            total_change,
        ]
    )
    lines += [
        f"Before: the {before.label} timeline of `profile.json` (the gate's baseline); after: "
        f"the {after.label} timeline of `profile_optimized.json`. {time_label(cpu)} and "
        'kernels per iteration. "new overhead" marks operators only the optimized backend runs.'
        + _gpu_time_agreement(after, a.optimized.timing),
        "",
    ]
    lines += table(
        ["operator", "before", "kernels before", "after", "kernels after", "change"], rows
    )
    lines += _figure(
        a,
        plots,
        "operators_before_after.png",
        f"{time_label(cpu)} per operator, before and after",
        lambda p: _plots.operator_bars(p, chart, before.label, after.label, time_label(cpu)),
    )
    return lines


def section_waterfall(a: WorkloadArtifacts, plots: bool) -> list[str]:
    lines = ["## What drove the speedup (per-pass waterfall)", ""]
    sel = a.selection
    if sel is None:
        return [*lines, _not_available(a, "backend"), ""]
    steps = waterfall_steps(sel)
    ref = BASELINE_LABELS.get(sel.reference, sel.reference)
    if not steps:
        return [
            *lines,
            f"_No step: no proposal made the backend faster, so it is the reference ({ref}) "
            "itself._",
            "",
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
    )
    chained = any(_paired_ms(s) is None for s in steps)
    lines += [
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
        ),
        "",
        _recapture_note(a, sel),
        "",
    ]
    bars = [
        _plots.WaterfallBar(ref, sel.reference_ms),
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
    lines += _figure(
        a, plots, "waterfall.png", "per-pass waterfall", lambda p: _plots.waterfall(p, bars)
    )
    return lines


def _paired_ms(s: WaterfallStep) -> tuple[float, float] | None:
    """A step's measured latency and the plan above's in the same rounds (schema 1.4 on)."""
    if s.measured_ms is None or s.paired_baseline_ms is None:
        return None
    return s.measured_ms, s.paired_baseline_ms


def _waterfall_row(s: WaterfallStep) -> list[str]:
    """A step's row: its measured latency, the plan above's in the same rounds and their ratio;
    a step written before schema 1.4 has only a chained latency, marked as the estimate it is."""
    measured = _paired_ms(s)
    if measured is None:
        latency, above, added = f"{fmt_ms(s.latency_ms)} (est.)", DASH, fmt_x(s.speedup_added)
    else:
        latency, above = fmt_ms(measured[0]), fmt_ms(measured[1])
        p = s.paired
        added = fmt_speedup(s.speedup_added, p.ci_low if p else None, p.ci_high if p else None)
    return [s.step, latency, above, added, fmt_x(s.speedup_cumulative)]


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


def section_estimated_vs_measured(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Estimated vs measured impact", ""]
    if a.optimizations is None:
        return [*lines, _not_available(a, "propose"), ""]
    if a.selection is None:
        return [*lines, _not_available(a, "backend"), ""]
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
        after_ms, above_ms = _paired_ms(step) or (step.latency_ms, prev_ms)
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
    )
    lines += [
        "Estimated: `optimizations.json` (`impact`, from the roofline model; summed over the "
        "proposals a step carried). Measured: that step of the waterfall, the plan above's "
        "latency minus the step's in the same interleaved rounds"
        + (
            " (a selection written before schema 1.4: the difference of chained latencies, "
            "an estimate)"
            if any(_paired_ms(s) is None for s in steps)
            else ""
        )
        + ". A ratio well below 1 means the model was optimistic.",
        "",
    ]
    return lines


def section_remaining(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Remaining opportunities", ""]
    found = False
    if a.optimizations is not None:
        for p in a.optimizations.proposals:
            status = proposal_status(a, p)
            if not _is_applied(status):
                found = True
                lines.append(
                    f"- {p.id} {p.type} on {', '.join(code(t) for t in p.targets)}: "
                    f"{status}; estimated {fmt_us(p.impact.estimated_saving_us)}, "
                    f"{fmt_x(p.impact.estimated_speedup)}."
                )
    else:
        lines.append(f"- Proposals: {_not_available(a, 'propose')}")
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
            lines.append(
                f"- {code(op.name)} still takes {fmt_pct(op.share)} of the {artifact} "
                f"timeline ({fmt_us(op_time(op, cpu) / div)} per iteration, "
                f"{fmt_count(op.kernel_count / div)} kernels), bottleneck "
                f"{op.bottleneck or 'not classified'}."
            )
        if t.summary.idle_time_per_iter_us and t.summary.device_time_per_iter_us:
            idle = (
                t.summary.idle_time_per_iter_us / t.summary.wall_time_per_iter_us
                if t.summary.wall_time_per_iter_us
                else None
            )
            if idle is not None and idle >= 0.2:
                found = True
                lines.append(
                    f"- The GPU is idle {fmt_pct(idle)} of the {artifact} iteration "
                    f"({fmt_us(t.summary.idle_time_per_iter_us)}): launch-bound."
                )
    if not found:
        lines.append(
            "None: every proposal was applied and no operator takes 10% or more of "
            "the optimized timeline."
        )
    return [*lines, ""]


def _session_out(out_dir: Path) -> str:
    out = Path(out_dir).parent
    try:
        rel = os.path.relpath(out.resolve(), Path.cwd().resolve())
    except ValueError:  # another drive on Windows
        return str(out)
    return str(out) if rel.startswith("..") else rel


def section_reproduction(a: WorkloadArtifacts) -> list[str]:
    out = _session_out(a.out_dir)
    stem = Path(a.path).stem
    extra, cli_extra = [], []
    if a.min_speedup != 1.0:
        extra.append(f"--opprof-min-speedup={a.min_speedup:g}")
        cli_extra.append(f"--min-speedup={a.min_speedup:g}")
    if a.gate_baseline != "best":
        extra.append(f"--opprof-baseline={a.gate_baseline}")
        cli_extra.append(f"--baseline={a.gate_baseline}")
    if a.strict_gate:
        extra.append("--opprof-strict-gate")
        cli_extra.append("--strict-gate")
    prof = a.profile or a.optimized
    if prof is not None and prof.capture_metadata.cpu_fallback:
        extra.append("--opprof-device=cpu")
        cli_extra.append("--device=cpu")
        if a.gate_on_cpu:
            extra.append("--opprof-gate-on-cpu")
            cli_extra.append("--gate-on-cpu")
    q = shlex.quote
    generated = f"{out}/{a.name}/{stem}_optimized.py"
    return [
        "## Reproduce",
        "",
        "From the folder pytest ran in:",
        "",
        "```bash",
        " ".join(["pytest --opprof", q(a.path), f"--opprof-out={q(out)}", *extra]),
        " ".join(["opprof optimize", q(a.path), f"--out={q(out)}", *cli_extra]),
        f"opprof validate {q(generated)}",
        "```",
        "",
    ]


def section_caveats(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Caveats", ""]
    for prof, artifact in ((a.profile, "profile.json"), (a.optimized, "profile_optimized.json")):
        if prof is None or not prof.timelines:
            continue
        t = prof.primary
        n = len(t.unattributed_kernels)
        lines.append(
            f"- Unattributed: {fmt_pct(1 - t.summary.attributed_share)} of the device time of "
            f"the {t.label} timeline (`{artifact}`) is not tied to an operator "
            f"({n} kernel record{'s' if n != 1 else ''}, "
            f"{fmt_us(_unattributed_us(t, on_cpu(a)))} per iteration); it is listed, never "
            "dropped."
        )
    prof = a.profile or a.optimized
    if prof is None:
        lines.append(f"- Capture: {_not_available(a, 'capture')}")
    else:
        counters = prof.counters or {}
        clock = counters.get("clock_control")
        if _has_counters(prof):
            lines.append(
                "- Hardware counters come from Nsight Compute replaying one measured iteration "
                f"(clock control: {clock or 'not recorded'}); replayed kernels run serialised, "
                "so counter durations are not the latencies above."
            )
            if counters.get("replay") == "unique":
                shares = [
                    f"{label} {entry['time_coverage_replayed']:.0%}"
                    for label, entry in counters.items()
                    if isinstance(entry, dict) and entry.get("time_coverage_replayed") is not None
                ]
                lines.append(
                    "- ncu replayed the first launch of each launch configuration (kernel, grid, "
                    "block, shared memory); the other launches carry its counters "
                    '(`counters_source: "same_launch_config"`). Kernel time replayed directly: '
                    + (", ".join(shares) or "not recorded")
                    + "; `--opprof-ncu-replay=all` replays every launch."
                )
        else:
            lines.append(
                "- Hardware counters missing: Nsight Compute did not run or was not permitted; "
                "bottleneck classes come from the fallbacks (kernel names, idle gaps)."
            )
        if prof.capture_metadata.cpu_fallback:
            lines.append(f"- CPU fallback: {CPU_CAVEAT}.")
        else:
            lines.append(
                f"- Clocks: latencies are timed with {prof.timing.clock} at the GPU's own "
                "clocks (not locked); thermal state and other tenants move them, which the "
                "interleaved rounds and the CI account for."
            )
    seen: set[tuple[str, str]] = set()
    for source in (a.profile, a.optimizations, a.optimized):
        for flag in getattr(source, "edge_case_flags", []) or []:
            if (flag.name, flag.detail) not in seen:
                seen.add((flag.name, flag.detail))
                lines.append(f"- Edge case {code(flag.name)}: {one_line(flag.detail).rstrip('.')}.")
    for prof, artifact in ((a.profile, "profile.json"), (a.optimized, "profile_optimized.json")):
        for w in prof.warnings if prof else []:
            lines.append(f"- Warning (`{artifact}`): {one_line(w)}")
    for stage, msg in a.stage_errors.items():
        lines.append(f"- Stage {stage}: {one_line(msg)}")
    return [*lines, ""]


def section_extra(sections: Sequence[tuple[str, str]]) -> list[str]:
    """The sections ``pytest_opprof_report_sections`` returned, as ``## title`` + markdown."""
    lines: list[str] = []
    for title, body in sections:
        lines += [f"## {one_line(title, 200)}", "", body.strip("\n"), ""]
    return lines


def render_workload_report(
    a: WorkloadArtifacts, *, plots: bool = True, extra_sections: Sequence[tuple[str, str]] = ()
) -> str:
    """The whole ``report.md`` of one workload. With ``plots`` and matplotlib present, the PNGs
    are written to ``a.out_dir / "profiler_output"`` and linked relatively. ``extra_sections``
    (title, markdown) come after the analysis, before the reproduction commands."""
    lines: list[str] = []
    lines += _title(a)
    lines += section_headline(a)
    lines += section_hardware(a)
    lines += section_operators(a, plots)
    lines += section_optimizations(a)
    lines += section_implementation(a)
    lines += section_validation(a)
    lines += section_before_after(a, plots)
    lines += section_waterfall(a, plots)
    lines += section_estimated_vs_measured(a)
    lines += section_remaining(a)
    lines += section_extra(extra_sections)
    lines += section_reproduction(a)
    lines += section_caveats(a)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_workload_report(a: WorkloadArtifacts, *, plots: bool = True) -> Path:
    """Render and write ``a.out_dir / "report.md"`` atomically; returns its path."""
    path = Path(a.out_dir) / "report.md"
    write_text_atomic(path, render_workload_report(a, plots=plots))
    return path


# ---------------------------------------------------------------------------------- session


def summary_row(s: WorkloadSummary) -> list[str]:
    return [
        s.name,
        verdict(s),
        BASELINE_LABELS.get(s.baseline or "", s.baseline or DASH),
        fmt_ms(s.baseline_ms, unit=False),
        fmt_ms(s.optimized_ms, unit=False),
        fmt_speedup(s.speedup, s.ci_low, s.ci_high),
        fmt_dtype(s.dtype),
        ", ".join(s.passes) or DASH,
    ]


def _report_link(s: WorkloadSummary, out_dir: Path) -> str | None:
    if s.report:
        target = Path(s.report)
        if target.is_absolute():
            try:
                return Path(os.path.relpath(target, Path(out_dir).resolve())).as_posix()
            except ValueError:
                return target.as_posix()
        return target.as_posix()
    default = Path(out_dir) / s.name / "report.md"
    return f"{s.name}/report.md" if default.is_file() else None


def _gpus_measured(
    items: Sequence[WorkloadSummary], out_dir: Path
) -> dict[str, tuple[list[str], set[int | None]]]:
    """GPU UUID -> (the workloads whose capture or recapture measured on it, the GPU counts
    those processes saw), from each workload's two profiles; empty where none recorded a
    UUID (CPU runs, profiles from before Profile 2.3)."""
    from pytest_opprof.errors import ArtifactError
    from pytest_opprof.schema import read_artifact

    gpus: dict[str, tuple[list[str], set[int | None]]] = {}
    for s in items:
        for name in ("profile_optimized.json", "profile.json"):
            path = Path(out_dir) / s.name / name
            if not path.is_file():
                continue
            try:
                meta = read_artifact(path, Profile).capture_metadata
            except ArtifactError:
                continue
            if meta.device_uuid:
                names, counts = gpus.setdefault(meta.device_uuid, ([], set()))
                if s.name not in names:
                    names.append(s.name)
                counts.add(meta.device_count)
    return gpus


def _gpus_line(gpus: dict[str, tuple[list[str], set[int | None]]]) -> str:
    counts = {c for _, seen in gpus.values() for c in seen}
    alone = " Each process saw one GPU." if counts == {1} else ""
    if len(gpus) == 1:
        ((uuid, _),) = gpus.items()
        return f"Measured on one GPU, `{uuid}`.{alone}"
    parts = [f"`{uuid}`: {', '.join(names)}" for uuid, (names, _) in gpus.items()]
    return f"Measured on {len(gpus)} GPUs: {'; '.join(parts)}.{alone}"


def render_session_report(items: Sequence[WorkloadSummary], *, device: str, out_dir: Path) -> str:
    """The session's ``report.md``: one table of every workload, then links to their reports."""
    verdicts = [verdict(s) for s in items]
    counts = {
        k: verdicts.count(k) for k in ("passed", CPU_NOT_ENFORCED, "failed", "error", "skipped")
    }
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no workload"
    lines = [
        "# pytest-opprof session report",
        "",
        f"Device: {device} · {len(items)} workload{'s' if len(items) != 1 else ''}: {tally}",
        "",
    ]
    if counts[CPU_NOT_ENFORCED]:
        lines += [
            f"**{CPU_NOT_ENFORCED}** where a workload ran on the CPU: its speedup is a CPU "
            "figure, not a verdict; `--opprof-gate-on-cpu` enforces it.",
            "",
        ]
    gpus = _gpus_measured(items, out_dir)
    if gpus:
        lines += [_gpus_line(gpus), ""]
    if items:
        lines += table(
            [
                "workload",
                "status",
                "baseline",
                "baseline (ms)",
                "optimized (ms)",
                "speedup (95% CI)",
                "dtype",
                "passes",
            ],
            [summary_row(s) for s in items],
        )
    problems = [s for s in items if s.status in ("failed", "error") and s.message]
    if problems:
        lines += ["## Problems", ""]
        lines += [
            f"- **{_cell(s.name)}** ({s.status} at {ITEM_NAMES.get(s.stage, s.stage)}): "
            f"{one_line(s.message)}"
            for s in problems
        ]
        lines.append("")
    lines += ["## Reports", ""]
    links = 0
    for s in items:
        link = _report_link(s, out_dir)
        if link:
            links += 1
            label = s.name.replace("[", "\\[").replace("]", "\\]")
            lines.append(f"- [{label}]({link.replace(' ', '%20')})")
    if not links:
        lines.append("_No workload report was written._")
    return "\n".join(lines).rstrip("\n") + "\n"


def render_comment_body(session_md: str) -> str:
    """The pull-request comment: the session report behind the hidden marker."""
    return f"{COMMENT_MARKER}\n{session_md}"
