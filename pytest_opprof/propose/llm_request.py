"""The request the strategist (``llm``) sends: the ``submit_proposals`` tool, whose input
schema is the pydantic ``Proposal`` model's, the system prompt, and the compact summary of the
artifacts the model reads (the profile, the FX graph, the rule engine's proposals, and three
knowledge pages cut to a budget). Deterministic for equal inputs; pure Python, no torch.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof.options import TRANSFORMATION_TYPES
from pytest_opprof.schema import FxGraphSummary, Optimizations, Profile, Proposal

if TYPE_CHECKING:
    from pytest_opprof.propose.llm import LlmSettings

TOOL_NAME = "submit_proposals"
KNOWLEDGE_PAGES: tuple[str, ...] = ("fx-patterns.md", "edge-cases.md", "bottlenecks.md")
KNOWLEDGE_BUDGET_CHARS = 24_000
"""The three knowledge pages together, split evenly; each page is cut at a line boundary."""
TOP_OPERATORS = 8
CAPTURE_FIELDS = {
    *("workload", "device_type", "device_name", "sm_count", "compute_capability", "dtype"),
    *("torch_version", "cuda_version", "input_shapes", "input_dtypes", "compile_mode"),
    "cpu_fallback",
}
GRAPH_NODES = 60
KERNEL_NAME_CHARS = 160
NOTE_CHARS = 300


def tool_definition() -> dict[str, Any]:
    """``submit_proposals``: its input schema is ``Proposal.model_json_schema()`` as the items
    of ``proposals``, with the model's ``$defs`` hoisted to the root so its ``$ref``s resolve."""
    item = Proposal.model_json_schema()
    defs = item.pop("$defs", {})
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "proposals": {"type": "array", "items": item},
            "review": {
                "type": "string",
                "description": "optional: one paragraph on the rule engine's proposals",
            },
        },
        "required": ["proposals"],
    }
    if defs:
        schema["$defs"] = defs
    return {
        "name": TOOL_NAME,
        "description": (
            "Submit the optimization proposals the rule engine missed (an empty list when it "
            "missed nothing). Each is validated against this schema; evidence values are "
            "checked against profile.json / graph.json."
        ),
        "input_schema": schema,
    }


SYSTEM_PROMPT = """\
You review the proposals of pytest-opprof's rule engine for one PyTorch model and add what it \
missed. pytest-opprof profiled the model on the device named below, turns the proposals into a \
torch.compile backend, validates that the backend computes the same function, and keeps a \
proposal only when it measurably makes the model faster.

Rules for your proposals:
- Propose only what the numbers in the summary support. Each evidence item is a metric, its \
exact value and its source, written as the rule engine writes it: `profile.json:<path>` or \
`graph.json:<path>` (`.field`, list index `[3]`, list element by name `[aten::addmm]`). \
Sources are resolved against the artifacts; evidence that does not resolve lowers the proposal \
to low confidence.
- Do not repeat a type the rule engine already proposed: each pass of the library applies to \
the whole graph.
- Prefer the pass library's types (implemented_types). A type outside it is reported, and runs \
only if params.pass_code holds the Python source of a module defining \
`apply(gm: torch.fx.GraphModule, example_inputs: list) -> int` that rewrites the graph in place \
and returns how many sites it changed: check the pattern first and return 0 when it is absent, \
mutate under `gm.graph.inserting_before(...)`, `replace_all_uses_with` before `erase_node`, \
then `gm.graph.lint()` and `gm.recompile()`. It is validated before it ever runs.
- impact.basis says how the saving follows from the given numbers; confidence is at most \
"medium" (your estimate is not a measurement).
- ids are renamed to llm-<type>-<n>; depends_on may name rule proposal ids or your own ids.
- When the rule engine already covers what the evidence shows, submit an empty list.
Call submit_proposals exactly once."""


def build_request(
    profile: Profile,
    graph: FxGraphSummary | None,
    rules: Optimizations,
    settings: LlmSettings,
) -> dict[str, Any]:
    """The keyword arguments of ``client.messages.create``: deterministic for equal inputs."""
    summary = summarize(profile, graph, rules)
    content = [{"type": "text", "text": text} for text in _knowledge_blocks()]
    content.append(
        {
            "type": "text",
            "text": "Profile, graph and rule-engine summary (JSON):\n"
            + json.dumps(summary, ensure_ascii=False, separators=(",", ":")),
        }
    )
    return {
        "model": settings.model,
        "max_tokens": settings.max_tokens,
        "system": SYSTEM_PROMPT,
        "tools": [tool_definition()],
        "tool_choice": {"type": "tool", "name": TOOL_NAME},
        "messages": [{"role": "user", "content": content}],
    }


