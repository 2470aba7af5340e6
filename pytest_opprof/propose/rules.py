"""The rules over the profile: from what the timelines measured to draft proposals.

One function per transformation type, named after it, each returning the drafts it makes (none
when its preconditions do not hold): precision (``dtype_promotion``), layout conversions
(``memory_layout``, with the graph's NCHW convolutions), launch overhead (``cuda_graphs``) and
library algorithm choice (``algorithm_selection``). The rules whose evidence is a pattern in the
FX graph are in ``graph_rules.py``; ``RULES`` lists both in the order they run. The engine in
``propose/__init__.py`` numbers, penalises, filters and orders the drafts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from pytest_opprof import knowledge
from pytest_opprof.propose import graph_rules, patterns
from pytest_opprof.propose.classify import (
    OpFacts,
    is_matmul_kernel,
    kernel_precision,
    operator_work,
)
from pytest_opprof.propose.context import (
    MAX_EVIDENCE_PER_KIND,
    SCORE_HIGH,
    SCORE_LOW,
    SCORE_MEDIUM,
    Context,
    Draft,
    TimelineRef,
    agg_source,
    ev,
    kernel_evidence,
    pct,
    share_evidence,
    summary_ev,
    timing_ev,
    top,
)
from pytest_opprof.propose.impact import (
    DtypeEstimate,
    OpTime,
    dtype_promotion_saving,
    host_floor_us,
    kernel_scale,
    roofline_scale,
)
from pytest_opprof.schema import Evidence, KernelRecord

DTYPE_HIGH_SHARE = 0.25
"""FP32 GEMM-like work at or above this share of kernel time, with kernel-name or counter
evidence, makes dtype promotion a high-confidence proposal."""

SKINNY_GEMM_MIN_SHARE = 0.05
"""Skinny GEMMs (matrix-vector, split-K kernels) at or above this share of kernel time are worth
autotuning, which costs minutes of compile time; below it the tuning cannot pay."""

# cuDNN's layout conversions around NHWC kernels; plain "NCHW" in a name (bn_fw_inf_…_NCHW,
# max_pool_forward_nchw) is a kernel working in that layout, not a conversion.
_CONVERSION = re.compile(r"nchw_?to_?nhwc|nhwc_?to_?nchw|nchw2nhwc|nhwc2nchw", re.IGNORECASE)
_SKINNY_GEMM = re.compile(r"gemv|gemmSN|splitK|splitk", re.IGNORECASE)

# ----------------------------------------------------------------------------------- rules


def _fp32_gemm_work(ctx: Context, facts: OpFacts) -> bool:
    """GEMM-like (or RNN) work that runs at FP32 or TF32 rather than a 16-bit type."""
    if facts.aggregate.share <= 0 or not (facts.gemm_like or facts.kind == "rnn"):
        return False
    tensor = facts.metric("tensor_pipe_active_pct")
    if tensor is not None and tensor < ctx.th.tensor_idle_pct:
        return True
    if facts.fp32_kernels or "tf32" in facts.precisions:
        return True
    reduced = {"bf16", "fp16", "fp8"} & set(facts.precisions)
    return not reduced and ctx.model_dtype == "float32"


def _default_precision(facts: OpFacts) -> str:
    # No telling kernel name: cuBLAS matmuls default to FP32 (allow_tf32 is off), cuDNN
    # convolutions to TF32 (cudnn.allow_tf32 is on) — the smaller gain is assumed for them.
    return "tf32" if facts.kind == "conv" else "fp32"


def _call_precision(facts: OpFacts, kernels: Sequence[KernelRecord]) -> str | None:
    """FP32 or TF32 as a call's GEMM-like kernels run; None when they are 16-bit already."""
    found = {kernel_precision(k.name) for k in kernels if is_matmul_kernel(k.name)}
    if "fp32" in found:
        return "fp32"
    if "tf32" in found:
        return "tf32"
    if found & {"bf16", "fp16", "fp8"}:
        return None
    return _default_precision(facts)


