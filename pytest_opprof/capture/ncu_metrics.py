"""Nsight Compute's metrics as the pipeline reads them: the logical counters and the ncu
metrics behind each (architecture fallbacks in order), parsing ncu's raw CSV into base units,
joining its rows to a timeline's kernels by name and ordinal within the measured iteration,
and the per-operator aggregates and roofline figures. Data in, data out: running ncu is
``capture.counters``'s."""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pytest_opprof.schema import KernelRecord, Timeline

NVTX_RANGE = "opprof_iteration"


# Logical name -> ncu metrics in order of preference; the first one present in the CSV header
# wins, and a name none of whose candidates is present is None (the GPU lacks it), never 0.
METRICS: dict[str, tuple[str, ...]] = {
    "gpu_time_ns": ("gpu__time_duration.sum",),
    "dram_bytes_read": ("dram__bytes_read.sum",),
    "dram_bytes_write": ("dram__bytes_write.sum",),
    "dram_throughput_pct": (
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    ),
    "memory_throughput_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",),
    "l1_throughput_pct": ("l1tex__throughput.avg.pct_of_peak_sustained_active",),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",),
    "l1_hit_rate_pct": ("l1tex__t_sector_hit_rate.pct",),
    "l2_hit_rate_pct": ("lts__t_sector_hit_rate.pct",),
    # Hopper's wgmma runs on the gmma path, which the hmma metric does not see: prefer the
    # all-tensor-pipe metric where the chip has it.
    "tensor_active_pct": (
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
    ),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active",),
    "warp_cycles_per_issued": ("smsp__average_warp_latency_per_inst_issued.ratio",),
    "issue_active_pct": (
        "sm__inst_issued.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
    ),
    "instructions": ("smsp__inst_executed.sum", "sm__inst_executed.sum"),
    "ipc": ("sm__inst_executed.avg.per_cycle_active",),
    "threads_per_warp": ("smsp__thread_inst_executed_per_inst_executed.ratio",),
    "registers_per_thread": ("launch__registers_per_thread",),
    "local_spill_bytes": ("l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",),
    "dynamic_shared_memory_bytes": ("launch__shared_mem_per_block_dynamic",),
    # FLOP counts: SIMT instructions (an FMA is two FLOPs) and tensor-pipe operations.
    "fadd": ("smsp__sass_thread_inst_executed_op_fadd_pred_on.sum",),
    "fmul": ("smsp__sass_thread_inst_executed_op_fmul_pred_on.sum",),
    "ffma": ("smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",),
    "hadd": ("smsp__sass_thread_inst_executed_op_hadd_pred_on.sum",),
    "hmul": ("smsp__sass_thread_inst_executed_op_hmul_pred_on.sum",),
    "hfma": ("smsp__sass_thread_inst_executed_op_hfma_pred_on.sum",),
    "tensor_ops": ("sm__ops_path_tensor_src_all.sum", "sm__ops_path_tensor.sum"),
}

SUM = frozenset(
    {
        "gpu_time_ns",
        "dram_bytes_read",
        "dram_bytes_write",
        "dram_bytes",
        "instructions",
        "local_spill_bytes",
        "flops",
        *("fadd", "fmul", "ffma", "hadd", "hmul", "hfma", "tensor_ops"),
    }
)
MAX = frozenset({"registers_per_thread", "dynamic_shared_memory_bytes"})
# Everything else (throughput %, hit rates, occupancy, IPC, warp cycles, threads per warp) is a
# rate: its operator value is the mean over kernels weighted by each kernel's duration.

