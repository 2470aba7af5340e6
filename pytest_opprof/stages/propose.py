"""Stage 1, propose: the rule engine over ``profile.json`` and the FX graph, the optional LLM
strategist, and the proposals of ``pytest_opprof_propose`` hooks. It runs in the parent:
it executes no user code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_opprof.errors import StageError
from pytest_opprof.pipeline import WorkloadRun
from pytest_opprof.schema import (
    ChildSpec,
    FxGraphSummary,
    Optimizations,
    Profile,
    Proposal,
    read_artifact,
    write_artifact,
)

NAME = "propose"


def run(run: WorkloadRun) -> str:
    from pytest_opprof.propose import propose

    profile = read_artifact(run.out_dir / "profile.json", Profile)
    graph_path = run.out_dir / "graph.json"
    graph = read_artifact(graph_path, FxGraphSummary) if graph_path.exists() else None
    result = propose(
        profile,
        graph,
        min_confidence=run.options.min_confidence,
        max_opts=run.options.max_opts,
        skip=run.setting("skip") or (),
    )
    note = ""
    if run.options.llm:
        from pytest_opprof.propose.llm import strategize

        result, note = strategize(profile, graph, result, run.options)
    found = run.hooks.pytest_opprof_propose(profile=profile, graph=graph, optimizations=result)
    result = merge_hook_proposals(run, result, [p for batch in found for p in batch or ()])
    write_artifact(run.out_dir / "optimizations.json", result)
    summary = f"{len(result.proposals)} proposals: " + ", ".join(p.type for p in result.proposals)
    return summary + (f" ({note})" if note else "")


def merge_hook_proposals(
    run: WorkloadRun, result: Optimizations, found: list[Any]
) -> Optimizations:
    """Add what ``pytest_opprof_propose`` returned: marked ``source="hook"``, renumbered where
    an id is taken, routed at its pass's level, filtered as the rules' proposals are, and the
    whole set put back in dependency order."""
    from pydantic import ValidationError

    from pytest_opprof.options import TRANSFORMATION_TYPES
    from pytest_opprof.propose import CONFIDENCE_RANK, order

    if not found:
        return result
    user_passes = run.extra_passes()
    skip = set(run.setting("skip") or ())
    floor = CONFIDENCE_RANK[run.options.min_confidence]
    taken = {p.id for p in result.proposals}
    proposals, notes = list(result.proposals), list(result.global_notes)
    for item in found:
        try:
            p = item if isinstance(item, Proposal) else Proposal.model_validate(item)
        except ValidationError as exc:
            raise StageError(
                f"pytest_opprof_propose returned a proposal that does not validate: "
                f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
            ) from None
        p = p.model_copy(update={"source": "hook"}, deep=True)
        if p.type in user_passes:
            p.ir_level = user_passes[p.type].level  # type: ignore[assignment]
        elif p.type not in TRANSFORMATION_TYPES:
            notes.append(
                f"hook proposal {p.id} dropped: type {p.type!r} is not a pass; register it "
                "with pytest_opprof_register_passes"
            )
            continue
        if p.type in skip or CONFIDENCE_RANK[p.confidence] < floor:
            why = (
                "OPPROF['skip']"
                if p.type in skip
                else f"min_confidence={run.options.min_confidence}"
            )
            notes.append(f"{why}: dropped hook proposal {p.id}")
            continue
        if p.id in taken:
            n = 1
            while f"{p.type}-hook-{n}" in taken:
                n += 1
            p.id = f"{p.type}-hook-{n}"
        taken.add(p.id)
        proposals.append(p)
    return result.model_copy(update={"proposals": order(proposals, notes), "global_notes": notes})


TASKS: dict[str, Callable[[ChildSpec], None]] = {}
"""The child halves, by the task name a spec carries (``runner`` dispatches them)."""
