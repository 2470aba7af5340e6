"""Bottleneck class of every operator, from counters when they ran and from names otherwise.

The classes, their order and their thresholds are knowledge/bottlenecks.md
(``knowledge.BOTTLENECK_CLASSES``, ``knowledge.THRESHOLDS``); this module applies them. Without
counters it reads what the timeline has: kernel names (FP32 SIMT GEMMs, layout conversions),
kernel durations and grids, and the operators' input shapes placed on the roofline. The CPU
fallback has no hardware table, so its operators get no class.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pytest_opprof import knowledge
from pytest_opprof.schema import KernelRecord, OperatorAggregate, Profile, Timeline

# Bare ATen names (``aten::`` stripped) of the operators of each kind.
GEMM_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "addmv",
        "mv",
        "dot",
        "addbmm",
        "_addmm_activation",
        "einsum",
        "_scaled_mm",
    }
)
CONV_OPS = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "_convolution",
        "cudnn_convolution",
        "cudnn_convolution_relu",
        "cudnn_convolution_add_relu",
        "mkldnn_convolution",
        "_conv_depthwise2d",
        "conv_depthwise3d",
        "slow_conv2d_forward",
        "_slow_conv2d_forward",
        "conv_transpose2d",
        "convolution_overrideable",
    }
)
ATTENTION_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_scaled_dot_product_attention_math",
    }
)
RNN_OPS = frozenset(
    {
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "_cudnn_rnn",
        "lstm_cell",
        "gru_cell",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "mkldnn_rnn_layer",
        "miopen_rnn",
    }
)
BATCH_NORM_OPS = frozenset(
    {
        "batch_norm",
        "_batch_norm_impl_index",
        "native_batch_norm",
        "cudnn_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit_functional",
        "miopen_batch_norm",
    }
)
LAYOUT_OPS = frozenset({"contiguous", "copy_", "clone", "_to_copy", "to", "permute", "transpose"})

_REDUCED = (
    ("bf16", re.compile(r"bf16|bfloat16", re.IGNORECASE)),
    ("fp16", re.compile(r"fp16|f16f16|__half|\bhalf\b|h884|h1688|h16816|hgemm", re.IGNORECASE)),
    ("fp8", re.compile(r"e4m3|e5m2|fp8", re.IGNORECASE)),
    ("tf32", re.compile(r"tf32", re.IGNORECASE)),
    # CUTLASS names float GEMMs on tensor cores by element and MMA shape: tensorop_s1688gemm
    # (float in and out, m16n8k8) is TF32 — seen on sm90 for 1x1 convolutions and cuDNN RNNs.
    ("tf32", re.compile(r"tensorop_s1688", re.IGNORECASE)),
)
_FP32 = re.compile(
    r"fp32|f32f32|(?<![a-z0-9])f32(?![a-z0-9])|sgemm|(?:^|[<_ ,])float(?:[_,>]|$)", re.IGNORECASE
)


def bare(name: str) -> str:
    """``aten::addmm`` → ``addmm``."""
    return name.split("::", 1)[-1]


def op_kind(name: str) -> str:
    """gemm, conv, attention, rnn, batch_norm, layout or other, from the operator's name."""
    op = bare(name)
    for kind, names in (
        ("gemm", GEMM_OPS),
        ("conv", CONV_OPS),
        ("attention", ATTENTION_OPS),
        ("rnn", RNN_OPS),
        ("batch_norm", BATCH_NORM_OPS),
        ("layout", LAYOUT_OPS),
    ):
        if op in names:
            return kind
    if op.startswith("triton_tem_"):
        return "gemm"  # an Inductor template kernel fuses a GEMM or a convolution
    return "other"


def kernel_precision(name: str) -> str | None:
    """bf16, fp16, fp8, tf32 or fp32 as the kernel's name tells; None when it does not."""
    for kind, pattern in _REDUCED:
        if pattern.search(name):
            return kind
    if knowledge.is_simt_fp32_gemm(name) or _FP32.search(name):
        return "fp32"
    return None