def fp32_gemm_operators(ctx: Context, ref: TimelineRef) -> list[OpFacts]:
    """A timeline's GEMM-like operators that run at FP32 or TF32, largest first."""
    return top([f for f in ref.facts.values() if _fp32_gemm_work(ctx, f)])


def op_parts(ctx: Context, ref: TimelineRef, facts: OpFacts) -> list[OpTime]:
    """An operator's time per iteration with the factor BF16 scales each part by.

    Per call from the call's shapes where they give its FLOPs and bytes (the call keeps its
    fraction of the roofline, ``impact.roofline_scale``); otherwise per kernel from its name.
    """
    assert ctx.spec is not None
    time, kernels = ref.op_time_us(facts), ref.op_kernels_per_iter(facts)
    records = [r for r in ref.records(facts) if r.gpu_time_us > 0]
    measured = sum(r.gpu_time_us for r in records)
    count = sum(len(r.kernels) for r in records) or 1
    if facts.kind in ("gemm", "conv", "attention") and measured > 0:
        parts = []
        for r in records:
            flops, data = operator_work(r.name, r.input_shapes, 4)
            if flops <= 0:
                break
            precision = _call_precision(facts, r.kernels)
            scale = 1.0 if precision is None else roofline_scale(ctx.spec, precision, flops, data)
            parts.append(
                OpTime(
                    f"{facts.name}#{r.call_index}",
                    time * r.gpu_time_us / measured,
                    scale,
                    kernels * len(r.kernels) / count,
                    "roofline",
                )
            )
        else:
            return parts
    return _kernel_parts(ctx, ref, facts)


def _kernel_parts(ctx: Context, ref: TimelineRef, facts: OpFacts) -> list[OpTime]:
    """The operator's time split by what its kernels run: FP32 / TF32 GEMM-like kernels; other
    kernels (layout conversions, elementwise), which BF16 speeds up only by halving bytes; and
    kernels it cannot speed up: already 16-bit, or latency-bound — shorter than
    ``launch_bound_kernel_us``, or the serial cell kernels of a recurrent layer."""
    assert ctx.spec is not None
    time, kernels = ref.op_time_us(facts), ref.op_kernels_per_iter(facts)
    total = sum(k.duration_us for k in facts.kernels)
    if total <= 0:
        precision = _call_precision(facts, []) if not facts.fp32_kernels else "fp32"
        scale = kernel_scale(ctx.spec, precision or "none")
        return [OpTime(facts.name, time, scale, kernels, "kernel names")]
    parts: dict[str, tuple[float, int]] = {}
    for k in facts.kernels:
        precision = kernel_precision(k.name)
        if not is_matmul_kernel(k.name):
            latency = facts.kind == "rnn" or k.duration_us < ctx.th.launch_bound_kernel_us
            kind = "none" if latency else "memory"
        elif precision in ("fp32", "tf32"):
            kind = precision
        elif precision is None:
            kind = _default_precision(facts)
        else:
            kind = "none"  # already 16-bit or narrower
        spent, n = parts.get(kind, (0.0, 0))
        parts[kind] = (spent + k.duration_us, n + 1)
    return [
        OpTime(
            f"{facts.name} ({kind})",
            time * spent / total,
            kernel_scale(ctx.spec, kind),
            kernels * n / len(facts.kernels),
            "kernel names",
        )
        for kind, (spent, n) in sorted(parts.items())
    ]


def dtype_estimate(ctx: Context, ref: TimelineRef) -> DtypeEstimate | None:
    """What BF16 saves of ``ref``'s kernel time (None without a hardware-table entry)."""
    if ctx.spec is None:
        return None
    ops = [part for f in fp32_gemm_operators(ctx, ref) for part in op_parts(ctx, ref, f)]
    return dtype_promotion_saving(ops, ctx.spec)


