"""The capture stage's artifacts: ``profile.json`` (``Profile``: the timing of each variant,
the timelines with their operators and kernels, the capture's metadata) and ``graph.json``
(``FxGraphSummary``: the workload's Dynamo graphs)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pytest_opprof.schema.base import Artifact, Model

Attribution = Literal["high", "medium", "none"]


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
