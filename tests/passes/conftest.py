"""Graph builders for the pass tests: the Dynamo graph a functional pass sees, and the aten
graph (after Inductor's decompositions) an aten pass sees — both small and on the CPU."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.fx
from pass_helpers import AtenTrace, DynamoCapture
from torch.fx.experimental.proxy_tensor import make_fx


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def dynamo_graph() -> DynamoCapture:
    """``capture(model, *inputs) -> (gm, example_inputs)``: the graph and the real example
    inputs Dynamo hands a backend (parameters as ``nn.Parameter`` placeholders)."""

    def capture(model: Callable[..., Any], *inputs: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
        seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            seen.append((gm, list(example_inputs)))
            return gm.forward

        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
        assert len(seen) == 1
        return seen[0]

    return capture


@pytest.fixture
def aten_graph() -> AtenTrace:
    """``trace(fn, *args, decompose=True)``: ``fn`` as an aten graph with fake values in
    ``meta["val"]``, decomposed with Inductor's table like the graph inner compile receives."""
    from torch._inductor.decomposition import select_decomp_table

    def trace(fn: Callable[..., Any], *args: Any, decompose: bool = True) -> torch.fx.GraphModule:
        table = select_decomp_table() if decompose else None
        with torch.no_grad():
            return make_fx(fn, decomposition_table=table, tracing_mode="fake")(*args)

    return trace
