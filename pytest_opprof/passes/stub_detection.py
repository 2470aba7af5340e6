"""stub_detection: find what no pass in this library can transform and say so, never mutating.

It reads Dynamo graphs and aten graphs alike and lists, with counts:

* recurrent cells (``aten.lstm`` / ``gru`` / ``rnn_*``, ``_cudnn_rnn``, ``mkldnn_rnn_layer``,
  ``torch.lstm``, ``nn.LSTM`` modules): one opaque kernel per step that no pass rewrites;
* custom autograd Functions and other higher-order operators (``autograd_function_apply``,
  ``cond``, ``while_loop``, ``invoke_subgraph`` …): subgraphs the passes do not descend into;
* leftovers of data-dependent control flow (``.item()``, ``aten._local_scalar_dense``,
  ``nonzero``, ``_assert_async``, ``masked_select`` …): host syncs and dynamic shapes;
* custom operators outside ``aten``/``prims`` and non-``torch.nn`` modules called opaquely.

The result is always ``NOT_APPLIED``; ``matches`` is the number of sites found and ``detail``
lists them (``"nothing untransformable"`` when there is none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import PassResult, failed, not_applied

NAME = "stub_detection"

_RNN_NAMES = frozenset({
    "lstm", "gru", "rnn_tanh", "rnn_relu", "_cudnn_rnn", "miopen_rnn", "mkldnn_rnn_layer",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell",
})  # fmt: skip
_DATA_DEPENDENT_NAMES = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static", "_assert_async", "_assert_scalar",
    "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "item", "tolist",
    "bincount", "repeat_interleave",
})  # fmt: skip
_RNN_MODULES = (torch.nn.RNNBase, torch.nn.RNNCellBase)
_OWN_NAMESPACES = frozenset({"aten", "prims", "inductor", "_inductor"})


def apply(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> PassResult:
    """List the untransformable sites of ``gm``; never mutates it."""
    try:
        found = scan(gm)
    except Exception as exc:
        return failed(NAME, exc)
    if not found:
        return not_applied(NAME, "nothing untransformable")
    detail = "; ".join(f"{what} x{n}" for what, n in sorted(found.items()))
    return not_applied(NAME, detail, sum(found.values()))


def scan(gm: torch.fx.GraphModule) -> Counter[str]:
    """``{"<category>: <op>": count}`` over the nodes of ``gm``."""
    found: Counter[str] = Counter()
    for node in gm.graph.nodes:
        what = _classify(gm, node)
        if what is not None:
            found[what] += 1
    return found


def _classify(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, _RNN_MODULES):
            return f"recurrent: {type(mod).__name__}"
        if not type(mod).__module__.startswith("torch."):
            return f"opaque module: {type(mod).__name__}"
        return None
    if node.op == "call_method":
        name = str(node.target)
        return f"data-dependent: .{name}()" if name in _DATA_DEPENDENT_NAMES else None
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher-order op: {getattr(target, '_name', target)}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = getattr(target, "_qualified_op_name", None) or target._schema.name
        namespace, _, rest = str(qualified).partition("::")
        op = rest.split(".")[0]
        if op in _RNN_NAMES:
            return f"recurrent: {namespace}.{op}"
        if op in _DATA_DEPENDENT_NAMES:
            return f"data-dependent: {namespace}.{op}"
        if namespace not in _OWN_NAMESPACES:
            return f"custom op: {namespace}.{op}"
        return None
    name = getattr(target, "__name__", "")
    if name in _RNN_NAMES:
        return f"recurrent: torch.{name}"
    if name in _DATA_DEPENDENT_NAMES:
        return f"data-dependent: torch.{name}"
    return None
