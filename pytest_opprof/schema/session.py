"""The session's artifacts and what the history reads: each workload's outcome
(``WorkloadSummary``), the session's ``summary.json`` (``SessionSummary``), and a workload's
comparison with a stored run (``Comparison``, ``Change``: ``--opprof-compare``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pytest_opprof.schema.base import Artifact, Model
from pytest_opprof.schema.capture import Speedup


class Change(Model):
    """One figure of a workload against a stored run (``--opprof-compare``): ``ratio`` is this
    run's over the stored run's, with a 95% CI from both runs' rounds, resampled apart
    (``measure.between_runs``)."""

    metric: Literal["latency", "speedup"]
    name: str = Field(
        description="latency: the variant timed (eager, compile, optimized, …); speedup: the "
        "baseline the optimized backend is measured against"
    )
    before: float = Field(description="the stored run's figure (ms, or ×)")
    after: float = Field(description="this run's figure")
    ratio: float
    ci_low: float
    ci_high: float
    verdict: Literal["regressed", "improved", "unchanged"] = Field(
        description="regressed / improved: the CI lies wholly on that side of 1 (a latency "
        "higher, a speedup lower); unchanged: it holds 1"
    )
    gate: bool = Field(default=False, description="the speedup the gate holds (its baseline)")
    limit: float | None = Field(
        default=None,
        description="the ratio past which --opprof-compare-fail fails this figure: 1 + the "
        "threshold for a latency, 1 - the threshold for a speedup",
    )
    rule: str | None = Field(default=None, description="the --opprof-compare-fail rule")
    failed: bool = Field(default=False, description="the CI lies wholly past limit")


class Comparison(Model):
    """A workload of this run against the same workload in a stored run."""

    run: int = Field(description="the stored run's number")
    label: str = Field(description="how reports name the stored run: '#3 main @ abc1234'")
    commit: str | None = None
    branch: str | None = None
    gated: bool = Field(
        default=True,
        description="false where the stored run measured on another device: the changes are "
        "shown, never failed",
    )
    changes: list[Change] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class WorkloadSummary(Model):
    name: str
    path: str
    status: Literal["passed", "failed", "error", "skipped"]
    stage: str = Field(description="the last stage reached")
    message: str = ""
    baseline: str | None = None
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    baseline_ms: float | None = None
    optimized_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    stock_ms: float | None = Field(
        default=None, description="the stock baseline's median (--opprof-stock; backend.stock)"
    )
    speedup_vs_stock: float | None = None
    stock: str | None = Field(default=None, description="the stock recipe measured, in words")
    stock_dtype: str | None = None
    stock_note: str = Field(
        default="", description="why the stock baseline, asked for, was not measured"
    )
    dtype: str | None = None
    passes: list[str] = Field(default_factory=list)
    report: str | None = None
    enforced: bool = Field(
        default=True,
        description="false on the CPU fallback without --opprof-gate-on-cpu: the speedup was "
        "measured but not gated, and every report says 'CPU fallback: gate not enforced' "
        "instead of a verdict",
    )
    speedups: list[Speedup] = Field(
        default_factory=list,
        description="every interleaved speedup of the recapture (profile_optimized.json), with "
        "its CI: against each baseline, with the dtype change and without it",
    )
    comparison: Comparison | None = Field(
        default=None, description="against the stored run of --opprof-compare (history.py)"
    )


CPU_NOT_ENFORCED = "CPU fallback: gate not enforced"
"""The words every report (headline, terminal table, job summary, PR comment) shows in place of
a verdict where the gate was not enforced."""


class SessionSummary(Artifact):
    # 1.1: gate_enforced, and each workload's enforced (the CPU fallback's gate); 1.2: the
    # measured commit, the stored runs compared with and saved, workloads' speedups and
    # comparison (issue 40); 1.3: workloads' stock baseline (issue 38); 1.4: why it was not
    # measured (stock_note)
    SCHEMA_VERSION: ClassVar[str] = "1.4"

    device: str
    workloads: list[WorkloadSummary]
    gate_passed: bool
    gate_enforced: bool = Field(
        default=True,
        description="false when some workload's gate was not enforced (the CPU fallback): "
        "gate_passed then says no stage failed, not that a speedup was proven",
    )
    commit: str | None = Field(default=None, description="the git commit measured (HEAD)")
    branch: str | None = None
    dirty: bool | None = Field(default=None, description="tracked files differed from commit")
    compared_with: str | None = Field(
        default=None, description="the stored run of --opprof-compare, as reports name it"
    )
    saved_as: str | None = Field(
        default=None, description="the stored run --opprof-save wrote: its file"
    )
