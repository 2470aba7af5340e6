"""The generated backend file: what it compiles, and shipping the baseline itself."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from pytest_opprof.backend import runtime
from pytest_opprof.backend.codegen import render_optimized
from pytest_opprof.schema import BackendPlan, BackendSelection


def _render(tmp_path: Path, chosen: str, plan: BackendPlan) -> str:
    selection = BackendSelection(
        workload="w", reference=chosen, reference_ms=1.0, variants=[], chosen=chosen, plan=plan
    )
    return render_optimized(
        stem="w",
        workload=tmp_path / "w.py",
        out_file=tmp_path / "out" / "w_optimized.py",
        selection=selection,
        proposals=[],
        rtol=1e-4,
        atol=1e-5,
    )


def test_nothing_faster_than_eager_ships_the_baseline_uncompiled(tmp_path: Path) -> None:
    text = _render(tmp_path, "eager", BackendPlan())
    assert "COMPILE = False" in text and "passthrough=True" in text
    compile(text, "w_optimized.py", "exec")


def test_a_plan_is_compiled_with_its_backend(tmp_path: Path) -> None:
    plan = BackendPlan(aten=["bn_fold"], config_patches={"freezing": True}, proposals=["b-1"])
    text = _render(tmp_path, "b-1", plan)
    assert "COMPILE = True" in text and "aten=['bn_fold']" in text
    assert "'freezing': True" in text and "../w.py" in text


def test_optimized_callable_follows_the_flag() -> None:
    model = torch.nn.Linear(2, 2).eval()
    shipped = types.SimpleNamespace(COMPILE=False, BACKEND="eager")
    assert runtime.optimized_callable(shipped, model) is model  # type: ignore[arg-type]
    compiled = runtime.optimized_callable(
        types.SimpleNamespace(COMPILE=True, BACKEND="eager"),  # type: ignore[arg-type]
        model,
    )
    assert compiled is not model
    torch.testing.assert_close(compiled(torch.ones(1, 2)), model(torch.ones(1, 2)))


def test_whole_model_cuda_graph_plan_is_written_as_a_flag(tmp_path: Path) -> None:
    plan = BackendPlan(cuda_graph_model=True, proposals=["cuda_graphs-model"])
    text = _render(tmp_path, "cuda_graphs-model", plan)
    assert "CUDA_GRAPH = True" in text and "triton.cudagraphs" not in text
    assert "def optimize(model" in text
    compile(text, "w_optimized.py", "exec")
    assert "CUDA_GRAPH = False" in _render(tmp_path, "b-1", BackendPlan(proposals=["b-1"]))


def test_whole_model_cuda_graph_replaces_inductor_graphs_in_the_plan() -> None:
    from pytest_opprof.backend.plan import add_proposal
    from pytest_opprof.backend.selection import auto_cuda_graphs

    plan = add_proposal(BackendPlan(), auto_cuda_graphs())
    assert plan.config_patches == {"triton.cudagraphs": True} and not plan.cuda_graph_model
    plan = add_proposal(plan, auto_cuda_graphs(scope="model"))
    assert plan.config_patches == {} and plan.cuda_graph_model
    assert plan.proposals == ["cuda_graphs-selection", "cuda_graphs-model"]


def test_inductor_cuda_graphs_are_not_tried_inside_a_whole_model_graph() -> None:
    from pytest_opprof.backend.plan import add_proposal, inside_model_graph
    from pytest_opprof.backend.selection import auto_cuda_graphs

    trees, whole = auto_cuda_graphs(), auto_cuda_graphs(scope="model")
    assert not inside_model_graph(BackendPlan(), trees)
    assert not inside_model_graph(add_proposal(BackendPlan(), trees), whole)
    in_one_graph = add_proposal(BackendPlan(), whole)
    assert inside_model_graph(in_one_graph, trees)  # LSTM's second pass failed capturing this
    assert not inside_model_graph(in_one_graph, whole)


def test_an_epilogue_of_exact_gelus_alone_is_not_built_on_a_float32_plan() -> None:
    """The pass folds an exact GELU only in bf16 / fp16: on GEMMs captured in float32 and kept
    there, a gemm_epilogue with nothing else to fold is not built; with a ReLU beside, with
    bf16 in the plan, or on a model captured in bf16, it is."""
    from pytest_opprof.backend.plan import add_proposal, cannot_change
    from pytest_opprof.backend.selection import auto_cuda_graphs, auto_gemm_out_dtype

    def epilogue(kinds: list[str], itemsize: int) -> Any:
        params = {"activations": kinds, "captured_itemsize": itemsize}
        return auto_gemm_out_dtype().model_copy(
            update={"id": "gemm_epilogue-1", "type": "gemm_epilogue", "params": params}
        )

    bf16 = auto_gemm_out_dtype().model_copy(
        update={"id": "dtype_promotion-1", "type": "dtype_promotion", "params": {}}
    )
    fp32 = BackendPlan()
    said = cannot_change(fp32, epilogue(["gelu_exact"], 4))
    assert said is not None and "bf16 / fp16" in said
    assert cannot_change(fp32, epilogue(["gelu_exact", "relu"], 4)) is None
    assert cannot_change(fp32, epilogue(["gelu_exact"], 2)) is None
    assert cannot_change(add_proposal(fp32, bf16), epilogue(["gelu_exact"], 4)) is None
    whole = add_proposal(fp32, auto_cuda_graphs(scope="model"))
    assert "one CUDA graph" in (cannot_change(whole, auto_cuda_graphs()) or "")


def test_optimize_records_no_graph_without_cuda() -> None:
    model = torch.nn.Linear(2, 2).eval()
    fn = runtime.optimize(model, "eager", compile=False, cuda_graph=True)
    assert fn is model or torch.cuda.is_available()


def test_a_rung_that_applied_nowhere_is_recognised(make_proposal: Any) -> None:
    from pytest_opprof.backend.selection import applied_nowhere
    from pytest_opprof.passes.base import PassResult

    sdpa = make_proposal("sdpa_replacement-1", "sdpa_replacement")
    gelu = make_proposal("activation_substitution-1", "activation_substitution")
    missed = PassResult("sdpa_replacement", "NOT_APPLIED", "no softmax(q @ k^T) @ v chain")
    kept = PassResult("activation_substitution", "NOT_APPLIED", "left as is")
    said = applied_nowhere([sdpa, gelu], [missed, kept])
    assert said is not None and "sdpa_replacement-1: no softmax" in said and "left as is" in said
    hit = PassResult("sdpa_replacement", "APPLIED", "1 attention block(s)", 1)
    assert applied_nowhere([sdpa, gelu], [hit, kept]) is None
    # A type that records nothing (Inductor settings, CUDA graphs) cannot be judged.
    graphs = make_proposal("cuda_graphs-selection", "cuda_graphs")
    assert applied_nowhere([graphs], []) is None


def test_each_graph_rewrite_is_its_own_rung(make_proposal: Any) -> None:
    """gpt2's SDPA and GELU rewrites are timed apart, so the report gives each its own gain."""
    from pytest_opprof.backend.plan import ladder

    rungs = ladder(
        [
            make_proposal("cuda_graphs-1", "cuda_graphs", "inductor_config"),
            make_proposal("activation_substitution-1", "activation_substitution", "aten"),
            make_proposal("my_fold-1", "my_fold", "functional"),
            make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph"),
            make_proposal("sdpa_replacement-1", "sdpa_replacement", "functional"),
            make_proposal("sdpa_replacement-2", "sdpa_replacement", "functional"),
            make_proposal("stub_detection-1", "stub_detection", "functional"),
        ]
    )
    assert [(r.name, [p.id for p in r.proposals]) for r in rungs] == [
        ("cuda_graphs", ["cuda_graphs-1"]),
        ("dtype_promotion", ["dtype_promotion-1"]),
        ("sdpa_replacement", ["sdpa_replacement-1", "sdpa_replacement-2"]),
        ("activation_substitution", ["activation_substitution-1"]),
        ("my_fold", ["my_fold-1"]),
    ]


