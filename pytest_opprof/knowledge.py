"""The knowledge base in code: the roofline model, the thresholds that classify a bottleneck,
the kernel-name evidence, and the confidence penalties of the edge-case flags; the hardware table
they read is ``hardware`` (its names are importable from here too).

Pure Python (no torch): the propose stage and the report read it on machines without a GPU.
Every number is in base units (FLOP/s, bytes/s, bytes, Hz) and every tensor-core peak is dense.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal, get_args

from pydantic import Field

# The hardware table's names, re-exported: callers read the table and the models over it here.
from pytest_opprof.hardware import (  # noqa: F401
    FrozenModel,
    GpuMatch,
    GpuSpec,
    HardwareTable,
    PeakFlops,
    SourceRef,
    TensorCoreTile,
    generic_gpu,
    hardware_json_text,
    load_hardware_table,
    load_hardware_table_model,
    lookup_gpu,
)

# -------------------------------------------------------------------------------- roofline


Dtype = Literal["bf16", "fp16", "tf32", "fp32", "fp8"]

_DTYPE_ALIASES: dict[str, Dtype] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}


def canonical_dtype(dtype: str) -> Dtype:
    """Map ``torch.bfloat16``, ``"bfloat16"``, ``"bf16"``… to the table's dtype names."""
    key = dtype.strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        accepted = ", ".join(sorted(set(_DTYPE_ALIASES.values())))
        raise ValueError(
            f"unknown dtype {dtype!r}: expected one of {accepted} (or a torch dtype name)"
        ) from None


def peak_flops(spec: GpuSpec, dtype: str, tensor_cores: bool = True) -> float:
    """The peak FLOP/s a kernel of ``dtype`` can reach on ``spec``.

    ``fp32`` with tensor cores means an FP32 GEMM with TF32 allowed, so it gets the TF32 rate;
    ``tf32`` without tensor cores is plain FP32. Half precision without tensor cores gets the
    FP32 rate: the packed half2 rate is 1-4x that depending on the part, and such elementwise
    work is memory-bound anyway, so the lower bound is the honest figure. FP8 exists only on
    tensor cores (sm_89 and later); asking for it elsewhere is a ``ValueError``.
    """
    kind = canonical_dtype(dtype)
    pf = spec.peak_flops
    if kind == "fp8":
        if not tensor_cores:
            raise ValueError("fp8 arithmetic runs only on tensor cores")
        if pf.fp8 is None:
            raise ValueError(f"{spec.name} has no FP8 tensor cores")
        return pf.fp8
    if not tensor_cores:
        return pf.fp32
    rates = {"bf16": pf.bf16, "fp16": pf.fp16, "tf32": pf.tf32, "fp32": pf.tf32}
    return rates[kind]


def ridge_point(spec: GpuSpec, dtype: str, tensor_cores: bool = True) -> float:
    """Arithmetic intensity (FLOP per DRAM byte) where memory-bound turns compute-bound."""
    return peak_flops(spec, dtype, tensor_cores) / spec.memory_bandwidth_bytes_per_s


class RooflinePoint(FrozenModel):
    """One kernel or operator placed on the roofline. Percentages are 0-100."""

    arithmetic_intensity: float | None = Field(
        description="FLOP per DRAM byte; None when no bytes moved"
    )
    achieved_flops: float = Field(description="FLOP/s")
    achieved_bytes_per_s: float
    pct_of_peak_flops: float
    pct_of_peak_bw: float
    bound: Literal["memory", "compute"]
    peak_flops: float
    peak_bytes_per_s: float
    ridge_point: float
    roofline_seconds: float = Field(
        description="the least time the work can take: max(flops / peak, bytes / bandwidth)"
    )
    pct_of_roofline: float = Field(description="roofline_seconds / measured seconds x 100")


