"""The knowledge base: hardware lookup, roofline math, and the pages that must agree with code."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import ValidationError

from pytest_opprof import knowledge
from pytest_opprof.knowledge import (
    CONFIDENCE_LEVELS,
    EDGE_CASE_APPLIES_TO,
    EDGE_CASE_PENALTIES,
    THRESHOLDS,
    PeakFlops,
    apply_edge_case_penalties,
    confidence_level,
    is_layout_conversion,
    is_simt_fp32_gemm,
    is_tensor_core_kernel,
    load_hardware_table,
    lookup_gpu,
    peak_flops,
    ridge_point,
    roofline,
    threshold_names,
    tile_multiple,
)

ROOT = Path(__file__).resolve().parents[2]
KNOWLEDGE = ROOT / "knowledge"


def _spec(key: str) -> knowledge.GpuSpec:
    return next(g for g in load_hardware_table() if g.key == key)


# ------------------------------------------------------------------------------- lookup

TORCH_NAMES = [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000-blackwell"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000-blackwell"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "rtx-pro-6000-blackwell-max-q"),
]


@pytest.mark.parametrize(("name", "key"), TORCH_NAMES)
def test_lookup_by_the_name_torch_reports(name: str, key: str) -> None:
    match = lookup_gpu(name)
    assert match is not None
    assert (match.spec.key, match.exact, match.note) == (key, True, "")


@pytest.mark.parametrize(("name", "key"), TORCH_NAMES)
def test_lookup_with_the_devices_own_sm_count_and_cc_stays_exact(name: str, key: str) -> None:
    spec = _spec(key)
    match = lookup_gpu(name, sm_count=spec.sm_count, compute_capability=spec.compute_capability)
    assert match is not None
    assert match.exact
    assert match.spec == spec


def test_lookup_is_case_insensitive() -> None:
    match = lookup_gpu("nvidia h100 pcie")
    assert match is not None and match.spec.key == "h100-pcie"


def test_h20_is_not_an_h200() -> None:
    match = lookup_gpu("NVIDIA H20", sm_count=78, compute_capability=(9, 0))
    assert match is not None
    assert not match.exact
    assert match.spec.key != "h200"
    assert match.note.startswith("unknown GPU 'NVIDIA H20': using ")
    assert "as an approximation" in match.note


def test_h100_pcie_does_not_match_the_sxm_entry_and_vice_versa() -> None:
    pcie = lookup_gpu("NVIDIA H100 PCIe")
    sxm = lookup_gpu("NVIDIA H100 80GB HBM3")
    assert pcie is not None and sxm is not None
    assert pcie.spec.sm_count == 114
    assert sxm.spec.sm_count == 132


@pytest.mark.reliability
def test_unknown_gpu_falls_back_by_compute_capability_and_sm_count_with_scaling() -> None:
    match = lookup_gpu("NVIDIA GeForce RTX 4090 D", sm_count=114, compute_capability=(8, 9))
    assert match is not None
    assert not match.exact
    assert match.note.startswith(
        "unknown GPU 'NVIDIA GeForce RTX 4090 D': using NVIDIA GeForce RTX 4090's figures "
        "as an approximation"
    )
    assert "114/128" in match.note
    assert match.spec.sm_count == 114
    assert match.spec.peak_flops.bf16 == pytest.approx(165.2e12 * 114 / 128)
    assert match.spec.memory_bandwidth_bytes_per_s == 1008e9


@pytest.mark.reliability
def test_unknown_gpu_of_a_newer_minor_uses_the_same_major() -> None:
    match = lookup_gpu("NVIDIA B300 SXM6 AC", sm_count=148, compute_capability=(10, 3))
    assert match is not None
    assert match.spec.key == "b200"
    assert "same major compute capability 10.x" in match.note


@pytest.mark.reliability
def test_unknown_gpu_of_an_unknown_architecture_uses_the_nearest_compute_capability() -> None:
    match = lookup_gpu("NVIDIA T4", sm_count=40, compute_capability=(7, 5))
    assert match is not None
    assert match.spec.compute_capability == (8, 0)
    assert "nearest compute capability to 7.5" in match.note


def test_no_information_gives_the_conservative_generic_entry() -> None:
    match = lookup_gpu("Mystery Accelerator")
    assert match is not None
    assert not match.exact
    assert match.spec.key == "generic"
    assert match.note.startswith("unknown GPU 'Mystery Accelerator' and no compute capability")
    smallest_bf16 = min(g.peak_flops.bf16 for g in load_hardware_table())
    assert match.spec.peak_flops.bf16 <= smallest_bf16


def test_mig_slice_scales_compute_and_bandwidth() -> None:
    match = lookup_gpu("NVIDIA A100-SXM4-40GB MIG 1g.5gb", sm_count=14)
    assert match is not None
    assert not match.exact
    assert match.spec.peak_flops.bf16 == pytest.approx(312e12 * 14 / 108)
    assert match.spec.memory_bandwidth_bytes_per_s == pytest.approx(1.555e12 * 14 / 108)
    assert "reports 14 SMs" in match.note


@pytest.mark.parametrize("name", ["cpu", "CPU", "  cpu  ", "cpu (x86_64)"])
def test_cpu_has_no_entry(name: str) -> None:
    assert lookup_gpu(name) is None


def test_load_hardware_table_returns_a_fresh_list() -> None:
    first = load_hardware_table()
    first.clear()
    assert len(load_hardware_table()) >= 14


# ------------------------------------------------------------------------- peaks, roofline


def test_peak_flops_by_dtype_and_unit() -> None:
    h100 = _spec("h100-sxm")
    assert peak_flops(h100, "bf16", tensor_cores=True) == 989.4e12
    assert peak_flops(h100, "torch.bfloat16", tensor_cores=True) == 989.4e12
    assert peak_flops(h100, "float16", tensor_cores=True) == 989.4e12
    assert peak_flops(h100, "tf32", tensor_cores=True) == 494.7e12
    assert peak_flops(h100, "fp32", tensor_cores=True) == 494.7e12  # fp32 GEMM with TF32
    assert peak_flops(h100, "fp32", tensor_cores=False) == 66.9e12
    assert peak_flops(h100, "bf16", tensor_cores=False) == 66.9e12  # lower bound, see docstring
    assert peak_flops(h100, "float8_e4m3fn", tensor_cores=True) == 1978.9e12


def test_peak_flops_rejects_what_does_not_exist() -> None:
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        peak_flops(_spec("a100-sxm4-80gb"), "fp8", tensor_cores=True)
    with pytest.raises(ValueError, match="only on tensor cores"):
        peak_flops(_spec("h200"), "fp8", tensor_cores=False)
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        peak_flops(_spec("h200"), "int4", tensor_cores=True)


def test_ridge_point() -> None:
    # 989.4 TFLOP/s / 3.35 TB/s and / 4.8 TB/s
    assert ridge_point(_spec("h100-sxm"), "bf16") == pytest.approx(295.343, rel=1e-5)
    assert ridge_point(_spec("h200"), "bf16") == pytest.approx(206.125, rel=1e-6)
    assert ridge_point(_spec("h200"), "fp32", tensor_cores=False) == pytest.approx(13.9375)


def test_roofline_compute_bound_gemm_by_hand() -> None:
    # 4096^3 bf16 GEMM on an A100 SXM4 80GB in 0.5 ms:
    # FLOP 2*4096^3 = 137438953472; bytes 3*4096*4096*2 = 100663296; AI = 1365.33 > 153.02
    point = roofline(_spec("a100-sxm4-80gb"), "bf16", 137438953472, 100663296, 0.5e-3)
    assert point.bound == "compute"
    assert point.arithmetic_intensity == pytest.approx(1365.3333, rel=1e-6)
    assert point.ridge_point == pytest.approx(153.0162, rel=1e-6)
    assert point.achieved_flops == pytest.approx(2.74877906944e14)
    assert point.pct_of_peak_flops == pytest.approx(88.1019, rel=1e-5)
    assert point.achieved_bytes_per_s == pytest.approx(2.01326592e11)
    assert point.pct_of_peak_bw == pytest.approx(9.87379, rel=1e-5)
    assert point.roofline_seconds == pytest.approx(4.405095e-4, rel=1e-6)
    assert point.pct_of_roofline == pytest.approx(88.1019, rel=1e-5)


def test_roofline_memory_bound_elementwise_by_hand() -> None:
    # fp32 add of 1e8 elements on an H200 in 0.3 ms: 1e8 FLOP, 1.2e9 bytes, 4 TB/s achieved
    point = roofline(_spec("h200"), "fp32", 1e8, 1.2e9, 3e-4, tensor_cores=False)
    assert point.bound == "memory"
    assert point.arithmetic_intensity == pytest.approx(1 / 12)
    assert point.achieved_bytes_per_s == pytest.approx(4e12)
    assert point.pct_of_peak_bw == pytest.approx(83.3333, rel=1e-5)
    assert point.roofline_seconds == pytest.approx(2.5e-4)
    assert point.pct_of_roofline == pytest.approx(83.3333, rel=1e-5)


def test_roofline_edges() -> None:
    h200 = _spec("h200")
    no_bytes = roofline(h200, "bf16", 1e9, 0, 1e-3)
    assert no_bytes.arithmetic_intensity is None
    assert no_bytes.bound == "compute"
    copy = roofline(h200, "bf16", 0, 1e9, 1e-3)
    assert copy.bound == "memory"
    with pytest.raises(ValueError, match="positive finite"):
        roofline(h200, "bf16", 1e9, 1e9, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        roofline(h200, "bf16", -1, 1e9, 1e-3)


def test_tile_multiples() -> None:
    h100 = _spec("h100-sxm")
    assert tile_multiple(h100, "bf16") == 8
    assert tile_multiple(h100, "bf16", preferred=True) == 64
    assert tile_multiple(h100, "fp32") == 4
    assert tile_multiple(h100, "fp8", preferred=True) == 128
    assert h100.tensor_core_tile.m_tile_rows == 64
    assert tile_multiple(_spec("a100-sxm4-40gb"), "fp8") is None


# --------------------------------------------------------------------- the table's numbers

# Well-known 2:4-sparsity BF16 figures that must never appear as a dense peak.
SPARSE_BF16 = {
    "h100-sxm": 1979e12,
    "h100-pcie": 1513e12,
    "h200": 1979e12,
    "b200": 4.5e15,
    "a100-pcie-80gb": 624e12,
    "a100-pcie-40gb": 624e12,
    "a100-sxm4-80gb": 624e12,
    "a100-sxm4-40gb": 624e12,
    "l40s": 733e12,
    "l4": 242e12,
    "rtx-4090": 330.3e12,
    "rtx-pro-6000-blackwell": 1000e12,
}

# Dense FP16/BF16 tensor FLOP per clock per SM (FP32 accumulate) and FP32 lanes per SM.
DENSE_BF16_PER_SM_CLOCK = {
    (8, 0): 2048,
    (8, 6): 1024,
    (8, 9): 1024,
    (9, 0): 4096,
    (10, 0): 8192,
    (12, 0): 1024,
}
FP32_LANES_PER_SM = {(8, 0): 64, (8, 6): 128, (8, 9): 128, (9, 0): 128, (10, 0): 128, (12, 0): 128}


def test_every_entry_orders_its_peaks_and_is_dense() -> None:
    for gpu in load_hardware_table():
        pf = gpu.peak_flops
        assert pf.basis == "dense"
        assert pf.bf16 >= pf.tf32 >= pf.fp32, gpu.key
        assert pf.fp16 == pf.bf16, gpu.key
        if gpu.key in SPARSE_BF16:
            assert abs(pf.bf16 - SPARSE_BF16[gpu.key]) > 0.01 * SPARSE_BF16[gpu.key], gpu.key


def test_every_peak_fits_its_architectures_per_sm_rate() -> None:
    # A sparse figure is twice the dense one, so it would exceed the per-SM dense ceiling.
    for gpu in load_hardware_table():
        cycles = gpu.sm_count * gpu.boost_clock_hz
        ceiling = DENSE_BF16_PER_SM_CLOCK[gpu.compute_capability] * cycles
        assert gpu.peak_flops.bf16 <= 1.01 * ceiling, gpu.key
        assert gpu.peak_flops.bf16 >= 0.45 * ceiling, gpu.key
        fp32 = FP32_LANES_PER_SM[gpu.compute_capability] * 2 * cycles
        assert gpu.peak_flops.fp32 == pytest.approx(fp32, rel=0.03), gpu.key


def test_key_figures_quoted_in_the_brief() -> None:
    h100, h200 = _spec("h100-sxm"), _spec("h200")
    assert (h100.sm_count, h100.memory_bandwidth_bytes_per_s, h100.l2_bytes) == (
        132,
        3.35e12,
        50 * 2**20,
    )
    assert h200.peak_flops == h100.peak_flops
    assert (h200.sm_count, h200.memory_bandwidth_bytes_per_s) == (132, 4.8e12)
    assert h200.memory_bytes == 141 * 2**30
    a100 = _spec("a100-sxm4-40gb")
    assert (a100.peak_flops.bf16, a100.peak_flops.tf32, a100.peak_flops.fp32) == (
        312e12,
        156e12,
        19.5e12,
    )
    assert _spec("a100-sxm4-80gb").memory_bandwidth_bytes_per_s == 2.039e12
    assert a100.memory_bandwidth_bytes_per_s == 1.555e12


def test_every_entry_names_its_sources() -> None:
    for gpu in [*load_hardware_table(), knowledge.generic_gpu()]:
        assert gpu.source, gpu.key
        for ref in gpu.source:
            assert ref.url.startswith("https://"), gpu.key
            assert ref.table.strip(), gpu.key
        if gpu.key != "generic":
            assert gpu.name_patterns, gpu.key


def test_a_table_that_mixes_sparse_into_dense_is_rejected() -> None:
    with pytest.raises(ValidationError, match="bf16 >= tf32 >= fp32"):
        PeakFlops(basis="dense", bf16=312e12, fp16=312e12, tf32=624e12, fp32=19.5e12)


def test_the_hardware_table_has_one_copy_the_one_the_code_reads() -> None:
    shipped = (ROOT / "pytest_opprof" / "data" / "hardware.json").read_bytes()
    assert knowledge.hardware_json_text().encode("utf-8") == shipped
    assert not (KNOWLEDGE / "hardware.json").exists()  # the page is rendered from this one


def test_no_init_in_the_data_folder() -> None:
    assert not (ROOT / "pytest_opprof" / "data" / "__init__.py").exists()


def _load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "render_hardware", KNOWLEDGE / "render_hardware.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hardware_md_is_up_to_date() -> None:
    renderer = _load_renderer()
    table = json.loads((ROOT / "pytest_opprof" / "data" / "hardware.json").read_text("utf-8"))
    expected = renderer.render(table)
    assert (KNOWLEDGE / "hardware.md").read_text(encoding="utf-8") == expected, (
        "knowledge/hardware.md is stale: run python knowledge/render_hardware.py"
    )
    assert "| NVIDIA H200 SXM 141GB" not in expected  # names are links in the summary
    assert "[NVIDIA H200 SXM 141GB](#h200) | 9.0 | 132 | 1980 | 989.4 |" in expected


# ------------------------------------------------------------------ pages agree with code


def _table(page: Path, header_start: str) -> list[list[str]]:
    """Rows of the Markdown table whose header row starts with ``header_start``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_thresholds_table_matches_code() -> None:
    rows = _table(KNOWLEDGE / "bottlenecks.md", "| threshold | value |")
    documented = {row[0].strip("`"): float(row[1]) for row in rows}
    assert set(documented) == set(threshold_names())
    for name, value in documented.items():
        assert getattr(THRESHOLDS, name) == pytest.approx(value), name


