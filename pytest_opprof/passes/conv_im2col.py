"""conv_im2col: a 2-D convolution over few input channels as an explicit im2col gather and one
GEMM, for the convolutions (a network's stem, a ViT's patch embedding) whose tensor-core
kernels run mostly on zero padding.

Each ``aten.convolution`` that is not transposed, has one group, 4-D operands of static shape,
a floating dtype and fewer than ``MIN_CHANNELS`` input channels becomes, in its own dtype, the
patch matrix ``[N·Ho·Wo, Kp]`` (the zero-padded input's window under each output pixel,
channel-major then kh, kw: the order of ``weight.reshape(Cout, K)``; K = C·kh·kw zero-padded to
Kp, a multiple of ``K_ALIGN``) times the weight as ``[Kp, Cout]`` through ``mm`` (``addmm``
with a bias), viewed back as the convolution's ``[N, Cout, Ho, Wo]`` with channels_last strides.
The patch matrix is pointwise code alone (a pad, indexing views, one copy), which Inductor
fuses into one kernel; the weight side reads the weight alone and folds into a constant under
freezing. The rewrite is exact up to the GEMM's summation order; whether it is faster depends
on the shapes and the device, which selection measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from pytest_opprof.knowledge import FEW_CHANNELS
from pytest_opprof.passes.base import (
    PassResult,
    fake_value,
    is_op,
    meta_key,
    run_graph_pass,
    set_fake_value,
)

NAME = "conv_im2col"
aten = torch.ops.aten

MIN_CHANNELS = FEW_CHANNELS  # the rule's threshold too: why, in ``knowledge``
# 16-bit GEMM operands need 16-byte-aligned rows: the reduction dimension K is padded with
# zeros to a multiple of 8 elements.
K_ALIGN = 8


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Run each convolution of fewer than ``MIN_CHANNELS`` input channels as im2col + GEMM."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    channels: set[int] = set()
    reductions: set[tuple[int, int]] = set()
    count = 0
    for conv in list(graph.nodes):
        site = _match(conv, key)
        if site is None:
            continue
        with graph.inserting_before(conv):
            out = _im2col_gemm(graph, key, site)
        conv.replace_all_uses_with(out)
        graph.erase_node(conv)
        channels.add(site.kernel[0])
        reductions.add((site.k, _aligned(site.k)))
        count += 1
    if not count:
        return 0, f"no convolution with fewer than {MIN_CHANNELS} input channels"
    ks = ", ".join(f"{k} → {kp}" if kp != k else str(k) for k, kp in sorted(reductions))
    cs = ", ".join(str(c) for c in sorted(channels))
    return count, f"{count} convolution(s) over {cs} input channel(s) as im2col + GEMM (K {ks})"


@dataclass(frozen=True)
class _Site:
    """One matched convolution: its operands and its static geometry."""

    x: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    out: tuple[int, int, int, int]  # N, Cout, Ho, Wo
    kernel: tuple[int, int, int]  # C, kh, kw
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def k(self) -> int:
        c, kh, kw = self.kernel
        return c * kh * kw


def _match(conv: torch.fx.Node, key: str) -> _Site | None:
    if not is_op(conv, aten.convolution) or len(conv.args) != 9 or conv.kwargs:
        return None
    x, w, b, *geometry, transposed, _output_padding, groups = conv.args
    if transposed or groups != 1:
        return None
    if not isinstance(x, torch.fx.Node) or not isinstance(w, torch.fx.Node):
        return None
    if b is not None and not isinstance(b, torch.fx.Node):
        return None
    stride, padding, dilation = (_pair(g) for g in geometry)
    if stride is None or padding is None or dilation is None:
        return None
    xv, out = fake_value(x), fake_value(conv)
    if not (_static_4d(xv) and _static_4d(out)) or not xv.is_floating_point():
        return None
    if xv.shape[1] >= MIN_CHANNELS:  # one group: the input's channels are the weight's
        return None
    wv = _weight_value(w, key)
    if not _static_4d(wv) or not (xv.dtype == wv.dtype == out.dtype):
        return None
    cout, c, kh, kw = wv.shape
    if c != xv.shape[1] or out.shape[1] != cout:
        return None
    if b is not None:
        bv = fake_value(b)
        if not isinstance(bv, torch.Tensor) or bv.dtype != out.dtype or bv.shape != (cout,):
            return None
    n, _, ho, wo = out.shape
    return _Site(x, w, b, (n, cout, ho, wo), (c, kh, kw), stride, padding, dilation)


def _weight_value(w: torch.fx.Node, key: str) -> Any:
    """The weight's fake value. With freezing on, Inductor hands the weights to the
    convolutions through a ``clone`` to channels_last that it inserts without one
    (``convert_conv_weights_to_channels_last``, torch 2.13): it is computed then."""
    inputs_known = all(fake_value(a) is not None for a in w.all_input_nodes)
    if fake_value(w) is None and w.op == "call_function" and inputs_known:
        set_fake_value(w, key)
    return fake_value(w)


def _static_4d(v: Any) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.dim() == 4
        and all(type(s) is int for s in v.shape)  # a SymInt is not an int
    )


def _pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(type(i) is int for i in v):
        return v[0], v[1]
    return None


def _aligned(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def _im2col_gemm(graph: torch.fx.Graph, key: str, site: _Site) -> torch.fx.Node:
    """The replacement of one convolution, built at the graph's insertion point."""

    def call(op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = graph.call_function(op, args, kwargs)
        set_fake_value(node, key)
        return node

    n, cout, ho, wo = site.out
    k, kp = site.k, _aligned(site.k)

    patches = _patch_matrix(call, site)
    # The weight may be channels_last: made contiguous before it is read as [Cout, K].
    wt = call(aten.clone.default, site.weight, memory_format=torch.contiguous_format)
    wt = call(aten.view.default, wt, [cout, k])
    if kp != k:
        wt = call(aten.constant_pad_nd.default, wt, [0, kp - k], 0.0)
    wt = call(aten.permute.default, wt, [1, 0])  # [Kp, Cout]

    if site.bias is not None:
        gemm = call(aten.addmm.default, site.bias, patches, wt)
    else:
        gemm = call(aten.mm.default, patches, wt)
    out = call(aten.view.default, gemm, [n, ho, wo, cout])
    return call(aten.permute.default, out, [0, 3, 1, 2])


def _patch_matrix(call: Callable[..., torch.fx.Node], site: _Site) -> torch.fx.Node:
    """``[N·Ho·Wo, Kp]``: row (n, ho, wo) holds the input window of that output pixel,
    channel-major then kh, kw, zero-padded from K to Kp columns.

    Views of the padded input (``unfold`` per spatial dimension, a strided ``slice`` for
    dilation) and one ``clone``: Inductor lowers ``unfold`` as an indexing view, so the pad,
    the windows, the layout and the K padding are one pointwise kernel. Not one slice per tap
    and a ``stack``: inner compile has no lowering for ``aten.stack`` (Inductor decomposes it
    earlier and refuses a fallback for it), and its decomposition, a ``cat`` of kh·kw inputs,
    becomes a buffer of its own ahead of the transposing copy: ``ConcatKernel``, always on the
    CPU and past ``config.max_pointwise_cat_inputs`` (8) inputs on the GPU (torch 2.13)."""
    n, _, ho, wo = site.out
    _, kh, kw = site.kernel
    (sh, sw), (ph, pw), (dh, dw) = site.stride, site.padding, site.dilation
    k, kp = site.k, _aligned(site.k)
    xp = site.x
    if ph or pw:
        xp = call(aten.constant_pad_nd.default, xp, [pw, pw, ph, ph], 0.0)
    span_h, span_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    windows = call(aten.unfold.default, xp, 2, span_h, sh)  # [N, C, Ho, Wp, span_h]
    windows = call(aten.unfold.default, windows, 3, span_w, sw)  # [N, C, Ho, Wo, span_h, span_w]
    if dh > 1:
        windows = call(aten.slice.Tensor, windows, 4, 0, span_h, dh)
    if dw > 1:
        windows = call(aten.slice.Tensor, windows, 5, 0, span_w, dw)
    patches = call(aten.permute.default, windows, [0, 2, 3, 1, 4, 5])  # [N, Ho, Wo, C, kh, kw]
    patches = call(aten.clone.default, patches, memory_format=torch.contiguous_format)
    patches = call(aten.view.default, patches, [n * ho * wo, k])
    if kp != k:
        patches = call(aten.constant_pad_nd.default, patches, [0, kp - k], 0.0)
    return patches