def is_matmul_kernel(name: str) -> bool:
    """The kernel computes a GEMM / convolution / attention product (by name)."""
    low = name.lower()
    return (
        knowledge.is_simt_fp32_gemm(name)
        or (knowledge.is_tensor_core_kernel(name) and not knowledge.is_layout_conversion(name))
        or any(w in low for w in ("gemm", "gemv", "conv", "fprop", "winograd", "fmha", "flash"))
    )


# -------------------------------------------------------------------------- operator facts


@dataclass(frozen=True)
class OpFacts:
    """What the timeline says about one operator, in the form the rules and classes need."""

    name: str
    aggregate: OperatorAggregate
    kind: str
    kernels: tuple[KernelRecord, ...]
    precisions: tuple[str, ...]
    fp32_kernels: tuple[str, ...]
    layout_share: float
    mean_kernel_us: float | None
    blocks_per_sm: float | None
    roofline_pct: float | None
    roofline_bound: str | None

    @property
    def gemm_like(self) -> bool:
        return self.kind in ("gemm", "conv", "attention") or any(
            is_matmul_kernel(k) for k in self.aggregate.kernel_names
        )

    @property
    def has_counters(self) -> bool:
        return any(v is not None for v in self.aggregate.metrics.values())

    def metric(self, key: str) -> float | None:
        value = self.aggregate.metrics.get(key)
        return None if value is None else float(value)


def timeline_facts(
    timeline: Timeline,
    *,
    spec: knowledge.GpuSpec | None = None,
    dtype: str = "float32",
) -> dict[str, OpFacts]:
    """Facts of every aggregated operator of ``timeline``, keyed by operator name."""
    records: dict[str, list[KernelRecord]] = {}
    shapes: dict[str, list[tuple[list[object], float]]] = {}
    for op in timeline.operators:
        records.setdefault(op.name, []).extend(op.kernels)
        shapes.setdefault(op.name, []).append((op.input_shapes, op.gpu_time_us))
    facts = {}
    for agg in timeline.aggregated:
        kernels = tuple(records.get(agg.name, ()))
        names = sorted({*agg.kernel_names, *(k.name for k in kernels)})
        precisions = tuple(sorted({p for p in map(kernel_precision, names) if p is not None}))
        fp32 = tuple(n for n in names if is_matmul_kernel(n) and kernel_precision(n) == "fp32")
        pct, bound = _roofline(agg.name, shapes.get(agg.name, []), precisions, spec, dtype)
        facts[agg.name] = OpFacts(
            name=agg.name,
            aggregate=agg,
            kind=op_kind(agg.name),
            kernels=kernels,
            precisions=precisions,
            fp32_kernels=fp32,
            layout_share=_layout_share(agg, kernels),
            mean_kernel_us=_mean_kernel_us(agg, kernels),
            blocks_per_sm=_blocks_per_sm(kernels, spec),
            roofline_pct=pct,
            roofline_bound=bound,
        )
    return facts


def _layout_share(agg: OperatorAggregate, kernels: Sequence[KernelRecord]) -> float:
    total = sum(k.duration_us for k in kernels)
    if total > 0:
        layout = sum(k.duration_us for k in kernels if knowledge.is_layout_conversion(k.name))
        return layout / total
    names = agg.kernel_names
    if names and all(knowledge.is_layout_conversion(n) for n in names):
        return 1.0
    return 0.0


