"""What selection writes for a timed rung (``backend.selection.timed_rung``): latencies measured,
the paired ratio measured and dividing out of them, the speedup over the reference chained."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_opprof.backend.selection import timed_rung
from pytest_opprof.measure import paired_gain
from pytest_opprof.schema import (
    BackendPlan,
    BackendSelection,
    LatencyStats,
    Speedup,
    VariantResult,
    WaterfallStep,
    read_artifact,
    write_artifact,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "report"


def _gpt2_first_rung() -> dict[str, list[float]]:
    """Shaped like gpt2's first rung on the H200 (tests/data/h200/gpt2): the whole-model CUDA graph
    at about 2.875 ms per call, torch.compile at about 4.401 ms in the same rounds, though the
    reference had timed 3.297 ms in its run with eager; the last round on a slowed host."""
    return {
        "current": [4.39, 4.40, 4.401, 4.402, 4.41, 4.38, 4.42, 4.395, 4.405, 9.0],
        "candidate": [2.87, 2.88, 2.875, 2.86, 2.89, 2.874, 2.876, 2.865, 2.885, 1.0],
    }


REFERENCE = WaterfallStep(
    step="compile", latency_ms=3.297, speedup_cumulative=1.0, speedup_added=1.0, measured_ms=3.297
)


def _first_rung() -> tuple[Speedup, LatencyStats, VariantResult, WaterfallStep]:
    samples = _gpt2_first_rung()
    host_us = [1.2] * 9 + [3.0]
    gain, cand, below = paired_gain(samples, {"current": 50, "candidate": 50}, host_us, *samples)
    assert cand.set_aside == below.set_aside == [9]
    variant, step = timed_rung(
        "cuda_graphs-model",
        BackendPlan(proposals=["cuda_graphs-model"]),
        gain,
        cand,
        label="+cuda_graphs_model (cuda_graphs-model)",
        below_name="compile",
        below_latency=below,
        below_step=REFERENCE,
    )
    return gain, cand, variant, step


def test_timed_rung_latencies_are_measured_and_the_speedup_chained() -> None:
    gain, cand, variant, step = _first_rung()
    # measured: the rung's own median, and the plan below's over the same rounds
    assert variant.latency == cand
    assert step.measured_ms == cand.median_ms == pytest.approx(2.875)
    assert step.paired_baseline_ms == variant.paired_baseline_ms == pytest.approx(4.401)
    assert step.paired_baseline_ms is not None and step.measured_ms is not None
    assert step.paired_baseline_ms / step.measured_ms == pytest.approx(gain.ratio, rel=1e-12)
    assert step.paired is not None and step.paired == variant.paired
    assert (step.paired.baseline, step.paired.candidate) == ("compile", "cuda_graphs-model")
    assert (step.paired.ci_low, step.paired.ci_high) == (gain.ci_low, gain.ci_high)
    assert step.speedup_added == gain.ratio and step.step.startswith("+cuda_graphs_model")
    # chained from the reference: 1.53x, not 3.297 / 2.875 = 1.15x across two runs; the
    # chained latency it implies (2.154 ms) is kept apart from the measured one
    assert variant.speedup == step.speedup_cumulative == pytest.approx(4.401 / 2.875, rel=1e-3)
    assert step.latency_ms == pytest.approx(3.297 / step.speedup_cumulative)
    assert step.latency_ms != pytest.approx(step.measured_ms, rel=0.1)


def test_a_later_rung_chains_onto_the_plan_below() -> None:
    _, _, _, first = _first_rung()
    samples = {"current": [2.874] * 5, "candidate": [0.624] * 5}
    gain, cand, below = paired_gain(samples, {"current": 50, "candidate": 50}, [1.2] * 5, *samples)
    variant, step = timed_rung(
        "cuda_graphs-model+dtype_promotion-1",
        BackendPlan(proposals=["cuda_graphs-model", "dtype_promotion-1"]),
        gain,
        cand,
        label="+dtype_promotion (dtype_promotion-1)",
        below_name="cuda_graphs-model",
        below_latency=below,
        below_step=first,
    )
    assert step.measured_ms == pytest.approx(0.624)
    assert step.speedup_added == pytest.approx(2.874 / 0.624)
    assert step.speedup_cumulative == pytest.approx(first.speedup_cumulative * 2.874 / 0.624)
    assert step.latency_ms == pytest.approx(3.297 / step.speedup_cumulative)
    assert variant.paired is not None and variant.paired.baseline == "cuda_graphs-model"


def test_selection_written_now_reads_back_and_one_written_before_still_loads(
    tmp_path: Path,
) -> None:
    _, _, variant, step = _first_rung()
    selection = BackendSelection(
        workload="gpt2",
        reference="compile",
        reference_ms=3.297,
        variants=[variant],
        chosen=variant.name,
        plan=variant.plan,
        waterfall=[REFERENCE, step],
    )
    path = write_artifact(tmp_path / "backend_selection.json", selection)
    back = read_artifact(path, BackendSelection)
    assert back.schema_version == BackendSelection.SCHEMA_VERSION == "1.5"
    assert back.waterfall[1] == step and back.variants[0] == variant
    old = read_artifact(
        DATA / "conv_block" / "profiler_output" / "backend_selection.json", BackendSelection
    )
    assert old.schema_version == "1.0"
    assert all(s.measured_ms is None and s.paired is None for s in old.waterfall)
