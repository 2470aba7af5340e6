"""The stage-level JUnit file: a testsuite per workload, a testcase per stage."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pytest_opprof.report import StageResultRecord, user_properties, write_stage_junit
from pytest_opprof.report.junit import STAGE_ORDER, Outcome
from pytest_opprof.schema import WorkloadSummary

# What the common (Jenkins) JUnit schema allows: element -> (attributes, children in order).
SCHEMA: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "testsuites": ({"name", "time", "tests", "failures", "disabled", "errors"}, ("testsuite",)),
    "testsuite": (
        {
            "name",
            "tests",
            "failures",
            "errors",
            "time",
            "disabled",
            "skipped",
            "timestamp",
            "hostname",
            "id",
            "package",
        },
        ("properties", "testcase", "system-out", "system-err"),
    ),
    "properties": (set(), ("property",)),
    "property": ({"name", "value"}, ()),
    "testcase": (
        {"name", "assertions", "time", "classname", "status"},
        ("skipped", "error", "failure", "system-out", "system-err"),
    ),
    "skipped": ({"message"}, ()),
    "error": ({"type", "message"}, ()),
    "failure": ({"type", "message"}, ()),
    "system-out": (set(), ()),
    "system-err": (set(), ()),
}
REQUIRED = {"testsuite": {"name", "tests"}, "testcase": {"name"}, "property": {"name", "value"}}


def _check_schema(element: ET.Element) -> None:
    attrs, children = SCHEMA[element.tag]
    assert set(element.attrib) <= attrs, (element.tag, element.attrib)
    assert REQUIRED.get(element.tag, set()) <= set(element.attrib)
    order = [children.index(child.tag) for child in element]  # unknown child: ValueError
    assert order == sorted(order), element.tag
    for child in element:
        _check_schema(child)


def _records() -> list[StageResultRecord]:
    ok: Outcome = "passed"
    return [
        StageResultRecord("conv_block", "propose", ok, 0.4, properties={"proposals": "4"}),
        StageResultRecord(
            "conv_block",
            "capture",
            ok,
            31.5,
            properties={"device": "NVIDIA H200", "eager_ms": "0.264"},
        ),
        StageResultRecord("conv_block", "backend", ok, 52.0),
        StageResultRecord("conv_block", "validate", ok, 12.25),
        StageResultRecord("conv_block", "recapture", ok, 30.0),
        StageResultRecord("conv_block", "report", ok, 0.1, properties={"speedup": "1.388"}),
        StageResultRecord("attention", "capture", ok, 20.0),
        StageResultRecord("attention", "propose", ok, 0.3),
        StageResultRecord(
            "attention",
            "backend",
            "error",
            3.0,
            "child process crashed\nTraceback: ...\nRuntimeError: boom",
        ),
        StageResultRecord("attention", "validate", "skipped", 0.0, "blocked by backend"),
        StageResultRecord("attention", "recapture", "skipped", 0.0, "blocked by backend"),
        StageResultRecord(
            "attention",
            "speedup",
            "failed",
            0.0,
            "speedup 0.97× (95% CI 0.93–0.99) is confidently below 1.00×\nreport: x",
        ),
    ]


def test_one_suite_per_workload_one_case_per_stage(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "opprof-junit.xml"
    write_stage_junit(path, _records())
    root = ET.parse(path).getroot()
    _check_schema(root)
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["conv_block", "attention"]
    for suite in suites:
        cases = suite.findall("testcase")
        assert [c.get("name") for c in cases] == list(STAGE_ORDER)
        assert {c.get("classname") for c in cases} == {suite.get("name")}
        assert suite.get("tests") == "6"
    conv, att = suites
    assert conv.get("failures") == "0" and conv.get("errors") == "0"
    assert float(conv.get("time", "0")) == sum(r.seconds for r in _records()[:6])
    assert conv.find("testcase[@name='capture']").get("time") == "31.500000"  # type: ignore[union-attr]
    props = {p.get("name"): p.get("value") for p in conv.iter("property")}
    assert props == {
        "propose.proposals": "4",
        "capture.device": "NVIDIA H200",
        "capture.eager_ms": "0.264",
        "speedup.speedup": "1.388",
    }
    assert conv.find("testcase[@name='capture']/system-out").text == (  # type: ignore[union-attr]
        "device=NVIDIA H200\neager_ms=0.264"
    )
    assert att.get("failures") == "1" and att.get("errors") == "1" and att.get("skipped") == "2"
    error = att.find("testcase[@name='backend']/error")
    assert error is not None and error.get("message") == "child process crashed"
    assert "RuntimeError: boom" in (error.text or "")
    skipped = att.find("testcase[@name='validate']/skipped")
    assert skipped is not None and skipped.get("message") == "blocked by backend"
    failure = att.find("testcase[@name='speedup']/failure")
    assert failure is not None
    assert failure.get("message") == "speedup 0.97× (95% CI 0.93–0.99) is confidently below 1.00×"
    assert root.get("tests") == "12" and root.get("failures") == "1" and root.get("errors") == "1"


def test_a_rerun_replaces_the_stage_and_the_write_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text("old", encoding="utf-8")
    records = [
        StageResultRecord("w", "capture", "failed", 1.0, "timed out"),
        StageResultRecord("w", "capture", "passed", 2.0),
    ]
    write_stage_junit(path, records)
    root = ET.parse(path).getroot()
    cases = root.findall("testsuite/testcase")
    assert len(cases) == 1 and cases[0].find("failure") is None
    assert [p.name for p in tmp_path.iterdir()] == ["j.xml"]


def test_user_properties_leave_out_what_was_not_measured() -> None:
    s = WorkloadSummary(
        name="w",
        path="w.py",
        status="passed",
        stage="report",
        baseline="compile",
        speedup=1.38812,
        ci_low=1.357,
        ci_high=1.419,
        baseline_ms=0.254,
        optimized_ms=0.183,
        passes=["bn_fold", "dtype_promotion"],
    )
    props = dict(user_properties(s))
    assert props["opprof.speedup"] == "1.38812"
    assert props["opprof.speedup_ci_low"] == "1.357"
    assert props["opprof.baseline_ms"] == "0.254"
    assert props["opprof.passes"] == "bn_fold,dtype_promotion"
    assert props["opprof.baseline"] == "compile"
    assert "opprof.eager_ms" not in props and "opprof.dtype" not in props
    assert props["opprof.gate_enforced"] == "true"
    cpu = dict(user_properties(s.model_copy(update={"enforced": False})))
    assert cpu["opprof.status"] == "passed" and cpu["opprof.gate_enforced"] == "false"


XSD = Path(__file__).parents[1] / "data" / "junit" / "junit.xsd"


def test_stage_junit_validates_against_the_junit_schema(tmp_path: Path) -> None:
    xmlschema = pytest.importorskip("xmlschema")
    path = tmp_path / "stages.xml"
    write_stage_junit(path, _records())
    schema = xmlschema.XMLSchema(str(XSD))
    schema.validate(str(path))
    broken = path.read_text().replace("<testcase ", "<testcase bogus='1' ", 1)
    assert not schema.is_valid(broken)


def test_pytests_junit_of_the_h200_run_validates_and_carries_the_speedup() -> None:
    xmlschema = pytest.importorskip("xmlschema")
    real = Path(__file__).parents[1] / "data" / "h200" / "pytest-junit-run2.xml"
    xmlschema.XMLSchema(str(XSD)).validate(str(real))
    assert 'name="opprof_speedup"' in real.read_text()
