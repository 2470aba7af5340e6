"""Pydantic models of every artifact the stages write, with atomic writes and validating reads.

Each artifact carries ``schema_version`` (``MAJOR.MINOR``). A reader accepts its own major
version and rejects a newer one with a message to upgrade; knowledge/schema-versions.md lists
what each version holds. Pure Python: no torch here.

The models live by artifact family; every name is importable from here:

- ``base``: ``Model``, ``Artifact`` and the file I/O (``write_artifact``, ``read_artifact``…);
- ``capture``: ``profile.json`` (``Profile``, ``Timing``, ``Timeline``…) and ``graph.json``;
- ``optimization``: ``optimizations.json``, ``backend_selection.json``, the stock baseline and
  ``validation_report.json``;
- ``session``: each workload's summary, the session's ``summary.json``, the comparison with a
  stored run;
- ``child``: the spec of a stage process and its failure.
"""

from __future__ import annotations

from pytest_opprof.schema.base import (
    Artifact,
    Model,
    first_error,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.schema.capture import (
    Attribution,
    CaptureMetadata,
    EdgeCaseFlag,
    FxGraphSummary,
    FxNode,
    HostWindow,
    KernelRecord,
    LatencyStats,
    OperatorAggregate,
    OperatorRecord,
    Profile,
    Speedup,
    Timeline,
    TimelineSummary,
    Timing,
    timing_variant,
)
from pytest_opprof.schema.child import ChildFailure, ChildSpec
from pytest_opprof.schema.optimization import (
    VALIDATION_STEPS,
    BackendPlan,
    BackendSelection,
    Confidence,
    DroppedProposal,
    Evidence,
    Impact,
    IrLevel,
    LadderProgress,
    Numerics,
    Optimizations,
    PassStatus,
    PassStatusName,
    Proposal,
    StepResult,
    StepStatus,
    StockBaseline,
    StockTrial,
    ValidationReport,
    VariantResult,
    WaterfallStep,
)
from pytest_opprof.schema.session import (
    CPU_NOT_ENFORCED,
    Change,
    Comparison,
    SessionSummary,
    WorkloadSummary,
)

__all__ = [
    "CPU_NOT_ENFORCED",
    "VALIDATION_STEPS",
    "Artifact",
    "Attribution",
    "BackendPlan",
    "BackendSelection",
    "CaptureMetadata",
    "Change",
    "ChildFailure",
    "ChildSpec",
    "Comparison",
    "Confidence",
    "DroppedProposal",
    "EdgeCaseFlag",
    "Evidence",
    "FxGraphSummary",
    "FxNode",
    "HostWindow",
    "Impact",
    "IrLevel",
    "KernelRecord",
    "LadderProgress",
    "LatencyStats",
    "Model",
    "Numerics",
    "OperatorAggregate",
    "OperatorRecord",
    "Optimizations",
    "PassStatus",
    "PassStatusName",
    "Profile",
    "Proposal",
    "SessionSummary",
    "Speedup",
    "StepResult",
    "StepStatus",
    "StockBaseline",
    "StockTrial",
    "Timeline",
    "TimelineSummary",
    "Timing",
    "ValidationReport",
    "VariantResult",
    "WaterfallStep",
    "WorkloadSummary",
    "first_error",
    "read_artifact",
    "timing_variant",
    "write_artifact",
    "write_text_atomic",
]
