"""bn_fold (aten level): an eval-mode batch norm after a convolution or a linear is folded into
that layer's weights and bias, computed once from the real parameter values.

What inner compile receives has batch norm already decomposed by Inductor's decomposition
table into per-channel arithmetic on the running statistics
(``(conv - mean) * rsqrt(var + eps) * gamma + beta``, as ``sub``/``mul``/``add`` with
``unsqueeze``-d operands). The pass therefore folds any chain of per-channel ``sub``/``add``/
``mul``/``div`` whose other operand is a compile-time constant (see ``base``) and that contains
at least one scaling; the undecomposed ``native_batch_norm`` /
``_native_batch_norm_legit_no_training`` ops (make_fx / aot_eager graphs) are folded too.
Producers: ``aten.convolution`` (not transposed) and ``aten.addmm`` / ``aten.mm`` on a permuted
constant weight (``nn.Linear``). A bf16/fp16 batch norm is decomposed in fp32 between two
casts; the casts are identity steps of the chain, the folded weights are rounded once to the
layer's dtype, and the result is cast to the chain's last dtype where that differs.

With Inductor freezing on, the backend runs this pass as freezing starts, on the same graph
as without it (``backend.compiler``): freezing's own patterns
(``torch._inductor.fx_passes.freezing_patterns``) would fold conv + bn first and, on the CPU,
leave oneDNN's packed convolutions, where this pass finds nothing. Weights that are ``get_attr``
constants (a graph frozen already, a custom post-grad pass) are read as such. Folding bakes the
current weight values into the graph: the compiled model no longer sees later updates to them —
the same contract as freezing, right for eval-mode inference only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    GETITEM,
    ConstantEvaluator,
    erase_if_dead,
    fake_value,
    is_erased,
    is_op,
    meta_key,
    register_constant,
    run_graph_pass,
    set_fake_value,
    single_user,
)

NAME = "bn_fold"
aten = torch.ops.aten
prims = torch.ops.prims


@dataclass
class _Site:
    producer: torch.fx.Node
    kind: str  # "conv" | "linear"
    x: torch.fx.Node
    weight: torch.Tensor  # [C_out, ...] as the layer stores it
    bias: torch.Tensor | None
    steps: list[torch.fx.Node] = field(default_factory=list)
    operands: list[Any] = field(default_factory=list)  # the constant side of each step
    scale: torch.Tensor | None = None  # per output channel, float64
    shift: torch.Tensor | None = None


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Fold each eval-mode batch norm (or per-channel affine chain) into the conv/linear before."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    constants = ConstantEvaluator(gm, example_inputs)
    folded: list[str] = []
    gone: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in gone or is_erased(node):
            continue
        site = _producer(node, constants)
        if site is None or not _walk_chain(site, constants):
            continue
        folded.append(f"{site.kind} {site.producer.name}")
        gone.update(_fold(gm, site))
    if not folded:
        return 0, "no conv/linear followed by a constant per-channel affine"
    return len(folded), f"folded {len(folded)} batch norm(s) into {', '.join(folded)}"


def _producer(node: torch.fx.Node, constants: ConstantEvaluator) -> _Site | None:
    if is_op(node, aten.convolution) and len(node.args) >= 9:
        x, w, b, _stride, _pad, _dil, transposed = node.args[:7]
        weight = constants.value(w)
        bias = constants.value(b) if b is not None else None
        if transposed or not isinstance(weight, torch.Tensor) or not isinstance(x, torch.fx.Node):
            return None
        if b is not None and bias is None:
            return None
        return _Site(node, "conv", x, weight, bias)
    if (is_op(node, aten.addmm) and not node.kwargs) or is_op(node, aten.mm):
        args: Any = node.args
        *maybe_bias, x, w_t = args
        if not isinstance(w_t, torch.fx.Node) or not isinstance(x, torch.fx.Node):
            return None
        perm: Any = w_t.args[1] if len(w_t.args) > 1 else None
        if not (is_op(w_t, aten.t) or (is_op(w_t, aten.permute) and list(perm) == [1, 0])):
            return None
        weight = constants.value(w_t.args[0])
        bias = constants.value(maybe_bias[0]) if maybe_bias else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return None
        if maybe_bias and (not isinstance(bias, torch.Tensor) or bias.dim() != 1):
            return None
        return _Site(node, "linear", x, weight, bias)
    return None


def _walk_chain(site: _Site, constants: ConstantEvaluator) -> bool:
    """Collect the per-channel affine steps after the producer into ``scale * y + shift``."""
    out = fake_value(site.producer)
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return False
    channels = int(site.weight.shape[0])
    scale = torch.ones(channels, dtype=torch.float64, device=site.weight.device)
    shift = torch.zeros_like(scale)
    scaled = False
    node = site.producer
    while (user := single_user(node)) is not None:
        step = _affine_step(user, node, channels, out, constants)
        if step is None:
            break
        mul, add, nxt = step
        mul, add = mul.to(scale.device), add.to(scale.device)
        site.operands.extend(a for a in user.all_input_nodes if a is not node)
        scale, shift = scale * mul, shift * mul + add
        scaled = scaled or not torch.equal(mul, torch.ones_like(mul))
        site.steps.extend([user] if nxt is user else [user, nxt])
        node = nxt
    if not site.steps or not scaled:
        return False
    site.scale, site.shift = scale, shift
    return True


def _affine_step(
    user: torch.fx.Node,
    node: torch.fx.Node,
    channels: int,
    out: torch.Tensor,
    constants: ConstantEvaluator,
) -> tuple[torch.Tensor, torch.Tensor, torch.fx.Node] | None:
    """``(mul, add, output)`` when ``user`` maps ``node`` to ``node * mul + add`` per channel."""
    val = fake_value(user)
    if is_op(user, aten._native_batch_norm_legit_no_training, aten.native_batch_norm):
        return _batch_norm_step(user, node, channels, constants)
    if not isinstance(val, torch.Tensor) or val.shape != out.shape:
        return None
    if not val.dtype.is_floating_point:  # a cast to an integer or bool is no affine step
        return None
    if is_op(user, prims.convert_element_type):
        # a low-precision batch norm is decomposed in fp32 between two casts: a cast is the
        # identity step of the chain, and the fold ends in the chain's last dtype
        one = torch.ones(channels, dtype=torch.float64)
        return one, torch.zeros_like(one), user
    if user.kwargs or len(user.args) != 2:
        return None
    a, b = user.args
    other = b if a is node else a
    if other is node:
        return None
    k = _per_channel(constants.value(other), channels, out.dim())
    if k is None:
        return None
    one, zero = torch.ones_like(k), torch.zeros_like(k)
    if is_op(user, aten.mul):
        return k, zero, user
    if is_op(user, aten.add):
        return one, k, user
    if is_op(user, aten.sub) and a is node:
        return one, -k, user
    if is_op(user, aten.div) and a is node and bool((k != 0).all()):
        return 1.0 / k, zero, user
    return None


def _batch_norm_step(
    bn: torch.fx.Node, node: torch.fx.Node, channels: int, constants: ConstantEvaluator
) -> tuple[torch.Tensor, torch.Tensor, torch.fx.Node] | None:
    if bn.args[0] is not node:
        return None
    args: Any = bn.args
    if is_op(bn, aten.native_batch_norm):
        _, weight, bias, mean, var, training, _momentum, eps = args
        if training:
            return None
    else:
        _, weight, bias, mean, var, _momentum, eps = args
    if any(u.target is not GETITEM for u in bn.users):
        return None
    first = [u for u in bn.users if u.args[1] == 0]
    if len(first) != 1 or any(u.users for u in bn.users if u.args[1] != 0):
        return None  # the saved mean / invstd outputs are read: not an inference batch norm
    vals = [constants.value(t) if t is not None else None for t in (weight, bias, mean, var)]
    if any(t is not None and not isinstance(t, torch.Tensor) for t in vals):
        return None
    if any(vals[i] is None for i in (2, 3)):
        return None
    w, b, m, v = (None if t is None else t.to(torch.float64).reshape(-1) for t in vals)
    assert m is not None and v is not None
    if m.numel() != channels:
        return None
    inv = torch.rsqrt(v + float(eps))
    mul = inv * (w if w is not None else 1.0)
    add = (b if b is not None else 0.0) - m * mul
    return mul, add, first[0]


def _per_channel(value: Any, channels: int, rank: int) -> torch.Tensor | None:
    """``value`` as a float64 vector over dim 1 of a rank-``rank`` output, if it is one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((channels,), float(value), dtype=torch.float64)
    if not isinstance(value, torch.Tensor) or value.dim() > rank:
        return None
    shape = [1] * (rank - value.dim()) + list(value.shape)
    if any(size != 1 for i, size in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return value.detach().to(torch.float64).reshape(-1).expand(channels).clone()


def _fold(gm: torch.fx.GraphModule, site: _Site) -> set[torch.fx.Node]:
    """Rewrite the site; returns the nodes it erased."""
    assert site.scale is not None and site.shift is not None
    graph = gm.graph
    key = meta_key(graph)
    scale = site.scale.to(site.weight.device)
    weight = site.weight.detach().to(torch.float64)
    weight = weight * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    bias = site.bias.detach().to(torch.float64) if site.bias is not None else 0.0
    bias = bias * scale + site.shift.to(site.weight.device)
    new_w = weight.to(site.weight.dtype)
    new_b = bias.to(site.weight.dtype)
    last = site.steps[-1]
    with graph.inserting_before(last):
        w_node = graph.get_attr(register_constant(gm, "_opprof_bn_fold_weight", new_w))
        b_node = graph.get_attr(register_constant(gm, "_opprof_bn_fold_bias", new_b))
        set_fake_value(w_node, key, [site.x])
        set_fake_value(b_node, key, [site.x])
        if site.kind == "conv":
            args = (site.x, w_node, b_node, *site.producer.args[3:])
            new = graph.call_function(aten.convolution.default, args)
        else:
            w_t = graph.call_function(aten.permute.default, (w_node, [1, 0]))
            set_fake_value(w_t, key)
            new = graph.call_function(aten.addmm.default, (b_node, site.x, w_t))
        set_fake_value(new, key)
        end = fake_value(last)
        if isinstance(end, torch.Tensor) and end.dtype != new_w.dtype:
            new = graph.call_function(prims.convert_element_type.default, (new, end.dtype))
            set_fake_value(new, key)
    last.replace_all_uses_with(new)
    erased: set[torch.fx.Node] = set()
    for node in reversed(site.steps):
        for user in list(node.users):  # unused getitems of a batch-norm tuple
            graph.erase_node(user)
            erased.add(user)
        graph.erase_node(node)
        erased.add(node)
    old_weight = site.producer.args[-1] if site.kind == "linear" else None
    graph.erase_node(site.producer)
    erased.add(site.producer)
    if isinstance(old_weight, torch.fx.Node) and not old_weight.users:
        graph.erase_node(old_weight)
        erased.add(old_weight)
    # the weight-only arithmetic that fed the chain (running-stat rsqrt, unsqueezes) is dead now
    dead_inputs = [n for n in site.operands if n not in erased]
    erase_if_dead(graph, dead_inputs)
    return erased
