"""Whole-model CUDA graphs: one call of the optimized callable — Dynamo's guard checks, every
compiled graph, and the eager code Dynamo left between them (``nn.LSTM`` runs cuDNN outside
any graph) — recorded once as one CUDA graph and replayed per call.

Inductor's own CUDA graphs (``triton.cudagraphs``) record each compiled graph only: a graph
break leaves the eager part launching kernel by kernel, and the Python of cudagraph trees and
of Dynamo's guards still runs on every call. Recording the whole call removes all of it; what
is left per call is one copy of each input into the recorded input buffers and the replay.

Outputs are not copied: each call returns fresh tensors over the recorded output buffers, as
``mode="reduce-overhead"`` does, and the next replay overwrites them. So that a caller who
keeps an output across calls cannot read overwritten values by mistake, the previous call's
outputs (and every view of them) are released before each replay: reading one raises an error
that says to clone it. A large output then costs no copy
(docs/design-notes.md#whole-call-graph-outputs). Where this torch lacks the bindings for that
(``_set_storage_data_ptr_access_error_msg``), each output is cloned instead.

Preconditions, checked on every call: CUDA tensors only, autograd off, and the same shapes,
dtypes, strides and non-tensor arguments as the recorded call. A call that differs runs the
uncaptured callable (``fn``), with one warning. Measured selection keeps this only where it is
faster, and stage 3 checks the replayed outputs against eager on fresh inputs.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map_only, tree_unflatten

from pytest_opprof.errors import OpprofWarning

Signature = tuple[Any, ...]


class Layout(NamedTuple):
    """Where a recorded output lies."""

    data_ptr: int
    device: torch.device
    nbytes: int
    dtype: torch.dtype
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


STALE = (
    "this output of an optimized model's whole-model CUDA graph is no longer valid: a later "
    "call replayed the graph into its memory, or the model was freed (backend.model_graph); "
    "clone an output you keep across calls: out = model(x).clone()"
)
# The bindings cudagraph trees invalidate stale outputs with (torch/csrc/cuda/Module.cpp):
# present in CUDA builds (torch 2.11), absent from CPU-only ones (2.13+cpu).
_CAN_RELEASE = hasattr(torch._C, "_set_storage_data_ptr_access_error_msg") and hasattr(
    torch._C, "_construct_storage_from_data_pointer"
)


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
        self._layouts: list[Layout | Any] = []
        """Each recorded output's :class:`Layout`, or the non-tensor output itself."""
        self._tree: TreeSpec | None = None
        self._handed_out: list[Any] = []
        """The storages of the last call's outputs. Held (they own no memory) so that the next
        replay can release them, and with them every view the caller took."""
        self._release = _CAN_RELEASE
        """Whether calls return the recorded outputs' memory (and release it on the next
        replay) rather than a clone of it."""

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
        self._release_handed_out()
        self._graph.replay()
        self.replays += 1
        if not self._release:
            return tree_map_only(torch.Tensor, torch.clone, self._outputs)
        leaves = [self._hand_out(x) if isinstance(x, Layout) else x for x in self._layouts]
        return leaves[0] if self._tree is None else tree_unflatten(leaves, self._tree)

    def _hand_out(self, layout: Layout) -> torch.Tensor:
        """A new tensor over a recorded output's memory, on a storage of its own that the next
        replay releases (views the caller takes share that storage, so they are released too).
        Cheaper than a clone, for a host-bound call as for a large output
        (docs/design-notes.md#whole-call-graph-outputs)."""
        ptr, device, nbytes, dtype, offset, shape, stride = layout
        own = torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)
        self._handed_out.append(own)
        return torch.empty(0, dtype=dtype, device=device).set_(own, offset, shape, stride)

    def _release_handed_out(self) -> None:
        for own in self._handed_out:
            torch._C._set_storage_data_ptr_access_error_msg(own._cdata, STALE)
        self._handed_out.clear()

    def __del__(self) -> None:
        # The recorded memory goes back to the allocator with the graph: nothing handed out
        # may point into it afterwards. (At interpreter exit torch may be gone already.)
        if getattr(self, "_handed_out", None) and self._release:
            with contextlib.suppress(Exception):
                self._release_handed_out()

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
        leaves, tree = tree_flatten(outputs)
        self._tree = None if tree.is_leaf() else tree
        self._layouts = [_layout(x) if isinstance(x, torch.Tensor) else x for x in leaves]


def _layout(t: torch.Tensor) -> Layout:
    storage = t.untyped_storage()
    return Layout(
        storage.data_ptr(),
        t.device,
        storage.nbytes(),
        t.dtype,
        int(t.storage_offset()),
        t.shape,
        tuple(t.stride()),
    )


def uncaptured(fn: Any) -> Any:
    """The callable a ``ModelGraph`` replays, else ``fn`` itself."""
    return fn.fn if isinstance(fn, ModelGraph) else fn
