"""PassResult's log line, the registry, and the wrapper that keeps a failing pass harmless."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.fx
from pass_helpers import DynamoCapture, const

from pytest_opprof.passes import REGISTRY, get_pass, non_graph_apply, qkv_fusion
from pytest_opprof.passes.base import (
    ConstantEvaluator,
    PassResult,
    is_constant_tensor,
    run_graph_pass,
)

ALL_TYPES = {
    "dtype_promotion": "aten",
    "gemm_out_dtype": "aten",
    "gemm_epilogue": "aten",
    "gemm_algorithm": "aten",
    "attention_backend": "aten",
    "memory_layout": "aten",
    "bn_fold": "aten",
    "conv_im2col": "aten",
    "depthwise_taps": "aten",
    "qkv_fusion": "functional",
    "sdpa_replacement": "functional",
    "pretranspose_weights": "inductor_config",
    "activation_substitution": "functional",
    "batch_padding": "non_graph",
    "cuda_graphs": "inductor_config",
    "algorithm_selection": "inductor_config",
    "stub_detection": "functional",
}


@pytest.mark.parametrize(
    ("result", "line"),
    [
        (PassResult("bn_fold", "APPLIED", "folded 2", 2), "INFO [pass_bn_fold] Applied: folded 2"),
        (PassResult("bn_fold", "NOT_APPLIED", "x"), "WARNING [pass_bn_fold] Pattern not found"),
        (
            PassResult("qkv_fusion", "FAILED", "RuntimeError: boom"),
            "WARNING [pass_qkv_fusion] Failed: RuntimeError: boom",
        ),
    ],
)
def test_log_line_format(result: PassResult, line: str, caplog: pytest.LogCaptureFixture) -> None:
    assert result.log_line() == line
    with caplog.at_level(logging.INFO, logger="pytest_opprof.passes"):
        result.log()
    (record,) = [r for r in caplog.records if r.name == "pytest_opprof.passes"]
    assert f"{record.levelname} {record.getMessage()}" == line


def test_registry_covers_every_type_at_its_level() -> None:
    assert {name: spec.level for name, spec in REGISTRY.items()} == ALL_TYPES
    assert all(spec.name == name and spec.description for name, spec in REGISTRY.items())
    assert all(callable(spec.apply) for spec in REGISTRY.values())


def test_get_pass_names_the_known_types() -> None:
    assert get_pass("bn_fold") is REGISTRY["bn_fold"]
    with pytest.raises(KeyError, match=r"unknown pass 'bn_folding'.*bn_fold.*stub_detection"):
        get_pass("bn_folding")


def test_non_graph_forms() -> None:
    assert non_graph_apply("dtype_promotion").__name__ == "apply_model"
    assert non_graph_apply("memory_layout").__name__ == "apply_model"
    assert non_graph_apply("batch_padding") is REGISTRY["batch_padding"].apply
    with pytest.raises(KeyError, match="no non-graph form"):
        non_graph_apply("bn_fold")


def test_only_parameters_and_static_buffers_are_constants() -> None:
    plain = torch.ones(3)
    marked = torch.ones(3)
    torch._dynamo.mark_static_address(marked)
    assert is_constant_tensor(const(torch.ones(3)))
    assert is_constant_tensor(marked)
    assert not is_constant_tensor(plain)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not is_constant_tensor(torch.nn.Parameter(torch.ones(3)))


def test_constant_evaluator_stops_at_runtime_inputs() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * (w + 1).sqrt()

    gm = torch.fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    ev = ConstantEvaluator(gm, [torch.ones(2), const(torch.full((2,), 3.0))])
    torch.testing.assert_close(ev.value(nodes["sqrt"]), torch.full((2,), 2.0))
    assert ev.value(nodes["mul"]) is None  # reads x, a runtime input


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) + self.k(x) * self.v(x)


def test_failing_pass_leaves_graph_unchanged(
    dynamo_graph: DynamoCapture, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = _Attention().eval()
    x = torch.randn(2, 8)
    gm, inputs = dynamo_graph(model, x)
    code, attrs = gm.code, {name for name, _ in gm.named_buffers()}
    sources = dict(gm._param_name_to_source)  # type: ignore[arg-type]
    real_fuse = qkv_fusion._fuse

    def fuse_then_fail(*args: Any, **kwargs: Any) -> bool:
        real_fuse(*args, **kwargs)  # mutates the graph and adds a constant first
        raise RuntimeError("injected failure")

    monkeypatch.setattr(qkv_fusion, "_fuse", fuse_then_fail)
    with caplog.at_level(logging.INFO, logger="pytest_opprof.passes"):
        result = qkv_fusion.apply(gm, inputs)

    assert result == PassResult("qkv_fusion", "FAILED", "RuntimeError: injected failure", 0)
    ours = [r for r in caplog.records if r.name == "pytest_opprof.passes"]
    assert [(r.levelname, r.getMessage()) for r in ours] == [
        ("WARNING", "[pass_qkv_fusion] Failed: RuntimeError: injected failure")
    ]
    assert gm.code == code
    assert {name for name, _ in gm.named_buffers()} == attrs
    assert gm._param_name_to_source == sources
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(hasattr(n, "_dynamo_source") for n in placeholders)  # AOT still accepts it
    torch.testing.assert_close(gm(*inputs)[0], model(x), rtol=0, atol=0)


def test_run_graph_pass_recompiles_only_on_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    calls: list[str] = []
    monkeypatch.setattr(gm, "recompile", lambda: calls.append("recompile"))
    result = run_graph_pass("demo", gm, [], lambda g, _: (0, "nothing here"))
    assert (result.status, result.detail, calls) == ("NOT_APPLIED", "nothing here", [])
    result = run_graph_pass("demo", gm, [], lambda g, _: (3, "did three"))
    assert (result.status, result.matches, calls) == ("APPLIED", 3, ["recompile"])


def test_constant_evaluator_reads_through_dunder_methods() -> None:
    """torch 2.11's Dynamo writes ``buf == 0`` as ``call_method __eq__``: still pure."""
    graph = torch.fx.Graph()
    buf = graph.placeholder("buf")
    eq = graph.call_method("__eq__", (buf, 0))
    add_ = graph.call_method("add_", (buf, 1))
    graph.output((eq, add_))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    ev = ConstantEvaluator(gm, [const(torch.tensor([0.0, 1.0]))])
    torch.testing.assert_close(ev.value(eq), torch.tensor([True, False]))
    assert ev.value(add_) is None  # in place: never evaluated at compile time
