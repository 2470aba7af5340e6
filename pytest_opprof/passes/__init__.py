"""The pass library: one module per transformation type, the type name being the module, the
pass name, the proposal type, the log tag and the report row.

``REGISTRY`` maps each type to its ``PassSpec``. Where a type has a graph form and a non-graph
form (``dtype_promotion``, ``memory_layout``) the graph form is registered (level ``aten``) and
the non-graph form is the module's ``apply_model``; ``non_graph_apply(name)`` returns it.

User passes (``pytest_opprof_register_passes``) join the registry through ``register``: the
generated ``<stem>_optimized.py`` calls it, and a child process of the pipeline registers the
passes its parent names in ``OPPROF_EXTRA_PASSES`` (JSON: type → ``{"target": "module:qualname",
"level", "description"}``) when this package is imported.

This package imports torch: the pytest plugin must not import it at start-up.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

from pytest_opprof.backend.plan import EXTRA_PASSES_ENV as ENV_VAR
from pytest_opprof.passes import (
    activation_substitution,
    algorithm_selection,
    attention_backend,
    batch_padding,
    bn_fold,
    conv_im2col,
    cuda_graphs,
    depthwise_taps,
    dtype_promotion,
    gemm_algorithm,
    gemm_epilogue,
    gemm_out_dtype,
    memory_layout,
    pretranspose_weights,
    qkv_fusion,
    sdpa_replacement,
    stub_detection,
)
from pytest_opprof.passes.base import Level, PassResult, PassSpec, failed

__all__ = [
    "BUILTIN",
    "ENV_VAR",
    "REGISTRY",
    "Level",
    "PassResult",
    "PassSpec",
    "get_pass",
    "load_target",
    "non_graph_apply",
    "register",
]


def _spec(name: str, level: Level, apply: Callable[..., Any], description: str) -> PassSpec:
    return PassSpec(name=name, level=level, apply=apply, description=description)


REGISTRY: dict[str, PassSpec] = {
    spec.name: spec
    for spec in (
        _spec(
            "dtype_promotion",
            "aten",
            dtype_promotion.apply,
            "fp32 matmul/conv computed in bf16, casts only around them",
        ),
        _spec(
            "gemm_out_dtype",
            "aten",
            gemm_out_dtype.apply,
            "bf16/fp16 GEMM whose result is only cast up writes fp32 itself (CUDA)",
        ),
        _spec(
            "gemm_epilogue",
            "aten",
            gemm_epilogue.apply,
            "ReLU / tanh-GELU after a biased GEMM applied in cuBLASLt's epilogue (CUDA)",
        ),
        _spec(
            "gemm_algorithm",
            "aten",
            gemm_algorithm.apply,
            "large bf16/fp16 GEMM runs the cuBLASLt algorithm measured fastest for it (CUDA)",
        ),
        _spec(
            "attention_backend",
            "aten",
            attention_backend.apply,
            "cuDNN attention moved to FlashAttention where flash computes the same call (CUDA)",
        ),
        _spec(
            "memory_layout",
            "aten",
            memory_layout.apply,
            "convolution inputs marked channels_last",
        ),
        _spec(
            "bn_fold",
            "aten",
            bn_fold.apply,
            "eval-mode batch norm folded into the conv/linear weights",
        ),
        _spec(
            "conv_im2col",
            "aten",
            conv_im2col.apply,
            "convolution over fewer than 8 input channels as an im2col gather and one GEMM",
        ),
        _spec(
            "depthwise_taps",
            "aten",
            depthwise_taps.apply,
            "depthwise convolution as the weighted sum of its kernel's taps, fused with its "
            "neighbours",
        ),
        _spec(
            "qkv_fusion",
            "functional",
            qkv_fusion.apply,
            "linears sharing an input fused into one linear + split",
        ),
        _spec(
            "sdpa_replacement",
            "functional",
            sdpa_replacement.apply,
            "hand-written attention replaced by scaled_dot_product_attention",
        ),
        _spec(
            "pretranspose_weights",
            "inductor_config",
            pretranspose_weights.config_patches,
            "Inductor freezing: weights constant, pre-transposed and pre-packed",
        ),
        _spec(
            "activation_substitution",
            "functional",
            activation_substitution.apply,
            "tanh-form GELU replaced by one GELU (F.gelu(approximate='tanh'))",
        ),
        _spec(
            "batch_padding",
            "non_graph",
            batch_padding.apply,
            "batch padded to a multiple of a tile, outputs sliced back",
        ),
        _spec(
            "cuda_graphs",
            "inductor_config",
            cuda_graphs.config_patches,
            "compiled graph replayed as a CUDA graph",
        ),
        _spec(
            "algorithm_selection",
            "inductor_config",
            algorithm_selection.config_patches,
            "GEMM autotuning, coordinate-descent tuning, optional TF32",
        ),
        _spec(
            "stub_detection",
            "functional",
            stub_detection.apply,
            "lists what no pass can transform; never mutates",
        ),
    )
}

_NON_GRAPH: dict[str, Callable[..., Any]] = {
    "dtype_promotion": dtype_promotion.apply_model,
    "memory_layout": memory_layout.apply_model,
    "batch_padding": batch_padding.apply,
}


BUILTIN: frozenset[str] = frozenset(REGISTRY)
"""The pass library's own types: a user pass cannot replace one."""