def test_selection_times_cuda_graphs_then_precision_before_every_other_rung(
    make_proposal: Any,
) -> None:
    """On a GPU a rung is timed on top of CUDA graphs and bf16, the conditions of the plan it
    would end in: with CUDA graphs last, bf16 on conv_block, mlp_activations and the LSTM
    gained 0.81–1.04× against a launch-bound plan and 1.35–4.63× on the second pass; gpt2's
    SDPA rewrite 0.98× at float32 and 1.20× at bf16."""
    from pytest_opprof.backend.selection import selection_rungs

    proposals = [
        make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph"),
        make_proposal("sdpa_replacement-1", "sdpa_replacement", "functional"),
        make_proposal("memory_layout-1", "memory_layout", "non_graph"),
    ]

    def order(device: str, skip: set[str], given: list[Any] = proposals) -> list[tuple[str, str]]:
        return [(r.name, r.proposals[0].id) for r in selection_rungs(given, device, skip)]

    assert order("cuda", set()) == [
        ("cuda_graphs_model", "cuda_graphs-model"),
        ("cuda_graphs", "cuda_graphs-selection"),
        ("dtype_promotion", "dtype_promotion-1"),
        ("gemm_out_dtype", "gemm_out_dtype-selection"),
        ("sdpa_replacement", "sdpa_replacement-1"),
        ("gemm_algorithm", "gemm_algorithm-selection"),
        ("memory_layout", "memory_layout-1"),
    ]
    # A rule's own CUDA graphs proposal takes the place of the one selection would add.
    ruled = [*proposals, make_proposal("cuda_graphs-1", "cuda_graphs", "inductor_config")]
    assert order("cuda", set(), ruled)[:3] == [
        ("cuda_graphs_model", "cuda_graphs-model"),
        ("cuda_graphs", "cuda_graphs-1"),
        ("dtype_promotion", "dtype_promotion-1"),
    ]
    skip = {"cuda_graphs", "gemm_out_dtype", "gemm_algorithm"}
    assert [n for n, _ in order("cuda", skip)] == [
        "dtype_promotion",
        "sdpa_replacement",
        "memory_layout",
    ]
    assert [n for n, _ in order("cpu", set())] == [
        "dtype_promotion",
        "sdpa_replacement",
        "memory_layout",
    ]


