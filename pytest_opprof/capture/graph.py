"""The workload's Dynamo graph(s), summarised for the pattern detectors of the propose stage."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from pytest_opprof.schema import FxGraphSummary, FxNode


def capture_graph(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> FxGraphSummary:
    """Trace with ``torch._dynamo.explain`` (no Inductor: seconds), keep every graph and break."""
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(*inputs)
    graphs = [[_node(n) for n in gm.graph.nodes] for gm in explained.graphs]
    reasons = [
        str(getattr(r, "reason", r)).strip().splitlines()[0] for r in explained.break_reasons
    ]
    torch._dynamo.reset()
    if not graphs:
        # torch 2.11/2.13: Dynamo skips frames it cannot trace at all (nn.LSTM is one) and
        # explain() then reports -1 breaks; the whole forward runs eagerly under torch.compile.
        reasons = [*reasons, "Dynamo captured no graph: the forward runs eagerly under compile"]
    return FxGraphSummary(
        graphs=graphs,
        graph_breaks=max(0, int(explained.graph_break_count)),
        break_reasons=reasons,
        parameters={n: list(p.shape) for n, p in model.named_parameters()},
        module_types={
            n or "": f"{type(m).__module__}.{type(m).__qualname__}"
            for n, m in model.named_modules()
        },
    )


def _target(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    try:
        return torch.fx.node._get_qualified_name(target)
    except Exception:
        return repr(target)


def _arg(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_arg(v) for v in value) + ")"
    return repr(value)


def _node(node: torch.fx.Node) -> FxNode:
    value = node.meta.get("example_value")
    shape = dtype = None
    if isinstance(value, torch.Tensor):
        shape = [int(s) if isinstance(s, int) or hasattr(s, "__int__") else -1 for s in value.shape]
        dtype = str(value.dtype)
    module_type = module_path = None
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, kind = list(stack.values())[-1]
        module_path = str(path)
        module_type = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
    return FxNode(
        name=node.name,
        op=node.op,
        target=_target(node),
        args=[_arg(a) for a in node.args],
        kwargs={k: _arg(v) for k, v in node.kwargs.items()},
        shape=shape,
        dtype=dtype,
        module_type=module_type,
        module_path=module_path,
    )
