"""Pydantic models of every artifact the stages write, with atomic writes and validating reads.

Each artifact carries ``schema_version`` (``MAJOR.MINOR``). A reader accepts its own major
version and rejects a newer one with a message to upgrade; knowledge/schema-versions.md lists
what each version holds. Pure Python: no torch here.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pytest_opprof.errors import ArtifactError

Confidence = Literal["high", "medium", "low"]
Attribution = Literal["high", "medium", "none"]
IrLevel = Literal["functional", "aten", "non_graph", "inductor_config"]
PassStatusName = Literal["APPLIED", "NOT_APPLIED", "FAILED"]
StepStatus = Literal["pass", "fail", "skipped"]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Artifact(Model):
    """Base of the files on disk: a ``schema_version`` whose major must match ours."""

    SCHEMA_VERSION: ClassVar[str] = "1.0"
    schema_version: str = ""

    def model_post_init(self, context: Any, /) -> None:
        if not self.schema_version:
            self.schema_version = self.SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _same_major(cls, value: str) -> str:
        if not value:
            return value
        major, _, _ = value.partition(".")
        ours, _, _ = cls.SCHEMA_VERSION.partition(".")
        if not major.isdigit():
            raise ValueError(f"schema_version {value!r} is not MAJOR.MINOR")
        if int(major) > int(ours):
            raise ValueError(
                f"schema_version {value} is newer than this pytest-opprof reads "
                f"({cls.SCHEMA_VERSION}); upgrade pytest-opprof or re-run the stage"
            )
        if int(major) < int(ours):
            raise ValueError(
                f"schema_version {value} is older than {cls.SCHEMA_VERSION}; re-run the stage "
                "to rewrite it"
            )
        return value


# --------------------------------------------------------------------------------- capture


class LatencyStats(Model):
    """Per-call latency of one callable, from repeated rounds of back-to-back calls."""

    median_ms: float
    ci_low_ms: float
    ci_high_ms: float
    mean_ms: float
    stdev_ms: float
    min_ms: float
    rounds: int
    calls_per_round: int
    samples_ms: list[float] = Field(description="per-call time of each round")
    processes: int = Field(default=1, description="timing processes the rounds came from")
    samples_per_process: list[int] = Field(
        default_factory=list,
        description="rounds of each process, in the order of samples_ms (several processes)",
    )
    cpu_share: list[float] = Field(
        default_factory=list,
        description=(
            "per round, in the order of samples_ms: the launching thread's CPU time over the "
            "round's wall time (near 1: it ran throughout, waiting on the GPU included; less: "
            "another task or the hypervisor had its CPU); empty where not measured"
        ),
    )
    preempted: list[int] = Field(
        default_factory=list,
        description="per round: the launching thread's involuntary context switches",
    )
    set_aside: list[int] = Field(
        default_factory=list,
        description=(
            "rounds (indices into samples_ms) left out of every statistic: timed while the "
            "host's CPU ran slowed (Timing.host_us); rounds counts them"
        ),
    )


class HostWindow(Model):
    """What the host's CPUs did while one timing process measured (``/proc/stat``, 10 ms
    ticks): CPUs' worth of busy and of stolen time, on the process's own CPUs (its launching
    thread is about one of them) and on the others."""

    seconds: float
    own_cpus: int
    own_busy: float
    own_steal: float
    other_cpus: int
    other_busy: float
    other_steal: float


class Speedup(Model):
    """``baseline / candidate`` latency, measured interleaved (in one process, or in each of
    several, pooled)."""

    baseline: str
    candidate: str
    ratio: float
    ci_low: float
    ci_high: float
    process_ratios: list[float] = Field(
        default_factory=list, description="each timing process's own ratio (several processes)"
    )


def timing_variant(timeline_label: str) -> str:
    """The ``Timing.variants`` key of a timeline: its own label, except the compiled
    baseline's (timeline ``compiled``, timing variant ``compile``)."""
    return "compile" if timeline_label == "compiled" else timeline_label


