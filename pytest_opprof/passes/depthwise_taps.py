"""depthwise_taps: a depthwise 2-D convolution as the weighted sum of its kernel's shifted taps,
pointwise code that Inductor fuses with the convolution's bias and the activation after it.

Each ``aten.convolution`` that is not transposed, has 4-D operands of static shape, one floating
dtype, ``groups == C_in == C_out > 1`` (a depthwise convolution with multiplier 1, weight
``[C, 1, kh, kw]``), at most ``MAX_TAPS`` taps and at most ``MAX_CHANNELS`` channels becomes,
per tap (i, j), the strided window of the zero-padded input at offset ``(i·dh, j·dw)`` times
the weight ``w[:, 0, i, j]`` as ``[1, C, 1, 1]``, summed over the taps, plus the bias. It
computes in fp32 (fp64 stays fp64), as the convolution accumulates, and casts back to the
convolution's dtype once. Every node is a pad, a view or an elementwise op, so Inductor emits
one kernel for the convolution, its bias and the pointwise code that reads it, instead of a
convolution kernel and an elementwise kernel that reads and writes the activation again; the
weight side reads the weight alone and folds into constants under freezing. The result takes
the input's layout (channels_last in, channels_last out), as the convolution's does. The
rewrite is exact up to the order of its summation; whether it is faster depends on the shapes
and the device, which selection measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.knowledge import DEPTHWISE_MAX_CHANNELS, DEPTHWISE_MAX_TAPS
from pytest_opprof.passes.base import PassResult, run_graph_pass
from pytest_opprof.passes.matching import Conv2d, Emit, replace_conv2ds

NAME = "depthwise_taps"
aten = torch.ops.aten
prims = torch.ops.prims

MAX_TAPS = DEPTHWISE_MAX_TAPS  # the rule's bounds too: why, in ``knowledge``
MAX_CHANNELS = DEPTHWISE_MAX_CHANNELS
# Dtypes whose convolution accumulates in fp32; fp32 and fp64 compute in their own dtype.
_ACCUMULATE_IN_FP32 = (torch.float16, torch.bfloat16)
_DTYPES = (*_ACCUMULATE_IN_FP32, torch.float32, torch.float64)


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Run each depthwise convolution of at most ``MAX_TAPS`` taps and ``MAX_CHANNELS``
    channels as a sum of shifted taps."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    sites = replace_conv2ds(gm, _accepts, _tap_sum)
    if not sites:
        return 0, (
            f"no depthwise convolution of at most {MAX_TAPS} taps and {MAX_CHANNELS} channels"
        )
    ts = ", ".join(str(t) for t in sorted({s.weight_shape[2] * s.weight_shape[3] for s in sites}))
    cs = ", ".join(str(c) for c in sorted({site.channels for site in sites}))
    n = len(sites)
    return n, f"{n} depthwise convolution(s) as {ts}-tap sums (channels {cs})"


def _accepts(site: Conv2d) -> bool:
    c = site.channels
    if site.dtype not in _DTYPES or not (site.groups == c == site.out[1] > 1):
        return False  # depthwise, multiplier 1
    if c > MAX_CHANNELS:
        return False  # cuDNN's kernel wins: ``knowledge.DEPTHWISE_MAX_CHANNELS``
    wc, one, kh, kw = site.weight_shape
    return (wc, one) == (c, 1) and kh * kw <= MAX_TAPS  # [C, 1, kh, kw], as the rewrite reads it


def _tap_sum(call: Emit, site: Conv2d) -> torch.fx.Node:
    """The replacement of one convolution, built at the graph's insertion point.

    Pointwise code alone: a pad, strided slices and per-channel multiply-adds, elementwise ops
    that take the input's layout (channels_last in, channels_last out). Not the taps
    stacked and reduced: inner compile has no lowering for ``aten.stack`` (Inductor decomposes
    it earlier and refuses a fallback for it), and its decomposition, a ``cat`` of kh·kw
    inputs, becomes a buffer of its own (``ConcatKernel``, always on the CPU and past
    ``config.max_pointwise_cat_inputs`` inputs on the GPU, torch 2.13)."""
    compute = torch.float32 if site.dtype in _ACCUMULATE_IN_FP32 else site.dtype

    def in_compute_dtype(node: torch.fx.Node) -> torch.fx.Node:
        if site.dtype == compute:
            return node
        return call(prims.convert_element_type.default, node, compute)

    _, c, ho, wo = site.out
    _, _, kh, kw = site.weight_shape
    (sh, sw), (ph, pw), (dh, dw) = site.stride, site.padding, site.dilation

    xp = in_compute_dtype(site.x)
    if ph or pw:
        xp = call(aten.constant_pad_nd.default, xp, [pw, pw, ph, ph], 0.0)
    # The weight as [kh, kw, C], contiguous: each tap's weights are then contiguous over the
    # channels, the innermost dimension of a channels_last activation. Under freezing the copy
    # folds into a constant; without it Inductor inlines it into the one kernel's loads.
    kernels = call(aten.permute.default, in_compute_dtype(site.weight), [1, 2, 3, 0])
    kernels = call(aten.clone.default, kernels, memory_format=torch.contiguous_format)
    kernels = call(aten.select.int, kernels, 0, 0)  # [kh, kw, C]

    acc: torch.fx.Node | None = None
    for i in range(kh):
        rows = call(aten.slice.Tensor, xp, 2, i * dh, i * dh + sh * (ho - 1) + 1, sh)
        kernel_row = call(aten.select.int, kernels, 0, i)  # [kw, C]
        for j in range(kw):
            tap = call(aten.slice.Tensor, rows, 3, j * dw, j * dw + sw * (wo - 1) + 1, sw)
            w_ij = call(aten.select.int, kernel_row, 0, j)  # w[:, 0, i, j]
            w_ij = call(aten.view.default, w_ij, [1, c, 1, 1])
            term = call(aten.mul.Tensor, tap, w_ij)  # [N, C, Ho, Wo]
            acc = term if acc is None else call(aten.add.Tensor, acc, term)
    assert acc is not None  # kh, kw >= 1
    if site.bias is not None:
        bias = call(aten.view.default, in_compute_dtype(site.bias), [1, c, 1, 1])
        acc = call(aten.add.Tensor, acc, bias)
    if site.dtype != compute:
        acc = call(prims.convert_element_type.default, acc, site.dtype)
    return acc
