"""depthwise_taps on aten graphs: which convolutions it rewrites into sums of shifted taps, that
the rewrite computes the convolution (fp32, bf16, channels_last, strides, dilation, rectangular
geometry), and end to end through the backend, where Inductor makes the taps, the bias and the
activation after them one kernel."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from pass_helpers import AtenTrace, count, output_node, without_fake_value
from torch.fx.experimental.proxy_tensor import make_fx

from pytest_opprof.passes import depthwise_taps
from pytest_opprof.passes.base import PassResult

aten = torch.ops.aten
prims = torch.ops.prims
RTOL, ATOL = 1e-5, 1e-5
BF16: dict[str, Any] = {"rtol": 1.6e-2, "atol": 2e-2}
NOT_FOUND = "no depthwise convolution of at most 25 taps and 32 channels"


@dataclass(frozen=True)
class Depthwise:
    """A depthwise convolution (multiplier 1) of an ``x``-shaped input by a ``kernel``."""

    x: tuple[int, int, int, int]
    kernel: tuple[int, int]
    bias: bool = False
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    @property
    def channels(self) -> int:
        return self.x[1]

    @property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1]

    def args(self, dtype: torch.dtype = torch.float32) -> list[Any]:
        c = self.channels
        b = torch.randn(c, dtype=dtype) if self.bias else None
        return [torch.randn(self.x, dtype=dtype), torch.randn(c, 1, *self.kernel, dtype=dtype), b]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, groups=self.channels)


CASES: dict[str, Depthwise] = {
    "3x3": Depthwise((2, 8, 9, 9), (3, 3), padding=(1, 1)),
    "5x5 stride 2 bias": Depthwise(
        (2, 6, 11, 11), (5, 5), bias=True, stride=(2, 2), padding=(2, 2)
    ),
    "dilated": Depthwise((1, 4, 10, 10), (3, 3), padding=(2, 2), dilation=(2, 2)),
    # every geometry parameter different along H and W, so a swapped pair shows
    "rectangular": Depthwise(
        (1, 5, 9, 11), (3, 2), bias=True, stride=(2, 1), padding=(1, 0), dilation=(1, 2)
    ),
    "unpadded": Depthwise((2, 3, 7, 8), (3, 3)),
}


def _detail(n: int, taps: str, channels: str) -> str:
    return f"{n} depthwise convolution(s) as {taps}-tap sums (channels {channels})"


def _rewritten(
    result: PassResult,
    gm: torch.fx.GraphModule,
    matches: int,
    taps: int,
    without_val: frozenset[str] = frozenset(),
) -> None:
    """Applied ``matches`` times, ``taps`` products in all; no convolution left; every node but
    ``without_val`` (added by others) has its fake value."""
    assert (result.status, result.matches) == ("APPLIED", matches)
    assert count(gm, aten.convolution) == 0
    assert count(gm, aten.mul) == taps
    assert count(gm, aten.stack, aten.cat) == 0
    assert without_fake_value(gm) == without_val


@pytest.mark.parametrize("case", list(CASES))
def test_rewrites_a_depthwise_convolution(aten_graph: AtenTrace, case: str) -> None:
    conv = CASES[case]
    args = conv.args()
    gm = aten_graph(conv, *args)
    assert count(gm, aten.convolution) == 1
    out_val = output_node(gm).meta["val"]

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 1, conv.taps)
    assert result.detail == _detail(1, str(conv.taps), str(conv.channels))
    assert count(gm, aten.constant_pad_nd) == (conv.padding != (0, 0))
    assert count(gm, prims.convert_element_type) == 0  # fp32 computes in fp32
    new_val = output_node(gm).meta["val"]
    assert (new_val.shape, new_val.dtype) == (out_val.shape, out_val.dtype)
    assert new_val.stride() == out_val.stride()
    torch.testing.assert_close(gm(*args), conv(*args), rtol=RTOL, atol=ATOL)


def test_bf16_computes_in_fp32(aten_graph: AtenTrace) -> None:
    conv = CASES["5x5 stride 2 bias"]
    args = conv.args(torch.bfloat16)
    gm = aten_graph(conv, *args)

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 1, conv.taps)
    # the input, the weight and the bias up to fp32, the sum back down
    assert count(gm, prims.convert_element_type) == 4
    products = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert {n.meta["val"].dtype for n in products} == {torch.float32}
    assert output_node(gm).meta["val"].dtype == torch.bfloat16
    got = gm(*args)
    assert got.dtype == torch.bfloat16
    x, w, b = args
    expected = conv(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), expected, **BF16)


def test_fp64_stays_fp64(aten_graph: AtenTrace) -> None:
    conv = CASES["rectangular"]
    args = conv.args(torch.float64)
    gm = aten_graph(conv, *args)

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 1, conv.taps)
    assert count(gm, prims.convert_element_type) == 0
    torch.testing.assert_close(gm(*args), conv(*args), rtol=1e-12, atol=1e-12)


def test_channels_last_in_channels_last_out(aten_graph: AtenTrace) -> None:
    conv = CASES["5x5 stride 2 bias"]
    x, w, b = conv.args()
    args = [t.contiguous(memory_format=torch.channels_last) for t in (x, w)] + [b]
    gm = aten_graph(conv, *args)

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 1, conv.taps)
    assert output_node(gm).meta["val"].is_contiguous(memory_format=torch.channels_last)
    got = gm(*args)
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, conv(x, w, b), rtol=RTOL, atol=ATOL)


def test_weight_behind_inductors_channels_last_clone(aten_graph: AtenTrace) -> None:
    """With freezing on, Inductor feeds a weight that is not channels_last through a clone it
    inserts without a fake value; the pass computes the value and still applies. (A depthwise
    weight ``[C, 1, kh, kw]`` stored contiguously already counts as channels_last: this one
    is a transposed view.)"""
    from torch._inductor.freezing import convert_conv_weights_to_channels_last

    conv = CASES["3x3"]
    x, w, b = conv.args()
    args = [x, w.transpose(2, 3), b]
    assert not args[1].is_contiguous(memory_format=torch.channels_last)
    gm = aten_graph(lambda *a: (conv(*a),), *args)  # Inductor's graphs return a tuple
    convert_conv_weights_to_channels_last(gm)
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 1 and "val" not in clones[0].meta
    # the output's stride guard that the same Inductor function adds has none either
    unknown = {n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta}
    others = frozenset(unknown - {clones[0].name})

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 1, conv.taps, others)
    torch.testing.assert_close(gm(*args)[0], conv(*args), rtol=RTOL, atol=ATOL)


def _one_group(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


def _multiplier_2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1, groups=4)


def _two_groups(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1, groups=2)


def _seven_by_seven(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=3, groups=4)


def _depthwise_33(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1, groups=33)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv_transpose2d(x, w, padding=1, groups=4)


LEFT_ALONE: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {
    "one group": (_one_group, [torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3)]),
    "one channel": (_one_group, [torch.randn(1, 1, 6, 6), torch.randn(1, 1, 3, 3)]),
    "multiplier 2": (_multiplier_2, [torch.randn(1, 4, 6, 6), torch.randn(8, 1, 3, 3)]),
    "two groups": (_two_groups, [torch.randn(1, 4, 6, 6), torch.randn(4, 2, 3, 3)]),
    "7x7 (49 taps)": (_seven_by_seven, [torch.randn(1, 4, 9, 9), torch.randn(4, 1, 7, 7)]),
    "transposed": (_transposed, [torch.randn(1, 4, 5, 5), torch.randn(4, 1, 3, 3)]),
    # cuDNN's kernel wins over this many channels (knowledge.DEPTHWISE_MAX_CHANNELS)
    "33 channels": (_depthwise_33, [torch.randn(1, 33, 4, 4), torch.randn(33, 1, 3, 3)]),
}


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_leaves_other_convolutions_alone(aten_graph: AtenTrace, case: str) -> None:
    fn, args = LEFT_ALONE[case]
    gm = aten_graph(fn, *args)
    assert count(gm, aten.convolution) == 1
    code = gm.code

    result = depthwise_taps.apply(gm, args)

    assert (result.status, result.matches, result.detail) == ("NOT_APPLIED", 0, NOT_FOUND)
    assert gm.code == code
    assert count(gm, aten.convolution) == 1


def test_leaves_symbolic_shapes_and_graphs_without_fake_values_alone(
    aten_graph: AtenTrace,
) -> None:
    conv = CASES["3x3"]
    args = conv.args()
    with torch.no_grad():
        symbolic = make_fx(conv, tracing_mode="symbolic")(*args)
    bare = aten_graph(conv, *args)
    for node in bare.graph.nodes:
        node.meta.clear()
    for gm in (symbolic, bare):
        assert count(gm, aten.convolution) == 1
        code = gm.code
        result = depthwise_taps.apply(gm, args)
        assert (result.status, result.detail) == ("NOT_APPLIED", NOT_FOUND)
        assert gm.code == code


# The larger tap and channel counts come first in these graphs, so that a detail listed in
# the order found (a set's order, here) differs from the sorted one.


def two_depthwise(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    y = F.hardtanh(F.conv2d(x, w1, padding=2, groups=8), 0.0, 6.0)
    return F.conv2d(y, w2, b2, stride=2, padding=1, groups=8)


def depthwise_then_pointwise(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.conv2d(torch.relu(F.conv2d(x, w1, padding=1, groups=8)), w2)


def depthwise_project_depthwise(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    y = F.conv2d(torch.relu(F.conv2d(x, w1, padding=1, groups=16)), w2)
    return F.conv2d(torch.relu(y), w3, padding=1, groups=8)


def test_two_depthwise_convolutions(aten_graph: AtenTrace) -> None:
    args = [
        torch.randn(2, 8, 10, 10),
        torch.randn(8, 1, 5, 5),
        torch.randn(8, 1, 3, 3),
        torch.randn(8),
    ]
    gm = aten_graph(two_depthwise, *args)

    result = depthwise_taps.apply(gm, args)

    _rewritten(result, gm, 2, 9 + 25)
    assert result.detail == _detail(2, "9, 25", "8")
    torch.testing.assert_close(gm(*args), two_depthwise(*args), rtol=RTOL, atol=ATOL)


def test_only_the_depthwise_convolution_of_two(aten_graph: AtenTrace) -> None:
    args = [torch.randn(2, 8, 8, 8), torch.randn(8, 1, 3, 3), torch.randn(16, 8, 1, 1)]
    gm = aten_graph(depthwise_then_pointwise, *args)

    result = depthwise_taps.apply(gm, args)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert result.detail == _detail(1, "9", "8")
    (left,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert left.args[1].name == "w2_1"  # the pointwise convolution is the one left
    assert count(gm, aten.mul) == 9
    expected = depthwise_then_pointwise(*args)
    torch.testing.assert_close(gm(*args), expected, rtol=RTOL, atol=ATOL)


def test_lists_each_channel_count(aten_graph: AtenTrace) -> None:
    args = [
        torch.randn(2, 16, 8, 8),
        torch.randn(16, 1, 3, 3),
        torch.randn(8, 16, 1, 1),
        torch.randn(8, 1, 3, 3),
    ]
    gm = aten_graph(depthwise_project_depthwise, *args)

    result = depthwise_taps.apply(gm, args)

    assert (result.status, result.matches) == ("APPLIED", 2)
    assert result.detail == _detail(2, "9", "8, 16")
    assert count(gm, aten.convolution) == 1
    torch.testing.assert_close(gm(*args), depthwise_project_depthwise(*args), rtol=RTOL, atol=ATOL)


def _randomize_batch_norms(model: torch.nn.Module) -> None:
    for bn in model.modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            mean, var = bn.running_mean, bn.running_var
            assert mean is not None and var is not None  # tracked statistics
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
                mean.uniform_(-0.5, 0.5)
                var.uniform_(0.5, 1.5)


class Block(torch.nn.Module):
    """MobileNetV2's inverted residual, without the residual: expand, depthwise 3×3, project,
    then a 5×5 stride-2 depthwise convolution with a bias."""

    def __init__(self, c: int = 8, expand: int = 2) -> None:
        super().__init__()
        hidden = c * expand
        self.expand = torch.nn.Conv2d(c, hidden, 1, bias=False)
        self.dw3 = torch.nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn = torch.nn.BatchNorm2d(hidden)
        self.project = torch.nn.Conv2d(hidden, c, 1)
        self.dw5 = torch.nn.Conv2d(c, c, 5, stride=2, padding=2, groups=c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn(self.dw3(F.relu6(self.expand(x)))))
        return F.relu6(self.dw5(self.project(y)))


def _registered() -> None:
    from pytest_opprof.passes import REGISTRY

    if depthwise_taps.NAME not in REGISTRY:
        pytest.skip(f"{depthwise_taps.NAME!r} is not in pytest_opprof.passes.REGISTRY yet")


@pytest.mark.parametrize("freezing", [False, True], ids=["no freezing", "freezing"])
def test_end_to_end_through_inductor(freezing: bool) -> None:
    """Inductor lowers every node the pass emits, without freezing and with it (where the
    weight side folds into constants and the weights arrive through Inductor's clone)."""
    from pytest_opprof.backend.compiler import make_backend

    _registered()
    model = Block().eval().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    _randomize_batch_norms(model)
    x = torch.randn(2, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    results: list[PassResult] = []
    backend = make_backend(
        aten=[depthwise_taps.NAME], config_patches={"freezing": freezing}, results=results
    )
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        expected = model(x)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 2)]
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class DepthwiseBnRelu6(torch.nn.Module):
    def __init__(self, c: int, kernel: int, stride: int = 1) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(
            c, c, kernel, stride=stride, padding=kernel // 2, groups=c, bias=False
        )
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.bn(self.dw(x)))


