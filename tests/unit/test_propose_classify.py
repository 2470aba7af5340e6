"""The bottleneck classifier: each class from counters, the no-counter fallbacks, kernel-name
precision, analytic work from input shapes, and classification on a copy of the profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_opprof import knowledge
from pytest_opprof.propose.classify import (
    OpFacts,
    classify,
    classify_operator,
    kernel_precision,
    op_kind,
    operator_work,
    timeline_facts,
)
from pytest_opprof.schema import (
    KernelRecord,
    OperatorAggregate,
    OperatorRecord,
    Profile,
    Timeline,
    TimelineSummary,
    read_artifact,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "propose"
K: dict[str, str] = json.loads((DATA / "kernel_names.json").read_text())["kernels"]
H200 = knowledge.lookup_gpu("NVIDIA H200").spec  # type: ignore[union-attr]
TH = knowledge.THRESHOLDS


def facts(
    name: str,
    kernels: list[tuple[str, float]],
    *,
    metrics: dict[str, float | None] | None = None,
    shapes: list[object] | None = None,
    grid: list[int] | None = None,
) -> OpFacts:
    records = [KernelRecord(name=n, duration_us=d, start_us=0.0, grid=grid) for n, d in kernels]
    gpu = sum(d for _, d in kernels)
    agg = OperatorAggregate(
        name=name,
        calls=1,
        cpu_time_us=gpu,
        gpu_time_us=gpu,
        share=1.0,
        kernel_count=len(kernels),
        kernel_names=list(dict.fromkeys(n for n, _ in kernels)),
        metrics=metrics or {},
    )
    op = OperatorRecord(
        name=name,
        call_index=0,
        cpu_time_us=gpu,
        gpu_time_us=gpu,
        input_shapes=shapes or [],
        kernels=records,
    )
    tl = Timeline(
        label="eager",
        compile_mode="eager",
        summary=TimelineSummary(
            iterations=1,
            device_time_per_iter_us=gpu,
            wall_time_per_iter_us=gpu,
            idle_time_per_iter_us=0.0,
            kernels_per_iter=len(kernels),
            attributed_share=1.0,
            high_share=1.0,
        ),
        operators=[op],
        aggregated=[agg],
    )
    return timeline_facts(tl, spec=H200)[name]


def cls(f: OpFacts) -> str:
    return classify_operator(f, TH)[0]


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("SGEMM", "fp32"),
        ("SIMT_CONV", "fp32"),
        ("GEMV", "fp32"),
        ("LSTM_GEMM", "fp32"),
        ("MEM_EFF_F32", "fp32"),
        ("TF32_CONV", "tf32"),
        ("BF16_GEMM", "bf16"),
        ("FLASH", "bf16"),
        ("TRITON", None),
    ],
)
def test_kernel_precision_from_names(key: str, expected: str | None) -> None:
    assert kernel_precision(K[key]) == expected


def test_op_kind_from_aten_names() -> None:
    assert [
        op_kind(n)
        for n in (
            "aten::addmm",
            "aten::cudnn_convolution",
            "aten::_efficient_attention_forward",
            "aten::_cudnn_rnn",
            "aten::cudnn_batch_norm",
            "aten::copy_",
            "aten::gelu",
            "triton_tem_fused_mm_0",
        )
    ] == ["gemm", "conv", "attention", "rnn", "batch_norm", "layout", "other", "gemm"]


# ---------------------------------------------------------------------- with counters


def test_register_pressure_from_spills_and_from_registers_at_low_occupancy() -> None:
    spills = facts("aten::mm", [(K["SGEMM"], 50.0)], metrics={"local_memory_spill_bytes": 64.0})
    assert cls(spills) == "register_pressure"
    regs = facts(
        "aten::mm",
        [(K["BF16_GEMM"], 50.0)],
        metrics={"registers_per_thread": 168.0, "achieved_occupancy_pct": 12.0},
    )
    assert cls(regs) == "register_pressure"


def test_tensor_core_idle_from_the_tensor_pipe_counter() -> None:
    f = facts(
        "aten::addmm",
        [(K["BF16_GEMM"], 50.0)],
        metrics={"tensor_pipe_active_pct": 1.5, "sm_throughput_pct": 70.0},
    )
    assert classify_operator(f, TH) == ("tensor_core_idle", "tensor pipe active 1.5%")
    busy = facts(
        "aten::addmm",
        [(K["BF16_GEMM"], 50.0)],
        metrics={"tensor_pipe_active_pct": 60.0, "sm_throughput_pct": 70.0},
    )
    assert cls(busy) == "compute_bound"


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({"sm_throughput_pct": 85.0, "dram_throughput_pct": 20.0}, "well_optimized"),
        ({"sm_throughput_pct": 30.0, "dram_throughput_pct": 70.0}, "memory_bound"),
        ({"sm_throughput_pct": 30.0, "memory_throughput_pct": 65.0}, "memory_bound"),
        ({"sm_throughput_pct": 65.0, "dram_throughput_pct": 40.0}, "compute_bound"),
        (
            {"sm_throughput_pct": 40.0, "dram_throughput_pct": 40.0, "achieved_occupancy_pct": 9.0},
            "occupancy_limited",
        ),
        ({"sm_throughput_pct": 12.0, "dram_throughput_pct": 8.0}, "launch_bound"),
    ],
)
def test_counter_rules_for_elementwise_work(
    metrics: dict[str, float | None], expected: str
) -> None:
    assert cls(facts("aten::add", [("elementwise_kernel", 40.0)], metrics=metrics)) == expected


def test_a_null_counter_falls_through_to_the_fallback() -> None:
    f = facts("aten::mm", [(K["SGEMM"], 50.0)], metrics={"tensor_pipe_active_pct": None})
    assert not f.has_counters
    assert cls(f) == "tensor_core_idle"


# ------------------------------------------------------------------------- no counters


def test_fp32_simt_kernel_names_mean_tensor_cores_idle() -> None:
    f = facts("aten::addmm", [(K["SGEMM"], 50.0)])
    assert classify_operator(f, TH) == ("tensor_core_idle", f"FP32 kernel {K['SGEMM']}")


def test_layout_conversions_are_layout_overhead() -> None:
    f = facts("aten::cudnn_convolution", [(K["TO_NHWC"], 20.0), (K["TF32_CONV"], 60.0)])
    assert f.layout_share == pytest.approx(0.25)
    assert cls(f) == "layout_overhead"


def test_short_kernels_are_launch_bound() -> None:
    f = facts("aten::relu", [("elementwise_kernel", 3.0), ("elementwise_kernel", 4.0)])
    assert classify_operator(f, TH) == ("launch_bound", "median kernel 4.0 µs")


def test_a_grid_smaller_than_one_wave_is_occupancy_limited() -> None:
    f = facts("aten::mm", [(K["BF16_GEMM"], 40.0)], grid=[16, 1, 1])
    assert f.blocks_per_sm == pytest.approx(16 / 132)
    assert cls(f) == "occupancy_limited"


def test_roofline_from_input_shapes_separates_memory_and_compute() -> None:
    # a [4096, 4096] add at 20 µs: 201 MB at 4.8 TB/s is 42 µs -> well optimized? no: the
    # measured time is below the floor, so it reads as at/above its roofline
    add = facts("aten::add", [("elementwise_kernel", 100.0)], shapes=[[4096, 4096], [4096, 4096]])
    assert add.roofline_bound == "memory"
    assert cls(add) == "memory_bound"
    fast = facts("aten::add", [("elementwise_kernel", 45.0)], shapes=[[4096, 4096], [4096, 4096]])
    assert cls(fast) == "well_optimized"
    mm = facts("aten::mm", [(K["BF16_GEMM"], 2000.0)], shapes=[[8192, 8192], [8192, 8192]])
    assert mm.roofline_bound == "compute" and cls(mm) == "compute_bound"


def test_operator_work_of_gemms_and_convolutions() -> None:
    assert operator_work("aten::mm", [[64, 32], [32, 16]], 4) == (
        2.0 * 64 * 16 * 32,
        float((64 * 32 + 32 * 16 + 64 * 16) * 4),
    )
    flops, _ = operator_work("aten::addmm", [[16], [64, 32], [32, 16], [], []], 4)
    assert flops == 2.0 * 64 * 16 * 32
    flops, _ = operator_work("aten::bmm", [[8, 64, 32], [8, 32, 16]], 2)
    assert flops == 2.0 * 8 * 64 * 16 * 32
    flops, data = operator_work("aten::cudnn_convolution", [[16, 3, 64, 64], [64, 3, 3, 3]], 4)
    assert flops == 2.0 * 16 * 64 * 64 * 64 * 27
    assert data == (16 * 3 * 64 * 64 + 64 * 27 + 16 * 64 * 64 * 64) * 4
    assert operator_work("aten::relu", [], 4) == (0.0, 0.0)


# -------------------------------------------------------------------------- on profiles


def test_classify_sets_every_class_on_a_copy() -> None:
    prof = read_artifact(DATA / "conv_block.profile.json", Profile)
    out = classify(prof)
    assert out is not prof
    assert all(a.bottleneck is None for t in prof.timelines for a in t.aggregated)
    classes = {a.name: a.bottleneck for a in out.timelines[0].aggregated}
    assert classes["aten::cudnn_convolution"] == "tensor_core_idle"
    assert classes["aten::clamp_min"] == "launch_bound"
    assert all(a.bottleneck in knowledge.BOTTLENECK_CLASSES for a in out.timelines[1].aggregated)


def test_cpu_profiles_get_no_class() -> None:
    out = classify(read_artifact(DATA / "cpu_mlp.profile.json", Profile))
    assert all(a.bottleneck is None for a in out.timelines[0].aggregated)
