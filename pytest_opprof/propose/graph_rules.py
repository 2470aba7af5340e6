"""The rules over the FX graph: from pattern matches (``patterns.py``, ``gemm_patterns.py``) to
draft proposals.

BN folding, QKV fusion, SDPA formation, activation substitution, freezing, padding to tensor-core
tiles and the stubs for what no pass can rewrite. Each rule reads the profile only to weigh a
match (the operators' share of time) and to estimate its impact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pytest_opprof import knowledge
from pytest_opprof.propose import gemm_patterns, graph, patterns
from pytest_opprof.propose.context import (
    MAX_EVIDENCE_PER_KIND,
    SCORE_HIGH,
    SCORE_LOW,
    SCORE_MEDIUM,
    Context,
    Draft,
    ev,
    pct,
    share_evidence,
    top,
)
from pytest_opprof.propose.impact import bytes_at_bandwidth_us
from pytest_opprof.schema import Evidence


def bn_fold(ctx: Context) -> list[Draft]:
    matches = [m for v in ctx.views for m in patterns.find_conv_bn(v)]
    if not matches:
        return []
    bns = top([f for f in ctx.facts.values() if f.kind == "batch_norm" and f.aggregate.share > 0])
    evidence = [e for m in matches for e in m.evidence]
    evidence.extend(share_evidence(ctx, f) for f in bns)
    if bns:
        device = sum(ctx.op_time_us(f) for f in bns)
        how = f"time budget: the batch-norm kernels ({device:.1f} µs per iteration) disappear"
    else:
        data = sum(2 * m.info["numel"] * graph.itemsize(m.info["dtype"]) for m in matches)
        device = bytes_at_bandwidth_us(data, ctx.spec)
        how = f"roofline: {data / 1e6:.1f} MB of batch-norm reads and writes at HBM bandwidth"
    impact = ctx.budget.impact(
        ctx.budget.wall_saving(device, launches=len(matches)),
        f"{how}, × busy share, plus {len(matches)} launch(es)",
    )
    from_contract = any(m.info["eval_from_contract"] for m in matches)
    score = SCORE_HIGH if not from_contract else 0.8
    rationale = (
        f"{len(matches)} convolution/linear → eval BatchNorm pair(s): in inference BN is an "
        "affine map per channel that folds into the producer's weight and bias"
        + (
            f"; batch norm takes {pct(sum(f.aggregate.share for f in bns))} of {ctx.time_word}"
            if bns
            else ""
        )
        + "."
    )
    steps = [
        "aten level: match convolution/addmm → _native_batch_norm_legit_no_training "
        "(eval BN) whose input has no other user",
        "fold with the real weights: s = γ / √(σ² + ε); W' = W · s (per output channel); "
        "b' = (b − μ) · s + β",
        "replace the BN output's uses with the producer's output (getitem 0), erase BN",
        "graph.lint(); recompile",
    ]
    targets = [n for m in matches for n in m.nodes] + [f.name for f in bns]
    return [
        Draft(
            "bn_fold",
            "aten",
            targets,
            evidence,
            steps,
            impact,
            score,
            rationale,
            {"pairs": [list(m.nodes) for m in matches]},
        )
    ]


ConvSite = tuple[str, list[int], list[int], list[Evidence]]
"""A 2-D convolution of the Dynamo graph: its name, input shape, weight shape, evidence."""


def _conv2d_sites(ctx: Context, keep: Callable[[list[int], list[int]], bool]) -> list[ConvSite]:
    """The 2-D convolutions whose input and weight shapes ``keep`` accepts, each with its
    input's and (where the graph has the node) its weight's shape as evidence."""
    sites: list[ConvSite] = []
    for v in ctx.views:
        for node in v.nodes:
            if not graph.is_conv(node):
                continue
            x, (weight, w) = v.arg(node, 0), graph.weight_shape(v, node)
            if x is None or not x.shape or len(x.shape) != 4 or not w or len(w) != 4:
                continue
            if not keep(x.shape, w):
                continue
            found = [ev(f"{node.name} input shape", x.shape, v.source(x, ".shape"))]
            if weight is not None:
                found.append(ev(f"{node.name} weight shape", w, v.source(weight, ".shape")))
            sites.append((node.name, x.shape, w, found))
    return sites


def _measured_only(
    kind: str, sites: list[ConvSite], steps: list[str], ctx: Context, race: str, why: str
) -> list[Draft]:
    """A low-confidence aten draft over ``sites`` with no modelled saving: which of two kernels
    wins (``race``) is selection's measurement."""
    return [
        Draft(
            kind,
            "aten",
            [name for name, *_ in sites],
            [e for *_, found in sites[:MAX_EVIDENCE_PER_KIND] for e in found],
            steps,
            ctx.budget.impact(0.0, f"not modelled: {race}; measured"),
            SCORE_LOW,
            why,
        )
    ]


