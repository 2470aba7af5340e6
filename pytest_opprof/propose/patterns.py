"""Pattern detectors over the workload's FX graph summary (``graph.json``).

Each detector reads one Dynamo graph as the capture stage summarised it and returns ``Match``
records: the nodes it matched, the evidence it read — every value copied from ``graph.json``
with the path it was read from — and the numbers the impact model needs. Detectors never decide
whether a proposal is worth making; the rules do. The detectors over GEMM-like nodes (output
GEMMs, tunable GEMMs, GEMM + activation, weight ops, off-tile dimensions) are ``gemm_patterns``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from pytest_opprof.propose.graph import (
    MATMUL_CALLS,
    GraphView,
    canon,
    geometry,
    is_call,
    is_conv,
    is_linear,
    itemsize,
    module_kind,
    numel,
    weight_shape,
)
from pytest_opprof.schema import Evidence, FxGraphSummary, FxNode

BATCH_NORM_CALLS = frozenset({"batch_norm", "_native_batch_norm_legit_no_training"})
SOFTMAX_CALLS = frozenset({"softmax", "_softmax"})
# Operations allowed between QKᵀ and the softmax: scaling and masking of the scores.
SCORE_OPS = frozenset({"truediv", "div", "mul", "where", "masked_fill", "add", "sub"})
DROPOUT_CALLS = frozenset({"dropout"})
RNN_MODULE = re.compile(r"(?:^|\.)(LSTM|GRU|RNN)$")

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


# --------------------------------------------------------------------------------- matches


@dataclass
class Match:
    """One occurrence of a pattern: the nodes, the evidence read, the numbers for the impact."""

    kind: str
    graph: int
    nodes: tuple[str, ...]
    evidence: list[Evidence] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def ev(metric: str, value: Any, source: str, unit: str = "") -> Evidence:
    """The evidence that ``value`` was read at ``source``; a list or tuple is kept as its text."""
    if isinstance(value, (list, tuple)):
        value = str(list(value))
    return Evidence(metric=metric, value=value, unit=unit, source=source)


# ------------------------------------------------------------------------------- detectors


def find_conv_bn(view: GraphView) -> list[Match]:
    """Convolution (or linear) whose only user is an eval-mode batch norm of its output."""
    matches = []
    for node in view.nodes:
        if not (is_conv(node) or is_linear(node)):
            continue
        users = view.users(node)
        if len(users) != 1:
            continue
        bn = users[0]
        if not _is_batch_norm(bn) or (bn.args and bn.args[0] != node.name):
            continue
        training, where = _bn_training(bn)
        if training not in ("False", None):
            continue
        evidence = [
            ev("producer", node.target, view.source(node, ".target")),
            ev("batch_norm", bn.target, view.source(bn, ".target")),
        ]
        if where is not None:
            evidence.append(ev("batch_norm training", training, view.source(bn, where)))
        matches.append(
            Match(
                "conv_bn",
                view.index,
                (node.name, bn.name),
                evidence,
                {
                    "producer": "conv" if is_conv(node) else "linear",
                    "numel": numel(bn.shape),
                    "dtype": bn.dtype,
                    "eval_from_contract": where is None,
                },
            )
        )
    return matches


def _is_batch_norm(node: FxNode) -> bool:
    if node.op == "call_module":
        return module_kind(node).startswith("BatchNorm")
    return is_call(node) and canon(node.target) in BATCH_NORM_CALLS


def _bn_training(bn: FxNode) -> tuple[str | None, str | None]:
    """The ``training`` argument of a functional batch norm and where it was read."""
    if "training" in bn.kwargs:
        return str(bn.kwargs["training"]), ".kwargs[training]"
    if bn.op != "call_module" and canon(bn.target) == "batch_norm" and len(bn.args) > 5:
        return bn.args[5], ".args[5]"
    # aten's _native_batch_norm_legit_no_training and nn.BatchNorm modules: eval by contract.
    return None, None


def find_shared_input_linears(view: GraphView) -> list[Match]:
    """Two or more linears reading the same input node with the same in_features (Q, K, V)."""
    groups: dict[tuple[str, int], list[tuple[FxNode, FxNode | None, list[int]]]] = {}
    for node in view.nodes:
        if not is_linear(node) or not node.args:
            continue
        weight, shape = weight_shape(view, node)
        if not shape or len(shape) != 2:
            continue
        groups.setdefault((node.args[0], shape[1]), []).append((node, weight, shape))
    matches = []
    for (shared, in_features), members in groups.items():
        if len(members) < 2:
            continue
        evidence = []
        for node, weight, shape in members:
            evidence.append(ev(f"{node.name} input", shared, view.source(node, ".args[0]")))
            if weight is not None:
                evidence.append(
                    ev(f"{node.name} weight shape", shape, view.source(weight, ".shape"))
                )
        source = view.by_name.get(shared)
        info = {
            "shared_input": shared,
            "in_features": in_features,
            "out_features": [shape[0] for _, _, shape in members],
            "input_bytes": numel(source.shape if source else None)
            * itemsize(source.dtype if source else None),
        }
        matches.append(
            Match(
                "shared_input_linears",
                view.index,
                tuple(n.name for n, _, _ in members),
                evidence,
                info,
            )
        )
    return matches


def find_manual_attention(view: GraphView) -> list[Match]:
    """matmul → (scale) → (mask / where) → softmax → (dropout) → matmul, written by hand."""
    matches = []
    for soft in view.nodes:
        if not (is_call(soft) and canon(soft.target) in SOFTMAX_CALLS):
            continue
        chain = _scores_chain(view, view.arg(soft, 0))
        if chain is None:
            continue
        first, between = chain
        second = _probs_consumer(view, soft)
        if second is None:
            continue
        evidence = [
            ev("scores", first.target, view.source(first, ".target")),
            ev("softmax", soft.target, view.source(soft, ".target")),
            ev("scores shape", soft.shape or [], view.source(soft, ".shape")),
            ev("values", second.target, view.source(second, ".target")),
        ]
        masked = False
        scale = None
        for node in between:
            op = canon(node.target)
            if op in ("truediv", "div", "mul"):
                for i in range(len(node.args)):
                    value = view.const(node, i)
                    if value is not None:
                        scale = 1.0 / value if op != "mul" else value
                        evidence.append(
                            ev(f"scale ({op})", node.args[i], view.source(node, f".args[{i}]"))
                        )
            elif op in ("where", "masked_fill", "add", "sub"):
                masked = True
                evidence.append(ev("mask", node.target, view.source(node, ".target")))
        nodes = (first.name, *(n.name for n in between), soft.name, second.name)
        elements = numel(soft.shape)
        matches.append(
            Match(
                "manual_attention",
                view.index,
                nodes,
                evidence,
                {
                    "score_numel": elements,
                    "itemsize": itemsize(soft.dtype),
                    "elementwise_ops": len(between) + 1,
                    "masked": masked,
                    "scale": scale,
                },
            )
        )
    return matches


def _scores_chain(view: GraphView, node: FxNode | None) -> tuple[FxNode, list[FxNode]] | None:
    between: list[FxNode] = []
    for _ in range(6):
        if node is None or not is_call(node):
            return None
        op = canon(node.target)
        if op in MATMUL_CALLS - {"einsum"}:
            return node, list(reversed(between))
        if op not in SCORE_OPS:
            return None
        between.append(node)
        # follow the tensor operand: the one that leads back to a matmul
        candidates = [view.by_name[a] for a in node.args if a in view.by_name]
        if op == "where" and len(node.args) > 1:
            candidates = [c for c in (view.arg(node, 1), view.arg(node, 2)) if c is not None]
        node = next((c for c in candidates if _reaches_matmul(view, c)), None)
    return None


def _reaches_matmul(view: GraphView, node: FxNode, depth: int = 6) -> bool:
    """``node`` is a matmul, or scaling/masking ops lead from it back to one."""
    if depth <= 0 or not is_call(node):
        return False
    op = canon(node.target)
    if op in MATMUL_CALLS:
        return True
    if op not in SCORE_OPS:
        return False
    return any(
        _reaches_matmul(view, view.by_name[a], depth - 1) for a in node.args if a in view.by_name
    )


def _probs_consumer(view: GraphView, soft: FxNode) -> FxNode | None:
    frontier = [soft]
    for _ in range(2):
        nxt = []
        for node in frontier:
            for user in view.users(node):
                op = canon(user.target) if is_call(user) else ""
                if op in MATMUL_CALLS and user.args and user.args[0] == node.name:
                    return user
                if op in DROPOUT_CALLS:
                    nxt.append(user)
        frontier = nxt
    return None


def find_tanh_gelu(view: GraphView) -> list[Match]:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) spelled out in elementwise ops."""
    matches = []
    for tanh in view.nodes:
        if not (is_call(tanh) and canon(tanh.target) == "tanh"):
            continue
        scaled = view.arg(tanh, 0)
        if scaled is None or canon(scaled.target) != "mul":
            continue
        c1, inner, c1_at = _const_and_node(view, scaled)
        if c1 is None or inner is None or not math.isclose(c1, SQRT_2_OVER_PI, rel_tol=1e-3):
            continue
        if canon(inner.target) != "add":
            continue
        cubic = _gelu_cubic(view, inner)
        if cubic is None:
            continue
        x, cube_mul, power, c2_at, exp_at = cubic
        nodes = [power.name, cube_mul.name, inner.name, scaled.name, tanh.name]
        outer = _gelu_outer(view, tanh, x)
        nodes.extend(outer)
        evidence = [
            ev("tanh", tanh.target, view.source(tanh, ".target")),
            ev("sqrt(2/pi) constant", scaled.args[c1_at], view.source(scaled, f".args[{c1_at}]")),
            ev("cubic coefficient", cube_mul.args[c2_at], view.source(cube_mul, f".args[{c2_at}]")),
        ]
        if exp_at is not None:
            evidence.append(
                ev("exponent", power.args[exp_at], view.source(power, f".args[{exp_at}]"))
            )
        matches.append(
            Match(
                "tanh_gelu",
                view.index,
                tuple(nodes),
                evidence,
                {
                    "input": x.name,
                    "numel": numel(tanh.shape),
                    "itemsize": itemsize(tanh.dtype),
                    "ops": len(nodes),
                },
            )
        )
    return matches