def test_edge_case_penalty_table_matches_code() -> None:
    rows = _table(KNOWLEDGE / "edge-cases.md", "| flag | penalty |")
    documented = {row[0].strip("`"): float(row[1]) for row in rows}
    assert documented == EDGE_CASE_PENALTIES
    for row in rows:
        flag, scope = row[0].strip("`"), row[2]
        expected = EDGE_CASE_APPLIES_TO[flag]
        if scope == "all":
            assert expected is None, flag
        else:
            assert expected == frozenset(s.strip() for s in scope.split(",")), flag


def test_confidence_levels_table_matches_code() -> None:
    rows = _table(KNOWLEDGE / "edge-cases.md", "| level | minimum score |")
    assert {row[0]: float(row[1]) for row in rows} == CONFIDENCE_LEVELS


def test_every_page_of_the_index_exists() -> None:
    readme = (KNOWLEDGE / "README.md").read_text(encoding="utf-8")
    for page in [
        "hardware.md",
        "bottlenecks.md",
        "fx-patterns.md",
        "edge-cases.md",
        "capture-errors.md",
        "validation-failures.md",
        "schema-versions.md",
    ]:
        assert f"]({page})" in readme
        assert (KNOWLEDGE / page).is_file()


def test_fx_patterns_use_only_the_transformation_vocabulary() -> None:
    text = (KNOWLEDGE / "fx-patterns.md").read_text(encoding="utf-8")
    from pytest_opprof.options import TRANSFORMATION_TYPES

    for word in TRANSFORMATION_TYPES:
        assert f"`{word}`" in text, word