class Timing(Model):
    device: str
    clock: Literal["cuda_event", "perf_counter"]
    variants: dict[str, LatencyStats]
    gpu_kernel_ms: dict[str, float] = Field(
        default_factory=dict, description="GPU kernel time per call, from the timeline"
    )
    gpu_time_ms: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "GPU time per call with the host hidden: calls enqueued behind a GPU sleep, CUDA "
            "events around them (capture.timing.gpu_time); none on the CPU, and none for a "
            "call the host never gets ahead of"
        ),
    )
    speedups: list[Speedup] = Field(default_factory=list)
    compile_seconds: dict[str, float] = Field(default_factory=dict)
    host: list[HostWindow] = Field(
        default_factory=list,
        description="per timing process, in the order of the samples: the host while it timed",
    )
    host_us: list[float] = Field(
        default_factory=list,
        description=(
            "per round, in the order of the samples of a variant timed in every process: "
            "microseconds per call of a fixed piece of CPU work at the round's start (the "
            "host's speed; capture.timing.host_reference_us)"
        ),
    )

    @property
    def processes(self) -> int:
        """The timing processes the most-timed variant came from (1: one process)."""
        return max((v.processes for v in self.variants.values()), default=1)


class KernelRecord(Model):
    name: str
    duration_us: float
    start_us: float = Field(description="start relative to the measured window")
    grid: list[int] | None = None
    block: list[int] | None = None
    stream: int | None = None
    device: int | None = None
    correlation: int | None = None
    shared_memory: int | None = Field(
        default=None, description="static + dynamic shared memory per block, bytes"
    )
    attribution: Attribution = "none"
    fused_ops: list[str] = Field(default_factory=list)
    metrics: dict[str, float | None] = Field(default_factory=dict)
    counters_source: Literal["measured", "same_launch_config"] | None = Field(
        default=None,
        description="measured: ncu replayed this launch; same_launch_config: copied from the "
        "replayed launch of the same kernel, grid, block and shared memory",
    )


class OperatorRecord(Model):
    name: str
    call_index: int
    cpu_time_us: float
    gpu_time_us: float
    input_shapes: list[Any] = Field(default_factory=list)
    kernels: list[KernelRecord] = Field(default_factory=list)
    fused_ops: list[str] = Field(default_factory=list)


class OperatorAggregate(Model):
    name: str
    calls: int
    cpu_time_us: float
    gpu_time_us: float
    share: float = Field(description="share of the timeline's device time, 0..1")
    kernel_count: int
    kernel_names: list[str] = Field(default_factory=list)
    metrics: dict[str, float | None] = Field(default_factory=dict)
    bottleneck: str | None = None


class TimelineSummary(Model):
    iterations: int
    device_time_per_iter_us: float
    wall_time_per_iter_us: float
    idle_time_per_iter_us: float
    kernels_per_iter: float
    launch_overhead_per_call_us: float | None = None
    launches_per_iter: float | None = Field(
        default=None,
        description="the host's kernel and CUDA-graph launches per iteration: what a stream's "
        "launch queue holds, one per replay of a CUDA graph whatever its kernels",
    )
    attributed_share: float
    high_share: float
    busy_time_per_iter_us: float | None = Field(
        default=None,
        description="time at least one kernel runs (the union of kernel intervals): below "
        "device_time_per_iter_us when streams overlap; comparable with the timing pass's "
        "per-call latency when the GPU never idles",
    )


class Timeline(Model):
    label: str
    compile_mode: str
    summary: TimelineSummary
    operators: list[OperatorRecord]
    aggregated: list[OperatorAggregate]
    unattributed_kernels: list[KernelRecord] = Field(default_factory=list)
    trace_file: str | None = None


class EdgeCaseFlag(Model):
    name: str
    detail: str


class CaptureMetadata(Model):
    workload: str
    device_type: Literal["cuda", "cpu"]
    device_name: str
    sm_count: int | None = None
    compute_capability: str | None = None
    driver: str | None = None
    torch_version: str
    cuda_version: str | None = None
    triton_version: str | None = None
    python_version: str
    dtype: str
    input_shapes: list[list[int]]
    input_dtypes: list[str]
    warmup_iters: int
    measure_iters: int
    rounds: int
    compile_mode: str
    timestamp: str
    environment_fingerprint: str
    workload_sha256: str
    cpu_fallback: bool = False
    visible_devices: str | None = Field(
        default=None, description="CUDA_VISIBLE_DEVICES as the measuring process saw it"
    )
    device_count: int | None = Field(
        default=None, description="GPUs the measuring process could see (torch.cuda)"
    )
    device_uuid: str | None = Field(default=None, description="the measured GPU's UUID")
    peak_memory_bytes: int | None = Field(
        default=None,
        description="the most GPU memory the measuring process reserved "
        "(torch.cuda.max_memory_reserved), models, compiles and timing included",
    )
    device_memory_bytes: int | None = Field(default=None, description="the GPU's memory")