def _mean_kernel_us(agg: OperatorAggregate, kernels: Sequence[KernelRecord]) -> float | None:
    if kernels:
        durations = sorted(k.duration_us for k in kernels)
        return durations[len(durations) // 2]  # median, as bottlenecks.md defines it
    if agg.kernel_count > 0 and agg.gpu_time_us > 0:
        return agg.gpu_time_us / agg.kernel_count
    return None


def _blocks_per_sm(kernels: Sequence[KernelRecord], spec: knowledge.GpuSpec | None) -> float | None:
    """Duration-weighted grid blocks per SM of the operator's kernels (None without grids)."""
    if spec is None:
        return None
    weighted = total = 0.0
    for k in kernels:
        if k.grid and k.duration_us > 0:
            weighted += math.prod(k.grid) / spec.sm_count * k.duration_us
            total += k.duration_us
    return weighted / total if total > 0 else None


def operator_work(name: str, input_shapes: Sequence[object], size: int) -> tuple[float, float]:
    """Analytic FLOPs and DRAM bytes of one call from its input shapes (0, 0 when unknown).

    GEMMs and convolutions by their product; anything else as elementwise over its first input.
    Convolution outputs are taken at the input's spatial size (stride and padding are not in the
    trace), which is exact for the 'same' convolutions of the examples.
    """
    tensors = [
        list(s)
        for s in input_shapes
        if isinstance(s, list) and s and all(isinstance(d, int) for d in s)
    ]
    if not tensors:
        return 0.0, 0.0
    op, kind = bare(name), op_kind(name)
    if kind == "gemm" and op not in ("einsum", "_scaled_mm"):
        mats = [t for t in tensors if len(t) >= 2]
        if op == "linear" and len(mats) >= 2:
            x, w = mats[0], mats[1]
            m, k, n = math.prod(x[:-1]), x[-1], w[0]
            return 2.0 * m * n * k, float((m * k + n * k + m * n) * size)
        if len(mats) >= 2:
            a, b = mats[-2], mats[-1]
            if op in ("addmm", "baddbmm") and len(mats) >= 3:
                a, b = mats[1], mats[2]
            batch = math.prod(a[:-2]) if len(a) > 2 else 1
            m, k, n = a[-2], a[-1], b[-1]
            return 2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * size)
    if kind == "attention" and len(tensors) >= 3 and len(tensors[0]) >= 2:
        q, k, v = tensors[0], tensors[1], tensors[2]
        heads = math.prod(q[:-2]) if len(q) > 2 else 1
        flops = 4.0 * heads * q[-2] * k[-2] * q[-1]
        return flops, float((math.prod(q) * 2 + math.prod(k) + math.prod(v)) * size)
    if kind == "conv" and len(tensors) >= 2 and len(tensors[0]) >= 3:
        x, w = tensors[0], tensors[1]
        out = [x[0], w[0], *x[2:]]
        flops = 2.0 * math.prod(out) * math.prod(w[1:])
        return flops, float((math.prod(x) + math.prod(w) + math.prod(out)) * size)
    first = math.prod(tensors[0])
    data = sum(math.prod(t) for t in tensors) + first
    return float(first), float(data * size)


def _roofline(
    name: str,
    calls: Sequence[tuple[list[object], float]],
    precisions: Sequence[str],
    spec: knowledge.GpuSpec | None,
    dtype: str,
) -> tuple[float | None, str | None]:
    """Per cent of its roofline the operator reached and the roof it sits under, from its
    input shapes; (None, None) where the shapes or the GPU are unknown."""
    if spec is None:
        return None, None
    size = 2 if dtype in ("bfloat16", "float16", "torch.bfloat16", "torch.float16") else 4
    precision = "bf16" if "bf16" in precisions else "tf32" if "tf32" in precisions else "fp32"
    tensor_cores = precision != "fp32" and op_kind(name) in ("gemm", "conv", "attention")
    flops = data = measured = 0.0
    for shapes, gpu_us in calls:
        f, d = operator_work(name, shapes, size)
        if gpu_us <= 0 or (f == 0 and d == 0):
            continue
        flops, data, measured = flops + f, data + d, measured + gpu_us * 1e-6
    if measured <= 0:
        return None, None
    point = knowledge.roofline(spec, precision, flops, data, measured, tensor_cores)
    return point.pct_of_roofline, point.bound


# ------------------------------------------------------------------------------ classifier


