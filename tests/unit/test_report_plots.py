"""The roofline plot draws the profiled device's roofs from the hardware table — DRAM bandwidth,
the bf16/fp16 tensor-core and fp32 peaks — with their ridge points (issue #41); checked on the
figure's lines and labels, from gpt2's profile of the H200 run (tests/data/h200/gpt2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_opprof import knowledge
from pytest_opprof.report import WorkloadArtifacts, plots, render_workload_report
from pytest_opprof.schema import Profile, WorkloadSummary, read_artifact

pytest.importorskip("matplotlib", reason="plots are the optional [plots] extra")

GPT2 = Path(__file__).resolve().parents[1] / "data" / "h200" / "gpt2"


@pytest.fixture(scope="module")
def profile() -> Profile:
    return read_artifact(GPT2 / "profile.json.gz", Profile)


@pytest.fixture(scope="module")
def h200() -> knowledge.GpuSpec:
    match = knowledge.lookup_gpu("NVIDIA H200", 132, (9, 0))
    assert match is not None and match.exact
    return match.spec


def test_the_roofs_are_the_hardware_tables(profile: Profile, h200: knowledge.GpuSpec) -> None:
    roofs = plots.device_roofs(profile.capture_metadata)
    assert roofs is not None
    assert (roofs.device, roofs.note) == ("NVIDIA H200 SXM 141GB", "")
    assert roofs.bandwidth_bytes_per_s == h200.memory_bandwidth_bytes_per_s == 4.8e12
    assert [(r.label, r.flops_per_s) for r in roofs.compute] == [
        ("bf16/fp16 tensor", h200.peak_flops.bf16),
        ("fp32 CUDA cores", h200.peak_flops.fp32),
    ]
    bf16, fp32 = roofs.compute
    assert roofs.ridge(bf16) == pytest.approx(knowledge.ridge_point(h200, "bf16"))
    assert roofs.ridge(fp32) == pytest.approx(
        knowledge.ridge_point(h200, "fp32", tensor_cores=False)
    )


def test_no_roofs_on_the_cpu_and_approximate_ones_for_an_unknown_gpu(profile: Profile) -> None:
    meta = profile.capture_metadata
    cpu = meta.model_copy(update={"device_type": "cpu", "device_name": "cpu"})
    assert plots.device_roofs(cpu) is None
    unknown = meta.model_copy(update={"device_name": "NVIDIA H999", "sm_count": 132})
    roofs = plots.device_roofs(unknown)
    assert roofs is not None and "unknown GPU 'NVIDIA H999'" in roofs.note


def test_the_roofline_draws_each_roof_from_its_ridge(
    profile: Profile, h200: knowledge.GpuSpec
) -> None:
    roofs = plots.device_roofs(profile.capture_metadata)
    assert roofs is not None
    points = plots.roofline_points(profile.timelines)
    assert points
    ax = plots.roofline_figure({"baseline": points}, roofs).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    bw = h200.memory_bandwidth_bytes_per_s
    tensor, cuda = h200.peak_flops.bf16, h200.peak_flops.fp32
    ridge_tensor, ridge_cuda = tensor / bw, cuda / bw
    assert set(lines) == {
        "DRAM 4.8 TB/s",
        "bf16/fp16 tensor 989.4 TFLOP/s (ridge 206 FLOP/B)",
        "fp32 CUDA cores 66.9 TFLOP/s (ridge 13.9 FLOP/B)",
        "_ridge bf16/fp16 tensor",
        "_ridge fp32 CUDA cores",
    }
    # the bandwidth roof: TFLOP/s = bytes/s × intensity, up to the highest ridge
    x, y = lines["DRAM 4.8 TB/s"].get_data()
    assert list(y) == pytest.approx([bw * v / 1e12 for v in x])
    assert x[0] <= min(p.intensity for p in points) and x[-1] == pytest.approx(ridge_tensor)
    # each compute roof: flat at its peak from its ridge point on
    for label, peak, ridge in (
        ("bf16/fp16 tensor 989.4 TFLOP/s (ridge 206 FLOP/B)", tensor, ridge_tensor),
        ("fp32 CUDA cores 66.9 TFLOP/s (ridge 13.9 FLOP/B)", cuda, ridge_cuda),
    ):
        x, y = lines[label].get_data()
        assert x[0] == pytest.approx(ridge) and list(y) == pytest.approx([peak / 1e12] * 2)
        assert x[-1] >= max(p.intensity for p in points)
    for name, peak, ridge in (
        ("bf16/fp16 tensor", tensor, ridge_tensor),
        ("fp32 CUDA cores", cuda, ridge_cuda),
    ):
        x, y = lines[f"_ridge {name}"].get_data()
        assert list(x) == pytest.approx([ridge]) and list(y) == pytest.approx([peak / 1e12])
    assert [t.get_text() for t in ax.texts] == ["ridge 206", "ridge 13.9"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "baseline kernels" and "DRAM 4.8 TB/s" in legend
    assert not any(t.startswith("_") for t in legend)
    assert "NVIDIA H200 SXM 141GB" in ax.get_title()


def test_distinct_peaks_get_a_roof_each(profile: Profile) -> None:
    compute = (
        plots.Roof("bf16 tensor", 4e14),
        plots.Roof("fp16 tensor", 2e14),
        plots.Roof("fp32", 5e13),
    )
    roofs = plots.DeviceRoofs("a GPU", 1e12, compute)
    points = plots.roofline_points(profile.timelines)
    ax = plots.roofline_figure({"baseline": points}, roofs).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    starts = {k: v.get_xdata()[0] for k, v in lines.items() if not k.startswith(("_", "DRAM"))}
    assert starts == pytest.approx(
        {
            "bf16 tensor 400 TFLOP/s (ridge 400 FLOP/B)": 400,
            "fp16 tensor 200 TFLOP/s (ridge 200 FLOP/B)": 200,
            "fp32 50 TFLOP/s (ridge 50 FLOP/B)": 50,
        }
    )
    assert lines["DRAM 1 TB/s"].get_xdata()[-1] == pytest.approx(400)
    assert sorted(k for k in lines if k.startswith("_ridge")) == [
        "_ridge bf16 tensor",
        "_ridge fp16 tensor",
        "_ridge fp32",
    ]


def test_without_a_table_entry_only_the_kernels_are_drawn(profile: Profile) -> None:
    points = plots.roofline_points(profile.timelines)
    ax = plots.roofline_figure({"baseline": points}, None).axes[0]
    assert ax.get_lines() == [] and "kernels only" in ax.get_title()


def test_the_report_draws_the_roofline_under_the_profiled_devices_roofs(
    profile: Profile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[object] = []

    def roofline(path: Path, series: object, roofs: object) -> Path:
        got.append(roofs)
        return path

    monkeypatch.setattr(plots, "roofline", roofline)
    summary = WorkloadSummary(name="gpt2", path="gpt2.py", status="passed", stage="capture")
    a = WorkloadArtifacts(
        name="gpt2", path="gpt2.py", out_dir=tmp_path / "gpt2", summary=summary, profile=profile
    )
    text = render_workload_report(a, plots=True)
    assert got == [plots.device_roofs(profile.capture_metadata)]
    ops = " ".join(text[text.index("## Operator summary") :].split())
    assert (
        "Roofline roofs: NVIDIA H200 SXM 141GB from the hardware table (`data/hardware.json`): "
        "DRAM 4.8 TB/s; bf16/fp16 tensor 989.4 TFLOP/s (ridge 206 FLOP/B); fp32 CUDA cores "
        "66.9 TFLOP/s (ridge 13.9 FLOP/B)." in ops
    )