def test_gemm_out_dtype_is_built_only_where_a_gemm_writes_an_output(make_proposal: Any) -> None:
    """The auto rung after bf16 exists for a GEMM whose result is only cast back up to float32,
    which only a GEMM writing a graph output leaves: embedding_projection's bias-free logits,
    not gpt2 (a LayerNorm writes its output; the rung cost it 17 s on the H200 and applied
    nowhere) nor conv_block (its classifier's bias add stands between GEMM and cast)."""
    from pytest_opprof.backend.selection import selection_rungs
    from pytest_opprof.schema import FxGraphSummary, read_artifact

    graphs = Path(__file__).resolve().parents[1] / "data" / "graphs"
    bf16 = [make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph")]

    def built(name: str | None) -> bool:
        graph = read_artifact(graphs / f"{name}.graph.json", FxGraphSummary) if name else None
        return any(r.name == "gemm_out_dtype" for r in selection_rungs(bf16, "cuda", set(), graph))

    assert built("embedding_projection")
    assert not built("gpt2") and not built("conv_block") and not built("mlp_activations")
    assert built(None)  # no graph summary to tell: build it and see


def test_gemm_algorithm_is_built_where_bf16_has_a_large_gemm(make_proposal: Any) -> None:
    """The auto rung for cuBLASLt's algorithms needs bf16 (it tunes bf16/fp16 GEMMs) and a GEMM
    without a bias of 1 GFLOP or more: embedding_projection's [8192, 512] @ [512, 32000]
    logits (268 GFLOP), not conv_block's classifier or gpt2's biased Conv1D GEMMs."""
    from pytest_opprof.backend.selection import selection_rungs
    from pytest_opprof.schema import FxGraphSummary, read_artifact

    graphs = Path(__file__).resolve().parents[1] / "data" / "graphs"
    bf16 = [make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph")]

    def built(name: str | None, proposals: list[Any] = bf16) -> bool:
        graph = read_artifact(graphs / f"{name}.graph.json", FxGraphSummary) if name else None
        rungs = selection_rungs(proposals, "cuda", set(), graph)
        return any(r.name == "gemm_algorithm" for r in rungs)

    assert built("embedding_projection")
    assert not built("gpt2") and not built("conv_block") and not built("mlp_activations")
    assert not built("embedding_projection", [])  # no bf16: nothing for it to tune
    assert built(None)


def test_what_task_select_climbs_with_the_captured_graph(
    make_proposal: Any, tmp_path: Path
) -> None:
    """task_select's ladder from its out folder: the capture's graph.json decides the
    gemm_out_dtype rung, and not_tried's proposals are neither rungs nor built."""
    import shutil

    from pytest_opprof.backend.selection import climbed
    from pytest_opprof.stages.backend import captured_graph

    graphs = Path(__file__).resolve().parents[1] / "data" / "graphs"
    proposals = [
        make_proposal("dtype_promotion-1", "dtype_promotion", "non_graph"),
        make_proposal(
            "activation_substitution-1",
            "activation_substitution",
            params={"compiled_already": "triton_poi_fused_add_mul_pow_tanh_view_2"},
        ),
    ]
    assert captured_graph(tmp_path) is None  # capture wrote none: build the rung and see
    aside, rungs = climbed(proposals, "cuda", set(), captured_graph(tmp_path))
    assert set(aside) == {"activation_substitution-1"}
    assert [r.name for r in rungs] == [
        "cuda_graphs_model",
        "cuda_graphs",
        "dtype_promotion",
        "gemm_out_dtype",
        "gemm_algorithm",
    ]
    shutil.copy(graphs / "gpt2.graph.json", tmp_path / "graph.json")
    _, rungs = climbed(proposals, "cuda", set(), captured_graph(tmp_path))
    assert "gemm_out_dtype" not in [r.name for r in rungs]


def test_what_selection_never_builds(make_proposal: Any) -> None:
    from pytest_opprof.backend.selection import not_tried

    proposals = [
        make_proposal("bn_fold-1", "bn_fold", "aten"),
        make_proposal("llm-x-1", "x", params={"implemented": False, "pass_file": "llm/x.py"}),
        make_proposal(
            "activation_substitution-1",
            "activation_substitution",
            params={"compiled_already": "triton_poi_fused_add_mul_pow_tanh_view_2"},
        ),
        make_proposal("qkv_fusion-1", "qkv_fusion"),
    ]
    why = not_tried(proposals, {"bn_fold"})
    assert set(why) == {"bn_fold-1", "llm-x-1", "activation_substitution-1"}
    assert why["bn_fold-1"] == ("bn_fold", "skipped by the workload's OPPROF['skip']")
    assert "stage 3 checks llm/x.py" in why["llm-x-1"][1]
    assert why["activation_substitution-1"][1].startswith(
        "not tried: the torch.compile profile already runs it inside one kernel "
        "(triton_poi_fused_add_mul_pow_tanh_view_2)"
    )


def test_which_dropped_rungs_get_a_second_pass() -> None:
    """A rung that made nothing faster is retried on the final plan; one that applied nowhere
    only once a rung before it was kept on the second pass (gemm_out_dtype after bf16)."""
    from pytest_opprof.backend.selection import worth_a_second_pass

    slower = ["made nothing faster: 0.998x (95% CI 0.994–1.001) against the plan without it"]
    nowhere = ["applied nowhere: gemm_out_dtype-selection: no bf16/fp16 GEMM ..."]
    assert worth_a_second_pass(slower, revived=False)
    assert not worth_a_second_pass(nowhere, revived=False)
    assert worth_a_second_pass(nowhere, revived=True)
    assert not worth_a_second_pass(["failed to build: RuntimeError"], revived=True)
    assert not worth_a_second_pass([slower[0], "changed the output: ..."], revived=True)
    small = ["gained under 1%: 1.003x (95% CI 1.001–1.005) against the plan without it"]
    assert worth_a_second_pass(small, revived=False)
    halved = ["made the call over twice as slow: 0.292x (95% CI 0.285–0.301) against ..."]
    assert not worth_a_second_pass(halved, revived=True)


def test_only_rungs_dropped_before_the_last_kept_one_get_a_second_pass() -> None:
    """They were timed against a plan that has changed since. With no rung kept the plan never
    changed: no second pass, where one used to retime every rung but the last against the same
    plan (bn_fold and memory_layout, 31 s of the quick start's conv_block run on a CPU:
    docs/results.md)."""
    from pytest_opprof.backend.selection import second_pass

    assert second_pass([False, False, False, False]) == []
    assert second_pass([]) == []
    assert second_pass([True, False, False]) == []
    assert second_pass([False, True, False, True, False]) == [0, 2]
    assert second_pass([False, False, True]) == [0, 1]


def test_a_rung_over_twice_as_slow_in_each_early_round_stops_being_timed() -> None:
    """bf16 on a CPU without bf16 units: 0.17x in every round. Asked after each round; a rung
    within a factor of two in any round, or with fewer rounds than EARLY_ROUNDS, goes on."""
    from pytest_opprof.backend.selection import EARLY_ROUNDS, over_twice_as_slow

    def rounds(current: list[float], candidate: list[float]) -> dict[str, list[float]]:
        return {"current": current, "candidate": candidate}

    assert EARLY_ROUNDS == 3
    assert over_twice_as_slow(rounds([190.0, 188.0, 191.0], [1110.0, 1120.0, 1098.0]))
    assert not over_twice_as_slow(rounds([190.0, 188.0], [1110.0, 1120.0]))  # too few
    assert not over_twice_as_slow(rounds([190.0, 188.0, 191.0], [1110.0, 370.0, 1098.0]))
    assert not over_twice_as_slow(rounds([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]))  # exactly twice
    # mid-round (the candidate's sample not in yet): only whole rounds count
    assert not over_twice_as_slow(rounds([190.0, 188.0, 191.0], [1110.0, 1120.0]))
    assert over_twice_as_slow(rounds([190.0, 188.0, 191.0, 189.0], [1110.0, 1120.0, 1098.0]))


def test_a_rung_far_faster_in_each_early_round_is_settled_too() -> None:
    """dtype_promotion's 3-5x: under a third of the plan's time in every one of the first
    rounds settles the rung, as over twice the time does; not a round within that, not fewer
    rounds than EARLY_ROUNDS, and not rounds on a slowed host, where a launch-bound plan's
    call can take twice its time while a CUDA-graph replay's does not."""
    from pytest_opprof.backend.selection import far_faster, over_twice_as_slow, settled
    from pytest_opprof.capture.timing import RoundSamples

    def rounds(current: list[float], candidate: list[float], host: list[float]) -> Any:
        samples = RoundSamples({"current": current, "candidate": candidate}, {})
        samples.host_us = host
        return samples

    quiet = [10.0, 10.3, 10.1]
    fast = rounds([1.00, 1.02, 0.99], [0.31, 0.30, 0.32], quiet)
    assert far_faster(fast) and settled(fast) and not over_twice_as_slow(fast)
    assert not settled(rounds([1.00, 1.02], [0.31, 0.30], quiet[:2]))  # too few
    assert not settled(rounds([1.00, 1.02, 0.99], [0.31, 0.40, 0.32], quiet))  # one at 0.39x
    assert not settled(rounds([1.00, 1.02, 0.99], [0.45, 0.45, 0.45], quiet))  # a halving
    assert not settled(rounds([1.00, 1.02, 0.99], [0.31, 0.30], quiet))  # whole rounds only
    assert not settled(rounds([1.00, 2.04, 0.99], [0.31, 0.30, 0.32], [10.0, 21.0, 10.1]))
    slow = rounds([190.0, 188.0, 191.0], [1110.0, 1120.0, 1098.0], quiet)
    assert settled(slow)  # the slow way


def _gain(ratio: float, low: float, high: float) -> Any:
    """A rung's measured gain against the plan below it."""
    from pytest_opprof.schema import Speedup

    return Speedup(baseline="current", candidate="rung", ratio=ratio, ci_low=low, ci_high=high)


def test_a_dropped_rung_says_how_it_fared() -> None:
    """The first words of a dropped rung's reason, which decide its second pass: bf16 on this
    CPU ran 0.29x (the quick start's conv_block run), gpt2's GELU rewrite 1.003x on the H200."""
    from pytest_opprof.backend.selection import SLOWER, SMALL_GAIN, verdict

    assert verdict(_gain(0.292, 0.285, 0.301)) == SLOWER
    assert verdict(_gain(0.80, 0.45, 0.95)) == "made nothing faster"  # not surely halved
    assert verdict(_gain(0.998, 0.994, 1.001)) == "made nothing faster"
    assert verdict(_gain(1.003, 1.001, 1.005)) == SMALL_GAIN


def test_a_rung_is_kept_only_when_confidently_faster_by_one_percent() -> None:
    """Timed on CUDA graphs, gpt2's GELU rewrite and frozen weights were confidently faster by
    0.3% each: kept, each cost a build and a second pass for nothing a user would measure."""
    from pytest_opprof.backend.selection import MIN_RUNG_GAIN, SMALL_GAIN, faster_enough

    assert faster_enough(_gain(1.12, 1.10, 1.14))
    assert faster_enough(_gain(MIN_RUNG_GAIN, 1.001, 1.02))
    assert not faster_enough(_gain(1.003, 1.001, 1.005))  # confident, too small
    assert not faster_enough(_gain(1.05, 0.99, 1.11))  # large, not confident
    assert SMALL_GAIN == "gained under 1%"


def test_the_stock_recipe_ships_unless_the_plan_clears_the_rung_bar() -> None:
    """The gain is the stock recipe timed against the ladder's plan. Under the rungs' bar a
    recipe a shade faster was dropped, and the recapture could then find the plan slower than
    it, its CI wholly below 1 (docs/design-notes.md#level-with-the-stock-recipe)."""
    from pytest_opprof.backend.selection import stock_holds

    assert stock_holds(_gain(1.010, 0.999, 1.013))  # a shade faster: it ships
    assert stock_holds(_gain(0.995, 0.990, 0.999))  # the plan surely faster, by under 1%
    assert stock_holds(_gain(0.990, 0.985, 1.002))  # the plan 1% faster, not surely
    assert not stock_holds(_gain(0.980, 0.970, 0.990))  # the plan surely faster by 2%


def test_gemm_algorithm_runs_after_the_other_aten_passes(make_proposal: Any) -> None:
    """It takes the ``mm`` nodes gemm_out_dtype and bn_fold match, so it runs last whatever
    the order its rung was kept in (a second pass keeps a rung after it)."""
    from pytest_opprof.backend.plan import plan_of

    plan = plan_of(
        [
            make_proposal("gemm_algorithm-selection", "gemm_algorithm", "aten"),
            make_proposal("gemm_out_dtype-selection", "gemm_out_dtype", "aten"),
            make_proposal("bn_fold-1", "bn_fold", "aten"),
        ]
    )
    assert plan.aten == ["bn_fold", "gemm_out_dtype", "gemm_algorithm"]


def test_notes_say_which_figures_are_measured_and_which_chained() -> None:
    """gpt2's first rung (tests/data/h200/gpt2): 2.875 ms in its pair, 1.53x over torch.compile
    at 4.401 ms in the same rounds, the reference having timed 3.297 ms in its own run."""
    from pytest_opprof.backend.codegen import render_notes
    from pytest_opprof.backend.selection import timed_rung
    from pytest_opprof.measure import latency_stats
    from pytest_opprof.schema import Speedup, VariantResult, WaterfallStep

    gain = Speedup(
        baseline="current", candidate="candidate", ratio=4.401 / 2.875, ci_low=1.5, ci_high=1.56
    )
    plan = BackendPlan(proposals=["cuda_graphs-model"])
    reference = WaterfallStep(
        step="compile",
        latency_ms=3.297,
        speedup_cumulative=1.0,
        speedup_added=1.0,
        measured_ms=3.297,
    )
    variant, step = timed_rung(
        "cuda_graphs-model",
        plan,
        gain,
        latency_stats([2.875] * 5, 50),
        label="+cuda_graphs_model (cuda_graphs-model)",
        below_name="compile",
        below_latency=latency_stats([4.401] * 5, 50),
        below_step=reference,
    )
    compiled = VariantResult(
        name="compile", plan=BackendPlan(), latency=latency_stats([3.297] * 5, 50), speedup=1.0
    )
    selection = BackendSelection(
        workload="gpt2",
        reference="compile",
        reference_ms=3.297,
        variants=[compiled, variant],
        chosen=variant.name,
        plan=plan,
        waterfall=[reference, step],
    )
    notes = render_notes(selection, [])
    assert "| compile | 3.2970 | — | — | 1.000x |" in notes
    assert (
        "| cuda_graphs-model | 2.8750 | 1.531x (1.500–1.560) | compile 4.4010 "
        "| 1.531x (chained, estimate) |" in notes
    )
    assert "| cumulative (chained, estimate) |" in notes
    assert (
        "| +cuda_graphs_model (cuda_graphs-model) | 2.8750 | 4.4010 | 1.531x (1.500–1.560) "
        "| 1.531x |" in notes
    )


def test_a_precision_change_under_autocast_is_written_as_such(tmp_path: Path) -> None:
    plan = BackendPlan(dtype="bfloat16", autocast=True, proposals=["d-1"])
    text = _render(tmp_path, "d-1", plan)
    assert "dtype='bfloat16', autocast=True" in text
    cast = _render(tmp_path, "d-1", plan.model_copy(update={"autocast": False}))
    assert "autocast" not in cast