def conv_im2col(ctx: Context) -> list[Draft]:
    """2-D convolutions over fewer than ``knowledge.FEW_CHANNELS`` input channels (a network's
    stem, a patch embedding): on a GPU their tensor-core kernels pad the channels and multiply
    mostly zeros. Whether a gather and one GEMM beat that is measured, not modelled: the gather
    writes the patches once, kernel area times the input for a stride of 1."""
    if not ctx.gpu:
        return []

    def few_channels(x: list[int], w: list[int]) -> bool:
        return x[1] == w[1] < knowledge.FEW_CHANNELS  # one group: the input's channels

    sites = _conv2d_sites(ctx, few_channels)
    if not sites:
        return []
    shapes = ", ".join(f"{name} (K {math.prod(w[1:])}, N {w[0]})" for name, _, w, _ in sites)
    rationale = (
        f"{len(sites)} convolution(s) over fewer than {knowledge.FEW_CHANNELS} input channels: "
        f"{shapes}. Tensor-core convolution kernels pad the channels to "
        f"{knowledge.FEW_CHANNELS} and multiply mostly zeros; an im2col gather and one GEMM "
        "of K = channels × kernel area pad K once. Selection times both."
    )
    steps = [
        "aten level: match convolution (not transposed, groups 1, 4-D) whose weight has fewer "
        f"than {knowledge.FEW_CHANNELS} input channels",
        "gather the windows of the padded input (unfold per spatial dimension, a strided "
        "slice for dilation), permute and copy them into the patch matrix [N·Ho·Wo, C·kh·kw], "
        "K padded with zeros to a multiple of 8",
        "mm / addmm with the weight as [K, C_out]; view and permute the result to "
        "[N, C_out, Ho, Wo] (channels_last strides)",
        "replace the convolution's uses; graph.lint(); recompile",
    ]
    race = "whether the gather and GEMM beat the padded kernel"
    return _measured_only("conv_im2col", sites, steps, ctx, race, rationale)


def depthwise_taps(ctx: Context) -> list[Draft]:
    """Depthwise 2-D convolutions (one group per channel, multiplier 1) of at most
    ``knowledge.DEPTHWISE_MAX_TAPS`` taps and ``knowledge.DEPTHWISE_MAX_CHANNELS`` channels:
    memory-bound, and on a GPU run as a kernel of their own followed by another for the bias
    and activation after them. As the weighted sum of their taps, pointwise code, Inductor
    makes one kernel of the three. Measured, not modelled: the sum loads the input once per
    tap."""
    if not ctx.gpu:
        return []

    def depthwise(x: list[int], w: list[int]) -> bool:
        taps = w[2] * w[3]
        c = x[1]
        small = taps <= knowledge.DEPTHWISE_MAX_TAPS and c <= knowledge.DEPTHWISE_MAX_CHANNELS
        return c > 1 and w[:2] == [c, 1] and small

    sites = _conv2d_sites(ctx, depthwise)
    if not sites:
        return []
    kernels = sorted({f"{w[2]}×{w[3]}" for _, _, w, _ in sites})
    rationale = (
        f"{len(sites)} depthwise convolution(s) ({', '.join(kernels)}): memory-bound, each a "
        "kernel of its own with the bias and activation after it in another. As the weighted "
        "sum of the kernel's taps, pointwise code, Inductor fuses the three into one kernel "
        "that reads the input once per tap. Selection times both."
    )
    steps = [
        "aten level: match convolution (not transposed, 4-D) with groups = input channels = "
        f"output channels, at most {knowledge.DEPTHWISE_MAX_TAPS} taps and "
        f"{knowledge.DEPTHWISE_MAX_CHANNELS} channels",
        "in float32: zero-pad the input, slice it once per tap (i, j) with the stride and "
        "dilation, multiply by that tap's per-channel weight [1, C, 1, 1], sum the terms, add "
        "the bias",
        "cast back to the convolution's dtype; replace its uses; graph.lint(); recompile",
    ]
    race = "whether one fused kernel beats the convolution's"
    return _measured_only("depthwise_taps", sites, steps, ctx, race, rationale)


