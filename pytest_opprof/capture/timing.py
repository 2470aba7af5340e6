"""The timing pass: no profiler attached, rounds of back-to-back calls, interleaved.

Callables are timed A B C A B C … so every round of each sees the same machine state; on CUDA
with events around each round, on the CPU with ``time.perf_counter``. Each round's input is a
fresh random tensor of the workload's shape, made before the round starts. On CUDA each
callable's round also starts from an L2 cache that holds none of its data (:func:`l2_flush`):
otherwise a round's first calls find the cache as the callable before it left it, and a
callable timed after one that reads the same weights (the stock recipe timed under two names)
starts warm where the others start cold.

On CUDA, :func:`gpu_time` measures a second figure per callable: the GPU's own time per call,
with the host out of the way. Calls are enqueued behind a GPU sleep long enough for the host to
get ahead, so their kernels run back to back and the events around them see the device alone.
The timeline's kernel time per iteration should agree with it, short by the GPU's idle gap
between two dependent kernels (about a microsecond each:
docs/design-notes.md#kernel-time-and-the-gpu-time); the rounds above include the time the GPU
waits on the host (a launch-bound call's latency).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

from pytest_opprof.capture.system import cpu_times, host_window
from pytest_opprof.measure import SLOW_HOST
from pytest_opprof.workload import fresh_inputs

Call = Callable[..., Any]


ROUND_SECONDS = 0.05
"""How long one callable's round may last: a callable slow enough that ``calls_per_round`` calls
would take longer gets fewer calls per round (never under ``MIN_CALLS``), as ``timeit``'s
autorange sizes its loops the other way. Each callable is sized by its own first call, so in one
round a 6 ms baseline makes 9 calls and a 0.6 ms CUDA-graph replay the full 30: a call under
1.7 ms keeps all 30; a 100 ms call on the CPU fallback gets 3."""
MIN_CALLS = 3


class RoundSamples(dict[str, list[float]]):
    """Per-call milliseconds of each callable, one sample per round, and how many calls each
    round made of each (``calls``). Rounds stay paired: round ``i`` of every callable ran
    back to back, whatever its number of calls.

    Beside each sample, how the launching thread fared on its CPU in that round
    (``cpu_share``: its CPU time over the round's wall time; ``preempted``: its involuntary
    context switches), and what the host's CPUs did over all the rounds (``host``, a
    ``schema.HostWindow`` or None): a launch-bound call runs at the speed of the CPU that
    launches it, and these say whether that CPU was its own. ``host_us``, per round: how fast
    the host ran a fixed piece of CPU work at its start (:func:`host_reference_us`)."""

    def __init__(self, samples: Mapping[str, list[float]], calls: Mapping[str, int]) -> None:
        super().__init__(samples)
        self.calls = dict(calls)
        self.cpu_share: dict[str, list[float]] = {name: [] for name in samples}
        self.preempted: dict[str, list[int]] = {name: [] for name in samples}
        self.host_us: list[float] = []
        self.host: Any = None

    def add(self, name: str, sample: Round) -> None:
        self[name].append(sample.ms)
        self.cpu_share[name].append(sample.cpu_share)
        self.preempted[name].append(sample.preempted)

    def to_json(self) -> dict[str, Any]:
        """What a timing process sends its parent (``measure.Replica.from_json`` reads it)."""
        return {
            "samples": dict(self),
            "cpu_share": self.cpu_share,
            "preempted": self.preempted,
            "host_us": self.host_us,
            "host": self.host.model_dump() if self.host is not None else None,
        }


class Round(NamedTuple):
    """One round of one callable: per-call milliseconds, and the launching thread's CPU."""

    ms: float
    cpu_share: float
    preempted: int


def _thread_switches() -> int:
    """This thread's involuntary context switches so far (0 where the platform cannot say)."""
    if resource is None or not hasattr(resource, "RUSAGE_THREAD"):
        return 0
    return int(resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw)


def calls_for(call_ms: float, calls_per_round: int, round_seconds: float = ROUND_SECONDS) -> int:
    """Calls per round for a callable whose call takes ``call_ms``: at most
    ``calls_per_round``, fewer where that many would outlast ``round_seconds``."""
    if call_ms <= 0 or call_ms * calls_per_round <= round_seconds * 1000.0:
        return calls_per_round
    fit = math.ceil(round_seconds * 1000.0 / call_ms)
    return max(min(MIN_CALLS, calls_per_round), min(calls_per_round, fit))


