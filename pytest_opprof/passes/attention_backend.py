"""attention_backend: cuDNN's fused attention replaced by FlashAttention's where flash computes
the same call.

For bf16 / fp16 attention on sm90, PyTorch's dispatcher prefers cuDNN's kernel. Inside a CUDA
graph, each cuDNN attention is preceded by a ``Memset`` node that runs on the copy engine, and
the GPU idles around it; FlashAttention's kernel needs no memset. Which kernel is faster
overall depends on the shape and on the call around it, so this pass is a measured choice, like
every rung (docs/design-notes.md#the-attention-backend).

Pattern (aten level, after AOT decomposition): ``_scaled_dot_product_cudnn_attention(q, k, v,
attn_bias=None, compute_log_sumexp, dropout_p=0, is_causal, return_debug_mask=False, scale)``
whose outputs other than the attention itself are unused (inference), on CUDA bf16 / fp16
tensors with one head size, a multiple of 8 and at most 256 (flash's limits). Rewritten to
``_scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)``, kept only
where the result has the same layout as before (the views after it were traced against it).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    PassResult,
    fake_value,
    is_op,
    meta_key,
    run_graph_pass,
    set_fake_value,
)

NAME = "attention_backend"
aten = torch.ops.aten
LOW = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def apply(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    devices: Sequence[str] = ("cuda",),
) -> PassResult:
    """Move each cuDNN attention that flash can compute onto flash. ``devices``: where both
    kernels exist (CUDA)."""
    return run_graph_pass(NAME, gm, example_inputs, lambda g, _: _rewrite(g, tuple(devices)))


def _rewrite(gm: torch.fx.GraphModule, devices: tuple[str, ...]) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    moved, kept = 0, 0
    for node in list(graph.nodes):
        if not is_op(node, aten._scaled_dot_product_cudnn_attention):
            continue
        call = _flash_call(node, devices)
        if call is None:
            kept += 1
            continue
        args, kwargs = call
        old = _output(node)
        with graph.inserting_before(node):
            flash = graph.call_function(
                aten._scaled_dot_product_flash_attention.default, args, kwargs
            )
            set_fake_value(flash, key)
            out = graph.call_function(operator.getitem, (flash, 0))
            set_fake_value(out, key)
        if old is not None and not _same_layout(old, out):
            graph.erase_node(out)
            graph.erase_node(flash)
            kept += 1
            continue
        if old is not None:
            old.replace_all_uses_with(out)
        for user in list(node.users):
            graph.erase_node(user)
        graph.erase_node(node)
        moved += 1
    if not moved:
        why = f"{kept} cuDNN attention(s) flash cannot compute" if kept else "no cuDNN attention"
        return 0, why
    return moved, f"{moved} cuDNN attention(s) moved to FlashAttention" + (
        f", {kept} left on cuDNN" if kept else ""
    )


def _flash_call(
    node: torch.fx.Node, devices: tuple[str, ...]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The flash call computing the same attention as ``node``, or None where it cannot."""
    names = ("attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask")
    values: dict[str, Any] = dict(zip(names, node.args[3:], strict=False))
    values.update(node.kwargs)
    if values.get("attn_bias") is not None or values.get("return_debug_mask", False):
        return None
    if values.get("dropout_p", 0.0) != 0.0:
        return None
    if any(
        not (u.op == "call_function" and u.target is operator.getitem)
        or (u.args[1] != 0 and u.users)
        for u in node.users
    ):
        return None  # the log-sum-exp or the RNG state is read: not inference
    q, k, v = (fake_value(a) for a in node.args[:3])
    tensors = [t for t in (q, k, v) if isinstance(t, torch.Tensor)]
    if len(tensors) != 3 or len({t.dtype for t in tensors}) != 1 or tensors[0].dtype not in LOW:
        return None
    if tensors[0].device.type not in devices or any(t.dim() != 4 for t in tensors):
        return None
    head = {t.shape[-1] for t in tensors}
    if len(head) != 1 or (d := head.pop()) % 8 or d > MAX_HEAD_DIM:
        return None
    kwargs = {"scale": values["scale"]} if values.get("scale") is not None else {}
    args = (*node.args[:3], 0.0, bool(values.get("is_causal", False)), False)
    return args, kwargs


def _output(node: torch.fx.Node) -> torch.fx.Node | None:
    return next((u for u in node.users if u.args[1] == 0), None)


def _same_layout(old: torch.fx.Node, new: torch.fx.Node) -> bool:
    a, b = fake_value(old), fake_value(new)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
