"""conv_im2col on aten graphs: which convolutions it rewrites into im2col + GEMM, that the
rewrite computes the convolution (fp32, bf16, channels_last, strides, dilation, patchify), and
end to end through the backend."""

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

from pytest_opprof.passes import conv_im2col
from pytest_opprof.passes.base import PassResult

aten = torch.ops.aten
RTOL, ATOL = 1e-5, 1e-5
BF16: dict[str, Any] = {"rtol": 1.6e-2, "atol": 2e-2}
NOT_FOUND = "no convolution with fewer than 8 input channels"


@dataclass(frozen=True)
class Conv:
    x: tuple[int, ...]
    w: tuple[int, ...]
    bias: bool = False
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    def args(self, dtype: torch.dtype = torch.float32) -> list[Any]:
        b = torch.randn(self.w[0], dtype=dtype) if self.bias else None
        return [torch.randn(self.x, dtype=dtype), torch.randn(self.w, dtype=dtype), b]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation)


CASES: dict[str, tuple[Conv, str, str]] = {  # convolution, channels, K in the detail
    "stem 3x3": (Conv((2, 3, 8, 8), (8, 3, 3, 3), padding=(1, 1)), "3 input channel(s)", "27 → 32"),
    "7x7 stride 2 bias": (
        Conv((2, 3, 15, 15), (4, 3, 7, 7), bias=True, stride=(2, 2), padding=(3, 3)),
        "3 input channel(s)",
        "147 → 152",
    ),
    "dilated": (
        Conv((1, 1, 9, 9), (4, 1, 3, 3), padding=(2, 2), dilation=(2, 2)),
        "1 input channel(s)",
        "9 → 16",
    ),
    "patchify": (
        Conv((2, 3, 32, 32), (8, 3, 16, 16), stride=(16, 16)),
        "3 input channel(s)",
        "768",
    ),
    # every geometry parameter different along H and W, so a swapped pair shows
    "rectangular": (
        Conv((1, 2, 7, 9), (5, 2, 3, 2), bias=True, stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        "2 input channel(s)",
        "12 → 16",
    ),
}


def _detail(n: int, channels: str, k: str) -> str:
    return f"{n} convolution(s) over {channels} as im2col + GEMM (K {k})"


def _rewritten(
    result: PassResult,
    gm: torch.fx.GraphModule,
    matches: int,
    without_val: frozenset[str] = frozenset(),
) -> None:
    """Applied ``matches`` times; no convolution left; every node but ``without_val`` (added
    by others) has its fake value."""
    assert (result.status, result.matches) == ("APPLIED", matches)
    assert count(gm, aten.convolution) == 0
    assert count(gm, aten.mm, aten.addmm) == matches
    assert without_fake_value(gm) == without_val


@pytest.mark.parametrize("case", list(CASES))
def test_rewrites_a_few_channel_convolution(aten_graph: AtenTrace, case: str) -> None:
    conv, channels, k = CASES[case]
    args = conv.args()
    gm = aten_graph(conv, *args)
    assert count(gm, aten.convolution) == 1
    out_val = output_node(gm).meta["val"]

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 1)
    assert count(gm, aten.addmm if conv.bias else aten.mm) == 1
    assert result.detail == _detail(1, channels, k)
    new_val = output_node(gm).meta["val"]
    assert (new_val.shape, new_val.dtype) == (out_val.shape, out_val.dtype)
    got = gm(*args)
    assert got.is_contiguous(memory_format=torch.channels_last)  # a view of the GEMM's rows
    torch.testing.assert_close(got, conv(*args), rtol=RTOL, atol=ATOL)


def test_bf16(aten_graph: AtenTrace) -> None:
    conv = CASES["7x7 stride 2 bias"][0]
    args = conv.args(torch.bfloat16)
    gm = aten_graph(conv, *args)

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 1)
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"]
    assert {v.dtype for v in vals} == {torch.bfloat16}  # computed in the convolution's dtype
    got = gm(*args)
    assert got.dtype == torch.bfloat16
    x, w, b = args
    expected = conv(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), expected, **BF16)


def test_channels_last_input_and_weight(aten_graph: AtenTrace) -> None:
    conv = CASES["stem 3x3"][0]
    x, w, _ = conv.args()
    args = [t.contiguous(memory_format=torch.channels_last) for t in (x, w)] + [None]
    gm = aten_graph(conv, *args)

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 1)
    torch.testing.assert_close(gm(*args), conv(x, w, None), rtol=RTOL, atol=ATOL)


def test_weight_behind_inductors_channels_last_clone(aten_graph: AtenTrace) -> None:
    """With freezing on, Inductor feeds the weights through a clone it inserts without a fake
    value; the pass computes the value and still applies."""
    from torch._inductor.freezing import convert_conv_weights_to_channels_last

    conv = CASES["stem 3x3"][0]
    args = conv.args()
    gm = aten_graph(lambda *a: (conv(*a),), *args)  # Inductor's graphs return a tuple
    convert_conv_weights_to_channels_last(gm)
    (clone,) = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert "val" not in clone.meta
    # the output's stride guard that the same Inductor function adds has none either
    unknown = {n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta}
    others = frozenset(unknown - {clone.name})

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 1, others)
    torch.testing.assert_close(gm(*args)[0], conv(*args), rtol=RTOL, atol=ATOL)


def _eight_channels(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv_transpose2d(x, w, padding=1)


def _depthwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w, padding=1, groups=4)


