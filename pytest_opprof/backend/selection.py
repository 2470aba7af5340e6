"""Measured selection's rules: which rungs it climbs and in what order, which it keeps, and
which get a second pass. Pure Python; ``runner.task_select`` builds and times the rungs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pytest_opprof.backend.plan import LADDER_ORDER, Rung, ladder
from pytest_opprof.schema import (
    BackendPlan,
    Evidence,
    FxGraphSummary,
    Impact,
    IrLevel,
    LatencyStats,
    Numerics,
    Proposal,
    Speedup,
    VariantResult,
    WaterfallStep,
)

if TYPE_CHECKING:
    from pytest_opprof.passes.base import PassResult


def not_tried(proposals: Sequence[Proposal], skip: Set[str]) -> dict[str, tuple[str, str]]:
    """The proposals selection never builds, id -> (type, why): those of a type the workload's
    ``OPPROF["skip"]`` names; an LLM proposal of a type no registered pass implements (its code,
    if any, was written to ``params["pass_file"]`` for stage 3 to check apart); and a rewrite
    whose chain the torch.compile profile already runs inside one kernel
    (``params["compiled_already"]``): Inductor builds every variant, and compiles the rewrite
    to that same kernel (docs/design-notes.md#rewrites-inductor-already-fuses)."""
    out: dict[str, tuple[str, str]] = {}
    for p in proposals:
        if p.type in skip:
            why = "skipped by the workload's OPPROF['skip']"
        elif p.params.get("implemented") is False:
            why = "no pass implements this type; selection does not run LLM-written code " + (
                f"(stage 3 checks {p.params['pass_file']} on its own)"
                if p.params.get("pass_file")
                else "and it carried none"
            )
        elif p.params.get("compiled_already"):
            why = (
                "not tried: the torch.compile profile already runs it inside one kernel "
                f"({p.params['compiled_already']}), which Inductor builds here too"
            )
        else:
            continue
        out[p.id] = (p.type, why)
    return out


def selection_rungs(
    proposals: Sequence[Proposal],
    device: str,
    skip: Set[str],
    graph: FxGraphSummary | None = None,
) -> list[Rung]:
    """The ladder selection climbs: the proposals' rungs (``backend.plan.ladder``) and, on a
    GPU, the rungs no rule proposes — ``gemm_out_dtype`` right after bf16 where a GEMM writes
    an output of the captured ``graph`` (or where there is no graph to tell), ``gemm_algorithm``
    after the graph rewrites where bf16 is in and a large GEMM without a bias is, and CUDA graphs
    before everything else: first one graph of the whole call (graph breaks included), then
    Inductor's per-graph CUDA graphs, which selection does not build once the whole call is
    one graph. ``skip``: the types the workload's ``OPPROF["skip"]`` names."""
    rungs = ladder(proposals)
    if device != "cuda":
        return rungs
    precision = next((i for i, r in enumerate(rungs) if r.name == "dtype_promotion"), None)
    if (
        precision is not None
        and "gemm_out_dtype" not in skip
        and not any(r.name == "gemm_out_dtype" for r in rungs)
        and gemm_writes_an_output(graph)
    ):
        # Right after bf16: a GEMM whose result is only cast back up can write fp32 itself,
        # which the fp32 profile cannot show (it has no cast).
        rungs.insert(precision + 1, Rung("gemm_out_dtype", (auto_gemm_out_dtype(),)))
    if (
        precision is not None
        and "gemm_algorithm" not in skip
        and not any(r.name == "gemm_algorithm" for r in rungs)
        and has_tunable_gemm(graph)
    ):
        # After the graph rewrites, before layout and Inductor's settings (LADDER_ORDER): the
        # GEMMs it tunes compute in bf16 only once dtype_promotion is in.
        later = LADDER_ORDER[LADDER_ORDER.index("gemm_algorithm") + 1 :]
        at = next((i for i, r in enumerate(rungs) if r.name in later), len(rungs))
        rungs.insert(at, Rung("gemm_algorithm", (auto_gemm_algorithm(),)))
    if "cuda_graphs" in skip:
        return rungs
    if not any(r.name == "cuda_graphs" for r in rungs):
        rungs.insert(0, Rung("cuda_graphs", (auto_cuda_graphs(),)))
    return [Rung("cuda_graphs_model", (auto_cuda_graphs(scope="model"),)), *rungs]


def climbed(
    proposals: Sequence[Proposal], device: str, skip: Set[str], graph: FxGraphSummary | None
) -> tuple[dict[str, tuple[str, str]], list[Rung]]:
    """What selection sets aside without building it (``not_tried``: id -> (type, why)), and
    the rungs it climbs with the rest (``selection_rungs``)."""
    aside = not_tried(proposals, skip)
    kept = [p for p in proposals if p.id not in aside]
    return aside, selection_rungs(kept, device, skip, graph)


def gemm_writes_an_output(graph: FxGraphSummary | None) -> bool:
    """Whether a GEMM without a bias writes one of the graph's outputs (through views and
    casts): the only place where bf16 leaves a GEMM whose result is just cast back up to
    float32. Without a graph summary, assume it may. Elsewhere the rung applies nowhere, and
    building it to find out costs seconds (docs/design-notes.md#gemms-that-write-an-output)."""
    if graph is None:
        return True
    from pytest_opprof.propose.gemm_patterns import find_output_gemms
    from pytest_opprof.propose.graph import views

    return any(find_output_gemms(v) for v in views(graph))


def has_tunable_gemm(graph: FxGraphSummary | None) -> bool:
    """Whether a GEMM without a bias of ``MIN_TUNED_GFLOP`` or more is in the graph: what
    ``gemm_algorithm`` tunes. Without a graph summary, assume there may be one."""
    if graph is None:
        return True
    from pytest_opprof.propose.gemm_patterns import find_tunable_gemms
    from pytest_opprof.propose.graph import views

    return any(find_tunable_gemms(v) for v in views(graph))


MIN_RUNG_GAIN = 1.01
"""A rung is kept when it is confidently faster (the paired 95% CI above 1) and by at least
this much at the median. Timed on CUDA graphs the intervals narrow to a few tenths of a
percent, and a gain that small is not worth a build and a second pass
(docs/design-notes.md#the-1-floor)."""
NO_GAIN = "made nothing faster"
SMALL_GAIN = f"gained under {MIN_RUNG_GAIN - 1:.0%}"


MUCH_SLOWER = 0.5
"""A rung whose paired CI lies wholly below this, the call over twice as slow, gets no second
pass: no rung kept on a second pass had timed near a halving on its first, and such a rung's
second pass is a selection's slowest timing (docs/design-notes.md#no-second-pass-for-a-halving)."""
SLOWER = "made the call over twice as slow"


def faster_enough(gain: Speedup) -> bool:
    """Whether selection keeps a rung that measured ``gain`` against the plan below it."""
    return gain.ci_low > 1.0 and gain.ratio >= MIN_RUNG_GAIN


def verdict(gain: Speedup) -> str:
    """Why a rung that measured ``gain`` was dropped (a dropped reason's first words)."""
    if gain.ci_high < MUCH_SLOWER:
        return SLOWER
    return NO_GAIN if gain.ci_low <= 1.0 else SMALL_GAIN


PLAN_FASTER = "the ladder's plan was faster"


def stock_holds(gain: Speedup) -> bool:
    """Whether the stock recipe ships in place of the ladder's plan, ``gain`` being the recipe
    timed against that plan: unless the plan clears the bar every rung clears, the other way
    round (the CI wholly below 1, by ``MIN_RUNG_GAIN`` at the median). Where the two are level
    within the noise, the recipe ships: the tool is never slower than the stock line, and its
    program is then a user's three lines, with no pass of this package in it
    (docs/design-notes.md#level-with-the-stock-recipe)."""
    return not (gain.ci_high < 1.0 and gain.ratio * MIN_RUNG_GAIN <= 1.0)


class Bar(NamedTuple):
    """What a timed rung must clear: ``keep`` it on its ``gain`` against ``against``; else
    drop it, ``verdict(gain)`` saying why."""

    keep: Callable[[Speedup], bool]
    verdict: Callable[[Speedup], str]
    against: str


RUNG_BAR = Bar(faster_enough, verdict, "the plan without it")
"""A rung of the ladder, on top of the plan below it."""
STOCK_BAR = Bar(stock_holds, lambda gain: PLAN_FASTER, "the ladder's plan")
"""The stock recipe, in place of the ladder's plan: the plan must beat it."""


EARLY_ROUNDS = 3
"""Rounds after which selection stops timing a rung whose call took over twice the plan's in
every one of them, or under a third of it (:func:`settled`)."""


def over_twice_as_slow(samples: Mapping[str, Sequence[float]]) -> bool:
    """Whether to stop timing a rung early: in each of at least ``EARLY_ROUNDS`` interleaved
    rounds so far, its call (``candidate``) took over twice the plan's (``current``). Such a
    rung cannot be kept (that needs its CI above 1), and the rest of its rounds are the slowest
    of a selection (bf16 on a CPU without bf16 units: docs/usage.md#quick-start)."""
    current, candidate = samples["current"], samples["candidate"]
    done = min(len(current), len(candidate))
    return done >= EARLY_ROUNDS and all(
        c * MUCH_SLOWER > b for b, c in zip(current[:done], candidate[:done], strict=True)
    )


MUCH_FASTER = 1 / 3
"""A rung's call under this share of the plan's in each early round settles it kept
(:func:`far_faster`). Not a half, the mirror of :data:`MUCH_SLOWER`: a slowed host moves a
launch-bound plan's call by up to twice for seconds at a time while a CUDA-graph replay's
stays, so a rung level with the plan can time twice as fast on such a host."""


def far_faster(samples: Mapping[str, Sequence[float]]) -> bool:
    """The other way round: in each of at least ``EARLY_ROUNDS`` rounds so far, the rung's
    call took under :data:`MUCH_FASTER` of the plan's, and no round ran on a slowed host (its
    host reference over ``measure.SLOW_HOST`` times the fastest of them). Such a rung is kept
    (its paired CI then lies far past the bar), and its rest of rounds would only narrow a
    figure no decision reads: the reported figures are the recapture's."""
    from pytest_opprof.measure import SLOW_HOST

    current, candidate = samples["current"], samples["candidate"]
    done = min(len(current), len(candidate))
    host = list(getattr(samples, "host_us", ()))[:done]
    if done < EARLY_ROUNDS or (host and max(host) > SLOW_HOST * min(host)):
        return False
    return all(c < MUCH_FASTER * b for b, c in zip(current[:done], candidate[:done], strict=True))


def settled(samples: Mapping[str, Sequence[float]]) -> bool:
    """Whether a rung's early rounds settle it either way (:func:`over_twice_as_slow`,
    :func:`far_faster`), so its timing stops there, sparing the GPU the rounds left."""
    return over_twice_as_slow(samples) or far_faster(samples)


def timed_rung(
    name: str,
    plan: BackendPlan,
    gain: Speedup,
    latency: LatencyStats,
    *,
    label: str,
    below_name: str,
    below_latency: LatencyStats,
    below_step: WaterfallStep,
    numerics: Numerics | None = None,
) -> tuple[VariantResult, WaterfallStep]:
    """A rung's row of the variants table, and the waterfall step (``label``) it makes if kept,
    from its one paired run against the plan below it: ``below_name``, whose latency in the same
    rounds is ``below_latency`` and whose step is ``below_step``. Latencies and the paired ratio
    are measured (``below_latency`` over ``latency`` is ``gain.ratio``); the speedup over the
    reference is chained, ``below_step``'s times ``gain.ratio``: each pair ran on its own, so
    the reference's latency over a rung's, taken from two runs, need not equal it (the report
    labels it an estimate)."""
    paired = gain.model_copy(update={"baseline": below_name, "candidate": name})
    chained = below_step.speedup_cumulative * gain.ratio
    variant = VariantResult(
        name=name,
        plan=plan,
        latency=latency,
        speedup=chained,
        paired=paired,
        paired_baseline_ms=below_latency.median_ms,
        numerics=numerics,
    )
    step = WaterfallStep(
        step=label,
        latency_ms=below_step.latency_ms / gain.ratio,
        speedup_cumulative=chained,
        speedup_added=gain.ratio,
        measured_ms=latency.median_ms,
        paired=paired,
        paired_baseline_ms=below_latency.median_ms,
    )
    return variant, step


def second_pass(kept: Sequence[bool]) -> list[int]:
    """The rungs (indices) that may be tried again on top of the final plan: those dropped
    before the last one kept, which were timed against a plan that has changed since. None where
    no rung was kept: the plan is still the one they were timed against."""
    last = max((i for i, k in enumerate(kept) if k), default=-1)
    return [i for i in range(last) if not kept[i]]


def worth_a_second_pass(reasons: list[str], revived: bool) -> bool:
    """Whether a dropped rung is tried again on top of the final plan: when it made nothing
    (or too little) faster, since some gains only appear together, but not when it made the
    call over twice as slow; or when it applied nowhere and a rung before it was kept on this
    second pass (the pattern it needs may exist now)."""
    if all(r.startswith((NO_GAIN, SMALL_GAIN)) for r in reasons):
        return True
    return revived and all(r.startswith("applied nowhere") for r in reasons)


FIRST_PASS, SECOND_PASS = "first pass: ", "second pass: "


def dropped_reason(first: str | None, reason: str, second_pass: bool) -> str:
    """What a dropped rung's record says: ``reason``; on selection's second pass, after what
    the first pass said (``first``), as ``"first pass: <first>; second pass: <reason>"``, so
    that the record keeps the rung's whole history: why it was tried again and why it was
    dropped again (``bn_fold`` made nothing faster, then applied nowhere on top of frozen
    weights). The words a second pass is decided on (:func:`worth_a_second_pass`) are the
    first pass's, read before the second pass writes."""
    if not second_pass or first is None:
        return reason
    return f"{FIRST_PASS}{first}; {SECOND_PASS}{reason}"


def applied_nowhere(proposals: Sequence[Proposal], results: Sequence[PassResult]) -> str | None:
    """What the passes said when every proposal of a rung has a pass record and none of them
    applied (the program is unchanged); None when any applied or one has no record (Inductor
    settings and CUDA graphs record none)."""
    said = []
    for p in proposals:
        mine = [r for r in results if r.name == p.type]
        if not mine:
            return None
        if any(r.status == "APPLIED" for r in mine):
            return None
        said.append(f"{p.id}: {mine[0].detail}")
    return "; ".join(said) if said else None


def auto_gemm_out_dtype() -> Proposal:
    """``gemm_out_dtype`` is tried after ``dtype_promotion`` on every GPU workload: the cast
    it removes only exists once bf16 is in."""
    return _tried_by_selection(
        "gemm_out_dtype-selection",
        "gemm_out_dtype",
        "aten",
        "GEMMs whose bf16 result is only cast to float32",
        "convert(views(mm(a, b)), float32) -> views(mm.dtype(a, b, float32))",
        "tried by measured selection after dtype_promotion on every GPU workload",
    )


def auto_gemm_algorithm() -> Proposal:
    """``gemm_algorithm`` is tried after the graph rewrites on every GPU workload with a large
    GEMM once bf16 is in: which of cuBLASLt's algorithms is fastest only a measurement says."""
    return _tried_by_selection(
        "gemm_algorithm-selection",
        "gemm_algorithm",
        "aten",
        "bf16/fp16 GEMMs without a bias of 1 GFLOP or more",
        "mm(a, b) -> opprof::tuned_mm(a, b, out_dtype): cuBLASLt's candidates timed on the "
        "first call, the fastest kept",
        "tried by measured selection after dtype_promotion on every GPU workload with one",
    )


def auto_cuda_graphs(scope: str = "graph") -> Proposal:
    """CUDA graphs are tried on every GPU workload, proposed or not
    (docs/how-it-works.md#measured-selection): once other rungs shorten the kernels, launch
    overhead is often what is left, which the eager profile cannot show. ``scope="graph"``:
    Inductor's CUDA graph trees, one per compiled graph; ``"model"``: one graph of the whole
    call, which also covers the code between graph breaks and skips the per-call Python of
    guards and trees."""
    whole = scope == "model"
    return _tried_by_selection(
        "cuda_graphs-model" if whole else "cuda_graphs-selection",
        "cuda_graphs",
        "non_graph" if whole else "inductor_config",
        "whole model" if whole else "whole graph",
        "record the whole compiled call as one CUDA graph and replay it (backend.model_graph)"
        if whole
        else "compile with Inductor's CUDA graph trees (triton.cudagraphs=True)",
        "tried by measured selection on every GPU workload",
        params={"scope": scope},
    )


def autocast_instead(rung: Rung) -> Rung | None:
    """``rung`` with its precision change run under autocast instead of casting the model
    (``dtype_promotion`` with ``mode="autocast"``: norms, softmax and reductions stay fp32),
    for selection to try where the cast changed the output past the tolerance; None where the
    rung has no cast to replace. The validator calibrates a low-precision backend by eager
    under autocast, so where the cast exceeds that error autocast often does not."""
    if not any(
        p.type == "dtype_promotion" and p.params.get("mode") != "autocast" for p in rung.proposals
    ):
        return None
    return Rung(
        rung.name,
        tuple(
            p.model_copy(update={"params": {**p.params, "mode": "autocast"}})
            if p.type == "dtype_promotion"
            else p
            for p in rung.proposals
        ),
    )


def stock_rung(path: Path) -> Rung | None:
    """The rung that tries the stock recipe the stock task kept (``path``: its
    ``stock_baseline.json``) in place of the ladder's plan: one proposal of type
    ``stock_recipe``, which ``plan.add_proposal`` turns into a plan that is that recipe (built by
    ``backend.stock.Compiled``, no pass of this package). None where no recipe passed or the
    file is missing. Kept unless the ladder's plan is measured faster (``STOCK_BAR``), so that
    a workload where a user's three lines beat or match the ladder ships those lines."""
    from pytest_opprof.schema import StockBaseline, read_artifact

    if not path.is_file():
        return None
    chosen = read_artifact(path, StockBaseline)
    if chosen.recipe is None or chosen.dtype is None:
        return None
    proposal = _tried_by_selection(
        "stock-recipe",
        "stock_recipe",
        "non_graph",
        "the whole model",
        chosen.description or chosen.recipe,
        "the stock recipe, tried in place of the ladder's plan (--opprof-stock)",
        params={"recipe": chosen.recipe, "dtype": chosen.dtype},
    )
    return Rung("stock_recipe", (proposal,))


def _tried_by_selection(
    pid: str,
    kind: str,
    level: IrLevel,
    target: str,
    step: str,
    rationale: str,
    params: dict[str, Any] | None = None,
) -> Proposal:
    """A proposal no rule made: selection tries it and keeps it only if measured faster."""
    return Proposal(
        id=pid,
        type=kind,
        ir_level=level,
        targets=[target],
        evidence=[Evidence(metric="tried_by", value="measured selection", source="backend")],
        fx_steps=[step],
        params=params or {},
        impact=Impact(
            estimated_saving_us=0.0,
            estimated_speedup=1.0,
            basis="not estimated: tried because selection measures it",
        ),
        confidence="low",
        rationale=rationale,
    )
