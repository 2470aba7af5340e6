"""The LLM strategist (issue 12) against a local server that speaks the Messages API.

The SDK is pointed at ``tests/unit/fake_anthropic.py`` through ``ANTHROPIC_BASE_URL``; nothing
leaves the machine. Fixtures are the real H200 artifacts of conv_block.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof.errors import OpprofWarning
from pytest_opprof.options import TRANSFORMATION_TYPES, OpprofOptions
from pytest_opprof.propose import llm
from pytest_opprof.schema import (
    FxGraphSummary,
    Optimizations,
    Profile,
    Proposal,
    read_artifact,
    write_artifact,
)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the helper is imported the same way whatever pytest's import mode
    sys.path.insert(0, str(HERE))

from fake_anthropic import (  # noqa: E402
    FakeMessagesAPI,
    Reply,
    error_body,
    message,
    tool_message,
    tool_use,
)

DATA = HERE.parents[0] / "data" / "llm" / "conv_block"
"""conv_block as an earlier H200 run captured it: the figures these tests quote are its."""
KEY = "sk-ant-test-0123456789-SECRET-do-not-leak"
needs_sdk = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("anthropic"),
    reason="the anthropic SDK is not installed (pip install pytest-opprof[llm])",
)


# -------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def artifacts() -> tuple[Profile, FxGraphSummary, Optimizations]:
    return (
        read_artifact(DATA / "profile.json", Profile),
        read_artifact(DATA / "graph.json", FxGraphSummary),
        read_artifact(DATA / "optimizations.json", Optimizations),
    )


@pytest.fixture
def inputs(
    artifacts: tuple[Profile, FxGraphSummary, Optimizations],
) -> tuple[Profile, FxGraphSummary, Optimizations]:
    """Fresh copies, so a test that mutates by mistake cannot hide it from the next."""
    return tuple(a.model_copy(deep=True) for a in artifacts)  # type: ignore[return-value]


@pytest.fixture
def options(tmp_path: Path) -> OpprofOptions:
    return OpprofOptions(out=tmp_path / "out", llm=True)


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMessagesAPI]:
    """The fake server, the key set, the SDK pointed at the server, no retries."""
    server = FakeMessagesAPI().start()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("all_proxy", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("OPPROF_LLM_MODEL", "OPPROF_LLM_MAX_TOKENS", "OPPROF_LLM_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    monkeypatch.setenv("OPPROF_LLM_MAX_RETRIES", "0")
    yield server
    server.stop()


def extra(**overrides: Any) -> dict[str, Any]:
    """A valid proposal the rule engine did not make on conv_block, with evidence that
    resolves in profile.json."""
    proposal: dict[str, Any] = {
        "id": "autotune-convs",
        "type": "algorithm_selection",
        "ir_level": "inductor_config",
        "targets": ["aten::conv2d"],
        "evidence": [
            {
                "metric": "aten::conv2d share of kernel time",
                "value": 0.5634,
                "unit": "fraction",
                "source": "profile.json:timelines[0].aggregated[aten::conv2d].share",
            }
        ],
        "fx_steps": ["inductor config: max_autotune_gemm = True for the convolutions"],
        "impact": {
            "estimated_saving_us": 12.0,
            "estimated_speedup": 1.02,
            "basis": "10% of the 142.9 µs of conv kernels",
        },
        "confidence": "high",
        "params": {"config_patches": {"max_autotune": True}},
        "rationale": "cuDNN picks an sm80 fp32 kernel on an sm90 GPU.",
    }
    proposal.update(overrides)
    return proposal


SENTINEL_CODE = """\
import pathlib
pathlib.Path({sentinel!r}).write_text("the LLM's code ran")


def apply(gm, example_inputs):
    return 0
