"""gemm_algorithm: a large bf16/fp16 GEMM runs the cuBLASLt algorithm measured fastest for it.

torch (and Inductor, which keeps a GEMM an extern cuBLAS call unless a Triton template wins
its autotuning) runs cuBLAS's first heuristic choice. ``opprof::tuned_mm``
(``backend.cublaslt``) times the heuristic's other candidates on the first call of a shape and
keeps the fastest (docs/design-notes.md#cublaslts-algorithms).

Pattern (aten level, after AOT decomposition and after ``gemm_out_dtype``): ``mm(a, b)`` or
``mm.dtype(a, b, out_dtype)`` with ``a`` and ``b`` bf16 or fp16 on CUDA and at least
``MIN_GFLOP`` of work, rewritten to ``tuned_mm(a, b, out_dtype)``. Smaller GEMMs are left
alone: their time is the launch's, not the tile shape's, and each tuned shape costs a
measurement on its first call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.backend import cublaslt  # noqa: F401  (registers opprof::tuned_mm)
from pytest_opprof.passes.base import (
    PassResult,
    fake_value,
    is_op,
    meta_key,
    run_graph_pass,
    set_fake_value,
)
from pytest_opprof.propose.gemm_patterns import MIN_TUNED_GFLOP

NAME = "gemm_algorithm"
aten = torch.ops.aten
LOW = (torch.bfloat16, torch.float16)
MIN_GFLOP = MIN_TUNED_GFLOP


def apply(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    devices: Sequence[str] = ("cuda",),
    min_gflop: float = MIN_GFLOP,
) -> PassResult:
    """Route each large bf16/fp16 ``mm`` through ``opprof::tuned_mm``. ``devices``: where the
    op tunes (CUDA; elsewhere it runs ``torch.mm``, which tests use)."""
    return run_graph_pass(
        NAME, gm, example_inputs, lambda g, _: _rewrite(g, tuple(devices), min_gflop)
    )


def _rewrite(
    gm: torch.fx.GraphModule, devices: tuple[str, ...], min_gflop: float
) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    tuned: list[str] = []
    for node in list(graph.nodes):
        if not is_op(node, aten.mm) or node.kwargs:
            continue
        shape = _low_gemm(node, devices)
        if shape is None:
            continue
        m, k, n, out_dtype = shape
        if 2 * m * k * n < min_gflop * 1e9:
            continue
        with graph.inserting_before(node):
            call = graph.call_function(
                torch.ops.opprof.tuned_mm.default, (*node.args[:2], out_dtype)
            )
            set_fake_value(call, key)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        tuned.append(f"[{m}, {k}] @ [{k}, {n}]")
    if not tuned:
        return 0, f"no bf16/fp16 mm of {min_gflop:g} GFLOP or more"
    return len(tuned), f"{len(tuned)} GEMM(s) tuned on first call: {', '.join(tuned)}"


def _low_gemm(
    node: torch.fx.Node, devices: tuple[str, ...]
) -> tuple[int, int, int, torch.dtype] | None:
    """(M, K, N, output dtype) of a 2-D bf16/fp16 ``mm`` / ``mm.dtype`` on ``devices``."""
    a, b, out = fake_value(node.args[0]), fake_value(node.args[1]), fake_value(node)
    if not (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and isinstance(out, torch.Tensor)
    ):
        return None
    if a.dim() != 2 or b.dim() != 2 or a.dtype not in LOW or b.dtype != a.dtype:
        return None
    if a.device.type not in devices:
        return None
    if any(not isinstance(s, int) for s in (*a.shape, b.shape[1])):
        return None  # a dynamic size: one tuning would not fit every call
    return int(a.shape[0]), int(a.shape[1]), int(b.shape[1]), out.dtype
