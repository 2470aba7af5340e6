"""qkv_fusion (functional level): linears that read the same activation become one linear on
the concatenated weights followed by a split, so three skinny GEMMs become one wide one.

Runs on the Dynamo graph, before ``compile_fx``, where the shared activation is still one node.
Dynamo (torch >= 2.5, ``inline_inbuilt_nn_modules``) writes ``nn.Linear`` as
``call_function torch._C._nn.linear(x, w, b)`` with the weights as placeholders (or as
``get_attr`` when Inductor freezing is on while tracing); older graphs may still hold
``call_module`` linears. All three forms are handled.

Where every weight is a compile-time constant (see ``base``) and autograd does not need them,
the concatenation is done once, here, from the real parameter values and stored on the graph
module as a constant. Otherwise it is emitted as a ``torch.cat`` in the graph, which is correct
for any weights (and is constant-folded by Inductor's freezing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from pytest_opprof.passes.base import (
    GETITEM,
    ConstantEvaluator,
    fake_mode_of,
    fake_value,
    meta_key,
    register_constant,
    run_graph_pass,
    set_fake_value,
)

NAME = "qkv_fusion"
_LINEAR = F.linear  # the same builtin as torch._C._nn.linear


@dataclass
class _Linear:
    node: torch.fx.Node
    x: torch.fx.Node
    weight: Any  # a Node, or a real tensor for call_module linears
    bias: Any  # a Node, a real tensor, or None
    out_features: int
    in_features: int
    dtype: torch.dtype


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Fuse each group of >= 2 linears that share their input and ``in_features``."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    constants = ConstantEvaluator(gm, example_inputs)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple[Any, ...], list[_Linear]] = {}
    for node in gm.graph.nodes:
        lin = _as_linear(gm, node)
        if lin is None:
            continue
        key = (lin.x, lin.in_features, lin.dtype, lin.bias is None)
        groups.setdefault(key, []).append(lin)
    fused: list[str] = []
    for group in groups.values():
        if len(group) < 2 or not _views_survive(group):
            continue
        if _fuse(gm, group, constants, order):
            fused.append("+".join(lin.node.name for lin in group))
    if not fused:
        return 0, "no linears share an input"
    total = sum(s.count("+") + 1 for s in fused)
    return len(fused), f"fused {total} linears into {len(fused)} ({'; '.join(fused)})"


def _as_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> _Linear | None:
    x: Any
    weight: Any
    bias: Any
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is not torch.nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        x = node.args[0]
        weight, bias = mod.weight, mod.bias
        shape, dtype = tuple(weight.shape), weight.dtype
    elif node.op == "call_function" and node.target is _LINEAR:
        args = list(node.args) + [None] * (3 - len(node.args))
        x = node.kwargs.get("input", args[0])
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        w_val = fake_value(weight)
        if not isinstance(w_val, torch.Tensor) or w_val.dim() != 2:
            return None
        shape, dtype = tuple(w_val.shape), w_val.dtype
    else:
        return None
    if not isinstance(x, torch.fx.Node) or not all(isinstance(s, int) for s in shape):
        return None
    return _Linear(node, x, weight, bias, int(shape[0]), int(shape[1]), dtype)


def _views_survive(group: list[_Linear]) -> bool:
    """The outputs become slices of one wide tensor: a ``.view`` that needs them contiguous
    would now fail, so check every direct ``view`` user against a fake slice first."""
    x_val = fake_value(group[0].x)
    mode = fake_mode_of([x_val])
    if mode is None:
        return True  # no fake values to check against; Dynamo graphs always have them
    total = sum(lin.out_features for lin in group)
    with mode:
        wide = torch.empty((*x_val.shape[:-1], total), dtype=group[0].dtype, device=x_val.device)
        chunks = torch.split(wide, [lin.out_features for lin in group], dim=-1)
        for lin, chunk in zip(group, chunks, strict=True):
            for user in lin.node.users:
                is_view = (user.op == "call_method" and user.target == "view") or (
                    user.op == "call_function" and user.target is torch.Tensor.view
                )
                if not is_view or user.args[0] is not lin.node:
                    continue
                shape = [fake_value(a) for a in user.args[1:]]
                try:
                    chunk.view(*shape)
                except Exception:
                    return False
    return True


def _fuse(
    gm: torch.fx.GraphModule,
    group: list[_Linear],
    constants: ConstantEvaluator,
    order: dict[torch.fx.Node, int],
) -> bool:
    graph = gm.graph
    key = meta_key(graph)
    group = sorted(group, key=lambda lin: order[lin.node])
    first = group[0].node
    weights = _concat_operand(gm, [lin.weight for lin in group], constants, order[first], "w")
    if weights is None:
        return False
    biases: Any = None
    if group[0].bias is not None:
        biases = _concat_operand(gm, [lin.bias for lin in group], constants, order[first], "b")
        if biases is None:
            return False
    like = [group[0].x]
    with graph.inserting_before(first):
        w_node = _materialize(gm, weights, "_opprof_qkv_weight", key, like)
        b_node = None if biases is None else _materialize(gm, biases, "_opprof_qkv_bias", key, like)
        wide = graph.call_function(_LINEAR, (group[0].x, w_node, b_node))
        set_fake_value(wide, key)
        sizes = [lin.out_features for lin in group]
        split = graph.call_function(torch.split, (wide, sizes), {"dim": -1})
        set_fake_value(split, key)
        for i, lin in enumerate(group):
            part = graph.call_function(GETITEM, (split, i))
            set_fake_value(part, key)
            lin.node.replace_all_uses_with(part)
    for lin in group:
        graph.erase_node(lin.node)
    # weights read through get_attr that nothing reads any more
    stale = {op for lin in group for op in (lin.weight, lin.bias) if isinstance(op, torch.fx.Node)}
    for node in stale:
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return True


def _concat_operand(
    gm: torch.fx.GraphModule,
    operands: list[Any],
    constants: ConstantEvaluator,
    insert_at: int,
    kind: str,
) -> Any:
    """Either a real concatenated tensor (all operands constant, autograd not watching) or the
    list of nodes to concatenate in the graph; ``None`` when neither is possible."""
    values = [op if isinstance(op, torch.Tensor) else constants.value(op) for op in operands]
    if all(isinstance(v, torch.Tensor) for v in values):
        grad = torch.is_grad_enabled() and any(v.requires_grad for v in values)
        if not grad:
            with torch.no_grad():
                return torch.cat([v.detach() for v in values], dim=0)
    if not all(isinstance(op, torch.fx.Node) for op in operands):
        return None  # a call_module weight under autograd: no node to concatenate
    nodes: list[torch.fx.Node] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for op in operands:
        if op.op == "get_attr":
            nodes.append(op)  # re-emitted at the insertion point by _materialize
        elif order[op] < insert_at:
            nodes.append(op)
        else:
            return None
    return nodes


def _materialize(
    gm: torch.fx.GraphModule, operand: Any, prefix: str, key: str, like: list[torch.fx.Node]
) -> torch.fx.Node:
    graph = gm.graph
    if isinstance(operand, torch.Tensor):
        node = graph.get_attr(register_constant(gm, prefix, operand))
        set_fake_value(node, key, like)
        return node
    parts = []
    for op in operand:
        if op.op == "get_attr":  # a fresh get_attr keeps the order valid
            fresh = graph.get_attr(str(op.target))
            fresh.meta = dict(op.meta)
            parts.append(fresh)
        else:
            parts.append(op)
    node = graph.call_function(torch.cat, (parts,), {"dim": 0})
    set_fake_value(node, key)
    return node