class Profile(Artifact):
    """``profile.json`` and ``profile_optimized.json``; ``timelines[0]`` is the primary one
    (eager for the baseline, the optimized backend for the recapture)."""

    # 2.1: summary.busy_time_per_iter_us; 2.2: kernels' shared_memory and counters_source;
    # 2.3: capture_metadata's visible_devices, device_count, device_uuid; timing from several
    # processes (variants' processes / samples_per_process, speedups' process_ratios);
    # 2.4: timing.gpu_time_ms; 2.5: capture_metadata's peak_memory_bytes, device_memory_bytes;
    # 2.6: timing variants' cpu_share, preempted and set_aside, timing.host and host_us
    SCHEMA_VERSION: ClassVar[str] = "2.6"
    capture_metadata: CaptureMetadata
    timing: Timing
    timelines: list[Timeline]
    edge_case_flags: list[EdgeCaseFlag] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    counters: dict[str, Any] | None = None

    @property
    def primary(self) -> Timeline:
        return self.timelines[0]

    def timeline(self, label: str) -> Timeline | None:
        return next((t for t in self.timelines if t.label == label), None)


class FxNode(Model):
    name: str
    op: str
    target: str
    args: list[str] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    shape: list[int] | None = None
    dtype: str | None = None
    module_type: str | None = None
    module_path: str | None = None


class FxGraphSummary(Artifact):
    """The workload's Dynamo graph(s), for the pattern detectors of the propose stage."""

    graphs: list[list[FxNode]]
    graph_breaks: int = 0
    break_reasons: list[str] = Field(default_factory=list)
    parameters: dict[str, list[int]] = Field(default_factory=dict)
    module_types: dict[str, str] = Field(default_factory=dict)


# --------------------------------------------------------------------------------- propose


class Evidence(Model):
    metric: str
    value: float | int | str
    unit: str = ""
    source: str = Field(description="where in profile.json / graph.json the value is")


class Impact(Model):
    estimated_saving_us: float
    estimated_speedup: float
    basis: str


class Proposal(Model):
    id: str
    type: str
    ir_level: IrLevel
    targets: list[str]
    evidence: list[Evidence]
    fx_steps: list[str]
    impact: Impact
    confidence: Confidence
    depends_on: list[str] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    source: Literal["rules", "llm", "hook"] = "rules"
    rationale: str = ""


class Optimizations(Artifact):
    workload: str
    device_type: str
    proposals: list[Proposal]
    global_notes: list[str] = Field(default_factory=list)
    edge_case_flags: list[EdgeCaseFlag] = Field(default_factory=list)


# --------------------------------------------------------------------------------- backend


class BackendPlan(Model):
    """What a generated backend does: non-graph changes, passes per IR level, config."""

    dtype: str | None = None
    channels_last: bool = False
    pad_batch_to: int | None = None
    functional: list[str] = Field(default_factory=list)
    aten: list[str] = Field(default_factory=list)
    config_patches: dict[str, Any] = Field(default_factory=dict)
    cuda_graph_model: bool = Field(
        default=False,
        description="record the whole optimized call as one CUDA graph and replay it "
        "(backend.model_graph); Inductor's own CUDA graphs are then off",
    )
    proposals: list[str] = Field(default_factory=list)
    extra_passes: dict[str, str] = Field(
        default_factory=dict,
        description="user passes among functional/aten: type → 'module:qualname' "
        "(registered by a conftest through pytest_opprof_register_passes)",
    )

    def without_dtype(self) -> BackendPlan:
        drop = {"dtype_promotion"}
        return self.model_copy(
            update={"dtype": None, "aten": [p for p in self.aten if p not in drop]}
        )


class Numerics(Model):
    """One output compared with the fp32 eager reference (``numerics.check_numerics``)."""

    max_abs_err: float
    rel_err: float
    rtol: float
    atol: float
    dtype: str
    ok: bool
    rel_limit: float | None = Field(
        default=None,
        description="the relative L2 error allowed: rtol, or less where the same-precision "
        "eager reference showed that this dtype's real error on this model is smaller",
    )
    reference_rel_err: float | None = Field(
        default=None,
        description="the relative L2 error of eager at the compute dtype (under autocast) "
        "against the fp32 eager reference (numerics.same_precision)",
    )
    elements_over: int = Field(
        default=0, description="elements past |d| <= atol' + rel_limit * |ref| (allclose-style)"
    )
    failed: str | None = Field(
        default=None, description="the check that failed and its figures, in words"
    )


