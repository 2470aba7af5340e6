"""The artifacts of the stages between capture and recapture: the proposals
(``optimizations.json``), the backend's measured selection (``backend_selection.json``), the
stock baseline, and the validation report (``validation_report.json``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pytest_opprof.schema.base import Artifact, Model
from pytest_opprof.schema.capture import EdgeCaseFlag, LatencyStats, Speedup

Confidence = Literal["high", "medium", "low"]
IrLevel = Literal["functional", "aten", "non_graph", "inductor_config"]
PassStatusName = Literal["APPLIED", "NOT_APPLIED", "FAILED"]
StepStatus = Literal["pass", "fail", "skipped"]


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
    stock_recipe: str | None = Field(
        default=None,
        description="the plan is a stock recipe of backend.stock at dtype, compiled as a user "
        "writes it (no pass of this package): selection measured it faster than the ladder's",
    )
    autocast: bool = Field(
        default=False,
        description="the precision change runs the fp32 model under torch.autocast at dtype "
        "(matmuls and convolutions low, norms and reductions fp32) instead of casting it",
    )
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
            update={
                "dtype": None,
                "autocast": False,
                "aten": [p for p in self.aten if p not in drop],
            }
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
    # below's latency in the same rounds, so a report shows latencies measured (issue 37);
    # 1.5: plan.autocast (the precision change under autocast) and plan.stock_recipe (issue 38)
    SCHEMA_VERSION: ClassVar[str] = "1.5"

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


class LadderProgress(Artifact):
    """Selection's ladder as it stands, written before and after each rung
    (``profiler_output/selection_progress.json``): where the selection process dies building or
    timing a rung (a CUDA error leaves a process unusable), a fresh process reads it, drops
    that rung and climbs on from the next (``stages.backend``)."""

    selection: BackendSelection
    first_pass: list[bool] = Field(
        default_factory=list, description="kept or not, each first-pass rung attempted, in order"
    )
    second_pass: int = Field(
        default=0,
        description="how far the second pass has gone through its rungs (the dropped ones "
        "before the last kept); a rung under way is on the second pass where first_pass "
        "covers every rung",
    )
    revived: bool = Field(
        default=False, description="a rung was kept on the second pass (worth_a_second_pass)"
    )
    under_way: str | None = Field(
        default=None, description="the rung being built or timed; None between rungs"
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
    """The stock baseline's choice (the backend stage, beside selection, which tries it against
    its plan once the ladder is climbed; the recapture times it): the faster of the stock
    recipes whose outputs pass the validator, at bf16 or, where bf16 fails, at fp32.
    ``recipe`` is None where none passed; ``message`` says why."""

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
