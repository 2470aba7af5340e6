"""What the rules read and what they write: the context computed once per profile, the draft
proposals, and the evidence rows with the paths they were read from.

Evidence is only ever a value copied from ``profile.json`` or ``graph.json``; its ``source`` is a
path into the artifact (``profile.json:timelines[0].aggregated[aten::addmm].share``) that
``resolve_source`` reads back, so a test can check every row. Derived numbers belong in the
rationale and the impact's basis, never in evidence.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_opprof import knowledge
from pytest_opprof.propose.classify import OpFacts, classify, gpu_match, timeline_facts
from pytest_opprof.propose.graph import GraphView, views
from pytest_opprof.propose.impact import Budget, budget
from pytest_opprof.schema import (
    Evidence,
    FxGraphSummary,
    Impact,
    IrLevel,
    OperatorRecord,
    Profile,
    Timeline,
    TimelineSummary,
)

SCORE_HIGH = 0.9
SCORE_MEDIUM = 0.6
SCORE_LOW = 0.3
"""Starting confidence scores (knowledge/edge-cases.md: high ≥ 0.75, medium ≥ 0.45)."""

MAX_EVIDENCE_PER_KIND = 6
"""Evidence rows of one kind per proposal (the rest are counted in the rationale)."""

# ---------------------------------------------------------------------------------- context


@dataclass
class Flag:
    """An edge-case flag with the evidence that it is set."""

    name: str
    detail: str
    evidence: Evidence


@dataclass(frozen=True)
class TimelineRef:
    """One profiled timeline, its index in ``profile.json`` and its operators' facts, with the
    timing pass's figures for the same variant (no profiler attached)."""

    timeline: Timeline
    index: int
    facts: dict[str, OpFacts]
    device_us: float
    device_from: str
    wall_us: float | None
    wall_from: str | None

    @property
    def summary(self) -> TimelineSummary:
        return self.timeline.summary

    def op_time_us(self, facts: OpFacts) -> float:
        return facts.aggregate.share * self.device_us

    def op_kernels_per_iter(self, facts: OpFacts) -> float:
        t = self.timeline
        total = sum(a.kernel_count for a in t.aggregated) + len(t.unattributed_kernels)
        if total <= 0:
            return 0.0
        return t.summary.kernels_per_iter * facts.aggregate.kernel_count / total

    def records(self, facts: OpFacts) -> list[OperatorRecord]:
        return [o for o in self.timeline.operators if o.name == facts.name]


_TIMING_VARIANT = {"eager": "eager", "compiled": "compile"}


def timeline_ref(profile: Profile, index: int, spec: knowledge.GpuSpec | None) -> TimelineRef:
    timeline = profile.timelines[index]
    label = timeline.label
    kernel_ms = profile.timing.gpu_kernel_ms.get(label)
    if kernel_ms is not None and kernel_ms > 0:
        device, device_from = kernel_ms * 1000.0, f"timing.gpu_kernel_ms.{label}"
    else:
        device = timeline.summary.device_time_per_iter_us
        device_from = f"timelines[{index}].summary.device_time_per_iter_us"
    variant = _TIMING_VARIANT.get(label, label)
    stats = profile.timing.variants.get(variant)
    wall = stats.median_ms * 1000.0 if stats is not None and stats.median_ms > 0 else None
    return TimelineRef(
        timeline=timeline,
        index=index,
        facts=timeline_facts(timeline, spec=spec, dtype=profile.capture_metadata.dtype),
        device_us=device,
        device_from=device_from,
        wall_us=wall,
        wall_from=f"timing.variants.{variant}.median_ms" if wall is not None else None,
    )


