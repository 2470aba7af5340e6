"""Attribution of the timeline trace: real torch 2.13 CPU traces, a synthetic CUDA trace in the
exact Kineto format, and any real H200 trace committed under ``tests/data/h200/``.

``tests/data/synthetic_cuda_trace.json`` holds two measured iterations of (per iteration):
``aten::linear ⊃ aten::addmm ⊃ cudaLaunchKernel → GEMM`` (twice), ``aten::relu ⊃
aten::clamp_min → clamp kernel``, an Inductor region with Triton launches under their
record functions (``triton_poi_fused_add_1`` and ``triton_poi_fused_add_10``, whose names are
prefixes of each other; ``triton_per_fused_softmax_4`` whose CUDA kernel is named ``triton_``;
``triton_poi_fused_mul_3`` with no provenance), a Triton launch straight from the wrapper
(``triton_red_fused_sum_2``), an extern ``aten::mm``, a ``cudaGraphLaunch`` replaying a Triton
and a CUTLASS kernel, an ``aten::add`` kernel on stream 20 overlapping stream 7, a memcpy and a
memset under ATen ops, and a 120 µs ``cudaStreamSynchronize``. Outside the window: a kernel
launched in the dropped warm step, one launched after the last mark, one with no launch record.

For ``tests/data/h200/<name>.trace.json[.gz]``, provenance is read from the sibling
``<name>.provenance.json`` (what ``collect_inductor_provenance()`` returned) when present.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.capture.attribution import TwinSite, build_timeline, replay_twin
from pytest_opprof.capture.trace import COMPILED_GRAPH_OPERATOR, ITERATION_MARK, load_trace
from pytest_opprof.errors import ArtifactError
from pytest_opprof.schema import EdgeCaseFlag, OperatorRecord, Timeline

DATA = Path(__file__).resolve().parents[1] / "data"
CPU = DATA / "cpu"
SYNTHETIC = DATA / "synthetic_cuda_trace.json"
PROVENANCE: dict[str, list[str]] = {
    "triton_poi_fused_add_1": ["aten::add"],
    "triton_poi_fused_add_10": ["aten::add", "aten::relu"],
    "triton_red_fused_sum_2": ["aten::sum"],
    "triton_per_fused_softmax_4": ["aten::_softmax"],
    "triton_poi_fused_relu_5": ["aten::relu"],
}
GEMM_PREFIX = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn"
CUTLASS_PREFIX = "void cutlass::device_kernel"


def synthetic(
    provenance: dict[str, list[str]] | None = None,
    trace: dict[str, Any] | None = None,
    twin: Any = None,
) -> tuple[Timeline, list[EdgeCaseFlag]]:
    return build_timeline(
        trace if trace is not None else load_trace(SYNTHETIC),
        label="eager",
        compile_mode="default",
        device_type="cuda",
        provenance=PROVENANCE if provenance is None else provenance,
        trace_file=SYNTHETIC.name,
        twin=twin,
    )


def cpu_trace(variant: str, *, provenance: bool = True) -> tuple[Timeline, list[EdgeCaseFlag]]:
    path = CPU / f"{variant}.trace.json"
    sibling = CPU / f"{variant}.provenance.json"
    known = json.loads(sibling.read_text()) if provenance and sibling.exists() else None
    return build_timeline(
        load_trace(path), label=variant, compile_mode=variant, device_type="cpu", provenance=known
    )


def operator(timeline: Timeline, name: str, call_index: int = 0) -> OperatorRecord:
    found = [o for o in timeline.operators if (o.name, o.call_index) == (name, call_index)]
    assert len(found) == 1, [(o.name, o.call_index) for o in timeline.operators]
    return found[0]


def flag(flags: list[EdgeCaseFlag], name: str) -> EdgeCaseFlag:
    found = [f for f in flags if f.name == name]
    assert len(found) == 1, flags
    return found[0]


# ------------------------------------------------------------------------- synthetic CUDA


def test_kernel_belongs_to_outermost_aten_op_below_the_mark() -> None:
    timeline, _ = synthetic()
    linear = operator(timeline, "aten::linear")
    assert [k.name.startswith(GEMM_PREFIX) for k in linear.kernels] == [True]
    assert linear.kernels[0].attribution == "high"
    assert linear.kernels[0].grid == [2, 1, 1] and linear.kernels[0].block == [128, 1, 1]
    assert (linear.kernels[0].stream, linear.kernels[0].device) == (7, 0)
    assert linear.input_shapes[0] == [8, 64]
    names = {o.name for o in timeline.operators}
    assert "aten::addmm" not in names and "aten::clamp_min" not in names
    assert operator(timeline, "aten::relu").kernels[0].attribution == "high"


@pytest.mark.parametrize("cat", ["cpu_op", "user_annotation"])
def test_a_custom_operator_owns_its_kernels_as_an_aten_op_does(cat: str) -> None:
    """A ``torch.library`` operator (``opprof::tuned_mm`` calls cuBLASLt itself) is a
    ``cpu_op`` named ``namespace::name``: the outermost operator, its kernels ``high``. A
    ``record_function`` of the same shape is a ``user_annotation`` and owns nothing."""
    trace = load_trace(SYNTHETIC)
    first = next(e for e in trace["traceEvents"] if e.get("name") == "aten::linear")
    first["name"], first["cat"] = "mylib::fused_linear", cat
    timeline, _ = synthetic(trace=trace)
    names = [o.name for o in timeline.operators]
    if cat == "cpu_op":
        fused = operator(timeline, "mylib::fused_linear")
        assert [k.attribution for k in fused.kernels] == ["high"]
        assert fused.kernels[0].name.startswith(GEMM_PREFIX)
        assert names.count("aten::addmm") == 0
    else:
        assert "mylib::fused_linear" not in names
        addmm = operator(timeline, "aten::addmm")
        assert [k.attribution for k in addmm.kernels] == ["high"]
    assert timeline.summary.attributed_share == synthetic()[0].summary.attributed_share


def test_call_index_counts_per_name_within_one_iteration() -> None:
    timeline, _ = synthetic()
    indices = [(o.name, o.call_index) for o in timeline.operators if o.name.startswith("aten::")]
    assert indices == [
        ("aten::linear", 0),
        ("aten::relu", 0),
        ("aten::linear", 1),
        ("aten::mm", 0),
        ("aten::add", 0),
        ("aten::copy_", 0),
        ("aten::zero_", 0),
        ("aten::item", 0),
    ]
    assert operator(timeline, "aten::linear", 1).input_shapes[0] == [8, 128]


def test_times_are_means_over_iterations() -> None:
    timeline, _ = synthetic()
    # The GEMM of the first linear ran 40 then 44 µs, the clamp 4 then 6, the second GEMM 20, 22.
    assert operator(timeline, "aten::linear").gpu_time_us == 42.0
    assert operator(timeline, "aten::relu").kernels[0].duration_us == 5.0
    assert operator(timeline, "aten::linear", 1).gpu_time_us == 21.0
    assert operator(timeline, "aten::linear").cpu_time_us == 50.0
    assert operator(timeline, "aten::linear").kernels[0].start_us == 40.0


def test_triton_kernels_of_compiled_code_are_medium_with_their_fused_ops() -> None:
    timeline, _ = synthetic()
    add_1 = operator(timeline, "triton_poi_fused_add_1")
    add_10 = operator(timeline, "triton_poi_fused_add_10")
    assert add_1.fused_ops == ["aten::add"]
    assert add_10.fused_ops == ["aten::add", "aten::relu"]
    assert [k.name for k in add_1.kernels] == ["triton_poi_fused_add_1"]
    assert [k.name for k in add_10.kernels] == ["triton_poi_fused_add_10"]
    assert add_1.kernels[0].attribution == add_10.kernels[0].attribution == "medium"
    assert add_10.kernels[0].fused_ops == ["aten::add", "aten::relu"]
    assert add_1.cpu_time_us == 8.0  # the launcher's record function
    # Launched straight from the wrapper, no record function: the cuLaunchKernel's 4 µs.
    assert operator(timeline, "triton_red_fused_sum_2").cpu_time_us == 4.0


@pytest.mark.parametrize(
    ("known", "medium", "unattributed"),
    [
        ({"triton_poi_fused_add_1": ["aten::add"]}, "triton_poi_fused_add_1", "_add_10"),
        ({"triton_poi_fused_add_10": ["aten::add"]}, "triton_poi_fused_add_10", "_add_1"),
    ],
)
def test_provenance_matches_exact_names_only(
    known: dict[str, list[str]], medium: str, unattributed: str
) -> None:
    timeline, _ = synthetic(known)
    assert [o.name for o in timeline.operators if o.fused_ops] == [medium]
    leftover = [k.name for k in timeline.unattributed_kernels]
    assert f"triton_poi_fused{unattributed}" in leftover
    assert medium not in leftover


def test_record_function_name_places_a_kernel_whose_cuda_name_differs() -> None:
    timeline, _ = synthetic()
    softmax = operator(timeline, "triton_per_fused_softmax_4")
    assert [k.name for k in softmax.kernels] == ["triton_"]
    assert softmax.fused_ops == ["aten::_softmax"]


def test_extern_kernel_of_compiled_code_is_high_through_its_aten_op() -> None:
    timeline, _ = synthetic()
    mm = operator(timeline, "aten::mm")
    assert mm.gpu_time_us == 30.0
    assert mm.kernels[0].attribution == "high"


def test_cuda_graph_replay_uses_provenance_and_is_flagged() -> None:
    timeline, flags = synthetic()
    relu = operator(timeline, "triton_poi_fused_relu_5")
    assert relu.kernels[0].attribution == "medium" and relu.cpu_time_us == 0.0
    assert any(k.name.startswith(CUTLASS_PREFIX) for k in timeline.unattributed_kernels)
    detail = flag(flags, "cuda_graph_replay").detail
    assert "1 graph launches per iteration replay 2 kernels" in detail
    assert "1 placed through Inductor provenance, 1 unattributed" in detail


def _cutlass_name(timeline: Timeline) -> str:
    return next(k.name for k in timeline.unattributed_kernels if k.name.startswith(CUTLASS_PREFIX))


def test_cuda_graph_replay_placed_by_the_uncaptured_twin() -> None:
    plain, _ = synthetic()
    gemm = _cutlass_name(plain)
    timeline, flags = synthetic(twin={gemm: [TwinSite("aten::mm", 1, ("aten::mm",))]})
    # Only the launch with no provenance (not a replay) stays unattributed.
    assert [k.name for k in timeline.unattributed_kernels] == ["triton_poi_fused_mul_3"]
    placed = [o for o in timeline.operators if o.kernels and o.kernels[0].name == gemm]
    assert len(placed) == 1 and placed[0].name == "aten::mm"
    assert placed[0].kernels[0].attribution == "medium" and placed[0].fused_ops == ["aten::mm"]
    assert placed[0].cpu_time_us == 0.0 and placed[0].gpu_time_us == 15.0
    assert timeline.summary.attributed_share > plain.summary.attributed_share
    detail = flag(flags, "cuda_graph_replay").detail
    assert "2 placed through Inductor provenance or the uncaptured twin, 0 unattributed" in detail


def test_twin_with_a_different_count_is_not_joined_but_flagged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain, _ = synthetic()
    gemm = _cutlass_name(plain)
    site = TwinSite("aten::mm", 0, ("aten::mm",))
    with caplog.at_level(logging.WARNING):
        timeline, flags = synthetic(twin={gemm: [site, site]})
    assert gemm in [k.name for k in timeline.unattributed_kernels]
    detail = flag(flags, "cuda_graph_replay").detail
    assert "not joined to the twin" in detail and "(1 replayed, 2 in the twin)" in detail
    assert "not joined to the uncaptured twin" in caplog.text


def test_replay_twin_lists_each_name_in_launch_order() -> None:
    timeline, _ = synthetic()
    twin = replay_twin(timeline)
    gemms = [n for n in twin if n.startswith(GEMM_PREFIX)]
    assert gemms
    sites = twin[gemms[0]]
    assert [s.operator if s else None for s in sites] == ["aten::linear"] * len(sites)
    assert [s.call_index for s in sites if s] == list(range(len(sites)))
    # The unattributed replay keeps its place, as None, so later ordinals do not shift.
    assert twin[_cutlass_name(timeline)] == [None]
    triton = twin["triton_poi_fused_add_10"]
    assert triton[0] is not None and triton[0].fused_ops == ("aten::add", "aten::relu")


def test_memcpy_and_memset_are_attributed_like_kernels() -> None:
    timeline, _ = synthetic()
    assert [k.name for k in operator(timeline, "aten::copy_").kernels] == [
        "Memcpy DtoD (Device -> Device)"
    ]
    assert operator(timeline, "aten::zero_").kernels[0].name == "Memset (Device)"
    assert operator(timeline, "aten::item").gpu_time_us == 2.0


def test_no_kernel_outside_the_measured_window(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="pytest_opprof.capture.attribution"):
        timeline, _ = synthetic()
    assert timeline.summary.kernels_per_iter == 15.0
    every = [k for o in timeline.operators for k in o.kernels] + timeline.unattributed_kernels
    assert len(every) == 15
    assert all(k.correlation is not None and 100 < k.correlation < 300 for k in every)
    assert "orphan" not in " ".join(k.name for k in every)
    assert "'no launch record': 1" in caplog.text
    assert "'launched outside the measured window': 2" in caplog.text


def test_unattributed_kernels_keep_their_time() -> None:
    timeline, flags = synthetic()
    names = [k.name for k in timeline.unattributed_kernels]
    assert names[0] == "triton_poi_fused_mul_3" and names[1].startswith(CUTLASS_PREFIX)
    assert [k.duration_us for k in timeline.unattributed_kernels] == [5.0, 15.0]
    assert all(k.attribution == "none" for k in timeline.unattributed_kernels)
    detail = flag(flags, "high_unattributed_share").detail
    assert detail.startswith("11.8% of kernel time (20.0 µs per iteration)")


def test_every_kernel_microsecond_is_accounted() -> None:
    timeline, _ = synthetic()
    operators = sum(o.gpu_time_us for o in timeline.operators)
    leftover = sum(k.duration_us for k in timeline.unattributed_kernels)
    assert operators + leftover == pytest.approx(timeline.summary.device_time_per_iter_us)


def test_summary_figures() -> None:
    summary = synthetic()[0].summary
    assert summary.iterations == 2
    assert summary.device_time_per_iter_us == 169.0  # (165 + 173) / 2
    assert summary.wall_time_per_iter_us == 500.0
    assert summary.idle_time_per_iter_us == 170.0  # (174 + 166) / 2, union of both streams
    assert summary.launch_overhead_per_call_us == 4.1  # 10 launches, not the graph launch
    assert summary.high_share == pytest.approx(252 / 338, abs=1e-6)
    assert summary.attributed_share == pytest.approx(298 / 338, abs=1e-6)


def test_multi_stream_overlap_and_host_sync_are_flagged() -> None:
    _, flags = synthetic()
    assert (
        "2 streams run at once for 16.0 µs per iteration"
        in flag(flags, "multi_stream_overlap").detail
    )
    stall = flag(flags, "host_sync_stalls").detail
    assert "1 host synchronizations over 50 µs per iteration" in stall
    assert "cudaStreamSynchronize 120.0 µs" in stall
    assert not [f for f in flags if f.name in ("graph_breaks", "dynamic_shapes")]


def test_aggregates_sorted_by_gpu_time() -> None:
    timeline, _ = synthetic()
    top = timeline.aggregated[0]
    assert (top.name, top.calls, top.gpu_time_us, top.kernel_count) == ("aten::linear", 2, 63.0, 2)
    assert top.share == pytest.approx(63 / 169, abs=1e-6)
    assert len(top.kernel_names) == 1 and top.kernel_names[0].startswith(GEMM_PREFIX)
    gpu = [a.gpu_time_us for a in timeline.aggregated]
    assert gpu == sorted(gpu, reverse=True)
    assert {a.name for a in timeline.aggregated} == {o.name for o in timeline.operators}


def test_without_provenance_triton_kernels_stay_unattributed() -> None:
    timeline, _ = synthetic({})
    assert not [o for o in timeline.operators if o.fused_ops]
    assert timeline.summary.attributed_share == timeline.summary.high_share
    assert "triton_poi_fused_add_1" in {k.name for k in timeline.unattributed_kernels}


def test_result_does_not_depend_on_event_order() -> None:
    trace = load_trace(SYNTHETIC)
    shuffled = copy.deepcopy(trace)
    random.Random(7).shuffle(shuffled["traceEvents"])
    first, flags = synthetic(trace=trace)
    second, flags_again = synthetic(trace=shuffled)
    assert first.model_dump_json() == second.model_dump_json()
    assert flags == flags_again
    assert Timeline.model_validate_json(first.model_dump_json()) == first


def test_launch_on_another_thread_is_placed_by_external_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = load_trace(SYNTHETIC)
    for event in trace["traceEvents"]:  # move the first linear's launches off the main thread
        if event.get("name") == "cudaLaunchKernel" and event["args"]["correlation"] in (101, 201):
            event["tid"] = 9999
    with caplog.at_level(logging.DEBUG, logger="pytest_opprof.capture.attribution"):
        timeline, _ = synthetic(trace=trace)
    assert operator(timeline, "aten::linear").kernels[0].attribution == "high"
    assert "'placed by External id': 2" in caplog.text


def test_large_trace_is_fast() -> None:
    base = load_trace(SYNTHETIC)
    measured = [
        e
        for e in base["traceEvents"]
        if e.get("ph") == "X" and 1_790_000_000_000 - 10 <= e["ts"] < 1_790_000_001_000 - 10
    ]
    events: list[dict[str, Any]] = []
    copies = 100_000 // len(measured) + 1
    for n in range(copies):
        for event in measured:
            clone = dict(event, ts=event["ts"] + n * 1000)
            args = dict(clone.get("args", {}))
            if "correlation" in args:
                args["correlation"] += n * 1000
            clone["args"] = args
            if clone["name"].startswith(ITERATION_MARK):
                clone["name"] = f"{ITERATION_MARK}#{n}"
            events.append(clone)
    start = time.perf_counter()
    timeline, _ = synthetic(trace={"traceEvents": events})
    elapsed = time.perf_counter() - start
    assert len(events) >= 100_000
    assert timeline.summary.iterations == copies
    assert timeline.summary.kernels_per_iter == 15.0
    assert elapsed < 20, f"{len(events)} events took {elapsed:.1f} s"


def test_trace_without_marks_is_refused() -> None:
    trace = load_trace(SYNTHETIC)
    trace["traceEvents"] = [
        e for e in trace["traceEvents"] if not str(e.get("name", "")).startswith(ITERATION_MARK)
    ]
    with pytest.raises(ArtifactError, match="no 'opprof::iteration#<i>' marks"):
        synthetic(trace=trace)


def test_load_trace_reads_gzip_and_refuses_garbage(tmp_path: Path) -> None:
    packed = tmp_path / "t.trace.json.gz"
    packed.write_bytes(gzip.compress(SYNTHETIC.read_bytes()))
    assert load_trace(packed) == load_trace(SYNTHETIC)
    broken = tmp_path / "broken.trace.json"
    broken.write_text('{"traceEvents": [')
    with pytest.raises(ArtifactError, match=r"broken\.trace\.json: not a readable Chrome trace"):
        load_trace(broken)
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ArtifactError, match="no 'traceEvents' list"):
        load_trace(other)


# ------------------------------------------------------------------------- real CPU traces


def test_cpu_eager_operators_are_the_outermost_aten_ops() -> None:
    timeline, flags = cpu_trace("eager")
    assert [(o.name, o.call_index) for o in timeline.operators] == [
        ("aten::conv2d", 0),
        ("aten::relu", 0),
        ("aten::mean", 0),
        ("aten::linear", 0),
        ("aten::relu", 1),
        ("aten::linear", 1),
        ("aten::add", 0),
    ]
    assert operator(timeline, "aten::conv2d").input_shapes[:2] == [[2, 3, 8, 8], [8, 3, 3, 3]]
    summary = timeline.summary
    assert (summary.iterations, summary.kernels_per_iter) == (3, 0.0)
    assert summary.attributed_share == summary.high_share == 1.0
    assert summary.device_time_per_iter_us == pytest.approx(
        sum(o.cpu_time_us for o in timeline.operators), abs=0.01
    )
    assert 0 < summary.device_time_per_iter_us <= summary.wall_time_per_iter_us
    assert summary.launch_overhead_per_call_us is None
    assert timeline.unattributed_kernels == [] and flags == []
    assert all(o.kernels == [] for o in timeline.operators)
    assert sum(a.share for a in timeline.aggregated) == pytest.approx(1.0, abs=1e-4)


def test_cpu_inductor_without_kernel_events_is_flagged() -> None:
    timeline, flags = cpu_trace("inductor")
    names = [o.name for o in timeline.operators]
    assert names == [COMPILED_GRAPH_OPERATOR, "aten::convolution", "aten::addmm", "aten::addmm"]
    residual = operator(timeline, COMPILED_GRAPH_OPERATOR)
    others = sum(o.cpu_time_us for o in timeline.operators if o is not residual)
    assert timeline.summary.high_share == pytest.approx(
        others / (others + residual.cpu_time_us), abs=1e-4
    )
    assert "enable_kernel_profile" in flag(flags, "high_unattributed_share").detail


def test_cpu_inductor_kernels_are_operators_with_fused_ops() -> None:
    timeline, flags = cpu_trace("inductor_kernel_profile")
    kernels = {o.name: o.fused_ops for o in timeline.operators if not o.name.startswith("aten::")}
    assert kernels == {
        "graph_0_cpp_fused_convolution_0": ["aten::convolution"],
        "graph_0_cpp_fused_mean_relu_1": ["aten::mean", "aten::relu"],
        "graph_0_cpp_fused_relu_2": ["aten::relu"],
        "graph_0_cpp_fused_add_3": ["aten::add"],
    }
    assert timeline.summary.attributed_share == 1.0
    assert timeline.summary.high_share < 1.0
    assert flags == []
    unknown, _ = cpu_trace("inductor_kernel_profile", provenance=False)
    assert unknown.summary.attributed_share == unknown.summary.high_share < 1.0
    assert [o.name for o in unknown.operators] == [o.name for o in timeline.operators]


def test_cpu_graph_break_is_flagged() -> None:
    timeline, flags = cpu_trace("graph_break")
    detail = flag(flags, "graph_breaks").detail
    assert detail.startswith("2 compiled regions per iteration")
    assert "Torch-Compiled Region: 0/0" in detail and "Torch-Compiled Region: 1/0" in detail
    assert operator(timeline, "graph_1_cpp_fused_add_0").fused_ops == ["aten::add"]


def test_cpu_dynamic_shapes_keep_the_first_iteration() -> None:
    timeline, flags = cpu_trace("dynamic_shapes")
    detail = flag(flags, "dynamic_shapes").detail
    assert "[2, 3, 8, 8]" in detail and "[3, 3, 8, 8]" in detail
    assert operator(timeline, "aten::conv2d").input_shapes[0] == [2, 3, 8, 8]


# ------------------------------------------------------------------------- real H200 traces

H200 = sorted(DATA.glob("h200/*.trace.json*"))


def _h200_params() -> list[Any]:
    if not H200:
        reason = "no real H200 traces under tests/data/h200/ yet (*.trace.json[.gz])"
        return [pytest.param(None, marks=pytest.mark.skip(reason=reason), id="none")]
    return [pytest.param(path, id=path.name) for path in H200]


def _real(path: Path, twin: Any = None) -> tuple[Timeline, list[EdgeCaseFlag], Any]:
    """A real trace attributed as the pipeline does: its label's provenance (the uncaptured
    twin's is its optimized run's), and the twin's timeline for a CUDA-graph run."""
    stem = path.name.split(".trace.json")[0]
    sibling = path.with_name(f"{stem.removesuffix('_uncaptured')}.provenance.json")
    provenance = json.loads(sibling.read_text()) if sibling.exists() else None
    trace = load_trace(path)
    timeline, flags = build_timeline(
        trace,
        label=stem,
        compile_mode=stem,
        device_type="cuda",
        provenance=provenance,
        twin=twin,
    )
    return timeline, flags, trace


