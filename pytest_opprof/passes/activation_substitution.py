"""activation_substitution (aten level): the hand-written tanh GELU,
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, becomes one
``aten.gelu(x, approximate="tanh")`` — one fused kernel instead of eight elementwise ops in
eager-style execution.

Matched by hand rather than with Inductor's pattern matcher: people write this formula in many
shapes (``x**3`` / ``x*x*x`` / ``pow``, either operand order, constants rounded to a few digits),
and a traced search pattern matches only one literal arrangement with exact constants. Products
are matched as multisets of factors, sums with either operand order, constants within 1e-4.

Inside Inductor (``make_backend``'s inner compile, or as an Inductor custom pass) the pass finds
the pattern but leaves it: ``aten.gelu`` is in Inductor's decomposition table and has no
lowering, so a post-decomposition ``aten.gelu`` makes Inductor fail ("both a fallback and a
decomp for same op", torch 2.13 ``lowering.make_fallback``) — and Inductor's decomposition of
``aten.gelu(approximate="tanh")`` is this very formula, which it already lowers as one fused
pointwise kernel. The result is then ``NOT_APPLIED`` with the count found and that reason. Where
a later torch adds a lowering for ``aten.gelu``, the rewrite applies there too. Elsewhere
(aot_eager, export, eager-mode graphs) the rewrite applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    PassResult,
    compile_target,
    fake_value,
    is_op,
    meta_key,
    not_applied,
    run_graph_pass,
    scalar,
    set_fake_value,
    single_user,
)

NAME = "activation_substitution"
aten = torch.ops.aten

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715
_TOL = 1e-4


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Replace each tanh-form GELU with ``aten.gelu(approximate='tanh')``."""
    if compile_target() == "inductor" and not _inductor_lowers_gelu():
        found = sum(1 for n in gm.graph.nodes if is_op(n, aten.tanh) and _match(n) is not None)
        if not found:
            return not_applied(NAME, "no tanh-form GELU")
        reason = (
            "Inductor decomposes aten.gelu into this same formula and has no lowering for it "
            f"(torch {torch.__version__}); its fused pointwise kernel already is the substitution"
        )
        return not_applied(NAME, f"found {found} tanh-form GELU(s), left as is: {reason}", found)
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _inductor_lowers_gelu() -> bool:
    from torch._inductor.lowering import lowerings

    return aten.gelu.default in lowerings or aten.gelu in lowerings


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    count = 0
    for tanh in list(graph.nodes):
        if not is_op(tanh, aten.tanh):
            continue
        match = _match(tanh)
        if match is None:
            continue
        x, root, pattern_nodes = match
        with graph.inserting_before(root):
            gelu = graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
            set_fake_value(gelu, key)
        root.replace_all_uses_with(gelu)
        _erase_dead(graph, pattern_nodes)
        count += 1
    if not count:
        return 0, "no tanh-form GELU"
    return count, f"{count} tanh-form GELU(s) -> aten.gelu(approximate='tanh')"


def _match(tanh: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]] | None:
    nodes: list[torch.fx.Node] = [tanh]
    # inside: sqrt(2/pi) * (x + 0.044715 * x^3)
    inner = tanh.args[0]
    if not isinstance(inner, torch.fx.Node):
        return None
    factors, consts, used = _product(inner)
    if len(factors) != 1 or not _close(consts, _SQRT_2_OVER_PI):
        return None
    nodes += used
    poly = factors[0]
    if not is_op(poly, aten.add) or poly.kwargs or single_user(poly) is None:
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
    # outside: 0.5 * x * (1 + tanh)
    one_plus = single_user(tanh)
    if one_plus is None or not is_op(one_plus, aten.add) or one_plus.kwargs:
        return None
    other = one_plus.args[1] if one_plus.args[0] is tanh else one_plus.args[0]
    if not _close(scalar(other), 1.0):
        return None
    nodes.append(one_plus)
    root = _outer_product(one_plus, x)
    if root is None:
        return None
    root_node, outer_nodes = root
    nodes += outer_nodes
    if not _same_tensor_type(x, root_node):
        return None
    return x, root_node, nodes


def _product(node: torch.fx.Node) -> tuple[list[Any], float, list[torch.fx.Node]]:
    """Flatten a tree of ``mul`` nodes (each read only inside the tree) into its non-scalar
    factors, the product of its scalar factors, and the mul nodes themselves."""
    factors: list[Any] = []
    const = 1.0
    used: list[torch.fx.Node] = []

    def visit(n: Any, top: bool) -> None:
        nonlocal const
        is_mul = isinstance(n, torch.fx.Node) and is_op(n, aten.mul) and not n.kwargs
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


def _cubic_term(node: torch.fx.Node, x: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``0.044715 * x^3`` in any arrangement: ``pow(x, 3)``, ``x*x*x``, ``x * pow(x, 2)``."""
    if single_user(node) is None:
        return None
    factors, const, used = _product(node)
    power = 0
    extra: list[torch.fx.Node] = []
    for f in factors:
        if f is x:
            power += 1
        elif is_op(f, aten.pow) and f.args[0] is x and scalar(f.args[1]) in (2.0, 3.0):
            if single_user(f) is None:
                return None
            power += int(scalar(f.args[1]) or 0)
            extra.append(f)
        else:
            return None
    if power != 3 or not _close(const, _CUBIC):
        return None
    return used + extra


def _outer_product(
    one_plus: torch.fx.Node, x: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """Climb the ``mul`` users of ``1 + tanh`` until the product is exactly
    ``0.5 * x * (1 + tanh)``."""
    node = one_plus
    while (user := single_user(node)) is not None and is_op(user, aten.mul) and not user.kwargs:
        factors, const, used = _product(user)
        exact = len(factors) == 2 and one_plus in factors and x in factors
        if exact and _close(const, 0.5):
            return user, [n for n in used if n is not one_plus]
        node = user
    return None


def _close(value: float | None, expected: float) -> bool:
    return value is not None and abs(value - expected) <= _TOL * max(1.0, abs(expected))


def _same_tensor_type(x: torch.fx.Node, root: torch.fx.Node) -> bool:
    xv, rv = fake_value(x), fake_value(root)
    if xv is None or rv is None:
        return True
    ok = isinstance(xv, torch.Tensor) and isinstance(rv, torch.Tensor)
    return ok and xv.shape == rv.shape and xv.dtype == rv.dtype and xv.is_floating_point()


def _erase_dead(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    pending = [n for n in dict.fromkeys(nodes) if n.op != "placeholder"]
    progress = True
    while pending and progress:
        progress = False
        for n in list(pending):
            if not n.users:
                graph.erase_node(n)
                pending.remove(n)
                progress = True