"""


def _auth(headers: dict[str, str]) -> str:
    """SDK 1.x sends ``x-api-key``, 2.x ``Authorization: Bearer``."""
    return headers.get("x-api-key", "") + headers.get("authorization", "")


def _sdk_samples() -> bool:
    from anthropic.resources.messages import Messages

    return "temperature" in inspect.signature(Messages.create).parameters


def run(
    inputs: tuple[Profile, FxGraphSummary, Optimizations], options: OpprofOptions
) -> tuple[Optimizations, str]:
    profile, graph, rules = inputs
    return llm.strategize(profile, graph, rules, options)


# ----------------------------------------------------------------------------- valid answers


@needs_sdk
def test_a_valid_extra_proposal_is_merged_and_marked(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, tmp_path: Path
) -> None:
    rules_before = inputs[2].model_dump()
    api.queue(Reply(body=tool_message({"proposals": [extra()]})))

    result, note = run(inputs, options)

    assert note == ""
    assert len(api.requests) == 1
    assert [p.model_dump() for p in result.proposals[:5]] == rules_before["proposals"]
    new = result.proposals[-1]
    assert (new.id, new.type, new.source) == (
        "llm-algorithm_selection-1",
        "algorithm_selection",
        "llm",
    )
    assert new.confidence == "medium"  # "high" capped: not measured
    assert "capped at medium" in new.rationale
    assert new.params["implemented"] is True
    assert new.params["evidence_verified"] == "1/1"
    assert new.params["config_patches"] == {"max_autotune": True}
    assert new.depends_on == ["dtype_promotion-1"]  # DEPENDS_ON of algorithm_selection
    assert any(
        n.startswith("llm: 1 proposal(s) from the LLM (llm-algorithm_selection-1)")
        and "unmeasured" in n
        for n in result.global_notes
    )
    assert result.global_notes[: len(rules_before["global_notes"])] == rules_before["global_notes"]
    # The merged artifact round-trips, with the source on disk.
    path = write_artifact(tmp_path / "optimizations.json", result)
    again = read_artifact(path, Optimizations)
    assert [p.source for p in again.proposals] == ["rules"] * 5 + ["llm"]


@needs_sdk
def test_the_request_carries_the_tool_the_choice_and_the_summary(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    run(inputs, options)

    (request,) = api.requests
    assert request.path == "/v1/messages"
    assert KEY in _auth(request.headers)  # the key goes to the API and nowhere else
    body = request.body
    assert body["model"] == llm.DEFAULT_MODEL
    assert body["max_tokens"] == 4000
    if _sdk_samples():
        assert body["temperature"] == 0
    else:  # API 2026-10-21 (SDK 2.x) removed the sampling parameters: sending one is a 400
        assert not {"temperature", "top_p", "top_k"} & set(body)
    assert body["tool_choice"] == {"type": "tool", "name": "submit_proposals"}
    (tool,) = body["tools"]
    assert tool["name"] == "submit_proposals"
    schema = tool["input_schema"]
    assert schema["type"] == "object"
    assert schema["required"] == ["proposals"]
    expected = Proposal.model_json_schema()
    assert schema["$defs"] == expected.pop("$defs")
    assert schema["properties"]["proposals"] == {"type": "array", "items": expected}
    text = "\n".join(block["text"] for block in body["messages"][0]["content"])
    for needle in (
        '"device_name":"NVIDIA H200"',
        '"dtype":"float32"',
        '"input_shapes":[[16,3,64,64]]',
        '"median_ms":0.5375576019287109',  # eager median
        '"label":"compiled"',
        '"name":"aten::conv2d"',
        "sm80_xmma_fprop_implicit_gemm_f32f32",
        '"op_counts":{"call_function:torch.conv2d":3',
        '"id":"bn_fold-1"',
        "knowledge/fx-patterns.md",
        "knowledge/edge-cases.md",
        "knowledge/bottlenecks.md",
    ):
        assert needle in text, needle
    assert "[… truncated]" in text  # the pages are cut to their budget
    assert len(text) < 60_000


@needs_sdk
def test_the_request_is_deterministic(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    run(inputs, options)
    run(inputs, options)
    first, second = (r.body for r in api.requests)
    assert first == second


@needs_sdk
def test_settings_come_from_the_environment(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPPROF_LLM_MODEL", "claude-opus-4-7")
    monkeypatch.setenv("OPPROF_LLM_MAX_TOKENS", "1234")
    run(inputs, options)
    assert api.requests[0].body["model"] == "claude-opus-4-7"
    assert api.requests[0].body["max_tokens"] == 1234


@needs_sdk
def test_a_deprecated_model_is_a_note_not_a_failure(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's DeprecationWarning would be an error under ``-W error``; it becomes a note."""
    from anthropic._data import DEPRECATED_MODELS

    if not DEPRECATED_MODELS:
        pytest.skip("this SDK lists no deprecated model")
    old = next(iter(DEPRECATED_MODELS))
    monkeypatch.setenv("OPPROF_LLM_MODEL", old)
    api.queue(Reply(body=tool_message({"proposals": [extra()]})))
    result, note = run(inputs, options)
    assert note == ""
    assert result.proposals[-1].source == "llm"
    assert any(
        n.startswith("llm: the SDK warned: The model") and old in n for n in result.global_notes
    )