def qkv_fusion(ctx: Context) -> list[Draft]:
    matches = [m for v in ctx.views for m in patterns.find_shared_input_linears(v)]
    if not matches:
        return []
    launches = sum(len(m.nodes) - 1 for m in matches)
    reread = sum((len(m.nodes) - 1) * m.info["input_bytes"] for m in matches)
    device = bytes_at_bandwidth_us(reread, ctx.spec)
    impact = ctx.budget.impact(
        ctx.budget.wall_saving(device, launches=launches),
        f"roofline: the shared input is read once instead of {len(matches[0].nodes)} times "
        f"({reread / 1e6:.1f} MB less at HBM bandwidth) × busy share, plus {launches} launch(es)"
        f" × launch overhead × idle share",
    )
    rationale = (
        "; ".join(
            f"{len(m.nodes)} linears read {m.info['shared_input']} "
            f"(in_features {m.info['in_features']}, out_features {m.info['out_features']})"
            for m in matches
        )
        + ": one GEMM with the concatenated weights replaces them (wider N, one launch)."
    )
    steps = [
        "functional level (Dynamo graph, before AOT): group linear calls with the same input "
        "node and in_features",
        "concatenate their weights (dim 0) and biases into one constant; emit one linear",
        "replace each original output with a slice (narrow/split) of the fused output",
        "erase the original linears; graph.lint(); recompile",
    ]
    return [
        Draft(
            "qkv_fusion",
            "functional",
            [n for m in matches for n in m.nodes],
            [e for m in matches for e in m.evidence],
            steps,
            impact,
            0.85,
            rationale,
            {"groups": [list(m.nodes) for m in matches]},
        )
    ]


def sdpa_replacement(ctx: Context) -> list[Draft]:
    matches = [m for v in ctx.views for m in patterns.find_manual_attention(v)]
    if not matches:
        return []
    data = sum(
        (2 * m.info["elementwise_ops"] + 2) * m.info["score_numel"] * m.info["itemsize"]
        for m in matches
    )
    launches = sum(m.info["elementwise_ops"] + 1 for m in matches)
    device = bytes_at_bandwidth_us(data, ctx.spec)
    impact = ctx.budget.impact(
        ctx.budget.wall_saving(device, launches=launches),
        f"roofline: the score matrix is no longer written and re-read ({data / 1e6:.1f} MB at "
        f"HBM bandwidth) × busy share, plus {launches} launch(es) × launch overhead × idle share",
    )
    masked = sum(1 for m in matches if m.info["masked"])
    rationale = (
        f"{len(matches)} hand-written attention(s) (matmul → scale → "
        f"{'mask → ' if masked else ''}softmax → matmul) materialise the score matrix; "
        "scaled_dot_product_attention runs them as one fused (flash / memory-efficient) kernel."
    )
    steps = [
        "functional level: match matmul(q, kᵀ) → div/mul by a constant → where/masked_fill "
        "(optional) → softmax(dim=-1) → matmul(·, v)",
        "replace with F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1/√d): "
        "is_causal=True when the mask is a lower-triangular buffer slice",
        "erase the chain; graph.lint(); recompile",
    ]
    return [
        Draft(
            "sdpa_replacement",
            "functional",
            [n for m in matches for n in m.nodes],
            [e for m in matches[:MAX_EVIDENCE_PER_KIND] for e in m.evidence],
            steps,
            impact,
            SCORE_MEDIUM,
            rationale,
        )
    ]