LEFT_ALONE: dict[str, tuple[Callable[..., torch.Tensor], list[torch.Tensor]]] = {
    "8 channels": (_eight_channels, [torch.randn(1, 8, 6, 6), torch.randn(4, 8, 3, 3)]),
    "depthwise": (_depthwise, [torch.randn(1, 4, 6, 6), torch.randn(4, 1, 3, 3)]),
    "transposed": (_transposed, [torch.randn(1, 3, 5, 5), torch.randn(3, 4, 3, 3)]),
}


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_leaves_other_convolutions_alone(aten_graph: AtenTrace, case: str) -> None:
    fn, args = LEFT_ALONE[case]
    gm = aten_graph(fn, *args)
    assert count(gm, aten.convolution) == 1
    code = gm.code

    result = conv_im2col.apply(gm, args)

    assert (result.status, result.matches, result.detail) == ("NOT_APPLIED", 0, NOT_FOUND)
    assert gm.code == code
    assert count(gm, aten.convolution) == 1


def test_leaves_symbolic_shapes_and_graphs_without_fake_values_alone(
    aten_graph: AtenTrace,
) -> None:
    conv = CASES["stem 3x3"][0]
    args = conv.args()
    with torch.no_grad():
        symbolic = make_fx(conv, tracing_mode="symbolic")(*args)
    bare = aten_graph(conv, *args)
    for node in bare.graph.nodes:
        node.meta.clear()
    for gm in (symbolic, bare):
        code = gm.code
        result = conv_im2col.apply(gm, args)
        assert (result.status, result.detail) == ("NOT_APPLIED", NOT_FOUND)
        assert gm.code == code


def two_stems(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    return F.conv2d(x, w1, padding=1) + F.conv2d(x, w2, b2, padding=1)


def stem_then_body(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.conv2d(torch.relu(F.conv2d(x, w1, padding=1)), w2)


def test_two_matching_convolutions(aten_graph: AtenTrace) -> None:
    args = [
        torch.randn(2, 3, 8, 8),
        torch.randn(4, 3, 3, 3),
        torch.randn(4, 3, 3, 3),
        torch.randn(4),
    ]
    gm = aten_graph(two_stems, *args)

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 2)
    assert result.detail == _detail(2, "3 input channel(s)", "27 → 32")
    assert (count(gm, aten.mm), count(gm, aten.addmm)) == (1, 1)
    torch.testing.assert_close(gm(*args), two_stems(*args), rtol=RTOL, atol=ATOL)


def test_only_the_few_channel_convolution_of_two(aten_graph: AtenTrace) -> None:
    args = [torch.randn(2, 3, 8, 8), torch.randn(8, 3, 3, 3), torch.randn(5, 8, 3, 3)]
    gm = aten_graph(stem_then_body, *args)

    result = conv_im2col.apply(gm, args)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert result.detail == _detail(1, "3 input channel(s)", "27 → 32")
    (left,) = [n for n in gm.graph.nodes if n.target is aten.convolution.default]
    assert left.args[1].name == "w2_1"  # the 8-channel convolution is the one left
    assert count(gm, aten.mm) == 1
    torch.testing.assert_close(gm(*args), stem_then_body(*args), rtol=RTOL, atol=ATOL)


def test_lists_each_channel_count_and_k(aten_graph: AtenTrace) -> None:
    args = [torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(5, 4, 3, 3)]
    gm = aten_graph(stem_then_body, *args)

    result = conv_im2col.apply(gm, args)

    _rewritten(result, gm, 2)
    assert result.detail == _detail(2, "3, 4 input channel(s)", "27 → 32, 36 → 40")
    torch.testing.assert_close(gm(*args), stem_then_body(*args), rtol=RTOL, atol=ATOL)


class Stem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.body = torch.nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.stem(x)))


@pytest.mark.parametrize("freezing", [False, True], ids=["no freezing", "freezing"])
def test_end_to_end_through_inductor(freezing: bool) -> None:
    """Inductor lowers every node the pass emits, without freezing and with it (where the
    weight side folds into a constant and the weights arrive through Inductor's clone)."""
    from pytest_opprof.backend.compiler import make_backend

    model = Stem().eval().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    results: list[PassResult] = []
    backend = make_backend(
        aten=[conv_im2col.NAME], config_patches={"freezing": freezing}, results=results
    )
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        expected = model(x)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


STEMS: dict[str, tuple[Callable[[], torch.nn.Conv2d], tuple[int, ...]]] = {
    "3x3": (lambda: torch.nn.Conv2d(3, 64, 3, padding=1, bias=False), (16, 3, 64, 64)),
    "7x7-stride2": (
        lambda: torch.nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        (8, 3, 224, 224),
    ),
    "patchify": (lambda: torch.nn.Conv2d(3, 768, 16, stride=16), (8, 3, 224, 224)),
}
"""A VGG stem, ResNet's, and a ViT-B/16 patch embedding: the convolutions the pass is for."""


@pytest.mark.gpu
@pytest.mark.parametrize("stem", list(STEMS))
def test_a_bf16_stem_on_the_gpu(stem: str) -> None:
    """On the GPU, with freezing as selection builds it: the gather and GEMM lower through
    Inductor and Triton and agree with cuDNN's convolution at bf16."""
    from pytest_opprof.backend.compiler import make_backend

    make, shape = STEMS[stem]
    model = make().to("cuda", torch.bfloat16).eval()
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    results: list[PassResult] = []
    backend = make_backend(
        aten=[conv_im2col.NAME], config_patches={"freezing": True}, results=results
    )
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
