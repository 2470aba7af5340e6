"""Whole-model CUDA graphs: one call of the optimized callable — Dynamo's guard checks, every
compiled graph, and the eager code Dynamo left between them (``nn.LSTM`` runs cuDNN outside
any graph) — recorded once as one CUDA graph and replayed per call.

Inductor's own CUDA graphs (``triton.cudagraphs``) record each compiled graph only: a graph
break leaves the eager part launching kernel by kernel, and the Python of cudagraph trees and
of Dynamo's guards still runs on every call. Recording the whole call removes all of it; what
is left per call is one copy of each input into the recorded input buffers, the replay, and one
copy of each output (the recorded outputs are overwritten by the next replay, so callers get
their own tensors, unlike ``mode="reduce-overhead"``).

Preconditions, checked on every call: CUDA tensors only, autograd off, and the same shapes,
dtypes, strides and non-tensor arguments as the recorded call. A call that differs runs the
uncaptured callable (``fn``), with one warning. Measured selection keeps this only where it is
faster, and stage 3 checks the replayed outputs against eager on fresh inputs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from pytest_opprof.errors import OpprofWarning

Signature = tuple[Any, ...]


class ModelGraphWarning(OpprofWarning):
    """A call the recorded CUDA graph cannot serve ran uncaptured."""


def _signature(args: tuple[Any, ...]) -> Signature | None:
    """What a replay must match, or None where no graph can serve the call."""
    parts: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cuda" or a.requires_grad:
                return None
            parts.append((tuple(a.shape), a.dtype, a.stride(), a.device.index))
        else:
            parts.append(("value", a))
    return tuple(parts)


class ModelGraph:
    """A callable that records ``fn`` as one CUDA graph on its first call and replays it."""

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3) -> None:
        self.fn = fn
        """The uncaptured callable: the fallback, and what the profiler attributes replays by."""
        self.warmup = warmup
        self.replays = 0
        self.fallbacks = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._signature: Signature | None = None
        self._inputs: list[Any] = []
        self._outputs: Any = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, *args: Any) -> Any:
        signature = None if torch.is_grad_enabled() else _signature(args)
        if signature is not None and self._graph is None:
            self._capture(args, signature)
        if signature is None or signature != self._signature:
            self.fallbacks += 1
            if self.fallbacks == 1:
                why = (
                    "autograd is on or an input is not a CUDA tensor"
                    if signature is None
                    else "its inputs differ in shape, dtype, stride or value from the recorded call"
                )
                warnings.warn(
                    f"whole-model CUDA graph: a call ran uncaptured because {why}; the result "
                    "is the same, only slower: call under torch.no_grad() with CUDA inputs shaped "
                    "as the first call's, or make another optimize(model) for other shapes",
                    ModelGraphWarning,
                    stacklevel=2,
                )
            return self.fn(*args)
        for static, given in zip(self._inputs, args, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(given)
        assert self._graph is not None
        self._graph.replay()
        self.replays += 1
        return tree_map_only(torch.Tensor, torch.clone, self._outputs)

    def _capture(self, args: tuple[Any, ...], signature: Signature) -> None:
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        # Warm up on a side stream, as torch.cuda.graphs' documentation asks: compilation,
        # autotuning, cuBLAS workspaces and lazy initialisation all happen before recording.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(*inputs)
        self._graph, self._signature = graph, signature
        self._inputs, self._outputs = inputs, outputs


def uncaptured(fn: Any) -> Any:
    """The callable a ``ModelGraph`` replays, else ``fn`` itself."""
    return fn.fn if isinstance(fn, ModelGraph) else fn
