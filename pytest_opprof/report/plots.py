"""PNG plots beside ``report.md``: per-operator before/after bars, the per-pass waterfall, and a
roofline of the kernels that carry counters under the device's roofs from the hardware table.

matplotlib is the optional ``plots`` extra. It is imported inside each drawing function, and
only its object-oriented API is used (``Figure`` + Agg canvas): no pyplot, so no global state,
no GUI backend and nothing left open between calls.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_opprof.knowledge import lookup_gpu
from pytest_opprof.schema import CaptureMetadata, KernelRecord, Timeline

PLOTS_MISSING = "plots need `pip install pytest-opprof[plots]`"
MAX_BARS = 12

FLOP_KEYS: tuple[str, ...] = ("flops", "flop_count", "executed_flops")
"""Kernel metric names read as floating-point operations of one launch (base unit: FLOP)."""
BYTE_KEYS: tuple[str, ...] = ("dram_bytes",)
BYTE_PAIRS: tuple[tuple[str, str], ...] = (
    ("dram_bytes_read", "dram_bytes_write"),
    ("dram_bytes_read", "dram_bytes_written"),
)
"""DRAM traffic of one launch, in bytes: one total key, or read + written."""


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


@dataclass(frozen=True)
class RooflinePoint:
    kernel: str
    intensity: float
    """FLOP per DRAM byte."""
    flops_per_s: float


def _first(metrics: Mapping[str, float | None], keys: Iterable[str]) -> float | None:
    for key in keys:
        value = metrics.get(key)
        if value is not None:
            return float(value)
    return None


def _kernel_point(k: KernelRecord) -> RooflinePoint | None:
    flops = _first(k.metrics, FLOP_KEYS)
    nbytes = _first(k.metrics, BYTE_KEYS)
    if nbytes is None:
        for read, written in BYTE_PAIRS:
            r, w = k.metrics.get(read), k.metrics.get(written)
            if r is not None and w is not None:
                nbytes = float(r) + float(w)
                break
    if not flops or not nbytes or k.duration_us <= 0:
        return None
    return RooflinePoint(k.name, flops / nbytes, flops / (k.duration_us * 1e-6))


def roofline_points(timelines: Sequence[Timeline]) -> list[RooflinePoint]:
    """One point per kernel launch whose counters give both FLOPs and DRAM bytes."""
    points = []
    for t in timelines:
        kernels = [k for op in t.operators for k in op.kernels] + list(t.unattributed_kernels)
        points += [p for p in map(_kernel_point, kernels) if p is not None]
    return points


@dataclass(frozen=True)
class Roof:
    """One compute roof: a peak rate the device's hardware table gives."""

    label: str
    flops_per_s: float


@dataclass(frozen=True)
class DeviceRoofs:
    """The roofs of one device: its DRAM bandwidth and its compute peaks (dense, FLOP/s)."""

    device: str
    bandwidth_bytes_per_s: float
    compute: tuple[Roof, ...]
    note: str = ""
    """Why the figures are approximate (a GPU matched by architecture); empty when exact."""

    def ridge(self, roof: Roof) -> float:
        """Arithmetic intensity (FLOP per DRAM byte) where ``roof`` meets the bandwidth roof."""
        return roof.flops_per_s / self.bandwidth_bytes_per_s


