"""``opprof::tuned_mm``: a GEMM run with the cuBLASLt algorithm measured fastest for its shape.

torch runs the first algorithm cuBLAS(Lt)'s heuristic names for a shape; nothing in torch
lists the others (TunableOp enumerates candidates on ROCm only). The first is not always the
fastest: a large bf16 GEMM can run markedly faster under another of the heuristic's candidates
(docs/design-notes.md#cublaslts-algorithms).

This module calls the libcublasLt that torch itself loaded, through ctypes. The first call of a
shape (outside CUDA graph capture) asks the heuristic for up to ``CANDIDATES`` algorithms, times
each beside torch's own call on the real operands in the two ways the op runs, back to back and
replayed from a CUDA graph behind a kernel that writes its input, and keeps the fastest that
beats torch's by ``MIN_GAIN`` in both (:func:`keep`); later calls of that shape, captured or
not, run the kept one. The timing holds the GPU alone (``devicelock.measuring_within``):
beside another process's GPU work it kept slower candidates
(docs/design-notes.md#tuning-with-the-gpu-alone). Anywhere this cannot run (no CUDA, no
libcublasLt, an unaligned or strided operand, the first call of a shape made inside a capture)
the op runs ``torch.mm`` as torch would. Every algorithm computes the same sums in fp32; the
order of the K-reduction may differ (split-K), well inside a bf16 tolerance.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_opprof import devicelock

LOGGER = logging.getLogger("pytest_opprof.passes")
OP_NAME = "opprof::tuned_mm"

CANDIDATES = 16
"""How many algorithms the heuristic is asked for: more than it returned for the logits GEMM
(docs/design-notes.md#cublaslts-algorithms)."""
MIN_GAIN = 1.05
"""A candidate replaces torch's own call only when this much faster at the median, both ways.
Each process tunes for itself, and a close race is decided differently from one process to the
next, so the processes timing one backend would run different GEMMs; and a candidate a few
percent faster here can cost the model more than it saves (a workspace memset that leaves the
GPU idle in its CUDA graph), which neither timing here shows. The GEMMs this op is for win by
far more (docs/design-notes.md#the-5-bar)."""
WORKSPACE_BYTES = 32 * 1024 * 1024
"""Workspace offered to the algorithms (cuBLAS's own default on Hopper); the candidates
measured asked for far less (docs/design-notes.md#cublaslts-algorithms)."""
TIMED_GPU_MS = 1.0
"""GPU time each candidate is timed over: enough calls back to back to fill it."""
TIMED_SAMPLES = 5

_COMPUTE_32F = 68
_CUDA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE = 1
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_OP_N, _OP_T = 0, 1


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than success."""


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CublasLtError(f"{call} returned cuBLAS status {status}")


# ----------------------------------------------------------------------------------- the op


@torch.library.custom_op(OP_NAME, mutates_args=())
def tuned_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (2-D), accumulated in fp32 and written as ``out_dtype``."""
    if a.device.type == "cuda":
        out = _tuner(a.device).mm(a, b, out_dtype)
        if out is not None:
            return out
    return reference_mm(a, b, out_dtype)


@tuned_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def reference_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What torch computes for the same call: ``mm``, or ``mm.dtype`` for a wider output on
    CUDA (the CPU has no ``mm.dtype`` kernel: there the operands are widened first, which sums
    the same products in fp32)."""
    if out_dtype == a.dtype:
        return torch.mm(a, b)
    if a.device.type == "cuda":
        return torch.ops.aten.mm.dtype(a, b, out_dtype)
    return torch.mm(a.to(out_dtype), b.to(out_dtype))


# ------------------------------------------------------------------------- the library


@dataclass(frozen=True)
class _Libraries:
    lt: ctypes.CDLL
    cudart: ctypes.CDLL


_LOCK = threading.Lock()


@functools.cache
def _libraries() -> _Libraries | None:
    """libcublasLt and libcudart as torch loaded them (found in ``/proc/self/maps``: the same
    copies torch's own GEMMs use), or None where this process has none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:
        return None
    lt = next((p for p in paths if "/libcublasLt.so" in p), None)
    cudart = next((p for p in paths if "/libcudart.so" in p), None)
    if lt is None or cudart is None:
        LOGGER.warning("tuned_mm: libcublasLt or libcudart is not loaded; torch.mm runs instead")
        return None
    return _Libraries(ctypes.CDLL(lt), ctypes.CDLL(cudart))


# ----------------------------------------------------------------------------- problems


@dataclass(frozen=True)
class _Operand:
    """A 2-D operand as cuBLAS's column-major matrix: its ``op`` and layout (rows, cols, ld)."""

    op: int
    rows: int
    cols: int
    ld: int


def _column_major(t: torch.Tensor) -> _Operand | None:
    """``t`` (row-major ``[r, c]`` as torch sees it) read by cuBLAS as the transpose it needs:
    a row-major ``[r, c]`` is a column-major ``[c, r]`` (op N), a transposed one (stride
    ``(1, ld)``) a column-major ``[r, c]`` read with op T. None for any other stride."""
    r, c = t.shape
    s0, s1 = t.stride()
    if (s1 == 1 or c == 1) and s0 >= max(c, 1):
        return _Operand(_OP_N, c, r, s0)
    if (s0 == 1 or r == 1) and s1 >= max(r, 1):
        return _Operand(_OP_T, r, c, s1)
    return None


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides the operand's address."""
    ptr = t.data_ptr()
    return 256 if ptr % 256 == 0 else ptr & -ptr


Key = tuple[Any, ...]


@dataclass
class _Problem:
    """One GEMM shape and layout under cuBLASLt: ``out[M, N] = a[M, K] @ b[K, N]`` computed as
    column-major ``out^T = b^T a^T``. Holds the descriptors its calls reuse."""

    lib: ctypes.CDLL
    handle: ctypes.c_void_p
    b_op: _Operand
    a_op: _Operand
    m: int
    n: int
    in_type: int
    out_type: int
    alignments: tuple[int, int, int]
    desc: ctypes.c_void_p = field(default_factory=ctypes.c_void_p)
    layouts: list[ctypes.c_void_p] = field(default_factory=list)

    def __post_init__(self) -> None:
        lib = self.lib
        _check(
            lib.cublasLtMatmulDescCreate(
                ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_TYPES[torch.float32]
            ),
            "cublasLtMatmulDescCreate",
        )
        for attr, operand in ((_DESC_TRANSA, self.b_op), (_DESC_TRANSB, self.a_op)):
            value = ctypes.c_int32(operand.op)
            _check(
                lib.cublasLtMatmulDescSetAttribute(
                    self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)
                ),
                "cublasLtMatmulDescSetAttribute",
            )
        for dtype, operand in (
            (self.in_type, self.b_op),
            (self.in_type, self.a_op),
            (self.out_type, _Operand(_OP_N, self.n, self.m, self.n)),
        ):
            layout = ctypes.c_void_p()
            _check(
                lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout),
                    dtype,
                    ctypes.c_uint64(operand.rows),
                    ctypes.c_uint64(operand.cols),
                    ctypes.c_int64(operand.ld),
                ),
                "cublasLtMatrixLayoutCreate",
            )
            self.layouts.append(layout)

    def heuristics(self, count: int) -> list[_Heuristic]:
        """Up to ``count`` algorithms the heuristic deems able to run, best-rated first."""
        lib = self.lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            settings: list[tuple[int, Any]] = [
                (_PREF_MAX_WORKSPACE, ctypes.c_uint64(WORKSPACE_BYTES))
            ]
            b_align, a_align, d_align = self.alignments
            for name, align in zip("abcd", (b_align, a_align, d_align, d_align), strict=True):
                settings.append((_PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(align)))
            for attr, value in settings:
                _check(
                    lib.cublasLtMatmulPreferenceSetAttribute(
                        pref, attr, ctypes.byref(value), ctypes.sizeof(value)
                    ),
                    "PreferenceSetAttribute",
                )
            results = (_Heuristic * count)()
            returned = ctypes.c_int(0)
            b_layout, a_layout, d_layout = self.layouts
            _check(
                lib.cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    self.desc,
                    b_layout,
                    a_layout,
                    d_layout,
                    d_layout,
                    pref,
                    count,
                    results,
                    ctypes.byref(returned),
                ),
                "cublasLtMatmulAlgoGetHeuristic",
            )
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [
            results[i]
            for i in range(returned.value)
            if results[i].state == 0 and results[i].workspace_size <= WORKSPACE_BYTES
        ]

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        algo: _Heuristic,
        workspace: int,
    ) -> None:
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        b_layout, a_layout, d_layout = self.layouts
        _check(
            self.lib.cublasLtMatmul(
                self.handle,
                self.desc,
                ctypes.byref(alpha),
                ctypes.c_void_p(b.data_ptr()),
                b_layout,
                ctypes.c_void_p(a.data_ptr()),
                a_layout,
                ctypes.byref(beta),
                ctypes.c_void_p(out.data_ptr()),
                d_layout,
                ctypes.c_void_p(out.data_ptr()),
                d_layout,
                ctypes.byref(algo.algo),
                ctypes.c_void_p(workspace),
                ctypes.c_size_t(WORKSPACE_BYTES),
                ctypes.c_void_p(torch.cuda.current_stream(a.device).cuda_stream),
            ),
            "cublasLtMatmul",
        )


