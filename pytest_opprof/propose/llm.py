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

The request it sends (the tool, the system prompt, the artifacts' summary) is built in
``llm_request``; this module asks, checks the answer and merges it.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pytest_opprof.errors import OpprofWarning
from pytest_opprof.options import OpprofOptions
from pytest_opprof.propose.llm_request import (
    TOOL_NAME,
    build_request,
    cut,
    implemented_types,
    one_line,
    summarize,
    tool_definition,
)
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
        note = one_line(f"--opprof-llm: {reason}; rule engine only")
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
    notes = [f"llm: the SDK warned: {one_line(str(w.message), 200)}" for w in caught]
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


# --------------------------------------------------------------------------------- merging


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
        label = cut(f"{raw.id} ({raw.type})", 80)
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
    review_note = [f"llm review: {one_line(review, 600)}"] if review.strip() else []
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
