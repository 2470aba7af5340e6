"""A torch.profiler Chrome trace as the timeline builder reads it: its events (operators,
kernels, runtime calls) linked into call stacks, the measured iterations their marks bound,
and the names and categories that classify them. Pure Python, no torch."""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pytest_opprof.errors import ArtifactError

log = logging.getLogger(__name__)

ITERATION_MARK = "opprof::iteration"
_MARK = re.compile(rf"^{re.escape(ITERATION_MARK)}#(\d+)$")
_CUSTOM_OP = re.compile(r"^[A-Za-z_]\w*::\w+(?:\.\w+)?$")
"""A dispatcher operator of another namespace than aten (``torch.library.custom_op``), as
Kineto names its ``cpu_op`` event: ``opprof::tuned_mm``."""


ITERATION_MARK = "opprof::iteration"

ITERATION_PATTERN = re.compile(rf"^{re.escape(ITERATION_MARK)}#(\d+)$")

CUSTOM_OP = re.compile(r"^[A-Za-z_]\w*::\w+(?:\.\w+)?$")
"""A dispatcher operator of another namespace than aten (``torch.library.custom_op``), as
Kineto names its ``cpu_op`` event: ``opprof::tuned_mm``."""


def is_operator(event: TraceEvent) -> bool:
    """An ATen op, or a custom operator's ``cpu_op`` event (not a ``record_function`` of the
    same shape: those are ``user_annotation`` events, the iteration marks among them)."""
    if event.name.startswith("aten::"):
        return True
    return event.cat == "cpu_op" and bool(CUSTOM_OP.match(event.name))


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

COMPILED_REGION = "Torch-Compiled Region"  # Dynamo frame, "Torch-Compiled Region: 0/0"

COMPILED_GRAPH = "## Call CompiledFxGraph"  # Inductor graph, "## Call CompiledFxGraph <key> ##"

COMPILED_FUNCTION = "CompiledFunction"  # AOTAutograd's autograd.Function (grad mode)

REGIONS = (COMPILED_REGION, COMPILED_GRAPH, COMPILED_FUNCTION)

COMPILED_GRAPH_OPERATOR = "CompiledFxGraph"
"""CPU mode: the time of an Inductor graph that holds no kernel event (``cpp_fused_*`` kernels
record none unless ``torch._inductor.config.cpp.enable_kernel_profile`` is set)."""

INDUCTOR_KERNEL = re.compile(r"^(?:graph_\d+_)?(?:cpp|triton)_\w+$")

# Kineto's categories, lower-cased; the capitalised ones are older Kineto's.
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})

RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})

OPERATOR_CATEGORIES = frozenset({"cpu_op", "user_annotation", "operator"})

Attribution = Literal["high", "medium", "none"]


@dataclass(eq=False, slots=True)
class TraceEvent:
    name: str
    kind: Literal["op", "runtime", "gpu"]
    cat: str
    pid: Any
    tid: Any
    ts: float
    end: float
    args: dict[str, Any]
    parent: TraceEvent | None = None
    mark: TraceEvent | None = None  # the iteration mark above it on its thread
    top_aten: TraceEvent | None = None  # the outermost operator above it (or itself) below the mark
    graph: TraceEvent | None = None  # the "## Call CompiledFxGraph" above it

    @property
    def dur(self) -> float:
        return self.end - self.ts


@dataclass(eq=False, slots=True)
class TraceKernel:
    event: TraceEvent
    iteration: int
    attribution: Attribution = "none"
    fused_ops: list[str] = field(default_factory=list)
    launched_at: float | None = None  # a replayed kernel: the host's graph launch (CPU clock)


@dataclass(eq=False, slots=True)
class OperatorCall:
    name: str
    ts: float
    end: float
    order: float  # orders calls that start together (kernels of one CUDA-graph replay)
    cpu_time: float
    shapes: list[Any]
    attribution: Attribution = "high"
    fused_ops: list[str] = field(default_factory=list)
    kernels: list[TraceKernel] = field(default_factory=list)


@dataclass(slots=True)
class Iteration:
    mark: TraceEvent
    # id(event) → call; ("twin", operator, call_index) for replays placed by the twin
    calls: dict[Any, OperatorCall] = field(default_factory=dict)
    unattributed: list[TraceKernel] = field(default_factory=list)
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


def read_events(
    trace: Mapping[str, Any],
) -> tuple[list[TraceEvent], list[TraceEvent], list[TraceEvent]]:
    ops: list[TraceEvent] = []
    runtime: list[TraceEvent] = []
    gpu: list[TraceEvent] = []
    for raw in trace.get("traceEvents", ()):
        if not isinstance(raw, dict) or raw.get("ph") != "X":
            continue
        cat = str(raw.get("cat", "")).lower()
        if cat in OPERATOR_CATEGORIES:
            kind: Literal["op", "runtime", "gpu"] = "op"
            bucket = ops
        elif cat in RUNTIME_CATEGORIES:
            kind, bucket = "runtime", runtime
        elif cat in GPU_CATEGORIES:
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
        bucket.append(
            TraceEvent(name, kind, cat, raw.get("pid"), raw.get("tid"), ts, ts + dur, args)
        )
    return ops, runtime, gpu


def link_stacks(events: list[TraceEvent]) -> None:
    """Nest the CPU events of each thread by time: parent, iteration mark, outermost aten op."""
    by_thread: dict[tuple[str, str], list[TraceEvent]] = defaultdict(list)
    for event in events:
        by_thread[(str(event.pid), str(event.tid))].append(event)
    for thread in by_thread.values():
        # Longer first at equal start, ops before the runtime calls they contain.
        thread.sort(key=lambda e: (e.ts, -e.end, e.kind != "op"))
        stack: list[TraceEvent] = []
        for event in thread:
            while stack and stack[-1].end <= event.ts:
                stack.pop()
            parent = stack[-1] if stack else None
            event.parent = parent
            if parent is not None:
                event.mark, event.top_aten, event.graph = parent.mark, parent.top_aten, parent.graph
            if event.kind == "op":
                if ITERATION_PATTERN.match(event.name):
                    event.mark, event.top_aten, event.graph = event, None, None
                elif event.top_aten is None and is_operator(event):
                    event.top_aten = event
                if event.name.startswith(COMPILED_GRAPH):
                    event.graph = event
            stack.append(event)


class Window:
    """Which iteration a CPU event belongs to: its mark, else (another thread) by time."""

    def __init__(self, marks: list[TraceEvent]) -> None:
        self.marks = marks
        self.index = {id(mark): i for i, mark in enumerate(marks)}
        self.starts = [mark.ts for mark in marks]

    def of(self, event: TraceEvent) -> int | None:
        if event.mark is not None:
            return self.index[id(event.mark)]
        i = bisect.bisect_right(self.starts, event.ts) - 1
        if i >= 0 and event.ts < self.marks[i].end:
            return i
        return None


def share(part: float, total: float) -> float:
    return round(min(1.0, part / total), 6) if total > 0 else 0.0


def round_us(value: float) -> float:
    return round(value, 3)


def dims(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return value
    return None


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ordered_calls(iteration: Iteration) -> list[tuple[int, OperatorCall]]:
    """The calls of one iteration in launch order, with their per-name ``call_index``."""
    seen: Counter[str] = Counter()
    ordered = []
    for call in sorted(iteration.calls.values(), key=lambda c: (c.ts, c.order, c.name)):
        ordered.append((seen[call.name], call))
        seen[call.name] += 1
    return ordered
