"""activation_substitution: the hand-written tanh GELU,
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, becomes one fused GELU — one
kernel instead of eight elementwise ops where nothing else fuses them (eager-style execution).

Matched by hand (``matching.match_tanh_gelu``) rather than with Inductor's pattern matcher:
people write this formula in many shapes (``x**3`` / ``x*x*x`` / ``pow``, either operand order,
constants rounded to a few digits), and a traced search pattern matches only one literal
arrangement with exact constants. Products are matched as multisets of factors, sums with
either operand order, constants within 1e-4.

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

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from pytest_opprof.passes.base import (
    PassResult,
    compile_target,
    meta_key,
    not_applied,
    run_graph_pass,
    set_fake_value,
)
from pytest_opprof.passes.matching import is_kind, match_tanh_gelu

NAME = "activation_substitution"
aten = torch.ops.aten


def _on_aten(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload)


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Replace each tanh-form GELU with one GELU: ``F.gelu(x, approximate='tanh')`` on a Dynamo
    graph, ``aten.gelu(x, approximate='tanh')`` on an aten graph."""
    sites = [n for n in gm.graph.nodes if is_kind(n, "tanh") and match_tanh_gelu(n) is not None]
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
        if not is_kind(tanh, "tanh"):
            continue
        match = match_tanh_gelu(tanh)
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