def roofline(
    spec: GpuSpec,
    dtype: str,
    flops: float,
    bytes: float,
    seconds: float,
    tensor_cores: bool = True,
) -> RooflinePoint:
    """Place ``flops`` of work moving ``bytes`` of DRAM traffic in ``seconds`` on the roofline.

    ``bound`` is where the work sits relative to the ridge point (memory below it, compute at or
    above), which is the roof it can reach, not whether it reached it: ``pct_of_roofline`` says
    how close it came, and ``roofline_seconds`` is the floor an impact estimate may promise.
    """
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"seconds must be a positive finite number, got {seconds!r}")
    if flops < 0 or bytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops!r} and {bytes!r}")
    peak = peak_flops(spec, dtype, tensor_cores)
    bandwidth = spec.memory_bandwidth_bytes_per_s
    ridge = peak / bandwidth
    intensity = flops / bytes if bytes > 0 else None
    bound: Literal["memory", "compute"] = (
        "compute" if intensity is None or intensity >= ridge else "memory"
    )
    floor = max(flops / peak, bytes / bandwidth)
    return RooflinePoint(
        arithmetic_intensity=intensity,
        achieved_flops=flops / seconds,
        achieved_bytes_per_s=bytes / seconds,
        pct_of_peak_flops=100.0 * flops / seconds / peak,
        pct_of_peak_bw=100.0 * bytes / seconds / bandwidth,
        bound=bound,
        peak_flops=peak,
        peak_bytes_per_s=bandwidth,
        ridge_point=ridge,
        roofline_seconds=floor,
        pct_of_roofline=100.0 * floor / seconds,
    )


def tile_multiple(spec: GpuSpec, dtype: str, preferred: bool = False) -> int | None:
    """The multiple GEMM dims of ``dtype`` need on ``spec`` (``preferred``: the efficient one).

    FP32 GEMMs with TF32 use the TF32 multiple. None where the dtype has no tensor-core path.
    """
    kind = canonical_dtype(dtype)
    kind = "tf32" if kind == "fp32" else kind
    tile = spec.tensor_core_tile
    table = tile.preferred_dim_multiple if preferred else tile.min_dim_multiple
    return table.get(kind)


# -------------------------------------------------------------------------- classification

BottleneckClass = Literal[
    "tensor_core_idle",
    "compute_bound",
    "memory_bound",
    "launch_bound",
    "occupancy_limited",
    "register_pressure",
    "layout_overhead",
    "well_optimized",
]
BOTTLENECK_CLASSES: tuple[BottleneckClass, ...] = get_args(BottleneckClass)
"""The bottleneck classes; ``launch_bound`` covers launch- and latency-bound work.
knowledge/bottlenecks.md gives each one's rule with counters and without."""


@dataclass(frozen=True)
class BottleneckThresholds:
    """Every threshold the classifier and the edge-case detectors use, in one place.

    Percentages are 0-100 (as ncu reports them); shares are fractions 0-1 of GPU time.
    knowledge/bottlenecks.md documents each and a test keeps that table equal to these values.
    """

    memory_bound_dram_pct: float = 60.0
    """DRAM throughput (% of peak sustained) at or above which an operator is memory-bound."""
    compute_bound_sm_pct: float = 60.0
    """SM throughput (% of peak sustained) at or above which an operator is compute-bound."""
    tensor_idle_pct: float = 5.0
    """Tensor-pipe active % below which a GEMM-like operator leaves the tensor cores idle."""
    well_optimized_pct: float = 80.0
    """Throughput of the limiting unit (or % of roofline) from which there is little to gain."""
    low_occupancy_pct: float = 25.0
    """Achieved occupancy % below which an operator that is neither bound is occupancy-limited."""
    register_spill_bytes: int = 0
    """Local-memory spill bytes above this mean register pressure."""
    register_pressure_regs_per_thread: int = 128
    """Registers per thread at or above which occupancy is capped (65536 / 128 = 512 threads)."""
    latency_bound_max_pct: float = 30.0
    """SM and DRAM throughput both below this: the kernel waits on latency, not a roof."""
    launch_bound_kernel_us: float = 10.0
    """A kernel shorter than this (µs) costs about as much to launch as to run."""
    launch_bound_short_kernel_share: float = 0.5
    """Share of a graph's kernels that are short from which the graph is launch-bound."""
    idle_gap_share: float = 0.3
    """Share of the measured window with the GPU idle from which the workload is launch-bound."""
    idle_gap_min_us: float = 1.0
    """Gaps between consecutive kernels shorter than this (µs) are not counted as idle."""
    wave_starvation_blocks_per_sm: float = 1.0
    """A grid with fewer blocks per SM than this cannot fill one wave (occupancy-limited)."""
    layout_overhead_share: float = 0.10
    """Share of an operator's GPU time in layout-conversion kernels that makes it layout-bound."""
    min_op_time_share: float = 0.02
    """Operators below this share of GPU time get no proposal of their own (Amdahl)."""
    padding_max_waste_pct: float = 12.5
    """Most extra work (%) that padding a dimension up to a tensor-core multiple may add."""
    unattributed_share_high: float = 0.05
    """Unattributed kernels' share of GPU time above which ``high_unattributed_share`` is set."""
    host_sync_stall_us: float = 50.0
    """A host synchronisation call in the measured window longer than this (µs) sets
    ``host_sync_stalls``."""
    multi_stream_overlap_share: float = 0.0
    """Share of kernel time with two streams running at once above which
    ``multi_stream_overlap`` is set (0: any overlap)."""