def _const_and_node(view: GraphView, node: FxNode) -> tuple[float | None, FxNode | None, int]:
    const, other, at = None, None, -1
    for i in range(len(node.args)):
        value = view.const(node, i)
        if value is not None:
            const, at = value, i
        else:
            other = view.arg(node, i) or other
    return const, other, at


def _gelu_cubic(
    view: GraphView, add: FxNode
) -> tuple[FxNode, FxNode, FxNode, int, int | None] | None:
    """``x + 0.044715 * x**3``: returns x, the mul, the power, and where the constants are."""
    operands = [view.arg(add, 0), view.arg(add, 1)]
    for i, mul in enumerate(operands):
        x = operands[1 - i]
        if mul is None or x is None or canon(mul.target) != "mul":
            continue
        c2, power, c2_at = _const_and_node(view, mul)
        if c2 is None or power is None or not math.isclose(c2, GELU_CUBIC, rel_tol=1e-3):
            continue
        if canon(power.target) == "pow" and view.arg(power, 0) is x:
            exp = view.const(power, 1)
            if exp == 3.0:
                return x, mul, power, c2_at, 1
        if canon(power.target) == "mul":
            # x * x * x spelled with two muls
            a, b = view.arg(power, 0), view.arg(power, 1)
            if x in (a, b):
                sq = b if a is x else a
                if (
                    sq is not None
                    and canon(sq.target) == "mul"
                    and all(view.arg(sq, j) is x for j in (0, 1))
                ):
                    return x, mul, power, c2_at, None
    return None


