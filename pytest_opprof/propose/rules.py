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
from collections.abc import Callable

from pytest_opprof import knowledge
from pytest_opprof.propose import graph_rules, patterns
from pytest_opprof.propose.classify import OpFacts, is_matmul_kernel, kernel_precision
from pytest_opprof.propose.context import (
    MAX_EVIDENCE_PER_KIND,
    SCORE_HIGH,
    SCORE_LOW,
    SCORE_MEDIUM,
    Context,
    Draft,
    agg_source,
    ev,
    kernel_evidence,
    pct,
    share_evidence,
    summary_ev,
    timing_ev,
    top,
)
from pytest_opprof.propose.impact import OpTime, dtype_promotion_saving
from pytest_opprof.schema import Evidence

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


def _op_precision(facts: OpFacts) -> str:
    if facts.fp32_kernels:
        return "fp32"
    if "tf32" in facts.precisions:
        return "tf32"
    return _default_precision(facts)


def _default_precision(facts: OpFacts) -> str:
    # No telling kernel name: cuBLAS matmuls default to FP32 (allow_tf32 is off), cuDNN
    # convolutions to TF32 (cudnn.allow_tf32 is on) — the smaller gain is assumed for them.
    return "tf32" if facts.kind == "conv" else "fp32"


def _op_parts(ctx: Context, facts: OpFacts) -> list[OpTime]:
    """The operator's time split by what its kernels run: FP32 / TF32 GEMM-like kernels; other
    kernels (layout conversions, elementwise), which BF16 speeds up only by halving bytes; and
    kernels it cannot speed up: already 16-bit, or latency-bound — shorter than
    ``launch_bound_kernel_us``, or the serial cell kernels of a recurrent layer."""
    time, kernels, data = (
        ctx.op_time_us(facts),
        ctx.op_kernels_per_iter(facts),
        ctx.op_bytes_fp32(facts),
    )
    total = sum(k.duration_us for k in facts.kernels)
    if total <= 0:
        return [OpTime(facts.name, time, _op_precision(facts), kernels, data)]
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
        spent, count = parts.get(kind, (0.0, 0))
        parts[kind] = (spent + k.duration_us, count + 1)
    return [
        OpTime(
            f"{facts.name} ({kind})",
            time * spent / total,
            kind,
            kernels * count / len(facts.kernels),
            None if data is None else data * spent / total,
        )
        for kind, (spent, count) in sorted(parts.items())
    ]


def dtype_promotion(ctx: Context) -> list[Draft]:
    affected = top([f for f in ctx.facts.values() if _fp32_gemm_work(ctx, f)])
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
    if ctx.gpu and ctx.spec is not None:
        ops = [part for f in affected for part in _op_parts(ctx, f)]
        estimate = dtype_promotion_saving(ops, ctx.spec)
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
    if ctx.compiled is None or ctx.compiled_index is None:
        return ""
    idx = ctx.compiled_index
    gemms = top([f for f in ctx.compiled_facts.values() if _fp32_gemm_work(ctx, f)])
    triton = top(
        [
            f
            for f in ctx.compiled_facts.values()
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
    if not ctx.gpu or "cuda_graph_replay" in ctx.flags:
        return []  # knowledge/edge-cases.md: graphs already replayed — a rule, not a penalty
    s = ctx.eager.summary
    if s.wall_time_per_iter_us <= 0 or s.kernels_per_iter <= 0:
        return []
    idle = s.idle_time_per_iter_us / s.wall_time_per_iter_us
    durations = sorted(k.duration_us for o in ctx.eager.operators for k in o.kernels)
    durations += sorted(k.duration_us for k in ctx.eager.unattributed_kernels)
    if durations:
        short = sum(d < ctx.th.launch_bound_kernel_us for d in durations) / len(durations)
        median = sorted(durations)[len(durations) // 2]
    else:
        median = s.device_time_per_iter_us / s.kernels_per_iter
        short = 1.0 if median < ctx.th.launch_bound_kernel_us else 0.0
    if idle < ctx.th.idle_gap_share or short < ctx.th.launch_bound_short_kernel_share:
        return []
    evidence = [
        e
        for e in (
            summary_ev("kernels per iteration", ctx.eager, 0, "kernels_per_iter"),
            summary_ev("GPU idle per iteration", ctx.eager, 0, "idle_time_per_iter_us", "µs"),
            summary_ev("wall time per iteration", ctx.eager, 0, "wall_time_per_iter_us", "µs"),
            summary_ev("kernel time per iteration", ctx.eager, 0, "device_time_per_iter_us", "µs"),
            summary_ev(
                "launch overhead per call", ctx.eager, 0, "launch_overhead_per_call_us", "µs"
            ),
        )
        if e is not None
    ]
    evidence.extend(timing_ev(ctx))
    compiled = ""
    if ctx.compiled is not None and ctx.compiled_index is not None:
        cs = ctx.compiled.summary
        for row in (
            summary_ev(
                "compiled kernels per iteration",
                ctx.compiled,
                ctx.compiled_index,
                "kernels_per_iter",
            ),
            summary_ev(
                "compiled GPU idle per iteration",
                ctx.compiled,
                ctx.compiled_index,
                "idle_time_per_iter_us",
                "µs",
            ),
        ):
            if row is not None:
                evidence.append(row)
        if cs.wall_time_per_iter_us > 0:
            still = cs.idle_time_per_iter_us / cs.wall_time_per_iter_us
            compiled = (
                f" The torch.compile baseline is still {pct(still)} idle with "
                f"{cs.kernels_per_iter:g} kernels per iteration."
            )
    recovered = max(0.0, ctx.budget.wall_us - ctx.budget.device_us)
    impact = ctx.budget.impact(
        recovered,
        "time budget: replaying one graph recovers the time the GPU waits for the "
        "host (eager iteration − kernel time), an upper bound",
    )
    rationale = (
        f"launch-bound: the GPU is idle {pct(idle)} of the profiled iteration, "
        f"{pct(short)} of the {len(durations) or int(s.kernels_per_iter)} kernels run under "
        f"{ctx.th.launch_bound_kernel_us:g} µs (median {median:.1f} µs)." + compiled
    )
    steps = [
        "inductor config triton.cudagraphs=True (mode='reduce-overhead'): the compiled graph "
        "is recorded once per input shape and replayed with one launch",
        "inputs are copied into static buffers; outputs are cloned before the next replay",
        "requires static shapes and no host synchronisation inside the graph",
    ]
    return [
        Draft(
            "cuda_graphs",
            "inductor_config",
            ["<whole graph>"],
            evidence,
            steps,
            impact,
            SCORE_HIGH,
            rationale,
            {"config_patches": {"triton.cudagraphs": True}},
        )
    ]


Rule = Callable[[Context], list[Draft]]

RULES: tuple[tuple[str, Rule], ...] = (
    ("dtype_promotion", dtype_promotion),
    ("memory_layout", memory_layout),
    ("bn_fold", graph_rules.bn_fold),
    ("qkv_fusion", graph_rules.qkv_fusion),
    ("sdpa_replacement", graph_rules.sdpa_replacement),
    ("activation_substitution", graph_rules.activation_substitution),
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
            ctx.drafted.add(name)
        drafts.extend(made)
    return drafts
