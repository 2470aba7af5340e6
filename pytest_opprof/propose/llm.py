"""The optional strategist (``--opprof-llm``): the Anthropic API reviews and extends the rule
engine's proposals (knowledge/llm-strategist.md).

It is never trusted and never required. The answer is asked for through tool use, with the
tool's ``input_schema`` derived from the pydantic ``Proposal`` model, and validated with that
model; each proposal it adds is marked ``source="llm"``, renamed ``llm-<type>-<n>``, capped at
``medium`` confidence (an LLM's claim is not a measurement) and lowered to ``low`` when its
evidence does not resolve in the artifacts. A proposal of a type the pass library does not
implement is kept, marked ``params["implemented"] = False``; pass code it carries is written to
``<out>/<workload>/llm_passes/<id>.py`` and never imported here: the backend's measured
selection and stage 3's validation are the only places it may run.

Any failure — no key, no SDK, network, timeout, an HTTP error (529 overloaded included), an
answer that does not validate — returns the rule engine's proposals unchanged with a one-line
note; a failure after the request was attempted also emits one ``OpprofWarning``.

Settings (environment only; the key is never an option, never logged, never written):

- ``ANTHROPIC_API_KEY`` — the key; without it the rule engine alone runs.
- ``OPPROF_LLM_MODEL`` — model id (default ``claude-sonnet-5-5``).
- ``OPPROF_LLM_MAX_TOKENS`` — answer budget in tokens (default 4000).
- ``OPPROF_LLM_TIMEOUT`` — seconds per request (default 60).
- ``OPPROF_LLM_MAX_RETRIES`` — SDK retries on 408/409/429/5xx and connection errors (default 2).
- ``ANTHROPIC_BASE_URL`` — read by the SDK itself (a proxy, or a test server).

Pure Python: the ``anthropic`` SDK (``pip install pytest-opprof[llm]``) is imported inside
``strategize``, and torch is never imported here.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pytest_opprof.errors import OpprofWarning
from pytest_opprof.options import TRANSFORMATION_TYPES, OpprofOptions
from pytest_opprof.schema import (
    FxGraphSummary,
    Model,
    Optimizations,
    Profile,
    Proposal,
    first_error,
    write_text_atomic,
)

__all__ = [
    "DEFAULT_MODEL",
    "TOOL_NAME",
    "LlmSettings",
    "build_request",
    "implemented_types",
    "merge",
    "strategize",
    "summarize",
    "tool_definition",
]

LOGGER = logging.getLogger("pytest_opprof.propose.llm")

DEFAULT_MODEL = "claude-sonnet-5-5"
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
_TYPE_NAME = re.compile(r"[a-z][a-z0-9_]{1,47}")


class _Answer(Model):
    """What ``submit_proposals`` receives: the proposals, and an optional one-paragraph review
    of the rule engine's proposals (kept as a global note)."""

    proposals: list[Proposal]
    review: str = ""


class _Failed(Exception):
    """The strategist gave up; the message is the one-line reason."""


@dataclass(frozen=True)
class LlmSettings:
    model: str = DEFAULT_MODEL
    max_tokens: int = 4000
    timeout: float = 60.0
    max_retries: int = 2

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> LlmSettings:
        """Parse the ``OPPROF_LLM_*`` variables; a bad value is a ``_Failed`` naming it."""
        return cls(
            model=env.get("OPPROF_LLM_MODEL", "").strip() or DEFAULT_MODEL,
            max_tokens=int(_env_number(env, "OPPROF_LLM_MAX_TOKENS", 4000, minimum=1)),
            timeout=_env_number(env, "OPPROF_LLM_TIMEOUT", 60.0, minimum=0, integer=False),
            max_retries=int(_env_number(env, "OPPROF_LLM_MAX_RETRIES", 2, minimum=0)),
        )


def _env_number(
    env: Mapping[str, str], name: str, default: float, *, minimum: float, integer: bool = True
) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number of seconds"
        raise _Failed(f"{name}={raw!r} is not {kind}") from None
    if not (value >= minimum and value == value and value != float("inf")):
        raise _Failed(f"{name}={raw!r} must be a finite number ≥ {minimum:g}")
    if not integer and value == 0:
        raise _Failed(f"{name}={raw!r} must be > 0")
    return value


# ------------------------------------------------------------------------------ entry point


