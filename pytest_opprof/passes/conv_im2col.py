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

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.knowledge import FEW_CHANNELS
from pytest_opprof.passes.base import PassResult, run_graph_pass
from pytest_opprof.passes.matching import Conv2d, Emit, replace_conv2ds

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
    sites = replace_conv2ds(gm, _accepts, _im2col_gemm)
    if not sites:
        return 0, f"no convolution with fewer than {MIN_CHANNELS} input channels"
    reductions = sorted({(_k(site), _aligned(_k(site))) for site in sites})
    ks = ", ".join(f"{k} → {kp}" if kp != k else str(k) for k, kp in reductions)
    cs = ", ".join(str(c) for c in sorted({site.channels for site in sites}))
    n = len(sites)
    return n, f"{n} convolution(s) over {cs} input channel(s) as im2col + GEMM (K {ks})"


def _accepts(site: Conv2d) -> bool:
    return site.groups == 1 and site.channels < MIN_CHANNELS


def _k(site: Conv2d) -> int:
    """The GEMM's reduction: channels × kernel area, the length of ``weight.reshape(Cout, K)``."""
    _, c, kh, kw = site.weight_shape
    return c * kh * kw


def _aligned(k: int) -> int:
    return -(-k // K_ALIGN) * K_ALIGN


def _im2col_gemm(call: Emit, site: Conv2d) -> torch.fx.Node:
    """The replacement of one convolution, built at the graph's insertion point."""
    n, cout, ho, wo = site.out
    k, kp = _k(site), _aligned(_k(site))

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


def _patch_matrix(call: Emit, site: Conv2d) -> torch.fx.Node:
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
    _, _, kh, kw = site.weight_shape
    (sh, sw), (ph, pw), (dh, dw) = site.stride, site.padding, site.dilation
    k, kp = _k(site), _aligned(_k(site))
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
