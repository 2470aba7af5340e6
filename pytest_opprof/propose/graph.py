"""Reading the FX graph summary (``graph.json``): canonical call names, an index of each graph
(nodes by name, their users, constant arguments), and the analytic work of GEMM-like nodes.

Pure Python: the summary carries strings (targets as the capture stage spelled them, arguments
as node names or reprs of constants), not ``torch.fx`` objects.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pytest_opprof.schema import FxGraphSummary, FxNode

# Canonical call names (see ``canon``) of the operations the detectors look for.
CONV_CALLS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
LINEAR_CALLS = frozenset({"linear"})
MATMUL_CALLS = frozenset({"matmul", "bmm", "mm", "baddbmm", "einsum"})
SDPA_CALLS = frozenset({"scaled_dot_product_attention"})

_ITEMSIZE = {
    "torch.float64": 8,
    "torch.float32": 4,
    "torch.bfloat16": 2,
    "torch.float16": 2,
    "torch.int64": 8,
    "torch.int32": 4,
    "torch.int8": 1,
    "torch.uint8": 1,
    "torch.bool": 1,
}


def canon(target: str) -> str:
    """The bare call name of a node target, whatever spelling the summary used.

    ``torch.conv2d`` → ``conv2d``; ``torch._C._nn.linear`` → ``linear``; ``_operator.mul`` and
    ``<built-in function mul>`` → ``mul``; ``torch.ops.aten.mul.Tensor`` → ``mul``; a method
    name (``transpose``) stays as it is.
    """
    text = target.strip()
    builtin = re.match(r"<built-in (?:function|method) (\w+)", text)
    if builtin:
        return builtin.group(1)
    parts = [p for p in text.split(".") if p]
    if "aten" in parts:
        rest = parts[parts.index("aten") + 1 :]
        return rest[0] if rest else text
    return parts[-1] if parts else text


def itemsize(dtype: str | None) -> int:
    """Bytes per element of a dtype string such as ``torch.float32`` (4 when unknown)."""
    return _ITEMSIZE.get(dtype or "", 4)


def numel(shape: Sequence[int] | None) -> int:
    return math.prod(shape) if shape else 0


def graph_source(graph: int, node: str, field_path: str = "") -> str:
    """The evidence path of a node (or one of its fields) in ``graph.json``."""
    return f"graph.json:graphs[{graph}][{node}]{field_path}"


# ----------------------------------------------------------------------------------- views


class GraphView:
    """Index over one graph of the summary: nodes by name, their users, constant arguments."""

    def __init__(self, summary: FxGraphSummary, index: int) -> None:
        self.summary = summary
        self.index = index
        self.nodes: list[FxNode] = list(summary.graphs[index])
        self.by_name: dict[str, FxNode] = {n.name: n for n in self.nodes}
        self._users: dict[str, list[FxNode]] = {n.name: [] for n in self.nodes}
        for node in self.nodes:
            for ref in self._refs(node):
                if node not in self._users[ref]:
                    self._users[ref].append(node)

    def _refs(self, node: FxNode) -> Iterator[str]:
        for text in [*node.args, *(str(v) for v in node.kwargs.values())]:
            for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
                if token in self.by_name and token != node.name:
                    yield token

    def users(self, node: FxNode) -> list[FxNode]:
        return self._users.get(node.name, [])

    def arg(self, node: FxNode, i: int) -> FxNode | None:
        """The node passed as positional argument ``i``, or None for a constant / no argument."""
        if i >= len(node.args):
            return None
        return self.by_name.get(node.args[i])

    def const(self, node: FxNode, i: int) -> float | None:
        """Positional argument ``i`` as a number when it is a numeric constant."""
        if i >= len(node.args) or node.args[i] in self.by_name:
            return None
        try:
            return float(node.args[i])
        except ValueError:
            return None

    def calls(self, names: frozenset[str]) -> list[FxNode]:
        return [n for n in self.nodes if is_call(n) and canon(n.target) in names]

    def source(self, node: FxNode, field_path: str = "") -> str:
        return graph_source(self.index, node.name, field_path)


def is_call(node: FxNode) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def views(summary: FxGraphSummary | None) -> list[GraphView]:
    if summary is None:
        return []
    return [GraphView(summary, i) for i in range(len(summary.graphs))]


def module_kind(node: FxNode) -> str:
    """``Conv2d`` for a node whose innermost module is ``torch.nn.modules.conv.Conv2d``."""
    return (node.module_type or "").rsplit(".", 1)[-1]


def is_conv(node: FxNode) -> bool:
    if node.op == "call_module":
        return module_kind(node) in ("Conv1d", "Conv2d", "Conv3d")
    return is_call(node) and canon(node.target) in CONV_CALLS


def is_linear(node: FxNode) -> bool:
    if node.op == "call_module":
        return module_kind(node) == "Linear"
    return is_call(node) and canon(node.target) in LINEAR_CALLS


def weight_shape(view: GraphView, node: FxNode) -> tuple[FxNode | None, list[int] | None]:
    """The weight node of a linear/conv and its shape (from the node, else ``parameters``)."""
    weight = view.arg(node, 1)
    if weight is not None and weight.shape:
        return weight, weight.shape
    if node.op == "call_module" and node.module_path:
        path = _module_path(node.module_path)
        shape = view.summary.parameters.get(f"{path}.weight")
        return None, shape
    return weight, None


def _module_path(path: str) -> str:
    """``L['self'].features.0`` (Dynamo's nn_module_stack) → ``features.0``."""
    return re.sub(r"^L\['self'\]\.?", "", path)


# ------------------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class Geometry:
    """Analytic work of one GEMM-like node, for roofline estimates and tile checks."""

    node: str
    kind: str  # "linear" | "conv" | "matmul" | "sdpa"
    m: int
    n: int
    k: int
    groups: int
    flops: float
    bytes: float
    dtype: str | None


def geometry(view: GraphView, node: FxNode) -> Geometry | None:
    """FLOPs and bytes of a linear, convolution, matmul or SDPA node, from the graph's shapes."""
    out = node.shape
    if not out:
        return None
    size = itemsize(node.dtype)
    if is_linear(node):
        x = view.arg(node, 0)
        _, w = weight_shape(view, node)
        if x is None or not x.shape or not w or len(w) != 2:
            return None
        m, n, k = numel(x.shape[:-1]), w[0], w[1]
        return Geometry(
            node.name,
            "linear",
            m,
            n,
            k,
            1,
            2.0 * m * n * k,
            float((m * k + n * k + m * n) * size),
            node.dtype,
        )
    if is_conv(node):
        x = view.arg(node, 0)
        _, w = weight_shape(view, node)
        if x is None or not x.shape or not w or len(w) < 3:
            return None
        groups = max(1, x.shape[1] // w[1]) if len(x.shape) > 1 and w[1] else 1
        k = numel(w[1:])
        m = out[0] * numel(out[2:])
        n = w[0]
        flops = 2.0 * m * n * k
        data = (numel(x.shape) + numel(w) + numel(out)) * size
        return Geometry(node.name, "conv", m, n, k, groups, flops, float(data), node.dtype)
    if is_call(node) and canon(node.target) in MATMUL_CALLS - {"einsum"}:
        a, b = view.arg(node, 0), view.arg(node, 1)
        if a is None or b is None or not a.shape or not b.shape or len(out) < 2:
            return None
        m, n, k = out[-2], out[-1], a.shape[-1]
        batch = numel(out[:-2]) or 1
        flops = 2.0 * batch * m * n * k
        data = (numel(a.shape) + numel(b.shape) + numel(out)) * size
        return Geometry(node.name, "matmul", m, n, k, batch, flops, float(data), node.dtype)
    if is_call(node) and canon(node.target) in SDPA_CALLS:
        q, k_node, v = view.arg(node, 0), view.arg(node, 1), view.arg(node, 2)
        if q is None or k_node is None or v is None or not q.shape or not k_node.shape:
            return None
        t, s, d = q.shape[-2], k_node.shape[-2], q.shape[-1]
        heads = numel(q.shape[:-2]) or 1
        flops = 4.0 * heads * t * s * d
        data = (numel(q.shape) + numel(k_node.shape) + numel(v.shape or []) + numel(out)) * size
        return Geometry(node.name, "sdpa", t, s, d, heads, flops, float(data), node.dtype)
    return None


def gemm_nodes(view: GraphView) -> list[tuple[FxNode, Geometry]]:
    """Every GEMM-like node of the graph with its geometry, in graph order."""
    found = []
    for node in view.nodes:
        geo = geometry(view, node)
        if geo is not None:
            found.append((node, geo))
    return found
