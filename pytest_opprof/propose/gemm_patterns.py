"""Pattern detectors over the GEMM-like nodes of the FX graph summary (linears, matmuls,
convolutions): GEMMs that write a graph output, GEMMs worth tuning, a biased GEMM followed by
the activation an epilogue can fold, weights that freezing makes constants, and dimensions off
the tensor-core tile. Each returns ``patterns.Match`` records, as the other detectors do.
"""

from __future__ import annotations

import re

from pytest_opprof.propose.graph import (
    MATMUL_CALLS,
    GraphView,
    canon,
    gemm_nodes,
    is_call,
    is_conv,
    is_linear,
    itemsize,
    module_kind,
    numel,
    weight_shape,
)
from pytest_opprof.propose.patterns import Match, ev, find_tanh_gelu
from pytest_opprof.schema import FxNode

VIEW_CALLS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten"})
CAST_CALLS = frozenset({"to", "float", "type", "_to_copy", "convert_element_type"})


def find_output_gemms(view: GraphView) -> list[Match]:
    """GEMMs without a bias (``linear`` without one, ``matmul``/``mm``/``bmm``) whose result,
    through views and casts, is an output of the graph: after bf16 these write the model's
    float32 output, which ``gemm_out_dtype`` lets them write themselves (an ``addmm``'s bias
    add keeps its cast apart)."""
    out = next((n for n in view.nodes if n.op == "output"), None)
    if out is None:
        return []
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(out.args))
    matches = []
    for name in dict.fromkeys(names):
        node = view.by_name.get(name)
        while node is not None and is_call(node) and canon(node.target) in VIEW_CALLS | CAST_CALLS:
            node = view.arg(node, 0)
        if node is None or not is_call(node):
            continue
        bare_linear = is_linear(node) and node.op != "call_module" and not _has_bias(view, node)
        if not (bare_linear or canon(node.target) in MATMUL_CALLS):
            continue
        evidence = [ev(f"{node.name} (output GEMM)", node.target, view.source(node, ".target"))]
        matches.append(Match("output_gemm", view.index, (node.name,), evidence))
    return matches


MIN_TUNED_GFLOP = 1.0
"""2·M·N·K of the smallest GEMM ``gemm_algorithm`` tunes: about a microsecond at a Hopper
GPU's dense bf16 peak (``knowledge``), where the tile shape matters less than the launch."""


def find_tunable_gemms(view: GraphView, min_gflop: float = MIN_TUNED_GFLOP) -> list[Match]:
    """GEMMs without a bias that lower to one 2-D ``mm`` (``linear`` without one, ``matmul`` /
    ``mm`` of a 2-D right operand) of at least ``min_gflop``: what ``gemm_algorithm`` times
    cuBLASLt's candidate algorithms for (an ``addmm``'s bias and ``bmm``'s batch it leaves)."""
    matches = []
    for node, geo in gemm_nodes(view):
        if geo.kind == "linear":
            if node.op == "call_module" or _has_bias(view, node):
                continue
        elif geo.kind == "matmul":
            b = view.arg(node, 1)
            if canon(node.target) not in ("matmul", "mm") or b is None or len(b.shape or []) != 2:
                continue
        else:
            continue
        if geo.flops < min_gflop * 1e9:
            continue
        evidence = [
            ev(f"{node.name} (GEMM)", node.target, view.source(node, ".target")),
            ev(f"{node.name} FLOPs", geo.flops, view.source(node, ".shape"), "FLOP"),
        ]
        matches.append(Match("tunable_gemm", view.index, (node.name,), evidence))
    return matches


RELU_CALLS = frozenset({"relu", "relu_"})


