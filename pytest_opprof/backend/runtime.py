"""What a generated ``<stem>_optimized.py`` calls: the baseline import and the non-graph changes.

Kept small on purpose: the passes live in ``pytest_opprof.passes`` and the pass-routing backend
in ``pytest_opprof.backend.compiler``; a generated file reads as the plan, not as their code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import pytest_opprof.backend.compiler as compiler
from pytest_opprof.backend.model_graph import ModelGraph
from pytest_opprof.workload import cpu_remap, import_workload

register_backend = compiler.register_backend


def import_baseline(generated_file: str, relative_path: str, name: str) -> ModuleType:
    """Import the baseline workload that sits at ``relative_path`` from the generated file.

    Where CUDA is absent its ``get_model_and_input`` runs under the CPU remap, as the loader
    does for the baseline itself, so the optimized file works on the CPU fallback too.
    """
    path = (Path(generated_file).resolve().parent / relative_path).resolve()
    with _remap_if_cpu():
        module = import_workload(path, module_name=name)
    entry = module.get_model_and_input

    @functools.wraps(entry)
    def get_model_and_input() -> Any:
        seed_everything()
        with _remap_if_cpu():
            return entry()

    module.get_model_and_input = get_model_and_input
    return module


def add_import_path(generated_file: str, relative_path: str) -> None:
    """Put the folder at ``relative_path`` from the generated file first on ``sys.path``, so
    the modules of the user passes a conftest registered can be imported by name."""
    import sys

    folder = str((Path(generated_file).resolve().parent / relative_path).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)


MODEL_SEED = 0


def seed_everything(seed: int = MODEL_SEED) -> None:
    """Seed torch's RNG before a workload builds its model, so the baseline and the optimized
    workload hold the same random weights."""
    torch.manual_seed(seed)


def _remap_if_cpu() -> Any:
    import contextlib

    return contextlib.nullcontext() if torch.cuda.is_available() else cpu_remap()


def apply_non_graph(
    model: torch.nn.Module,
    inputs: Any,
    *,
    dtype: str | None = None,
    channels_last: bool = False,
    pad_batch_to: int | None = None,
    autocast: bool = False,
    results: list[Any] | None = None,
) -> torch.nn.Module:
    """The model with the non-graph changes; it still takes the baseline's inputs. Each pass's
    ``PassResult`` is appended to ``results``."""
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    new_model, _, applied = compiler.apply_non_graph(
        model,
        args,
        dtype=dtype,
        channels_last=channels_last,
        pad_batch_to=pad_batch_to,
        autocast=autocast,
    )
    if results is not None:
        results.extend(applied)
    return new_model


def stock_recipe(model: torch.nn.Module, inputs: Any, recipe: str, dtype: str) -> torch.nn.Module:
    """The stock recipe ``recipe`` of ``model`` at ``dtype``, compiled on its first call: what a
    generated file ships where selection measured it faster than its own plan."""
    from pytest_opprof.backend.stock import Compiled

    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return Compiled(recipe, model, args, dtype)


def optimize(
    model: torch.nn.Module,
    backend: str | Callable[..., Any],
    *,
    compile: bool = True,
    cuda_graph: bool = False,
) -> Any:
    """The model compiled with ``backend`` (or itself where ``compile`` is false: nothing beat
    eager, so the baseline is shipped), recorded as one CUDA graph where ``cuda_graph`` and
    CUDA is present (``backend.model_graph``: its outputs are the graph's memory until the next
    call, as with ``mode="reduce-overhead"``; clone one you keep)."""
    fn: Any = torch.compile(model, backend=backend) if compile else model
    if cuda_graph and torch.cuda.is_available():
        fn = ModelGraph(fn)
    return fn


def optimized_callable(module: ModuleType, model: torch.nn.Module) -> Any:
    """What the pipeline times and validates for a generated file: ``optimize`` as the file's
    ``BACKEND``, ``COMPILE`` and ``CUDA_GRAPH`` say (files written before ``CUDA_GRAPH``
    existed record none)."""
    return optimize(
        model,
        module.BACKEND,
        compile=getattr(module, "COMPILE", True),
        cuda_graph=getattr(module, "CUDA_GRAPH", False),
    )