def dtype_promotion(ctx: Context) -> list[Draft]:
    affected = fp32_gemm_operators(ctx, ctx.eager)
    share = sum(f.aggregate.share for f in affected)
    if not affected or share < ctx.th.min_op_time_share:
        return []
    evidence: list[Evidence] = [
        ev(
            "model dtype", ctx.profile.capture_metadata.dtype, "profile.json:capture_metadata.dtype"
        ),
    ]
    named = 0
    for facts in affected[:MAX_EVIDENCE_PER_KIND]:
        evidence.append(share_evidence(ctx, facts))
        tensor = facts.metric("tensor_pipe_active_pct")
        if tensor is not None:
            evidence.append(
                ev(
                    f"{facts.name} tensor pipe active",
                    tensor,
                    agg_source(0, facts.name, "metrics.tensor_pipe_active_pct"),
                    "%",
                )
            )
            named += 1
        wanted = [
            *facts.fp32_kernels,
            *(k for k in facts.aggregate.kernel_names if "tf32" in k.lower()),
        ]
        rows = kernel_evidence(facts, wanted)
        named += bool(rows)
        evidence.extend(rows)
    evidence.extend(timing_ev(ctx))
    compiled_note = _compiled_fp32(ctx, evidence)
    listed = ", ".join(f"{f.name} {pct(f.aggregate.share)}" for f in affected[:4])
    rationale = (
        f"{len(affected)} GEMM-like operator(s) run in FP32/TF32 and take {pct(share)} of the "
        f"eager {ctx.time_word} ({listed}{', …' if len(affected) > 4 else ''}). "
    )
    estimate = dtype_estimate(ctx, ctx.eager) if ctx.gpu else None
    if ctx.spec is not None and estimate is not None:
        wall = ctx.budget.wall_saving(estimate.device_saving_us)
        impact = ctx.budget.impact(
            wall, f"{estimate.detail}; device saving × busy share {1 - ctx.budget.idle_share:.0%}"
        )
        score = SCORE_HIGH if named and share >= DTYPE_HIGH_SHARE else SCORE_MEDIUM
        ratio = knowledge.peak_flops(ctx.spec, "bf16") / knowledge.peak_flops(
            ctx.spec, "fp32", tensor_cores=False
        )
        rationale += (
            f"Tensor cores run BF16 at {ratio:.1f}× the FP32 CUDA-core peak and halve the bytes "
            "moved." + compiled_note
        )
    else:
        impact = ctx.budget.impact(
            0.0,
            "not modelled on the CPU (no roofline entry; bf16 on CPU is often slower "
            "than fp32 without AMX): measured by the backend stage",
        )
        score = SCORE_LOW
        rationale += (
            "On the CPU bf16 pays only with AMX/AVX512-BF16 kernels and is often slower: "
            "proposed at low confidence for the backend stage to measure." + compiled_note
        )
    int_inputs = [d for d in ctx.profile.capture_metadata.input_dtypes if "int" in d]
    steps = [
        "get_model_and_input: model = model.to(torch.bfloat16) (parameters and buffers)",
        "cast floating-point inputs to torch.bfloat16"
        + (
            f"; integer inputs ({', '.join(sorted(set(int_inputs)))}) stay as they are"
            if int_inputs
            else ""
        ),
        "no graph change: Dynamo retraces at bf16 and cuBLAS/cuDNN pick tensor-core kernels",
        "compare with the fp32 baseline at bf16 tolerance (rtol ≈ 1e-2)",
    ]
    return [
        Draft(
            "dtype_promotion",
            "non_graph",
            [f.name for f in affected],
            evidence,
            steps,
            impact,
            score,
            rationale,
            {"dtype": "bfloat16"},
        )
    ]


def _compiled_fp32(ctx: Context, evidence: list[Evidence]) -> str:
    """Evidence and a sentence when the compiled baseline runs FP32 work too."""
    if ctx.compiled is None:
        return ""
    idx = ctx.compiled.index
    gemms = fp32_gemm_operators(ctx, ctx.compiled)
    triton = top(
        [
            f
            for f in ctx.compiled.facts.values()
            if any(k.startswith("triton_") for k in f.aggregate.kernel_names)
            and f not in gemms
            and f.aggregate.share > 0
        ]
    )
    parts = []
    if gemms:
        evidence.append(share_evidence(ctx, gemms[0], idx))
        evidence.extend(kernel_evidence(gemms[0], gemms[0].fp32_kernels, idx))
        parts.append(f"FP32 GEMM-like work holds {pct(sum(f.aggregate.share for f in gemms))}")
    if triton and ctx.model_dtype == "float32":
        evidence.append(share_evidence(ctx, triton[0], idx))
        parts.append(f"FP32 Triton kernels hold {pct(sum(f.aggregate.share for f in triton))}")
    if not parts:
        return ""
    return (
        " The torch.compile baseline keeps the precision: "
        + " and ".join(parts)
        + f" of its {ctx.time_word}."
    )


