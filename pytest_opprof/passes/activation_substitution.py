"""activation_substitution: the hand-written tanh GELU,
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, becomes one fused GELU — one
kernel instead of eight elementwise ops where nothing else fuses them (eager-style execution).

Matched by hand rather than with Inductor's pattern matcher: people write this formula in many
shapes (``x**3`` / ``x*x*x`` / ``pow``, either operand order, constants rounded to a few digits),
and a traced search pattern matches only one literal arrangement with exact constants. Products
are matched as multisets of factors, sums with either operand order, constants within 1e-4.

Registered at the functional level: on the Dynamo graph (torch functions, operators, tensor
methods) the formula becomes ``F.gelu(x, approximate="tanh")``, which every backend then lowers
its own way — Inductor decomposes it into this same formula and fuses it into one pointwise
kernel, so there the rewrite changes which code states the GELU, and selection measures what,
if anything, that buys. The same matcher works on aten graphs (make_fx, export, aot_eager),
where the result is ``aten.gelu(x, approximate="tanh")``. Inside Inductor's inner compile it
finds the pattern but leaves it: ``aten.gelu`` is in Inductor's decomposition table and has no
lowering, so a post-decomposition ``aten.gelu`` makes Inductor fail ("both a fallback and a
decomp for same op", torch 2.13 ``lowering.make_fallback``); the result is then ``NOT_APPLIED``
with the count found and that reason.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

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


# What each step of the formula is called: on aten graphs an overload packet, on Dynamo graphs
# a torch function, an operator or a tensor method.
_OPS: dict[str, tuple[Any, tuple[Any, ...], tuple[str, ...]]] = {
    "mul": (aten.mul, (operator.mul, torch.mul), ("mul", "__mul__", "__rmul__")),
    "add": (aten.add, (operator.add, torch.add), ("add", "__add__", "__radd__")),
    "tanh": (aten.tanh, (torch.tanh, F.tanh), ("tanh",)),
    "pow": (aten.pow, (operator.pow, torch.pow), ("pow", "__pow__")),
}


def _is(node: Any, kind: str) -> bool:
    """``node`` computes ``kind`` (mul, add, tanh, pow) with positional operands only."""
    if not isinstance(node, torch.fx.Node) or node.kwargs:
        return False
    packet, functions, methods = _OPS[kind]
    if node.op == "call_method":
        return node.target in methods
    return is_op(node, packet) or (node.op == "call_function" and node.target in functions)


def _on_aten(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload)


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Replace each tanh-form GELU with one GELU: ``F.gelu(x, approximate='tanh')`` on a Dynamo
    graph, ``aten.gelu(x, approximate='tanh')`` on an aten graph."""
    sites = [n for n in gm.graph.nodes if _is(n, "tanh") and _match(n) is not None]
    if not sites:
        return not_applied(NAME, "no tanh-form GELU")
    if _on_aten(sites[0]) and compile_target() == "inductor" and not _inductor_lowers_gelu():
        found = len(sites)
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
        if not _is(tanh, "tanh"):
            continue
        match = _match(tanh)
        if match is None:
            continue
        x, root, pattern_nodes = match
        gelu_fn, target = (aten.gelu.default, "aten.gelu") if _on_aten(tanh) else (F.gelu, "F.gelu")
        with graph.inserting_before(root):
            gelu = graph.call_function(gelu_fn, (x,), {"approximate": "tanh"})
            set_fake_value(gelu, key)
        root.replace_all_uses_with(gelu)
        _erase_dead(graph, pattern_nodes)
        count += 1
    if not count:
        return 0, "no tanh-form GELU"
    return count, f"{count} tanh-form GELU(s) -> {target}(approximate='tanh')"


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
    if not _is(poly, "add") or single_user(poly) is None:
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
    if one_plus is None or not _is(one_plus, "add"):
        return None
    other = one_plus.args[1] if one_plus.args[0] is f else one_plus.args[0]
    if not _close(scalar(other), 1.0):
        return None
    root = _outer_product(one_plus, x)
    if root is None or not _same_tensor_type(x, root[0]):
        return None
    return root[0], [one_plus, *root[1]]


def _product(node: torch.fx.Node) -> tuple[list[Any], float, list[torch.fx.Node]]:
    """Flatten a tree of ``mul`` nodes (each read only inside the tree) into its non-scalar
    factors, the product of its scalar factors, and the mul nodes themselves."""
    factors: list[Any] = []
    const = 1.0
    used: list[torch.fx.Node] = []

    def visit(n: Any, top: bool) -> None:
        nonlocal const
        is_mul = _is(n, "mul")
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
        elif _is(f, "pow") and f.args[0] is x and scalar(f.args[1]) in (2.0, 3.0):
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
    while (user := single_user(node)) is not None and _is(user, "mul"):
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
