"""The impact model: an iteration's time budget and what a change can save from it.

Savings are estimated, never guessed: device time from the roofline of the hardware table
(peak FLOP/s per precision, HBM bandwidth), host time from the measured launch overhead, both
applied to the eager iteration the timing pass measured (no profiler attached). Where a term
cannot be modelled the estimate says so and is zero; the backend stage measures every proposal
anyway and drops those that do not pay.

How device savings reach the wall clock: an eager iteration alternates regions where the GPU is
busy (the host runs ahead) and regions where it waits for the host. A device-time saving only
shortens the former, so it is scaled by the busy share of the iteration; a launch removed only
shortens the latter, so it is scaled by the idle share.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_opprof import knowledge
from pytest_opprof.schema import Impact, Profile, Timeline, TimelineSummary

KERNEL_FLOOR_US = 2.0
"""Least time one kernel takes back to back on current GPUs (launch latency and tail): no
estimate may promise an operator faster than its kernel count times this."""


PROFILER_HOST_SLOWDOWN = 3.0
"""Most the timeline pass's profiler (CPU + CUDA activities, record_shapes) slowed the host's
iteration of the examples (docs/design-notes.md#the-profilers-host-slowdown). A profiled host
time divided by it is a lower bound of the real one."""


def host_floor_us(summary: TimelineSummary, wall_us: float | None, device_us: float) -> float:
    """A lower bound of the host's time per iteration: what the GPU waited (timing pass), the
    kernels' launch calls, or the profiled host time less the profiler's largest slowdown."""
    launches = summary.kernels_per_iter * (summary.launch_overhead_per_call_us or 0.0)
    profiled = summary.wall_time_per_iter_us / PROFILER_HOST_SLOWDOWN
    waited = max(0.0, wall_us - device_us) if wall_us is not None else 0.0
    floor = max(launches, profiled, waited)
    return min(floor, wall_us) if wall_us is not None else floor


@dataclass(frozen=True)
class Budget:
    """Where the time of one eager iteration goes, with where each figure was read."""

    wall_us: float
    wall_from: str
    device_us: float
    device_from: str
    idle_share: float
    idle_from: str
    host_floor_us: float
    kernels_per_iter: float
    launch_us: float | None
    workload: str

    def wall_saving(self, device_us: float = 0.0, launches: float = 0.0) -> float:
        """Wall-clock µs saved by ``device_us`` less kernel time and ``launches`` fewer launches.

        Kernel time saved counts in the busy share of the iteration, launches removed in the
        idle share; the iteration never gets shorter than the host needs to issue its kernels.
        """
        busy = 1.0 - self.idle_share
        host = launches * (self.launch_us or 0.0) * self.idle_share
        saving = max(0.0, device_us) * busy + host
        floor = max(KERNEL_FLOOR_US, self.host_floor_us - launches * (self.launch_us or 0.0))
        return min(saving, max(0.0, self.wall_us - floor))

    def impact(self, saving_us: float, basis: str) -> Impact:
        """The saving as an ``Impact`` against the eager iteration, with its basis."""
        saving = min(max(0.0, saving_us), max(0.0, self.wall_us - KERNEL_FLOOR_US))
        remaining = self.wall_us - saving
        speedup = self.wall_us / remaining if remaining > 0 else 1.0
        text = (
            f"{basis}; {self.workload}: eager iteration {self.wall_us:.1f} µs "
            f"({self.wall_from}), kernel time {self.device_us:.1f} µs ({self.device_from}), "
            f"GPU idle {self.idle_share:.0%} ({self.idle_from}), host ≥ "
            f"{self.host_floor_us:.1f} µs"
        )
        return Impact(
            estimated_saving_us=round(saving, 1),
            estimated_speedup=round(speedup, 3),
            basis=text,
        )


def budget(profile: Profile, timeline: Timeline) -> Budget:
    """The eager iteration's budget: timing pass first (no profiler attached), the profiled
    timeline otherwise. The profiler slows the host, so the timeline's own idle time overstates
    how long the GPU waits; latency − kernel time from the timing pass does not."""
    summary = timeline.summary
    eager = profile.timing.variants.get("eager")
    timed = eager is not None and eager.median_ms > 0
    if eager is not None and timed:
        wall, wall_from = eager.median_ms * 1000.0, "timing.variants.eager.median_ms"
    else:
        wall = summary.wall_time_per_iter_us
        wall_from = "timelines[0].summary.wall_time_per_iter_us"
    kernel_ms = profile.timing.gpu_kernel_ms.get("eager")
    if kernel_ms is not None and kernel_ms > 0:
        device, device_from = kernel_ms * 1000.0, "timing.gpu_kernel_ms.eager"
    else:
        device = summary.device_time_per_iter_us
        device_from = "timelines[0].summary.device_time_per_iter_us"
    if timed and wall > 0:
        idle, idle_from = max(0.0, wall - device) / wall, "latency − kernel time"
    elif summary.wall_time_per_iter_us > 0:
        idle = summary.idle_time_per_iter_us / summary.wall_time_per_iter_us
        idle_from = "profiled timeline"
    else:
        idle, idle_from = 0.0, "unknown"
    return Budget(
        wall_us=wall,
        wall_from=wall_from,
        device_us=min(device, wall) if wall > 0 else device,
        device_from=device_from,
        idle_share=min(1.0, max(0.0, idle)),
        idle_from=idle_from,
        host_floor_us=host_floor_us(summary, wall if timed else None, device),
        kernels_per_iter=summary.kernels_per_iter,
        launch_us=summary.launch_overhead_per_call_us,
        workload=profile.capture_metadata.workload,
    )


# -------------------------------------------------------------------------- dtype roofline


@dataclass(frozen=True)
class OpTime:
    """Part of an operator's time per iteration and the factor a precision change scales it by."""

    name: str
    time_us: float
    scale: float
    kernels: float
    basis: str
    """how ``scale`` was found: "roofline" (the call's FLOPs and bytes) or "kernel names"."""


def roofline_scale(
    spec: knowledge.GpuSpec,
    precision: str,
    flops: float,
    nbytes: float,
    target: str = "bf16",
) -> float:
    """How much faster a call gets at ``target``, if it keeps its fraction of the roofline.

    The roofline moves from the current one (FP32 on the CUDA cores, or TF32 on tensor cores;
    ``bytes``) to the target's (dense tensor-core peak, half the bytes): the ratio of the two
    roofline times. A compute-bound FP32 GEMM gets the ratio of the two peaks in ``knowledge``'s
    table, a memory-bound kernel ½, and a GEMM that turns memory-bound at BF16 something between.
    """
    if flops <= 0 and nbytes <= 0:
        return 1.0
    now = knowledge.roofline(
        spec, precision, flops, nbytes, 1.0, tensor_cores=precision != "fp32"
    ).roofline_seconds
    after = knowledge.roofline(spec, target, flops, nbytes / 2.0, 1.0).roofline_seconds
    return after / now if now > 0 else 1.0


def kernel_scale(spec: knowledge.GpuSpec, kind: str, target: str = "bf16") -> float:
    """The factor for a kernel known only by name: fp32 (CUDA cores) or tf32 by the peak ratio,
    ``memory`` (bandwidth-bound: layout conversions, elementwise) by ½, anything else by 1."""
    to_peak = knowledge.peak_flops(spec, target)
    if kind == "fp32":
        return knowledge.peak_flops(spec, "fp32", tensor_cores=False) / to_peak
    if kind == "tf32":
        return knowledge.peak_flops(spec, "tf32") / to_peak
    return 0.5 if kind == "memory" else 1.0


@dataclass(frozen=True)
class DtypeEstimate:
    device_saving_us: float
    before_us: float
    after_us: float
    detail: str


def dtype_promotion_saving(ops: list[OpTime], spec: knowledge.GpuSpec) -> DtypeEstimate:
    """Kernel time saved by running ``ops`` in BF16: each part scaled by its factor, but never
    below its kernel count times ``KERNEL_FLOOR_US``."""
    before = sum(op.time_us for op in ops)
    after = sum(max(op.time_us * op.scale, op.kernels * KERNEL_FLOOR_US) for op in ops)
    by_roofline = sum(op.time_us for op in ops if op.basis == "roofline")
    fp32 = knowledge.peak_flops(spec, "fp32", tensor_cores=False) / 1e12
    tf32 = knowledge.peak_flops(spec, "tf32") / 1e12
    bf16 = knowledge.peak_flops(spec, "bf16") / 1e12
    detail = (
        f"roofline on {spec.name} (FP32 {fp32:.1f} / TF32 {tf32:.1f} → BF16 {bf16:.1f} "
        f"TFLOP/s, {spec.memory_bandwidth_bytes_per_s / 1e12:.1f} TB/s, bytes halved): "
        f"{before:.1f} µs of FP32/TF32 GEMM-like operators keep their fraction of the roofline "
        f"({by_roofline:.1f} µs placed by their calls' shapes, the rest by kernel names), "
        f"floored at {KERNEL_FLOOR_US:g} µs per kernel → {after:.1f} µs"
    )
    return DtypeEstimate(max(0.0, before - after), before, after, detail)


def bytes_at_bandwidth_us(nbytes: float, spec: knowledge.GpuSpec | None) -> float:
    """Time to move ``nbytes`` at the GPU's HBM bandwidth (0 on the CPU)."""
    if spec is None:
        return 0.0
    return nbytes / spec.memory_bandwidth_bytes_per_s * 1e6