def device_roofs(meta: CaptureMetadata) -> DeviceRoofs | None:
    """The roofs of the profiled device from the hardware table (``knowledge.lookup_gpu`` by
    its name, SM count and compute capability): DRAM bandwidth, the bf16/fp16 tensor-core
    peaks (one roof where they are equal) and fp32 on the CUDA cores. None on the CPU."""
    if meta.device_type != "cuda":
        return None
    found = re.findall(r"\d+", meta.compute_capability or "")
    cc = (int(found[0]), int(found[1])) if len(found) >= 2 else None
    match = lookup_gpu(meta.device_name, meta.sm_count, cc)
    if match is None:
        return None
    spec, pf = match.spec, match.spec.peak_flops
    tensor = (
        [Roof("bf16/fp16 tensor", pf.bf16)]
        if pf.bf16 == pf.fp16
        else [Roof("bf16 tensor", pf.bf16), Roof("fp16 tensor", pf.fp16)]
    )
    return DeviceRoofs(
        device=spec.name,
        bandwidth_bytes_per_s=spec.memory_bandwidth_bytes_per_s,
        compute=(*tensor, Roof("fp32 CUDA cores", pf.fp32)),
        note=match.note,
    )


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Path) -> Path:
    """PNG written atomically, like every artifact: a reader never sees half a file."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(buf.getvalue())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _short(name: str, limit: int = 40) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def operator_bars(
    path: Path,
    rows: Sequence[tuple[str, float, float]],
    before_label: str,
    after_label: str,
    what: str = "GPU time",
) -> Path:
    """Horizontal bars of time per iteration (µs), before and after, largest first."""
    top = sorted(rows, key=lambda r: -max(r[1], r[2]))[:MAX_BARS]
    if not top:
        raise ValueError("no operator to plot")
    fig = _figure(8.0, 1.2 + 0.42 * len(top))
    ax = fig.add_subplot()
    ys = list(range(len(top)))[::-1]
    h = 0.4
    ax.barh([y + h / 2 for y in ys], [r[1] for r in top], h, label=before_label, color="#9e9e9e")
    ax.barh([y - h / 2 for y in ys], [r[2] for r in top], h, label=after_label, color="#1f77b4")
    ax.set_yticks(ys, [_short(r[0]) for r in top], fontsize=8)
    ax.set_xlabel(f"{what} per iteration (µs)")
    ax.set_title(f"Per-operator {what}, before and after")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


@dataclass(frozen=True)
class WaterfallBar:
    """One bar of the waterfall: a plan's latency, and what its label may claim of it."""

    name: str
    latency_ms: float
    measured: bool = True
    """False: a latency chained from ratios (a selection written before schema 1.4)."""
    speedup: float | None = None
    """Over the reference, chained from the paired ratios (an estimate); None: not shown."""
    recapture: bool = False
    """The recapture's latency of the chosen plan: the gate's figure, timed on its own."""


def waterfall(path: Path, steps: Sequence[WaterfallBar]) -> Path:
    """Latency of each cumulative plan (the first is the reference), with the speedup chained so
    far, and the recapture's latency of the chosen plan where there is one. Each label says
    which of its numbers are measured and which estimated."""
    if not steps:
        raise ValueError("no waterfall step to plot")
    fig = _figure(1.5 + 1.1 * len(steps), 4.6)
    ax = fig.add_subplot()
    names = [_short(s.name, 22) for s in steps]
    latencies = [s.latency_ms for s in steps]
    colors = [
        "#ff7f0e" if s.recapture else "#9e9e9e" if i == 0 else "#1f77b4"
        for i, s in enumerate(steps)
    ]
    bars = ax.bar(range(len(steps)), latencies, color=colors)
    for bar, s in zip(bars, steps, strict=True):
        label = f"{s.latency_ms:.3f} ms" + ("" if s.measured else " (est.)")
        if s.speedup is not None:
            label += f"\n{s.speedup:.2f}× est."
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(steps)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("latency per call (ms)")
    ax.set_ylim(0, max(latencies) * 1.3)
    notes = [
        "latency: measured in selection's brief timing",
        "×: chained from paired ratios (est.)",
    ]
    if any(s.recapture for s in steps):
        notes.append("orange: the recapture's latency, the gate's figure")
    ax.set_title("Per-pass waterfall\n" + "\n".join(notes), fontsize=8)
    return _save(fig, path)


