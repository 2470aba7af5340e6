"""gemm_out_dtype: a low-precision GEMM whose result is only widened to fp32 writes fp32 itself.

After ``dtype_promotion`` a bf16 ``mm`` / ``bmm`` often feeds nothing but a cast back up to
fp32 — the model's fp32 output, such as a vocabulary projection's logits: the GEMM writes its
output in bf16, then a second kernel reads it and writes it again in fp32. ``aten.mm.dtype(a, b,
out_dtype)`` (CUDA; torch >= 2.8) has cuBLAS accumulate in fp32 and write fp32 directly: one
write of the wide output instead of a narrow write, a read and a wide write, and no rounding to
bf16 on the way (the result is closer to fp32 than before). Inductor lowers it to the extern
kernel ``at::mm_dtype_out`` (``torch/_inductor/kernel/mm.py``, ``tuned_mm(out_dtype=...)``).

Pattern (aten level, after AOT decomposition): ``convert(views*(mm|bmm(a, b)), float32)``, ``a``
and ``b`` in bf16 or fp16 on CUDA, the GEMM and each view used only by the next node. Rewritten
to ``views*(mm.dtype(a, b, float32))``. No other use of the low-precision result may exist, or
the narrow tensor would still have to be written.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    PassResult,
    fake_value,
    is_op,
    meta_key,
    reapply_views,
    run_graph_pass,
    set_fake_value,
)
from pytest_opprof.passes.matching import VIEWS, cast_dtype, is_cast

NAME = "gemm_out_dtype"
aten = torch.ops.aten
LOW = (torch.bfloat16, torch.float16)


def _widened() -> dict[Any, Any]:
    """GEMM overload -> its ``out_dtype`` overload, where this torch has them."""
    pairs = {}
    for packet in (aten.mm, aten.bmm):
        if "dtype" in packet.overloads():
            pairs[packet.default] = packet.dtype
    return pairs


def inductor_lowers_out_dtype() -> bool:
    """Whether this Inductor's ``mm`` / ``bmm`` lowerings take ``out_dtype`` (else the op would
    fall back to a generic extern call, or fail to lower)."""
    try:
        from torch._inductor.kernel.bmm import tuned_bmm
        from torch._inductor.kernel.mm import tuned_mm
    except ImportError:
        return False
    return all("out_dtype" in inspect.signature(f).parameters for f in (tuned_mm, tuned_bmm))


def apply(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    devices: Sequence[str] = ("cuda",),
) -> PassResult:
    """Fold each widening cast after a bf16/fp16 GEMM into the GEMM. ``devices``: where the
    ``out_dtype`` kernels exist (CUDA only in torch 2.11-2.13)."""
    return run_graph_pass(NAME, gm, example_inputs, lambda g, _: _rewrite(g, tuple(devices)))


def _rewrite(gm: torch.fx.GraphModule, devices: tuple[str, ...]) -> tuple[int, str]:
    pairs = _widened()
    if not pairs:
        return 0, "this torch has no aten.mm.dtype"
    if not inductor_lowers_out_dtype():
        return 0, "this Inductor's mm lowering takes no out_dtype"
    graph = gm.graph
    key = meta_key(graph)
    folded: list[str] = []
    for cast in list(graph.nodes):
        if not is_cast(cast) or cast_dtype(cast) != torch.float32:
            continue
        views: list[torch.fx.Node] = []
        node = cast.args[0]
        while isinstance(node, torch.fx.Node) and is_op(node, *VIEWS) and len(node.users) == 1:
            views.append(node)
            node = node.args[0]
        if not isinstance(node, torch.fx.Node) or node.target not in pairs:
            continue
        if len(node.users) != 1 or not _low_on(node, devices):
            continue
        with graph.inserting_before(node):
            wide = graph.call_function(pairs[node.target], (*node.args[:2], torch.float32))
            set_fake_value(wide, key)
        with graph.inserting_before(cast):  # the same views, now on the fp32 result
            replacement = reapply_views(graph, wide, views, key)
        cast.replace_all_uses_with(replacement)
        for stale in [cast, *views, node]:
            graph.erase_node(stale)
        folded.append(str(node.target).split(".")[-2])
    if not folded:
        return 0, "no bf16/fp16 GEMM whose only use is a cast to float32"
    kinds = ", ".join(sorted(set(folded)))
    return len(folded), f"{len(folded)} GEMM(s) ({kinds}) write float32 themselves"


def _low_on(node: torch.fx.Node, devices: tuple[str, ...]) -> bool:
    out = fake_value(node)
    operands = [fake_value(a) for a in node.args[:2]]
    if not isinstance(out, torch.Tensor) or out.dtype not in LOW:
        return False
    if out.device.type not in devices:
        return False
    return all(isinstance(t, torch.Tensor) and t.dtype == out.dtype for t in operands)