def memory_layout(ctx: Context) -> list[Draft]:
    convs = [m for v in ctx.views for m in patterns.find_nchw_convolutions(v)]
    converting = top(
        [
            f
            for f in ctx.facts.values()
            if any(_CONVERSION.search(k) for k in f.aggregate.kernel_names)
        ]
    )
    if not convs and not converting:
        return []
    evidence: list[Evidence] = []
    for m in convs[:MAX_EVIDENCE_PER_KIND]:
        evidence.extend(m.evidence)
    conversion_us = 0.0
    for facts in converting[:MAX_EVIDENCE_PER_KIND]:
        evidence.append(share_evidence(ctx, facts))
        evidence.extend(
            kernel_evidence(
                facts, [k for k in facts.aggregate.kernel_names if _CONVERSION.search(k)]
            )
        )
    for facts in converting:
        total = sum(k.duration_us for k in facts.kernels)
        moved = sum(k.duration_us for k in facts.kernels if _CONVERSION.search(k.name))
        if total > 0:
            conversion_us += ctx.op_time_us(facts) * moved / total
    if conversion_us > 0:
        impact = ctx.budget.impact(
            ctx.budget.wall_saving(conversion_us),
            f"time budget: the NCHW↔NHWC conversion kernels ({conversion_us:.1f} µs of kernel "
            "time per iteration) disappear, × busy share",
        )
    else:
        impact = ctx.budget.impact(
            0.0,
            "not modelled: no layout-conversion kernel time measured; channels_last pays "
            "with tensor-core (bf16) convolutions, measured by the backend stage",
        )
    score = SCORE_HIGH if convs and conversion_us > 0 else SCORE_MEDIUM
    targets = [m.nodes[0] for m in convs] + [f.name for f in converting]
    depthwise = sum(1 for m in convs if m.info["groups"] > 1)
    rationale = (
        f"{len(convs)} 4-D convolution(s) run on NCHW (contiguous) tensors"
        + (f", {depthwise} of them depthwise/grouped" if depthwise else "")
        + (
            f"; cuDNN converts layouts around them ({', '.join(f.name for f in converting)})"
            if converting
            else ""
        )
        + ". channels_last lets cuDNN / oneDNN and Inductor run NHWC kernels without conversions."
    )
    steps = [
        "get_model_and_input: model = model.to(memory_format=torch.channels_last)",
        "4-D floating-point inputs: x = x.contiguous(memory_format=torch.channels_last)",
        "no graph change: shapes stay logical NCHW; the NCHW↔NHWC conversion kernels go away",
    ]
    return [
        Draft(
            "memory_layout",
            "non_graph",
            targets,
            evidence,
            steps,
            impact,
            score,
            rationale,
            {"channels_last": True},
        )
    ]


