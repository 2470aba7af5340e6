"""A timeline's summary per iteration (device time, idle time, launches, the attributed share)
and the edge-case flags that lower a proposal's confidence (unattributed time, host sync
stalls, multi-stream overlap, iterations that differ). Pure Python, no torch."""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from pytest_opprof.capture.trace import (
    COMPILED_FUNCTION,
    COMPILED_GRAPH,
    COMPILED_GRAPH_OPERATOR,
    COMPILED_REGION,
    GRAPH_LAUNCH_CALLS,
    LAUNCH_CALLS,
    QUEUED_CALLS,
    SYNC_CALLS,
    Iteration,
    TraceEvent,
    TraceKernel,
    Window,
    ordered_calls,
    round_us,
    share,
)
from pytest_opprof.schema import (
    EdgeCaseFlag,
    TimelineSummary,
)

log = logging.getLogger(__name__)

ITERATION_MARK = "opprof::iteration"
_MARK = re.compile(rf"^{re.escape(ITERATION_MARK)}#(\d+)$")
_CUSTOM_OP = re.compile(r"^[A-Za-z_]\w*::\w+(?:\.\w+)?$")
"""A dispatcher operator of another namespace than aten (``torch.library.custom_op``), as
Kineto names its ``cpu_op`` event: ``opprof::tuned_mm``."""


SYNC_STALL_US = 50.0

UNATTRIBUTED_LIMIT = 0.05


def summarise(
    iterations: list[Iteration],
    kernels: list[TraceKernel],
    runtime: list[TraceEvent],
    window: Window,
    device_type: str,
    with_twin: bool = False,
) -> tuple[TimelineSummary, list[EdgeCaseFlag]]:
    """GPU mode sums kernel time; CPU mode sums the time of the operators themselves."""
    n = len(iterations)
    if device_type == "cpu":
        items = [
            (c.cpu_time, c.attribution, c.name) for it in iterations for c in it.calls.values()
        ]
        idle = sum(_cpu_idle(it) for it in iterations) / n
        busy = 0.0
    else:
        items = [(k.event.dur, k.attribution, k.event.name) for k in kernels]
        idle = sum(_gpu_idle(kernels, i) for i in range(n)) / n
        busy = sum(_gpu_busy(kernels, i) for i in range(n)) / n
    total = sum(time for time, _, _ in items)
    high = sum(time for time, attribution, _ in items if attribution == "high")
    lost: dict[str, float] = defaultdict(float)
    for time, attribution, name in items:
        if attribution == "none":
            lost[name] += time
    issued = [  # what the stream's launch queue holds: a CUDA-graph replay is one
        e
        for e in runtime
        if e.name in QUEUED_CALLS
        and window.of(e) is not None
        and not (e.parent is not None and e.parent.name in QUEUED_CALLS)
    ]
    launches = [e.dur for e in issued if e.name in LAUNCH_CALLS]
    summary = TimelineSummary(
        iterations=n,
        device_time_per_iter_us=round_us(total / n),
        wall_time_per_iter_us=round_us(sum(it.mark.dur for it in iterations) / n),
        idle_time_per_iter_us=round_us(idle),
        kernels_per_iter=round(len(kernels) / n, 3),
        launch_overhead_per_call_us=round_us(sum(launches) / len(launches)) if launches else None,
        launches_per_iter=round(len(issued) / n, 3) if device_type == "cuda" else None,
        attributed_share=share(total - sum(lost.values()), total),
        high_share=share(high, total),
        busy_time_per_iter_us=round_us(busy) if device_type == "cuda" else None,
    )
    flags = (
        _gpu_flags(kernels, runtime, window, n, total, with_twin) if device_type == "cuda" else []
    )
    if total and sum(lost.values()) / total > UNATTRIBUTED_LIMIT:
        what = "kernel time" if device_type == "cuda" else "operator time"
        flags.append(_unattributed_flag(what, lost, total, n))
    return summary, flags


def _gpu_flags(
    kernels: list[TraceKernel],
    runtime: list[TraceEvent],
    window: Window,
    n: int,
    total: float,
    with_twin: bool = False,
) -> list[EdgeCaseFlag]:
    flags = []
    overlap = _multi_stream_overlap(kernels)
    if overlap > 1e-3:
        streams = len({(k.event.pid, k.event.args.get("stream", k.event.tid)) for k in kernels})
        detail = (
            f"kernels of {streams} streams run at once for {overlap / n:.1f} µs per iteration "
            f"({share(overlap, total):.1%} of kernel time); operator GPU times overlap"
        )
        flags.append(EdgeCaseFlag(name="multi_stream_overlap", detail=detail))
    in_window = [e for e in runtime if window.of(e) is not None]
    stalls = [e for e in in_window if e.name in SYNC_CALLS and e.dur > SYNC_STALL_US]
    if stalls:
        longest = max(stalls, key=lambda e: e.dur)
        stalled = sum(e.dur for e in stalls) / n
        detail = (
            f"{len(stalls) / n:g} host synchronizations over {SYNC_STALL_US:g} µs per iteration, "
            f"{stalled:.1f} µs per iteration; longest {longest.name} {longest.dur:.1f} µs"
        )
        flags.append(EdgeCaseFlag(name="host_sync_stalls", detail=detail))
    replays = [e for e in in_window if e.name in GRAPH_LAUNCH_CALLS]
    if replays:
        correlations = {e.args.get("correlation") for e in replays}
        replayed = [k for k in kernels if k.event.args.get("correlation") in correlations]
        placed = sum(1 for k in replayed if k.attribution == "medium")
        time = sum(k.event.dur for k in replayed)
        detail = (
            f"{len(replays) / n:g} graph launches per iteration replay {len(replayed) / n:g} "
            f"kernels ({share(time, total):.1%} of kernel time) that have no launch of their "
            f"own: {placed / n:g} placed through Inductor provenance"
            + (" or the uncaptured twin" if with_twin else "")
            + f", {(len(replayed) - placed) / n:g} unattributed"
        )
        flags.append(EdgeCaseFlag(name="cuda_graph_replay", detail=detail))
    return flags


