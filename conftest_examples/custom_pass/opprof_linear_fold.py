"""linear_chain_fold: a user pass, registered by the conftest beside this file.

Two linears in a row, with nothing between them, are one linear:
``W2 (W1 x + b1) + b2 = (W2 W1) x + (W2 b1 + b2)``. Models grow such chains when a projection
is split for a reason that is gone at inference (a LoRA adapter merged as a second linear, a
bottleneck kept from training, an output head behind a projection), and Inductor does not fold
them: it sees two GEMMs, not one.

The pass runs at the ``functional`` level (the Dynamo graph, before ``compile_fx``), where
``nn.Linear`` is ``torch._C._nn.linear(x, w, b)`` and the weights arrive as real parameters.
It lives in a module of its own, not in the conftest, because the processes that build and
validate the backend, and the generated ``<stem>_optimized.py``, import it by name. Only this
module imports torch: pytest's own process does not load it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from pytest_opprof.passes import PassResult
from pytest_opprof.passes.base import (
    ConstantEvaluator,
    meta_key,
    register_constant,
    run_graph_pass,
    set_fake_value,
)

NAME = "linear_chain_fold"


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Fold every linear whose only user is another linear into it. ``run_graph_pass`` logs the
    one line, lints and recompiles after a match, and restores the graph if the rewrite fails."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _linear(node: Any) -> tuple[Any, Any, Any] | None:
    """``(input, weight, bias)`` of a functional linear node, else ``None``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is not F.linear:  # the same builtin as torch._C._nn.linear
        return None
    args = [*node.args, None, None][:3]
    return (
        node.kwargs.get("input", args[0]),
        node.kwargs.get("weight", args[1]),
        node.kwargs.get("bias", args[2]),
    )


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    graph = gm.graph
    constants = ConstantEvaluator(gm, example_inputs)
    key = meta_key(graph)
    folded = []
    for outer in list(graph.nodes):
        second = _linear(outer)
        if second is None:
            continue
        inner, w2_node, b2_node = second
        first = _linear(inner)
        if first is None or len(inner.users) != 1:
            continue  # not a chain, or the middle activation is read elsewhere
        x, w1_node, b1_node = first
        w1, w2 = constants.value(w1_node), constants.value(w2_node)
        b1 = None if b1_node is None else constants.value(b1_node)
        b2 = None if b2_node is None else constants.value(b2_node)
        if w1 is None or w2 is None or (b1_node is not None and b1 is None):
            continue  # weights that are not compile-time constants
        if b2_node is not None and b2 is None:
            continue
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (w1, w2, b1, b2)
        ):
            continue  # autograd needs the two weights apart
        out1, in1 = w1.shape
        out2 = w2.shape[0]
        if in1 * out2 >= in1 * out1 + out1 * out2:
            continue  # a bottleneck: the folded GEMM would do more work than the two
        with torch.no_grad():  # fold in float64, store in the weights' dtype
            w = (w2.double() @ w1.double()).to(w1.dtype)
            b = torch.zeros(out2, dtype=torch.float64, device=w1.device)
            if b1 is not None:
                b += w2.double() @ b1.double()
            if b2 is not None:
                b += b2.double()
            has_bias = b1 is not None or b2 is not None
        with graph.inserting_before(outer):
            w_node = graph.get_attr(register_constant(gm, "_opprof_linear_fold_w", w))
            set_fake_value(w_node, key, [x])
            b_node = None
            if has_bias:
                b_node = graph.get_attr(
                    register_constant(gm, "_opprof_linear_fold_b", b.to(w1.dtype))
                )
                set_fake_value(b_node, key, [x])
            fused = graph.call_function(F.linear, (x, w_node, b_node))
            set_fake_value(fused, key)
        outer.replace_all_uses_with(fused)
        folded.append(f"{inner.name}+{outer.name}")
        graph.erase_node(outer)
        graph.erase_node(inner)
    if not folded:
        return 0, "no linear feeds another linear directly"
    return len(
        folded
    ), f"folded {len(folded)} linear pair(s) into one GEMM each ({', '.join(folded)})"
