"""The report's operator sections: where the baseline's time goes (the top operators of its
timeline, and the roofs its kernels sit under) and how each operator's time changed in the
optimized backend.

Times are per iteration (``lookups.per_iter_divisor``), GPU time on a GPU and CPU time on the
CPU fallback; every row is copied from ``profile.json`` and ``profile_optimized.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_opprof.report import plots as _plots
from pytest_opprof.report.format import (
    DASH,
    code,
    fmt_count,
    fmt_pct,
    fmt_us,
    para,
    table,
)
from pytest_opprof.report.lookups import (
    baseline_timeline,
    gate_baseline,
    not_available,
    on_cpu,
    op_time,
    per_iter_divisor,
    time_label,
    unattributed_us,
)
from pytest_opprof.schema import OperatorAggregate, Timeline, Timing, timing_variant

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

TOP_OPERATORS = 15
BEFORE_AFTER_ROWS = 25
KERNEL_CELL = 60
"""Characters of a kernel name in a table; the whole name follows the table."""


def timeline_line(t: Timeline, artifact: str, index: int, timing: Timing) -> str:
    s = t.summary
    idle = f", idle {fmt_us(s.idle_time_per_iter_us)}" if s.idle_time_per_iter_us else ""
    line = (
        f"{t.label} timeline (`{artifact}` → `timelines[{index}]`, compile mode {t.compile_mode}): "
        f"{fmt_us(s.device_time_per_iter_us)} of device time per iteration over "
        f"{s.iterations} profiled iterations, {fmt_count(s.kernels_per_iter)} kernels per "
        f"iteration{idle}; {fmt_pct(s.attributed_share)} of that time attributed to operators "
        f"({fmt_pct(s.high_share)} at high confidence)."
    )
    return line + gpu_time_agreement(t, timing)


def gpu_time_agreement(t: Timeline, timing: Timing) -> str:
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


def roofline_series(a: WorkloadArtifacts) -> dict[str, list[_plots.RooflinePoint]]:
    """The kernels that carry FLOP and DRAM-byte counters, baseline and optimized; none
    without the baseline's profile."""
    if a.profile is None:
        return {}
    series = {"baseline": _plots.roofline_points(a.profile.timelines)}
    if a.optimized is not None:
        series["optimized"] = _plots.roofline_points(a.optimized.timelines[:1])
    return series


def roofs_line(roofs: _plots.DeviceRoofs) -> str:
    """The roofs the roofline plot draws, with their ridge points, named for the reader."""
    parts = [
        f"{r.label} {r.flops_per_s / 1e12:.4g} TFLOP/s (ridge {roofs.ridge(r):.3g} FLOP/B)"
        for r in roofs.compute
    ]
    line = (
        f"Roofline roofs: {roofs.device} from the hardware table (`data/hardware.json`): DRAM "
        f"{roofs.bandwidth_bytes_per_s / 1e12:.3g} TB/s; {'; '.join(parts)}."
    )
    return line + (f" Approximate: {roofs.note}." if roofs.note else "")


def section_operators(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Operator summary", ""]
    if a.profile is None or not a.profile.timelines:
        return [*lines, *para(not_available(a, "capture"))]
    t = a.profile.primary
    cpu = on_cpu(a)
    div = per_iter_divisor(t, cpu)
    lines += para(timeline_line(t, "profile.json", 0, a.profile.timing))
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
            code(op.kernel_names[0]) if op.kernel_names else DASH,
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
                fmt_us(unattributed_us(t, cpu)),
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
        caps={1: 60, 7: KERNEL_CELL},
        key=1,
    )
    compiled = a.profile.timeline("compiled")
    if compiled is not None and compiled is not t:
        index = a.profile.timelines.index(compiled)
        lines += para(timeline_line(compiled, "profile.json", index, a.profile.timing))
    roofs = _plots.device_roofs(a.profile.capture_metadata)
    if roofs is not None and any(roofline_series(a).values()):
        lines += para(roofs_line(roofs))
    return lines