@pytest.mark.parametrize("freezing", [False, True], ids=["no freezing", "freezing"])
def test_one_kernel_for_the_taps_the_batch_norm_and_the_activation(freezing: bool) -> None:
    """What the pass is for: Inductor generates one kernel for the depthwise convolution and
    the batch norm and ReLU6 after it, and calls no convolution."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    from pytest_opprof.backend.compiler import make_backend

    _registered()
    model = DepthwiseBnRelu6(16, 3).eval().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    _randomize_batch_norms(model)
    x = torch.randn(2, 16, 10, 10).contiguous(memory_format=torch.channels_last)
    results: list[PassResult] = []
    backend = make_backend(
        aten=[depthwise_taps.NAME], config_patches={"freezing": freezing}, results=results
    )
    with torch.no_grad(), fresh_cache():
        got, (code,) = run_and_get_code(torch.compile(model, backend=backend), x)
        expected = model(x)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    assert code.count("async_compile.cpp_pybinding(") == 1
    assert "convolution" not in code
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


MOBILENET: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "3x3": (lambda: DepthwiseBnRelu6(64, 3), (16, 64, 56, 56)),
    "5x5-stride2": (lambda: DepthwiseBnRelu6(64, 5, stride=2), (16, 64, 56, 56)),
}
"""MobileNet-style depthwise blocks (depthwise convolution, batch norm, ReLU6): the
convolutions the pass is for."""


@pytest.mark.gpu
@pytest.mark.parametrize("block", list(MOBILENET))
def test_a_bf16_mobilenet_block_on_the_gpu(block: str) -> None:
    """On the GPU at bf16 channels_last, with freezing as selection builds it: the taps lower
    through Inductor and Triton and agree with cuDNN's convolution at bf16."""
    from pytest_opprof.backend.compiler import make_backend

    _registered()
    make, shape = MOBILENET[block]
    model = make().eval()
    _randomize_batch_norms(model)
    model = model.to("cuda", torch.bfloat16).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    results: list[PassResult] = []
    backend = make_backend(
        aten=[depthwise_taps.NAME], config_patches={"freezing": True}, results=results
    )
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