# ------------------------------------------------------------- confidence and kernel names


def test_penalties_apply_by_scope_once_per_flag() -> None:
    flags = ["graph_breaks", "dynamic_shapes", "not_a_flag", "graph_breaks"]
    score, applied = apply_edge_case_penalties(0.9, flags, "cuda_graphs")
    assert score == pytest.approx(0.45)
    assert applied == ["graph_breaks", "dynamic_shapes"]
    assert confidence_level(score) == "medium"
    assert apply_edge_case_penalties(0.9, flags, "dtype_promotion") == (0.9, [])
    floor, _ = apply_edge_case_penalties(0.2, ["cuda_graph_replay"], "qkv_fusion")
    assert floor == 0.0
    assert (confidence_level(0.75), confidence_level(0.7449), confidence_level(0.1)) == (
        "high",
        "medium",
        "low",
    )


@pytest.mark.parametrize(
    "name",
    [
        "ampere_sgemm_128x64_tn",
        "volta_sgemm_64x32_sliced1x4_nn",
        "cutlass_80_simt_sgemm_128x128_8x4_nn_align1",
        "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_warpgroupsize1x1x1_execute_kernel",
        "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>",
        "gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false>",
    ],
)
def test_simt_fp32_gemm_names(name: str) -> None:
    assert is_simt_fp32_gemm(name)
    assert not is_tensor_core_kernel(name)


