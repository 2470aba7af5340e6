"""matching: the FX pattern-matching helpers several passes share.

``activation_substitution`` and ``gemm_epilogue`` both find the tanh-form GELU and the
``0.5 * x * (1 + f)`` around a GELU's ``tanh`` / ``erf``; ``dtype_promotion``,
``gemm_epilogue`` and ``gemm_out_dtype`` all step through view ops and recognise dtype casts;
``conv_im2col`` and ``depthwise_taps`` read a 2-D convolution's operands and geometry
(``conv2d``) and replace it (``replace_conv2ds``). The helpers live here, public, so that no
pass imports another pass's private names.

Matched by hand rather than with Inductor's pattern matcher: people write the GELU formula in
many shapes (``x**3`` / ``x*x*x`` / ``pow``, either operand order, constants rounded to a few
digits), and a traced search pattern matches only one literal arrangement with exact
constants. Products are matched as multisets of factors, sums with either operand order,
constants within 1e-4.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from pytest_opprof.passes.base import (
    fake_value,
    is_op,
    meta_key,
    scalar,
    set_fake_value,
    single_user,
)

aten = torch.ops.aten
prims = torch.ops.prims

VIEWS = (
    aten.view,
    aten.reshape,
    aten._unsafe_view,
    aten.permute,
    aten.t,
    aten.transpose,
    aten.unsqueeze,
    aten.squeeze,
    aten.expand,
)
"""The aten view ops a matcher may step through: each changes only how the same values are
laid out, never a value or its dtype."""

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715
_TOL = 1e-4


# What each step of the formula is called: on aten graphs an overload packet, on Dynamo graphs
# a torch function, an operator or a tensor method.
_OPS: dict[str, tuple[Any, tuple[Any, ...], tuple[str, ...]]] = {
    "mul": (aten.mul, (operator.mul, torch.mul), ("mul", "__mul__", "__rmul__")),
    "add": (aten.add, (operator.add, torch.add), ("add", "__add__", "__radd__")),
    "tanh": (aten.tanh, (torch.tanh, F.tanh), ("tanh",)),
    "pow": (aten.pow, (operator.pow, torch.pow), ("pow", "__pow__")),
}


def is_kind(node: Any, kind: str) -> bool:
    """``node`` is an FX node that computes ``kind`` (mul, add, tanh, pow) with positional
    operands only, on an aten graph or a Dynamo graph alike. False for anything else,
    including a non-node."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return False
    packet, functions, methods = _OPS[kind]
    if node.op == "call_method":
        return node.target in methods
    return is_op(node, packet) or (node.op == "call_function" and node.target in functions)


def close_to(value: float | None, expected: float) -> bool:
    """``value`` is a number within 1e-4 of ``expected`` (relative where ``|expected| > 1``,
    absolute below): hand-written constants rounded to a few digits still match. False for
    None (no scalar)."""
    return value is not None and abs(value - expected) <= _TOL * max(1.0, abs(expected))


def flatten_product(node: torch.fx.Node) -> tuple[list[Any], float, list[torch.fx.Node]]:
    """Flatten a tree of ``mul`` nodes (each read only inside the tree) into its non-scalar
    factors, the product of its scalar factors, and the mul nodes themselves. ``node`` itself
    counts as a mul of the tree whatever its users; a mul read elsewhere is a factor. The
    product of the factors and the constant is ``node``'s value (up to rounding)."""
    factors: list[Any] = []
    const = 1.0
    used: list[torch.fx.Node] = []

    def visit(n: Any, top: bool) -> None:
        nonlocal const
        is_mul = is_kind(n, "mul")
        if is_mul and (top or single_user(n) is not None):
            used.append(n)
            visit(n.args[0], False)
            visit(n.args[1], False)
            return
        c = scalar(n)
        if c is not None:
            const *= c
        else:
            factors.append(n)

    visit(node, True)
    return factors, const, used


