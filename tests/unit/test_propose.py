"""The propose stage end to end on hand-made profiles and the real graph summaries of the
examples: each rule firing and not firing, confidence, filters, ordering, determinism, and every
evidence value traced back into the artifacts."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.propose import DEPENDS_ON, classify, evidence_matches, order, propose
from pytest_opprof.propose.context import resolve_source
from pytest_opprof.propose.impact import (
    KERNEL_FLOOR_US,
    OpTime,
    budget,
    dtype_promotion_saving,
    kernel_scale,
    roofline_scale,
)
from pytest_opprof.schema import (
    CaptureMetadata,
    EdgeCaseFlag,
    FxGraphSummary,
    Impact,
    KernelRecord,
    LatencyStats,
    OperatorAggregate,
    OperatorRecord,
    Optimizations,
    Profile,
    Proposal,
    Timeline,
    TimelineSummary,
    Timing,
)

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "tests" / "data" / "graphs"
DATA = ROOT / "tests" / "data" / "propose"

# Kernel names as cuBLAS / cuDNN / PyTorch print them on an H200 (torch 2.11, CUDA 13).
KERNELS: dict[str, str] = json.loads((DATA / "kernel_names.json").read_text())["kernels"]
SGEMM = KERNELS["SGEMM"]
BF16_GEMM = KERNELS["BF16_GEMM"]
TF32_CONV = KERNELS["TF32_CONV"]
SIMT_CONV = KERNELS["SIMT_CONV"]
TO_NHWC = KERNELS["TO_NHWC"]
TO_NCHW = KERNELS["TO_NCHW"]
BN_INF = KERNELS["BN_INF"]
ELEMENTWISE = KERNELS["ELEMENTWISE"]
GEMV = KERNELS["GEMV"]
LSTM_CELL = KERNELS["LSTM_CELL"]
LSTM_GEMM = KERNELS["LSTM_GEMM"]
TRITON = KERNELS["TRITON"]
FLASH = KERNELS["FLASH"]
MEM_EFF_F32 = KERNELS["MEM_EFF_F32"]


# -------------------------------------------------------------------------------- builder


@dataclass
class Op:
    """One operator of a hand-made timeline: its kernels (name, µs) and input shapes."""

    name: str
    kernels: list[tuple[str, float]]
    shapes: list[Any] = field(default_factory=list)
    metrics: dict[str, float | None] = field(default_factory=dict)
    grid: list[int] | None = None


def timeline(
    label: str,
    ops: Sequence[Op],
    *,
    wall_us: float,
    launch_us: float | None = 4.0,
    unattributed: Sequence[tuple[str, float]] = (),
) -> Timeline:
    total = sum(d for o in ops for _, d in o.kernels) + sum(d for _, d in unattributed)
    kernels = sum(len(o.kernels) for o in ops) + len(unattributed)
    records, aggregated = [], []
    start = 0.0
    for i, o in enumerate(ops):
        recs = []
        for name, duration in o.kernels:
            recs.append(
                KernelRecord(
                    name=name,
                    duration_us=duration,
                    start_us=start,
                    grid=o.grid,
                    attribution="high",
                    stream=7,
                )
            )
            start += duration
        gpu = sum(d for _, d in o.kernels)
        records.append(
            OperatorRecord(
                name=o.name,
                call_index=0,
                cpu_time_us=gpu + 10.0,
                gpu_time_us=gpu,
                input_shapes=o.shapes,
                kernels=recs,
            )
        )
        aggregated.append(
            OperatorAggregate(
                name=o.name,
                calls=1,
                cpu_time_us=gpu + 10.0,
                gpu_time_us=gpu,
                share=gpu / total if total else 0.0,
                kernel_count=len(o.kernels),
                kernel_names=list(dict.fromkeys(n for n, _ in o.kernels)),
                metrics=o.metrics,
            )
        )
        del i
    return Timeline(
        label=label,
        compile_mode="eager" if label == "eager" else "default",
        summary=TimelineSummary(
            iterations=1,
            device_time_per_iter_us=total,
            wall_time_per_iter_us=wall_us,
            idle_time_per_iter_us=max(0.0, wall_us - total),
            kernels_per_iter=kernels,
            launch_overhead_per_call_us=launch_us,
            attributed_share=1.0 - sum(d for _, d in unattributed) / total if total else 1.0,
            high_share=0.99,
        ),
        operators=records,
        aggregated=aggregated,
        unattributed_kernels=[
            KernelRecord(name=n, duration_us=d, start_us=0.0) for n, d in unattributed
        ],
    )


def latency(ms: float) -> LatencyStats:
    return LatencyStats(
        median_ms=ms,
        ci_low_ms=ms * 0.98,
        ci_high_ms=ms * 1.02,
        mean_ms=ms,
        stdev_ms=ms * 0.01,
        min_ms=ms * 0.97,
        rounds=7,
        calls_per_round=30,
        samples_ms=[ms] * 7,
    )


def make_profile(
    ops: Sequence[Op],
    *,
    wall_us: float,
    compiled: Sequence[Op] | None = None,
    compiled_wall_us: float | None = None,
    device: str = "cuda",
    dtype: str = "float32",
    input_dtypes: Sequence[str] = ("torch.float32",),
    flags: Sequence[tuple[str, str]] = (),
    workload: str = "wl",
    unattributed: Sequence[tuple[str, float]] = (),
) -> Profile:
    eager = timeline("eager", ops, wall_us=wall_us, unattributed=unattributed)
    timelines = [eager]
    if compiled is not None:
        timelines.append(timeline("compiled", compiled, wall_us=compiled_wall_us or wall_us))
    compile_ms = (compiled_wall_us or wall_us * 0.95) / 1000.0
    gpu_ms = {t.label: t.summary.device_time_per_iter_us / 1000.0 for t in timelines}
    return Profile(
        capture_metadata=CaptureMetadata(
            workload=workload,
            device_type=device,  # type: ignore[arg-type]
            device_name="NVIDIA H200" if device == "cuda" else "cpu",
            sm_count=132 if device == "cuda" else None,
            compute_capability="9.0" if device == "cuda" else None,
            torch_version="2.11.0+cu130",
            python_version="3.12.3",
            dtype=dtype,
            input_shapes=[[1]],
            input_dtypes=list(input_dtypes),
            warmup_iters=10,
            measure_iters=10,
            rounds=7,
            compile_mode="default",
            timestamp="2026-11-29T00:00:00Z",
            environment_fingerprint="f",
            workload_sha256="0",
            cpu_fallback=device == "cpu",
        ),
        timing=Timing(
            device=device,
            clock="cuda_event" if device == "cuda" else "perf_counter",
            variants={
                "eager": latency(wall_us / 1000.0),
                "compile": latency(compile_ms),
            },
            gpu_kernel_ms=gpu_ms,
        ),
        timelines=timelines,
        edge_case_flags=[EdgeCaseFlag(name=n, detail=d) for n, d in flags],
    )


def graph(name: str) -> FxGraphSummary:
    return FxGraphSummary.model_validate_json((GRAPHS / f"{name}.graph.json").read_text())


def conv_block_profile(**kw: Any) -> Profile:
    ops = [
        Op(
            "aten::cudnn_convolution",
            [
                (SIMT_CONV, 14.0),
                (TO_NHWC, 6.0),
                (TF32_CONV, 30.0),
                (TO_NCHW, 8.0),
                (TO_NHWC, 4.0),
                (TF32_CONV, 28.0),
                (TO_NCHW, 4.0),
            ],
            shapes=[[16, 3, 64, 64], [64, 3, 3, 3]],
        ),
        Op(
            "aten::cudnn_batch_norm",
            [(BN_INF, 9.0), (BN_INF, 8.0), (BN_INF, 4.0)],
            shapes=[[16, 64, 64, 64], [64], [64], [64], [64]],
        ),
        Op(
            "aten::clamp_min",
            [(ELEMENTWISE, 6.0), (ELEMENTWISE, 6.0), (ELEMENTWISE, 3.0)],
            shapes=[[16, 64, 64, 64], []],
        ),
        Op(
            "aten::max_pool2d_with_indices",
            [("max_pool_forward_nchw", 5.0)],
            shapes=[[16, 128, 64, 64]],
        ),
        Op("aten::addmm", [(GEMV, 3.0)], shapes=[[10], [16, 256], [256, 10]]),
    ]
    compiled = [
        Op("aten::convolution", [(TF32_CONV, 28.0), (TF32_CONV, 27.0), (SIMT_CONV, 13.0)]),
        Op(
            "triton_poi_fused__native_batch_norm_legit_no_training_relu_0",
            [(TRITON, 6.0), (TRITON, 5.0)],
        ),
        Op("aten::addmm", [(GEMV, 3.0)]),
    ]
    return make_profile(
        ops, wall_us=264.0, compiled=compiled, compiled_wall_us=254.0, workload="conv_block", **kw
    )


def mlp_profile(**kw: Any) -> Profile:
    ops = [
        Op(
            "aten::addmm",
            [(SGEMM, 20.0), (SGEMM, 75.0), (SGEMM, 75.0), (SGEMM, 20.0)],
            shapes=[[2048], [256, 2048], [2048, 2048]],
        ),
        Op("aten::relu", [(ELEMENTWISE, 2.5)], shapes=[[256, 2048]]),
        Op("aten::gelu", [(ELEMENTWISE, 2.6)], shapes=[[256, 2048]]),
        Op("aten::silu", [(ELEMENTWISE, 2.4)], shapes=[[256, 2048]]),
        Op("aten::tanh", [(ELEMENTWISE, 2.2)], shapes=[[256, 512]]),
    ]
    return make_profile(ops, wall_us=270.0, workload="mlp_activations", **kw)


def launch_bound_profile(**kw: Any) -> Profile:
    """gpt2-like: hundreds of short kernels, the GPU idle most of the iteration."""
    ops = [
        Op("aten::addmm", [(SGEMM, 9.0)] * 48, shapes=[[768], [512, 768], [768, 3072]]),
        Op("aten::bmm", [(SGEMM, 4.0)] * 24, shapes=[[48, 128, 64], [48, 64, 128]]),
        Op("aten::mul", [(ELEMENTWISE, 2.0)] * 60, shapes=[[4, 128, 3072], []]),
        Op("aten::add", [(ELEMENTWISE, 2.0)] * 60, shapes=[[4, 128, 3072], []]),
        Op("aten::_softmax", [("softmax_warp_forward", 3.0)] * 12, shapes=[[4, 12, 128, 128]]),
        Op(
            "aten::native_layer_norm",
            [("vectorized_layer_norm_kernel", 3.0)] * 25,
            shapes=[[4, 128, 768]],
        ),
    ]
    return make_profile(ops, wall_us=4885.0, workload="gpt2", **kw)


def embedding_profile(**kw: Any) -> Profile:
    ops = [
        Op("aten::mm", [(SGEMM, 5000.0)], shapes=[[8192, 512], [512, 32000]]),
        Op(
            "aten::addmm",
            [(SGEMM, 500.0), (SGEMM, 480.0)],
            shapes=[[2048], [8192, 512], [512, 2048]],
        ),
        Op("aten::embedding", [("indexSelectLargeIndex", 20.0)], shapes=[[32000, 512], [64, 128]]),
        Op("aten::native_layer_norm", [("vectorized_layer_norm_kernel", 15.0)]),
        Op("aten::gelu", [(ELEMENTWISE, 40.0)], shapes=[[64, 128, 2048]]),
    ]
    return make_profile(
        ops, wall_us=6206.0, input_dtypes=("torch.int64",), workload="embedding_projection", **kw
    )


def lstm_profile(**kw: Any) -> Profile:
    ops = [
        Op(
            "aten::_cudnn_rnn",
            [(LSTM_GEMM, 60.0)] * 4 + [(LSTM_CELL, 12.0)] * 256,
            shapes=[[32, 128, 256]],
        ),
        Op("aten::mean", [("reduce_kernel", 8.0)], shapes=[[32, 128, 512]]),
        Op("aten::addmm", [(GEMV, 3.0)], shapes=[[10], [32, 512], [512, 10]]),
    ]
    return make_profile(ops, wall_us=4125.0, workload="lstm_sequence_encoder", **kw)


def sdpa_profile(**kw: Any) -> Profile:
    ops = [
        Op("aten::mm", [(SGEMM, 40.0)] * 4, shapes=[[4096, 512], [512, 512]]),
        Op(
            "aten::_efficient_attention_forward",
            [(MEM_EFF_F32, 90.0)],
            shapes=[[8, 512, 8, 64], [8, 512, 8, 64], [8, 512, 8, 64]],
        ),
        Op(
            "aten::native_layer_norm",
            [("vectorized_layer_norm_kernel", 8.0)] * 2,
            shapes=[[8, 512, 512]],
        ),
        Op("aten::add", [(ELEMENTWISE, 7.0)], shapes=[[8, 512, 512], [8, 512, 512]]),
        Op("aten::clone", [("elementwise_kernel copy", 6.0)], shapes=[[8, 8, 512, 64]]),
    ]
    return make_profile(ops, wall_us=423.0, workload="sdpa_attention", **kw)


def cpu_profile() -> Profile:
    ops = [
        Op("aten::addmm", [], shapes=[[2048], [256, 512], [512, 2048]]),
        Op("aten::relu", [], shapes=[[256, 2048]]),
    ]
    prof = make_profile(ops, wall_us=2000.0, device="cpu", workload="mlp_activations")
    # CPU timelines carry operator CPU time as their device time.
    for agg, share in zip(prof.timelines[0].aggregated, (0.9, 0.1), strict=True):
        agg.share = share
        agg.cpu_time_us = 2000.0 * share
    prof.timelines[0].summary.device_time_per_iter_us = 2000.0
    prof.timelines[0].summary.idle_time_per_iter_us = 0.0
    return prof


def types(opt: Optimizations) -> list[str]:
    return [p.type for p in opt.proposals]


def one(opt: Optimizations, kind: str) -> Proposal:
    found = [p for p in opt.proposals if p.type == kind]
    assert len(found) == 1, (kind, types(opt))
    return found[0]


SCENARIOS = {
    "conv_block": (conv_block_profile, "conv_block"),
    "depthwise": (conv_block_profile, "depthwise_separable_conv"),
    "mlp": (mlp_profile, "mlp_activations"),
    "gpt2": (launch_bound_profile, "gpt2"),
    "embedding": (embedding_profile, "embedding_projection"),
    "lstm": (lstm_profile, "lstm_sequence_encoder"),
    "sdpa": (sdpa_profile, "sdpa_attention"),
}


def scenario(key: str) -> tuple[Profile, FxGraphSummary]:
    make, graph_name = SCENARIOS[key]
    return make(), graph(graph_name)


# ---------------------------------------------------------------------------- dtype rule


def test_dtype_promotion_fires_on_fp32_simt_gemms_with_kernel_name_evidence() -> None:
    prof, g = scenario("mlp")
    p = one(propose(prof, g), "dtype_promotion")
    assert p.ir_level == "non_graph" and p.params == {"dtype": "bfloat16"}
    assert p.confidence == "high"
    assert p.targets == ["aten::addmm"]
    kernels = [e for e in p.evidence if e.metric == "aten::addmm kernel"]
    assert kernels and kernels[0].value == SGEMM
    share = next(e for e in p.evidence if e.metric == "aten::addmm share of kernel time")
    assert share.value == prof.timelines[0].aggregated[0].share
    assert share.source == "profile.json:timelines[0].aggregated[aten::addmm].share"
    assert 0 < p.impact.estimated_saving_us < 270.0 and p.impact.estimated_speedup > 1.2
    assert "mlp_activations" in p.impact.basis and "roofline" in p.impact.basis


def test_dtype_promotion_cites_the_tensor_pipe_counter_when_counters_ran() -> None:
    prof = mlp_profile()
    prof.timelines[0].aggregated[0].metrics = {
        "tensor_pipe_active_pct": 0.0,
        "sm_throughput_pct": 71.0,
    }
    p = one(propose(prof, None), "dtype_promotion")
    pipe = next(e for e in p.evidence if "tensor pipe" in e.metric)
    assert pipe.value == 0.0 and pipe.unit == "%"
    assert pipe.source.endswith("aggregated[aten::addmm].metrics.tensor_pipe_active_pct")


def test_dtype_promotion_does_not_fire_on_bf16_work() -> None:
    ops = [Op("aten::addmm", [(BF16_GEMM, 20.0)] * 4), Op("aten::relu", [(ELEMENTWISE, 2.0)])]
    prof = make_profile(ops, wall_us=120.0, dtype="bfloat16")
    assert "dtype_promotion" not in types(propose(prof, None))


def test_dtype_promotion_does_not_fire_below_the_min_share() -> None:
    ops = [Op("aten::addmm", [(SGEMM, 1.0)]), Op("aten::relu", [(ELEMENTWISE, 99.0)])]
    assert "dtype_promotion" not in types(propose(make_profile(ops, wall_us=120.0), None))


def test_dtype_promotion_on_cpu_is_low_confidence_with_no_modelled_saving() -> None:
    opt = propose(cpu_profile(), graph("mlp_activations"))
    p = one(opt, "dtype_promotion")
    assert p.confidence == "low" and p.impact.estimated_saving_us == 0.0
    assert "CPU" in p.rationale
    assert any("CPU profile" in n for n in opt.global_notes)


def test_dtype_promotion_mentions_fp32_triton_work_of_the_compiled_baseline() -> None:
    p = one(propose(conv_block_profile(), graph("conv_block")), "dtype_promotion")
    assert "Triton" in p.rationale
    assert any(
        e.source.startswith("profile.json:timelines[1].aggregated[triton_poi") for e in p.evidence
    )


def test_roofline_scale_keeps_each_call_at_its_fraction_of_the_roofline() -> None:
    from pytest_opprof import knowledge

    spec = knowledge.lookup_gpu("NVIDIA H200").spec  # type: ignore[union-attr]
    fp32 = knowledge.peak_flops(spec, "fp32", tensor_cores=False)
    tf32, bf16 = knowledge.peak_flops(spec, "tf32"), knowledge.peak_flops(spec, "bf16")
    bw = spec.memory_bandwidth_bytes_per_s
    # the 32000-wide logits GEMM: compute-bound at every precision -> the peak ratio
    m, k, n = 8192, 512, 32000
    flops, data = 2.0 * m * n * k, 4.0 * (m * k + k * n + m * n)
    assert roofline_scale(spec, "fp32", flops, data) == pytest.approx(fp32 / bf16)
    assert roofline_scale(spec, "tf32", flops, data) == pytest.approx(tf32 / bf16)
    # a depthwise 3x3 conv: memory-bound -> half the bytes, half the time
    depthwise = (2.0 * 16 * 128 * 56 * 56 * 9, 4.0 * (2 * 16 * 128 * 56 * 56 + 128 * 9))
    assert roofline_scale(spec, "fp32", *depthwise) == pytest.approx(0.5)
    # compute-bound at FP32, memory-bound at BF16: between the two
    mid = (2.0 * 256 * 2048 * 2048, 4.0 * (256 * 2048 * 2 + 2048 * 2048))
    expected = (mid[1] / 2 / bw) / (mid[0] / fp32)
    assert roofline_scale(spec, "fp32", *mid) == pytest.approx(expected)
    assert fp32 / bf16 < expected < 0.5
    assert kernel_scale(spec, "memory") == 0.5 and kernel_scale(spec, "none") == 1.0


def test_dtype_saving_is_floored_by_the_kernel_count() -> None:
    from pytest_opprof import knowledge

    spec = knowledge.lookup_gpu("NVIDIA H200").spec  # type: ignore[union-attr]
    free = dtype_promotion_saving([OpTime("a", 100.0, 0.1, 1, "roofline")], spec)
    assert free.device_saving_us == pytest.approx(90.0) and free.after_us == pytest.approx(10.0)
    floored = dtype_promotion_saving([OpTime("a", 100.0, 0.1, 20, "roofline")], spec)
    assert floored.after_us == pytest.approx(20 * KERNEL_FLOOR_US)
    assert "roofline" in floored.detail and spec.name in floored.detail


def test_the_eager_budget_comes_from_the_timing_pass() -> None:
    prof = mlp_profile()
    b = budget(prof, prof.timelines[0])
    assert b.wall_us == pytest.approx(270.0) and b.wall_from == "timing.variants.eager.median_ms"
    assert b.idle_share == pytest.approx((270.0 - b.device_us) / 270.0)
    # the iteration cannot get shorter than the host needs: kernels x launch overhead here
    assert b.host_floor_us == pytest.approx(max(8 * 4.0, 270.0 - b.device_us, 270.0 / 3))
    assert b.wall_saving(10_000.0) == pytest.approx(270.0 - b.host_floor_us)


# -------------------------------------------------------------------------- graph rules


def test_memory_layout_fires_for_nchw_convolutions_with_conversion_kernels() -> None:
    p = one(propose(conv_block_profile(), graph("conv_block")), "memory_layout")
    assert p.params == {"channels_last": True} and p.confidence == "high"
    assert {"input_1", "input_4", "input_8", "aten::cudnn_convolution"} <= set(p.targets)
    assert any(e.value == TO_NHWC for e in p.evidence)
    assert p.impact.estimated_saving_us > 0


def test_memory_layout_from_graph_shapes_alone_is_medium() -> None:
    p = one(propose(mlp_profile(), graph("depthwise_separable_conv")), "memory_layout")
    assert p.confidence == "medium" and p.impact.estimated_saving_us == 0.0
    assert "depthwise" in p.rationale


def test_memory_layout_does_not_fire_without_convolutions() -> None:
    assert "memory_layout" not in types(propose(mlp_profile(), graph("mlp_activations")))


def test_bn_fold_fires_for_conv_then_eval_batch_norm() -> None:
    p = one(propose(conv_block_profile(), graph("conv_block")), "bn_fold")
    assert p.ir_level == "aten" and p.confidence == "high"
    assert p.params["pairs"] == [
        ["input_1", "input_2"],
        ["input_4", "input_5"],
        ["input_8", "input_9"],
    ]
    flag = next(e for e in p.evidence if e.metric == "batch_norm training")
    assert flag.value == "False" and flag.source == "graph.json:graphs[0][input_2].args[5]"
    assert "aten::cudnn_batch_norm" in p.targets
    depthwise = one(propose(conv_block_profile(), graph("depthwise_separable_conv")), "bn_fold")
    assert len(depthwise.params["pairs"]) == 6


def test_bn_fold_does_not_fire_for_training_batch_norm() -> None:
    g = graph("conv_block")
    for node in g.graphs[0]:
        if node.target.endswith("batch_norm"):
            node.args[5] = "True"
    assert "bn_fold" not in types(propose(conv_block_profile(), g))
    assert "bn_fold" not in types(propose(conv_block_profile(), None))


def test_qkv_fusion_fires_for_linears_sharing_one_input() -> None:
    p = one(propose(sdpa_profile(), graph("sdpa_attention")), "qkv_fusion")
    assert p.ir_level == "functional" and p.confidence == "high"
    assert p.params["groups"] == [["linear", "linear_1", "linear_2"]]
    assert [e.value for e in p.evidence if e.metric.endswith(" input")] == ["h", "h", "h"]
    assert p.impact.estimated_saving_us > 0


def test_qkv_fusion_does_not_fire_when_already_fused() -> None:
    assert "qkv_fusion" not in types(propose(launch_bound_profile(), graph("gpt2")))


def test_sdpa_replacement_fires_for_hand_written_attention() -> None:
    p = one(propose(launch_bound_profile(), graph("gpt2")), "sdpa_replacement")
    assert p.ir_level == "functional" and p.confidence == "medium"
    assert p.targets[:5] == ["matmul", "att", "att_1", "att_2", "y"]
    assert len(p.targets) == 12 * 5
    assert any(e.metric == "mask" for e in p.evidence)


def test_sdpa_replacement_does_not_fire_when_sdpa_is_used() -> None:
    assert "sdpa_replacement" not in types(propose(sdpa_profile(), graph("sdpa_attention")))


def test_activation_substitution_fires_for_tanh_gelu() -> None:
    p = one(propose(launch_bound_profile(), graph("gpt2")), "activation_substitution")
    assert p.ir_level == "functional" and len(p.targets) == 12 * 8
    assert any(e.value == "0.7978845608028654" for e in p.evidence)
    assert p.impact.estimated_saving_us > 0


def test_activation_substitution_does_not_fire_for_nn_gelu() -> None:
    assert "activation_substitution" not in types(propose(mlp_profile(), graph("mlp_activations")))


def test_pretranspose_weights_fires_for_weight_reading_ops() -> None:
    p = one(propose(mlp_profile(), graph("mlp_activations")), "pretranspose_weights")
    assert p.params == {"freezing": True} and p.ir_level == "inductor_config"
    assert p.targets == ["input_1", "input_3", "input_5", "input_7"]


def test_pretranspose_weights_does_not_fire_without_gemms() -> None:
    prof = make_profile([Op("aten::relu", [(ELEMENTWISE, 5.0)])], wall_us=20.0)
    assert "pretranspose_weights" not in types(propose(prof, None))


def test_cuda_graphs_fires_when_launch_bound() -> None:
    prof = launch_bound_profile()  # no compiled timeline: judged on the eager iteration
    p = one(propose(prof, graph("gpt2")), "cuda_graphs")
    assert p.params == {"config_patches": {"triton.cudagraphs": True}}
    assert p.confidence == "high"
    metrics = {e.metric: e.value for e in p.evidence}
    s = prof.timelines[0].summary
    assert metrics["eager kernels per iteration"] == s.kernels_per_iter
    assert metrics["eager launch overhead per call"] == 4.0
    assert metrics["eager latency (median, no profiler)"] == 4.885
    assert p.impact.estimated_saving_us == pytest.approx(
        4885.0 - s.device_time_per_iter_us, abs=0.1
    )
    assert "eager iteration" in p.rationale


def test_cuda_graphs_is_judged_on_the_compiled_baseline() -> None:
    prof = conv_block_profile()
    p = one(propose(prof, graph("conv_block")), "cuda_graphs")
    compiled = prof.timelines[1].summary
    assert any(e.source == "profile.json:timing.variants.compile.median_ms" for e in p.evidence)
    assert any(e.source == "profile.json:timing.gpu_kernel_ms.compiled" for e in p.evidence)
    assert p.impact.estimated_saving_us == pytest.approx(
        254.0 - compiled.device_time_per_iter_us, abs=0.1
    )
    assert "torch.compile baseline" in p.rationale


def test_cuda_graphs_after_the_precision_change_is_medium() -> None:
    """GPU-bound at FP32 (sdpa_attention, gpt2 on the H200), launch-bound once BF16 shrinks
    the kernels: proposed, after dtype_promotion, at medium confidence."""
    short = [Op("triton_poi_fused_0", [("triton_poi_fused_0", 4.0)] * 8)]
    gemm = Op("aten::mm", [(SGEMM, 80.0)] * 4, shapes=[[4096, 512], [512, 512]])
    prof = make_profile(
        [gemm, *short], wall_us=400.0, compiled=[gemm, *short], compiled_wall_us=372.0
    )
    opt = propose(prof, None)
    p = one(opt, "cuda_graphs")
    assert p.confidence == "medium" and "dtype_promotion-1" in p.depends_on
    assert "once the kernels run in BF16" in p.rationale
    assert "after dtype_promotion" in p.impact.basis
    # without the precision change the compiled graph stays GPU-bound: no CUDA graphs
    bf16 = [Op("aten::mm", [(BF16_GEMM, 80.0)] * 4), *short]
    gpu_bound = make_profile(
        bf16, wall_us=400.0, compiled=bf16, compiled_wall_us=372.0, dtype="bfloat16"
    )
    assert "dtype_promotion" not in types(propose(gpu_bound, None))
    assert "cuda_graphs" not in types(propose(gpu_bound, None))


def test_cuda_graphs_not_where_dynamo_captured_no_graph() -> None:
    opt = propose(launch_bound_profile(), graph("lstm_sequence_encoder"))
    assert "cuda_graphs" not in types(opt)
    assert any("nothing to record and replay" in n for n in opt.global_notes)


def test_cuda_graphs_does_not_fire_when_gpu_bound() -> None:
    assert "cuda_graphs" not in types(propose(embedding_profile(), graph("embedding_projection")))


def test_cuda_graphs_never_on_cpu_or_when_graphs_already_replay() -> None:
    assert "cuda_graphs" not in types(propose(cpu_profile(), None))
    replay = launch_bound_profile(flags=[("cuda_graph_replay", "cudaGraphLaunch seen")])
    assert "cuda_graphs" not in types(propose(replay, None))


def test_lstm_gets_low_confidence_algorithm_selection_and_a_stub() -> None:
    prof, g = scenario("lstm")
    opt = propose(prof, g)
    algo = one(opt, "algorithm_selection")
    assert algo.confidence == "low" and algo.params["scope"] == "rnn"
    assert "aten::_cudnn_rnn" in algo.targets
    stub = one(opt, "stub_detection")
    assert stub.targets[0] == "lstm" and stub.params == {"patterns": ["LSTM"]}
    module = next(e for e in stub.evidence if e.metric == "module type")
    assert module.value == "torch.nn.modules.rnn.LSTM"
    assert any("Dynamo captured no graph" in n for n in opt.global_notes)
    # Inductor never sees the LSTM's weights: freezing cannot help
    assert "pretranspose_weights" not in types(opt)
    # cuDNN's serial cell kernels are latency-bound: bf16 gains little (1.09× measured)
    assert 1.0 < one(opt, "dtype_promotion").impact.estimated_speedup < 1.2


def test_algorithm_selection_for_skinny_gemms_only_above_min_share() -> None:
    ops = [Op("aten::addmm", [(GEMV, 30.0)]), Op("aten::relu", [(ELEMENTWISE, 70.0)])]
    p = one(propose(make_profile(ops, wall_us=120.0), None), "algorithm_selection")
    assert p.params["config_patches"] == {"max_autotune_gemm": True}
    assert "algorithm_selection" not in types(propose(conv_block_profile(), None))
    assert "stub_detection" not in types(propose(mlp_profile(), graph("mlp_activations")))


def test_batch_padding_fires_for_cheap_padding_of_an_off_tile_dimension() -> None:
    g = graph("mlp_activations")
    weight = next(n for n in g.graphs[0] if n.name.endswith("layers_modules_2_parameters_weight_"))
    weight.shape = [2044, 2048]  # N = 2044: 4 short of a multiple of 8
    p = one(propose(mlp_profile(), g), "batch_padding")
    assert p.params == {"multiple": 8} and p.targets == ["input_3"]
    assert p.depends_on == ["dtype_promotion-1"]


def test_batch_padding_does_not_fire_when_padding_wastes_too_much() -> None:
    # conv_block: C_in = 3 → 8 and out_features 10 → 16 waste 167 % and 60 %
    assert "batch_padding" not in types(propose(conv_block_profile(), graph("conv_block")))


# ------------------------------------------------------------------- confidence and flags


def test_graph_breaks_lower_graph_passes_but_not_non_graph_changes() -> None:
    g = graph("conv_block")
    g.graph_breaks = 2
    opt = propose(conv_block_profile(), g)
    assert one(opt, "bn_fold").confidence == "medium"
    assert one(opt, "memory_layout").confidence == "high"
    bn = one(opt, "bn_fold")
    assert any(e.source == "graph.json:graph_breaks" and e.value == 2 for e in bn.evidence)
    assert "graph_breaks (−0.25)" in bn.rationale
    assert [f.name for f in opt.edge_case_flags] == ["graph_breaks"]


def test_profile_flags_are_copied_and_lower_every_proposal() -> None:
    prof = mlp_profile(flags=[("cuda_graph_replay", "cudaGraphLaunch in the window")])
    opt = propose(prof, graph("mlp_activations"))
    assert opt.edge_case_flags == prof.edge_case_flags
    assert one(opt, "dtype_promotion").confidence == "medium"


def test_high_unattributed_share_is_detected() -> None:
    prof = mlp_profile(unattributed=[("mystery_kernel", 40.0)])
    opt = propose(prof, None)
    assert "high_unattributed_share" in [f.name for f in opt.edge_case_flags]
    dtype = one(opt, "dtype_promotion")
    assert "high_unattributed_share (−0.15)" in dtype.rationale
    attributed = next(e for e in dtype.evidence if e.metric == "attributed share")
    assert attributed.value == prof.timelines[0].summary.attributed_share < 0.9
    # 0.9 − 0.15 stays high; with graph breaks as well bn_fold would drop further
    assert dtype.confidence == "high"


def test_a_penalty_that_lands_on_a_level_boundary_keeps_that_level() -> None:
    # memory_layout from graph shapes alone starts at 0.6; 0.6 − 0.15 is 0.4499… in floats
    prof = mlp_profile(flags=[("high_unattributed_share", "12% unattributed")])
    p = one(propose(prof, graph("depthwise_separable_conv")), "memory_layout")
    assert p.confidence == "medium"


def test_cpu_shares_are_called_operator_time() -> None:
    p = one(propose(cpu_profile(), None), "dtype_promotion")
    assert p.evidence[1].metric == "aten::addmm share of operator time"
    assert "operator time" in p.rationale and "kernel time" not in p.rationale


def test_global_notes_say_counters_were_not_collected() -> None:
    opt = propose(mlp_profile(), None)
    assert any(n.startswith("counters were not collected") for n in opt.global_notes)
    assert any(n.startswith("no FX graph summary") for n in opt.global_notes)
    assert any("aten::addmm" in n and "tensor_core_idle" in n for n in opt.global_notes)


# ------------------------------------------------------------------------------ filters


def test_min_confidence_drops_lower_levels() -> None:
    prof, g = scenario("lstm")
    assert {"algorithm_selection", "stub_detection"} <= set(types(propose(prof, g)))
    opt = propose(prof, g, min_confidence="medium")
    assert all(p.confidence in ("high", "medium") for p in opt.proposals)
    assert any(n.startswith("min_confidence=medium: dropped") for n in opt.global_notes)
    with pytest.raises(ValueError, match="min_confidence"):
        propose(prof, g, min_confidence="sure")


def test_max_opts_keeps_the_largest_estimated_savings() -> None:
    prof, g = scenario("conv_block")
    full = propose(prof, g)
    top = propose(prof, g, max_opts=2)
    expected = sorted(full.proposals, key=lambda p: -p.impact.estimated_saving_us)[:2]
    assert {p.id for p in top.proposals} == {p.id for p in expected}
    kept = {p.id for p in top.proposals}
    assert all(d in kept for p in top.proposals for d in p.depends_on)
    assert propose(prof, g, max_opts=0).proposals == []


def test_skip_drops_types_and_notes_unknown_ones() -> None:
    prof, g = scenario("conv_block")
    opt = propose(prof, g, skip=["bn_fold", "no_such_pass"])
    assert "bn_fold" not in types(opt)
    assert one(opt, "memory_layout").depends_on == []
    assert any("no_such_pass" in n for n in opt.global_notes)


# -------------------------------------------------------------------- ids and ordering


def test_ids_are_type_and_ordinal_and_dependencies_point_backwards() -> None:
    opt = propose(*scenario("conv_block"))
    seen: set[str] = set()
    for p in opt.proposals:
        assert p.id.startswith(p.type + "-") and p.id.rsplit("-", 1)[1].isdigit()
        assert all(d in seen for d in p.depends_on), (p.id, p.depends_on)
        seen.add(p.id)
    position = {p.type: i for i, p in enumerate(opt.proposals)}
    assert position["bn_fold"] < position["memory_layout"]
    assert one(opt, "memory_layout").depends_on == ["bn_fold-1"]


def test_cuda_graphs_comes_after_dtype_promotion() -> None:
    opt = propose(*scenario("gpt2"))
    cg = one(opt, "cuda_graphs")
    assert "dtype_promotion-1" in cg.depends_on
    assert types(opt).index("dtype_promotion") < types(opt).index("cuda_graphs")
    assert set(DEPENDS_ON["cuda_graphs"]) >= {"dtype_promotion"}


def _proposal(pid: str, confidence: str, saving: float, deps: list[str]) -> Proposal:
    kind = pid.rsplit("-", 1)[0]
    return Proposal(
        id=pid,
        type=kind,
        ir_level="aten",
        targets=[],
        evidence=[],
        fx_steps=[],
        impact=Impact(estimated_saving_us=saving, estimated_speedup=1.0, basis="b"),
        confidence=confidence,  # type: ignore[arg-type]
        depends_on=deps,
    )


def test_order_breaks_cycles_at_the_most_confident_proposal() -> None:
    a = _proposal("bn_fold-1", "medium", 5.0, ["qkv_fusion-1"])
    b = _proposal("qkv_fusion-1", "high", 1.0, ["bn_fold-1"])
    c = _proposal("cuda_graphs-1", "high", 50.0, ["bn_fold-1"])
    notes: list[str] = []
    result = order([a, b, c], notes)
    assert [p.id for p in result] == ["qkv_fusion-1", "bn_fold-1", "cuda_graphs-1"]
    assert result[0].depends_on == []
    assert notes == [
        "dependency cycle broken at qkv_fusion-1 (highest confidence): no longer "
        "waits for bn_fold-1"
    ]


def test_order_puts_larger_savings_first_among_ready_proposals() -> None:
    a = _proposal("bn_fold-1", "high", 5.0, [])
    b = _proposal("qkv_fusion-1", "low", 9.0, [])
    assert [p.id for p in order([a, b])] == ["qkv_fusion-1", "bn_fold-1"]


# ------------------------------------------------------ determinism, purity, traceability


@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_every_evidence_value_is_found_at_its_source(key: str) -> None:
    prof, g = scenario(key)
    opt = propose(prof, g)
    assert opt.proposals
    for p in opt.proposals:
        assert p.evidence, p.id
        for e in p.evidence:
            assert evidence_matches(e, prof, g), (p.id, e)


def test_cpu_evidence_is_traceable_too() -> None:
    prof, g = cpu_profile(), graph("mlp_activations")
    for p in propose(prof, g).proposals:
        for e in p.evidence:
            assert evidence_matches(e, prof, g), (p.id, e)


def test_resolve_source_reads_fields_indices_and_names() -> None:
    prof, g = scenario("conv_block")
    assert (
        resolve_source("profile.json:timelines[0].aggregated[aten::addmm].kernel_names[0]", prof, g)
        == GEMV
    )
    assert resolve_source("profile.json:timing.variants.eager.median_ms", prof, g) == 0.264
    assert resolve_source("graph.json:graphs[0][input_2].args[5]", prof, g) == "False"
    assert resolve_source("graph.json:module_types[features.0]", prof, g).endswith("Conv2d")
    for bad in (
        "profile.json:timelines[0].aggregated[aten::nope].share",
        "graph.json:graphs[0][input_2].nofield",
        "other.json:x",
        "profile.json:capture_metadata.dtype[0]",
    ):
        with pytest.raises(KeyError):
            resolve_source(bad, prof, g)
    with pytest.raises(KeyError):
        resolve_source("graph.json:graph_breaks", prof, None)


@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_same_inputs_give_byte_identical_json(key: str) -> None:
    first = propose(*scenario(key)).model_dump_json(indent=2)
    second = propose(*scenario(key)).model_dump_json(indent=2)
    assert first == second


PROFILE_FIXTURES = {"cpu_mlp": cpu_profile, "conv_block": conv_block_profile, "mlp": mlp_profile}


@pytest.mark.parametrize("key", sorted(PROFILE_FIXTURES))
def test_profile_fixtures_match_the_builder(key: str) -> None:
    """tests/data/propose/*.profile.json are these profiles, for the other test modules;
    OPPROF_REGEN=1 rewrites them."""
    text = PROFILE_FIXTURES[key]().model_dump_json(indent=1) + "\n"
    path = DATA / f"{key}.profile.json"
    if os.environ.get("OPPROF_REGEN"):
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def test_output_matches_the_committed_golden_file() -> None:
    """Catches accidental changes of the rules' output; OPPROF_REGEN=1 rewrites the file."""
    text = propose(*scenario("conv_block")).model_dump_json(indent=2) + "\n"
    golden = DATA / "conv_block.optimizations.json"
    if os.environ.get("OPPROF_REGEN"):
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")
    Optimizations.model_validate(json.loads(text))


def test_propose_does_not_mutate_its_inputs() -> None:
    prof, g = scenario("conv_block")
    before = (prof.model_dump_json(), g.model_dump_json())
    propose(prof, g)
    assert (prof.model_dump_json(), g.model_dump_json()) == before
    assert all(a.bottleneck is None for a in prof.timelines[0].aggregated)
    classified = classify(prof)
    assert classified.timelines[0].aggregated[0].bottleneck is not None


def test_a_profile_without_timelines_gives_no_proposals() -> None:
    prof = mlp_profile()
    prof.timelines = []
    opt = propose(prof, None)
    assert opt.proposals == [] and opt.global_notes
