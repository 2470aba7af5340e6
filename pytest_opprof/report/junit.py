"""Stage-level JUnit XML (``--opprof-junit=PATH``): a testsuite per workload, a testcase per
stage, and the ``user_properties`` every pytest item carries into pytest's own ``--junitxml``.

Built with ``junit-xml`` and kept valid against the common (Jenkins) JUnit schema: that schema
has no ``<properties>`` under ``<testcase>`` nor a ``type`` on ``<skipped>``, so stage properties
go to the suite's ``<properties>`` as ``<stage>.<name>`` (and to the case's ``system-out``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from junit_xml import TestCase, TestSuite

from pytest_opprof import ITEM_NAMES, STAGES
from pytest_opprof.schema import WorkloadSummary, write_text_atomic

Outcome = Literal["passed", "failed", "error", "skipped"]
STAGE_ORDER: tuple[str, ...] = tuple(ITEM_NAMES[s] for s in STAGES)
"""capture, propose, backend, validate, recapture, speedup: the item names, in order."""


@dataclass
class StageResultRecord:
    """How one stage of one workload ended (one pytest item, or one CLI stage)."""

    workload: str
    stage: str
    outcome: Outcome
    seconds: float
    message: str = ""
    properties: dict[str, str] = field(default_factory=dict)


def _item_name(stage: str) -> str:
    return ITEM_NAMES.get(stage, stage)


def _case(r: StageResultRecord) -> TestCase:
    case = TestCase(
        _item_name(r.stage),
        classname=r.workload,
        elapsed_sec=max(0.0, float(r.seconds)),
        stdout="\n".join(f"{k}={v}" for k, v in r.properties.items()) or None,
    )
    first = r.message.strip().splitlines()[0] if r.message.strip() else ""
    if r.outcome == "failed":
        case.add_failure_info(message=first or "failed", output=r.message or None)
    elif r.outcome == "error":
        case.add_error_info(message=first or "error", output=r.message or None)
    elif r.outcome == "skipped":
        case.add_skipped_info(message=first or "skipped", output=r.message or None)
    return case


def _suites(results: Sequence[StageResultRecord]) -> list[TestSuite]:
    by_workload: dict[str, dict[str, StageResultRecord]] = {}
    for r in results:  # a later record of the same stage (a re-run) replaces the earlier one
        by_workload.setdefault(r.workload, {})[_item_name(r.stage)] = r

    def rank(stage: str) -> int:
        return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)

    suites = []
    for workload, stages in by_workload.items():
        ordered = sorted(stages.values(), key=lambda r: rank(_item_name(r.stage)))
        props = {
            f"{_item_name(r.stage)}.{k}": str(v) for r in ordered for k, v in r.properties.items()
        }
        suites.append(TestSuite(workload, [_case(r) for r in ordered], properties=props or None))
    return suites


def stage_junit_xml(results: Sequence[StageResultRecord]) -> str:
    root = ET.Element("testsuites", {"name": "pytest-opprof"})
    totals = {"tests": 0, "failures": 0, "errors": 0, "disabled": 0}
    time = 0.0
    for suite in _suites(results):
        element = suite.build_xml_doc()
        for skipped in element.iter("skipped"):
            skipped.attrib.pop("type", None)  # not in the JUnit schema
        for key in totals:
            totals[key] += int(element.get(key, "0"))
        time += float(element.get("time", "0"))
        root.append(element)
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{time:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


def write_stage_junit(path: Path, results: Sequence[StageResultRecord]) -> None:
    """Write the stage-level JUnit file atomically (a reader never sees half of it)."""
    write_text_atomic(Path(path), stage_junit_xml(results))


def user_properties(s: WorkloadSummary) -> list[tuple[str, str]]:
    """``(name, value)`` pairs for an item's ``user_properties``: they reach pytest's own
    ``--junitxml`` also from xdist workers. Absent figures are left out, never written as 0."""
    pairs: list[tuple[str, object]] = [
        ("opprof.status", s.status),
        # "false" on the CPU fallback: the status says no stage failed, not that a gate held
        ("opprof.gate_enforced", str(s.enforced).lower()),
        ("opprof.baseline", s.baseline),
        ("opprof.speedup", s.speedup),
        ("opprof.speedup_ci_low", s.ci_low),
        ("opprof.speedup_ci_high", s.ci_high),
        ("opprof.baseline_ms", s.baseline_ms),
        ("opprof.optimized_ms", s.optimized_ms),
        ("opprof.eager_ms", s.eager_ms),
        ("opprof.compile_ms", s.compile_ms),
        ("opprof.speedup_vs_eager", s.speedup_vs_eager),
        ("opprof.speedup_vs_compile", s.speedup_vs_compile),
        ("opprof.stock_ms", s.stock_ms),
        ("opprof.speedup_vs_stock", s.speedup_vs_stock),
        ("opprof.dtype", s.dtype),
        ("opprof.passes", ",".join(s.passes) if s.passes else None),
        ("opprof.report", s.report),
    ]
    return [(k, f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in pairs if v is not None]
