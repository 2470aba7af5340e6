"""sdpa_replacement (functional level): hand-written attention,
``softmax(q @ k.transpose(-2, -1) * scale [+ mask]) @ v``, becomes one
``F.scaled_dot_product_attention`` call, which dispatches to a fused (flash / memory-efficient)
kernel instead of materialising the L x S score matrix.

Runs on the Dynamo graph, where the chain is still written in torch functions, operators and
tensor methods. Accepted between the two matmuls: any number of scalings by a Python number
(``*``, ``/``), one mask — additive (``+ mask``, same dtype as the scores),
``masked_fill(cond, -inf)``, or ``torch.where(keep, scores, fill)`` with ``fill`` -inf or a
finite value at most float16's lowest (HF GPT-2 writes ``torch.finfo(dtype).min``) — and an
inactive dropout (``training=False`` or ``p == 0``). A mask that is a compile-time constant
equal to the causal pattern becomes ``is_causal=True``. A finite fill only matches the -inf of
SDPA where no row is wholly masked, so it is replaced only when the mask is that causal
constant (every row keeps its diagonal).
Dropout in training mode, a softmax over another dim, or intermediate values read elsewhere
leave the site alone.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from pytest_opprof.passes.base import (
    ConstantEvaluator,
    fake_value,
    meta_key,
    run_graph_pass,
    scalar,
    set_fake_value,
    single_user,
)

NAME = "sdpa_replacement"

_MATMUL_FNS = (operator.matmul, torch.matmul, torch.bmm)
_MATMUL_METHODS = ("matmul", "bmm", "__matmul__")
_MUL_FNS = (operator.mul, torch.mul)
_MUL_METHODS = ("mul", "__mul__", "__rmul__")
_DIV_FNS = (operator.truediv, torch.div)
_DIV_METHODS = ("div", "__truediv__")
_ADD_FNS = (operator.add, torch.add)
_ADD_METHODS = ("add", "__add__", "__radd__")
_SOFTMAX_FNS = (torch.softmax, F.softmax, torch.Tensor.softmax)
_DROPOUT_FNS = (F.dropout, torch.dropout)
_TRANSPOSE_FNS = (torch.transpose, torch.swapaxes, torch.swapdims)
_TRANSPOSE_METHODS = ("transpose", "swapaxes", "swapdims")


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Replace each hand-written attention with ``F.scaled_dot_product_attention``."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


@dataclass
class _Site:
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    out: torch.fx.Node
    scale: float
    chain: list[torch.fx.Node] = field(default_factory=list)  # scores .. softmax output
    key_t: torch.fx.Node | None = None
    additive_mask: torch.fx.Node | None = None
    fill_cond: torch.fx.Node | None = None
    keep_cond: torch.fx.Node | None = None  # torch.where(keep, scores, fill)
    finite_fill: bool = False


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    constants = ConstantEvaluator(gm, example_inputs)
    sites = [s for n in list(gm.graph.nodes) if (s := _match(n)) is not None]
    if not sites:
        return 0, "no softmax(q @ k^T) @ v chain"
    # A finite fill equals SDPA's -inf only where every row keeps an entry: causal masks.
    sites = [s for s in sites if not s.finite_fill or _is_causal(s, constants)]
    if not sites:
        return 0, "attention masked with a finite fill whose mask is not causal: left as is"
    notes = [_replace(gm, site, constants) for site in sites]
    detail = f"{len(sites)} attention block(s) -> scaled_dot_product_attention"
    return len(sites), f"{detail} ({', '.join(notes)})"


def _is_call(node: Any, fns: tuple[Any, ...], methods: tuple[str, ...] = ()) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is f for f in fns)
    return node.op == "call_method" and node.target in methods


def _arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _match(sm: torch.fx.Node) -> _Site | None:
    if not _is_call(sm, _SOFTMAX_FNS, ("softmax",)):
        return None
    scores_val = fake_value(sm)
    dim = _arg(sm, 1, "dim")
    if not isinstance(scores_val, torch.Tensor) or not isinstance(dim, int):
        return None
    if dim not in (-1, scores_val.dim() - 1) or sm.kwargs.get("dtype") is not None:
        return None
    # forward: softmax -> [inactive dropout] -> matmul(., v)
    probs, nxt = sm, single_user(sm)
    if nxt is not None and _is_call(nxt, _DROPOUT_FNS) and _inactive_dropout(nxt):
        probs, nxt = nxt, single_user(nxt)
    if nxt is None or not _is_call(nxt, _MATMUL_FNS, _MATMUL_METHODS) or nxt.args[0] is not probs:
        return None
    out, v = nxt, nxt.args[1]
    # backward: softmax input -> scalings / one mask -> matmul(q, k^T)
    chain = ([probs] if probs is not sm else []) + [sm]  # consumers before producers
    scale, node = 1.0, sm.args[0]
    mask_seen: str | None = None
    scaled_since: list[float] = []  # factors applied after (nearer the softmax than) the mask
    while True:
        if not isinstance(node, torch.fx.Node) or single_user(node) is None:
            return None
        if _is_call(node, _MATMUL_FNS, _MATMUL_METHODS):
            break
        factor = _scaling(node)
        if factor is not None:
            if mask_seen is None:
                scaled_since.append(factor)
            scale *= factor
            chain.append(node)
            node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else node.args[1]
            continue
        kind = _mask_kind(node)
        if kind is None or mask_seen is not None:
            return None
        # SDPA adds the mask after scaling: a scaling after an additive mask would scale the
        # mask too; after masked_fill(-inf) only a positive factor keeps -inf at -inf.
        if (kind == "add" and scaled_since) or any(f <= 0 for f in scaled_since):
            return None
        if kind == "where" and scaled_since and _where_fill(node) != float("-inf"):
            return None  # a scaling after a finite fill would move it
        mask_seen = kind
        chain.append(node)
        node = _chain_input(node)
    scores = node
    chain.append(scores)
    q, key_t = scores.args[0], scores.args[1]
    k = _untransposed(key_t)
    if not isinstance(q, torch.fx.Node) or k is None or not isinstance(v, torch.fx.Node):
        return None
    assert isinstance(key_t, torch.fx.Node)  # _untransposed found k through it
    if not _shapes_fit(q, k, v):
        return None
    site = _Site(q=q, k=k, v=v, out=out, scale=scale, chain=chain, key_t=key_t)
    for link in chain:
        if _mask_kind(link) == "add":
            site.additive_mask = _mask_operand(link)
        elif _mask_kind(link) == "fill":
            site.fill_cond = link.args[1]  # type: ignore[assignment]  # a Node: see _mask_kind
        elif _mask_kind(link) == "where":
            site.keep_cond = link.args[0]  # type: ignore[assignment]  # a Node: see _mask_kind
            site.finite_fill = not math.isinf(_where_fill(link) or 0.0)
    if not _mask_fits(site, fake_value(scores)):
        return None
    return site


def _inactive_dropout(node: torch.fx.Node) -> bool:
    p = scalar(_arg(node, 1, "p", 0.5))
    training = _arg(node, 2, "training" if node.target is F.dropout else "train", True)
    return p == 0.0 or training is False


def _scaling(node: torch.fx.Node) -> float | None:
    a, b = (*node.args, None, None)[:2]
    if _is_call(node, _MUL_FNS, _MUL_METHODS):
        c = scalar(b) if isinstance(a, torch.fx.Node) else scalar(a)
        return c if c is not None and not node.kwargs else None
    if _is_call(node, _DIV_FNS, _DIV_METHODS) and isinstance(a, torch.fx.Node):
        c = scalar(b)
        return 1.0 / c if c and not node.kwargs else None
    return None


def _mask_kind(node: torch.fx.Node) -> str | None:
    if _is_call(node, _ADD_FNS, _ADD_METHODS) and not node.kwargs and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            return "add"
    fill = _is_call(node, (torch.masked_fill,), ("masked_fill",)) and len(node.args) == 3
    if fill and isinstance(node.args[1], torch.fx.Node):
        value = scalar(node.args[2])
        if value is not None and math.isinf(value) and value < 0:
            return "fill"
    if _where_fill(node) is not None:
        return "where"
    return None


LOWEST_FILL = float(torch.finfo(torch.float16).min)
"""A fill at or below this underflows ``exp`` beside any real score, in every float dtype."""


def _where_fill(node: torch.fx.Node) -> float | None:
    """The fill of ``torch.where(keep, scores, fill)`` when it masks like -inf, else None."""
    if not (node.op == "call_function" and node.target is torch.where) or node.kwargs:
        return None
    if len(node.args) != 3 or not all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return None
    value = scalar(node.args[2])
    return value if value is not None and value <= LOWEST_FILL else None


def _chain_input(node: torch.fx.Node) -> Any:
    """The score operand of a mask op: for ``a + b`` the one that comes from a matmul chain."""
    if _mask_kind(node) == "fill":
        return node.args[0]
    if _mask_kind(node) == "where":
        return node.args[1]
    a, b = node.args
    return b if _from_scores(b) and not _from_scores(a) else a


def _mask_operand(node: torch.fx.Node) -> torch.fx.Node:
    a, b = node.args
    chain_in = _chain_input(node)
    result = b if chain_in is a else a
    assert isinstance(result, torch.fx.Node)
    return result


def _from_scores(node: Any) -> bool:
    while isinstance(node, torch.fx.Node):
        if _is_call(node, _MATMUL_FNS, _MATMUL_METHODS):
            return True
        if _scaling(node) is None:
            return False
        node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else node.args[1]
    return False


def _untransposed(node: Any) -> torch.fx.Node | None:
    """``k`` when ``node`` swaps the last two dims of ``k``."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    args: Any = node.args
    src = args[0]
    src_val = fake_value(src)
    if not isinstance(src, torch.fx.Node) or not isinstance(src_val, torch.Tensor):
        return None
    rank = src_val.dim()
    last_two = {rank - 2, rank - 1}
    dims: Any
    if _is_call(node, _TRANSPOSE_FNS, _TRANSPOSE_METHODS) and len(args) == 3:
        dims = args[1:]
        if all(isinstance(d, int) for d in dims) and {d % rank for d in dims} == last_two:
            return src
        return None
    if _is_call(node, (torch.permute,), ("permute",)):
        packed = len(args) == 2 and isinstance(args[1], (list, tuple))
        dims = args[1] if packed else args[1:]
        want = [*range(rank - 2), rank - 1, rank - 2]
        if all(isinstance(d, int) for d in dims) and [d % rank for d in dims] == want:
            return src
    return None