class VariantResult(Model):
    name: str
    plan: BackendPlan
    latency: LatencyStats | None = Field(
        default=None,
        description="measured: eager's and compile's in their interleaved run, a rung's in its "
        "paired run against the plan below it",
    )
    speedup: float | None = Field(
        default=None,
        description="reference / variant: for eager and compile, their latencies in the same "
        "run; for a rung, chained: the product of the paired ratios from the reference up, an "
        "estimate that reference_ms / latency need not equal (each pair ran on its own)",
    )
    paired: Speedup | None = Field(
        default=None,
        description="a rung's measured ratio against the plan below it (baseline: that plan's "
        "name) over the same interleaved rounds, with its 95% CI",
    )
    paired_baseline_ms: float | None = Field(
        default=None,
        description="the plan below's median latency in those rounds: it over latency's "
        "median is paired.ratio",
    )
    numerics: Numerics | None = None
    error: str | None = None


class WaterfallStep(Model):
    step: str
    latency_ms: float = Field(
        description="chained: reference_ms / speedup_cumulative, an estimate; the latency "
        "measured is measured_ms"
    )
    speedup_cumulative: float = Field(
        description="chained: the product of the paired ratios so far, an estimate (each pair "
        "ran on its own)"
    )
    speedup_added: float = Field(
        description="measured: the plan below's latency over this one's in the same rounds"
    )
    measured_ms: float | None = Field(
        default=None,
        description="this cumulative plan's median latency measured in its own paired run (the "
        "reference's: in its run with eager); absent before schema 1.4",
    )
    paired: Speedup | None = Field(
        default=None,
        description="speedup_added with its 95% CI; baseline: the plan below's variant name",
    )
    paired_baseline_ms: float | None = Field(
        default=None,
        description="the plan below's median latency in the same rounds: it over measured_ms "
        "is speedup_added",
    )


class DroppedProposal(Model):
    id: str
    type: str
    reason: str


class BackendSelection(Artifact):
    # 1.1: plan.extra_passes (user passes); 1.2: plan.cuda_graph_model; 1.3: numerics_dtype;
    # 1.4: a waterfall step's measured_ms, and a step's and a rung's paired ratio with the plan
    # below's latency in the same rounds, so a report shows latencies measured (issue 37)
    SCHEMA_VERSION: ClassVar[str] = "1.4"

    workload: str
    reference: str
    reference_ms: float
    variants: list[VariantResult]
    chosen: str
    plan: BackendPlan
    dropped: list[DroppedProposal] = Field(default_factory=list)
    waterfall: list[WaterfallStep] = Field(default_factory=list)
    numerics_dtype: str | None = Field(
        default=None,
        description="the dtype whose tolerance the chosen plan was held to, where it is not "
        "the plan's dtype (tensorfloat32: an fp32 plan whose convolutions or matmuls run on "
        "TF32 tensor cores)",
    )


class StockTrial(Model):
    """One stock recipe at one dtype (``backend.stock``): built, checked, briefly timed."""

    recipe: str
    dtype: str
    description: str
    compile_s: float | None = None
    numerics: Numerics | None = None
    median_ms: float | None = Field(
        default=None, description="its median in the brief interleaved timing of the recipes"
    )
    error: str | None = Field(default=None, description="why it is not the bar, in words")


class StockBaseline(Artifact):
    """The stock baseline's choice (stage 4, before the timing): the faster of the stock
    recipes whose outputs pass the validator, at bf16 or, where bf16 fails, at the optimized
    backend's dtype. ``recipe`` is None where none passed; ``message`` says why."""

    SCHEMA_VERSION: ClassVar[str] = "1.0"

    recipe: str | None = None
    dtype: str | None = None
    description: str | None = None
    trials: list[StockTrial] = Field(default_factory=list)
    message: str = ""


# -------------------------------------------------------------------------------- validate


class StepResult(Model):
    status: StepStatus
    detail: str = ""


class PassStatus(Model):
    name: str
    status: PassStatusName
    detail: str = ""
    matches: int = 0