def keep(times_ms: Mapping[int, float], graphed_ms: Mapping[int, float]) -> int | None:
    """The candidate to run instead of torch's own call (index -1), or None: of those
    ``MIN_GAIN`` faster than torch's both back to back (``times_ms``) and in a CUDA graph
    behind their input's producer (``graphed_ms``), the fastest in the graph. A candidate or
    torch's call missing from either went untimed there, and is not judged on half."""
    own, own_graphed = times_ms.get(-1), graphed_ms.get(-1)
    if not own or not own_graphed:
        return None
    faster = [
        i
        for i, t in times_ms.items()
        if i >= 0
        and i in graphed_ms
        and own >= MIN_GAIN * t
        and own_graphed >= MIN_GAIN * graphed_ms[i]
    ]
    return min(faster, key=lambda i: (graphed_ms[i], times_ms[i]), default=None)


@dataclass(frozen=True)
class Choice:
    """What tuning one shape found: the candidates' median ms per call (index -1: torch's own
    call) back to back (``times_ms``) and in a CUDA graph behind their input's producer
    (``graphed_ms``, the producer's own time taken off), and the one kept (None: torch's own)."""

    shape: tuple[int, int, int]
    dtypes: tuple[str, str]
    times_ms: dict[int, float]
    kept: int | None
    graphed_ms: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        m, k, n = self.shape
        own = self.times_ms.get(-1, math.nan)
        own_graphed = self.graphed_ms.get(-1, math.nan)
        head = f"tuned_mm [{m}, {k}] @ [{k}, {n}] {self.dtypes[0]} -> {self.dtypes[1]}"
        if self.kept is None:
            best = min(self.times_ms.items(), key=lambda it: (it[0] < 0, it[1]))
            if best[0] < 0:
                return f"{head}: torch's own algorithm kept ({own:.4f} ms; no other timed)"
            in_graph = self.graphed_ms.get(best[0], math.nan)
            return (
                f"{head}: torch's own algorithm kept ({own:.4f} ms, in a graph {own_graphed:.4f}; "
                f"best other {best[1]:.4f}, in a graph {in_graph:.4f})"
            )
        return (
            f"{head}: cuBLASLt candidate {self.kept} of {len(self.times_ms) - 1}, "
            f"{self.times_ms[self.kept]:.4f} ms against torch's {own:.4f} ms "
            f"(in a graph {self.graphed_ms.get(self.kept, math.nan):.4f} against "
            f"{own_graphed:.4f})"
        )