_TIME_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
_TIME_NS |= {"second": 1e9, "s": 1e9}
_BYTES = {"byte": 1.0, "b": 1.0}
for _p, _f in (("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12)):
    _BYTES |= {f"{_p}byte": _f, f"{_p}b": _f}


class KernelCounters(BaseModel):
    """One timeline kernel's counters: ``index`` is its position in the iteration."""

    model_config = ConfigDict(extra="forbid")
    index: int
    name: str
    ncu_id: int
    metrics: dict[str, float | None]
    bound: Literal["memory", "compute"] | None = None
    source: Literal["measured", "same_launch_config"] = "measured"


# ---------------------------------------------------------------------------------- parsing


class CountersResult(BaseModel):
    """What the counters pass returns; a failure is a ``note``, never an exception."""

    model_config = ConfigDict(extra="forbid")
    metrics: list[KernelCounters] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    note: str | None = None
    resolved: dict[str, str | None] = Field(
        default_factory=dict, description="logical name -> the ncu metric read"
    )
    command: list[str] = Field(default_factory=list)


def to_base(value: str, unit: str) -> float | None:
    """One ncu cell in base units: times in ns, sizes in bytes (1000-based, as ncu prints
    them), rates per second (bytes/s); ``%``, cycles, instructions… as printed."""
    text = value.strip().replace(",", "")
    if text in ("", "n/a", "N/A", "nan", "-"):
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    num, _, den = unit.strip().partition("/")
    if not den:
        return number * _scale(num)
    # A rate: per second when its denominator is a time (bytes/s, FLOP/s), else as printed.
    per = _TIME_NS[den.strip().lower()] / 1e9 if den.strip().lower() in _TIME_NS else _scale(den)
    return number * _scale(num) / per


def _scale(unit: str) -> float:
    key = unit.strip().lower()
    if key in _TIME_NS:
        return _TIME_NS[key]
    if key in _BYTES:
        return _BYTES[key]
    return 1.0


class NcuRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int
    name: str
    values: dict[str, float | None]
    grid: list[int] | None = None
    block: list[int] | None = None
    shared_memory: int | None = None
    label: str | None = Field(
        default=None, description="the timeline label its NVTX range names (None: one range)"
    )


def _dims(cell: str) -> list[int] | None:
    """``"(256, 1, 1)"`` -> ``[256, 1, 1]``; None for anything else."""
    numbers = re.findall(r"\d+", cell)
    return [int(n) for n in numbers] if len(numbers) == 3 else None


def parse_raw_csv(text: str) -> tuple[list[NcuRow], list[str]]:
    """ncu's ``--csv --page raw`` output: a header of column names, a row of units, then one
    row per kernel. Lines that are not CSV (``==PROF==`` and the like) are skipped. Returns
    the rows in launch order and the header's metric columns."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return [], []
    table = list(csv.reader(lines[start:]))
    header = table[0]
    units = table[1] if len(table) > 1 else []
    has_units = bool(units) and units[0].strip() == ""
    body = table[2:] if has_units else table[1:]
    if not has_units:
        units = [""] * len(header)
    name_col = header.index("Kernel Name")
    grid_col = header.index("Grid Size") if "Grid Size" in header else None
    block_col = header.index("Block Size") if "Block Size" in header else None
    nvtx_col = next((i for i, h in enumerate(header) if "Push/Pop_Range" in h), None)
    metric_cols = [i for i, h in enumerate(header) if "__" in h]
    rows = []
    for cells in body:
        if len(cells) != len(header) or not cells[0].strip().isdigit():
            continue
        values = {header[i]: to_base(cells[i], units[i]) for i in metric_cols}
        rows.append(
            NcuRow(
                id=int(cells[0]),
                name=cells[name_col],
                values=values,
                grid=_dims(cells[grid_col]) if grid_col is not None else None,
                block=_dims(cells[block_col]) if block_col is not None else None,
                shared_memory=_shared_memory(values),
                label=_range_label(cells[nvtx_col]) if nvtx_col is not None else None,
            )
        )
    rows.sort(key=lambda r: r.id)
    return rows, [header[i] for i in metric_cols]


def _shared_memory(values: Mapping[str, float | None]) -> int | None:
    """Static + dynamic shared memory per block, what the profiler's "shared memory" holds."""
    static = values.get("launch__shared_mem_per_block_static")
    dynamic = values.get("launch__shared_mem_per_block_dynamic")
    return None if static is None or dynamic is None else int(static + dynamic)


_RANGE_LABEL = re.compile(rf"(?<![\w]){NVTX_RANGE}_([A-Za-z0-9]+)(?![\w])")


def _range_label(cell: str) -> str | None:
    match = _RANGE_LABEL.search(cell)
    return match.group(1) if match else None


def resolve(header: Sequence[str]) -> dict[str, str | None]:
    """Logical name -> the first candidate present in the CSV header (None: absent)."""
    present = set(header)
    return {
        name: next((m for m in candidates if m in present), None)
        for name, candidates in METRICS.items()
    }


def logical_metrics(row: NcuRow, resolved: Mapping[str, str | None]) -> dict[str, float | None]:
    """One row's logical metrics, plus the derived ``dram_bytes`` and ``flops``."""
    out = {name: (row.values.get(m) if m else None) for name, m in resolved.items()}
    read, write = out.get("dram_bytes_read"), out.get("dram_bytes_write")
    out["dram_bytes"] = read + write if read is not None and write is not None else None
    simt = [out.get(k) for k in ("fadd", "fmul", "ffma", "hadd", "hmul", "hfma")]
    tensor_busy = (out.get("tensor_active_pct") or 0.0) > 0.0
    if all(v is None for v in simt[:3]) or (tensor_busy and out.get("tensor_ops") is None):
        # no count, or a tensor-core kernel whose tensor FLOPs this chip cannot count: a SIMT
        # count alone would put a GEMM far below its roof, so say nothing instead
        out["flops"] = None
    else:
        fadd, fmul, ffma, hadd, hmul, hfma = (v or 0.0 for v in simt)
        # half-precision SIMT ops count per instruction thread; the packed form is counted
        # once by ncu, so this is a lower bound for half2 code.
        out["flops"] = fadd + fmul + 2 * ffma + hadd + hmul + 2 * hfma + (out["tensor_ops"] or 0.0)
    return out


# ------------------------------------------------------------------------------------ join


def kernel_key(name: str) -> str:
    """The function's own name in a demangled kernel name: no namespaces, return type, template
    arguments or parameters. ``void at::native::k<float, 4>(float*)`` -> ``k``."""
    out: list[str] = []
    depth = 0
    for ch in name.strip():
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip()
    if text.endswith(")"):  # drop the trailing parameter list, balanced
        level = 0
        for i in range(len(text) - 1, -1, -1):
            level += {")": 1, "(": -1}.get(text[i], 0)
            if level == 0:
                text = text[:i].rstrip()
                break
    qualified = text.split()[-1] if text.split() else text
    return qualified.rsplit("::", 1)[-1]


def join(
    timeline: Sequence[KernelRecord], rows: Sequence[NcuRow], resolved: Mapping[str, str | None]
) -> tuple[list[KernelCounters], list[str]]:
    """Pair timeline kernels (one iteration, launch order) with ncu rows by key + ordinal."""
    by_key_t: dict[str, list[int]] = {}
    for i, k in enumerate(timeline):
        by_key_t.setdefault(kernel_key(k.name), []).append(i)
    by_key_n: dict[str, list[NcuRow]] = {}
    for r in rows:
        by_key_n.setdefault(kernel_key(r.name), []).append(r)
    out: list[KernelCounters] = []
    warnings: list[str] = []
    for key in sorted(set(by_key_t) | set(by_key_n)):
        t, n = by_key_t.get(key, []), by_key_n.get(key, [])
        if len(t) != len(n):
            warnings.append(
                f"counters: kernel {key!r} ran {len(t)}x in the timeline iteration but "
                f"{len(n)}x under ncu; its counters are left out rather than paired by guess"
            )
            continue
        clash = next(
            (
                (timeline[i], row)
                for i, row in zip(t, n, strict=True)
                if _geometry_differs(timeline[i], row)
            ),
            None,
        )
        if clash is not None:
            k, row = clash
            warnings.append(
                f"counters: kernel {key!r} launched with grid {k.grid} block {k.block} in the "
                f"timeline but grid {row.grid} block {row.block} under ncu (row {row.id}); its "
                "counters are left out rather than paired by guess"
            )
            continue
        for i, row in zip(t, n, strict=True):
            out.append(
                KernelCounters(
                    index=i,
                    name=timeline[i].name,
                    ncu_id=row.id,
                    metrics=logical_metrics(row, resolved),
                )
            )
    out.sort(key=lambda c: c.index)
    return out, warnings


def _geometry_differs(kernel: KernelRecord, row: NcuRow) -> bool:
    grid_clash = None not in (kernel.grid, row.grid) and kernel.grid != row.grid
    block_clash = None not in (kernel.block, row.block) and kernel.block != row.block
    return grid_clash or block_clash


def _same_config(kernel: KernelRecord, row: NcuRow) -> bool:
    """Same function, grid, block and shared memory (where both sides know them)."""
    if kernel_key(kernel.name) != kernel_key(row.name) or _geometry_differs(kernel, row):
        return False
    return None in (kernel.shared_memory, row.shared_memory) or (
        kernel.shared_memory == row.shared_memory
    )


def join_unique(
    timeline: Sequence[KernelRecord],
    rows: Sequence[NcuRow],
    resolved: Mapping[str, str | None],
    label: str | None = None,
) -> tuple[list[KernelCounters], list[str]]:
    """Pair timeline kernels with the rows of a ``unique`` replay (the first launch of each
    launch configuration). The launches of one configuration in this iteration take the rows of
    this label's range in order; where ncu replayed fewer (it had met the configuration before,
    here or in another label's range), the rest carry the counters of the last row, marked
    ``same_launch_config``. A launch no row of its configuration exists for is a warning."""
    own = [r for r in rows if r.label in (label, None)]
    others = [r for r in rows if r.label not in (label, None)]
    families: list[tuple[KernelRecord, list[int]]] = []
    for i, k in enumerate(timeline):
        family = next((f for f in families if _same_launch(f[0], k)), None)
        if family is None:
            families.append((k, [i]))
        else:
            family[1].append(i)
    used: set[int] = set()
    out: list[KernelCounters] = []
    warnings: list[str] = []
    for first, members in families:
        mine = [r for r in own if r.id not in used and _same_config(first, r)]
        mine = mine[: len(members)]
        used.update(r.id for r in mine)
        if len(mine) == len(members):  # every launch replayed: the exact join
            pairs = [(i, row, True) for i, row in zip(members, mine, strict=True)]
        elif mine:
            # The first launch is the first row; which launches later rows belong to ncu does
            # not say (it told configurations apart by more than we see), so they are not
            # paired: every later launch carries the first row's counters.
            if len(mine) > 1:
                warnings.append(
                    f"counters: ncu replayed {len(mine)} of {len(members)} launches of "
                    f"{kernel_key(first.name)!r} as distinct configurations; launches after "
                    "the first carry the first one's counters (--opprof-ncu-replay=all "
                    "replays every launch)"
                )
            pairs = [(i, mine[0], n == 0) for n, i in enumerate(members)]
        else:
            seen = [r for r in others if _same_config(first, r)]
            if not seen:
                warnings.append(
                    f"counters: kernel {kernel_key(first.name)!r} (grid {first.grid}, block "
                    f"{first.block}) ran {len(members)}x in the timeline iteration but ncu "
                    "replayed no launch of that configuration; its counters are left out "
                    "(--opprof-ncu-replay=all replays every launch)"
                )
                continue
            pairs = [(i, seen[0], False) for i in members]  # replayed in another label's range
        out += [
            KernelCounters(
                index=i,
                name=timeline[i].name,
                ncu_id=row.id,
                metrics=logical_metrics(row, resolved),
                source="measured" if measured else "same_launch_config",
            )
            for i, row, measured in pairs
        ]
    stray = [r for r in own if r.id not in used]
    if stray:
        names = sorted({kernel_key(r.name) for r in stray})
        warnings.append(
            f"counters: ncu replayed {len(stray)} launch(es) the timeline iteration does not "
            f"have ({', '.join(names[:5])}); left out"
        )
    out.sort(key=lambda c: c.index)
    return out, warnings


def _same_launch(a: KernelRecord, b: KernelRecord) -> bool:
    return (
        kernel_key(a.name) == kernel_key(b.name)
        and a.grid == b.grid
        and a.block == b.block
        and a.shared_memory == b.shared_memory
    )


# ------------------------------------------------------------------------ roofline, operators


ROOFLINE_KEYS = (
    "achieved_flops_per_s",
    "achieved_bytes_per_s",
    "arithmetic_intensity",
    "pct_of_peak_flops",
    "pct_of_peak_bw",
    "pct_of_roofline",
)
"""What ``add_roofline`` writes (None where a counter it needs is missing)."""


def add_roofline(
    metrics: dict[str, float | None], spec: Any, dtype: str
) -> Literal["memory", "compute"] | None:
    """Add achieved FLOP/s, bytes/s and roofline position to ``metrics`` (in place) from its
    ``flops``, ``dram_bytes`` and ``gpu_time_ns``; returns the bound, or None if unknown.
    ``spec`` is a ``knowledge.GpuSpec`` (``lookup_gpu(...).spec``)."""
    from pytest_opprof.knowledge import roofline

    flops, nbytes, ns = metrics.get("flops"), metrics.get("dram_bytes"), metrics.get("gpu_time_ns")
    for k in ROOFLINE_KEYS:
        metrics.setdefault(k, None)
    if flops is None or nbytes is None or not ns:
        return None
    tensor = bool(metrics.get("tensor_ops"))
    point = roofline(spec, dtype, flops, nbytes, ns * 1e-9, tensor_cores=tensor)
    metrics.update(
        achieved_flops_per_s=point.achieved_flops,
        achieved_bytes_per_s=point.achieved_bytes_per_s,
        arithmetic_intensity=point.arithmetic_intensity,
        pct_of_peak_flops=point.pct_of_peak_flops,
        pct_of_peak_bw=point.pct_of_peak_bw,
        pct_of_roofline=point.pct_of_roofline,
    )
    return point.bound


def aggregate(kernels: Sequence[KernelRecord]) -> dict[str, float | None]:
    """One operator's counters from its kernels': sum, max, or duration-weighted mean (see
    ``SUM``/``MAX``). Kernels without counters are left out, and ``counter_coverage`` says
    what share of the operator's kernel time the result covers; a metric missing on any
    covered kernel is None, never a partial sum."""
    covered = [k for k in kernels if k.metrics]
    total_us = sum(k.duration_us for k in kernels)
    out: dict[str, float | None] = {
        "counter_coverage": (sum(k.duration_us for k in covered) / total_us) if total_us else None
    }
    if not covered:
        return out
    names = sorted({n for k in covered for n in k.metrics if n not in _DERIVED_RATES})
    for name in names:
        values = [k.metrics.get(name) for k in covered]
        if any(v is None for v in values):
            out[name] = None
            continue
        nums = [float(v) for v in values if v is not None]
        if name in SUM:
            out[name] = sum(nums)
        elif name in MAX:
            out[name] = max(nums)
        else:
            weights = [_duration_ns(k) for k in covered]
            wsum = sum(weights)
            out[name] = (
                sum(w * v for w, v in zip(weights, nums, strict=True)) / wsum if wsum else None
            )
    return out


# Recomputed from the sums by ``add_roofline``, never averaged.
_DERIVED_RATES = frozenset(ROOFLINE_KEYS)


def _duration_ns(k: KernelRecord) -> float:
    ns = k.metrics.get("gpu_time_ns")
    return float(ns) if ns is not None else k.duration_us * 1e3


def attach(
    kernels: Sequence[KernelRecord], result: CountersResult, spec: Any | None, dtype: str
) -> list[KernelRecord]:
    """Copies of ``kernels`` carrying their counters (and roofline, with a GPU ``spec``)."""
    by_index = {c.index: c for c in result.metrics}
    out = []
    for i, k in enumerate(kernels):
        c = by_index.get(i)
        if c is None:
            out.append(k.model_copy(deep=True))
            continue
        metrics = dict(c.metrics)
        if spec is not None:
            c.bound = add_roofline(metrics, spec, dtype)
        update = {"metrics": {**k.metrics, **metrics}, "counters_source": c.source}
        out.append(k.model_copy(update=update, deep=True))
    return out


def timeline_kernels(timeline: Timeline) -> list[KernelRecord]:
    """The kernels of the timeline's iteration (operators describe one iteration) in launch
    order, memcpy/memset activities left out since ncu profiles kernels only. The records are
    the timeline's own objects, not copies."""
    kernels = [k for op in timeline.operators for k in op.kernels]
    kernels += list(timeline.unattributed_kernels)
    kernels = [k for k in kernels if not k.name.startswith(("Memcpy", "Memset"))]
    return sorted(kernels, key=lambda k: k.start_us)


def apply_to_timeline(
    timeline: Timeline, result: CountersResult, spec: Any | None, dtype: str
) -> Timeline:
    """A copy of ``timeline`` with each joined kernel's counters (and roofline, given the
    ``knowledge.GpuSpec``) in ``KernelRecord.metrics`` and each operator's aggregate in
    ``OperatorAggregate.metrics``. ``result`` must come from ``run_counters_many`` over
    ``timeline_kernels(timeline)``."""
    out = timeline.model_copy(deep=True)
    kernels = timeline_kernels(out)
    for kernel, filled in zip(kernels, attach(kernels, result, spec, dtype), strict=True):
        kernel.metrics = filled.metrics
        kernel.counters_source = filled.counters_source
    for agg in out.aggregated:
        members = [k for op in out.operators if op.name == agg.name for k in op.kernels]
        members = [k for k in members if not k.name.startswith(("Memcpy", "Memset"))]
        if not members:
            continue
        metrics = aggregate(members)
        if spec is not None and len(metrics) > 1:
            add_roofline(metrics, spec, dtype)
        agg.metrics = {**agg.metrics, **metrics}
    return out