@dataclass(frozen=True)
class OperatorChange:
    """One operator before and after, per iteration; ``None`` where its timeline lacks it."""

    name: str
    before: OperatorAggregate | None
    after: OperatorAggregate | None
    before_us: float
    after_us: float


@dataclass(frozen=True)
class BeforeAfter:
    before: Timeline
    after: Timeline
    cpu: bool
    changes: list[OperatorChange]


def before_after(a: WorkloadArtifacts) -> BeforeAfter | None:
    """The gate's baseline timeline against the optimized one, operator by operator: the
    baseline's operators by time, then those only the optimized backend runs."""
    before = baseline_timeline(a.profile, gate_baseline(a)) if a.profile else None
    if before is None or a.optimized is None or not a.optimized.timelines:
        return None
    after = a.optimized.primary
    cpu = on_cpu(a)
    db, da = per_iter_divisor(before, cpu), per_iter_divisor(after, cpu)
    b_ops = {op.name: op for op in before.aggregated}
    a_ops = {op.name: op for op in after.aggregated}
    names = sorted(b_ops, key=lambda n: -op_time(b_ops[n], cpu))
    names += sorted((n for n in a_ops if n not in b_ops), key=lambda n: -op_time(a_ops[n], cpu))
    changes = []
    for name in names:
        b, o = b_ops.get(name), a_ops.get(name)
        changes.append(
            OperatorChange(
                name,
                b,
                o,
                op_time(b, cpu) / db if b else 0.0,
                op_time(o, cpu) / da if o else 0.0,
            )
        )
    return BeforeAfter(before, after, cpu, changes)


def _change(c: OperatorChange) -> str:
    if c.before is None:
        return "new overhead"
    if c.after is None:
        return "removed"
    return f"{(c.after_us - c.before_us) / c.before_us * 100:+.1f}%" if c.before_us else DASH


def _percent(before: float, after: float) -> str:
    return f"{(after - before) / before * 100:+.1f}%" if before else DASH


def section_before_after(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Before and after, per operator", ""]
    if a.profile is None or baseline_timeline(a.profile, gate_baseline(a)) is None:
        return [*lines, *para(not_available(a, "capture"))]
    found = before_after(a)
    if found is None or a.optimized is None:
        return [*lines, *para(not_available(a, "recapture"))]
    before, after, cpu = found.before, found.after, found.cpu
    db, da = per_iter_divisor(before, cpu), per_iter_divisor(after, cpu)
    rows = [
        [
            code(c.name),
            fmt_us(c.before_us) if c.before else DASH,
            fmt_count(c.before.kernel_count / db) if c.before else DASH,
            fmt_us(c.after_us) if c.after else DASH,
            fmt_count(c.after.kernel_count / da) if c.after else DASH,
            _change(c),
        ]
        for c in found.changes
    ]
    if len(rows) > BEFORE_AFTER_ROWS:
        # keep every "new overhead" row: those are what a reader must not miss
        keep = [r for i, r in enumerate(rows) if i < BEFORE_AFTER_ROWS or r[-1] == "new overhead"]
        rows = [*keep, ["", f"… {len(rows) - len(keep)} smaller operators", "", "", "", ""]]
    ub, ua = unattributed_us(before, cpu), unattributed_us(after, cpu)
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
    rows.append(
        [
            "**device time per iteration**",
            fmt_us(sb.device_time_per_iter_us),
            fmt_count(sb.kernels_per_iter),
            fmt_us(sa.device_time_per_iter_us),
            fmt_count(sa.kernels_per_iter),
            _percent(sb.device_time_per_iter_us, sa.device_time_per_iter_us),
        ]
    )
    lines += para(
        f"Before: the {before.label} timeline of `profile.json` (the gate's baseline); after: "
        f"the {after.label} timeline of `profile_optimized.json`. {time_label(cpu)} and "
        'kernels per iteration. "new overhead" marks operators only the optimized backend runs.'
        + gpu_time_agreement(after, a.optimized.timing)
    )
    lines += table(
        ["operator", "before", "kernels before", "after", "kernels after", "change"],
        rows,
        caps={0: 80},
    )
    return lines
