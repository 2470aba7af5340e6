"""The counters pass (docs/how-it-works.md#nsight-compute): Nsight Compute over exactly one
measured iteration.

Why an NVTX range and not ``--launch-skip``: the number of kernels launched before the
measured call (model set-up, Inductor compile and autotuning, warmup) changes from run to run
with the autotune and FX-graph caches, so a skip count taken from the timeline is not exact. The
target process (``stages.capture.task_counters_target``) wraps the one measured call in
``torch.cuda.nvtx.range("opprof_iteration")``, a push/pop range, which ncu selects with
``--nvtx --nvtx-include "opprof_iteration/"`` (the trailing ``/`` names a push/pop range).
``--launch-count`` is only a safety bound (twice the timeline's kernel count, at least +16): if
the range somehow matched more, the join below reports the surplus instead of ncu replaying
kernels for an hour. One ncu process serves every timeline of a capture: each label's
iteration runs in its own range (``opprof_iteration_eager``, ``opprof_iteration_compiled``)
and each CSV row names its range, so rows go back to their timeline exactly; the process start,
model set-up and compile under ncu are paid once.

Replay ``unique`` (``--opprof-ncu-replay``; ``auto`` picks it above ``UNIQUE_ABOVE`` kernels):
``--filter-mode per-launch-config --launch-count 1`` replays the first launch of each launch
configuration only — GPT-2's twelve identical layers, an LSTM's 128 time steps — and the other
launches of the same kernel with the same grid, block and shared memory carry its counters,
marked ``counters_source="same_launch_config"`` (``measured`` for the replayed one). Each
replay pass costs every kernel launch tens of milliseconds (12 passes for this metric list),
which took minutes for gpt2 and the LSTM replayed in full
(docs/design-notes.md#nsight-computes-unique-replay).

Kernel names: ncu prints names with ``--print-kernel-base demangled``, the torch profiler
(CUPTI) its own demangled form, and with ncu 2025.3.1 and torch 2.11 the two differ in
more than spacing: ncu drops inner namespaces (CUPTI's ``at::native::(anonymous
namespace)::max_pool_forward_nchw<float, int>(int, float const*, ...)`` is ncu's
``at::<unnamed>::max_pool_forward_nchw<float, int>(T2, const T1 *, ...)``, and
``cask_plugin__5x_cudnn::xmma__5x_cudnn::init_device_workspace_kernel`` is
``cask_plugin__5x_cudnn::init_device_workspace_kernel``). ``kernel_key`` therefore keeps the
function's own name only — no namespaces, return type, template arguments or parameters. The
join is by key *and* ordinal among the kernels of that key in launch order, and each pair must
agree on its launch geometry (grid and block) where both sides know it; a key whose counts or
geometries differ is a warning naming the kernels, never a shifted join. Keys compare exactly,
so ``triton_poi_fused_add_1`` never matches ``triton_poi_fused_add_10``.

Everything here is data in, data out: failures come back as ``CountersResult.note`` and
``warnings``, never raised. No torch here: the target process is a stage child (``stages.capture``).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pytest_opprof import devicelock
from pytest_opprof.schema import KernelRecord, Profile, Timeline, write_text_atomic

NVTX_RANGE = "opprof_iteration"
REPLAY_MODES = ("auto", "all", "unique")
UNIQUE_ABOVE = 96
"""``--opprof-ncu-replay=auto``: replay every launch up to this many kernels (all labels)."""
TARGET_TASK = "counters_target"
LOG_NAME = "ncu.log"
PARAMS_FILE = Path("/proc/driver/nvidia/params")
NCU_LOCATIONS = (
    "/usr/local/cuda/bin/ncu",
    "/opt/nvidia/nsight-compute/*/ncu",
    "/usr/local/NVIDIA-Nsight-Compute*/ncu",
)

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


# ------------------------------------------------------------------------------- detection


def find_ncu(path: str | None = None, locations: Sequence[str] = NCU_LOCATIONS) -> str | None:
    """``ncu`` on ``path`` (default ``$PATH``), else the newest of the usual install places."""
    found = shutil.which("ncu", path=path)
    if found:
        return found
    for pattern in locations:
        hits = sorted(glob.glob(pattern), key=_version_key, reverse=True)
        for hit in hits:
            if os.path.isfile(hit) and os.access(hit, os.X_OK):
                return hit
    return None


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def needs_sudo(mode: str, params_file: Path = PARAMS_FILE, euid: int | None = None) -> bool:
    """``--opprof-ncu-sudo``: ``auto`` uses sudo when the driver restricts the counters to
    admins (``RmProfilingAdminOnly: 1``) and we are not root."""
    if mode == "true":
        return True
    if mode == "false":
        return False
    uid = os.geteuid() if euid is None else euid
    if uid == 0:
        return False
    try:
        text = params_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    match = re.search(r"^\s*RmProfilingAdminOnly\s*:\s*(\d+)", text, re.MULTILINE)
    return bool(match and match.group(1) == "1")


# -------------------------------------------------------------------------------- command


def launch_bound(kernels_per_iteration: int) -> int:
    """``--launch-count``: a bound, not the selector (the NVTX range is)."""
    return max(2 * kernels_per_iteration, kernels_per_iteration + 16)


def range_name(label: str) -> str:
    """The NVTX push/pop range around ``label``'s measured iteration."""
    return f"{NVTX_RANGE}_{label}"


