"""stub_detection reports what no pass transforms and never touches the graph."""

from __future__ import annotations

import torch
import torch.fx
from pass_helpers import AtenTrace, DynamoCapture

from pytest_opprof.passes import stub_detection


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def test_custom_autograd_function(dynamo_graph: DynamoCapture) -> None:
    lin = torch.nn.Linear(4, 4)
    gm, inputs = dynamo_graph(lambda x: Double.apply(lin(x)).sum(), torch.randn(2, 4))
    code = gm.code
    result = stub_detection.apply(gm, inputs)
    assert (result.status, result.matches) == ("NOT_APPLIED", 1)
    assert result.detail == "higher-order op: autograd_function_apply x1"
    assert result.log_line() == "WARNING [pass_stub_detection] Pattern not found"
    assert gm.code == code


def test_recurrent_and_data_dependent(aten_graph: AtenTrace) -> None:
    lstm = torch.nn.LSTM(4, 4, batch_first=True)
    weights = list(lstm._flat_weights)

    def rnn(x: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(1, x.shape[0], 4)
        return torch._VF.lstm(x, (h, h), w, True, 1, 0.0, False, False, True)[0]

    gm = aten_graph(rnn, torch.randn(2, 3, 4), *weights, decompose=False)
    found = stub_detection.scan(gm)
    assert any(key.startswith("recurrent: aten.") for key in found)  # mkldnn_rnn_layer on CPU

    traced = torch.fx.symbolic_trace(lambda x: x * x.sum().item() + x.nonzero().sum())
    result = stub_detection.apply(traced, [])
    assert result.matches == 2
    assert result.detail == "data-dependent: .item() x1; data-dependent: .nonzero() x1"


def test_clean_graph(aten_graph: AtenTrace) -> None:
    gm = aten_graph(lambda x: torch.relu(x) @ x, torch.randn(3, 3))
    result = stub_detection.apply(gm, [])
    assert (result.status, result.matches, result.detail) == (
        "NOT_APPLIED",
        0,
        "nothing untransformable",
    )
