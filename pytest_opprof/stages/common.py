"""What the child halves of the stages share: the stage log, the torch set-up, the options,
loading the workload and the generated file, and compiling off the GPU (``devicelock``).

The stage process's bootstrap (``runner``) configures it once (:func:`configure`); the stage
modules call it. It imports no stage, so no stage's module imports another's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pytest_opprof import devicelock
from pytest_opprof.schema import ChildSpec

_STARTED = time.perf_counter()


TIMING_PROCESSES_GPU = 3
"""Timing processes on a GPU when the option says auto: a launch-bound call's speed differs
from one fresh process to the next, steady within each, so one process's interval does not
cover the next run (docs/design-notes.md#timing-processes)."""


def timing_processes(run: Any, device_type: str) -> int:
    """The recapture's timing processes (``--opprof-timing-processes``; ``run`` a
    ``WorkloadRun``)."""
    chosen = run.setting("timing_processes")
    if chosen is None:
        return TIMING_PROCESSES_GPU if device_type == "cuda" else 1
    return int(chosen)


SIDE_BY_SIDE_MEMORY = 0.8
"""The share of the GPU's memory a workload's processes may plan on together, each counted at
twice the capture's peak (a timing process holds the optimized plan besides both baselines)."""


def side_by_side(baseline: Any, processes: int) -> bool:
    """Whether ``processes`` of a workload's processes may run on the GPU together (the
    recapture's timing processes, a sibling beside selection or the later stages): only
    under a GPU lock, which keeps their measurements apart (``devicelock``), and where the
    capture's peak memory (``baseline``, its ``CaptureMetadata``) says they all fit."""
    if not os.environ.get(devicelock.LOCK_ENV):
        return False
    peak, total = baseline.peak_memory_bytes, baseline.device_memory_bytes
    return bool(peak and total and 2 * peak * processes <= SIDE_BY_SIDE_MEMORY * total)


def phase(what: str) -> None:
    """One line in the stage log: seconds since this process started, and what just ended —
    where a stage's wall time goes."""
    print(f"[opprof] +{time.perf_counter() - _STARTED:7.1f} s  {what}", flush=True)


def wall_clock() -> str:
    """Now, in UTC to the millisecond: a stage log's first line says when its process started,
    so the logs of a run's processes line up on one timeline (who held the GPU while another
    waited)."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%H:%M:%S.%f")[:-3] + " UTC"


def note_tuned_gemms() -> None:
    """One stage-log line for each GEMM shape ``opprof::tuned_mm`` tuned in this process since
    the last: which cuBLASLt algorithm it kept, against torch's own. Without the module loaded
    (no plan routed a GEMM through it) there is none."""
    cublaslt = sys.modules.get("pytest_opprof.backend.cublaslt")
    for choice in cublaslt.unreported() if cublaslt is not None else []:
        phase(choice.describe())


_COMPILE_PARTS = (
    ("trace", "bytecode_tracing"),
    ("aot", "create_aot_dispatcher_function"),
    ("inductor", "fx_codegen_and_compile"),
    ("kernels", "async_compile.wait"),
)


def compile_clock() -> dict[str, float]:
    """Dynamo's running totals of compile time by phase, and Inductor's FX graph cache hits and
    misses so far; :func:`compile_note` reports the difference since a reading."""
    try:
        from torch._dynamo import utils
    except ImportError:  # pragma: no cover - torch without Dynamo
        return {}
    totals = {
        name: sum(utils.compilation_time_metrics.get(key, [])) for name, key in _COMPILE_PARTS
    }
    inductor = utils.counters["inductor"]
    totals["cache_hit"] = float(inductor.get("fxgraph_cache_hit", 0))
    totals["cache_miss"] = float(inductor.get("fxgraph_cache_miss", 0))
    return totals


def compile_note(before: dict[str, float]) -> str:
    """Where a compile's time went since ``before`` (a :func:`compile_clock` reading): Dynamo's
    trace, AOT autograd, Inductor's codegen and the wait for its kernels, and whether Inductor's
    FX graph cache answered. Empty where Dynamo records nothing."""
    now = compile_clock()
    if not now or not before:
        return ""

    def since(name: str) -> float:  # torch._dynamo.reset() clears the totals in between
        was = before.get(name, 0.0)
        return now[name] - was if now[name] >= was else now[name]

    parts = [f"{name} {since(name):.1f}" for name, _ in _COMPILE_PARTS]
    hits, misses = int(since("cache_hit")), int(since("cache_miss"))
    return f"{', '.join(parts)} s; FX graph cache {hits} hit, {misses} miss"


def in_background(task: Callable[[], Any], name: str) -> Future[Any]:
    """``task`` (a later stage's work started ahead: the recapture beside validation, the
    counters pass beside the stages after the capture) in a thread of its own, named
    ``name``, which outlives the caller; its future, for the stage that takes the work up."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(task)
    pool.shutdown(wait=False)
    return future


@contextlib.contextmanager
def beside(task: Callable[[], None]) -> Iterator[Future[None]]:
    """``task`` (a sibling stage process's ``run_child``) in a thread while the block runs the
    stage's own process: the sibling does not outlive its stage or its folder, so the block's
    end, however it ended, waits for it (its future then done), but for an interrupt, which
    the session's end answers by stopping it. Yields the sibling's future; its error is the
    caller's to raise (``result()``) or weigh against the block's."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    future = pool.submit(task)
    try:
        yield future
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    except BaseException:
        pool.shutdown()
        raise
    pool.shutdown()


def wait_for_file(
    path: Path | Sequence[Path],
    waiting: str,
    before: str,
    over: Callable[[], bool] = lambda: False,
) -> float | None:
    """Wait until ``path`` exists (another process's end, which its stage marks there), or
    any one of several paths, or ``over()`` says the wait is over (the awaited process gone
    without marking it), holding nothing of the GPU's lock meanwhile (the caller has
    synchronized), saying ``waiting`` in the stage log: the seconds waited, or None where it
    was over already. The stage's timeout bounds the wait (the parent stops this process); a
    parent gone, or a path's folder gone with the stage that made it, ends it with an error
    that says the stage ended ``before`` what was awaited."""
    from pytest_opprof.errors import StageError

    paths = [path] if isinstance(path, Path) else list(path)

    def ended() -> bool:
        return any(p.exists() for p in paths) or over()

    if ended():
        return None
    devicelock.let_go()
    parent, t0 = os.getppid(), time.perf_counter()
    phase(waiting)
    while not ended():
        gone = next((p.parent for p in paths if not p.parent.is_dir()), None)
        if os.getppid() != parent or gone is not None:
            raise StageError(
                "the stage that started this process has ended (its process or "
                f"{gone or paths[0].parent} is gone) before {before}"
            )
        time.sleep(0.1)
    return time.perf_counter() - t0


def setup_torch() -> None:
    import torch

    # Inductor's C++ kernels are invisible to the profiler unless asked (torch 2.11/2.13);
    # with it they appear as cpu ops that attribution ties to their fused ATen ops.
    cpp = getattr(torch._inductor.config, "cpp", None)
    if cpp is not None and hasattr(cpp, "enable_kernel_profile"):
        cpp.enable_kernel_profile = True

    # Measured selection compiles the same forward many times (one per variant); Dynamo's
    # default recompile limit (8) would silently fall back to eager past it.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 512

    if _SHARES_CPUS and not (_COMPILE_POOL and _warm_compile_pool()):
        # Inductor starts a pool of compile workers at a process's first compile, each
        # importing torch: seconds of CPU on the slice, outside any lock, which slows a sibling
        # timing process that measures meanwhile. The siblings compile what selection already
        # compiled (the caches answer): in this process, without the pool.
        # (docs/design-notes.md#compiling-beside-a-sibling-timing-process)
        torch._inductor.config.compile_threads = 1
    elif not _SHARES_CPUS:
        compile_pool_on_host()
    phase("torch imported")


COMPILE_POOL_ENV = "OPPROF_COMPILE_POOL"
"""``host``: Inductor's compile workers run on every CPU of the host (:func:`compile_pool_on_host`);
otherwise they stay on the worker's CPU slice, as Inductor starts them. Not the default: a
selection build waits far longer on AOTAutograd's and Inductor's own Python, one thread on the
slice, than on its kernels (docs/design-notes.md#compile-workers-on-the-host)."""

POOL_NICE = 10
"""The compile workers' niceness on the host's CPUs: a neighbour's thread of normal priority
(a timing loop, a compile's own Python) takes a CPU back from them at once, and they still
get the time nothing else wants."""

POOL_PER_SLICE_CPU = 4
"""Compile workers per CPU of the slice, at most the host's CPUs: several workloads' pools
share the host, each with a process per worker (hundreds of MB each)."""


def compile_pool_on_host() -> int | None:
    """Start Inductor's pool of compile workers now, on every CPU the session had before it
    pinned its worker to a slice (``gpus.HOST_CPUS_ENV``), at nice :data:`POOL_NICE`, with up
    to :data:`POOL_PER_SLICE_CPU` workers per CPU of the slice; their number, or None where
    the pool starts as Inductor would start it: not asked for (``OPPROF_COMPILE_POOL=host``),
    no CPUs past the slice, compile threads the user chose (``gpus.pin_worker`` then names no
    host), a pool already started, or workers Inductor forks from this process.

    The pool's sidecar process (``subprocess.Popen`` from this thread) takes this thread's
    CPUs of the moment, so the thread widens them for the span of the start; the sidecar is
    reniced before it has any worker, and the workers it forks at their first job inherit both.
    The stage process itself stays on the slice: its measurements launch from it."""
    from torch._inductor import async_compile, config

    from pytest_opprof.gpus import onto_host

    if os.environ.get(COMPILE_POOL_ENV) != "host":
        return None
    started = getattr(async_compile.AsyncCompile.process_pool, "cache_info", None)
    if config.worker_start_method != "subprocess" or started is None or started().currsize:
        return None
    mine = onto_host()
    if mine is None:
        return None
    host = os.sched_getaffinity(0)
    config.compile_threads = min(len(host), POOL_PER_SLICE_CPU * len(mine))
    try:
        async_compile.AsyncCompile.warm_pool()
    finally:
        os.sched_setaffinity(0, mine)
    sidecar = getattr(async_compile.AsyncCompile.process_pool(), "process", None)
    if sidecar is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, sidecar.pid, POOL_NICE)
    phase(f"compile workers: {config.compile_threads} on the host's {len(host)} CPUs")
    return int(config.compile_threads)


def _warm_compile_pool() -> bool:
    """Start Inductor's pool of compile workers now and wait until it answers, as a compile
    (off the GPU, the siblings' lock held shared: ``devicelock.off_gpu``), so that its
    workers import torch beside no sibling's measurement; later they work only inside
    compiles. For siblings whose compiles no cache answers (max-autotune's templates compile
    hundreds of Triton kernels), which a single thread compiles one by one. False where this
    torch has no such pool or it did not start (then the caller compiles in-process)."""
    from torch._inductor.async_compile import AsyncCompile

    warm = getattr(AsyncCompile, "warm_pool", None)
    ready = getattr(AsyncCompile, "wait_pool_ready", None)
    if warm is None or ready is None:
        return False
    try:
        with devicelock.off_gpu(lambda: None):  # nothing of this process is on the GPU yet
            if compile_pool_on_host() is None:
                warm()
            ready()
    except Exception as exc:  # a pool that never answered: compile in this process instead
        phase(f"compile workers did not start ({type(exc).__name__}: {exc}); compiling here")
        return False
    phase("compile workers started")
    return True


def options(spec: ChildSpec) -> Any:
    from pytest_opprof.options import OpprofOptions

    return OpprofOptions.from_child(spec.options)


def setting(spec: ChildSpec, name: str) -> Any:
    return spec.overrides.get(name, getattr(options(spec), name, None))


def measures_stock(spec: ChildSpec) -> bool:
    """The child's half of ``WorkloadRun.measures_stock``: asked for, or the gate's baseline."""
    return bool(options(spec).stock) or setting(spec, "baseline") == "stock"


def load_baseline(spec: ChildSpec, device: str) -> Any:
    import torch

    from pytest_opprof.workload import check_output, load

    w = load(Path(spec.workload), device)
    with torch.no_grad():
        out = w.model(*w.inputs)
    check_output(w.path, out)
    return w


def import_generated(path: Path, sha256: str | None = None) -> Any:
    """Import the generated file; with ``sha256``, only the file of that hash (the one
    validated), read once so that the bytes checked are the bytes run."""
    import hashlib

    from pytest_opprof.errors import StageError

    name = path.stem
    if sha256 is not None:
        source = path.read_bytes()
        if hashlib.sha256(source).hexdigest() != sha256:
            raise StageError(
                f"{path.name} changed after its validation: not timed; validate it again"
            )
        module = types.ModuleType(name)
        module.__file__ = str(path)
        sys.modules[name] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        return module
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise StageError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    mod_spec.loader.exec_module(module)
    return module


_SHARES_CPUS = False
"""Sibling stage processes share this process's CPUs (a recapture's timing processes, side by
side): one of them measures while the others compile."""

_COMPILE_POOL = False
"""A process of :data:`_SHARES_CPUS` that keeps Inductor's pool of compile workers
(``ChildSpec.compile_pool``): its compiles are new, not answered by the caches."""

_STOPPED_BY_SIBLING = False
"""A process of :data:`_SHARES_CPUS` that its sibling stops while it measures
(:func:`stopped_while_siblings_measure`), not one under the siblings' lock."""

_OWN_CPUS = False
"""This process's CPU slice is its workload's own (``devicelock.OWN_CPUS_ENV``): it may compile
while another workload's process measures — alone on the slice, or beside siblings that hold
their lock (``devicelock``: a sibling's measurement waits for its siblings' compiles)."""

_OFF_GPU = contextlib.ExitStack()
"""The compile under way off the GPU: entered at Dynamo's compile start, closed at its end
(Dynamo runs both once for nested compiles)."""


@contextlib.contextmanager
def autotuning(device: str) -> Iterator[None]:
    """Compiles in the block may time kernels on the GPU (Inductor's max-autotune): they go off
    the GPU like any compile (:func:`compile_off_gpu`), and only their GPU work takes it back:
    each of Inductor's timings holds it alone for its span, the autotuning around them and the
    weights folded by freezing hold it shared. So a minutes-long max-autotune compile holds no
    measurement of another process back for longer than one of its steps, and its kernel
    choices are timed beside no other process's GPU work."""
    if device != "cuda":
        yield
        return
    compile_off_gpu(device)
    with _inductor_gpu_work():
        yield


WARMING = "an autotuned op's warming"
"""How the logs name the one shared hold an op's warming takes (``_inductor_gpu_work``)."""
FIRST_CALL = "a timed kernel's first call"
"""How the logs name a timed callable's first call: its own long shared hold
(``devicelock.SHARED``) where no autotuning step holds the GPU around it, and its length."""


@contextlib.contextmanager
def _inductor_gpu_work() -> Iterator[None]:
    """Inductor's own GPU work inside a compile, under the GPU's lock for the block. One op's
    autotuning (``benchmark_in_current_process``) runs twice. First it is warmed, its
    timings skipped: each Triton choice's kernel built or loaded beforehand, holding nothing
    (CPU work), then the op's inputs made and every choice first called in one shared hold of
    the GPU, which launches kernels only. Then it is timed, with the GPU alone for the whole
    op. So a compile asks for the GPU twice per op, not once or twice per choice: each ask
    waits for the measurements queued and the other processes' shared steps under way, and
    asked per choice, those waits set a stock task's wall time
    (docs/design-notes.md#autotuning-holds). The warming's results are thrown away; the
    timing calls everything again, as Inductor would have once. The op's steps
    (``get_inputs``, ``benchmark_choice``) share the GPU where they run outside such a hold.
    Elsewhere (a Triton kernel's configs, ``bench``; coordinate descent) a timed callable's
    first call shares the GPU, then its timing holds it alone, and ``freeze``'s fold on real
    weights shares it. A Triton kernel's build on its first call (``CachingAutotuner.
    precompile``: CPU work) lets go of the GPU, inside a hold too. The entry points are looked
    up by name (torch 2.11 and 2.13 have them); one that is missing is left as it is. Without
    a lock joined, nothing is run twice."""
    import contextvars
    import functools
    import threading

    import torch
    from torch._inductor import autotune_process, freezing, select_algorithm
    from torch._inductor.runtime import benchmarking, triton_heuristics

    from pytest_opprof.capture.timing import synchronize

    def sync() -> None:
        synchronize("cuda")

    warming = contextvars.ContextVar("warming", default=False)

    def warmed_alone(fn: Callable[..., Any]) -> Callable[..., Any]:
        """``benchmark_gpu(callable, ...)``: the callable's first call sharing the GPU, then
        the timing alone; while a batch warms, the first call only. A first call that fails
        is left to the timing, which calls it again and fails, or reports it, as Inductor
        expects. Inside a batch's timing (the GPU held alone already) there is no first call
        apart: the batch's warming made it."""

        @functools.wraps(fn)
        def measured(*args: Any, **kwargs: Any) -> Any:
            if devicelock.held_alone():
                return fn(*args, **kwargs)
            if args and callable(args[0]):
                t0 = time.perf_counter()
                with contextlib.suppress(Exception), devicelock.on_gpu(sync, FIRST_CALL):
                    args[0]()
                    sync()
                took = time.perf_counter() - t0
                if took >= devicelock.SHARED_NOTE_S:  # where a step's shared hold goes
                    phase(f"{FIRST_CALL} took {took:.2f} s")
            if warming.get():
                return 0.0  # a figure nobody reads: the timing pass times it
            with devicelock.measuring_within(sync):
                return fn(*args, **kwargs)

        return measured

    def kept_while_warming(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def cleanup(*args: Any, **kwargs: Any) -> Any:
            return None if warming.get() else fn(*args, **kwargs)

        return cleanup

    def built_off_gpu(fn: Callable[..., Any]) -> Callable[..., Any]:
        """``CachingAutotuner.precompile``: a Triton kernel built or loaded from the caches
        on its first call, CPU work (the kernel loaded into this process's context, nothing
        launched). Where this process's CPU work may run beside a measurement, the share held
        around that call is let go of for it (``devicelock.off_gpu``: after ``sync``, and
        taken back behind any measurer), so a measurer does not wait for the build; not while
        a CUDA graph is being captured, which a sync would break, and not from another thread
        (Inductor's precompiling pool), whose caller may hold the share in the meantime."""

        @functools.wraps(fn)
        def precompile(*args: Any, **kwargs: Any) -> Any:
            if (
                threading.current_thread() is not threading.main_thread()
                or not _compiles_off_gpu("cuda")
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
            ):
                return fn(*args, **kwargs)
            with devicelock.off_gpu(sync):
                return fn(*args, **kwargs)

        return precompile

    def prebuilt(choices: Any) -> None:
        """Each Triton choice's kernel built or loaded into this process before the op's
        warming takes the GPU (``TritonBenchmarkRequest.precompile``: CPU work, holding
        nothing), so that its first call in the warming only launches it. Called while
        warming, so the modules stay loaded (``cleanup_run_fn`` waits). A choice whose build
        fails is left to the warming: its first call builds it, letting go of the GPU
        (``built_off_gpu``), or fails there as Inductor expects."""
        request = getattr(autotune_process, "TritonBenchmarkRequest", None)
        if request is None:
            return
        for choice in choices if isinstance(choices, (list, tuple)) else ():
            bmreq = getattr(choice, "bmreq", None)
            if isinstance(bmreq, request):
                with contextlib.suppress(Exception):
                    bmreq.precompile()

    def warmed_then_timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        """A batch of timings: its choices' kernels built off the GPU, warmed in one shared
        hold of the GPU, then timed alone as one. A warming that fails is left to the timing,
        which runs it all again."""

        @functools.wraps(fn)
        def batch(*args: Any, **kwargs: Any) -> Any:
            if devicelock.joined_path() is None or devicelock.held_alone() or warming.get():
                return fn(*args, **kwargs)
            token = warming.set(True)
            try:
                prebuilt(kwargs.get("choices", args[1] if len(args) > 1 else None))
                with contextlib.suppress(Exception), devicelock.on_gpu(sync, WARMING):
                    fn(*args, **kwargs)
            finally:
                warming.reset(token)
            with devicelock.measuring_within(sync):
                return fn(*args, **kwargs)

        return batch

    def on_gpu(fn: Callable[..., Any]) -> Callable[..., Any]:
        what = f"Inductor's {fn.__name__}"

        @functools.wraps(fn)
        def folded(*args: Any, **kwargs: Any) -> Any:
            with devicelock.on_gpu(sync, what):
                return fn(*args, **kwargs)

        return folded

    undo: list[Callable[[], None]] = []

    Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]

    def wrap(owner: Any, name: str, how: Wrapper) -> None:
        found = vars(owner).get(name)  # a class's or a module's own attribute
        if found is None:
            return
        if isinstance(found, (classmethod, staticmethod)):
            setattr(owner, name, type(found)(how(found.__func__)))
        else:
            setattr(owner, name, how(found))
        undo.append(lambda: setattr(owner, name, found))

    cache, autotuner = select_algorithm.AlgorithmSelectorCache, triton_heuristics.CachingAutotuner
    steps: tuple[str, ...] = ("get_inputs", "benchmark_choice")  # an op's inputs, its choices
    if not all(name in vars(cache) for name in steps):
        steps = ("benchmark_in_current_process",)  # the op as a whole
    for name in steps:
        wrap(cache, name, on_gpu)
    wrap(cache, "benchmark_in_current_process", warmed_then_timed)
    # Kept loaded from the warming to the timing (torch 2.13 unloads each choice's kernels
    # after its timing): the timing pass then loads nothing again, with the GPU alone.
    wrap(autotune_process.TritonBenchmarkRequest, "cleanup_run_fn", kept_while_warming)
    wrap(autotuner, "bench" if "bench" in vars(autotuner) else "benchmark_all_configs", on_gpu)
    wrap(autotuner, "precompile", built_off_gpu)
    bench = benchmarking.benchmarker  # one instance, imported by name across Inductor

    def wrap_bound(name: str) -> None:
        original = getattr(bench, name, None)
        if not callable(original):
            return
        shadowed = name in vars(bench)
        setattr(bench, name, warmed_alone(original))
        undo.append(
            functools.partial(setattr, bench, name, original)
            if shadowed
            else functools.partial(delattr, bench, name)
        )

    wrap_bound("benchmark_gpu")
    wrap_bound("benchmark_gpu_with_cuda_graph")
    wrap(freezing, "freeze", on_gpu)
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _off_gpu_start(args: Any) -> None:
    from torch._dynamo.callback import CallbackTrigger

    from pytest_opprof.capture.timing import synchronize

    if args.callback_trigger is CallbackTrigger.DYNAMO:  # not a CUDA-graph recording
        # first the work queued before the compile (a graph before a break)
        _OFF_GPU.enter_context(devicelock.off_gpu(lambda: synchronize("cuda")))


def _off_gpu_end(args: Any) -> None:
    _OFF_GPU.close()


def _compiles_off_gpu(device: str) -> bool:
    """Whether this process's CPU work may run beside another process's measurement: its CPUs
    its own, or shared with siblings that hold their lock (``devicelock``), or with a sibling
    that stops this process while it measures (:func:`stopped_while_siblings_measure`)."""
    apart = devicelock.has_siblings() or _STOPPED_BY_SIBLING
    return device == "cuda" and _OWN_CPUS and not (_SHARES_CPUS and not apart)


def stopped_while_siblings_measure() -> None:
    """This process shares its CPUs with a sibling that stops it (``devicelock.stopped``)
    while it measures, instead of waiting for its compiles (the rung warmer: the sibling is
    selection, ``stages.rung_warmer``): so where its CPUs are the workload's own, its compiles
    may let go of the GPU as those of siblings under their lock do, and selection's
    measurement need not wait for one to end."""
    global _STOPPED_BY_SIBLING
    _STOPPED_BY_SIBLING = True


def compile_off_gpu(device: str) -> None:
    """Where this process's CPUs are its own, let go of the GPU while Dynamo compiles (from
    its start to its end callback: ``devicelock.off_gpu``), so a measurer waits for no compile
    of ours; our backend takes the GPU back for the weights it folds. Registered again where a
    ``torch._dynamo.reset()`` cleared the callbacks; nothing on torch without them."""
    if not _compiles_off_gpu(device):
        return
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - torch < 2.6
        return
    if _off_gpu_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_off_gpu_start)
        callback_handler.register_end_callback(_off_gpu_end)