def roofline_figure(
    series: Mapping[str, Sequence[RooflinePoint]], roofs: DeviceRoofs | None
) -> Any:
    """The roofline as a matplotlib ``Figure``: kernels placed by measured arithmetic intensity
    and achieved FLOP/s (log-log), one colour per profile, under the device's roofs — DRAM
    bandwidth, then each compute peak flat from its ridge point, the ridge marked."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("no kernel with FLOP and byte counters")
    fig = _figure(7.0, 4.8)
    ax = fig.add_subplot()
    for (label, pts), color in zip(series.items(), ("#9e9e9e", "#1f77b4", "#2ca02c"), strict=False):
        if pts:
            ax.scatter(
                [p.intensity for p in pts],
                [p.flops_per_s / 1e12 for p in pts],
                s=22,
                alpha=0.8,
                color=color,
                label=f"{label} kernels",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    if roofs is not None:
        _draw_roofs(ax, roofs, [p.intensity for p in points])
        title = f"Roofline on {roofs.device} (peaks: hardware table)"
        ax.set_title(title + ("\napproximate: " + _short(roofs.note, 90) if roofs.note else ""))
    else:
        ax.set_title("Roofline (device not in the hardware table: kernels only)", fontsize=9)
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("arithmetic intensity (FLOP / DRAM byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _draw_roofs(ax: Any, roofs: DeviceRoofs, intensities: Sequence[float]) -> None:
    """The bandwidth roof up to the highest ridge, each compute roof from its own ridge on."""
    ridges = [roofs.ridge(r) for r in roofs.compute]
    lo = min(min(intensities) / 4, min(ridges) / 8)
    hi = max(max(intensities) * 4, max(ridges) * 8)
    bw = roofs.bandwidth_bytes_per_s
    ax.plot(
        [lo, max(ridges)],
        [bw * lo / 1e12, bw * max(ridges) / 1e12],
        color="#d62728",
        label=f"DRAM {bw / 1e12:.3g} TB/s",
    )
    colors = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
    for roof, ridge, color in zip(roofs.compute, ridges, colors, strict=False):
        peak = roof.flops_per_s / 1e12
        ax.plot(
            [ridge, hi],
            [peak, peak],
            color=color,
            label=f"{roof.label} {peak:.4g} TFLOP/s (ridge {ridge:.3g} FLOP/B)",
        )
        # "_" keeps the marker out of the legend; the roof's own label names the ridge
        ax.plot([ridge], [peak], marker="o", color=color, label=f"_ridge {roof.label}")
        ax.annotate(
            f"ridge {ridge:.3g}",
            (ridge, peak),
            textcoords="offset points",
            xytext=(-4, 5),
            ha="right",
            fontsize=7,
        )


def roofline(
    path: Path, series: Mapping[str, Sequence[RooflinePoint]], roofs: DeviceRoofs | None
) -> Path:
    """:func:`roofline_figure`, written to ``path``."""
    return _save(roofline_figure(series, roofs), path)


@dataclass(frozen=True)
class TrendPoint:
    """One stored run of a workload: latencies and the gate's speedup, each with its CI."""

    label: str
    latencies: Mapping[str, tuple[float, float, float]]
    """variant → (median, CI low, CI high), ms."""
    speedup: tuple[float, float, float] | None = None
    """The optimized backend against the gate's baseline: (ratio, CI low, CI high)."""


def trend(path: Path, title: str, points: Sequence[TrendPoint]) -> Path:
    """A workload over stored runs, oldest first: each variant's latency (top) and the gate's
    speedup (bottom), each point with its 95% CI as an error bar."""
    if not points:
        raise ValueError("no run to plot")
    fig = _figure(1.8 + 0.55 * len(points), 5.6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    xs = list(range(len(points)))
    names = sorted({n for p in points for n in p.latencies}, key=variant_rank)
    for name in names:
        at = [
            (x, p.latencies[name]) for x, p in zip(xs, points, strict=True) if name in p.latencies
        ]
        top.errorbar(
            [x for x, _ in at],
            [m for _, (m, _, _) in at],
            yerr=[[m - lo for _, (m, lo, _) in at], [hi - m for _, (m, _, hi) in at]],
            marker="o",
            ms=4,
            capsize=3,
            label=name,
        )
    top.set_ylabel("latency per call (ms)")
    top.set_ylim(bottom=0)
    top.legend(fontsize=8, loc="best")
    top.set_title(f"{_short(title)} across stored runs (95% CI)", fontsize=10)
    at_s = [(x, p.speedup) for x, p in zip(xs, points, strict=True) if p.speedup is not None]
    if at_s:
        bottom.errorbar(
            [x for x, _ in at_s],
            [s[0] for _, s in at_s],
            yerr=[[s[0] - s[1] for _, s in at_s], [s[2] - s[0] for _, s in at_s]],
            marker="o",
            ms=4,
            capsize=3,
            color="#2ca02c",
        )
    bottom.axhline(1.0, color="#9e9e9e", lw=0.8, ls="--")
    bottom.set_ylabel("speedup (gate) ×")
    bottom.set_xticks(
        xs, [_short(p.label, 18) for p in points], rotation=30, ha="right", fontsize=7
    )
    return _save(fig, path)


def variant_rank(name: str) -> tuple[int, str]:
    order = ("eager", "compile", "stock", "optimized", "optimized_baseline_dtype")
    return (order.index(name) if name in order else len(order), name)