def _shapes_fit(q: torch.fx.Node, k: torch.fx.Node, v: torch.fx.Node) -> bool:
    qv, kv, vv = fake_value(q), fake_value(k), fake_value(v)
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, vv)):
        return False
    if not (qv.dim() == kv.dim() == vv.dim() and qv.dim() >= 3):
        return False
    if not (qv.dtype == kv.dtype == vv.dtype and qv.dtype.is_floating_point):
        return False
    same_batch = qv.shape[:-2] == kv.shape[:-2] == vv.shape[:-2]
    return bool(same_batch and qv.shape[-1] == kv.shape[-1] and kv.shape[-2] == vv.shape[-2])


def _mask_of(site: _Site) -> torch.fx.Node | None:
    for mask in (site.additive_mask, site.fill_cond, site.keep_cond):
        if mask is not None:
            return mask
    return None


def _mask_fits(site: _Site, scores_val: Any) -> bool:
    mask = _mask_of(site)
    if mask is None:
        return True
    mask_val = fake_value(mask)
    if not isinstance(mask_val, torch.Tensor) or not isinstance(scores_val, torch.Tensor):
        return False
    boolean = site.fill_cond is not None or site.keep_cond is not None
    if boolean and mask_val.dtype != torch.bool:
        return False
    if site.additive_mask is not None and mask_val.dtype != scores_val.dtype:
        return False
    try:
        return tuple(torch.broadcast_shapes(mask_val.shape, scores_val.shape)) == tuple(
            scores_val.shape
        )
    except RuntimeError:
        return False


