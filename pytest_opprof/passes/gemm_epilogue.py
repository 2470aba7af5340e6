"""gemm_epilogue: a linear layer's activation applied in the GEMM's epilogue (cuBLASLt).

Inductor keeps a GEMM an extern call (cuBLAS) and fuses the activation after it into a Triton
pointwise kernel: one more launch, and the GEMM's output written, read and written again.
``aten._addmm_activation(bias, a, b, use_gelu)`` has cuBLASLt add the bias and apply ReLU or
GELU while the tile is still in registers (``CUBLASLT_EPILOGUE_RELU_BIAS`` /
``GELU_BIAS``), and Inductor lowers it to that extern call as it is (``make_fallback``, no
decomposition). That saves the launch and a pass over the output
(docs/design-notes.md#the-gemm-epilogue).

The epilogue's GELU is the tanh approximation on CUDA (the CPU kernel applies the exact GELU,
``torch/_decomp/decompositions.py`` ``_addmm_activation``), so a GELU is rewritten only on
CUDA. The tanh form is rewritten in any dtype. The exact (erf) GELU is rewritten only where
the GEMM computes in bf16 or fp16, whose own rounding is the larger error: the tanh form
differs from the exact GELU by an order of magnitude less than bf16 does
(docs/design-notes.md#the-gemm-epilogue). ReLU is exact everywhere.

Pattern (aten level, after Inductor's decompositions): ``addmm(bias, a, b)`` with a 1-D bias,
then views, each used only by the next, then ``relu``, the tanh-GELU formula
(``matching.match_tanh_gelu``: spelled out by hand or by Inductor's decomposition of
``gelu(approximate='tanh')``, which computes it in fp32 between two casts), or Inductor's
decomposition of the exact GELU, ``(x * 0.5) * (erf(x * 0.7071...) + 1)`` (in fp32 between
two casts for bf16). The GEMM's result may have no other use: the pre-activation values
would still have to be written.

Among the views there may be one cast of a bf16 / fp16 result up to fp32: what the graph form
of ``dtype_promotion`` (which runs before this pass, ``backend.plan.CANONICAL_ORDER``) leaves
after each GEMM it lowers. The fused result is then viewed and cast up the same way. For a
ReLU that is exact (rounding keeps the sign); a GELU's output is rounded to the GEMM's dtype
once more, an error of the size of the GEMM's own rounding, which a plan that computes the
GEMM in bf16 / fp16 already allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from pytest_opprof.passes.base import (
    PassResult,
    erase_if_dead,
    fake_value,
    is_op,
    meta_key,
    reapply_views,
    run_graph_pass,
    set_fake_value,
    single_user,
)
from pytest_opprof.passes.matching import (
    VIEWS,
    cast_dtype,
    close_to,
    flatten_product,
    half_x_times_one_plus,
    is_cast,
    is_kind,
    match_tanh_gelu,
)

NAME = "gemm_epilogue"
aten = torch.ops.aten
prims = torch.ops.prims
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LOW = (torch.bfloat16, torch.float16)
"""Where the exact GELU may become the epilogue's tanh form: the dtype's rounding outweighs it."""
_RSQRT2 = 0.7071067811865476


def tanh_gelu_epilogue(device: torch.device) -> bool:
    """Whether ``_addmm_activation(use_gelu=True)`` applies the tanh-form GELU on ``device``."""
    return device.type == "cuda"


def apply(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    devices: Sequence[str] = ("cuda",),
) -> PassResult:
    """Fold each ReLU / tanh-GELU after a biased GEMM, and each exact GELU after a bf16 / fp16
    one, into the GEMM's epilogue. ``devices``: where the fused kernels exist (cuBLASLt:
    CUDA)."""
    return run_graph_pass(NAME, gm, example_inputs, lambda g, _: _rewrite(g, tuple(devices)))


def _rewrite(gm: torch.fx.GraphModule, devices: tuple[str, ...]) -> tuple[int, str]:
    graph = gm.graph
    key = meta_key(graph)
    fused: list[str] = []
    for node in list(graph.nodes):
        site = _relu_site(node) or _gelu_site(node) or _erf_gelu_site(node)
        if site is None:
            continue
        src, final, dead, kind = site
        gemm, views, widen = _gemm_under(src)
        if gemm is None or not _fits(gemm, devices, kind):
            continue
        with graph.inserting_before(gemm):
            kwargs: dict[str, Any] = {"use_gelu": True} if kind != RELU else {}
            out = graph.call_function(aten._addmm_activation.default, tuple(gemm.args), kwargs)
            set_fake_value(out, key)
        with graph.inserting_before(final):  # the same views, now on the activated result
            replacement = reapply_views(graph, out, [v for v in views if v is not widen], key)
            if widen is not None:  # and the same cast up (a view commutes with it)
                replacement = graph.call_function(
                    prims.convert_element_type.default, (replacement, cast_dtype(widen))
                )
                set_fake_value(replacement, key)
        final.replace_all_uses_with(replacement)
        erase_if_dead(graph, [final, *dead, *views, gemm])
        fused.append(kind)
    if not fused:
        return 0, "no biased GEMM whose only use is a ReLU or tanh-GELU (or a bf16 exact GELU)"
    kinds = ", ".join(f"{fused.count(k)} {k}" for k in (RELU, GELU, EXACT_GELU) if k in fused)
    return len(fused), f"{len(fused)} GEMM(s) apply their activation in the epilogue ({kinds})"


RELU, GELU, EXACT_GELU = "relu", "gelu", "exact gelu as tanh"
Site = tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node], str]
"""(the GEMM's viewed result, the node whose uses get the fused result, the nodes that die,
which activation: RELU, GELU or EXACT_GELU)."""


def _relu_site(node: torch.fx.Node) -> Site | None:
    if not is_op(node, aten.relu) or not isinstance(node.args[0], torch.fx.Node):
        return None
    src = node.args[0]
    return (src, node, [], RELU) if single_user(src) is node else None


def _gelu_site(tanh: torch.fx.Node) -> Site | None:
    """The tanh-GELU around ``tanh``, on the low-precision result itself or, as Inductor's
    decomposition computes it, on its fp32 copy with the result cast back."""
    if not is_kind(tanh, "tanh"):
        return None
    match = match_tanh_gelu(tanh)
    if match is None:
        return None
    x, root, nodes = match
    return _around(x, root, nodes, GELU)


def _erf_gelu_site(erf: torch.fx.Node) -> Site | None:
    """The exact GELU around ``erf``, ``0.5 * x * (1 + erf(x * 0.7071...))`` with its products
    in any arrangement (Inductor's decomposition: ``mul(mul(x, 0.5), add(erf(mul(x, 0.7071...)),
    1))``), on the low-precision result itself or on its fp32 copy with the result cast back."""
    if not is_op(erf, aten.erf) or not isinstance(erf.args[0], torch.fx.Node):
        return None
    factors, const, inner = flatten_product(erf.args[0])
    if (
        len(factors) != 1
        or not isinstance(factors[0], torch.fx.Node)
        or not close_to(const, _RSQRT2)
    ):
        return None
    x = factors[0]
    outside = half_x_times_one_plus(erf, x)
    if outside is None:
        return None
    root, outer = outside
    return _around(x, root, [*inner, erf, *outer], EXACT_GELU)


def _around(
    x: torch.fx.Node, root: torch.fx.Node, nodes: list[torch.fx.Node], kind: str
) -> Site | None:
    """The site of a GELU computed from ``x`` by ``nodes`` up to ``root``: on the GEMM's
    result itself (a widened copy of it included, see ``_gemm_under``), or on its fp32 copy
    with ``root`` cast back to the low dtype (Inductor's decomposition)."""
    if not all(u in {*nodes, root} for u in x.users):
        return None
    src, final, dead = x, root, [*nodes, root]
    back = single_user(root)
    if back is not None and is_cast(back) and is_cast(x) and isinstance(x.args[0], torch.fx.Node):
        low = fake_value(x.args[0])
        if not isinstance(low, torch.Tensor) or cast_dtype(back) != low.dtype:
            return None
        if single_user(x.args[0]) is not x:
            return None
        src, final, dead = x.args[0], back, [*dead, x]
    return src, final, dead, kind


def _gemm_under(
    src: torch.fx.Node,
) -> tuple[torch.fx.Node | None, list[torch.fx.Node], torch.fx.Node | None]:
    """The ``addmm`` under ``src``, the views between them (outermost first), each used only
    by the next, and among them at most one cast of a bf16 / fp16 result up to fp32 (the
    ``widen``, else None): what the graph form of ``dtype_promotion`` leaves after each GEMM it
    lowers. (None, [], None) where there is none."""
    views: list[torch.fx.Node] = []
    widen: torch.fx.Node | None = None
    node: Any = src
    while is_op(node, *VIEWS) or (widen is None and _widens(node)):
        if views and single_user(node) is not views[-1]:
            return None, [], None
        if not is_op(node, *VIEWS):
            widen = node
        views.append(node)
        node = node.args[0]
    if not is_op(node, aten.addmm) or len(node.args) != 3 or node.kwargs:
        return None, [], None  # beta / alpha: the epilogue adds the bias as it is
    if views and single_user(node) is not views[-1]:
        return None, [], None
    return node, views, widen


def _widens(node: Any) -> bool:
    """``node`` casts a bf16 / fp16 tensor up to fp32."""
    if not is_cast(node) or not isinstance(node.args[0], torch.fx.Node):
        return False
    low, wide = fake_value(node.args[0]), fake_value(node)
    if not isinstance(low, torch.Tensor) or not isinstance(wide, torch.Tensor):
        return False
    return low.dtype in LOW and wide.dtype == torch.float32


def _fits(gemm: torch.fx.Node, devices: tuple[str, ...], kind: str) -> bool:
    out, bias = fake_value(gemm), fake_value(gemm.args[0])
    if not isinstance(out, torch.Tensor) or not isinstance(bias, torch.Tensor):
        return False
    if out.dtype not in FLOATS or bias.dim() != 1 or bias.shape[0] != out.shape[-1]:
        return False
    if kind == EXACT_GELU and out.dtype not in LOW:
        return False
    if out.device.type not in devices:
        return False
    return kind == RELU or tanh_gelu_epilogue(out.device)
