"""The pass library: one module per transformation type, the type name being the module, the
pass name, the proposal type, the log tag and the report row.

``REGISTRY`` maps each type to its ``PassSpec``. Where a type has a graph form and a non-graph
form (``dtype_promotion``, ``memory_layout``) the graph form is registered (level ``aten``) and
the non-graph form is the module's ``apply_model``; ``non_graph_apply(name)`` returns it.

This package imports torch: the pytest plugin must not import it at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_opprof.passes import (
    activation_substitution,
    algorithm_selection,
    batch_padding,
    bn_fold,
    cuda_graphs,
    dtype_promotion,
    memory_layout,
    pretranspose_weights,
    qkv_fusion,
    sdpa_replacement,
    stub_detection,
)
from pytest_opprof.passes.base import Level, PassResult, PassSpec

__all__ = ["REGISTRY", "Level", "PassResult", "PassSpec", "get_pass", "non_graph_apply"]


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
            "aten",
            activation_substitution.apply,
            "tanh-form GELU replaced by aten.gelu(approximate='tanh')",
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


def get_pass(name: str) -> PassSpec:
    """The registered pass ``name``; ``KeyError`` naming the known types otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}"
        ) from None


def non_graph_apply(name: str) -> Callable[..., Any]:
    """The ``(model, inputs, **params)`` form of ``name``; ``KeyError`` if it has none."""
    try:
        return _NON_GRAPH[name]
    except KeyError:
        raise KeyError(
            f"pass {name!r} has no non-graph form; those that do: {', '.join(sorted(_NON_GRAPH))}"
        ) from None
