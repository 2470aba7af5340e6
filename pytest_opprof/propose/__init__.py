"""The propose stage: ``profile.json`` (+ the FX graph summary) → ``optimizations.json``.

Deterministic: the same inputs give byte-identical output. The rules (``rules.py``) draft
proposals from the profile's facts and the graph's pattern matches; this module numbers them,
lowers their confidence by the edge-case flags (``knowledge.apply_edge_case_penalties``),
links their dependencies, applies the user's filters and orders them topologically.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_opprof import knowledge
from pytest_opprof.options import TRANSFORMATION_TYPES
from pytest_opprof.propose.classify import classify
from pytest_opprof.propose.context import (
    Context,
    Draft,
    build_context,
    evidence_matches,
    resolve_source,
)
from pytest_opprof.propose.rules import run_rules
from pytest_opprof.schema import (
    EdgeCaseFlag,
    Evidence,
    FxGraphSummary,
    Optimizations,
    Profile,
    Proposal,
)

__all__ = ["DEPENDS_ON", "classify", "evidence_matches", "order", "propose", "resolve_source"]

CONFIDENCE_RANK = {"high": 2, "medium": 1, "low": 0}

DEPENDS_ON: dict[str, tuple[str, ...]] = {
    "memory_layout": ("bn_fold",),
    "conv_im2col": ("bn_fold", "dtype_promotion"),
    "depthwise_taps": ("bn_fold", "dtype_promotion"),
    "sdpa_replacement": ("qkv_fusion",),
    "pretranspose_weights": ("bn_fold", "qkv_fusion"),
    "batch_padding": ("dtype_promotion",),
    "algorithm_selection": ("dtype_promotion", "batch_padding"),
    "cuda_graphs": ("dtype_promotion", "memory_layout", "pretranspose_weights"),
}
"""Which types a proposal of each type applies after: BN folds into the NCHW weights before the
layout changes and before a convolution becomes a GEMM, which computes at the promoted dtype;
fusion before SDPA formation and freezing; padding at the promoted dtype's tile; CUDA graphs
record the final kernels."""


def propose(
    profile: Profile,
    graph: FxGraphSummary | None,
    *,
    min_confidence: str = "low",
    max_opts: int | None = None,
    skip: Sequence[str] = (),
) -> Optimizations:
    """Evidence-backed proposals for ``profile`` (and ``graph``, when Dynamo captured one)."""
    if min_confidence not in CONFIDENCE_RANK:
        raise ValueError(
            f"min_confidence {min_confidence!r} is not one of {', '.join(CONFIDENCE_RANK)}"
        )
    meta = profile.capture_metadata
    ctx = build_context(profile, graph)
    if ctx is None:
        return Optimizations(
            workload=meta.workload,
            device_type=meta.device_type,
            proposals=[],
            global_notes=["the profile has no timeline: nothing to propose from"],
            edge_case_flags=list(profile.edge_case_flags),
        )
    drafts = run_rules(ctx)
    proposals = _finalise(drafts, ctx)
    notes = [*_context_notes(ctx), *ctx.notes]
    proposals = _filter(proposals, min_confidence, max_opts, skip, notes)
    proposals = order(proposals, notes)
    return Optimizations(
        workload=meta.workload,
        device_type=meta.device_type,
        proposals=proposals,
        global_notes=notes,
        edge_case_flags=[EdgeCaseFlag(name=f.name, detail=f.detail) for f in ctx.flags.values()],
    )


def _finalise(drafts: Sequence[Draft], ctx: Context) -> list[Proposal]:
    counters: dict[str, int] = {}
    present = {d.type for d in drafts}
    proposals = []
    for draft in drafts:
        counters[draft.type] = counters.get(draft.type, 0) + 1
        score, applied = knowledge.apply_edge_case_penalties(draft.score, ctx.flags, draft.type)
        score = round(score, 6)  # 0.6 − 0.15 is 0.4499…, which must stay "medium" (≥ 0.45)
        evidence = list(draft.evidence)
        rationale = draft.rationale
        if applied:
            evidence.extend(ctx.flags[name].evidence for name in applied)
            lowered = ", ".join(
                f"{name} (−{knowledge.EDGE_CASE_PENALTIES[name]:g})" for name in applied
            )
            rationale += f" Confidence lowered by {lowered}."
        proposals.append(
            Proposal(
                id=f"{draft.type}-{counters[draft.type]}",
                type=draft.type,
                ir_level=draft.ir_level,
                targets=list(dict.fromkeys(draft.targets)),
                evidence=_unique(evidence),
                fx_steps=draft.fx_steps,
                impact=draft.impact,
                confidence=knowledge.confidence_level(score),
                depends_on=[],
                params=draft.params,
                rationale=rationale,
            )
        )
    by_type: dict[str, list[str]] = {}
    for p in proposals:
        by_type.setdefault(p.type, []).append(p.id)
    for p in proposals:
        p.depends_on = [
            dep_id
            for dep_type in DEPENDS_ON.get(p.type, ())
            if dep_type in present
            for dep_id in by_type[dep_type]
        ]
    return proposals


def _unique(evidence: Sequence[Evidence]) -> list[Evidence]:
    seen: set[tuple[str, str]] = set()
    out = []
    for e in evidence:
        key = (e.metric, e.source)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _filter(
    proposals: list[Proposal],
    min_confidence: str,
    max_opts: int | None,
    skip: Sequence[str],
    notes: list[str],
) -> list[Proposal]:
    unknown = sorted(set(skip) - set(TRANSFORMATION_TYPES))
    if unknown:
        notes.append(f"skip: {', '.join(unknown)} not a transformation type (ignored)")
    kept = [p for p in proposals if p.type not in set(skip)]
    _note_dropped(notes, "skip", proposals, kept)
    floor = CONFIDENCE_RANK[min_confidence]
    confident = [p for p in kept if CONFIDENCE_RANK[p.confidence] >= floor]
    _note_dropped(notes, f"min_confidence={min_confidence}", kept, confident)
    kept = confident
    if max_opts is not None and len(kept) > max_opts:
        ranked = sorted(kept, key=_rank_key)
        chosen = {p.id for p in ranked[: max(0, max_opts)]}
        top = [p for p in kept if p.id in chosen]
        _note_dropped(notes, f"max_opts={max_opts} (kept the largest estimated savings)", kept, top)
        kept = top
    ids = {p.id for p in kept}
    for p in kept:
        gone = [d for d in p.depends_on if d not in ids]
        if gone:
            p.depends_on = [d for d in p.depends_on if d in ids]
    return kept


def _rank_key(p: Proposal) -> tuple[float, int, int, str]:
    return (
        -p.impact.estimated_saving_us,
        -CONFIDENCE_RANK[p.confidence],
        _type_index(p.type),
        p.id,
    )


def _type_index(kind: str) -> int:
    return (
        TRANSFORMATION_TYPES.index(kind)
        if kind in TRANSFORMATION_TYPES
        else len(TRANSFORMATION_TYPES)
    )


def _note_dropped(
    notes: list[str], why: str, before: list[Proposal], after: list[Proposal]
) -> None:
    kept = {p.id for p in after}
    dropped = [p.id for p in before if p.id not in kept]
    if dropped:
        notes.append(f"{why}: dropped {', '.join(dropped)}")


def order(proposals: Sequence[Proposal], notes: list[str] | None = None) -> list[Proposal]:
    """Topological order of ``depends_on``; among ready proposals the largest saving first.

    A cycle (possible once hooks or the LLM add proposals) is broken at the most confident
    proposal still waiting: it loses its unmet dependencies, and a note says which.
    """
    pending = {p.id: p for p in proposals}
    done: set[str] = set()
    result: list[Proposal] = []
    while pending:
        ready = [
            p for p in pending.values() if all(d in done or d not in pending for d in p.depends_on)
        ]
        if not ready:
            cyclic = [p for p in pending.values() if _on_cycle(p.id, pending)]
            chosen = min(cyclic, key=lambda p: (-CONFIDENCE_RANK[p.confidence], *_rank_key(p)))
            unmet = [d for d in chosen.depends_on if d in pending]
            chosen.depends_on = [d for d in chosen.depends_on if d not in unmet]
            if notes is not None:
                notes.append(
                    f"dependency cycle broken at {chosen.id} (highest confidence): no longer "
                    f"waits for {', '.join(unmet)}"
                )
            ready = [chosen]
        nxt = min(ready, key=_rank_key)
        result.append(nxt)
        done.add(nxt.id)
        del pending[nxt.id]
    return result


def _on_cycle(start: str, pending: dict[str, Proposal]) -> bool:
    """``start`` reaches itself through the dependencies of pending proposals."""
    seen: set[str] = set()
    stack = [d for d in pending[start].depends_on if d in pending]
    while stack:
        current = stack.pop()
        if current == start:
            return True
        if current in seen:
            continue
        seen.add(current)
        stack.extend(d for d in pending[current].depends_on if d in pending)
    return False


def _context_notes(ctx: Context) -> list[str]:
    notes = []
    if not ctx.gpu:
        notes.append(
            "CPU profile: no hardware-table entry, so operators carry no bottleneck class and "
            "no roofline; the GPU-only rules (cuda_graphs, batch_padding, algorithm_selection, "
            "gemm_epilogue, attention_backend) did not run; dtype_promotion is proposed at low "
            "confidence (bf16 on the CPU is often slower)"
        )
    else:
        counters = any(f.has_counters for f in ctx.facts.values())
        if not counters:
            notes.append(
                "counters were not collected: classification from kernel names, kernel "
                "durations and grids, and the roofline of the operators' input shapes only"
            )
        ranked = sorted(ctx.eager.timeline.aggregated, key=lambda a: (-a.share, a.name))[:5]
        if ranked:
            notes.append(
                "largest eager operators: "
                + ", ".join(
                    f"{a.name} {a.share:.1%} ({a.bottleneck or 'unclassified'})" for a in ranked
                )
            )
    if ctx.graph is None:
        notes.append(
            "no FX graph summary: the graph detectors (bn_fold, qkv_fusion, sdpa_replacement, "
            "activation_substitution, gemm_epilogue, attention_backend, NCHW convolutions, "
            "batch_padding) did not run"
        )
    elif not ctx.graph.graphs:
        notes.append(
            "Dynamo captured no graph (the forward runs eagerly under torch.compile): FX passes "
            "have nothing to rewrite"
        )
    if ctx.compiled is None:
        notes.append("no compiled timeline: the torch.compile baseline was not profiled")
    return notes
