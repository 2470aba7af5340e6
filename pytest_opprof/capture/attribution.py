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

import bisect
import gzip
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pytest_opprof.errors import ArtifactError
from pytest_opprof.schema import (
    EdgeCaseFlag,
    KernelRecord,
    OperatorAggregate,
    OperatorRecord,
    Timeline,
    TimelineSummary,
)

log = logging.getLogger(__name__)

ITERATION_MARK = "opprof::iteration"
_MARK = re.compile(rf"^{re.escape(ITERATION_MARK)}#(\d+)$")
_CUSTOM_OP = re.compile(r"^[A-Za-z_]\w*::\w+(?:\.\w+)?$")
"""A dispatcher operator of another namespace than aten (``torch.library.custom_op``), as
Kineto names its ``cpu_op`` event: ``opprof::tuned_mm``."""


def _is_operator(event: _Event) -> bool:
    """An ATen op, or a custom operator's ``cpu_op`` event (not a ``record_function`` of the
    same shape: those are ``user_annotation`` events, the iteration marks among them)."""
    if event.name.startswith("aten::"):
        return True
    return event.cat == "cpu_op" and bool(_CUSTOM_OP.match(event.name))


# torch 2.11, CUDA 13: eager kernels go through cudaLaunchKernel, cuBLAS also through
# cuLaunchKernel and cudaLaunchKernelExC, Inductor's Triton launcher through cuLaunchKernel.
LAUNCH_CALLS = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel"}
    | {"cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel"}
)
GRAPH_LAUNCH_CALLS = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
QUEUED_CALLS = LAUNCH_CALLS | GRAPH_LAUNCH_CALLS
SYNC_CALLS = frozenset(
    {"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
    | {"cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"}
)
SYNC_STALL_US = 50.0
UNATTRIBUTED_LIMIT = 0.05

COMPILED_REGION = "Torch-Compiled Region"  # Dynamo frame, "Torch-Compiled Region: 0/0"
COMPILED_GRAPH = "## Call CompiledFxGraph"  # Inductor graph, "## Call CompiledFxGraph <key> ##"
COMPILED_FUNCTION = "CompiledFunction"  # AOTAutograd's autograd.Function (grad mode)
_REGIONS = (COMPILED_REGION, COMPILED_GRAPH, COMPILED_FUNCTION)
COMPILED_GRAPH_OPERATOR = "CompiledFxGraph"
"""CPU mode: the time of an Inductor graph that holds no kernel event (``cpp_fused_*`` kernels
record none unless ``torch._inductor.config.cpp.enable_kernel_profile`` is set)."""
_INDUCTOR_KERNEL = re.compile(r"^(?:graph_\d+_)?(?:cpp|triton)_\w+$")

# Kineto's categories, lower-cased; the capitalised ones are older Kineto's.
_GPU = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_RUNTIME = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_OPS = frozenset({"cpu_op", "user_annotation", "operator"})

Attribution = Literal["high", "medium", "none"]


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


@dataclass(eq=False, slots=True)
class _Event:
    name: str
    kind: Literal["op", "runtime", "gpu"]
    cat: str
    pid: Any
    tid: Any
    ts: float
    end: float
    args: dict[str, Any]
    parent: _Event | None = None
    mark: _Event | None = None  # the iteration mark above it on its thread
    top_aten: _Event | None = None  # the outermost operator above it (or itself) below the mark
    graph: _Event | None = None  # the "## Call CompiledFxGraph" above it

    @property
    def dur(self) -> float:
        return self.end - self.ts


@dataclass(eq=False, slots=True)
class _Kernel:
    event: _Event
    iteration: int
    attribution: Attribution = "none"
    fused_ops: list[str] = field(default_factory=list)
    launched_at: float | None = None  # a replayed kernel: the host's graph launch (CPU clock)


@dataclass(eq=False, slots=True)
class _Call:
    name: str
    ts: float
    end: float
    order: float  # orders calls that start together (kernels of one CUDA-graph replay)
    cpu_time: float
    shapes: list[Any]
    attribution: Attribution = "high"
    fused_ops: list[str] = field(default_factory=list)
    kernels: list[_Kernel] = field(default_factory=list)


@dataclass(slots=True)
class _Iteration:
    mark: _Event
    # id(event) → call; ("twin", operator, call_index) for replays placed by the twin
    calls: dict[Any, _Call] = field(default_factory=dict)
    unattributed: list[_Kernel] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)  # compiled regions entered, by name

    def count(self, kind: str) -> int:
        return sum(1 for name in self.regions if name.startswith(kind))


