"""Turn a ``BackendPlan`` into a callable: non-graph changes on the model, then torch.compile
with the pass-routing backend. Used by measured selection, validation and recapture alike, and
by the generated ``<stem>_optimized.py`` files."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import pytest_opprof.backend.compiler as compiler
from pytest_opprof.backend import runtime
from pytest_opprof.passes.base import PassResult
from pytest_opprof.schema import BackendPlan


@dataclass
class BuiltVariant:
    fn: Callable[..., Any]
    model: torch.nn.Module
    results: list[PassResult] = field(default_factory=list)


def backend_kwargs(plan: BackendPlan) -> dict[str, Any]:
    return {
        "functional": list(plan.functional),
        "aten": list(plan.aten),
        "config_patches": dict(plan.config_patches),
    }


def apply_model_changes(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], plan: BackendPlan
) -> tuple[torch.nn.Module, list[PassResult]]:
    """The non-graph passes. The returned model takes the ORIGINAL inputs and returns outputs
    in the original dtype, so optimized and baseline compute the same function on the same
    tensors."""
    new_model, _, results = compiler.apply_non_graph(
        model,
        inputs,
        dtype=plan.dtype,
        channels_last=plan.channels_last,
        pad_batch_to=plan.pad_batch_to,
        autocast=plan.autocast,
    )
    return new_model, list(results)


def build(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    plan: BackendPlan,
    *,
    backend_name: str | None = None,
) -> BuiltVariant:
    """Compile ``model`` as ``plan`` says. With ``backend_name`` the registered backend of that
    name is used (a generated file registered it); otherwise one is made for the plan. A stock
    recipe's plan is that recipe, compiled on its first call (``backend.stock.Compiled``)."""
    if plan.stock_recipe is not None:
        from pytest_opprof.backend.stock import Compiled

        recipe = Compiled(plan.stock_recipe, model, inputs, plan.dtype or "float32")
        return BuiltVariant(fn=recipe, model=model, results=[])
    new_model, results = apply_model_changes(model, inputs, plan)
    if backend_name is not None:
        backend: Any = backend_name
    else:
        backend = compiler.make_backend(results=results, **backend_kwargs(plan))
    fn = runtime.optimize(new_model, backend, cuda_graph=plan.cuda_graph_model)
    return BuiltVariant(fn=fn, model=new_model, results=results)