def attention_backend(ctx: Context) -> list[Draft]:
    """Fused attention, written as SDPA or by hand (which ``sdpa_replacement`` makes SDPA):
    which fused kernel runs it fastest at the plan's precision is measured, not modelled —
    PyTorch prefers cuDNN's for bf16 on sm90, whose memset before each call idles a CUDA
    graph, while flash is slower on some shapes."""
    if not ctx.gpu:
        return []
    sites: list[tuple[str, Evidence]] = []
    for v in ctx.views:
        for node in v.calls(graph.SDPA_CALLS):
            sites.append((node.name, ev("attention", node.target, v.source(node, ".target"))))
        for m in patterns.find_manual_attention(v):
            sites.append((m.nodes[-1], m.evidence[0]))
    if not sites:
        return []
    rationale = (
        f"{len(sites)} attention(s): at bf16 / fp16 on sm90 PyTorch runs them on cuDNN, whose "
        "kernel is preceded by a copy-engine memset that leaves the GPU idle around it inside a "
        "CUDA graph; FlashAttention needs none but is slower on some shapes, so selection "
        "times both."
    )
    steps = [
        "aten level: match _scaled_dot_product_cudnn_attention(q, k, v, attn_bias=None, ...) "
        "whose log-sum-exp and RNG outputs are unused, bf16/fp16 on CUDA, head size a multiple "
        "of 8 and at most 256",
        "replace with _scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=...) "
        "where its output has the same layout",
        "graph.lint(); recompile",
    ]
    return [
        Draft(
            "attention_backend",
            "aten",
            [name for name, _ in sites],
            [e for _, e in sites[:MAX_EVIDENCE_PER_KIND]],
            steps,
            ctx.budget.impact(
                0.0, "not modelled: which fused kernel is faster depends on the shape; measured"
            ),
            SCORE_LOW,
            rationale,
            {"backend": "flash"},
        )
    ]


def activation_substitution(ctx: Context) -> list[Draft]:
    matches = [m for v in ctx.views for m in patterns.find_tanh_gelu(v)]
    if not matches:
        return []
    data = sum((m.info["ops"] - 1) * 2 * m.info["numel"] * m.info["itemsize"] for m in matches)
    launches = sum(m.info["ops"] - 1 for m in matches)
    impact = ctx.budget.impact(
        ctx.budget.wall_saving(bytes_at_bandwidth_us(data, ctx.spec), launches=launches),
        f"roofline: {launches} elementwise passes fewer ({data / 1e6:.1f} MB at HBM bandwidth) "
        "× busy share, plus their launches × launch overhead × idle share",
    )
    rationale = (
        f"{len(matches)} tanh-form GELU(s) spelled out in {matches[0].info['ops']} elementwise "
        "ops each; one gelu(approximate='tanh') computes the same function in one kernel "
        "(a compiler that fuses the spelled-out ops already has one: selection measures it)."
    )
    evidence = [e for m in matches[:MAX_EVIDENCE_PER_KIND] for e in m.evidence]
    score = 0.7
    params: dict[str, str] = {"replacement": "gelu_tanh"}
    fused = _compiled_gelu_kernel(ctx)
    if fused is not None:
        params["compiled_already"] = fused[0]
        name, source, ops = fused
        evidence.append(ev("torch.compile kernel holding the chain", ops, source))
        rationale += (
            f" The torch.compile profile already runs the chain inside one kernel ({name}: "
            f"{', '.join(ops)}), so the estimate holds against eager only; against torch.compile "
            "expect no gain, and selection, which builds with Inductor, does not try it."
        )
        score = SCORE_LOW
    steps = [
        "functional level (the Dynamo graph): match 0.5 · x · (1 + tanh(√(2/π) · "
        "(x + 0.044715 · x³))) in any operand order, x³ as pow or products",
        "replace with F.gelu(x, approximate='tanh'); erase the matched nodes",
        "graph.lint(); recompile",
    ]
    return [
        Draft(
            "activation_substitution",
            "functional",
            [n for m in matches for n in m.nodes],
            evidence,
            steps,
            impact,
            score,
            rationale,
            params,
        )
    ]


