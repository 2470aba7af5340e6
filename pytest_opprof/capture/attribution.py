"""Attribution: the Chrome trace of the timeline pass → the schema's ``Timeline``. Pure Python.

The trace holds the measured iterations only, each inside a CPU-side mark
``opprof::iteration#<i>``. A GPU activity (kernel, memcpy, memset) belongs to the window when the
runtime call that launched it (matched by ``correlation``) lies inside a mark; anything else is
counted in a debug figure and left out. Each activity in the window is then:

- ``high``: its launch lies, on the launching thread, inside an ``aten::`` op (or a custom
  operator's ``namespace::name`` op, such as ``opprof::tuned_mm``); the operator is the
  outermost such op below the mark (``aten::linear``, whose kernel ``aten::addmm`` launched).
  Kineto's ``External id`` on the launch names the innermost op it saw; where time containment
  finds no op, that link is used instead.
- ``medium``: no ATen op encloses the launch (Inductor's wrapper launched it) and its exact name,
  or the exact name of the record function around the launch (Inductor's Triton launcher opens
  one named after the kernel), is a key of the provenance map; the operator is named after the
  kernel and lists the fused ATen ops. Kernels replayed by a CUDA graph have no launch of their
  own: Triton's are placed by this rule; the others (cuBLAS, cuDNN) by the *twin*, a timeline of
  the same compiled code run without the graph: the k-th replayed kernel of a name in an
  iteration is the k-th kernel of that name in the twin's iteration, and takes the operator
  that launched it there (``medium``). A name whose count differs between the two is not joined
  but flagged, never shifted.
- otherwise ``unattributed_kernels``, with its time.

The operator records describe one iteration: per-name ``call_index`` within the iteration, times
averaged over the iterations, the first iteration's structure kept when iterations disagree.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pytest_opprof.capture.timeline_summary import structure_flags, summarise
from pytest_opprof.capture.trace import (
    COMPILED_GRAPH_OPERATOR,
    GRAPH_LAUNCH_CALLS,
    INDUCTOR_KERNEL,
    ITERATION_MARK,
    REGIONS,
    Attribution,
    Iteration,
    OperatorCall,
    TraceEvent,
    TraceKernel,
    Window,
    as_int,
    dims,
    link_stacks,
    ordered_calls,
    read_events,
    round_us,
    share,
)
from pytest_opprof.errors import ArtifactError
from pytest_opprof.schema import (
    EdgeCaseFlag,
    KernelRecord,
    OperatorAggregate,
    OperatorRecord,
    Timeline,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TwinSite:
    """Where the uncaptured twin launched one kernel: its operator (or, for a Triton kernel of
    Inductor, the kernel itself) and the ATen ops it computes."""

    operator: str
    call_index: int
    fused_ops: tuple[str, ...]


Twin = Mapping[str, Sequence[TwinSite | None]]
"""``twin_key`` of a kernel name → its occurrences in one iteration of the twin, in launch order
(None where the twin could not place it either)."""


# A memset or memcpy recorded into a CUDA graph may replay as a kernel of the driver's own
# (CUDA 13: "memset32", "memcpy128", "memcpy32_post"), where the uncaptured run shows
# "Memset (Device)" / "Memcpy DtoD (Device -> Device)": they are joined as one class.
_GRAPH_COPY = re.compile(r"^(?:(memset)\d+\w*|(memcpy)\d+\w*|(Memset) .*|(Memcpy) .*)$")


def twin_key(name: str) -> str:
    """The name a kernel is joined to the twin by: itself, or its memset/memcpy class."""
    m = _GRAPH_COPY.match(name)
    return next(g for g in m.groups() if g).lower() if m else name


def replay_twin(twin: Timeline) -> dict[str, list[TwinSite | None]]:
    """The ``Twin`` of an attributed timeline of the uncaptured code."""
    seen: list[tuple[float, str, TwinSite | None]] = []
    for op in twin.operators:
        fused = tuple(op.fused_ops) or (op.name,)
        for k in op.kernels:
            seen.append((k.start_us, k.name, TwinSite(op.name, op.call_index, fused)))
    seen += [(k.start_us, k.name, None) for k in twin.unattributed_kernels]
    out: dict[str, list[TwinSite | None]] = defaultdict(list)
    for _, name, site in sorted(seen, key=lambda item: item[0]):
        out[twin_key(name)].append(site)
    return dict(out)


def build_timeline(
    trace: Mapping[str, Any],
    *,
    label: str,
    compile_mode: str,
    device_type: Literal["cuda", "cpu"],
    provenance: Mapping[str, Sequence[str]] | None = None,
    trace_file: str | None = None,
    twin: Twin | None = None,
) -> tuple[Timeline, list[EdgeCaseFlag]]:
    """Attribute every GPU activity of the measured window (or, on the CPU, every operator).
    ``twin``: see ``replay_twin``; it places CUDA-graph replays that provenance cannot."""
    provenance = provenance or {}
    ops, runtime, gpu = read_events(trace)
    link_stacks(ops + runtime)
    marks = sorted((e for e in ops if e.mark is e), key=lambda e: e.ts)
    if not marks:
        raise ArtifactError(
            f"the trace has no '{ITERATION_MARK}#<i>' marks; it was not written by the timeline "
            "pass (each measured call runs inside torch.profiler.record_function of that name)"
        )
    iterations = [Iteration(mark) for mark in marks]
    window = Window(marks)
    for op in ops:
        _collect_call(op, window, iterations, device_type, provenance)

    kernels: list[TraceKernel] = []
    if device_type == "cuda":
        kernels, unjoined = _attribute_kernels(
            gpu, ops, runtime, window, iterations, provenance, twin
        )
    else:
        _add_graph_residuals(ops, window, iterations)

    flags = structure_flags(iterations)
    operators, unattributed = _merge(iterations)
    summary, summary_flags = summarise(
        iterations, kernels, runtime, window, device_type, twin is not None
    )
    if device_type == "cuda" and unjoined:
        names = ", ".join(
            f"{name} ({got} replayed, {want} in the twin)" for name, got, want in unjoined
        )
        log.warning("CUDA-graph replays not joined to the uncaptured twin: %s", names)
        summary_flags = [
            f.model_copy(
                update={
                    "detail": f"{f.detail}; not joined to the twin (counts differ, so left "
                    f"unattributed rather than shifted): {names}"
                }
            )
            if f.name == "cuda_graph_replay"
            else f
            for f in summary_flags
        ]
    flags += summary_flags
    aggregated = _aggregate(operators, summary.device_time_per_iter_us, device_type)
    timeline = Timeline(
        label=label,
        compile_mode=compile_mode,
        summary=summary,
        operators=operators,
        aggregated=aggregated,
        unattributed_kernels=unattributed if device_type == "cuda" else [],
        trace_file=trace_file,
    )
    return timeline, flags


# ------------------------------------------------------------------------------ reading


# ------------------------------------------------------------------------------ attribution


def _collect_call(
    op: TraceEvent,
    window: Window,
    iterations: list[Iteration],
    device_type: str,
    provenance: Mapping[str, Sequence[str]],
) -> None:
    """Operators that exist without kernels: outermost aten ops, Inductor CPU kernels, regions."""
    if op.mark is None or op.mark is op:
        return
    iteration = iterations[window.index[id(op.mark)]]
    if op.name.startswith(REGIONS):
        iteration.regions.append(op.name)
    if op.top_aten is op:
        iteration.calls[id(op)] = _aten_call(op)
    elif device_type == "cpu" and op.top_aten is None and _is_cpu_kernel(op, provenance):
        ops = list(provenance.get(op.name, ()))
        attribution: Attribution = "medium" if ops else "none"
        iteration.calls[id(op)] = OperatorCall(
            op.name, op.ts, op.end, 0.0, op.dur, [], attribution, ops
        )


def _is_cpu_kernel(op: TraceEvent, provenance: Mapping[str, Sequence[str]]) -> bool:
    if not (op.name in provenance or INDUCTOR_KERNEL.match(op.name)):
        return False
    parent = op.parent
    while parent is not None and parent is not op.mark:  # outermost kernel op only
        if parent.name in provenance or INDUCTOR_KERNEL.match(parent.name):
            return False
        parent = parent.parent
    return True


def _add_graph_residuals(
    ops: list[TraceEvent], window: Window, iterations: list[Iteration]
) -> None:
    """CPU mode: an Inductor graph with no kernel events ran its C++ kernels unseen; its time
    not spent in the ATen ops it called becomes one unattributed operator."""
    inside: dict[int, float] = defaultdict(float)
    has_kernels: set[int] = set()
    for op in ops:
        if op.graph is None or op.graph is op or op.mark is None:
            continue
        call = iterations[window.index[id(op.mark)]].calls.get(id(op))
        if call is not None:
            inside[id(op.graph)] += op.dur
            if call.attribution != "high":
                has_kernels.add(id(op.graph))
    for op in ops:
        if op.graph is not op or op.mark is None or id(op) in has_kernels:
            continue
        residual = op.dur - inside[id(op)]
        if residual > 0:
            iteration = iterations[window.index[id(op.mark)]]
            iteration.calls[id(op)] = OperatorCall(
                COMPILED_GRAPH_OPERATOR, op.ts, op.end, 0.0, residual, [], "none"
            )


def _attribute_kernels(
    gpu: list[TraceEvent],
    ops: list[TraceEvent],
    runtime: list[TraceEvent],
    window: Window,
    iterations: list[Iteration],
    provenance: Mapping[str, Sequence[str]],
    twin: Twin | None = None,
) -> tuple[list[TraceKernel], list[tuple[str, int, int]]]:
    by_correlation: dict[Any, TraceEvent] = {}
    for api in runtime:
        corr = api.args.get("correlation")
        if corr is None:
            continue
        held = by_correlation.get(corr)
        # cuLaunchKernel nested in the cudaLaunchKernel that made it shares its correlation.
        if held is None or (held.cat.endswith("driver") and not api.cat.endswith("driver")):
            by_correlation[corr] = api
    by_external: dict[Any, TraceEvent] = {}
    for op in ops:
        ext = op.args.get("External id")
        if ext:
            by_external.setdefault(ext, op)

    kernels: list[TraceKernel] = []
    pending: list[TraceKernel] = []  # replays no provenance places, for the twin
    skipped = Counter[str]()
    for event in sorted(gpu, key=lambda e: e.ts):
        launch = by_correlation.get(event.args.get("correlation"))
        site = launch if launch is not None else by_external.get(event.args.get("External id"))
        if site is None:
            skipped["no launch record"] += 1
            continue
        index = window.of(site)
        if index is None:
            skipped["launched outside the measured window"] += 1
            continue
        kernel = TraceKernel(event, index)
        kernels.append(kernel)
        iteration = iterations[index]
        replayed = launch is not None and launch.name in GRAPH_LAUNCH_CALLS
        operator = None if replayed else _launching_op(site, by_external, skipped)
        if operator is not None:
            kernel.attribution = "high"
            call = iteration.calls.get(id(operator))
            if call is None:  # an aten op of another thread, inside the window by time
                call = iteration.calls[id(operator)] = _aten_call(operator)
            call.kernels.append(kernel)
            continue
        enclosing = None if replayed else _enclosing_op(site)
        key = _provenance_key(event, enclosing, provenance)
        if key is None:
            kernel.launched_at = site.ts
            (pending if replayed and twin is not None else iteration.unattributed).append(kernel)
            continue
        kernel.attribution = "medium"
        kernel.fused_ops = list(provenance[key])
        # One call per launch: the record function Inductor's launcher opened, else the launch
        # itself; a replayed kernel is its own call, with no CPU time of its own.
        owner = site
        if replayed:
            owner = event
        elif enclosing is not None and enclosing.name in (key, event.name):
            owner = enclosing
        call = iteration.calls.get(id(owner))
        if call is None:
            call = _aten_call(owner)  # the launcher's record function, else the launch
            call.name, call.ts, call.attribution = key, site.ts, "medium"
            call.fused_ops = list(provenance[key])
            if replayed:
                call.order, call.cpu_time = event.ts, 0.0
            iteration.calls[id(owner)] = call
        call.kernels.append(kernel)
    if skipped:
        log.debug("GPU activities left out of the timeline: %s", dict(skipped))
    unjoined = _join_twin(pending, iterations, twin or {})
    return kernels, unjoined


def _join_twin(
    pending: list[TraceKernel], iterations: list[Iteration], twin: Twin
) -> list[tuple[str, int, int]]:
    """Place replayed kernels by exact name + ordinal in the twin's iteration; returns the
    names not joined (name, replayed per iteration, in the twin) — each left unattributed."""
    groups: dict[tuple[int, str], list[TraceKernel]] = defaultdict(list)
    for kernel in pending:  # already in time order
        groups[(kernel.iteration, twin_key(kernel.event.name))].append(kernel)
    unjoined: dict[str, tuple[str, int, int]] = {}
    for (index, name), same in groups.items():
        iteration = iterations[index]
        sites = list(twin.get(name, ()))
        if len(sites) != len(same):
            unjoined[name] = (name, len(same), len(sites))
            iteration.unattributed.extend(same)
            continue
        for kernel, site in zip(same, sites, strict=True):
            if site is None:
                iteration.unattributed.append(kernel)
                continue
            kernel.attribution = "medium"
            kernel.fused_ops = list(site.fused_ops)
            owner = ("twin", site.operator, site.call_index)
            call = iteration.calls.get(owner)
            # Ordered among the iteration's calls as the provenance-placed replays are: at the
            # graph launch on the host's clock, then by the kernel's start on the GPU's. A GPU
            # time as ``ts`` would sort against host ops by how far the GPU lags the host.
            event, launched = kernel.event, kernel.launched_at
            at = event.ts if launched is None else launched
            if call is None:
                call = OperatorCall(site.operator, at, event.end, event.ts, 0.0, [], "medium")
                call.fused_ops = list(site.fused_ops)
                iteration.calls[owner] = call
            call.ts, call.order = min(call.ts, at), min(call.order, event.ts)
            call.kernels.append(kernel)
    return sorted(unjoined.values())


def _launching_op(
    site: TraceEvent, by_external: Mapping[Any, TraceEvent], stats: Counter[str]
) -> TraceEvent | None:
    """The outermost aten op around a launch: by time containment, else by ``External id``."""
    linked = by_external.get(site.args.get("External id")) if site.kind == "runtime" else None
    if site.top_aten is not None:
        if linked is not None and linked.top_aten not in (None, site.top_aten):
            stats["External id disagrees with time containment"] += 1
        return site.top_aten
    if linked is not None and linked.top_aten is not None:
        stats["placed by External id"] += 1
        return linked.top_aten
    return None


def _enclosing_op(site: TraceEvent) -> TraceEvent | None:
    event: TraceEvent | None = site if site.kind == "op" else site.parent
    while event is not None and event.kind != "op":
        event = event.parent
    return None if event is None or event is event.mark else event


def _provenance_key(
    kernel: TraceEvent, enclosing: TraceEvent | None, provenance: Mapping[str, Sequence[str]]
) -> str | None:
    """Exact names only: the kernel's, then the record function's around its launch."""
    if kernel.name in provenance:
        return kernel.name
    if enclosing is not None and enclosing.name in provenance:
        return enclosing.name
    return None


def _aten_call(op: TraceEvent) -> OperatorCall:
    """A call of ``op``: an ATen op, or the launch of an Inductor kernel (record function or
    runtime call) before it is renamed after the kernel."""
    dims = op.args.get("Input Dims")
    return OperatorCall(
        op.name, op.ts, op.end, 0.0, op.dur, list(dims) if isinstance(dims, list) else []
    )


# ------------------------------------------------------------------------------ one iteration


def _merge(iterations: list[Iteration]) -> tuple[list[OperatorRecord], list[KernelRecord]]:
    keyed = [{(c.name, i): c for i, c in ordered_calls(it)} for it in iterations]
    starts = [it.mark.ts for it in iterations]
    operators = []
    for (name, call_index), first in keyed[0].items():
        same = [calls[(name, call_index)] for calls in keyed if (name, call_index) in calls]
        kernels = _merge_kernels(
            [sorted(c.kernels, key=lambda k: k.event.ts) for c in same], starts
        )
        operators.append(
            OperatorRecord(
                name=name,
                call_index=call_index,
                cpu_time_us=round_us(sum(c.cpu_time for c in same) / len(same)),
                gpu_time_us=round_us(sum(k.duration_us for k in kernels)),
                input_shapes=first.shapes,
                kernels=kernels,
                fused_ops=first.fused_ops,
            )
        )
    # Unattributed activities: by (name, ordinal of that name) in each iteration, none dropped.
    by_key: dict[tuple[str, int], list[TraceKernel]] = {}
    for iteration in iterations:
        seen: Counter[str] = Counter()
        for kernel in sorted(iteration.unattributed, key=lambda k: k.event.ts):
            by_key.setdefault((kernel.event.name, seen[kernel.event.name]), []).append(kernel)
            seen[kernel.event.name] += 1
    unattributed = [_kernel_record(group, starts) for group in by_key.values()]
    return operators, unattributed


def _merge_kernels(per_call: list[list[TraceKernel]], starts: list[float]) -> list[KernelRecord]:
    """Kernel ordinal j of the same operator in every iteration → one record, mean duration."""
    count = len(per_call[0]) if per_call else 0
    return [_kernel_record([c[j] for c in per_call if len(c) > j], starts) for j in range(count)]


def _kernel_record(same: list[TraceKernel], starts: list[float]) -> KernelRecord:
    """One activity of one iteration, its duration the mean over ``same``."""
    first = same[0]
    args = first.event.args
    return KernelRecord(
        name=first.event.name,
        duration_us=round_us(sum(k.event.dur for k in same) / len(same)),
        start_us=round_us(first.event.ts - starts[first.iteration]),
        grid=dims(args.get("grid")),
        block=dims(args.get("block")),
        stream=as_int(args.get("stream")),
        device=as_int(args.get("device")),
        correlation=as_int(args.get("correlation")),
        shared_memory=as_int(args.get("shared memory")),
        attribution=first.attribution,
        fused_ops=first.fused_ops,
    )


# ------------------------------------------------------------------------------ summary, flags


def _aggregate(
    operators: list[OperatorRecord], device_time: float, device_type: str
) -> list[OperatorAggregate]:
    groups: dict[str, list[OperatorRecord]] = defaultdict(list)
    for record in operators:
        groups[record.name].append(record)
    aggregated = []
    for name, records in groups.items():
        gpu = sum(r.gpu_time_us for r in records)
        cpu = sum(r.cpu_time_us for r in records)
        kernel_names = list(dict.fromkeys(k.name for r in records for k in r.kernels))
        aggregated.append(
            OperatorAggregate(
                name=name,
                calls=len(records),
                cpu_time_us=round_us(cpu),
                gpu_time_us=round_us(gpu),
                share=share(gpu if device_type == "cuda" else cpu, device_time),
                kernel_count=sum(len(r.kernels) for r in records),
                kernel_names=kernel_names,
            )
        )
    aggregated.sort(key=lambda a: (-a.gpu_time_us, -a.cpu_time_us, a.name))
    return aggregated