def _unattributed_flag(what: str, times: dict[str, float], total: float, n: int) -> EdgeCaseFlag:
    unattributed = sum(times.values())
    largest = sorted(times.items(), key=lambda item: (-item[1], item[0]))[:3]
    top = ", ".join(f"{name} ({t / n:.1f} µs)" for name, t in largest)
    detail = (
        f"{unattributed / total:.1%} of {what} ({unattributed / n:.1f} µs per iteration) is "
        f"tied to no ATen operator; largest: {top}"
    )
    if COMPILED_GRAPH_OPERATOR in times:
        detail += (
            f"; {COMPILED_GRAPH_OPERATOR} is Inductor code whose C++ kernels recorded no event "
            "(set torch._inductor.config.cpp.enable_kernel_profile = True)"
        )
    return EdgeCaseFlag(name="high_unattributed_share", detail=detail)


def structure_flags(iterations: list[Iteration]) -> list[EdgeCaseFlag]:
    """Graph breaks (several compiled regions per iteration) and iterations that differ."""
    flags = []
    # A graph break nests the resumed frame's region in the first one: count them all.
    counts = [
        max(it.count(COMPILED_REGION), it.count(COMPILED_GRAPH)) or it.count(COMPILED_FUNCTION)
        for it in iterations
    ]
    if max(counts) > 1:
        held = iterations[counts.index(max(counts))].regions
        names = ", ".join(n for n in held if not n.startswith(COMPILED_GRAPH)) or ", ".join(held)
        detail = f"{max(counts)} compiled regions per iteration, eager code between them: {names}"
        flags.append(EdgeCaseFlag(name="graph_breaks", detail=detail))
    first = [(c.name, c.shapes) for _, c in ordered_calls(iterations[0])]
    for number, iteration in enumerate(iterations[1:], start=2):
        other = [(c.name, c.shapes) for _, c in ordered_calls(iteration)]
        regions, first_regions = iteration.regions, iterations[0].regions
        if other == first and regions == first_regions:
            continue
        if regions != first_regions:
            what = f"compiled regions {first_regions} then {regions}"
        else:
            pairs = zip(first, other, strict=False)
            at = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(other)))
            what = f"operator {at}: {_describe(first, at)} then {_describe(other, at)}"
        name = "graph_breaks" if counts[number - 1] != counts[0] else "dynamic_shapes"
        detail = f"iterations 1 and {number} differ at {what}; the timeline keeps iteration 1's"
        if flags and flags[0].name == name:  # one flag of each name
            flags[0].detail += f"; {detail}"
        else:
            flags.append(EdgeCaseFlag(name=name, detail=detail))
        break
    return flags


def _describe(calls: list[tuple[str, list[Any]]], position: int) -> str:
    if position >= len(calls):
        return "nothing"
    name, shapes = calls[position]
    return f"{name}{shapes}" if shapes else name


def _multi_stream_overlap(kernels: list[TraceKernel]) -> float:
    """Time during which activities of two or more streams run at once (sweep over edges)."""
    edges = []
    for k in kernels:
        stream = (k.event.pid, k.event.args.get("stream", k.event.tid))
        edges.append((k.event.ts, 1, stream))
        edges.append((k.event.end, -1, stream))
    edges.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    active: Counter[Any] = Counter()
    overlap, previous = 0.0, None
    for time, delta, stream in edges:
        if previous is not None and len(active) >= 2:
            overlap += time - previous
        active[stream] += delta
        if active[stream] == 0:
            del active[stream]
        previous = time
    return overlap


def _gpu_idle(kernels: list[TraceKernel], iteration: int) -> float:
    spans = sorted((k.event.ts, k.event.end) for k in kernels if k.iteration == iteration)
    return _gaps(spans)


def _gpu_busy(kernels: list[TraceKernel], iteration: int) -> float:
    spans = sorted((k.event.ts, k.event.end) for k in kernels if k.iteration == iteration)
    return sum(e - s for s, e in _union(spans))


def _cpu_idle(iteration: Iteration) -> float:
    mark = iteration.mark
    spans = sorted((c.ts, c.end) for c in iteration.calls.values())
    return max(0.0, mark.dur - sum(e - s for s, e in _union(spans)))


def _gaps(spans: list[tuple[float, float]]) -> float:
    if not spans:
        return 0.0
    busy = _union(spans)
    return (busy[-1][1] - busy[0][0]) - sum(e - s for s, e in busy)


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