def gemm_epilogue(ctx: Context) -> list[Draft]:
    """A biased GEMM's ReLU / GELU applied in cuBLASLt's epilogue (CUDA only: the CPU
    kernel's GELU is the exact one). Its pointwise kernel after the GEMM goes, with its read
    and write of the GEMM's output. The epilogue's GELU is the tanh form: an exact GELU folds
    only where the GEMM runs in bf16 / fp16 (after ``dtype_promotion``), whose rounding
    outweighs the difference."""
    if not ctx.gpu:
        return []
    matches = [m for v in ctx.views for m in gemm_patterns.find_gemm_activation(v)]
    if not matches:
        return []
    data = sum(2 * m.info["numel"] * m.info["itemsize"] for m in matches)
    impact = ctx.budget.impact(
        ctx.budget.wall_saving(bytes_at_bandwidth_us(data, ctx.spec), launches=len(matches)),
        f"roofline: {len(matches)} pointwise pass(es) fewer ({data / 1e6:.1f} MB at HBM "
        "bandwidth) × busy share, plus their launches × launch overhead × idle share",
    )
    kinds = sorted({m.info["activation"] for m in matches})
    rationale = (
        f"{len(matches)} biased GEMM(s) feed nothing but {' / '.join(kinds)}: torch.compile "
        "keeps the GEMM a cuBLAS call and runs the activation as one more kernel over its "
        "output; cuBLASLt applies bias and activation in the GEMM's epilogue "
        "(aten._addmm_activation), which Inductor calls as it is."
    )
    if "gelu_exact" in kinds:
        rationale += (
            " The epilogue's GELU is the tanh form, so an exact GELU folds only once the GEMM "
            "runs in bf16 / fp16: over standard-normal inputs the two differ by 2.0e-4 "
            "relative, bf16's own rounding of the exact GELU by 2.6e-3."
        )
    steps = [
        "aten level: match addmm(bias, a, b) → views → relu, or → the tanh-GELU formula "
        "(spelled out, or Inductor's decomposition of gelu(approximate='tanh')), or → "
        "Inductor's erf decomposition of the exact GELU, the GEMM's result read by nothing "
        "else",
        "replace with aten._addmm_activation(bias, a, b, use_gelu=...) and the same views; "
        "a GELU only on CUDA, where the epilogue's GELU is the tanh form, and an exact GELU "
        "only where the GEMM computes in bf16 / fp16",
        "graph.lint(); recompile",
    ]
    return [
        Draft(
            "gemm_epilogue",
            "aten",
            [n for m in matches for n in m.nodes[:1]],
            [e for m in matches[:MAX_EVIDENCE_PER_KIND] for e in m.evidence],
            steps,
            impact,
            SCORE_MEDIUM,
            rationale,
            {
                "activations": kinds,
                "captured_itemsize": max(m.info["itemsize"] for m in matches),
            },
        )
    ]


GELU_CHAIN_OPS = frozenset({"aten::tanh", "aten::mul", "aten::add"})
"""ATen ops that one compiled kernel fuses where it holds a spelled-out tanh GELU."""


def _compiled_gelu_kernel(ctx: Context) -> tuple[str, str, list[str]] | None:
    """The first kernel of the torch.compile timeline whose Inductor provenance fuses a tanh
    with the multiplies and adds around it (gpt2's:
    ``triton_poi_fused_add_addmm_mul_pow_tanh_view_7``): its name, the evidence source of its
    fused ops, and those ops. None without a compiled timeline or such a kernel."""
    if ctx.compiled is None:
        return None
    for op in ctx.compiled.timeline.operators:
        if GELU_CHAIN_OPS.issubset(op.fused_ops):
            source = f"profile.json:timelines[{ctx.compiled.index}].operators[{op.name}].fused_ops"
            return op.name, source, list(op.fused_ops)
    return None