def match_tanh_gelu(
    tanh: torch.fx.Node,
) -> tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]] | None:
    """The tanh-form GELU ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` around
    ``tanh``, in any arrangement: ``(x, root, nodes)``, where ``root`` computes that GELU of
    ``x`` (with ``x``'s shape and floating dtype, where both carry a fake value) and ``nodes``
    are the formula's other nodes, for the caller to erase once dead. None where ``tanh`` is
    not such a GELU's."""
    nodes: list[torch.fx.Node] = [tanh]
    # inside: sqrt(2/pi) * (x + 0.044715 * x^3)
    inner = tanh.args[0]
    if not isinstance(inner, torch.fx.Node):
        return None
    factors, consts, used = flatten_product(inner)
    if len(factors) != 1 or not close_to(consts, _SQRT_2_OVER_PI):
        return None
    nodes += used
    poly = factors[0]
    if not is_kind(poly, "add") or single_user(poly) is None:
        return None
    nodes.append(poly)
    a, b = poly.args
    for x, cubic in ((a, b), (b, a)):
        if isinstance(x, torch.fx.Node) and isinstance(cubic, torch.fx.Node):
            cubic_nodes = _cubic_term(cubic, x)
            if cubic_nodes is not None:
                nodes += cubic_nodes
                break
    else:
        return None
    outside = half_x_times_one_plus(tanh, x)
    if outside is None:
        return None
    root_node, outer_nodes = outside
    return x, root_node, nodes + outer_nodes