def trace_file(folder: Path, stem: str, label: str) -> Path:
    """Where the timeline pass saves the Chrome trace of ``label`` (``eager`` unsuffixed)."""
    suffix = "" if label == "eager" else f".{label}"
    return Path(folder) / f"{stem}{suffix}.trace.json"


def provenance_file(folder: Path, stem: str, labels: Iterable[str]) -> Path:
    """Where the provenance map of one capture of ``labels`` (its timelines) is saved."""
    named = "-".join(label for label in labels if label != "eager") or "eager"
    return Path(folder) / f"{stem}.{named}.provenance.json"


def load_trace(path: Path) -> dict[str, Any]:
    """Read a Chrome trace, ``.json`` or gzip-compressed ``.json.gz``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        data = json.loads(text)
    except (OSError, EOFError, ValueError) as exc:
        raise ArtifactError(
            f"{path}: not a readable Chrome trace ({exc}); re-run the capture stage"
        ) from None
    if isinstance(data, list):  # the bare-array form of the trace event format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ArtifactError(f"{path}: no 'traceEvents' list; it is not a Chrome trace")
    return data


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
    ops, runtime, gpu = _read_events(trace)
    _link_stacks(ops + runtime)
    marks = sorted((e for e in ops if e.mark is e), key=lambda e: e.ts)
    if not marks:
        raise ArtifactError(
            f"the trace has no '{ITERATION_MARK}#<i>' marks; it was not written by the timeline "
            "pass (each measured call runs inside torch.profiler.record_function of that name)"
        )
    iterations = [_Iteration(mark) for mark in marks]
    window = _Window(marks)
    for op in ops:
        _collect_call(op, window, iterations, device_type, provenance)

    kernels: list[_Kernel] = []
    if device_type == "cuda":
        kernels, unjoined = _attribute_kernels(
            gpu, ops, runtime, window, iterations, provenance, twin
        )
    else:
        _add_graph_residuals(ops, window, iterations)

    flags = _structure_flags(iterations)
    operators, unattributed = _merge(iterations)
    summary, summary_flags = _summarise(
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


def _read_events(trace: Mapping[str, Any]) -> tuple[list[_Event], list[_Event], list[_Event]]:
    ops: list[_Event] = []
    runtime: list[_Event] = []
    gpu: list[_Event] = []
    for raw in trace.get("traceEvents", ()):
        if not isinstance(raw, dict) or raw.get("ph") != "X":
            continue
        cat = str(raw.get("cat", "")).lower()
        if cat in _OPS:
            kind: Literal["op", "runtime", "gpu"] = "op"
            bucket = ops
        elif cat in _RUNTIME:
            kind, bucket = "runtime", runtime
        elif cat in _GPU:
            kind, bucket = "gpu", gpu
        else:
            continue  # python_function, gpu_user_annotation, flows, the trace span...
        try:
            ts = float(raw["ts"])
            dur = float(raw.get("dur") or 0.0)
        except (KeyError, TypeError, ValueError):
            continue
        args = raw.get("args")
        if not isinstance(args, dict):
            args = {}
        name = str(raw.get("name", ""))
        bucket.append(_Event(name, kind, cat, raw.get("pid"), raw.get("tid"), ts, ts + dur, args))
    return ops, runtime, gpu


def _link_stacks(events: list[_Event]) -> None:
    """Nest the CPU events of each thread by time: parent, iteration mark, outermost aten op."""
    by_thread: dict[tuple[str, str], list[_Event]] = defaultdict(list)
    for event in events:
        by_thread[(str(event.pid), str(event.tid))].append(event)
    for thread in by_thread.values():
        # Longer first at equal start, ops before the runtime calls they contain.
        thread.sort(key=lambda e: (e.ts, -e.end, e.kind != "op"))
        stack: list[_Event] = []
        for event in thread:
            while stack and stack[-1].end <= event.ts:
                stack.pop()
            parent = stack[-1] if stack else None
            event.parent = parent
            if parent is not None:
                event.mark, event.top_aten, event.graph = parent.mark, parent.top_aten, parent.graph
            if event.kind == "op":
                if _MARK.match(event.name):
                    event.mark, event.top_aten, event.graph = event, None, None
                elif event.top_aten is None and _is_operator(event):
                    event.top_aten = event
                if event.name.startswith(COMPILED_GRAPH):
                    event.graph = event
            stack.append(event)


class _Window:
    """Which iteration a CPU event belongs to: its mark, else (another thread) by time."""

    def __init__(self, marks: list[_Event]) -> None:
        self.marks = marks
        self.index = {id(mark): i for i, mark in enumerate(marks)}
        self.starts = [mark.ts for mark in marks]

    def of(self, event: _Event) -> int | None:
        if event.mark is not None:
            return self.index[id(event.mark)]
        i = bisect.bisect_right(self.starts, event.ts) - 1
        if i >= 0 and event.ts < self.marks[i].end:
            return i
        return None


# ------------------------------------------------------------------------------ attribution


def _collect_call(
    op: _Event,
    window: _Window,
    iterations: list[_Iteration],
    device_type: str,
    provenance: Mapping[str, Sequence[str]],
) -> None:
    """Operators that exist without kernels: outermost aten ops, Inductor CPU kernels, regions."""
    if op.mark is None or op.mark is op:
        return
    iteration = iterations[window.index[id(op.mark)]]
    if op.name.startswith(_REGIONS):
        iteration.regions.append(op.name)
    if op.top_aten is op:
        iteration.calls[id(op)] = _aten_call(op)
    elif device_type == "cpu" and op.top_aten is None and _is_cpu_kernel(op, provenance):
        ops = list(provenance.get(op.name, ()))
        attribution: Attribution = "medium" if ops else "none"
        iteration.calls[id(op)] = _Call(op.name, op.ts, op.end, 0.0, op.dur, [], attribution, ops)


def _is_cpu_kernel(op: _Event, provenance: Mapping[str, Sequence[str]]) -> bool:
    if not (op.name in provenance or _INDUCTOR_KERNEL.match(op.name)):
        return False
    parent = op.parent
    while parent is not None and parent is not op.mark:  # outermost kernel op only
        if parent.name in provenance or _INDUCTOR_KERNEL.match(parent.name):
            return False
        parent = parent.parent
    return True


def _add_graph_residuals(ops: list[_Event], window: _Window, iterations: list[_Iteration]) -> None:
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
            iteration.calls[id(op)] = _Call(
                COMPILED_GRAPH_OPERATOR, op.ts, op.end, 0.0, residual, [], "none"
            )


def _attribute_kernels(
    gpu: list[_Event],
    ops: list[_Event],
    runtime: list[_Event],
    window: _Window,
    iterations: list[_Iteration],
    provenance: Mapping[str, Sequence[str]],
    twin: Twin | None = None,
) -> tuple[list[_Kernel], list[tuple[str, int, int]]]:
    by_correlation: dict[Any, _Event] = {}
    for api in runtime:
        corr = api.args.get("correlation")
        if corr is None:
            continue
        held = by_correlation.get(corr)
        # cuLaunchKernel nested in the cudaLaunchKernel that made it shares its correlation.
        if held is None or (held.cat.endswith("driver") and not api.cat.endswith("driver")):
            by_correlation[corr] = api
    by_external: dict[Any, _Event] = {}
    for op in ops:
        ext = op.args.get("External id")
        if ext:
            by_external.setdefault(ext, op)

    kernels: list[_Kernel] = []
    pending: list[_Kernel] = []  # replays no provenance places, for the twin
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
        kernel = _Kernel(event, index)
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
    pending: list[_Kernel], iterations: list[_Iteration], twin: Twin
) -> list[tuple[str, int, int]]:
    """Place replayed kernels by exact name + ordinal in the twin's iteration; returns the
    names not joined (name, replayed per iteration, in the twin) — each left unattributed."""
    groups: dict[tuple[int, str], list[_Kernel]] = defaultdict(list)
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
                call = _Call(site.operator, at, event.end, event.ts, 0.0, [], "medium")
                call.fused_ops = list(site.fused_ops)
                iteration.calls[owner] = call
            call.ts, call.order = min(call.ts, at), min(call.order, event.ts)
            call.kernels.append(kernel)
    return sorted(unjoined.values())


def _launching_op(
    site: _Event, by_external: Mapping[Any, _Event], stats: Counter[str]
) -> _Event | None:
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


def _enclosing_op(site: _Event) -> _Event | None:
    event: _Event | None = site if site.kind == "op" else site.parent
    while event is not None and event.kind != "op":
        event = event.parent
    return None if event is None or event is event.mark else event


def _provenance_key(
    kernel: _Event, enclosing: _Event | None, provenance: Mapping[str, Sequence[str]]
) -> str | None:
    """Exact names only: the kernel's, then the record function's around its launch."""
    if kernel.name in provenance:
        return kernel.name
    if enclosing is not None and enclosing.name in provenance:
        return enclosing.name
    return None


def _aten_call(op: _Event) -> _Call:
    """A call of ``op``: an ATen op, or the launch of an Inductor kernel (record function or
    runtime call) before it is renamed after the kernel."""
    dims = op.args.get("Input Dims")
    return _Call(op.name, op.ts, op.end, 0.0, op.dur, list(dims) if isinstance(dims, list) else [])


# ------------------------------------------------------------------------------ one iteration


def _ordered(iteration: _Iteration) -> list[tuple[int, _Call]]:
    """The calls of one iteration in launch order, with their per-name ``call_index``."""
    seen: Counter[str] = Counter()
    ordered = []
    for call in sorted(iteration.calls.values(), key=lambda c: (c.ts, c.order, c.name)):
        ordered.append((seen[call.name], call))
        seen[call.name] += 1
    return ordered


def _merge(iterations: list[_Iteration]) -> tuple[list[OperatorRecord], list[KernelRecord]]:
    keyed = [{(c.name, i): c for i, c in _ordered(it)} for it in iterations]
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
                cpu_time_us=_round(sum(c.cpu_time for c in same) / len(same)),
                gpu_time_us=_round(sum(k.duration_us for k in kernels)),
                input_shapes=first.shapes,
                kernels=kernels,
                fused_ops=first.fused_ops,
            )
        )
    # Unattributed activities: by (name, ordinal of that name) in each iteration, none dropped.
    by_key: dict[tuple[str, int], list[_Kernel]] = {}
    for iteration in iterations:
        seen: Counter[str] = Counter()
        for kernel in sorted(iteration.unattributed, key=lambda k: k.event.ts):
            by_key.setdefault((kernel.event.name, seen[kernel.event.name]), []).append(kernel)
            seen[kernel.event.name] += 1
    unattributed = [_kernel_record(group, starts) for group in by_key.values()]
    return operators, unattributed


def _merge_kernels(per_call: list[list[_Kernel]], starts: list[float]) -> list[KernelRecord]:
    """Kernel ordinal j of the same operator in every iteration → one record, mean duration."""
    count = len(per_call[0]) if per_call else 0
    return [_kernel_record([c[j] for c in per_call if len(c) > j], starts) for j in range(count)]


def _kernel_record(same: list[_Kernel], starts: list[float]) -> KernelRecord:
    """One activity of one iteration, its duration the mean over ``same``."""
    first = same[0]
    args = first.event.args
    return KernelRecord(
        name=first.event.name,
        duration_us=_round(sum(k.event.dur for k in same) / len(same)),
        start_us=_round(first.event.ts - starts[first.iteration]),
        grid=_dims(args.get("grid")),
        block=_dims(args.get("block")),
        stream=_int(args.get("stream")),
        device=_int(args.get("device")),
        correlation=_int(args.get("correlation")),
        shared_memory=_int(args.get("shared memory")),
        attribution=first.attribution,
        fused_ops=first.fused_ops,
    )


# ------------------------------------------------------------------------------ summary, flags


def _summarise(
    iterations: list[_Iteration],
    kernels: list[_Kernel],
    runtime: list[_Event],
    window: _Window,
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
        device_time_per_iter_us=_round(total / n),
        wall_time_per_iter_us=_round(sum(it.mark.dur for it in iterations) / n),
        idle_time_per_iter_us=_round(idle),
        kernels_per_iter=round(len(kernels) / n, 3),
        launch_overhead_per_call_us=_round(sum(launches) / len(launches)) if launches else None,
        launches_per_iter=round(len(issued) / n, 3) if device_type == "cuda" else None,
        attributed_share=_share(total - sum(lost.values()), total),
        high_share=_share(high, total),
        busy_time_per_iter_us=_round(busy) if device_type == "cuda" else None,
    )
    flags = (
        _gpu_flags(kernels, runtime, window, n, total, with_twin) if device_type == "cuda" else []
    )
    if total and sum(lost.values()) / total > UNATTRIBUTED_LIMIT:
        what = "kernel time" if device_type == "cuda" else "operator time"
        flags.append(_unattributed_flag(what, lost, total, n))
    return summary, flags


def _gpu_flags(
    kernels: list[_Kernel],
    runtime: list[_Event],
    window: _Window,
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
            f"({_share(overlap, total):.1%} of kernel time); operator GPU times overlap"
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
            f"kernels ({_share(time, total):.1%} of kernel time) that have no launch of their "
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


def _structure_flags(iterations: list[_Iteration]) -> list[EdgeCaseFlag]:
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
    first = [(c.name, c.shapes) for _, c in _ordered(iterations[0])]
    for number, iteration in enumerate(iterations[1:], start=2):
        other = [(c.name, c.shapes) for _, c in _ordered(iteration)]
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


def _multi_stream_overlap(kernels: list[_Kernel]) -> float:
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


def _gpu_idle(kernels: list[_Kernel], iteration: int) -> float:
    spans = sorted((k.event.ts, k.event.end) for k in kernels if k.iteration == iteration)
    return _gaps(spans)


def _gpu_busy(kernels: list[_Kernel], iteration: int) -> float:
    spans = sorted((k.event.ts, k.event.end) for k in kernels if k.iteration == iteration)
    return sum(e - s for s, e in _union(spans))


def _cpu_idle(iteration: _Iteration) -> float:
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
                cpu_time_us=_round(cpu),
                gpu_time_us=_round(gpu),
                share=_share(gpu if device_type == "cuda" else cpu, device_time),
                kernel_count=sum(len(r.kernels) for r in records),
                kernel_names=kernel_names,
            )
        )
    aggregated.sort(key=lambda a: (-a.gpu_time_us, -a.cpu_time_us, a.name))
    return aggregated


def _share(part: float, total: float) -> float:
    return round(min(1.0, part / total), 6) if total > 0 else 0.0


def _round(value: float) -> float:
    return round(value, 3)


def _dims(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
