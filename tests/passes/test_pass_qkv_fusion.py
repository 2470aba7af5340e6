"""qkv_fusion on real Dynamo graphs (torch 2.13: ``torch._C._nn.linear`` with parameter
placeholders) and on an FX ``call_module`` graph."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config
import torch.fx
import torch.nn.functional as F
from pass_helpers import DynamoCapture, count

from pytest_opprof.passes import qkv_fusion

RTOL = ATOL = 1e-5


class QKV(torch.nn.Module):
    """Three projections of one input plus an output projection of another value."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, dim)
        self.v = torch.nn.Linear(dim, 2 * dim)
        self.o = torch.nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return self.o(att @ v)


def test_fuses_three_projections_into_one(dynamo_graph: DynamoCapture) -> None:
    model, x = QKV().eval(), torch.randn(2, 5, 16)
    gm, inputs = dynamo_graph(model, x)
    assert count(gm, F.linear) == 4

    with torch.no_grad():
        result = qkv_fusion.apply(gm, inputs)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert result.detail == "fused 3 linears into 1 (q+k+v)"
    assert count(gm, F.linear) == 2 and count(gm, torch.split) == 1
    fused = dict(gm.named_buffers())["_opprof_qkv_weight0"]
    assert fused.shape == (64, 16)  # concatenated once, from the real parameter values
    torch.testing.assert_close(fused[:16], model.q.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(gm(*inputs)[0], model(x), rtol=RTOL, atol=ATOL)


def test_two_groups_on_two_inputs(dynamo_graph: DynamoCapture) -> None:
    a, b, c, d = (torch.nn.Linear(8, 8) for _ in range(4))

    def two_pairs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return a(x) * b(x) + c(y) - d(y)

    x, y = torch.randn(3, 8), torch.randn(3, 8)
    gm, inputs = dynamo_graph(two_pairs, x, y)
    with torch.no_grad():
        result = qkv_fusion.apply(gm, inputs)
    assert (result.status, result.matches) == ("APPLIED", 2)
    assert count(gm, F.linear) == 2
    torch.testing.assert_close(gm(*inputs)[0], two_pairs(x, y), rtol=RTOL, atol=ATOL)


def test_under_autograd_concatenates_in_the_graph(dynamo_graph: DynamoCapture) -> None:
    model, x = QKV(), torch.randn(2, 5, 16)
    gm, inputs = dynamo_graph(model, x)
    result = qkv_fusion.apply(gm, inputs)  # grad enabled, weights require grad
    assert result.matches == 1
    assert count(gm, torch.cat) == 2  # weights and biases, so gradients still reach them
    assert not any(name.startswith("_opprof") for name, _ in gm.named_buffers())
    torch.testing.assert_close(gm(*inputs)[0], model(x), rtol=RTOL, atol=ATOL)


def test_call_module_linears() -> None:
    model = QKV().eval()
    gm = torch.fx.symbolic_trace(model)  # nn.Linear stays call_module here
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        result = qkv_fusion.apply(gm, [x])
    assert result.matches == 1
    assert sum(1 for n in gm.graph.nodes if n.op == "call_module") == 1  # only o remains
    torch.testing.assert_close(gm(x), model(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["different inputs", "bias on one only", "view needs copy"])
def test_leaves_graph_alone_without_the_pattern(dynamo_graph: DynamoCapture, case: str) -> None:
    p, q = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    no_bias = torch.nn.Linear(8, 8, bias=False)

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if case == "different inputs":
            return p(x) + q(y)
        if case == "bias on one only":
            return p(x) + no_bias(x)
        # a split slice of [N, T, 16] is not viewable as [-1]: fusing would break this view
        return p(x).view(-1) + q(x).view(-1)

    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    gm, inputs = dynamo_graph(fn, x, y)
    code = gm.code
    with torch.no_grad():
        result = qkv_fusion.apply(gm, inputs)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_get_attr_weights_when_freezing_while_tracing(dynamo_graph: DynamoCapture) -> None:
    """With Inductor freezing on while Dynamo traces, weights are ``get_attr`` nodes."""
    model, x = QKV().eval(), torch.randn(2, 5, 16)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        gm, inputs = dynamo_graph(model, x)
        assert any(n.op == "get_attr" for n in gm.graph.nodes)
        result = qkv_fusion.apply(gm, inputs)
        out = gm(*inputs)[0]
    assert result.matches == 1
    stale = [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert stale == []  # the per-projection weights are no longer read
    torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)