def algorithm_selection(ctx: Context) -> list[Draft]:
    if not ctx.gpu:
        return []
    drafts = []
    rnns = top(
        [
            f
            for f in ctx.facts.values()
            if f.kind == "rnn" and f.aggregate.share >= ctx.th.min_op_time_share
        ]
    )
    if rnns:
        evidence = [share_evidence(ctx, f) for f in rnns]
        for f in rnns:
            evidence.extend(kernel_evidence(f, sorted(f.aggregate.kernel_names)))
        evidence.extend(e for m in patterns.find_rnn_modules(ctx.graph) for e in m.evidence)
        drafts.append(
            Draft(
                "algorithm_selection",
                "inductor_config",
                [f.name for f in rnns],
                evidence,
                [
                    "keep the recurrent layers on cuDNN's fused RNN (Dynamo does not trace "
                    "nn.LSTM)",
                    "torch.backends.cudnn.benchmark = True so cuDNN times its RNN algorithms for "
                    "this shape",
                ],
                ctx.budget.impact(
                    0.0,
                    "not modelled: cuDNN's RNN algorithms are opaque to the "
                    "roofline; measured by the backend stage",
                ),
                SCORE_LOW,
                f"recurrent operators take {pct(sum(f.aggregate.share for f in rnns))} of kernel "
                "time in cuDNN; its algorithm choice is the only lever short of a custom kernel.",
                {"scope": "rnn", "cudnn_benchmark": True, "config_patches": {}},
            )
        )
    skinny = top(
        [
            f
            for f in ctx.facts.values()
            if f.kind == "gemm"
            and f.aggregate.share >= SKINNY_GEMM_MIN_SHARE
            and any(_SKINNY_GEMM.search(k) for k in f.aggregate.kernel_names)
        ]
    )
    if skinny:
        evidence = []
        for f in skinny:
            evidence.append(share_evidence(ctx, f))
            evidence.extend(
                kernel_evidence(f, [k for k in f.aggregate.kernel_names if _SKINNY_GEMM.search(k)])
            )
        drafts.append(
            Draft(
                "algorithm_selection",
                "inductor_config",
                [f.name for f in skinny],
                evidence,
                [
                    "inductor config max_autotune_gemm=True: time cuBLAS against Triton templates "
                    "for these shapes (minutes of compile time)"
                ],
                ctx.budget.impact(
                    0.0,
                    "not modelled: autotuning outcomes are shape-specific; "
                    "measured by the backend stage",
                ),
                SCORE_LOW,
                "cuBLAS picked matrix-vector / split-K kernels (skinny shapes), where its "
                "heuristics are weakest.",
                {"scope": "gemm", "config_patches": {"max_autotune_gemm": True}},
            )
        )
    return drafts


