"""Small helpers shared by the pass tests (fixtures live in ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

DynamoCapture = Callable[..., tuple[torch.fx.GraphModule, list[Any]]]
AtenTrace = Callable[..., torch.fx.GraphModule]


def const(t: torch.Tensor) -> torch.nn.Parameter:
    """A compile-time constant as the passes recognise one (see ``passes.base``)."""
    return torch.nn.Parameter(t, requires_grad=False)


def targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def count(gm: torch.fx.GraphModule, *wanted: Any) -> int:
    def hit(t: Any) -> bool:
        packet = getattr(t, "overloadpacket", None)
        return any(t is w or t == w or (packet is not None and packet is w) for w in wanted)

    return sum(1 for t in targets(gm) if hit(t))


def output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The node a single-output graph returns."""
    node = gm.graph.output_node().args[0]
    assert isinstance(node, torch.fx.Node)
    return node


def without_fake_value(gm: torch.fx.GraphModule) -> set[str]:
    """The names of the call nodes with no fake value: what a pass left later passes unable to
    read dtypes and shapes from."""
    return {n.name for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta}