@needs_sdk
def test_a_duplicate_of_a_rule_type_is_dropped(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    duplicate = extra(id="bn_fold-1", type="bn_fold", ir_level="aten", targets=["input_2"])
    colliding = extra(id="dtype_promotion-1")  # a rule id: renamed, never reused
    api.queue(Reply(body=tool_message({"proposals": [duplicate, colliding]})))

    result, note = run(inputs, options)

    assert note == ""
    assert [p.type for p in result.proposals].count("bn_fold") == 1
    assert [p.id for p in result.proposals] == [
        "bn_fold-1",
        "dtype_promotion-1",
        "memory_layout-1",
        "pretranspose_weights-1",
        "cuda_graphs-1",
        "llm-algorithm_selection-1",
    ]
    assert result.proposals[0].source == "rules"
    assert "llm: dropped bn_fold-1 (bn_fold): duplicates bn_fold-1" in result.global_notes


@needs_sdk
def test_an_unimplemented_type_keeps_its_code_in_a_file_that_never_runs(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, tmp_path: Path
) -> None:
    sentinel = tmp_path / "the_llm_code_ran"
    code = SENTINEL_CODE.format(sentinel=str(sentinel))
    novel = extra(
        id="fuse-pool",
        type="pool_relu_reorder",
        ir_level="aten",
        targets=["aten::max_pool2d"],
        params={"pass_code": code},
        confidence="medium",
    )
    api.queue(Reply(body=tool_message({"proposals": [novel]})))

    result, note = run(inputs, options)

    assert note == ""
    new = result.proposals[-1]
    assert (new.id, new.source) == ("llm-pool_relu_reorder-1", "llm")
    assert new.params["implemented"] is False
    assert new.params["pass_file"] == "llm_passes/llm-pool_relu_reorder-1.py"
    assert "pass_code" not in new.params  # the code lives in its file, not in the artifact
    written = options.out / "conv_block" / new.params["pass_file"]
    text = written.read_text(encoding="utf-8")
    assert code.strip() in text
    assert text.startswith("# Written by the --opprof-llm strategist")
    compile(text, str(written), "exec")  # it is Python (compiling runs nothing)
    assert not sentinel.exists()
    assert not list(written.parent.glob(".*.tmp"))  # written atomically, no leftovers
    # The sentinel is a real witness: running the file does create it.
    subprocess.run([sys.executable, str(written)], check=True, timeout=60)
    assert sentinel.read_text() == "the LLM's code ran"


@needs_sdk
def test_a_pass_file_goes_beside_the_proposals_written_elsewhere(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, tmp_path: Path
) -> None:
    """``opprof propose --out`` (issue #41): the file a proposal names sits beside it."""
    novel = extra(
        id="fuse-pool",
        type="pool_relu_reorder",
        ir_level="aten",
        targets=["aten::max_pool2d"],
        params={"pass_code": "x = 1\n"},
        confidence="medium",
    )
    api.queue(Reply(body=tool_message({"proposals": [novel]})))
    profile, graph, rules = inputs
    elsewhere = tmp_path / "elsewhere"

    result, note = llm.strategize(profile, graph, rules, options, workload_dir=elsewhere)

    assert note == ""
    written = elsewhere / result.proposals[-1].params["pass_file"]
    assert written.read_text(encoding="utf-8").endswith("\nx = 1\n")
    assert not (options.out / "conv_block").exists()


@needs_sdk
def test_code_is_written_only_for_kept_unimplemented_proposals(
    api: FakeMessagesAPI, inputs: Any, tmp_path: Path
) -> None:
    code = SENTINEL_CODE.format(sentinel=str(tmp_path / "ran"))
    library = extra(params={"pass_code": code})  # a library type: the library's pass runs
    unproven = extra(  # unimplemented, but no evidence resolves: low, under min_confidence
        type="pool_relu_reorder",
        params={"pass_code": code},
        evidence=[{"metric": "m", "value": 1, "unit": "", "source": "profile.json:nowhere"}],
    )
    api.queue(Reply(body=tool_message({"proposals": [library, unproven]})))
    options = OpprofOptions(out=tmp_path / "out", llm=True, min_confidence="medium")

    result, note = run(inputs, options)

    assert note == ""
    new = result.proposals[-1]
    assert new.id == "llm-algorithm_selection-1"
    assert new.params["pass_code_ignored"] == "the pass library implements this type"
    assert "pass_code" not in new.params and "pass_file" not in new.params
    assert "llm: min_confidence=medium: dropped llm-pool_relu_reorder-1" in result.global_notes
    assert not (tmp_path / "out").exists()  # nothing written for either


@needs_sdk
def test_unverifiable_evidence_lowers_the_proposal_to_low(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    made_up = extra(
        evidence=[
            {
                "metric": "tensor pipe active",
                "value": 3.0,
                "unit": "%",
                "source": "profile.json:timelines[0].aggregated[aten::conv2d].metrics.tensor_pipe",
            },
            {
                "metric": "aten::conv2d share",
                "value": 0.99,  # the artifact says 0.5634
                "unit": "fraction",
                "source": "profile.json:timelines[0].aggregated[aten::conv2d].share",
            },
        ]
    )
    api.queue(Reply(body=tool_message({"proposals": [made_up]})))

    result, _ = run(inputs, options)

    new = result.proposals[-1]
    assert new.confidence == "low"
    assert new.params["evidence_verified"] == "0/2"
    assert "none of its evidence was found" in new.rationale


@needs_sdk
def test_min_confidence_and_max_opts_apply_to_the_llm_too(
    api: FakeMessagesAPI, inputs: Any, tmp_path: Path
) -> None:
    api.queue(Reply(body=tool_message({"proposals": [extra()]})))
    strict = OpprofOptions(out=tmp_path, llm=True, min_confidence="high")
    result, _ = run(inputs, strict)
    assert [p.source for p in result.proposals] == ["rules"] * 5
    assert "llm: min_confidence=high: dropped llm-algorithm_selection-1" in result.global_notes

    api.queue(Reply(body=tool_message({"proposals": [extra()]})))
    capped = OpprofOptions(out=tmp_path, llm=True, max_opts=5)
    result, _ = run(inputs, capped)
    assert len(result.proposals) == 5
    assert "llm: max_opts=5: dropped llm-algorithm_selection-1" in result.global_notes


@needs_sdk
def test_an_empty_answer_changes_nothing_but_the_notes(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    api.queue(Reply(body=tool_message({"proposals": [], "review": "The rules cover it."})))
    result, note = run(inputs, options)
    assert note == ""
    assert result.proposals == inputs[2].proposals
    assert "llm review: The rules cover it." in result.global_notes


# ---------------------------------------------------------------------------- fallbacks


GARBAGE = [
    pytest.param(
        tool_message({"proposals": [extra(ir_level="somewhere")]}),
        "the answer did not validate (proposals.0.ir_level: Input should be 'functional'",
        id="bad-field",
    ),
    pytest.param(
        tool_message({"proposals": [{"type": "bn_fold"}]}),
        "the answer did not validate (proposals.0.id: Field required; and 6 more)",
        id="missing-fields",
    ),
    pytest.param(
        tool_message({"ideas": "make it faster"}),
        "the answer did not validate (proposals: Field required; and 1 more)",
        id="wrong-shape",
    ),
    pytest.param(
        tool_message("{not json"),
        "the tool input is not valid JSON",
        id="tool-input-not-json",
    ),
    pytest.param(
        message([{"type": "text", "text": "I would fuse things."}], stop_reason="end_turn"),
        "the answer had no submit_proposals tool call (stop_reason end_turn; text)",
        id="no-tool-use",
    ),
    pytest.param(
        message([tool_use({"proposals": []}, name="other_tool")]),
        "the answer had no submit_proposals tool call",
        id="other-tool",
    ),
    pytest.param(
        tool_message({"proposals": [extra()]}, stop_reason="max_tokens"),
        "the answer was cut off at max_tokens=4000 (raise OPPROF_LLM_MAX_TOKENS)",
        id="cut-off",
    ),
]


@needs_sdk
@pytest.mark.parametrize(("body", "why"), GARBAGE)
def test_garbage_keeps_the_rules_and_warns_why(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, body: Any, why: str
) -> None:
    api.queue(Reply(body=body))
    with pytest.warns(OpprofWarning) as record:
        result, note = run(inputs, options)
    assert result is inputs[2]
    assert note.startswith(f"--opprof-llm: {why}")
    assert note.endswith("; rule engine only")
    assert "\n" not in note
    assert [str(w.message) for w in record] == [note]  # exactly one warning


@needs_sdk
def test_a_body_that_is_not_json_keeps_the_rules(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions
) -> None:
    api.queue(Reply(raw=b"{not json"))
    with pytest.warns(OpprofWarning, match="response is not valid JSON"):
        result, _ = run(inputs, options)
    assert result is inputs[2]


@needs_sdk
def test_a_timeout_keeps_the_rules_and_warns(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPPROF_LLM_TIMEOUT", "0.5")
    api.queue(Reply(body=tool_message({"proposals": [extra()]}), delay_s=30))
    start = time.monotonic()
    with pytest.warns(OpprofWarning) as record:
        result, note = run(inputs, options)
    assert time.monotonic() - start < 10
    assert result is inputs[2]
    assert note == ("--opprof-llm: no answer within 0.5 s (OPPROF_LLM_TIMEOUT); rule engine only")
    assert len(record) == 1


@needs_sdk
@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (
            529,
            error_body("overloaded_error", "Overloaded"),
            "HTTP 529 (overloaded_error: Overloaded)",
        ),
        (500, error_body("api_error", "Internal server error"), "HTTP 500 (api_error: Internal"),
        (400, error_body("invalid_request_error", "max_tokens: too large"), "HTTP 400"),
        (404, error_body("not_found_error", "model: claude-x"), "HTTP 404 (not_found_error"),
    ],
)
def test_an_http_error_keeps_the_rules_and_warns(
    api: FakeMessagesAPI,
    inputs: Any,
    options: OpprofOptions,
    status: int,
    body: dict[str, Any],
    why: str,
) -> None:
    api.queue(Reply(status=status, body=body))
    with pytest.warns(OpprofWarning) as record:
        result, note = run(inputs, options)
    assert result is inputs[2]
    assert note.startswith(f"--opprof-llm: the API answered {why}")
    assert len(record) == 1
    assert len(api.requests) == 1  # OPPROF_LLM_MAX_RETRIES=0


@needs_sdk
def test_retries_follow_the_environment(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPPROF_LLM_MAX_RETRIES", "1")
    overloaded = Reply(
        status=529,
        body=error_body("overloaded_error", "Overloaded"),
        headers={"retry-after-ms": "10"},
    )
    api.queue(overloaded)
    api.queue(Reply(body=tool_message({"proposals": [extra()]})))
    result, note = run(inputs, options)
    assert note == ""
    assert len(api.requests) == 2
    assert result.proposals[-1].source == "llm"


@needs_sdk
def test_an_unreachable_api_keeps_the_rules(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = api.url
    api.stop()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", url)
    with pytest.warns(OpprofWarning, match="could not reach the API"):
        result, _ = run(inputs, options)
    assert result is inputs[2]


@needs_sdk
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OPPROF_LLM_MAX_TOKENS", "lots"),
        ("OPPROF_LLM_TIMEOUT", "0"),
        ("OPPROF_LLM_MAX_RETRIES", "-1"),
    ],
)
def test_a_bad_setting_keeps_the_rules_and_sends_nothing(
    api: FakeMessagesAPI,
    inputs: Any,
    options: OpprofOptions,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str,
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.warns(OpprofWarning, match=f"{name}='{value}'"):
        result, _ = run(inputs, options)
    assert result is inputs[2]
    assert api.requests == []


@needs_sdk
def test_without_a_key_nothing_changes_and_nothing_is_sent(
    api: FakeMessagesAPI, inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    result, note = run(inputs, options)  # no warning: filterwarnings = error would fail here
    assert result is inputs[2]
    assert note == "--opprof-llm: ANTHROPIC_API_KEY is not set; rule engine only"
    assert api.requests == []


def test_without_the_sdk_nothing_changes(
    inputs: Any, options: OpprofOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setitem(sys.modules, "anthropic", None)  # import anthropic → ImportError
    result, note = run(inputs, options)
    assert result is inputs[2]
    assert "pip install pytest-opprof[llm]" in note
    assert note.endswith("; rule engine only")


# ----------------------------------------------------------------------------- the key


@needs_sdk
def test_the_key_never_appears_in_any_output(
    api: FakeMessagesAPI,
    inputs: Any,
    options: OpprofOptions,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # the SDK's own debug logging included
    sentinel = tmp_path / "ran"
    novel = extra(
        type="pool_relu_reorder",
        params={"pass_code": SENTINEL_CODE.format(sentinel=str(sentinel))},
    )
    api.queue(Reply(body=tool_message({"proposals": [extra(), novel]})))
    result, good_note = run(inputs, options)
    assert len(result.proposals) == 7
    dump = write_artifact(options.out / "conv_block" / "optimizations.json", result)

    # A server that echoes the key in its error body, and one that puts it in the answer.
    echo = error_body("authentication_error", f"invalid x-api-key: {KEY}")
    api.queue(Reply(status=401, body=echo))
    with pytest.warns(OpprofWarning) as record_401:
        _, note_401 = run(inputs, options)
    assert "HTTP 401 (authentication_error: invalid x-api-key: [redacted]); check" in note_401
    api.queue(Reply(body=tool_message({"proposals": [extra(rationale=f"key {KEY}")]})))
    with pytest.warns(OpprofWarning, match="the answer contained the API key") as record_echo:
        echoed, _ = run(inputs, options)
    assert echoed is inputs[2]

    captured = capsys.readouterr()
    outputs = [
        good_note,
        note_401,
        captured.out,
        captured.err,
        caplog.text,
        *(str(w.message) for w in [*record_401, *record_echo]),
        result.model_dump_json(),
    ]
    outputs += [p.read_text(encoding="utf-8") for p in options.out.rglob("*") if p.is_file()]
    assert dump.exists()
    assert any("llm_passes" in str(p) for p in options.out.rglob("*.py"))
    assert "Request options" in caplog.text  # the SDK's debug log of the request was scanned
    for text in outputs:
        assert KEY not in text
    assert all(KEY in _auth(r.headers) for r in api.requests)


# ------------------------------------------------------------------------------ the module


def test_the_library_registry_is_the_vocabulary() -> None:
    """``implemented_types`` falls back on the vocabulary so that propose never imports torch;
    the two must stay equal."""
    from pytest_opprof import passes

    builtin = getattr(passes, "BUILTIN", passes.REGISTRY)  # user passes may join REGISTRY
    assert set(builtin) == set(TRANSFORMATION_TYPES)
    assert llm.implemented_types() == frozenset(passes.REGISTRY)  # loaded: the registry itself


def test_importing_the_module_needs_neither_the_sdk_nor_torch() -> None:
    code = (
        "import sys; sys.modules['anthropic'] = None; "
        "import pytest_opprof.propose.llm as m; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert callable(m.strategize)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_tool_schema_accepts_what_the_model_accepts() -> None:
    """The schema sent is the pydantic model's: the rule engine's real proposals pass both, and
    a proposal that one rejects the other rejects too."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = llm.tool_definition()["input_schema"]
    payload = json.loads(
        read_artifact(DATA / "optimizations.json", Optimizations).model_dump_json()
    )
    good = {"proposals": payload["proposals"]}
    jsonschema.validate(good, schema)
    assert len(llm._Answer.model_validate(good).proposals) == 5
    bad = copy.deepcopy(good)
    bad["proposals"][0]["ir_level"] = "somewhere"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    with pytest.raises(ValueError, match="ir_level"):
        llm._Answer.model_validate(bad)


def test_the_page_documents_the_settings_the_code_reads() -> None:
    page = (HERE.parents[1] / "knowledge" / "llm-strategist.md").read_text(encoding="utf-8")
    rows = {
        cells[0].strip("` "): cells[1].strip("` ")
        for line in page.splitlines()
        if line.startswith("| `")
        for cells in [line.strip("|").split("|")]
    }
    defaults = llm.LlmSettings()
    assert rows["OPPROF_LLM_MODEL"] == defaults.model == llm.DEFAULT_MODEL
    assert rows["OPPROF_LLM_MAX_TOKENS"] == str(defaults.max_tokens)
    assert rows["OPPROF_LLM_TIMEOUT"] == f"{defaults.timeout:g}"
    assert rows["OPPROF_LLM_MAX_RETRIES"] == str(defaults.max_retries)
    assert {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"} <= set(rows)
    for name in rows:
        assert name in (llm.__doc__ or ""), f"{name} is missing from the module docstring"
