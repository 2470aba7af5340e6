"""dtype_promotion: compute fp32 matmuls and convolutions in bf16 (or fp16) on tensor cores.

Two forms share the name:

* ``apply(gm, example_inputs)`` — the graph pass, registered in ``REGISTRY`` at the aten level.
  Each fp32 ``mm`` / ``bmm`` / ``addmm`` / ``baddbmm`` / ``convolution`` (and ``matmul`` /
  ``linear`` where a graph still has them) gets its tensor operands cast down and its result
  cast back up, so everything else in the graph keeps fp32. A cast back up followed directly
  (or through view ops) by a cast down to the same low dtype is cancelled: chained GEMMs hand
  bf16 straight to each other.
* ``apply_model(model, inputs, dtype=...)`` — the non-graph form: the whole model in the low
  dtype, wrapped so that it still takes the original inputs and returns the original dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

from pytest_opprof.passes.base import (
    PassResult,
    applied,
    failed,
    fake_value,
    is_op,
    meta_key,
    not_applied,
    run_graph_pass,
    set_fake_value,
)
from pytest_opprof.passes.matching import VIEWS, cast_dtype, is_cast

NAME = "dtype_promotion"
aten = torch.ops.aten
prims = torch.ops.prims

_COMPUTE = (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.convolution, aten.matmul, aten.linear)
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype_promotion: expected bfloat16 or float16, got {dtype}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype_promotion: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}"
        ) from None


# ------------------------------------------------------------------------------ graph pass


def apply(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, dtype: str | torch.dtype = "bf16"
) -> PassResult:
    """Cast each fp32 matmul / convolution to ``dtype`` and its output back to fp32."""
    low = resolve_dtype(dtype)
    return run_graph_pass(NAME, gm, example_inputs, lambda g, _: _rewrite(g, low))


def _rewrite(gm: torch.fx.GraphModule, low: torch.dtype) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    cast_cache: dict[torch.fx.Node, torch.fx.Node] = {}
    converted: list[str] = []
    for node in list(graph.nodes):
        if not is_op(node, *_COMPUTE) or not _all_fp32(node):
            continue
        with graph.inserting_before(node):
            args = tuple(_lowered(graph, a, low, key, cast_cache) for a in node.args)
            kwargs = {k: _lowered(graph, v, low, key, cast_cache) for k, v in node.kwargs.items()}
            new = graph.call_function(node.target, args, kwargs)
            set_fake_value(new, key)
        with graph.inserting_after(new):
            up = graph.call_function(prims.convert_element_type.default, (new, torch.float32))
            set_fake_value(up, key)
        node.replace_all_uses_with(up)
        graph.erase_node(node)
        converted.append(str(getattr(node.target, "__name__", node.target)))
    if not converted:
        return 0, "no fp32 matmul or convolution"
    cancelled = _cancel_cast_pairs(graph)
    kinds = ", ".join(sorted({c.split(".")[0] for c in converted}))
    return len(converted), (
        f"{len(converted)} op(s) ({kinds}) in {low}; {cancelled} cast pair(s) cancelled"
    )


def _all_fp32(node: torch.fx.Node) -> bool:
    tensors = [fake_value(a) for a in node.all_input_nodes]
    out = fake_value(node)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        return False
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in tensors
    )


def _lowered(
    graph: torch.fx.Graph,
    arg: Any,
    low: torch.dtype,
    key: str,
    cache: dict[torch.fx.Node, torch.fx.Node],
) -> Any:
    if not isinstance(arg, torch.fx.Node):
        return arg
    if arg not in cache:
        cast = graph.call_function(prims.convert_element_type.default, (arg, low))
        set_fake_value(cast, key)
        cache[arg] = cast
    return cache[arg]


def _cancel_cast_pairs(graph: torch.fx.Graph) -> int:
    """``down(views(up(x)))`` -> ``views(x)`` where ``x`` already has the low dtype and ``up`` is
    a lossless widening: an exact identity."""
    count = 0
    key = meta_key(graph)
    for down in list(graph.nodes):
        if not is_cast(down):
            continue
        target = cast_dtype(down)
        views: list[torch.fx.Node] = []
        node = down.args[0]
        while isinstance(node, torch.fx.Node) and is_op(node, *VIEWS):
            views.append(node)
            node = node.args[0]
        if not isinstance(node, torch.fx.Node) or not is_cast(node):
            continue
        src = node.args[0]
        src_val = fake_value(src)
        if not isinstance(src_val, torch.Tensor) or src_val.dtype != target:
            continue
        if not _lossless(src_val.dtype, cast_dtype(node)):
            continue
        replacement: Any = src
        with graph.inserting_before(down):
            for view in reversed(views):
                view_op: Any = view.target
                replacement = graph.call_function(
                    view_op, (replacement, *view.args[1:]), dict(view.kwargs)
                )
                set_fake_value(replacement, key)
        down.replace_all_uses_with(replacement)
        graph.erase_node(down)
        for stale in [*views, node]:  # the old path, when nothing else reads it
            if not stale.users:
                graph.erase_node(stale)
        count += 1
    return count


def _lossless(src: torch.dtype, dst: Any) -> bool:
    if not isinstance(dst, torch.dtype) or not (src.is_floating_point and dst.is_floating_point):
        return False
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.bits >= a.bits and b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny


# -------------------------------------------------------------------------- non-graph form


class LowPrecision(torch.nn.Module):
    """Runs ``inner`` (already in ``low``) on inputs cast down; floating outputs are cast back to
    ``out_dtype``. Integer inputs such as token ids pass through untouched."""

    def __init__(self, inner: torch.nn.Module, low: torch.dtype, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.low = low
        self.out_dtype = out_dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(self._down, (args, kwargs))
        return tree_map(self._up, self.inner(*args, **kwargs))

    def _down(self, t: Any) -> Any:
        return t.to(self.low) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def _up(self, t: Any) -> Any:
        return t.to(self.out_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class AutocastPrecision(torch.nn.Module):
    """Runs ``inner``, unchanged, under ``torch.autocast`` at ``low``: matmuls and convolutions
    in ``low``, what autocast keeps in fp32 (norms, softmax, reductions) in fp32; floating
    outputs in ``out_dtype``. The precision change whose error is eager-under-autocast's,
    which is what the validator calibrates a low-precision backend against
    (``numerics.same_precision``): where casting the whole model to ``low`` exceeds that,
    this does not (a pre-LN transformer's residual stream and norms stay fp32)."""

    def __init__(
        self, inner: torch.nn.Module, low: torch.dtype, out_dtype: torch.dtype, device_type: str
    ) -> None:
        super().__init__()
        self.inner = inner
        self.low = low
        self.out_dtype = out_dtype
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.low):
            found = self.inner(*args, **kwargs)
        return tree_map(self._up, found)

    def _up(self, t: Any) -> Any:
        return t.to(self.out_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def apply_model(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    *,
    dtype: str | torch.dtype = "bfloat16",
    autocast: bool = False,
    **_: Any,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], PassResult]:
    """Convert ``model`` (in place, like ``nn.Module.to``) to ``dtype`` and wrap it so that it
    takes the original ``inputs`` and returns outputs in the original floating dtype; with
    ``autocast``, leave it in its dtype and run it under autocast (:class:`AutocastPrecision`)."""
    try:
        low = resolve_dtype(dtype)
        floats: list[torch.Tensor] = [p for p in model.parameters() if p.is_floating_point()]
        floats += [b for b in model.buffers() if b.is_floating_point()]
        if not floats or all(t.dtype == low for t in floats):
            return model, inputs, not_applied(NAME, f"no floating parameters to convert to {low}")
        original = floats[0].dtype
        if autocast:
            device_type = floats[0].device.type
            done = f"model run under autocast at {low} on {device_type}, I/O kept in {original}"
            return (
                AutocastPrecision(model, low, original, device_type),
                inputs,
                applied(NAME, done, 1),
            )
        wrapped = LowPrecision(model.to(low), low, original)
    except Exception as exc:
        return model, inputs, failed(NAME, exc)
    return (
        wrapped,
        inputs,
        applied(
            NAME, f"model {original} -> {low} ({len(floats)} tensors), I/O kept in {original}", 1
        ),
    )
