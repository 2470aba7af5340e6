"""The stock baseline: the best a user gets from stock PyTorch in a few lines, the bar the
optimized backend is held to beside eager and fp32 ``torch.compile``.

Two recipes, both ``torch.compile(mode="max-autotune")`` (Inductor's autotuned GEMM and
convolution templates, coordinate-descent tuning, CUDA graphs), the faster of which is the bar:

- ``autocast``: the fp32 model under ``torch.autocast`` at the low precision;
- ``cast``: the model's weights and floating inputs cast to the low precision, channels-last
  where an input is 4-D, with Inductor's weight freezing (constant folding of the weights).

Each recipe is a module wrapping the workload's model, compiled whole: its input and output
casts are in the compiled graph (fused into its first and last kernels, inside its CUDA
graph), so the recipe takes the workload's own inputs and returns outputs in the eager model's
dtype, exactly like the optimized backend; a user who kept the data in bf16 would pay the
casts elsewhere. The recipes are compiled as a user writes them: nothing of this package's
backend is in them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

RECIPES: dict[str, str] = {
    "autocast": 'torch.autocast({dtype}) around torch.compile(model, mode="max-autotune")',
    "cast": (
        "model and input in {dtype}{layout}, Inductor weight freezing, "
        'torch.compile(model, mode="max-autotune")'
    ),
}
"""Recipe name -> how a user writes it (``describe``)."""

MODE = "max-autotune"
LOW_PRECISION = "bfloat16"
"""The stock recipes' precision, unless it fails the tolerance on the workload; then the
fallback of ``dtypes_to_try``."""


def dtypes_to_try(plan_dtype: str | None) -> list[str]:
    """bf16 first; where its outputs fail the tolerance, ``plan_dtype``, the dtype a plan
    computes in where one is known, else fp32 (the stock task runs before selection has chosen a
    plan, so for it fp32)."""
    fallback = plan_dtype or "float32"
    return [LOW_PRECISION] if fallback == LOW_PRECISION else [LOW_PRECISION, fallback]


def channels_last_input(inputs: tuple[Any, ...]) -> bool:
    """The ``cast`` recipe goes channels-last where a floating input is 4-D (an image batch)."""
    return any(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 4 for t in inputs
    )


def describe(recipe: str, dtype: str, inputs: tuple[Any, ...] = ()) -> str:
    layout = ", channels-last" if recipe == "cast" and channels_last_input(inputs) else ""
    return RECIPES[recipe].format(dtype=dtype, layout=layout)


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in ``dtype``, its structure kept (traced by Dynamo,
    so plain Python over tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to_dtype(v, dtype) for k, v in value.items()}
    return value


def output_dtype(output: Any) -> torch.dtype:
    """The dtype of eager's first floating output: the recipes return theirs in it."""
    from pytest_opprof.workload import flatten_tensors

    found = (t.dtype for t in flatten_tensors(output) if t.is_floating_point())
    return next(found, torch.float32)


class Autocast(nn.Module):
    """Recipe ``autocast``: the model as it is, its matmuls and convolutions under autocast."""

    def __init__(self, model: nn.Module, device_type: str, dtype: torch.dtype, out: torch.dtype):
        super().__init__()
        self.model, self.device_type, self.dtype, self.out = model, device_type, dtype, out

    def forward(self, *args: Any) -> Any:
        # at fp32 (bf16 failed the tolerance) the recipe is max-autotune alone
        with torch.autocast(self.device_type, self.dtype, enabled=self.dtype != torch.float32):
            found = self.model(*args)
        return _to_dtype(found, self.out)


class Cast(nn.Module):
    """Recipe ``cast``: a copy of the model in ``dtype`` (channels-last for image batches),
    fed its inputs in ``dtype``."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, out: torch.dtype, layout: bool):
        super().__init__()
        self.model = copy.deepcopy(model).to(dtype)
        if layout:
            self.model = self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.dtype, self.out, self.layout = dtype, out, layout

    def forward(self, *args: Any) -> Any:
        cast = []
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a = a.to(self.dtype)
                if self.layout and a.dim() == 4:
                    a = a.contiguous(memory_format=torch.channels_last)
            cast.append(a)
        return _to_dtype(self.model(*cast), self.out)


@dataclass
class StockRecipe:
    """One recipe compiled: its name, dtype and compiled call (the first call made: compiled)."""

    recipe: str
    dtype: str
    fn: Callable[..., Any]
    compile_s: float


@contextlib.contextmanager
def _inductor_settings(recipe: str) -> Iterator[None]:
    """Freezing for the ``cast`` recipe, read by Inductor when it compiles (the first call)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(freezing=recipe == "cast"):
        yield