THRESHOLDS = BottleneckThresholds()


def threshold_names() -> tuple[str, ...]:
    """Field names of ``BottleneckThresholds``, in declaration order."""
    return tuple(f.name for f in fields(BottleneckThresholds))


# Kernel-name evidence for the no-counter fallbacks. Names differ by library and version, so a
# miss means "unknown", never "not a GEMM".
TENSOR_CORE_KERNEL_PATTERNS: tuple[str, ...] = (
    r"\d{3,5}gemm",  # cuBLAS MMA shape in the name: s1688gemm, s16816gemm, h16816gemm
    r"tensorop",  # CUTLASS tensor-op kernels
    r"wgmma|gmma|tcgen05|umma",  # Hopper / Blackwell MMA instruction families
    r"hmma|imma",
    r"tf32|bf16|f16f16|e4m3|e5m2",  # input types that only tensor cores run at speed
    r"flash|fmha",  # fused attention (FlashAttention / cuDNN / mem-efficient)
)
SIMT_FP32_GEMM_KERNEL_PATTERNS: tuple[str, ...] = (
    r"(?<![a-z])sgemm",  # ampere_sgemm_128x64_tn, volta_sgemm, implicit_convolve_sgemm
    r"_simt_",  # cutlass_80_simt_sgemm_..., cutlass simt kernels
    r"xmma_gemm_f32f32_f32f32",  # sm80/sm90 xmma FP32 GEMM without TF32
    r"gemmSN_|gemv2[NT]_kernel|gemvx?_kernel",  # small-N and matrix-vector cuBLAS kernels
    r"convolve_sgemm|fprop_implicit_gemm_f32f32_f32f32",  # cuDNN FP32 convolutions
)
LAYOUT_CONVERSION_KERNEL_PATTERNS: tuple[str, ...] = (
    r"nchwToNhwc|nhwcToNchw",  # cuDNN layout conversions around NHWC tensor-core convs
    r"transpose",  # explicit transposes (cuDNN / PyTorch)
    r"copy_kernel|CatArrayBatchedCopy",  # aten::copy_ / contiguous / cat materialising layouts
)


def _any(patterns: tuple[str, ...], name: str) -> bool:
    return any(re.search(p, name, re.IGNORECASE) for p in patterns)


def is_tensor_core_kernel(name: str) -> bool:
    """The kernel's name shows it runs on tensor cores."""
    return _any(TENSOR_CORE_KERNEL_PATTERNS, name)


def is_simt_fp32_gemm(name: str) -> bool:
    """The kernel's name shows an FP32 GEMM/conv on the CUDA cores (tensor cores idle)."""
    return not is_tensor_core_kernel(name) and _any(SIMT_FP32_GEMM_KERNEL_PATTERNS, name)


def is_layout_conversion(name: str) -> bool:
    """The kernel only reorders memory (NCHW<->NHWC, transposes, contiguous copies)."""
    return _any(LAYOUT_CONVERSION_KERNEL_PATTERNS, name)