def l2_flush(device: str) -> Callable[[], Any] | None:
    """On CUDA, a call that overwrites the current GPU's L2 cache (a buffer twice its size,
    zeroed), queued before a round's start event so that it is not timed; None elsewhere.
    Every callable's round then starts from the same cache, whichever callable ran before."""
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    size = int(getattr(props, "L2_cache_size", 0)) or L2_FALLBACK_BYTES
    return torch.empty(2 * size, dtype=torch.uint8, device="cuda").zero_


L2_FALLBACK_BYTES = 64 * 1024 * 1024
"""The L2 size assumed where torch does not report it: as large as any current GPU's."""


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    calls: Mapping[str, Call],
    template: tuple[torch.Tensor, ...],
    *,
    device: str,
    warmup: int,
    calls_per_round: int,
    rounds: int,
    seed: int = 1000,
    warmup_seconds: float = 0.05,
    round_seconds: float = ROUND_SECONDS,
    any_cpu: bool = False,
    enough: Callable[[RoundSamples], bool] | None = None,
    flush: Callable[[], Any] | None = None,
) -> RoundSamples:
    """Per-call milliseconds of each callable, one sample per round; fewer rounds where
    ``enough(samples)``, asked after each round, says the rounds so far settle the question.

    Warmup runs at least ``warmup`` calls of each and at least ``warmup_seconds`` in all. An
    idle GPU's clock reaches its working speed within a millisecond of work arriving
    (docs/design-notes.md#warmup), so 50 ms of calls is ample and the warmup calls are for the
    code's own first-call costs. After it, one call of each is timed and each round makes
    :func:`calls_for` calls of each callable.

    On CUDA the launching thread times its rounds on the CPU that runs the host reference
    fastest (:class:`FastCpu`: of its own CPUs, or with ``any_cpu`` of the host's, for a
    measurement no other work on the host runs beside), and each round starts with the
    reference (``host_us``). A round whose reference ran more than ``SLOW_HOST`` times slower
    than the best so far moves the thread to the fastest CPU again and takes the reference
    anew there; still slowed, it earns one more round after the planned ones (at most
    ``rounds`` more): the pooled statistics set such rounds aside
    (``measure.slow_host_rounds``), and the extra rounds keep their number up.

    ``flush`` runs before each callable's round, untimed (default: :func:`l2_flush`).
    """
    if flush is None:
        flush = l2_flush(device)
    with torch.no_grad():
        warm = fresh_inputs(template, seed)
        deadline = time.perf_counter() + warmup_seconds
        first = True
        while first or time.perf_counter() < deadline:
            for fn in calls.values():
                for _ in range(warmup):
                    fn(*warm)
            synchronize(device)
            first = False
        n = {
            name: calls_for(_one_round(fn, warm, device, 1).ms, calls_per_round, round_seconds)
            for name, fn in calls.items()
        }
        samples = RoundSamples({name: [] for name in calls}, n)
        before, t0 = cpu_times(), time.perf_counter()
        cpu = _launching_cpu(device, any_cpu)
        try:
            best = cpu.move() if cpu is not None else math.inf
            r, slowed = 0, 0
            while r < rounds + min(slowed, rounds):
                inputs = fresh_inputs(template, seed + 1 + r)
                ref = host_reference_us()
                if ref > SLOW_HOST * best and cpu is not None:
                    best = min(best, cpu.move())  # this round on a CPU at full speed, if any is
                    ref = host_reference_us()  # the speed of the CPU the round runs on
                if ref > SLOW_HOST * best:
                    slowed += 1  # this round is timed, and one more after the planned ones
                best = min(best, ref)
                samples.host_us.append(ref)
                for name, fn in calls.items():
                    samples.add(name, _one_round(fn, inputs, device, n[name], flush))
                r += 1
                if enough is not None and enough(samples):
                    break
        finally:
            if cpu is not None:
                cpu.restore()
        samples.host = host_window(before, cpu_times(), time.perf_counter() - t0)
    return samples