def build_command(
    ncu: str,
    spec_path: Path,
    *,
    kernels_per_iteration: int,
    log_file: Path,
    metrics: Sequence[str],
    clock_control: str = "none",
    sudo: bool = False,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    labels: Sequence[str] = ("eager",),
    unique: bool = False,
) -> list[str]:
    """The ncu command line over ``python -m pytest_opprof.runner SPEC``: one iteration of
    each label, ``kernels_per_iteration`` counting all of them. ``unique``: the first launch
    of each launch configuration only.

    ncu's own output (the raw CSV included) goes to ``log_file`` so the workload's prints
    cannot interleave with it. Kernel replay (the default) replays each kernel in place, not
    the whole process (application replay took ~65 s for a tiny script). ``application-only``
    keeps ncu out of Inductor's compile workers, which launch nothing inside the range.
    """
    if clock_control not in ("none", "base"):
        raise ValueError(f"clock control must be none or base, got {clock_control!r}")
    cmd = [ncu, "--nvtx"]
    for label in labels:  # include statements are alternatives: a kernel in any range
        cmd += ["--nvtx-include", f"{range_name(label)}/"]
    if unique:
        cmd += ["--filter-mode", "per-launch-config", "--launch-count", "1"]
    else:
        cmd += ["--launch-count", str(launch_bound(kernels_per_iteration))]
    cmd += [
        "--replay-mode",
        "kernel",
        "--target-processes",
        "application-only",
        "--clock-control",
        clock_control,
        "--print-kernel-base",
        "demangled",
        "--metrics",
        ",".join(metrics),
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        "--log-file",
        str(log_file),
        python,
        "-m",
        "pytest_opprof.runner",
        str(spec_path),
    ]
    if not sudo:
        return cmd
    environ = os.environ if env is None else env
    # sudo resets the environment: pass PATH (ncu's own tools) and PYTHONPATH (this package)
    # through explicitly; -n fails at once instead of waiting for a password nobody types.
    passthrough = [f"PATH={environ.get('PATH', '')}", f"PYTHONPATH={_pythonpath(environ)}"]
    passthrough += [f"{k}={environ[k]}" for k in _KEEP_THROUGH_SUDO if k in environ]
    return ["sudo", "-n", "-E", "env", *passthrough, *cmd]