@dataclass
class Context:
    """Everything the rules read, computed once."""

    profile: Profile
    graph: FxGraphSummary | None
    views: list[GraphView]
    device_type: str
    spec: knowledge.GpuSpec | None
    eager: TimelineRef
    compiled: TimelineRef | None
    budget: Budget
    flags: dict[str, Flag]
    notes: list[str]
    th: knowledge.BottleneckThresholds = knowledge.THRESHOLDS
    drafted: dict[str, Draft] = field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        return self.device_type == "cuda"

    @property
    def time_word(self) -> str:
        """What a share is a share of: GPU kernel time, or CPU operator time on the fallback."""
        return "kernel time" if self.gpu else "operator time"

    @property
    def model_dtype(self) -> str:
        return self.profile.capture_metadata.dtype.removeprefix("torch.")

    @property
    def facts(self) -> dict[str, OpFacts]:
        """The eager timeline's operators."""
        return self.eager.facts

    def op_time_us(self, facts: OpFacts) -> float:
        return self.eager.op_time_us(facts)


def build_context(profile: Profile, graph: FxGraphSummary | None) -> Context | None:
    """The rules' context, or None when the profile has no timeline to reason about."""
    if not profile.timelines:
        return None
    classified = classify(profile)
    match = gpu_match(classified)
    spec = match.spec if match else None
    compiled_index = next(
        (i for i, t in enumerate(classified.timelines) if t.label == "compiled"), None
    )
    notes: list[str] = []
    if match is not None and not match.exact:
        notes.append(f"hardware table: {match.note}")
    return Context(
        profile=classified,
        graph=graph,
        views=views(graph),
        device_type=classified.capture_metadata.device_type,
        spec=spec,
        eager=timeline_ref(classified, 0, spec),
        compiled=timeline_ref(classified, compiled_index, spec)
        if compiled_index is not None
        else None,
        budget=budget(classified, classified.timelines[0]),
        flags=edge_flags(classified, graph),
        notes=notes,
    )


def edge_flags(profile: Profile, graph: FxGraphSummary | None) -> dict[str, Flag]:
    """The profile's edge-case flags, plus those the propose stage can see for itself."""
    flags: dict[str, Flag] = {}
    for flag in profile.edge_case_flags:
        flags.setdefault(
            flag.name,
            Flag(
                flag.name,
                flag.detail,
                ev("edge-case flag", flag.name, f"profile.json:edge_case_flags[{flag.name}].name"),
            ),
        )
    summary = profile.timelines[0].summary if profile.timelines else None
    th = knowledge.THRESHOLDS
    if (
        summary is not None
        and profile.capture_metadata.device_type == "cuda"
        and 1.0 - summary.attributed_share > th.unattributed_share_high
        and "high_unattributed_share" not in flags
    ):
        flags["high_unattributed_share"] = Flag(
            "high_unattributed_share",
            f"{1.0 - summary.attributed_share:.0%} of GPU time is not attributed to an operator",
            ev(
                "attributed share",
                summary.attributed_share,
                "profile.json:timelines[0].summary.attributed_share",
                "fraction",
            ),
        )
    if graph is not None and "graph_breaks" not in flags:
        if graph.graph_breaks > 0:
            flags["graph_breaks"] = Flag(
                "graph_breaks",
                f"Dynamo split the forward at {graph.graph_breaks} graph break(s)",
                ev("graph breaks", graph.graph_breaks, "graph.json:graph_breaks"),
            )
        elif not graph.graphs:
            reason = graph.break_reasons[0] if graph.break_reasons else "no graph captured"
            evidence = (
                ev("break reason", reason, "graph.json:break_reasons[0]")
                if graph.break_reasons
                else ev("graph breaks", graph.graph_breaks, "graph.json:graph_breaks")
            )
            flags["graph_breaks"] = Flag("graph_breaks", reason, evidence)
    return flags


# ---------------------------------------------------------------------------------- drafts


@dataclass
class Draft:
    """A proposal before numbering, penalties, filters and ordering."""

    type: str
    ir_level: IrLevel
    targets: list[str]
    evidence: list[Evidence]
    fx_steps: list[str]
    impact: Impact
    score: float
    rationale: str
    params: dict[str, Any] = field(default_factory=dict)


def ev(metric: str, value: Any, source: str, unit: str = "") -> Evidence:
    if isinstance(value, (list, tuple)):
        value = str(list(value))
    return Evidence(metric=metric, value=value, unit=unit, source=source)


def agg_source(index: int, op: str, path: str) -> str:
    return f"profile.json:timelines[{index}].aggregated[{op}].{path}"