# --------------------------------------------------------------------- edge-case confidence

EdgeCaseFlagName = Literal[
    "high_unattributed_share",
    "graph_breaks",
    "dynamic_shapes",
    "multi_stream_overlap",
    "host_sync_stalls",
    "cuda_graph_replay",
]

FEW_CHANNELS = 8
"""A 2-D convolution over fewer input channels than this is ``conv_im2col``'s: tensor-core
convolution kernels take the channels in multiples of 8 at 16 bits, so cuDNN pads fewer with
zeros (padding kernels before the call) and its implicit GEMM then multiplies mostly zeros,
while the same convolution as a gather and one GEMM of K = channels × kernel area pads K once."""

DEPTHWISE_MAX_TAPS = 25
"""A depthwise convolution of at most this many kernel taps is ``depthwise_taps``': written as
the weighted sum of its taps it is pointwise code, one load of the input per tap and output
element, which Inductor fuses with the bias and activation around it. The depthwise kernels
networks use are 3 × 3 and 5 × 5; past that, a convolution kernel's reuse of its loads wins."""

DEPTHWISE_MAX_CHANNELS = 32
"""A depthwise convolution over more channels than this is left to cuDNN: layer by layer the
fused tap sum ran faster than cuDNN's kernel at 32 channels and slower at 72 and 128, likely
because cuDNN reads a channels-last pixel's vector of channels in short pieces where it is
short and reuses its loads where it is long (docs/design-notes.md#depthwise-convolutions)."""

EDGE_CASE_PENALTIES: dict[str, float] = {
    "high_unattributed_share": 0.15,
    "graph_breaks": 0.25,
    "dynamic_shapes": 0.20,
    "multi_stream_overlap": 0.10,
    "host_sync_stalls": 0.15,
    "cuda_graph_replay": 0.30,
}
"""How much each edge-case flag lowers a proposal's confidence score (0-1), as the table in
knowledge/edge-cases.md says; a test keeps the two equal."""

EDGE_CASE_APPLIES_TO: dict[str, frozenset[str] | None] = {
    "high_unattributed_share": None,
    "graph_breaks": frozenset(
        {
            "qkv_fusion",
            "sdpa_replacement",
            "bn_fold",
            "conv_im2col",
            "depthwise_taps",
            "activation_substitution",
            "gemm_epilogue",
            "attention_backend",
            "pretranspose_weights",
            "cuda_graphs",
            "algorithm_selection",
        }
    ),
    "dynamic_shapes": frozenset({"cuda_graphs", "batch_padding", "algorithm_selection"}),
    "multi_stream_overlap": None,
    "host_sync_stalls": frozenset({"cuda_graphs"}),
    "cuda_graph_replay": None,
}
"""Proposal types each flag's penalty applies to; None means every type."""

CONFIDENCE_LEVELS: dict[str, float] = {"high": 0.75, "medium": 0.45, "low": 0.0}
"""Lowest score of each confidence level (knowledge/edge-cases.md)."""


def apply_edge_case_penalties(
    score: float, flags: Iterable[str], proposal_type: str
) -> tuple[float, list[str]]:
    """Subtract the penalty of each distinct flag that applies to ``proposal_type``.

    Returns the new score (never below 0) and the flags that were applied, for the evidence.
    Unknown flag names are ignored here; the capture stage owns the vocabulary.
    """
    applied: list[str] = []
    for flag in dict.fromkeys(flags):
        if flag not in EDGE_CASE_PENALTIES:
            continue
        scope = EDGE_CASE_APPLIES_TO[flag]
        if scope is not None and proposal_type not in scope:
            continue
        score -= EDGE_CASE_PENALTIES[flag]
        applied.append(flag)
    return max(0.0, score), applied


def confidence_level(score: float) -> Literal["high", "medium", "low"]:
    """The level a confidence score falls in."""
    if score >= CONFIDENCE_LEVELS["high"]:
        return "high"
    if score >= CONFIDENCE_LEVELS["medium"]:
        return "medium"
    return "low"