_UNLOADABLE: dict[str, str] = {}


def get_pass(name: str) -> PassSpec:
    """The registered pass ``name``; ``KeyError`` naming the known types otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        if name in _UNLOADABLE:
            raise KeyError(f"user pass {name!r} could not be loaded: {_UNLOADABLE[name]}") from None
        raise KeyError(
            f"unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}"
        ) from None


def register(spec: PassSpec) -> PassSpec:
    """Add a user graph pass (``functional`` or ``aten``) under a new type name.

    Registering the same name again replaces the earlier user pass (a generated file may be
    imported more than once); a built-in name raises ``ValueError``. The pass is guarded: an
    exception it raises, or a result that is not a ``PassResult``, becomes a ``FAILED`` result,
    as a built-in pass's failure does."""
    if spec.name in BUILTIN:
        raise ValueError(f"{spec.name!r} is a built-in pass and cannot be replaced")
    if spec.level not in ("functional", "aten"):
        raise ValueError(
            f"user pass {spec.name!r}: level {spec.level!r} is not 'functional' or 'aten'"
        )
    guarded = PassSpec(
        name=spec.name,
        level=spec.level,
        apply=_guarded(spec.name, spec.apply),
        description=spec.description,
    )
    REGISTRY[spec.name] = guarded
    _UNLOADABLE.pop(spec.name, None)
    return guarded


def load_target(target: str) -> Callable[..., Any]:
    """Import ``"module:qualname"`` and return the object it names."""
    module_name, _, qualname = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        value = getattr(value, part)
    if not callable(value):
        raise TypeError(f"{target} is not callable")
    return value


def _guarded(name: str, apply: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(apply, "__opprof_guarded__", False):
        return apply

    @functools.wraps(apply)  # keeps __module__, so the Inductor pass uuid hashes its source
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = apply(*args, **kwargs)
        except Exception as exc:
            return failed(name, exc)
        if not isinstance(result, PassResult):
            return failed(name, f"returned {type(result).__name__}, not a PassResult")
        return result

    run.__opprof_guarded__ = True  # type: ignore[attr-defined]
    return run


def _register_from_environment() -> None:
    """The user passes a parent process named in ``OPPROF_EXTRA_PASSES`` (their folders are on
    ``PYTHONPATH``). One that cannot be imported is remembered: ``get_pass`` then says why, and
    the variant that needs it fails to build with that reason."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return
    for name, entry in json.loads(raw).items():
        try:
            register(
                PassSpec(
                    name=name,
                    level=entry["level"],
                    apply=load_target(entry["target"]),
                    description=entry.get("description", ""),
                )
            )
        except Exception as exc:
            _UNLOADABLE[name] = f"{entry.get('target')}: {type(exc).__name__}: {exc}"


_register_from_environment()


def non_graph_apply(name: str) -> Callable[..., Any]:
    """The ``(model, inputs, **params)`` form of ``name``; ``KeyError`` if it has none."""
    try:
        return _NON_GRAPH[name]
    except KeyError:
        raise KeyError(
            f"pass {name!r} has no non-graph form; those that do: {', '.join(sorted(_NON_GRAPH))}"
        ) from None