def strategize(
    profile: Profile,
    graph: FxGraphSummary | None,
    rules: Optimizations,
    options: OpprofOptions,
    *,
    workload_dir: Path | None = None,
) -> tuple[Optimizations, str]:
    """``rules`` extended by the LLM's proposals, and a one-line note ("" when all went well).
    ``workload_dir``: where ``optimizations.json`` goes, and the pass files it names beside it
    (default: the workload's folder in ``--opprof-out``).

    Never raises: every failure returns ``rules`` unchanged with the reason in the note.
    """
    key = os.environ.get("ANTHROPIC_API_KEY", "").strip()
    if not key:
        return rules, "--opprof-llm: ANTHROPIC_API_KEY is not set; rule engine only"
    try:
        import anthropic
    except ImportError:
        return rules, (
            "--opprof-llm: the anthropic SDK is not installed (pip install pytest-opprof[llm]); "
            "rule engine only"
        )
    settings: LlmSettings | None = None
    try:
        settings = LlmSettings.from_env(os.environ)
        request = build_request(profile, graph, rules, settings)
        answer, sdk_notes = _ask(anthropic, key, settings, request)
        if key in json.dumps(answer, ensure_ascii=False):
            raise _Failed("the answer contained the API key; it was discarded")
        parsed = _validate(answer)
        merged = merge(
            rules,
            parsed.proposals,
            profile,
            graph,
            options,
            review=parsed.review,
            workload_dir=workload_dir,
        )
        merged.global_notes = [_redact(n, key) for n in [*merged.global_notes, *sdk_notes]]
    except Exception as exc:  # never raise: the rule engine's proposals stand on their own
        reason = _redact(_reason(anthropic, exc, settings), key)
        note = _one_line(f"--opprof-llm: {reason}; rule engine only")
        warnings.warn(note, OpprofWarning, stacklevel=2)
        return rules, note
    return merged, ""