_CAN_PIN = hasattr(os, "sched_setaffinity")
REFERENCE_CALLS = 32
"""Calls of the host reference's tiny CPU ``torch.add`` per repetition: a fraction of a
millisecond per round in all (docs/design-notes.md#the-host-reference)."""


@functools.cache
def _reference_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(8), torch.ones(8)


def host_reference_us(repetitions: int = 3) -> float:
    """Microseconds per call of a fixed piece of host work, the best of ``repetitions``: a tiny
    ``torch.add`` on CPU tensors, the Python, ATen dispatch and allocation a launch-bound call
    spends its host time in, with no device work. A CPU's speed at this work can drop for
    seconds at a time while the timing thread holds it and nothing else runs
    (docs/design-notes.md#the-host-reference): a launch-bound baseline timed in such a stretch
    runs that much slower. Timed at the start of every round, it says which rounds ran on a
    slowed host (``measure.slow_host_rounds``)."""
    a, b = _reference_tensors()
    best = math.inf
    with torch.no_grad():
        for _ in range(repetitions):
            t0 = time.perf_counter()
            for _ in range(REFERENCE_CALLS):
                torch.add(a, b)
            best = min(best, time.perf_counter() - t0)
    return round(best * 1e6 / REFERENCE_CALLS, 3)


class FastCpu:
    """Moves the calling thread to the CPU that runs :func:`host_reference_us` fastest now.

    On a shared host a vCPU can run the reference at half its speed for seconds at a time, with
    the thread on it throughout and no steal reported (another tenant on the same core, as far
    as the guest can tell), and which vCPUs are slowed changes with time
    (docs/design-notes.md#the-host-reference). The candidates are this thread's CPUs, or with
    ``any_cpu`` every CPU of the host it may run on; :meth:`restore` gives the thread its own
    CPUs back."""

    def __init__(self, any_cpu: bool) -> None:
        self.home: set[int] = set(os.sched_getaffinity(0)) if _CAN_PIN else set()
        count = os.cpu_count() or 0
        every = set(range(count)) | self.home if _CAN_PIN else set()
        self.cpus = sorted(every if any_cpu else self.home)  # none where nothing can pin

    def move(self) -> float:
        """Probe every candidate (a few milliseconds in all), stay on the fastest; its
        reference in µs (inf where the thread cannot be moved)."""
        best, where = math.inf, None
        for c in self.cpus if len(self.cpus) > 1 else ():
            try:
                os.sched_setaffinity(0, {c})
            except OSError:  # outside this process's cpuset
                continue
            us = host_reference_us(2)
            if us < best:
                best, where = us, c
        if where is not None:
            os.sched_setaffinity(0, {where})
        return best

    def restore(self) -> None:
        if self.home:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.home)


def _launching_cpu(device: str, any_cpu: bool) -> FastCpu | None:
    """Where the timing thread may move: on CUDA, where the host's speed is the launch's; on
    the CPU the call's own threads do the work, and none is moved."""
    return FastCpu(any_cpu) if device == "cuda" else None


def _one_round(
    fn: Call,
    inputs: Sequence[torch.Tensor],
    device: str,
    n: int,
    flush: Callable[[], Any] | None = None,
) -> Round:
    if flush is not None:
        flush()
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        wall, cpu, switches = time.perf_counter(), time.thread_time(), _thread_switches()
        start.record()
        for _ in range(n):
            fn(*inputs)
        end.record()
        end.synchronize()  # spins on the CPU while it waits (CUDA's default for few contexts)
        ms = float(start.elapsed_time(end)) / n
    else:
        wall, cpu, switches = time.perf_counter(), time.thread_time(), _thread_switches()
        for _ in range(n):
            fn(*inputs)
        ms = (time.perf_counter() - wall) * 1000.0 / n
    spent = time.perf_counter() - wall
    share = (time.thread_time() - cpu) / spent if spent > 0 else 1.0
    return Round(ms, round(min(share, 1.0), 4), _thread_switches() - switches)


LAUNCH_QUEUE = 900
"""Launches a sample may queue behind the sleep: CUDA holds about 1024 pending launches per
stream before the host blocks, and a blocked host is a sample lost."""