def summarize(
    profile: Profile, graph: FxGraphSummary | None, rules: Optimizations
) -> dict[str, Any]:
    """The compact, JSON-able view of the artifacts that the model reads."""
    return {
        "capture": {
            **profile.capture_metadata.model_dump(include=CAPTURE_FIELDS),
            "counters_collected": profile.counters is not None,
        },
        "timing": {
            "variants": {
                name: {
                    "median_ms": s.median_ms,
                    "ci_low_ms": s.ci_low_ms,
                    "ci_high_ms": s.ci_high_ms,
                    "source": f"profile.json:timing.variants[{name}].median_ms",
                }
                for name, s in sorted(profile.timing.variants.items())
            },
            "gpu_kernel_ms": dict(sorted(profile.timing.gpu_kernel_ms.items())),
            "compile_seconds": dict(sorted(profile.timing.compile_seconds.items())),
        },
        "timelines": [_timeline(i, t) for i, t in enumerate(profile.timelines)],
        "edge_case_flags": [{"name": f.name, "detail": f.detail} for f in profile.edge_case_flags],
        "capture_warnings": [one_line(w, 200) for w in profile.warnings[:10]],
        "graph": _graph(graph),
        "rule_proposals": [_proposal(p) for p in rules.proposals],
        "rule_notes": [one_line(n, 300) for n in rules.global_notes[:10]],
        "implemented_types": sorted(implemented_types()),
    }


def _timeline(index: int, timeline: Any) -> dict[str, Any]:
    ranked = sorted(timeline.aggregated, key=lambda a: (-a.share, a.name))[:TOP_OPERATORS]
    return {
        "label": timeline.label,
        "compile_mode": timeline.compile_mode,
        "summary": timeline.summary.model_dump(),
        "unattributed_kernels": len(timeline.unattributed_kernels),
        "top_operators": [
            {
                "name": a.name,
                "source": f"profile.json:timelines[{index}].aggregated[{a.name}]",
                "share": a.share,
                "gpu_time_us": a.gpu_time_us,
                "calls": a.calls,
                "kernel_count": a.kernel_count,
                "kernel_names": [cut(k, KERNEL_NAME_CHARS) for k in a.kernel_names[:4]],
                "bottleneck": a.bottleneck,
                "metrics": {k: v for k, v in sorted(a.metrics.items()) if v is not None},
            }
            for a in ranked
        ],
    }


def _graph(graph: FxGraphSummary | None) -> dict[str, Any] | None:
    if graph is None:
        return None
    calls = [
        (gi, n)
        for gi, nodes in enumerate(graph.graphs)
        for n in nodes
        if n.op not in ("placeholder", "output", "get_attr")
    ]
    counts = Counter(f"{n.op}:{n.target}" for _, n in calls)
    return {
        "graphs": len(graph.graphs),
        "nodes": sum(len(nodes) for nodes in graph.graphs),
        "graph_breaks": graph.graph_breaks,
        "break_reasons": [one_line(r, 200) for r in graph.break_reasons[:5]],
        "parameters": len(graph.parameters),
        "op_counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "nodes_shown": min(len(calls), GRAPH_NODES),
        "call_nodes": [
            {
                "source": f"graph.json:graphs[{gi}][{n.name}]",
                "target": n.target,
                "args": [cut(a, 60) for a in n.args[:6]],
                "shape": n.shape,
                "dtype": n.dtype,
                "module_type": n.module_type,
            }
            for gi, n in calls[:GRAPH_NODES]
        ],
    }


def _proposal(p: Proposal) -> dict[str, Any]:
    return {
        "id": p.id,
        "type": p.type,
        "ir_level": p.ir_level,
        "targets": p.targets,
        "confidence": p.confidence,
        "evidence": [e.model_dump() for e in p.evidence],
        "impact": p.impact.model_dump(),
        "depends_on": p.depends_on,
        "source": p.source,
    }


def _knowledge_blocks() -> list[str]:
    """The relevant knowledge pages, each cut to its share of ``KNOWLEDGE_BUDGET_CHARS``."""
    folder = Path(__file__).resolve().parents[2] / "knowledge"
    budget = KNOWLEDGE_BUDGET_CHARS // len(KNOWLEDGE_PAGES)
    blocks = []
    for name in KNOWLEDGE_PAGES:
        try:
            text = (folder / name).read_text(encoding="utf-8")
        except OSError:
            continue  # an installed wheel has no knowledge/ folder: the summary stands alone
        if len(text) > budget:
            text = text[: text.rfind("\n", 0, budget) + 1] + "[… truncated]\n"
        blocks.append(f"knowledge/{name}:\n\n{text}")
    return blocks


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis where it was cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text: str, limit: int = NOTE_CHARS) -> str:
    """``text`` on one line (each run of white space one space), cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def implemented_types() -> frozenset[str]:
    """The types the pass library implements: ``passes.REGISTRY`` where it is already imported
    (it may hold passes a conftest registered), else the vocabulary, which
    ``tests/unit/test_llm.py`` keeps equal to the registry — so this module never imports torch."""
    passes = sys.modules.get("pytest_opprof.passes")
    registry = getattr(passes, "REGISTRY", None)
    if isinstance(registry, Mapping):
        return frozenset(registry)
    return frozenset(TRANSFORMATION_TYPES)