def pretranspose_weights(ctx: Context) -> list[Draft]:
    """Freezing, for every linear/convolution that reads parameters. Without a graph summary
    the profile's GEMM and convolution operators stand in; with a summary that holds no graph
    (Dynamo traced nothing) Inductor never sees the weights, so nothing is proposed."""
    if ctx.graph is not None and not ctx.graph.graphs:
        return []
    weight_ops = [m for v in ctx.views for m in gemm_patterns.find_weight_ops(v)]
    gemms = top(
        [f for f in ctx.facts.values() if f.kind in ("gemm", "conv") and f.aggregate.share > 0]
    )
    if not weight_ops and (ctx.graph is not None or not gemms):
        return []
    evidence = [e for m in weight_ops[:MAX_EVIDENCE_PER_KIND] for e in m.evidence]
    evidence.extend(share_evidence(ctx, f) for f in gemms[:3])
    impact = ctx.budget.impact(
        0.0,
        "not modelled: freezing folds weight transposes and layouts into constants at "
        "compile time, which no eager operator shows; measured by the backend stage",
    )
    count = len(weight_ops) or len(gemms)
    what = "linear/convolution call(s)" if weight_ops else "GEMM/convolution operator(s)"
    rationale = (
        f"{count} {what} read parameters that never change in inference; with freezing "
        "Inductor treats them as constants (pre-transposed, pre-packed, BN folded)."
    )
    steps = [
        "inductor config freezing=True for the compiled forward (inference under no_grad)",
        "Inductor constant-folds weight permutes/transposes and conv-BN, and lays weights out "
        "for the chosen kernels",
    ]
    targets = [m.nodes[0] for m in weight_ops] or [f.name for f in gemms]
    return [
        Draft(
            "pretranspose_weights",
            "inductor_config",
            targets,
            evidence,
            steps,
            impact,
            0.8,
            rationale,
            {"freezing": True},
        )
    ]


def batch_padding(ctx: Context) -> list[Draft]:
    if not ctx.gpu or ctx.spec is None or not ctx.views:
        return []
    half = "dtype_promotion" in ctx.drafted or ctx.model_dtype in ("bfloat16", "float16")
    dtype = "bf16" if half else "tf32"
    multiple = knowledge.tile_multiple(ctx.spec, dtype)
    if not multiple:
        return []
    found = [m for v in ctx.views for m in gemm_patterns.find_off_tile(v, multiple)]
    total = sum(g.flops for v in ctx.views for _, g in graph.gemm_nodes(v))
    gemm_share = sum(f.aggregate.share for f in ctx.facts.values() if f.gemm_like)
    padded = [m for m in found if m.info["waste_pct"] <= ctx.th.padding_max_waste_pct]
    share = gemm_share * sum(m.info["flops"] for m in padded) / total if total else 0.0
    if not padded or share < ctx.th.min_op_time_share:
        return []
    impact = ctx.budget.impact(
        0.0,
        "not modelled: the gain depends on the kernel cuBLAS/cuDNN picks for the padded "
        "shape; measured by the backend stage",
    )
    rationale = (
        f"{len(padded)} GEMM-like node(s) have N or K off the {dtype.upper()} tensor-core multiple "
        f"of {multiple} ({pct(share)} of {ctx.time_word} by FLOPs); padding adds at most "
        f"{max(m.info['waste_pct'] for m in padded):.1f}% work."
    )
    steps = [
        f"pad the off-tile dimension to a multiple of {multiple} with zeros (weights and "
        "inputs), slice the result back to the original size",
    ]
    return [
        Draft(
            "batch_padding",
            "non_graph",
            [m.nodes[0] for m in padded],
            [e for m in padded[:MAX_EVIDENCE_PER_KIND] for e in m.evidence],
            steps,
            impact,
            0.4,
            rationale,
            {"multiple": multiple},
        )
    ]


def stub_detection(ctx: Context) -> list[Draft]:
    modules = patterns.find_rnn_modules(ctx.graph)
    rnns = top([f for f in ctx.facts.values() if f.kind == "rnn" and f.aggregate.share > 0])
    if not modules and not rnns:
        return []
    evidence = [e for m in modules for e in m.evidence]
    evidence.extend(share_evidence(ctx, f) for f in rnns)
    cells = sorted({m.info["cell"] for m in modules}) or ["RNN"]
    return [
        Draft(
            "stub_detection",
            "functional",
            [m.nodes[0] for m in modules] + [f.name for f in rnns],
            evidence,
            [
                f"recognise {', '.join(cells)} (module types / aten RNN operators) and log "
                "WARNING [pass_stub_detection] with the reason; no graph change"
            ],
            ctx.budget.impact(0.0, "informational: no transformation"),
            SCORE_LOW,
            f"{', '.join(cells)} recognised: recurrent layers run as one opaque cuDNN call that "
            "no FX pass can rewrite (a custom persistent kernel would be needed).",
            {"patterns": cells},
        )
    ]