GPU_TIME_WINDOW_MS = 10.0
"""About how long the calls a sample queues behind the sleep take, where the call's latency is
known: fewer calls than a timing round's 50 ms of them for a slow call, none fewer than one.
The figure is a mean over back-to-back calls between two events, which a 10 ms window resolves
to well under a percent, and a sample holds the GPU alone for about three times its window (the
sleep is twice the host's enqueue time): at a round's size, seconds of a real model's
measurements (docs/design-notes.md#the-gpu-times-window)."""


def calls_per_gpu_sample(round_calls: int, latency_ms: float | None, launches: float | None) -> int:
    """The calls a GPU-time sample queues behind the sleep: a timing round's (``round_calls``),
    no more than about ``GPU_TIME_WINDOW_MS`` of them where the latency is known, and no more
    than the launch queue holds where the launches per call are (a CUDA-graph replay is one)."""
    n = max(1, round_calls)
    if latency_ms:
        n = min(n, max(1, math.ceil(GPU_TIME_WINDOW_MS / latency_ms)))
    if launches:
        n = max(1, min(n, int(LAUNCH_QUEUE // launches)))
    return n


def gpu_time(
    calls: Mapping[str, Call],
    template: tuple[torch.Tensor, ...],
    *,
    device: str,
    calls_per_sample: Mapping[str, int],
    latency_ms: Mapping[str, float] | None = None,
    launches: Mapping[str, float] | None = None,
    samples: int = 5,
    seed: int = 999,
) -> dict[str, float]:
    """Each callable's GPU time per call (ms, the median of ``samples``) with the host hidden;
    none on the CPU, and none for a callable the host never gets ahead of (one that
    synchronizes with the host, or launches more than the launch queue holds).

    ``latency_ms`` (the timing pass's medians) and ``launches`` (the host's launches per call,
    from the timeline: a CUDA-graph replay is one) size the first attempt: a sleep long enough
    for the host, about ``GPU_TIME_WINDOW_MS`` of calls, and no more than the launch queue
    takes (:func:`calls_per_gpu_sample`). Without them the first samples find the sleep and the
    queue out by missing.
    ``calls_per_sample``: each callable's calls per timing round (RoundSamples.calls)."""
    if device != "cuda":
        return {}
    latency_ms, launches = latency_ms or {}, launches or {}
    out: dict[str, float] = {}
    with torch.no_grad():
        inputs = fresh_inputs(template, seed)
        for name, fn in calls.items():
            n = calls_per_gpu_sample(
                calls_per_sample.get(name, 1), latency_ms.get(name), launches.get(name)
            )
            ms = gpu_time_of(fn, inputs, n, samples, latency_ms.get(name))
            if ms is not None:
                out[name] = ms
    return out


def gpu_time_of(
    fn: Call, inputs: Sequence[torch.Tensor], n: int, samples: int, latency_ms: float | None
) -> float | None:
    """Sleep the GPU, enqueue ``n`` calls between two events, and keep the sample only where
    the start event was still pending when the host had enqueued them all: then no kernel of
    theirs waited on the host. A miss halves ``n`` and sleeps longer (the host's enqueue time
    of the miss, twice, with a floor); one call missing three times gives up."""
    per_call: list[float] = []
    enqueue_ms = latency_ms * n if latency_ms else 5.0
    misses_at_one = 0
    while len(per_call) < samples and misses_at_one < 3:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        sleep_ms = min(2.0 * enqueue_ms + 1.0, 500.0)
        t0 = time.perf_counter()
        torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms()))
        start.record()
        for _ in range(n):
            fn(*inputs)
        end.record()
        enqueued = (time.perf_counter() - t0) * 1000.0
        ahead = not start.query()
        end.synchronize()
        if ahead:
            per_call.append(float(start.elapsed_time(end)) / n)
            enqueue_ms = enqueued
            continue
        enqueue_ms = max(enqueue_ms, enqueued)
        if n == 1:
            misses_at_one += 1
        n = max(1, n // 2)
    if not per_call:
        return None
    return sorted(per_call)[len(per_call) // 2]


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s spin cycles per millisecond on this GPU at its current clock."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # the clock up
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(float(start.elapsed_time(end)), 1e-3)
