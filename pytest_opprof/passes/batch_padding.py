"""batch_padding (non-graph): pad the batch dimension up to a multiple of ``tile`` so GEMM and
convolution shapes land on whole tensor-core tiles (and one compiled shape serves nearby batch
sizes), then slice the outputs back.

The returned model is a wrapper that takes the ORIGINAL inputs: every tensor input whose first
dim is the batch size is padded by repeating its last row (never zeros — a padded row is a
valid input, so norms and softmaxes stay finite), and every output whose first dim is the padded
size is cut back to the real batch. Valid only for models whose rows do not interact across the
batch (eval-mode batch norm is fine); the validation stage's equivalence check is what proves it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from pytest_opprof.passes.base import PassResult, applied, failed, not_applied

NAME = "batch_padding"


def padded_size(batch: int, tile: int) -> int:
    return -(-batch // tile) * tile


class BatchPadded(torch.nn.Module):
    """``inner`` run on inputs padded along dim 0 to a multiple of ``tile``."""

    def __init__(self, inner: torch.nn.Module, tile: int) -> None:
        super().__init__()
        self.inner = inner
        self.tile = tile

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0:
            return self.inner(*args, **kwargs)
        batch = tensors[0].shape[0]
        size = padded_size(batch, self.tile)
        if size == batch:
            return self.inner(*args, **kwargs)

        def pad(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
                return t
            last = t[-1:].expand(size - batch, *t.shape[1:])
            return torch.cat([t, last], dim=0)

        def cut(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == size:
                return t[:batch]
            return t

        args, kwargs = tree_map(pad, (args, kwargs))
        return tree_map(cut, self.inner(*args, **kwargs))


def apply(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, tile: int = 8, **_: Any
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], PassResult]:
    """Wrap ``model`` in ``BatchPadded``; ``NOT_APPLIED`` when the example batch already is a
    multiple of ``tile`` (the model is then returned as it was)."""
    try:
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"batch_padding: tile must be a positive int, got {tile!r}")
        first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if first is None:
            return model, inputs, not_applied(NAME, "no batched tensor input")
        batch = int(first.shape[0])
        if batch % tile == 0:
            return model, inputs, not_applied(NAME, f"batch {batch} is a multiple of {tile}")
        wrapped = BatchPadded(model, tile)
    except Exception as exc:
        return model, inputs, failed(NAME, exc)
    size = padded_size(batch, tile)
    return wrapped, inputs, applied(NAME, f"batch {batch} padded to {size} (tile {tile})", 1)