def _gelu_outer(view: GraphView, tanh: FxNode, x: FxNode) -> list[str]:
    """The ``1 + tanh`` add and the multiplications by ``0.5 * x`` that follow, when present."""
    names: list[str] = []
    plus = next((u for u in view.users(tanh) if canon(u.target) == "add"), None)
    if plus is None:
        return names
    names.append(plus.name)
    for user in view.users(plus):
        if canon(user.target) != "mul":
            continue
        names.append(user.name)
        for operand in (view.arg(user, 0), view.arg(user, 1)):
            if (
                operand is not None
                and operand is not plus
                and canon(operand.target) == "mul"
                and x.name in operand.args
            ):
                names.insert(len(names) - 1, operand.name)
        break
    return names


def find_nchw_convolutions(view: GraphView) -> list[Match]:
    """4-D convolutions: Dynamo shapes are logical NCHW, the default contiguous layout."""
    matches = []
    for node in view.nodes:
        if not is_conv(node) or not node.shape or len(node.shape) != 4:
            continue
        x = view.arg(node, 0)
        evidence = [ev("conv output shape", node.shape, view.source(node, ".shape"))]
        if x is not None and x.shape:
            evidence.append(ev("conv input shape", x.shape, view.source(x, ".shape")))
        geo = geometry(view, node)
        matches.append(
            Match(
                "nchw_conv",
                view.index,
                (node.name,),
                evidence,
                {"groups": geo.groups if geo else 1, "channels": node.shape[1]},
            )
        )
    return matches


def find_rnn_modules(summary: FxGraphSummary | None) -> list[Match]:
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` modules of the model (module_types)."""
    if summary is None:
        return []
    matches = []
    for path, kind in sorted(summary.module_types.items()):
        found = RNN_MODULE.search(kind)
        if found and kind.startswith("torch.nn."):
            matches.append(
                Match(
                    "rnn_module",
                    -1,
                    (path,),
                    [ev("module type", kind, f"graph.json:module_types[{path}]")],
                    {"cell": found.group(1)},
                )
            )
    return matches
