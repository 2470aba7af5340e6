"""memory_layout: NHWC (channels_last) for convolutions, which cuDNN and oneDNN run without the
layout transposes they insert around NCHW tensor-core kernels.

Two forms share the name:

* ``apply_model(model, inputs)`` — the non-graph form and the one that does the real work: the
  model's 4-D parameters and the 4-D floating inputs become channels_last, so every convolution
  in the network sees NHWC from the first layer on.
* ``apply(gm, example_inputs)`` — the graph pass, registered in ``REGISTRY`` at the aten level.
  It marks the activation input of each 2-D convolution as channels_last with
  ``aten.clone(memory_format=torch.channels_last)`` (one clone per distinct input), which
  Inductor then produces directly from the fused producer kernel where there is one. It cannot
  change the layout of graph inputs or weights that arrive NCHW (that costs a copy per call —
  the clone of a graph input is counted in the detail), and Inductor already does this itself
  on GPU when ``config.layout_optimization`` decides so; convolutions whose input is already
  channels_last are left alone, so on such graphs the pass reports ``NOT_APPLIED``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    PassResult,
    applied,
    failed,
    fake_value,
    is_op,
    meta_key,
    not_applied,
    run_graph_pass,
    set_fake_value,
)

NAME = "memory_layout"
aten = torch.ops.aten


# ------------------------------------------------------------------------------ graph pass


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """Feed each 2-D convolution a channels_last activation."""
    return run_graph_pass(NAME, gm, example_inputs, _rewrite)


def _rewrite(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    clones: dict[torch.fx.Node, torch.fx.Node] = {}
    count = 0
    for conv in list(graph.nodes):
        if not is_op(conv, aten.convolution):
            continue
        x = conv.args[0]
        val = fake_value(x)
        if not isinstance(x, torch.fx.Node) or not _wants_nhwc(val):
            continue
        if x not in clones:
            with graph.inserting_after(x):
                clone = graph.call_function(
                    aten.clone.default, (x,), {"memory_format": torch.channels_last}
                )
                set_fake_value(clone, key)
            clones[x] = clone
        conv.replace_input_with(x, clones[x])
        count += 1
    if not count:
        return 0, "no NCHW convolution input"
    from_inputs = sum(1 for x in clones if x.op == "placeholder")
    return count, (
        f"{count} convolution(s) read channels_last ({len(clones)} clone(s), "
        f"{from_inputs} of a graph input)"
    )


def _wants_nhwc(val: Any) -> bool:
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or not val.is_floating_point():
        return False
    try:
        return not val.is_contiguous(memory_format=torch.channels_last)
    except Exception:  # symbolic strides that cannot be decided at compile time
        return False


# -------------------------------------------------------------------------- non-graph form


def apply_model(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], **_: Any
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], PassResult]:
    """``model.to(memory_format=torch.channels_last)`` (in place) and the 4-D floating inputs
    in channels_last. Without any 4-D tensor there is nothing to do: ``NOT_APPLIED``."""
    try:
        four_d = sum(1 for p in model.parameters() if p.dim() == 4)
        new_inputs = tuple(
            t.contiguous(memory_format=torch.channels_last)
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()
            else t
            for t in inputs
        )
        moved = sum(1 for a, b in zip(inputs, new_inputs, strict=True) if a is not b)
        if not four_d and not moved:
            return model, inputs, not_applied(NAME, "no 4-D parameters or inputs")
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    except Exception as exc:
        return model, inputs, failed(NAME, exc)
    return (
        model,
        new_inputs,
        applied(
            NAME, f"channels_last: {four_d} 4-D parameter(s), {moved} input(s)", four_d + moved
        ),
    )