# The device the timeline used and where Inductor caches its kernels (else root recompiles).
_KEEP_THROUGH_SUDO = ("CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _pythonpath(environ: Mapping[str, str]) -> str:
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([root, *[p for p in parts if p != root]])


def requested_metrics(available: set[str] | None = None) -> list[str]:
    """Every candidate of ``METRICS``; with ``available`` (base names from ``ncu
    --query-metrics``), only those the chip has, since ncu refuses an unknown metric."""
    out: list[str] = []
    for candidates in METRICS.values():
        for metric in candidates:
            wanted = available is None or metric.split(".")[0] in available
            if wanted and metric not in out:
                out.append(metric)
    return out


def query_available(ncu: str, sudo: bool = False, timeout: float = 120.0) -> set[str] | None:
    """Base metric names the installed GPU supports (``ncu --query-metrics --csv``)."""
    cmd = [ncu, "--query-metrics", "--csv"]
    if sudo:
        cmd = ["sudo", "-n", "-E", *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    names = set()
    for row in csv.reader(io.StringIO(proc.stdout)):
        if row and re.fullmatch(r"[a-z0-9_]+__[a-z0-9_]+", row[0].strip()):
            names.add(row[0].strip())
    return names or None


# ---------------------------------------------------------------------------------- parsing


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


# ----------------------------------------------------------------------------------- errors

PERMISSION_FIX = (
    "ncu: ERR_NVGPUCTRPERM, this user may not read the GPU performance counters; the profile "
    "is kept without counters. Fix: rerun with --opprof-ncu-sudo=true (ncu through sudo), or "
    "let every user profile with the NVIDIA driver option NVreg_RestrictProfilingToAdminUsers=0 "
    "(a line `options nvidia NVreg_RestrictProfilingToAdminUsers=0` in /etc/modprobe.d/, then "
    "reload the driver or reboot)"
)


def classify_failure(returncode: int, output: str, tail: int = 8) -> str | None:
    """A note for a failed ncu run (None when it succeeded)."""
    if "ERR_NVGPUCTRPERM" in output:
        return PERMISSION_FIX
    if "sudo:" in output and ("password" in output or "not allowed" in output):  # -n, -E
        return (
            "ncu through sudo failed: sudo needs a password here (it is run with -n); allow "
            "ncu without one, or use the driver option NVreg_RestrictProfilingToAdminUsers=0 "
            "with --opprof-ncu-sudo=false"
        )
    errors = [line for line in output.splitlines() if "==ERROR==" in line]
    if returncode == 0 and not errors:
        return None
    lines = [line for line in output.splitlines() if line.strip()][-tail:]
    return f"ncu failed (exit status {returncode}): " + " | ".join(lines)


# ------------------------------------------------------------------------------ parent side


def run_counters_many(
    spec: Mapping[str, Any],
    kernels_by_label: Mapping[str, Sequence[KernelRecord]],
    *,
    work_dir: Path,
    replay: str = "all",
    sudo_mode: str = "auto",
    clock_control: str = "none",
    timeout: float = 600.0,
    ncu: str | None = None,
) -> dict[str, CountersResult]:
    """Replay one iteration of each labelled call (``eager``, ``compiled``) in ONE process
    under ncu and join each range's rows to that label's kernels (one iteration of its
    timeline, launch order). ``replay``: ``all`` launches, or ``unique`` configurations."""
    labels = list(kernels_by_label)
    bad = [x for x in labels if x not in ("eager", "compiled")]
    if bad:
        note = f"counters: no target for the {bad[0]!r} timeline"
        return {x: CountersResult(note=note) for x in labels}
    ncu = ncu or find_ncu()
    if ncu is None:
        note = "counters: ncu (Nsight Compute) not found on PATH or in the usual places; skipped"
        return {x: CountersResult(note=note) for x in labels}
    no_kernels = "counters: the timeline iteration launched no kernels"
    empty = {x: CountersResult(note=no_kernels) for x in labels if not kernels_by_label[x]}
    labels = [x for x in labels if x not in empty]
    if not labels:
        return empty
    work_dir.mkdir(parents=True, exist_ok=True)
    target = dict(spec, task=TARGET_TASK, counters_labels=labels)
    spec_path = work_dir / "counters_target.json"
    spec_path.write_text(json.dumps(target, indent=1, default=str), encoding="utf-8")
    log_file = work_dir / LOG_NAME
    log_file.unlink(missing_ok=True)
    sudo = needs_sudo(sudo_mode)
    metrics = requested_metrics(query_available(ncu, sudo=sudo))
    total = sum(len(kernels_by_label[x]) for x in labels)
    cmd = build_command(
        ncu,
        spec_path,
        kernels_per_iteration=total,
        log_file=log_file,
        metrics=metrics,
        clock_control=clock_control,
        sudo=sudo,
        labels=labels,
        unique=replay == "unique",
    )
    for attempt in range(2):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            note = f"counters: ncu took over {timeout:.0f} s; skipped"
            return {**empty, **{x: CountersResult(note=note, command=cmd) for x in labels}}
        except OSError as exc:
            note = f"counters: could not start ncu: {exc}"
            return {**empty, **{x: CountersResult(note=note, command=cmd) for x in labels}}
        log = log_file.read_text(encoding="utf-8", errors="replace") if log_file.exists() else ""
        output = proc.stdout + proc.stderr
        # the target's own lines: where the pass's time goes (import, compile, replay)
        write_text_atomic(log_file.with_name("target.log"), output)
        unknown = unknown_metrics(log + "\n" + output, metrics)
        if proc.returncode == 0 or not unknown or attempt:
            break
        # The chip lacks a metric that --query-metrics could not rule out: drop it, once.
        metrics = [m for m in metrics if m not in unknown]
        cmd[cmd.index("--metrics") + 1] = ",".join(metrics)
        log_file.unlink(missing_ok=True)
    unique = replay == "unique"
    bound = None if unique else launch_bound(total)
    results = {
        x: parse_run(
            proc.returncode, log, output, kernels_by_label[x], cmd, label=x, unique=unique,
            bound=bound,
        )
        for x in labels
    }  # fmt: skip
    return {**empty, **results}


def unknown_metrics(output: str, requested: Sequence[str]) -> set[str]:
    """Requested metrics that ncu's error lines name (it refuses a metric the chip lacks)."""
    errors = [line for line in output.splitlines() if "==ERROR==" in line]
    return {
        m
        for m in requested
        for line in errors
        if re.search(rf"(?<![\w.]){re.escape(m.split('.')[0])}(?!\w)", line)
    }


def parse_run(
    returncode: int,
    log: str,
    output: str,
    timeline_kernels: Sequence[KernelRecord],
    command: Sequence[str] = (),
    *,
    label: str | None = None,
    unique: bool = False,
    bound: int | None = None,
) -> CountersResult:
    """Turn one ncu run's log (the CSV) and console output into ``label``'s
    ``CountersResult``: the rows of its NVTX range (a log of one unnamed range is all its)."""
    note = classify_failure(returncode, log + "\n" + output)
    all_rows, header = parse_raw_csv(log)
    rows = [r for r in all_rows if r.label in (label, None)]
    if note and (not rows or note == PERMISSION_FIX):
        return CountersResult(note=note, command=list(command))
    if not rows and not (unique and all_rows):
        where = range_name(label) if label else NVTX_RANGE
        return CountersResult(
            note=f"counters: ncu profiled no kernels inside the NVTX range {where!r}: "
            + " | ".join(log.splitlines()[-4:]),
            command=list(command),
        )
    resolved = resolve(header)
    if unique:
        joined, warnings = join_unique(timeline_kernels, all_rows, resolved, label)
    else:
        joined, warnings = join(timeline_kernels, rows, resolved)
    if note:  # ncu reported an error but profiled kernels: keep them, say what it said
        warnings.insert(0, f"counters: {note}")
    if bound is None and not unique and label is None:  # a log of this timeline alone
        bound = launch_bound(len(timeline_kernels))
    if bound is not None and len(all_rows) >= bound:
        warnings.append(
            f"counters: ncu stopped at its bound of {len(all_rows)} kernels; the range held more"
        )
    return CountersResult(
        metrics=joined, warnings=warnings, resolved=resolved, command=list(command)
    )


def counters_for_capture(
    spec: Mapping[str, Any],
    timelines: Sequence[Timeline],
    info: Mapping[str, Any],
    options: Any,
    dtype: str,
    device: str = "cuda",
) -> tuple[list[Timeline], dict[str, Any] | None, list[str]]:
    """The counters pass as ``task_capture`` calls it: on CUDA and unless ``--opprof-ncu=off``,
    every ``eager``/``compiled`` timeline gets its counters; returns the timelines,
    ``Profile.counters`` (None when the pass did not run) and warnings for the profile.
    ``--opprof-ncu=auto`` without ncu is a one-line note; ``on`` without it, a warning."""
    if device != "cuda" or options.ncu == "off":
        return list(timelines), None, []
    ncu = find_ncu()
    if ncu is None:
        note = "ncu (Nsight Compute) not found on PATH or in the usual places"
        if options.ncu == "on":
            return list(timelines), {"note": note}, [f"--opprof-ncu=on: {note}; no counters"]
        return list(timelines), {"note": note}, []
    gpu = gpu_of(info)
    work_dir = Path(spec["out_dir"]) / "profiler_output" / "ncu"
    summary: dict[str, Any] = {"ncu": Path(ncu).name, "clock_control": options.ncu_clock_control}
    warnings: list[str] = []
    # The same kernels in the same order (a model Dynamo leaves to eager, as nn.LSTM): one
    # range serves both timelines.
    kernels = {t.label: timeline_kernels(t) for t in timelines}
    first_with: dict[tuple[Any, ...], str] = {}
    same_as: dict[str, str | None] = {}
    for t in timelines:
        launches = tuple(
            (k.name, tuple(k.grid or ()), tuple(k.block or ())) for k in kernels[t.label]
        )
        same_as[t.label] = first_with.get(launches)
        first_with.setdefault(launches, t.label)
    replayed = {x: kernels[x] for x in kernels if same_as[x] is None}
    replay = options.ncu_replay
    if replay == "auto":
        replay = "unique" if sum(map(len, replayed.values())) > UNIQUE_ABOVE else "all"
    devicelock.resume()  # the capture's measurements released the GPU; ncu replays on it
    started = time.perf_counter()
    results = run_counters_many(
        spec,
        replayed,
        work_dir=work_dir,
        replay=replay,
        sudo_mode=options.ncu_sudo,
        clock_control=options.ncu_clock_control,
        ncu=ncu,
        # Inside the capture stage's own timeout, so a slow replay costs the counters, never
        # the profile.
        timeout=min(600.0, float(options.timeout) / 2),
    )
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["replay"] = replay
    out: list[Timeline] = []
    for timeline in timelines:
        source = same_as[timeline.label] or timeline.label
        result = results[source]
        if result.note:
            warnings.append(f"{timeline.label} timeline: {result.note}")
            out.append(timeline)
        else:
            out.append(apply_to_timeline(timeline, result, gpu, dtype))
        warnings += [f"{timeline.label} timeline: {w}" for w in result.warnings]
        summary[timeline.label] = {
            **_summary_entry(kernels[timeline.label], result),
            "reused_from": same_as[timeline.label],
        }
    return out, summary, warnings


def _summary_entry(kernels: Sequence[KernelRecord], result: CountersResult) -> dict[str, Any]:
    total = sum(k.duration_us for k in kernels)
    covered = {c.index for c in result.metrics}
    measured = {c.index for c in result.metrics if c.source == "measured"}

    def share(indices: set[int]) -> float | None:
        if not total:
            return None
        return sum(k.duration_us for i, k in enumerate(kernels) if i in indices) / total

    return {
        "note": result.note,
        "resolved": result.resolved,
        "kernels": len(kernels),
        "kernels_with_counters": len(covered),
        "kernels_replayed": len(measured),
        "time_coverage": share(covered),
        "time_coverage_replayed": share(measured),
        "warnings": result.warnings,
    }


def gpu_of(meta: Mapping[str, Any] | Any) -> Any:
    """The ``knowledge.GpuSpec`` of a device description — ``environment()``'s dict or a
    profile's ``capture_metadata`` — or None where the table has no match."""
    from pytest_opprof.knowledge import lookup_gpu

    fields = meta if isinstance(meta, Mapping) else meta.model_dump()
    cc = str(fields.get("compute_capability") or "")
    major_minor = (int(cc.split(".")[0]), int(cc.split(".")[1])) if "." in cc else None
    match = lookup_gpu(str(fields.get("device_name", "")), fields.get("sm_count"), major_minor)
    return match.spec if match is not None else None


def rejoin(profile: Profile, ncu_dir: Path) -> Profile:
    """``profile`` with the ncu output a run saved in ``ncu_dir`` (``ncu.<label>.log``)
    joined again to its timelines by this version's join — no GPU needed, nothing measured
    anew. Timelines without a log keep what they have; ``counters`` records the new join."""
    gpu = gpu_of(profile.capture_metadata)
    counters = dict(profile.counters or {})
    timelines = []
    for timeline in profile.timelines:
        before = counters.get(timeline.label)
        before = before if isinstance(before, dict) else {}
        source = before.get("reused_from") or timeline.label
        one_log = ncu_dir / LOG_NAME  # every label's range in one log, else one log per label
        log = one_log if one_log.exists() else ncu_dir / f"ncu.{source}.log"
        if not before or not log.exists():  # a timeline the counters pass never replayed
            timelines.append(timeline)
            continue
        kernels = timeline_kernels(timeline)
        result = parse_run(
            0,
            log.read_text(encoding="utf-8", errors="replace"),
            "",
            kernels,
            label=source,
            unique=counters.get("replay") == "unique",
        )
        timelines.append(apply_to_timeline(timeline, result, gpu, profile.capture_metadata.dtype))
        counters[timeline.label] = {
            **before,
            **_summary_entry(kernels, result),
            "rejoined": True,
            # What the run itself said (a replay that outlived its limit still wrote its log).
            "note_at_capture": before.get("note_at_capture", before.get("note")),
        }
    return profile.model_copy(update={"timelines": timelines, "counters": counters})