def find_gemm_activation(view: GraphView) -> list[Match]:
    """A biased linear (``linear`` with a bias, ``addmm``) whose result, through views used
    only once, feeds nothing but a ReLU, a tanh-form GELU (``gelu(approximate='tanh')``, or
    the formula spelled out: :func:`find_tanh_gelu`), or an exact GELU (``gelu``, which the
    pass folds only once the GEMM runs in bf16 / fp16)."""
    spelled = {m.info["input"]: m for m in find_tanh_gelu(view)}
    matches = []
    for gemm in view.nodes:
        kind = canon(gemm.target) if is_call(gemm) else ""
        if not (
            (is_linear(gemm) and gemm.op != "call_module" and _has_bias(view, gemm))
            or kind == "addmm"
        ):
            continue
        out, chain = gemm, [gemm.name]
        while len(users := view.users(out)) == 1 and canon(users[0].target) in VIEW_CALLS:
            out = users[0]
            chain.append(out.name)
        users = view.users(out)
        act, act_node = None, None
        if len(users) == 1 and _is_relu(users[0]):
            act, act_node = "relu", users[0]
        elif len(users) == 1 and (approximation := _gelu_approximation(users[0])) is not None:
            act, act_node = ("gelu_tanh" if approximation == "tanh" else "gelu_exact"), users[0]
        elif out.name in spelled and all(u.name in spelled[out.name].nodes for u in users):
            act = "gelu_tanh"
        if act is None:
            continue
        nodes = (*chain, act_node.name) if act_node is not None else tuple(chain)
        evidence = [ev(f"{gemm.name} (biased GEMM)", gemm.target, view.source(gemm, ".target"))]
        if act_node is not None:
            evidence.append(ev("activation", act_node.target, view.source(act_node, ".target")))
        else:
            evidence.extend(spelled[out.name].evidence[:1])
        matches.append(
            Match(
                "gemm_activation",
                view.index,
                nodes,
                evidence,
                {
                    "activation": act,
                    "numel": numel(out.shape),
                    "itemsize": itemsize(out.dtype),
                },
            )
        )
    return matches


def _has_bias(view: GraphView, linear: FxNode) -> bool:
    bias = view.arg(linear, 2) or view.by_name.get(str(linear.kwargs.get("bias", "")))
    return bias is not None


def _is_relu(node: FxNode) -> bool:
    if node.op == "call_module":
        return module_kind(node) == "ReLU"
    return is_call(node) and canon(node.target) in RELU_CALLS


def _gelu_approximation(node: FxNode) -> str | None:
    """The ``approximate`` of an ``F.gelu`` call (``nn.GELU()`` as Dynamo inlines it):
    ``"none"`` for the exact GELU, ``"tanh"``; None for any other node."""
    if not (is_call(node) and canon(node.target) == "gelu"):
        return None
    return str(node.kwargs.get("approximate", "none")).strip("'\"")


def find_weight_ops(view: GraphView) -> list[Match]:
    """Linears and convolutions reading parameters: constants once the model is frozen."""
    matches = []
    for node in view.nodes:
        if not (is_linear(node) or is_conv(node)):
            continue
        weight = view.arg(node, 1)
        if node.op == "call_module":
            matches.append(
                Match(
                    "weight_op",
                    view.index,
                    (node.name,),
                    [ev("module", node.target, view.source(node, ".target"))],
                )
            )
            continue
        if weight is None or weight.op not in ("placeholder", "get_attr"):
            continue
        if "parameters" not in weight.name and weight.op != "get_attr":
            continue
        matches.append(
            Match(
                "weight_op",
                view.index,
                (node.name,),
                [ev(f"{node.name} weight", weight.name, view.source(node, ".args[1]"))],
            )
        )
    return matches


def find_off_tile(view: GraphView, multiple: int) -> list[Match]:
    """GEMM-like nodes whose N or K (channels / features) is not a multiple of ``multiple``."""
    matches = []
    for node, geo in gemm_nodes(view):
        if geo.kind in ("sdpa", "matmul") or geo.groups > 1:
            continue  # grouped / depthwise convs never run as tensor-core GEMMs
        weight, shape = weight_shape(view, node)
        if not shape:
            continue
        out_dim = shape[0]
        in_dim = shape[1]
        off = [d for d in (("N", out_dim), ("K", in_dim)) if d[1] % multiple]
        if not off:
            continue
        padded = {name: _round_up(value, multiple) for name, value in off}
        waste = max(padded[name] / value - 1.0 for name, value in off) * 100.0
        evidence = []
        if weight is not None:
            evidence.append(ev(f"{node.name} weight shape", shape, view.source(weight, ".shape")))
        evidence.append(
            ev(f"{node.name} output shape", node.shape or [], view.source(node, ".shape"))
        )
        matches.append(
            Match(
                "off_tile",
                view.index,
                (node.name,),
                evidence,
                {
                    "dims": {name: value for name, value in off},
                    "padded": padded,
                    "waste_pct": waste,
                    "flops": geo.flops,
                    "bytes": geo.bytes,
                },
            )
        )
    return matches


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