def _ask(
    anthropic: Any, key: str, settings: LlmSettings, request: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """One Messages API call through the SDK: the tool's input and notes on the way, or
    ``_Failed`` saying why not."""
    LOGGER.info(
        "--opprof-llm: asking %s (%d characters of context, max_tokens=%d, timeout=%g s)",
        settings.model,
        sum(len(block["text"]) for block in request["messages"][0]["content"]),
        settings.max_tokens,
        settings.timeout,
    )
    client = anthropic.Anthropic(
        api_key=key, timeout=settings.timeout, max_retries=settings.max_retries
    )
    create = client.messages.create
    if "temperature" in inspect.signature(create).parameters:
        # SDKs before 2.0 speak API version 2023-06-01, which samples; 2.x speak 2026-10-21,
        # which removed the sampling parameters (sending one is a 400): there the request is
        # deterministic by construction and the model's own decoding is left as it is.
        request = {**request, "temperature": 0}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            message = create(**request)
    finally:
        client.close()
    # The SDK warns about a deprecated model: a note, not a failure under ``-W error``.
    notes = [f"llm: the SDK warned: {_one_line(str(w.message), 200)}" for w in caught]
    stop = getattr(message, "stop_reason", None)
    blocks = list(getattr(message, "content", None) or [])
    calls = [
        b
        for b in blocks
        if getattr(b, "type", None) == "tool_use" and getattr(b, "name", None) == TOOL_NAME
    ]
    if stop == "max_tokens":
        raise _Failed(
            f"the answer was cut off at max_tokens={settings.max_tokens} "
            "(raise OPPROF_LLM_MAX_TOKENS)"
        )
    if not calls:
        kinds = ", ".join(str(getattr(b, "type", type(b).__name__)) for b in blocks) or "nothing"
        raise _Failed(f"the answer had no {TOOL_NAME} tool call (stop_reason {stop}; {kinds})")
    data = calls[0].input
    if isinstance(data, str):  # some gateways pass the tool input through as a JSON string
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise _Failed(f"the tool input is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise _Failed(f"the tool input is {type(data).__name__}, not an object")
    return data, notes


def _validate(answer: dict[str, Any]) -> _Answer:
    try:
        return _Answer.model_validate(answer)
    except ValidationError as exc:
        where, msg, others = first_error(exc)
        more = f"; and {others} more" if others else ""
        raise _Failed(f"the answer did not validate ({where}: {msg}{more})") from None


def _reason(anthropic: Any, exc: BaseException, settings: LlmSettings | None) -> str:
    """One line that names what went wrong, for the note and the warning."""
    if isinstance(exc, _Failed):
        return str(exc)
    if isinstance(exc, anthropic.APITimeoutError):
        limit = f"{settings.timeout:g} s" if settings else "the timeout"
        return f"no answer within {limit} (OPPROF_LLM_TIMEOUT)"
    if isinstance(exc, anthropic.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        detail = f": {type(cause).__name__}: {cause}" if cause else ""
        return f"could not reach the API{detail}"
    if isinstance(exc, anthropic.APIStatusError):
        return f"the API answered HTTP {exc.status_code}{_error_detail(exc)}"
    if isinstance(exc, json.JSONDecodeError):  # the SDK lets a 200 with a broken body through
        return f"the API's response is not valid JSON ({exc.msg} at line {exc.lineno})"
    if isinstance(exc, anthropic.APIResponseValidationError):
        return f"the API's response did not parse ({exc.message})"
    return f"unexpected {type(exc).__name__}: {exc}"


def _error_detail(exc: Any) -> str:
    body = getattr(exc, "body", None)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        parts = [str(error.get(k)) for k in ("type", "message") if error.get(k)]
        hint = "; check ANTHROPIC_API_KEY" if exc.status_code in (401, 403) else ""
        return f" ({': '.join(parts)}){hint}" if parts else hint
    return f" ({body})" if isinstance(body, str) and body else ""


def _redact(text: str, key: str) -> str:
    return text.replace(key, "[redacted]") if key else text


def _one_line(text: str, limit: int = NOTE_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


# ------------------------------------------------------------------------------- the request


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
        "capture_warnings": [_one_line(w, 200) for w in profile.warnings[:10]],
        "graph": _graph(graph),
        "rule_proposals": [_proposal(p) for p in rules.proposals],
        "rule_notes": [_one_line(n, 300) for n in rules.global_notes[:10]],
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
                "kernel_names": [_cut(k, KERNEL_NAME_CHARS) for k in a.kernel_names[:4]],
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
        "break_reasons": [_one_line(r, 200) for r in graph.break_reasons[:5]],
        "parameters": len(graph.parameters),
        "op_counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "nodes_shown": min(len(calls), GRAPH_NODES),
        "call_nodes": [
            {
                "source": f"graph.json:graphs[{gi}][{n.name}]",
                "target": n.target,
                "args": [_cut(a, 60) for a in n.args[:6]],
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


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------------- merging


def implemented_types() -> frozenset[str]:
    """The types the pass library implements: ``passes.REGISTRY`` where it is already imported
    (it may hold passes a conftest registered), else the vocabulary, which
    ``tests/unit/test_llm.py`` keeps equal to the registry — so this module never imports torch."""
    passes = sys.modules.get("pytest_opprof.passes")
    registry = getattr(passes, "REGISTRY", None)
    if isinstance(registry, Mapping):
        return frozenset(registry)
    return frozenset(TRANSFORMATION_TYPES)


def merge(
    rules: Optimizations,
    answer: Sequence[Proposal],
    profile: Profile,
    graph: FxGraphSummary | None,
    options: OpprofOptions,
    *,
    review: str = "",
    workload_dir: Path | None = None,
) -> Optimizations:
    """``rules`` plus the admissible proposals of ``answer``, each renamed, marked and checked;
    a note says what was added and what was dropped, and why."""
    from pytest_opprof.propose import CONFIDENCE_RANK, DEPENDS_ON, evidence_matches, order

    implemented = implemented_types()
    kept: list[Proposal] = list(rules.proposals)
    taken = {p.id for p in kept}
    renamed: dict[str, str] = {}
    added: list[Proposal] = []
    notes: list[str] = []
    counters: dict[str, int] = {}
    code: dict[str, Any] = {}
    for raw in answer:
        label = _cut(f"{raw.id} ({raw.type})", 80)
        if not _TYPE_NAME.fullmatch(raw.type):
            notes.append(f"llm: dropped {label}: the type is not a snake_case name")
            continue
        twin = next((p for p in kept if _duplicates(raw, p, implemented)), None)
        if twin is not None:
            notes.append(f"llm: dropped {label}: duplicates {twin.id}")
            continue
        n = counters.get(raw.type, 0)
        while f"llm-{raw.type}-{n + 1}" in taken:
            n += 1
        counters[raw.type] = n + 1
        new_id = f"llm-{raw.type}-{n + 1}"
        renamed[raw.id] = new_id
        taken.add(new_id)
        proposal = raw.model_copy(update={"id": new_id, "source": "llm"}, deep=True)
        _check(proposal, profile, graph, evidence_matches)
        code[new_id] = proposal.params.pop("pass_code", None)
        proposal.params["implemented"] = raw.type in implemented
        kept.append(proposal)
        added.append(proposal)

    ids = {p.id for p in kept}
    present: dict[str, list[str]] = {}
    for p in kept:
        present.setdefault(p.type, []).append(p.id)
    for p in added:
        deps = [renamed.get(d, d) for d in p.depends_on]
        deps += [d for t in DEPENDS_ON.get(p.type, ()) for d in present.get(t, ())]
        p.depends_on = [d for d in dict.fromkeys(deps) if d in ids and d != p.id]

    floor = CONFIDENCE_RANK[options.min_confidence]
    below = [p for p in added if CONFIDENCE_RANK[p.confidence] < floor]
    if below:
        notes.append(
            f"llm: min_confidence={options.min_confidence}: dropped "
            + ", ".join(p.id for p in below)
        )
    added = [p for p in added if p.id not in {q.id for q in below}]
    if options.max_opts is not None and len(rules.proposals) + len(added) > options.max_opts:
        room = max(0, options.max_opts - len(rules.proposals))
        notes.append(
            f"llm: max_opts={options.max_opts}: dropped " + ", ".join(p.id for p in added[room:])
        )
        added = added[:room]
    added = order(added, notes)
    ids = {p.id for p in [*rules.proposals, *added]}
    if workload_dir is None:
        workload_dir = options.out / _safe_name(profile.capture_metadata.workload)
    for p in added:
        p.depends_on = [d for d in p.depends_on if d in ids]  # not on a dropped LLM proposal
        _keep_code(p, code[p.id], workload_dir)

    headline = (
        f"llm: {len(added)} proposal(s) from the LLM"
        + (f" ({', '.join(p.id for p in added)})" if added else "")
        + "; unmeasured until the backend stage times them"
    )
    review_note = [f"llm review: {_one_line(review, 600)}"] if review.strip() else []
    return rules.model_copy(
        update={
            "proposals": [*rules.proposals, *added],
            "global_notes": [*rules.global_notes, headline, *notes, *review_note],
        },
        deep=True,
    )


def _duplicates(new: Proposal, old: Proposal, implemented: frozenset[str]) -> bool:
    """Same type, and either a library pass (it rewrites the whole graph, so a second proposal
    would run it twice) or the same targets in part."""
    if new.type != old.type:
        return False
    return new.type in implemented or not new.targets or bool(set(new.targets) & set(old.targets))


def _check(
    proposal: Proposal, profile: Profile, graph: FxGraphSummary | None, matches: Any
) -> None:
    """Cap the confidence at ``medium``; ``low`` when none of the evidence resolves."""
    verified = []
    for e in proposal.evidence:
        try:
            verified.append(bool(matches(e, profile, graph)))
        except Exception:  # a source that points nowhere (KeyError) or at the wrong kind
            verified.append(False)
    proposal.params["evidence_verified"] = f"{sum(verified)}/{len(verified)}"
    lines = [proposal.rationale.strip()] if proposal.rationale.strip() else []
    if proposal.confidence == "high":
        proposal.confidence = "medium"
        lines.append("Confidence capped at medium: an LLM's estimate, not a measurement.")
    if not any(verified):
        proposal.confidence = "low"
        lines.append("Confidence low: none of its evidence was found in the artifacts.")
    elif not all(verified):
        lines.append(f"Evidence found in the artifacts: {sum(verified)} of {len(verified)} items.")
    proposal.rationale = " ".join(lines)


def _keep_code(proposal: Proposal, code: Any, workload_dir: Path) -> None:
    """Pass code of an unimplemented type goes to its own file, never imported here; a library
    type's code is ignored (the library's pass runs)."""
    if code is None:
        return
    if proposal.params["implemented"]:
        proposal.params["pass_code_ignored"] = "the pass library implements this type"
        return
    if not isinstance(code, str) or not code.strip():
        return
    relative = f"llm_passes/{proposal.id}.py"
    header = (
        f"# Written by the --opprof-llm strategist for proposal {proposal.id} "
        f"({proposal.type}).\n"
        "# Unreviewed and unmeasured: it runs only through the backend's measured selection\n"
        "# and stage 3's validation.\n\n"
    )
    write_text_atomic(workload_dir / relative, header + code.rstrip() + "\n")
    proposal.params["pass_file"] = relative


def _safe_name(name: str) -> str:
    """The workload's folder name, never a path out of ``--opprof-out``."""
    base = Path(name).name
    return base if base not in ("", ".", "..") else "workload"
