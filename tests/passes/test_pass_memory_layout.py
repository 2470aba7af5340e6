"""memory_layout: the aten graph pass and the non-graph channels_last conversion."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, count

from pytest_opprof.passes import memory_layout

aten = torch.ops.aten


def two_convs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    y = torch.relu(F.conv2d(x, w1, padding=1))
    return F.conv2d(y, w2) + F.conv2d(y, w2 * 2)


def test_marks_conv_inputs_channels_last(aten_graph: AtenTrace) -> None:
    args = [torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(5, 4, 3, 3)]
    gm = aten_graph(two_convs, *args)
    result = memory_layout.apply(gm, args)

    assert (result.status, result.matches) == ("APPLIED", 3)
    # one clone for the graph input, one shared by the two convolutions that read y
    assert result.detail == "3 convolution(s) read channels_last (2 clone(s), 1 of a graph input)"
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert [c.kwargs["memory_format"] for c in clones] == [torch.channels_last] * 2
    torch.testing.assert_close(gm(*args), two_convs(*args), rtol=1e-5, atol=1e-5)


def test_leaves_nhwc_and_conv_free_graphs_alone(aten_graph: AtenTrace) -> None:
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    for gm in (aten_graph(F.conv2d, x, w), aten_graph(torch.relu, torch.randn(2, 3, 8, 8))):
        code = gm.code
        result = memory_layout.apply(gm, [])
        assert (result.status, result.matches) == ("NOT_APPLIED", 0)
        assert gm.code == code
    assert count(gm, aten.clone) == 0


def test_apply_model_converts_model_and_inputs() -> None:
    first = torch.nn.Conv2d(3, 4, 3)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    new_model, (new_x,), result = memory_layout.apply_model(model, (x,))

    assert (result.status, result.matches) == ("APPLIED", 3)  # two conv weights, one input
    assert new_x.is_contiguous(memory_format=torch.channels_last)
    assert first.weight.is_contiguous(memory_format=torch.channels_last)  # converted in place
    torch.testing.assert_close(new_model(new_x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_model(x), expected, rtol=1e-5, atol=1e-5)  # original input


def test_apply_model_without_4d_tensors() -> None:
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    same, inputs, result = memory_layout.apply_model(model, (x,))
    assert (same, inputs, result.status, result.matches) == (model, (x,), "NOT_APPLIED", 0)