def classify_operator(facts: OpFacts, th: knowledge.BottleneckThresholds) -> tuple[str, str]:
    """The class of one operator and the reason, in the order of knowledge/bottlenecks.md."""
    spills = facts.metric("local_memory_spill_bytes")
    regs = facts.metric("registers_per_thread")
    occupancy = facts.metric("achieved_occupancy_pct")
    tensor = facts.metric("tensor_pipe_active_pct")
    sm = facts.metric("sm_throughput_pct")
    dram = _first(facts.metric("dram_throughput_pct"), facts.metric("memory_throughput_pct"))
    short = facts.mean_kernel_us is not None and facts.mean_kernel_us < th.launch_bound_kernel_us

    if spills is not None and spills > th.register_spill_bytes:
        return "register_pressure", f"local-memory spills {spills:g} B"
    if (
        regs is not None
        and regs >= th.register_pressure_regs_per_thread
        and occupancy is not None
        and occupancy < th.low_occupancy_pct
    ):
        return "register_pressure", f"{regs:g} registers/thread at {occupancy:g}% occupancy"
    if facts.gemm_like:
        if tensor is not None:
            if tensor < th.tensor_idle_pct:
                return "tensor_core_idle", f"tensor pipe active {tensor:g}%"
        elif facts.fp32_kernels:
            # fmha_cutlassF_f32 (fp32 memory-efficient attention) is CUDA-core work too, though
            # knowledge.is_tensor_core_kernel reads 'fmha' as tensor-core.
            return "tensor_core_idle", f"FP32 kernel {facts.fp32_kernels[0]}"
    if facts.layout_share >= th.layout_overhead_share:
        return "layout_overhead", f"{facts.layout_share:.0%} of its time in layout conversions"
    if sm is not None or dram is not None:
        top = max(v for v in (sm, dram) if v is not None)
        if top >= th.well_optimized_pct:
            return "well_optimized", f"limiting unit at {top:g}%"
        if dram is not None and dram >= th.memory_bound_dram_pct and dram >= (sm or 0.0):
            return "memory_bound", f"DRAM throughput {dram:g}%"
        if sm is not None and sm >= th.compute_bound_sm_pct:
            return "compute_bound", f"SM throughput {sm:g}%"
        if occupancy is not None and occupancy < th.low_occupancy_pct:
            return "occupancy_limited", f"achieved occupancy {occupancy:g}%"
        return "launch_bound", f"SM {sm}% and DRAM {dram}%: neither roof reached"
    # No counters: names, durations, grids and the roofline from shapes. A short kernel is
    # launch-bound whatever its roofline says, so that test comes before the roofline's, where
    # bottlenecks.md (written for counters) lists it last.
    if short:
        return "launch_bound", f"median kernel {facts.mean_kernel_us:.1f} µs"
    if facts.roofline_pct is not None and facts.roofline_pct >= th.well_optimized_pct:
        return "well_optimized", f"{facts.roofline_pct:.0f}% of its roofline"
    if facts.blocks_per_sm is not None and facts.blocks_per_sm < th.wave_starvation_blocks_per_sm:
        return "occupancy_limited", f"{facts.blocks_per_sm:.2f} blocks per SM"
    if facts.roofline_bound is not None:
        return f"{facts.roofline_bound}_bound", "roofline position from its input shapes"
    if facts.gemm_like or facts.kind == "rnn":
        return "compute_bound", "GEMM-like work (no shapes to place it on the roofline)"
    return "memory_bound", "elementwise / reduction work (no shapes to place it on the roofline)"


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def classify(profile: Profile) -> Profile:
    """A copy of ``profile`` with ``bottleneck`` set on every aggregated operator.

    CPU profiles are copied unchanged: there is no roofline to judge them against.
    """
    result = profile.model_copy(deep=True)
    if profile.capture_metadata.device_type != "cuda":
        return result
    spec = gpu_spec(profile)
    for timeline in result.timelines:
        facts = timeline_facts(timeline, spec=spec, dtype=profile.capture_metadata.dtype)
        for agg in timeline.aggregated:
            if agg.gpu_time_us <= 0 and agg.kernel_count == 0:
                continue
            agg.bottleneck = classify_operator(facts[agg.name], knowledge.THRESHOLDS)[0]
    return result


def gpu_spec(profile: Profile) -> knowledge.GpuSpec | None:
    """The hardware-table entry of the profiled GPU (None on the CPU)."""
    match = gpu_match(profile)
    return match.spec if match else None


def gpu_match(profile: Profile) -> knowledge.GpuMatch | None:
    meta = profile.capture_metadata
    if meta.device_type != "cuda":
        return None
    cc = None
    if meta.compute_capability:
        parts = re.findall(r"\d+", meta.compute_capability)
        if len(parts) >= 2:
            cc = (int(parts[0]), int(parts[1]))
    return knowledge.lookup_gpu(meta.device_name, meta.sm_count, cc)