def half_x_times_one_plus(
    f: torch.fx.Node, x: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The outside of a GELU, ``0.5 * x * (1 + f)`` around ``f`` (``tanh`` in the tanh form,
    ``erf`` in the exact one), its products in any arrangement: the root, and the nodes from
    ``1 + f`` up to it. None where there is no such product or it changes the tensor type."""
    one_plus = single_user(f)
    if one_plus is None or not is_kind(one_plus, "add"):
        return None
    other = one_plus.args[1] if one_plus.args[0] is f else one_plus.args[0]
    if not close_to(scalar(other), 1.0):
        return None
    root = _outer_product(one_plus, x)
    if root is None or not _same_tensor_type(x, root[0]):
        return None
    return root[0], [one_plus, *root[1]]


def is_cast(node: Any) -> bool:
    """``node`` only converts its one tensor operand to another dtype:
    ``prims.convert_element_type(x, dtype)`` or ``aten._to_copy(x, dtype=...)`` with no other
    argument (no device, layout or memory-format change)."""
    return is_op(node, prims.convert_element_type) or (
        is_op(node, aten._to_copy) and set(node.kwargs) == {"dtype"} and len(node.args) == 1
    )


def cast_dtype(node: torch.fx.Node) -> Any:
    """The dtype a node for which ``is_cast`` holds converts to."""
    if is_op(node, prims.convert_element_type):
        return node.args[1]
    return node.kwargs.get("dtype")


def _cubic_term(node: torch.fx.Node, x: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``0.044715 * x^3`` in any arrangement: ``pow(x, 3)``, ``x*x*x``, ``x * pow(x, 2)``."""
    if single_user(node) is None:
        return None
    factors, const, used = flatten_product(node)
    power = 0
    extra: list[torch.fx.Node] = []
    for f in factors:
        if f is x:
            power += 1
        elif is_kind(f, "pow") and f.args[0] is x and scalar(f.args[1]) in (2.0, 3.0):
            if single_user(f) is None:
                return None
            power += int(scalar(f.args[1]) or 0)
            extra.append(f)
        else:
            return None
    if power != 3 or not close_to(const, _CUBIC):
        return None
    return used + extra


def _outer_product(
    one_plus: torch.fx.Node, x: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """Climb the ``mul`` users of ``1 + tanh`` until the product is exactly
    ``0.5 * x * (1 + tanh)``."""
    node = one_plus
    while (user := single_user(node)) is not None and is_kind(user, "mul"):
        factors, const, used = flatten_product(user)
        exact = len(factors) == 2 and one_plus in factors and x in factors
        if exact and close_to(const, 0.5):
            return user, [n for n in used if n is not one_plus]
        node = user
    return None


def _same_tensor_type(x: torch.fx.Node, root: torch.fx.Node) -> bool:
    xv, rv = fake_value(x), fake_value(root)
    if xv is None or rv is None:
        return True
    ok = isinstance(xv, torch.Tensor) and isinstance(rv, torch.Tensor)
    return ok and xv.shape == rv.shape and xv.dtype == rv.dtype and xv.is_floating_point()


# --------------------------------------------------------------------------- convolutions


@dataclass(frozen=True)
class Conv2d:
    """A 2-D ``aten.convolution`` with static shapes: its operands and its geometry."""

    x: torch.fx.Node
    weight: torch.fx.Node
    bias: torch.fx.Node | None
    dtype: torch.dtype  # of the input, the weight, the bias and the output alike
    channels: int  # of the input
    weight_shape: tuple[int, int, int, int]  # C_out, C / groups, kh, kw
    out: tuple[int, int, int, int]  # N, C_out, Ho, Wo
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int


def conv2d(node: Any, key: str) -> Conv2d | None:
    """``node`` as a ``Conv2d`` where it is an ``aten.convolution`` that is not transposed,
    with floating 4-D input, weight and output of static shape and one dtype (the bias's too,
    of shape ``[C_out]``) and plain int strides, paddings, dilations and groups; else None."""
    if not is_op(node, aten.convolution) or len(node.args) != 9 or node.kwargs:
        return None
    x, w, b, *geometry, transposed, _output_padding, groups = node.args
    if transposed or type(groups) is not int or groups < 1:
        return None
    if not isinstance(x, torch.fx.Node) or not isinstance(w, torch.fx.Node):
        return None
    if b is not None and not isinstance(b, torch.fx.Node):
        return None
    stride, padding, dilation = (_int_pair(g) for g in geometry)
    if stride is None or padding is None or dilation is None:
        return None
    xv, wv, out = fake_value(x), _weight_value(w, key), fake_value(node)
    if not all(_static_4d(v) for v in (xv, wv, out)) or not xv.is_floating_point():
        return None
    if not (xv.dtype == wv.dtype == out.dtype):
        return None
    if b is not None:
        bv = fake_value(b)
        if not isinstance(bv, torch.Tensor) or (bv.dtype, bv.shape) != (out.dtype, (out.shape[1],)):
            return None
    return Conv2d(
        x,
        w,
        b,
        out.dtype,
        xv.shape[1],
        tuple(wv.shape),
        tuple(out.shape),
        stride,
        padding,
        dilation,
        groups,
    )


Emit = Callable[..., torch.fx.Node]
"""``emit(op, *args, **kwargs)``: a ``call_function`` node at the insertion point, with its fake
value recorded, so that later passes read its dtype and shape."""


def replace_conv2ds(
    gm: torch.fx.GraphModule,
    accept: Callable[[Conv2d], bool],
    build: Callable[[Emit, Conv2d], torch.fx.Node],
) -> list[Conv2d]:
    """Replace each 2-D convolution of ``gm`` that ``accept`` takes with the node ``build``
    makes from it, built right before it (the graph's order holds); the convolutions
    replaced, in graph order. Only the convolution is erased."""
    graph = gm.graph
    key = meta_key(graph)

    def emit(op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = graph.call_function(op, args, kwargs)
        set_fake_value(node, key)
        return node

    replaced = []
    for node in list(graph.nodes):
        site = conv2d(node, key)
        if site is None or not accept(site):
            continue
        with graph.inserting_before(node):
            out = build(emit, site)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        replaced.append(site)
    return replaced


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


def _int_pair(v: Any) -> tuple[int, int] | None:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(type(i) is int for i in v):
        return v[0], v[1]
    return None
