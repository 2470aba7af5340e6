"""From proposals to backend plans: which pass runs at which IR level, and the variant ladder
that measured selection times.

Pure Python. A proposal's ``type`` names the pass; its ``ir_level`` routes it. The ladder adds
the proposals one group at a time in a fixed order — graph rewrites first (they change what the
later steps see), then precision, layout, Inductor settings, and CUDA graphs last, since they
only pay once the kernels are short — so each rung's gain can be attributed to what it added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytest_opprof.schema import BackendPlan, Proposal

# Rung order of the ladder; proposal types not listed are graph passes of the first rung.
LADDER_ORDER: tuple[str, ...] = (
    "graph",
    "dtype_promotion",
    "memory_layout",
    "batch_padding",
    "pretranspose_weights",
    "algorithm_selection",
    "cuda_graphs",
)

# Types that change the computation's precision: reported apart from graph changes.
PRECISION_TYPES = frozenset({"dtype_promotion"})
# Types that never transform anything (reported only).
REPORT_ONLY_TYPES = frozenset({"stub_detection"})


def add_proposal(plan: BackendPlan, proposal: Proposal) -> BackendPlan:
    """The plan with ``proposal`` applied at its IR level."""
    kind, params = proposal.type, proposal.params
    update: dict[str, object] = {"proposals": [*plan.proposals, proposal.id]}
    if kind in REPORT_ONLY_TYPES:
        return plan
    if kind == "dtype_promotion":
        update["dtype"] = str(params.get("dtype", "bfloat16"))
    elif kind == "memory_layout":
        update["channels_last"] = True
    elif kind == "batch_padding":
        update["pad_batch_to"] = int(params.get("multiple", 8))
    elif kind == "pretranspose_weights":
        update["config_patches"] = {**plan.config_patches, "freezing": True}
    elif kind == "cuda_graphs":
        update["config_patches"] = {**plan.config_patches, "triton.cudagraphs": True}
    elif kind == "algorithm_selection":
        patches = {str(k): v for k, v in params.get("config_patches", {}).items()}
        update["config_patches"] = {**plan.config_patches, **patches}
    elif proposal.ir_level == "functional":
        update["functional"] = [*plan.functional, kind]
    elif proposal.ir_level == "aten":
        update["aten"] = [*plan.aten, kind]
    else:
        return plan
    return plan.model_copy(update=update)


def rung_of(proposal: Proposal) -> str:
    return proposal.type if proposal.type in LADDER_ORDER else "graph"


@dataclass(frozen=True)
class Rung:
    name: str
    proposals: tuple[Proposal, ...]


def ladder(proposals: Sequence[Proposal]) -> list[Rung]:
    """Group the transforming proposals into rungs, in ``LADDER_ORDER``."""
    groups: dict[str, list[Proposal]] = {}
    for p in proposals:
        if p.type in REPORT_ONLY_TYPES:
            continue
        groups.setdefault(rung_of(p), []).append(p)
    return [Rung(name, tuple(groups[name])) for name in LADDER_ORDER if name in groups]


def plan_of(proposals: Sequence[Proposal]) -> BackendPlan:
    plan = BackendPlan()
    for p in proposals:
        plan = add_proposal(plan, p)
    return plan


def changes_precision(plan: BackendPlan) -> bool:
    return plan.dtype not in (None, "float32")