def cuda_graphs(ctx: Context) -> list[Draft]:
    """CUDA graphs where the graph Inductor would record is launch-bound, now or once the
    drafted precision change has shrunk its kernels.

    Judged on the compiled baseline (what ``triton.cudagraphs`` replays) from the timing pass —
    latency against kernel time, no profiler overhead — with the host's time per iteration
    bounded below by max(latency − kernel time, kernels × launch overhead).
    """
    if not ctx.gpu or "cuda_graph_replay" in ctx.flags:
        return []  # knowledge/edge-cases.md: graphs already replayed — a rule, not a penalty
    if ctx.graph is not None and not ctx.graph.graphs:
        ctx.notes.append(
            "cuda_graphs: Dynamo captured no graph, so Inductor has nothing to record and replay"
        )
        return []
    ref = ctx.compiled if ctx.compiled is not None else ctx.eager
    s = ref.summary
    wall = ref.wall_us or s.wall_time_per_iter_us
    if wall <= 0 or s.kernels_per_iter <= 0:
        return []
    device = ref.device_us
    host = host_floor_us(s, ref.wall_us, device)
    idle_now = max(0.0, wall - device) / wall
    after = device
    estimate = dtype_estimate(ctx, ref) if "dtype_promotion" in ctx.drafted else None
    if estimate is not None:
        after = max(0.0, device - estimate.device_saving_us)
    idle_after = max(0.0, host - after) / max(host, after) if max(host, after) > 0 else 0.0
    durations = [k.duration_us for o in ref.timeline.operators for k in o.kernels]
    durations += [k.duration_us for k in ref.timeline.unattributed_kernels]
    if durations:
        short = sum(d < ctx.th.launch_bound_kernel_us for d in durations) / len(durations)
        median = sorted(durations)[len(durations) // 2]
    else:
        median = device / s.kernels_per_iter
        short = 1.0 if median < ctx.th.launch_bound_kernel_us else 0.0
    launch_bound = max(idle_now, idle_after) >= ctx.th.idle_gap_share
    if not launch_bound or short < ctx.th.launch_bound_short_kernel_share:
        return []
    name = "torch.compile baseline" if ref is ctx.compiled else "eager iteration"
    evidence = timing_ev(ctx, ref)
    for row in (
        summary_ev(f"{ref.timeline.label} kernels per iteration", ref, "kernels_per_iter"),
        summary_ev(
            f"{ref.timeline.label} launch overhead per call",
            ref,
            "launch_overhead_per_call_us",
            "µs",
        ),
        summary_ev("eager kernels per iteration", ctx.eager, "kernels_per_iter"),
        summary_ev(
            "eager GPU idle per iteration (profiled)", ctx.eager, "idle_time_per_iter_us", "µs"
        ),
    ):
        if row is not None and row.source not in {e.source for e in evidence}:
            evidence.append(row)
    recovered_now = max(0.0, wall - device)
    recovered_after = max(0.0, host - after)
    saving = max(recovered_now, recovered_after)
    basis = (
        f"time budget of the {name}: latency {wall:.1f} µs, kernel time {device:.1f} µs, host "
        f"≥ {host:.1f} µs per iteration (latency − kernel time, {s.kernels_per_iter:g} kernels "
        "× launch overhead, or the profiled host time / the profiler's slowdown); replaying "
        f"one graph recovers the GPU's idle time now ({recovered_now:.1f} µs)"
    )
    if estimate is not None:
        basis += (
            f" or, after dtype_promotion shrinks the kernels to ~{after:.1f} µs, the host "
            f"time they no longer hide ({recovered_after:.1f} µs)"
        )
    rationale = (
        f"launch-bound: the {name} keeps the GPU idle {pct(idle_now)} of its latency"
        + (f", {pct(idle_after)} once the kernels run in BF16" if estimate is not None else "")
        + f"; {pct(short)} of its {len(durations) or int(s.kernels_per_iter)} kernels run "
        f"under {ctx.th.launch_bound_kernel_us:g} µs (median {median:.1f} µs)."
    )
    steps = [
        "inductor config triton.cudagraphs=True (mode='reduce-overhead'): the compiled graph "
        "is recorded once per input shape and replayed with one launch",
        "inputs are copied into static buffers; outputs are cloned before the next replay",
        "requires static shapes and no host synchronisation inside the graph",
    ]
    measured_now = idle_now >= ctx.th.idle_gap_share
    return [
        Draft(
            "cuda_graphs",
            "inductor_config",
            ["<whole graph>"],
            evidence,
            steps,
            ctx.budget.impact(saving, basis),
            SCORE_HIGH if measured_now else SCORE_MEDIUM,
            rationale,
            {"config_patches": {"triton.cudagraphs": True}},
        )
    ]


Rule = Callable[[Context], list[Draft]]

RULES: tuple[tuple[str, Rule], ...] = (
    ("dtype_promotion", dtype_promotion),
    ("memory_layout", memory_layout),
    ("bn_fold", graph_rules.bn_fold),
    ("conv_im2col", graph_rules.conv_im2col),
    ("depthwise_taps", graph_rules.depthwise_taps),
    ("qkv_fusion", graph_rules.qkv_fusion),
    ("sdpa_replacement", graph_rules.sdpa_replacement),
    ("activation_substitution", graph_rules.activation_substitution),
    ("gemm_epilogue", graph_rules.gemm_epilogue),
    ("attention_backend", graph_rules.attention_backend),
    ("pretranspose_weights", graph_rules.pretranspose_weights),
    ("batch_padding", graph_rules.batch_padding),
    ("algorithm_selection", algorithm_selection),
    ("cuda_graphs", cuda_graphs),
    ("stub_detection", graph_rules.stub_detection),
)
"""Every rule, in the order they run (batch_padding reads whether dtype_promotion fired)."""


def run_rules(ctx: Context) -> list[Draft]:
    drafts: list[Draft] = []
    for name, rule in RULES:
        made = rule(ctx)
        if made:
            ctx.drafted[name] = made[0]
        drafts.extend(made)
    return drafts