# ------------------------------------------------------------------------------- the tuner


class _Tuner:
    """One device's handle, workspace and tuned shapes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.libs = _libraries()
        self.handle = ctypes.c_void_p()
        self.workspace = 0
        self.ready = False
        self.chosen: dict[Key, tuple[_Problem, _Heuristic] | None] = {}
        self.choices: list[Choice] = []

    def _start(self) -> bool:
        """Create the handle and the workspace once; False (torch.mm runs, with one warning)
        where either fails. The workspace comes from ``cudaMalloc``, not torch's allocator,
        and lives as long as the process: captured graphs read its address, and an allocation
        made inside a CUDA graph tree's warm-up would belong to the tree's pool."""
        if self.ready:
            return True
        if self.libs is None:
            return False
        try:
            with torch.cuda.device(self.device):
                _check(self.libs.lt.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
                pointer = ctypes.c_void_p()
                status = self.libs.cudart.cudaMalloc(
                    ctypes.byref(pointer), ctypes.c_size_t(WORKSPACE_BYTES)
                )
                if status != 0 or not pointer.value:
                    raise CublasLtError(f"cudaMalloc of the workspace returned {status}")
        except CublasLtError as error:
            LOGGER.warning(
                "tuned_mm: %s on %s; its GEMMs run torch.mm instead. To leave them to torch "
                "from the start, add 'gemm_algorithm' to the workload's OPPROF['skip']",
                error,
                self.device,
            )
            self.libs = None
            return False
        self.workspace = pointer.value
        self.ready = True
        return True

    def mm(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """``a @ b`` under the kept algorithm, or None where torch's own call should run."""
        if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.dtype not in _CUDA_TYPES:
            return None
        if out_dtype not in _CUDA_TYPES or a.dtype == torch.float32:
            return None  # fp32 inputs: torch's TF32 setting decides the compute type
        a_op, b_op = _column_major(a), _column_major(b)
        if a_op is None or b_op is None:
            return None
        m, k = a.shape
        n = b.shape[1]
        if min(m, k, n) == 0:
            return None
        alignments = (_alignment(b), _alignment(a), 256)
        key = (m, k, n, a.dtype, out_dtype, a_op, b_op, alignments)
        if key not in self.chosen:
            if torch.cuda.is_current_stream_capturing() or not self._start():
                return None
            self.chosen[key] = self._tune(a, b, out_dtype, a_op, b_op, alignments)
        entry = self.chosen[key]
        if entry is None:
            return None
        problem, algo = entry
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
        problem.run(a, b, out, algo, self.workspace)
        return out

    def _tune(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out_dtype: torch.dtype,
        a_op: _Operand,
        b_op: _Operand,
        alignments: tuple[int, int, int],
    ) -> tuple[_Problem, _Heuristic] | None:
        assert self.libs is not None
        m, k = a.shape
        n = b.shape[1]
        problem = _Problem(
            self.libs.lt,
            self.handle,
            b_op,
            a_op,
            m,
            n,
            _CUDA_TYPES[a.dtype],
            _CUDA_TYPES[out_dtype],
            alignments,
        )
        candidates = problem.heuristics(CANDIDATES)
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
        # A copy of ``a`` that a kernel writes before each graphed call, as in a model's graph
        # the GEMM follows the kernel that produced its input.
        fed = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        torch.cuda.synchronize(a.device)

        def calls_on(x: torch.Tensor) -> dict[int, Callable[[], Any]]:
            calls: dict[int, Callable[[], Any]] = {-1: lambda: reference_mm(x, b, out_dtype)}
            for index, algo in enumerate(candidates):
                calls[index] = functools.partial(problem.run, x, b, out, algo, self.workspace)
            return calls

        times: dict[int, float] = {}
        with devicelock.measuring_within():  # no other process's GPU work in the timings
            for index, call in calls_on(a).items():
                try:
                    ms = _time(call)
                except CublasLtError as error:
                    LOGGER.info("tuned_mm: candidate %d failed (%s)", index, error)
                    continue
                if ms is not None:
                    times[index] = ms
            graphed = _graphed_times(
                {i: c for i, c in calls_on(fed).items() if i in times},
                lambda: fed.copy_(a),
            )
        kept = keep(times, graphed)
        choice = Choice((m, k, n), (str(a.dtype)[6:], str(out_dtype)[6:]), times, kept, graphed)
        self.choices.append(choice)
        LOGGER.info("%s", choice.describe())
        return None if kept is None else (problem, candidates[kept])


