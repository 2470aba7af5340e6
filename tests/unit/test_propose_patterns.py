"""Pattern detectors on the real graph summaries of the seven examples (tests/data/graphs, torch
2.13 Dynamo) and on small hand-written graphs for the variants the examples do not show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.propose import gemm_patterns, patterns
from pytest_opprof.propose.context import evidence_matches
from pytest_opprof.propose.graph import GraphView, canon, geometry, views
from pytest_opprof.schema import FxGraphSummary, FxNode

GRAPHS = Path(__file__).resolve().parents[1] / "data" / "graphs"
EXAMPLES = (
    "conv_block",
    "depthwise_separable_conv",
    "embedding_projection",
    "gpt2",
    "lstm_sequence_encoder",
    "mlp_activations",
    "sdpa_attention",
)


def real(name: str) -> FxGraphSummary:
    return FxGraphSummary.model_validate_json((GRAPHS / f"{name}.graph.json").read_text())


def count(name: str, detector: Any) -> int:
    return sum(len(detector(v)) for v in views(real(name)))


def node(name: str, op: str, target: str, *args: str, **kw: Any) -> FxNode:
    return FxNode(name=name, op=op, target=target, args=list(args), **kw)


def view_of(*nodes: FxNode, parameters: dict[str, list[int]] | None = None) -> GraphView:
    summary = FxGraphSummary(graphs=[list(nodes)], parameters=parameters or {})
    return GraphView(summary, 0)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("torch.conv2d", "conv2d"),
        ("torch._C._nn.linear", "linear"),
        ("torch.nn.functional.batch_norm", "batch_norm"),
        ("<built-in function mul>", "mul"),
        ("_operator.truediv", "truediv"),
        ("<built-in method conv2d of type object at 0x7f3a>", "conv2d"),
        ("torch.ops.aten.mul.Tensor", "mul"),
        (
            "aten._native_batch_norm_legit_no_training.default",
            "_native_batch_norm_legit_no_training",
        ),
        ("transpose", "transpose"),
        ("torch._C._nn.scaled_dot_product_attention", "scaled_dot_product_attention"),
    ],
)
def test_canon_reads_every_spelling_of_a_target(target: str, expected: str) -> None:
    assert canon(target) == expected


@pytest.mark.parametrize(
    ("detector", "counts"),
    [
        (patterns.find_conv_bn, {"conv_block": 3, "depthwise_separable_conv": 6}),
        (patterns.find_shared_input_linears, {"sdpa_attention": 1}),
        (patterns.find_manual_attention, {"gpt2": 12}),
        (patterns.find_tanh_gelu, {"gpt2": 12}),
        (patterns.find_nchw_convolutions, {"conv_block": 3, "depthwise_separable_conv": 6}),
        (
            gemm_patterns.find_weight_ops,
            {
                "conv_block": 4,
                "depthwise_separable_conv": 6,
                "embedding_projection": 3,
                "gpt2": 48,
                "mlp_activations": 4,
                "sdpa_attention": 4,
            },
        ),
    ],
)
def test_detectors_on_the_seven_examples(detector: Any, counts: dict[str, int]) -> None:
    found = {name: count(name, detector) for name in EXAMPLES}
    assert found == {name: counts.get(name, 0) for name in EXAMPLES}


@pytest.mark.parametrize("name", EXAMPLES)
def test_detector_evidence_is_found_in_the_graph(name: str) -> None:
    g = real(name)
    detectors = (
        patterns.find_conv_bn,
        patterns.find_shared_input_linears,
        patterns.find_manual_attention,
        patterns.find_tanh_gelu,
        patterns.find_nchw_convolutions,
        gemm_patterns.find_weight_ops,
    )
    matches = [m for v in views(g) for d in detectors for m in d(v)]
    matches += gemm_patterns.find_off_tile(views(g)[0], 8) if g.graphs else []
    matches += patterns.find_rnn_modules(g)
    for m in matches:
        for e in m.evidence:
            assert evidence_matches(e, None, g), (m.kind, e)  # type: ignore[arg-type]


def test_rnn_modules_from_module_types() -> None:
    (m,) = patterns.find_rnn_modules(real("lstm_sequence_encoder"))
    assert m.nodes == ("lstm",) and m.info == {"cell": "LSTM"}
    assert patterns.find_rnn_modules(real("gpt2")) == []
    assert patterns.find_rnn_modules(None) == []


def test_off_tile_dimensions_and_their_padding_waste() -> None:
    found = gemm_patterns.find_off_tile(views(real("conv_block"))[0], 8)
    assert [(m.nodes, m.info["dims"], m.info["padded"]) for m in found] == [
        (("input_1",), {"K": 3}, {"K": 8}),
        (("linear",), {"N": 10}, {"N": 16}),
    ]
    assert found[0].info["waste_pct"] == pytest.approx(500 / 3)
    assert count("depthwise_separable_conv", lambda v: gemm_patterns.find_off_tile(v, 8)) == 0


def test_geometry_of_linear_conv_matmul() -> None:
    v = views(real("gpt2"))[0]
    linear = geometry(v, v.by_name["linear"])
    assert linear is not None and (linear.m, linear.n, linear.k) == (512, 2304, 768)
    assert linear.flops == 2.0 * 512 * 2304 * 768
    scores = geometry(v, v.by_name["matmul"])
    assert scores is not None and (scores.m, scores.n, scores.k, scores.groups) == (
        128,
        128,
        64,
        48,
    )
    cv = views(real("depthwise_separable_conv"))[0]
    depthwise = geometry(cv, cv.nodes[[n.op for n in cv.nodes].index("call_function")])
    assert depthwise is not None and depthwise.kind == "conv" and depthwise.groups == 32


# ----------------------------------------------------------------- hand-written variants


def conv_bn_graph(training: str = "False", extra_user: bool = False) -> GraphView:
    nodes = [
        node("x", "placeholder", "L_x_", shape=[2, 3, 8, 8]),
        node("w", "placeholder", "L_w_", shape=[8, 3, 3, 3]),
        node("conv", "call_function", "torch.conv2d", "x", "w", "None", shape=[2, 8, 8, 8]),
        node(
            "bn",
            "call_function",
            "torch.nn.functional.batch_norm",
            "conv",
            "m",
            "v",
            "g",
            "b",
            training,
            "0.1",
            "1e-05",
            shape=[2, 8, 8, 8],
        ),
    ]
    if extra_user:
        nodes.append(node("other", "call_function", "torch.relu", "conv", shape=[2, 8, 8, 8]))
    return view_of(*nodes)


def test_conv_bn_needs_eval_mode_and_a_sole_user() -> None:
    (m,) = patterns.find_conv_bn(conv_bn_graph())
    assert m.nodes == ("conv", "bn")
    assert [(e.metric, e.value) for e in m.evidence][-1] == ("batch_norm training", "False")
    assert patterns.find_conv_bn(conv_bn_graph(training="True")) == []
    assert patterns.find_conv_bn(conv_bn_graph(extra_user=True)) == []


def test_conv_bn_in_call_module_form_takes_eval_from_the_contract() -> None:
    v = view_of(
        node("x", "placeholder", "L_x_", shape=[2, 3, 8, 8]),
        node(
            "conv",
            "call_module",
            "features.0",
            "x",
            module_type="torch.nn.modules.conv.Conv2d",
            module_path="L['self'].features.0",
            shape=[2, 8, 8, 8],
        ),
        node(
            "bn",
            "call_module",
            "features.1",
            "conv",
            module_type="torch.nn.modules.batchnorm.BatchNorm2d",
            shape=[2, 8, 8, 8],
        ),
        parameters={"features.0.weight": [8, 3, 3, 3]},
    )
    (m,) = patterns.find_conv_bn(v)
    assert m.info["eval_from_contract"] is True
    geo = geometry(v, v.by_name["conv"])
    assert geo is not None and (geo.n, geo.k) == (8, 27)


def test_shared_input_linears_need_equal_in_features() -> None:
    v = view_of(
        node("h", "placeholder", "L_h_", shape=[4, 16]),
        node("wa", "placeholder", "L_wa_", shape=[16, 16]),
        node("wb", "placeholder", "L_wb_", shape=[32, 16]),
        node("a", "call_function", "torch._C._nn.linear", "h", "wa", "None", shape=[4, 16]),
        node("b", "call_function", "torch._C._nn.linear", "h", "wb", "None", shape=[4, 32]),
        node("c", "call_function", "torch._C._nn.linear", "a", "wa", "None", shape=[4, 16]),
    )
    (m,) = patterns.find_shared_input_linears(v)
    assert m.nodes == ("a", "b") and m.info["out_features"] == [16, 32]
    assert m.info["input_bytes"] == 4 * 16 * 4


def attention_graph(*, dropout: bool = False, mask: bool = True) -> GraphView:
    nodes = [
        node("q", "placeholder", "L_q_", shape=[2, 4, 8, 16]),
        node("k", "placeholder", "L_k_", shape=[2, 4, 8, 16]),
        node("v", "placeholder", "L_v_", shape=[2, 4, 8, 16]),
        node("m", "placeholder", "L_m_", shape=[2, 4, 8, 8]),
        node("kt", "call_method", "transpose", "k", "-2", "-1", shape=[2, 4, 16, 8]),
        node("s", "call_function", "torch.matmul", "q", "kt", shape=[2, 4, 8, 8]),
        node("s1", "call_function", "<built-in function mul>", "s", "0.25", shape=[2, 4, 8, 8]),
    ]
    last = "s1"
    if mask:
        nodes.append(
            node("s2", "call_function", "<built-in function add>", "s1", "m", shape=[2, 4, 8, 8])
        )
        last = "s2"
    nodes.append(
        node("p", "call_function", "torch.softmax", last, shape=[2, 4, 8, 8], kwargs={"dim": "-1"})
    )
    probs = "p"
    if dropout:
        nodes.append(
            node(
                "pd", "call_function", "torch.nn.functional.dropout", "p", "0.1", shape=[2, 4, 8, 8]
            )
        )
        probs = "pd"
    nodes.append(node("o", "call_function", "torch.matmul", probs, "v", shape=[2, 4, 8, 16]))
    return view_of(*nodes)


def test_manual_attention_with_additive_mask_and_dropout() -> None:
    (m,) = patterns.find_manual_attention(attention_graph(dropout=True))
    assert m.nodes == ("s", "s1", "s2", "p", "o")
    assert m.info["masked"] is True and m.info["scale"] == 0.25
    assert m.info["score_numel"] == 2 * 4 * 8 * 8
    (plain,) = patterns.find_manual_attention(attention_graph(mask=False))
    assert plain.info["masked"] is False and plain.nodes == ("s", "s1", "p", "o")


def test_softmax_not_between_two_matmuls_is_not_attention() -> None:
    v = view_of(
        node("x", "placeholder", "L_x_", shape=[4, 8]),
        node("p", "call_function", "torch.softmax", "x", shape=[4, 8]),
        node("y", "call_function", "torch.tanh", "p", shape=[4, 8]),
    )
    assert patterns.find_manual_attention(v) == []


def test_tanh_gelu_spelled_with_multiplications_instead_of_pow() -> None:
    mul = "<built-in function mul>"
    add = "<built-in function add>"
    v = view_of(
        node("x", "placeholder", "L_x_", shape=[4, 8]),
        node("x2", "call_function", mul, "x", "x", shape=[4, 8]),
        node("x3", "call_function", mul, "x", "x2", shape=[4, 8]),
        node("c", "call_function", mul, "x3", "0.044715", shape=[4, 8]),
        node("inner", "call_function", add, "x", "c", shape=[4, 8]),
        node("scaled", "call_function", mul, "inner", "0.7978845608028654", shape=[4, 8]),
        node("t", "call_function", "torch.tanh", "scaled", shape=[4, 8]),
        node("one", "call_function", add, "t", "1.0", shape=[4, 8]),
        node("half", "call_function", mul, "x", "0.5", shape=[4, 8]),
        node("out", "call_function", mul, "half", "one", shape=[4, 8]),
    )
    (m,) = patterns.find_tanh_gelu(v)
    assert m.info["input"] == "x"
    assert set(m.nodes) == {"x3", "c", "inner", "scaled", "t", "one", "half", "out"}


def test_plain_tanh_is_not_gelu() -> None:
    assert count("mlp_activations", patterns.find_tanh_gelu) == 0
    v = view_of(
        node("x", "placeholder", "L_x_", shape=[4, 8]),
        node("s", "call_function", "<built-in function mul>", "x", "0.5", shape=[4, 8]),
        node("t", "call_function", "torch.tanh", "s", shape=[4, 8]),
    )
    assert patterns.find_tanh_gelu(v) == []