def _is_causal(site: _Site, constants: ConstantEvaluator) -> bool:
    """The mask is a compile-time constant equal to the causal pattern for a square L x S."""
    mask = _mask_of(site)
    value = constants.value(mask) if mask is not None else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    size_l, size_s = value.shape[-2:]
    if size_l != size_s or value.numel() != size_l * size_s:
        return False
    grid = value.reshape(size_l, size_s)
    above = torch.ones(size_l, size_s, dtype=torch.bool, device=grid.device).triu(1)
    if site.fill_cond is not None:
        return bool(torch.equal(grid, above))
    if site.keep_cond is not None:
        return grid.dtype == torch.bool and bool(torch.equal(grid, ~above))
    if not grid.dtype.is_floating_point:
        return False
    expected = torch.zeros_like(grid).masked_fill(above, float("-inf"))
    return bool(torch.equal(grid, expected))


def _replace(gm: torch.fx.GraphModule, site: _Site, constants: ConstantEvaluator) -> str:
    graph = gm.graph
    key = meta_key(graph)
    causal = _is_causal(site, constants)
    with graph.inserting_before(site.out):
        attn_mask: torch.fx.Node | None = None
        if not causal and site.additive_mask is not None:
            attn_mask = site.additive_mask
        elif not causal and site.fill_cond is not None:
            attn_mask = graph.call_function(torch.logical_not, (site.fill_cond,))
            set_fake_value(attn_mask, key)
        elif not causal and site.keep_cond is not None:
            attn_mask = site.keep_cond  # True takes part, as SDPA's boolean mask
        sdpa = graph.call_function(
            F.scaled_dot_product_attention,
            (site.q, site.k, site.v),
            {"attn_mask": attn_mask, "dropout_p": 0.0, "is_causal": causal, "scale": site.scale},
        )
        set_fake_value(sdpa, key)
    how = "causal" if causal else ("masked" if attn_mask is not None else "unmasked")
    note = f"{site.out.name}: {how}, scale={site.scale:.6g}"
    site.out.replace_all_uses_with(sdpa)
    graph.erase_node(site.out)
    for node in site.chain:  # consumers before producers
        graph.erase_node(node)
    if site.key_t is not None and not site.key_t.users:
        graph.erase_node(site.key_t)
    return note