VALIDATION_STEPS: tuple[str, ...] = (
    "syntax",
    "import",
    "registration",
    "tests",
    "smoke",
    "numerics",
)


class ValidationReport(Artifact):
    SCHEMA_VERSION: ClassVar[str] = "1.2"  # 1.1: llm_passes; 1.2: sha256

    file: str
    sha256: str = Field(
        default="",
        description="the sha256 of the file validated: the recapture times only that file",
    )
    backend: str
    steps: dict[str, StepResult]
    passes: list[PassStatus] = Field(default_factory=list)
    numerics: Numerics | None = None
    checks: dict[str, StepResult] = Field(default_factory=dict)
    overall: Literal["READY_FOR_PROFILING", "BLOCKED"]
    message: str = ""
    llm_passes: list[PassStatus] = Field(
        default_factory=list,
        description="LLM-written passes of types the library lacks (named by proposal id), run "
        "apart from the backend on the baseline's Dynamo graph and checked against eager",
    )


# --------------------------------------------------------------------------------- session


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
    # comparison (issue 40); 1.3: workloads' stock baseline (issue 38)
    SCHEMA_VERSION: ClassVar[str] = "1.3"

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


class ChildSpec(Model):
    """What a stage process is asked to do (``python -m pytest_opprof.runner SPEC.json``): the
    task, the workload, the options, and each task's own inputs. Written by the parent
    (``WorkloadRun.run_child``), read by the child's bootstrap; unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    task: str
    workload: str
    out_dir: str = ""
    options: dict[str, Any] = Field(default_factory=dict)
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="the workload's OPPROF and the timing settings"
    )
    extra_passes: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="a record of the user passes (loaded by environment)"
    )
    generated: Path | None = Field(default=None, description="the generated file under test")
    sha256: str | None = Field(
        default=None, description="the generated file's validated hash: no other bytes are run"
    )
    dtype: str | None = Field(default=None, description="the compute dtype numerics are held to")
    result: Path | None = Field(default=None, description="where the task writes its answer")
    outputs: Path | None = Field(default=None, description="the candidate's outputs (validate)")
    tests_log: Path | None = None
    passes: list[dict[str, str]] = Field(
        default_factory=list, description="LLM-written passes to check: proposal id and file"
    )
    shares_cpus: bool = False
    siblings_lock: str | None = None
    profile_name: str = "profile.json"
    timeline_iters: int = 3
    counters_labels: list[str] = Field(default_factory=list)
    counters_label: str = "eager"
    counters_warmup: int = 3

    def need(self, name: str) -> Path:
        """The path input ``name`` of this task, which its parent must have given."""
        value = getattr(self, name)
        if not isinstance(value, Path):
            raise TypeError(f"the spec of task {self.task!r} has no {name}: a bug of the parent")
        return value


class ChildFailure(Model):
    """What the runner writes when user code broke: read by the parent as one message."""

    kind: str
    message: str


# ------------------------------------------------------------------------------------- I/O

A = TypeVar("A", bound=BaseModel)


def write_artifact(path: Path, artifact: BaseModel) -> Path:
    """Write ``artifact`` as JSON atomically: a temp file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = artifact.model_dump_json(indent=2)
    write_text_atomic(path, text + "\n")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def first_error(exc: ValidationError) -> tuple[str, str, int]:
    """The first problem pydantic found: its dotted location, its message, and how many more."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    return where, first["msg"], exc.error_count() - 1


def read_artifact(path: Path, model: type[A]) -> A:
    """Read and validate; any problem is an ``ArtifactError`` naming the file and the field. A
    ``.gz`` file is read through gzip (archived results keep their profiles so)."""
    path = Path(path)
    try:
        if path.suffix == ".gz":
            text = gzip.decompress(path.read_bytes()).decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(
            f"{path}: not found; run the stage that writes it (or drop --opprof-from)"
        ) from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ArtifactError(
            f"{path}: cannot be read ({why}); check its permissions, or delete it and re-run "
            "the stage that writes it"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(
            f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "the file is truncated or was edited by hand — delete it and re-run the stage"
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where, msg, others = first_error(exc)
        more = f" (and {others} more)" if others else ""
        raise ArtifactError(
            f"{path}: field '{where}': {msg}{more}; delete the file and re-run the "
            "stage that writes it"
        ) from None
