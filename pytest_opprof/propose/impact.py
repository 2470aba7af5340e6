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
from pytest_opprof.schema import Impact, Profile, Timeline

KERNEL_FLOOR_US = 2.0
"""Least time one kernel takes back to back on current GPUs (launch latency and tail): no
estimate may promise an operator faster than its kernel count times this."""


@dataclass(frozen=True)
class Budget:
    """Where the time of one eager iteration goes, with where each figure was read."""

    wall_us: float
    wall_from: str
    device_us: float
    device_from: str
    idle_share: float
    kernels_per_iter: float
    launch_us: float | None
    workload: str

    def wall_saving(self, device_us: float = 0.0, launches: float = 0.0) -> float:
        """Wall-clock µs saved by ``device_us`` less kernel time and ``launches`` fewer launches."""
        busy = 1.0 - self.idle_share
        host = launches * (self.launch_us or 0.0) * self.idle_share
        saving = max(0.0, device_us) * busy + host
        return min(saving, max(0.0, self.wall_us - KERNEL_FLOOR_US))

    def impact(self, saving_us: float, basis: str) -> Impact:
        """The saving as an ``Impact`` against the eager iteration, with its basis."""
        saving = min(max(0.0, saving_us), max(0.0, self.wall_us - KERNEL_FLOOR_US))
        remaining = self.wall_us - saving
        speedup = self.wall_us / remaining if remaining > 0 else 1.0
        text = (
            f"{basis}; {self.workload}: eager iteration {self.wall_us:.1f} µs "
            f"({self.wall_from}), kernel time {self.device_us:.1f} µs ({self.device_from}), "
            f"GPU idle {self.idle_share:.0%}"
        )
        return Impact(
            estimated_saving_us=round(saving, 1),
            estimated_speedup=round(speedup, 3),
            basis=text,
        )


def budget(profile: Profile, timeline: Timeline) -> Budget:
    """The eager iteration's budget: timing pass first, the profiled timeline otherwise."""
    summary = timeline.summary
    eager = profile.timing.variants.get("eager")
    if eager is not None and eager.median_ms > 0:
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
    if summary.wall_time_per_iter_us > 0:
        idle = summary.idle_time_per_iter_us / summary.wall_time_per_iter_us
    else:
        idle = max(0.0, 1.0 - device / wall) if wall > 0 else 0.0
    return Budget(
        wall_us=wall,
        wall_from=wall_from,
        device_us=min(device, wall) if wall > 0 else device,
        device_from=device_from,
        idle_share=min(1.0, max(0.0, idle)),
        kernels_per_iter=summary.kernels_per_iter,
        launch_us=summary.launch_overhead_per_call_us,
        workload=profile.capture_metadata.workload,
    )


# -------------------------------------------------------------------------- dtype roofline


@dataclass(frozen=True)
class OpTime:
    """One operator's share of the iteration and what its kernels and shapes say."""

    name: str
    time_us: float
    precision: str
    """fp32 (CUDA cores), tf32 (tensor cores), memory (bandwidth-bound kernels: layout
    conversions, elementwise) or none (already 16-bit)."""
    kernels: float
    bytes_fp32: float | None


@dataclass(frozen=True)
class DtypeEstimate:
    device_saving_us: float
    compute_us: float
    memory_floor_us: float | None
    launch_floor_us: float
    detail: str


def dtype_promotion_saving(
    ops: list[OpTime], spec: knowledge.GpuSpec, target: str = "bf16"
) -> DtypeEstimate:
    """Device time saved by running ``ops`` in ``target`` on tensor cores.

    Each GEMM-like part's time scales by its current peak over the target's dense peak (FP32 on
    the CUDA cores, or TF32); bandwidth-bound parts by ½ (half the bytes). The result is bounded
    below by the memory floor (all bytes, halved, at HBM bandwidth) and by the kernel count
    times ``KERNEL_FLOOR_US``.
    """
    to_peak = knowledge.peak_flops(spec, target)
    scale = {
        "fp32": knowledge.peak_flops(spec, "fp32", tensor_cores=False) / to_peak,
        "tf32": knowledge.peak_flops(spec, "tf32") / to_peak,
        "memory": 0.5,
        "none": 1.0,
    }
    before = compute = floor_mem = floor_launch = 0.0
    known_bytes = True
    for op in ops:
        before += op.time_us
        compute += op.time_us * scale[op.precision]
        floor_launch += op.kernels * KERNEL_FLOOR_US
        if op.bytes_fp32 is None:
            known_bytes = False
        else:
            floor_mem += op.bytes_fp32 / 2.0 / spec.memory_bandwidth_bytes_per_s * 1e6
    memory = floor_mem if known_bytes else None
    after = max(compute, memory or 0.0, floor_launch)
    fp32 = knowledge.peak_flops(spec, "fp32", tensor_cores=False) / 1e12
    tf32 = knowledge.peak_flops(spec, "tf32") / 1e12
    detail = (
        f"roofline on {spec.name}: {before:.1f} µs of FP32/TF32 GEMM-like operators, their "
        f"kernels scaled by peak ratio (FP32 {fp32:.1f} / TF32 {tf32:.1f} → {target.upper()} "
        f"{to_peak / 1e12:.1f} TFLOP/s) ½ where bandwidth-bound, "
        f"unchanged where latency-bound = {compute:.1f} µs, "
        "memory floor "
        + (f"{memory:.1f} µs" if memory is not None else "unknown (no shapes or DRAM counters)")
        + f", launch floor {floor_launch:.1f} µs → {after:.1f} µs"
    )
    return DtypeEstimate(max(0.0, before - after), compute, memory, floor_launch, detail)


def bytes_at_bandwidth_us(nbytes: float, spec: knowledge.GpuSpec | None) -> float:
    """Time to move ``nbytes`` at the GPU's HBM bandwidth (0 on the CPU)."""
    if spec is None:
        return 0.0
    return nbytes / spec.memory_bandwidth_bytes_per_s * 1e6
