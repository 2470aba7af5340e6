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
from pytest_opprof.propose.classify import (
    OpFacts,
    classify,
    gpu_match,
    operator_work,
    timeline_facts,
)
from pytest_opprof.propose.graph import GraphView, views
from pytest_opprof.propose.impact import Budget, budget
from pytest_opprof.schema import Evidence, FxGraphSummary, Impact, IrLevel, Profile, Timeline

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


@dataclass
class Context:
    """Everything the rules read, computed once."""

    profile: Profile
    graph: FxGraphSummary | None
    views: list[GraphView]
    device_type: str
    spec: knowledge.GpuSpec | None
    eager: Timeline
    compiled: Timeline | None
    compiled_index: int | None
    facts: dict[str, OpFacts]
    compiled_facts: dict[str, OpFacts]
    budget: Budget
    flags: dict[str, Flag]
    notes: list[str]
    th: knowledge.BottleneckThresholds = knowledge.THRESHOLDS
    drafted: set[str] = field(default_factory=set)

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

    def op_time_us(self, facts: OpFacts) -> float:
        return facts.aggregate.share * self.budget.device_us

    def op_kernels_per_iter(self, facts: OpFacts) -> float:
        total = sum(a.kernel_count for a in self.eager.aggregated) + len(
            self.eager.unattributed_kernels
        )
        if total <= 0:
            return 0.0
        return self.eager.summary.kernels_per_iter * facts.aggregate.kernel_count / total

    def op_bytes_fp32(self, facts: OpFacts) -> float | None:
        """DRAM bytes per iteration of an operator: counters, else its input shapes."""
        read, write = facts.metric("dram_bytes_read"), facts.metric("dram_bytes_write")
        if read is not None and write is not None:
            return read + write  # ncu replays one iteration
        ops = [o for o in self.eager.operators if o.name == facts.name]
        measured = sum(o.gpu_time_us for o in ops)
        data = sum(operator_work(o.name, o.input_shapes, 4)[1] for o in ops)
        if measured <= 0 or data <= 0:
            return None
        return data / measured * self.op_time_us(facts)


def build_context(profile: Profile, graph: FxGraphSummary | None) -> Context | None:
    """The rules' context, or None when the profile has no timeline to reason about."""
    if not profile.timelines:
        return None
    classified = classify(profile)
    match = gpu_match(classified)
    spec = match.spec if match else None
    eager = classified.timelines[0]
    compiled_index = next(
        (i for i, t in enumerate(classified.timelines) if t.label == "compiled"), None
    )
    compiled = classified.timelines[compiled_index] if compiled_index is not None else None
    dtype = classified.capture_metadata.dtype
    notes: list[str] = []
    if match is not None and not match.exact:
        notes.append(f"hardware table: {match.note}")
    ctx = Context(
        profile=classified,
        graph=graph,
        views=views(graph),
        device_type=classified.capture_metadata.device_type,
        spec=spec,
        eager=eager,
        compiled=compiled,
        compiled_index=compiled_index,
        facts=timeline_facts(eager, spec=spec, dtype=dtype),
        compiled_facts=timeline_facts(compiled, spec=spec, dtype=dtype) if compiled else {},
        budget=budget(classified, eager),
        flags=edge_flags(classified, graph),
        notes=notes,
    )
    return ctx


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


def summary_ev(
    metric: str, timeline: Timeline, index: int, field_name: str, unit: str = ""
) -> Evidence | None:
    value = getattr(timeline.summary, field_name)
    if value is None:
        return None
    return ev(metric, value, f"profile.json:timelines[{index}].summary.{field_name}", unit)


def timing_ev(ctx: Context) -> list[Evidence]:
    eager = ctx.profile.timing.variants.get("eager")
    if eager is None:
        return []
    return [
        ev(
            "eager latency (median)",
            eager.median_ms,
            "profile.json:timing.variants.eager.median_ms",
            "ms",
        )
    ]


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