@pytest.mark.parametrize("path", _h200_params())
def test_real_h200_trace(path: Path) -> None:
    stem = path.name.split(".trace.json")[0]
    uncaptured = path.with_name(f"{stem}_uncaptured.trace.json.gz")
    twin = replay_twin(_real(uncaptured)[0]) if uncaptured.exists() else None
    timeline, flags, trace = _real(path, twin)
    summary = timeline.summary
    assert summary.kernels_per_iter * summary.iterations == _kernels_launched_in_marks(trace)
    # what the launch queue holds: a kernel launch each, memory copies aside; one per replay
    assert summary.launches_per_iter is not None
    assert summary.launches_per_iter <= summary.kernels_per_iter
    every = [k for o in timeline.operators for k in o.kernels] + timeline.unattributed_kernels
    accounted = sum(k.duration_us for k in every)
    assert accounted == pytest.approx(summary.device_time_per_iter_us, rel=0.02)
    replayed = [f for f in flags if f.name == "cuda_graph_replay"]
    # The examples take one fixed input: a replay ordered against the host ops by GPU time
    # once looked like a change of structure between iterations.
    assert not [f.detail for f in flags if f.name == "dynamic_shapes"]
    if "." not in stem:  # the eager timeline
        assert summary.attributed_share >= 0.99
        assert summary.high_share >= 0.95
    elif twin is not None or not replayed:
        assert summary.attributed_share >= 0.99
    if twin is not None:  # this run's optimized timeline, replayed from a CUDA graph
        assert replayed and "0 unattributed" in replayed[0].detail
        # one graph launch, whatever its kernels, and the kernels launched outside it (memory
        # copies aside): the input copy of Inductor's CUDA graph trees, a multi-tensor-apply
        # kernel (embedding_projection in h200-2026-12-02b), where ModelGraph copies instead
        direct = [
            k
            for o in timeline.operators
            for k in o.kernels
            if k.attribution == "high" and not k.name.startswith(("Memcpy", "Memset"))
        ]
        assert summary.launches_per_iter == 1.0 + len(direct)
    for op in timeline.operators:  # every Triton kernel tied to the ATen ops it fuses
        for k in op.kernels:
            if k.name.startswith("triton_"):
                assert k.attribution == "medium" and k.fused_ops, (k.name, op.name)


def _kernels_launched_in_marks(trace: dict[str, Any]) -> int:
    """An independent count: GPU activities whose launch starts inside a CPU mark's span."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    marks = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith(ITERATION_MARK)
    ]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    count = 0
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts = launches.get(e.get("args", {}).get("correlation"))
        count += ts is not None and any(start <= ts < end for start, end in marks)
    return count


def test_busy_time_counts_overlapping_streams_once() -> None:
    timeline, flags = synthetic()
    summary = timeline.summary
    assert flag(flags, "multi_stream_overlap")
    assert summary.busy_time_per_iter_us is not None
    assert 0 < summary.busy_time_per_iter_us < summary.device_time_per_iter_us


def test_cpu_timelines_have_no_busy_time() -> None:
    timeline, _ = cpu_trace("eager")
    assert timeline.summary.busy_time_per_iter_us is None