def share_evidence(ctx: Context, facts: OpFacts, index: int = 0) -> Evidence:
    return ev(
        f"{facts.name} share of {ctx.time_word}",
        facts.aggregate.share,
        agg_source(index, facts.name, "share"),
        "fraction",
    )


def kernel_evidence(facts: OpFacts, names: Sequence[str], index: int = 0) -> list[Evidence]:
    """Evidence rows for the first of ``names`` that the aggregate lists."""
    for name in names:
        if name in facts.aggregate.kernel_names:
            i = facts.aggregate.kernel_names.index(name)
            return [
                ev(
                    f"{facts.name} kernel",
                    name,
                    agg_source(index, facts.name, f"kernel_names[{i}]"),
                )
            ]
    return []


def summary_ev(metric: str, ref: TimelineRef, field_name: str, unit: str = "") -> Evidence | None:
    value = getattr(ref.summary, field_name)
    if value is None:
        return None
    return ev(metric, value, f"profile.json:timelines[{ref.index}].summary.{field_name}", unit)


def timing_ev(ctx: Context, ref: TimelineRef | None = None) -> list[Evidence]:
    """The timing pass's latency and kernel time of a variant (eager unless ``ref`` says)."""
    ref = ref or ctx.eager
    label = ref.timeline.label
    rows = []
    if ref.wall_from is not None:
        variant = ref.wall_from.split(".")[2]
        rows.append(
            ev(
                f"{variant} latency (median, no profiler)",
                ctx.profile.timing.variants[variant].median_ms,
                f"profile.json:{ref.wall_from}",
                "ms",
            )
        )
    if ref.device_from.startswith("timing."):
        rows.append(
            ev(
                f"{label} kernel time per call",
                ctx.profile.timing.gpu_kernel_ms[label],
                f"profile.json:{ref.device_from}",
                "ms",
            )
        )
    return rows


def pct(value: float) -> str:
    return f"{value:.1%}"


def top(facts: Sequence[OpFacts]) -> list[OpFacts]:
    return sorted(facts, key=lambda f: (-f.aggregate.share, f.name))


# ------------------------------------------------------------------------ evidence sources

_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]")


def resolve_source(source: str, profile: Profile, graph: FxGraphSummary | None) -> Any:
    """Read the value an evidence ``source`` points at (``KeyError`` when it points nowhere).

    ``profile.json:timelines[0].aggregated[aten::addmm].share``: ``.name`` is a field,
    ``[3]`` a list index, ``[aten::addmm]`` the list element with that ``name`` (or a dict key).
    """
    file, _, path = source.partition(":")
    roots: dict[str, Any] = {"profile.json": profile, "graph.json": graph}
    if file not in roots or roots[file] is None:
        raise KeyError(f"{source}: unknown file {file!r}")
    current: Any = roots[file].model_dump(mode="python")
    pos = 0
    path = "." + path if path and not path.startswith("[") else path
    while pos < len(path):
        token = _TOKEN.match(path, pos)
        if token is None:
            raise KeyError(f"{source}: cannot parse at {path[pos:]!r}")
        pos = token.end()
        attr, key = token.group(1), token.group(2)
        if attr is not None:
            if not isinstance(current, dict) or attr not in current:
                raise KeyError(f"{source}: no field {attr!r}")
            current = current[attr]
        elif isinstance(current, list):
            if key.isdigit():
                current = current[int(key)]
            else:
                found = [e for e in current if isinstance(e, dict) and e.get("name") == key]
                if not found:
                    raise KeyError(f"{source}: no element named {key!r}")
                current = found[0]
        elif isinstance(current, dict):
            if key not in current:
                raise KeyError(f"{source}: no key {key!r}")
            current = current[key]
        else:
            raise KeyError(f"{source}: cannot index {type(current).__name__} with [{key}]")
    return current


def evidence_matches(evidence: Evidence, profile: Profile, graph: FxGraphSummary | None) -> bool:
    """The evidence's value is exactly what its source holds (lists compare as their str)."""
    value = resolve_source(evidence.source, profile, graph)
    if isinstance(value, list):
        return str(value) == evidence.value
    return bool(value == evidence.value)