def _graphed_times(
    calls: Mapping[int, Callable[[], Any]], produce: Callable[[], Any]
) -> dict[int, float]:
    """Each call's GPU ms in a CUDA graph of ``produce(); call()`` replayed back to back, less
    a graph of ``produce()`` alone: the call replayed from a graph behind the kernel that wrote
    its input, as in a model's graph, memset nodes and all (it does not show what a workspace
    memset costs inside a whole model's graph: ``MIN_GAIN``). The graphs share
    one memory pool (each call's output is dropped once captured). A call that cannot be
    captured is left out, and every call where the producer alone cannot be captured or
    timed."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    try:
        base = _time(_captured([produce], pool, side))
    except RuntimeError as error:  # no capture here at all: nothing is judged in a graph
        LOGGER.info("tuned_mm: no CUDA graph could be captured to time in (%s)", error)
        return {}
    if base is None:
        return {}
    out: dict[int, float] = {}
    for index, call in calls.items():
        try:
            replay = _captured([produce, call], pool, side)
        except RuntimeError as error:  # a CublasLtError among them
            LOGGER.info("tuned_mm: candidate %d not captured (%s)", index, error)
            continue
        ms = _time(replay)
        if ms is not None:
            out[index] = max(ms - base, 1e-6)
    return out


def _captured(
    steps: list[Callable[[], Any]], pool: Any, side: torch.cuda.Stream
) -> Callable[[], None]:
    """``steps`` captured in one CUDA graph, warmed up on ``side`` first; its replay."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for step in steps:
            step()
    return graph.replay


def _time(call: Callable[[], Any]) -> float | None:
    """Median GPU ms per call of ``call`` run back to back with the host hidden, as the timing
    pass measures GPU time (``capture.timing.gpu_time_of``: behind a GPU sleep, kept only where
    the host enqueued every call first, so the host's launch cost, some 10 us a call through
    ctypes, is not what is timed); None where the host never got ahead."""
    from pytest_opprof.capture.timing import gpu_time_of

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    once = max(float(start.elapsed_time(end)), 1e-3)
    calls = max(2, min(50, math.ceil(TIMED_GPU_MS / once)))
    return gpu_time_of(call, (), calls, TIMED_SAMPLES, once)


_TUNERS: dict[int, _Tuner] = {}


def _tuner(device: torch.device) -> _Tuner:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _TUNERS:
            _TUNERS[index] = _Tuner(torch.device("cuda", index))
        return _TUNERS[index]


def choices() -> list[Choice]:
    """Every shape this process tuned, in order, on every device."""
    return [c for tuner in _TUNERS.values() for c in tuner.choices]


_REPORTED: list[int] = [0]


def unreported() -> list[Choice]:
    """The choices made since the last call (the stage log names each once)."""
    made = choices()
    new, _REPORTED[0] = made[_REPORTED[0] :], len(made)
    return new