class Compiled(nn.Module):
    """A recipe compiled as a user writes it: ``torch.compile(wrapper, mode="max-autotune")``,
    its first call (the compile) under the recipe's Inductor settings. What a generated file
    ships where the ladder's plan was not measured faster (``runtime.stock_recipe``). Its
    ``recipe`` and ``dtype`` name it in the stage logs."""

    def __init__(self, recipe: str, model: nn.Module, inputs: tuple[Any, ...], dtype: str):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"unknown stock recipe {recipe!r}; accepted: {', '.join(RECIPES)}")
        device_type = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
        with torch.no_grad():
            out = output_dtype(model(*inputs))
        low = getattr(torch, dtype)
        wrapped: nn.Module
        if recipe == "autocast":
            wrapped = Autocast(model, device_type, low, out)
        else:
            wrapped = Cast(model, low, out, channels_last_input(inputs))
        self.recipe, self.dtype = recipe, dtype
        self.compiled = torch.compile(wrapped.eval(), mode=MODE)
        self._first = True
        self.eval()

    def forward(self, *args: Any) -> Any:
        if self._first:
            with _inductor_settings(self.recipe):
                found = self.compiled(*args)
            self._first = False
            return found
        return self.compiled(*args)


def build(
    recipe: str,
    model: nn.Module,
    inputs: tuple[Any, ...],
    dtype: str,
    *,
    first_call: Callable[[Callable[..., Any]], None],
) -> StockRecipe:
    """``recipe`` of ``model`` at ``dtype`` (:class:`Compiled`), compiled by ``first_call(fn)``
    (which runs it once on ``inputs`` under no_grad and waits for the device; timed here)."""
    import time

    fn = Compiled(recipe, model, inputs, dtype)
    t0 = time.perf_counter()
    first_call(fn)
    return StockRecipe(recipe, dtype, fn, time.perf_counter() - t0)


Check = Callable[[Callable[..., Any], str], tuple[Any, list[str]]]
"""``check(fn, dtype)`` -> (Numerics, the failed checks in words) of a recipe's outputs."""


def choose(
    model: nn.Module,
    inputs: tuple[Any, ...],
    plan_dtype: str | None,
    *,
    check: Check,
    first_call: Callable[[Callable[..., Any]], None],
    time_brief: Callable[[dict[str, Callable[..., Any]]], dict[str, float]],
    before_build: Callable[[str, str], None] | None = None,
) -> Any:
    """The stock baseline (``schema.StockBaseline``): at the first dtype of
    :func:`dtypes_to_try` where some recipe builds and passes ``check``, the faster of those
    that do (``time_brief``: median ms of each, timed interleaved). A recipe that fails to
    build or to pass is a trial with its error; where none passes at any dtype, no recipe.
    ``before_build(recipe, dtype)``, where given, is called before each build, in the order
    of the builds: the caller's moment to wait for what a build needs; what it raises is not
    a recipe's failure and ends the choice."""
    from pytest_opprof.schema import StockBaseline, StockTrial

    trials: list[StockTrial] = []
    for dtype in dtypes_to_try(plan_dtype):
        passed: dict[str, StockRecipe] = {}
        for recipe in RECIPES:
            trial = StockTrial(
                recipe=recipe, dtype=dtype, description=describe(recipe, dtype, inputs)
            )
            trials.append(trial)
            if before_build is not None:
                before_build(recipe, dtype)
            try:
                built = build(recipe, model, inputs, dtype, first_call=first_call)
            except Exception as exc:  # Inductor failed on this recipe: the other may build
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    raise
                first = str(exc).splitlines()[0] if str(exc) else ""
                trial.error = f"failed to build: {type(exc).__name__}: {first}"[:300]
                continue
            trial.compile_s = built.compile_s
            trial.numerics, failed = check(built.fn, dtype)
            if failed:
                trial.error = "; ".join(failed)[:300]
                continue
            passed[recipe] = built
        if not passed:
            continue
        medians = time_brief({r: b.fn for r, b in passed.items()}) if len(passed) > 1 else {}
        for trial in trials[-len(RECIPES) :]:
            trial.median_ms = medians.get(trial.recipe)
        best = min(passed, key=lambda r: medians.get(r, 0.0))
        kept = passed[best]
        others = ", ".join(f"{r} {medians[r]:.4f} ms" for r in passed if r != best and r in medians)
        return StockBaseline(
            recipe=best,
            dtype=kept.dtype,
            description=describe(best, kept.dtype, inputs),
            trials=trials,
            message=f"{best} at {kept.dtype}"
            + (f": {medians[best]:.4f} ms, faster than {others}" if others else ""),
        )
    return StockBaseline(
        trials=trials,
        message="no stock recipe passed: "
        + "; ".join(f"{t.recipe} at {t.dtype}: {t.error}" for t in trials),
    )