def step_done(device: str) -> None:
    """A step of this process's work (a compile, a build, the generated tests) is over: once
    its GPU work has finished, a measurer waiting on the GPU goes first."""
    from pytest_opprof.capture.timing import synchronize

    synchronize(device)
    devicelock.make_way()


def compile_timed(
    model: Any, backend: Any, inputs: tuple[Any, ...], device: str
) -> tuple[Any, float]:
    import torch

    from pytest_opprof.capture.timing import synchronize
    from pytest_opprof.errors import StageError

    fn = torch.compile(model, backend=backend)
    compile_off_gpu(device)
    clock = compile_clock()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            fn(*inputs)
        synchronize(device)
    except Exception as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        lines = [line for line in str(exc).splitlines() if line.strip()]
        shown = lines[0] if lines else type(exc).__name__
        raise StageError(
            f"torch.compile(backend={getattr(backend, '__name__', backend)!r}) failed: "
            f"{type(exc).__name__}: {shown[:300]}; check that Inductor works here (a C++ "
            "compiler for the CPU, Triton for the GPU), or see the stage log"
        ) from None
    seconds = time.perf_counter() - t0
    note = compile_note(clock)
    phase(
        f"compiled (backend={getattr(backend, '__name__', backend)!r}) in {seconds:.1f} s"
        + (f" ({note})" if note else "")
    )
    devicelock.make_way()  # synchronized above
    return fn, seconds


def first_call(w: Any, device: str) -> Any:
    """A call of a compiled callable on ``w``'s inputs under no_grad, waiting for the device:
    the ``first_call`` that ``backend.stock.build`` compiles a recipe by."""
    import torch

    from pytest_opprof.capture.timing import synchronize

    def call(fn: Any) -> None:
        with torch.no_grad():
            fn(*w.inputs)
        synchronize(device)

    return call


def flat(value: Any) -> list[Any]:
    from pytest_opprof.workload import flatten_tensors

    return flatten_tensors(value)


def configure(*, shares_cpus: bool, own_cpus: bool, compile_pool: bool = False) -> None:
    """The process's place among its siblings, from its spec and its environment."""
    global _SHARES_CPUS, _OWN_CPUS, _COMPILE_POOL
    _SHARES_CPUS, _OWN_CPUS, _COMPILE_POOL = shares_cpus, own_cpus, compile_pool


def restart_clock() -> None:
    """The stage log counts from now: a process forked from the fork server starts here."""
    global _STARTED
    _STARTED = time.perf_counter()