@pytest.mark.parametrize(
    "name",
    [
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        "sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x16_stage4_warpsize2x2x1",
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>",
    ],
)
def test_tensor_core_names(name: str) -> None:
    assert is_tensor_core_kernel(name)
    assert not is_simt_fp32_gemm(name)


def test_layout_conversion_names() -> None:
    assert is_layout_conversion("void cudnn::ops::nchwToNhwcKernel<float, float, float, false>")
    assert is_layout_conversion("void at::native::elementwise_kernel<128, 2>(copy_kernel)")
    assert not is_layout_conversion("ampere_sgemm_128x64_tn")


def test_importing_knowledge_imports_no_torch() -> None:
    code = (
        "import sys, pytest_opprof.knowledge as k; k.load_hardware_table(); "
        "sys.exit('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_the_schema_page_names_each_artifacts_current_version() -> None:
    """knowledge/schema-versions.md had gone stale by two minor versions of Profile."""
    from pytest_opprof import schema

    text = (KNOWLEDGE / "schema-versions.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `[^`]+` \| `(\w+)` \| ([\d.]+) \|", text, flags=re.M)
    assert rows
    for model, version in rows:
        assert version == getattr(schema, model).SCHEMA_VERSION, model
    assert f"`BackendSelection`,\n{schema.BackendSelection.SCHEMA_VERSION}" in text
