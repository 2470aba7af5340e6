"""The child process: ``python -m pytest_opprof.runner SPEC.json``.

User code (the workload, the generated backend) runs only here, so a crash, a hang or a CUDA
error never takes pytest down. The spec names the task and its inputs; the task writes its
artifacts atomically. A user's mistake (``OpprofError``) is written to ``failure.json`` beside
the spec and the process exits with ``EXIT_USER_ERROR``; anything else is a bug of ours and
keeps its traceback on stderr.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof import devicelock

if TYPE_CHECKING:
    from collections.abc import Callable

    from pytest_opprof.backend.plan import Rung
    from pytest_opprof.capture.timing import RoundSamples
    from pytest_opprof.schema import FxGraphSummary

EXIT_USER_ERROR = 3
_STARTED = time.perf_counter()


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pytest_opprof.runner SPEC.json", file=sys.stderr)
        return 2
    spec_path = Path(args[0])
    _die_with_parent()
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    from pytest_opprof.errors import OpprofError
    from pytest_opprof.schema import ChildFailure, write_artifact

    global _OWN_CPUS, _SHARES_CPUS
    _SHARES_CPUS = bool(spec.get("shares_cpus"))
    _OWN_CPUS = os.environ.get(devicelock.OWN_CPUS_ENV) == "1"
    try:
        devicelock.join(note=phase, siblings=spec.get("siblings_lock"))
        TASKS[spec["task"]](spec)
        waited, alone = devicelock.waited_s(), devicelock.alone_s()
        phase(
            f"task {spec['task']} done"
            + (f", {waited:.1f} s of it waiting for the GPU" * (waited >= 0.05))
            + (f", {alone:.1f} s with the GPU to itself" * (alone >= 0.05))
        )
    except OpprofError as exc:
        write_artifact(
            spec_path.with_name("failure.json"),
            ChildFailure(kind=type(exc).__name__, message=str(exc)),
        )
        return EXIT_USER_ERROR
    except BaseException as exc:
        if _is_oom(exc):
            write_artifact(
                spec_path.with_name("failure.json"),
                ChildFailure(
                    kind="WorkloadError",
                    message=f"{Path(spec['workload']).name}: out of GPU memory during "
                    f"{spec['task']} ({str(exc).splitlines()[0]}); use a smaller model or "
                    "batch, or free the GPU",
                ),
            )
            return EXIT_USER_ERROR
        raise
    return 0


def _die_with_parent() -> None:
    """Linux: be killed when the parent (pytest, the CLI) dies, even by SIGKILL, so no child
    writes artifacts after its session is gone. Elsewhere the parent's own cleanup must do."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl: nobody to report to
        os._exit(1)


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(exc, torch.cuda.OutOfMemoryError)


# ------------------------------------------------------------------------------- helpers


def _setup_torch() -> None:
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

    if _SHARES_CPUS:
        # Inductor starts a pool of compile workers at a process's first compile, each
        # importing torch: seconds of CPU on the slice, outside any lock. Beside a sibling
        # timing process that measures meanwhile, its launch-bound calls ran 1.4-2.5x slower
        # (benchmarks/results/h200-2026-11-30j). The siblings compile what selection already
        # compiled (the caches answer): in this process, without the pool.
        torch._inductor.config.compile_threads = 1
    phase("torch imported")


def _options(spec: dict[str, Any]) -> Any:
    from pytest_opprof.options import OpprofOptions

    return OpprofOptions.from_child(spec["options"])


def _setting(spec: dict[str, Any], name: str) -> Any:
    return spec.get("overrides", {}).get(name, getattr(_options(spec), name, None))


def _load_baseline(spec: dict[str, Any], device: str) -> Any:
    import torch

    from pytest_opprof.workload import check_output, load

    w = load(Path(spec["workload"]), device)
    with torch.no_grad():
        out = w.model(*w.inputs)
    check_output(w.path, out)
    return w


def _import_generated(path: Path, sha256: str | None = None) -> Any:
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
_OWN_CPUS = False
"""This process's CPU slice is its workload's own (``devicelock.OWN_CPUS_ENV``): it may compile
while another workload's process measures — alone on the slice, or beside siblings that hold
their lock (``devicelock``: a sibling's measurement waits for its siblings' compiles)."""
_OFF_GPU = contextlib.ExitStack()
"""The compile under way off the GPU: entered at Dynamo's compile start, closed at its end
(Dynamo runs both once for nested compiles)."""


def _off_gpu_start(args: Any) -> None:
    from torch._dynamo.callback import CallbackTrigger

    from pytest_opprof.capture.timing import synchronize

    if args.callback_trigger is CallbackTrigger.DYNAMO:  # not a CUDA-graph recording
        # first the work queued before the compile (a graph before a break)
        _OFF_GPU.enter_context(devicelock.off_gpu(lambda: synchronize("cuda")))


def _off_gpu_end(args: Any) -> None:
    _OFF_GPU.close()


def _compile_off_gpu(device: str) -> None:
    """Where this process's CPUs are its own, let go of the GPU while Dynamo compiles (from
    its start to its end callback: ``devicelock.off_gpu``), so a measurer waits for no compile
    of ours; our backend takes the GPU back for the weights it folds. Registered again where a
    ``torch._dynamo.reset()`` cleared the callbacks; nothing on torch without them."""
    if device != "cuda" or not _OWN_CPUS or (_SHARES_CPUS and not devicelock.has_siblings()):
        return
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # pragma: no cover - torch < 2.6
        return
    if _off_gpu_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_off_gpu_start)
        callback_handler.register_end_callback(_off_gpu_end)


def _step_done(device: str) -> None:
    """A step of this process's work (a compile, a build, the generated tests) is over: once
    its GPU work has finished, a measurer waiting on the GPU goes first."""
    from pytest_opprof.capture.timing import synchronize

    synchronize(device)
    devicelock.make_way()


def _compile_timed(
    model: Any, backend: Any, inputs: tuple[Any, ...], device: str
) -> tuple[Any, float]:
    import torch

    from pytest_opprof.capture.timing import synchronize
    from pytest_opprof.errors import StageError

    fn = torch.compile(model, backend=backend)
    _compile_off_gpu(device)
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


def _metadata(spec: dict[str, Any], w: Any, device: str, info: dict[str, Any]) -> Any:
    import torch

    from pytest_opprof.capture.system import fingerprint
    from pytest_opprof.schema import CaptureMetadata
    from pytest_opprof.workload import WorkloadSpec

    opts = _options(spec)
    params = list(w.model.parameters())
    return CaptureMetadata(
        workload=Path(spec["workload"]).stem,
        device_type="cuda" if device == "cuda" else "cpu",
        device_name=info["device_name"],
        sm_count=info["sm_count"],
        compute_capability=info["compute_capability"],
        driver=info["driver"],
        torch_version=info["torch_version"],
        cuda_version=info["cuda_version"],
        triton_version=info["triton_version"],
        python_version=info["python_version"],
        dtype=str(params[0].dtype).replace("torch.", "") if params else "float32",
        input_shapes=[list(t.shape) for t in w.inputs],
        input_dtypes=[str(t.dtype).replace("torch.", "") for t in w.inputs],
        warmup_iters=_setting(spec, "warmup_iters"),
        measure_iters=_setting(spec, "measure_iters"),
        rounds=_setting(spec, "rounds"),
        compile_mode=f"torch.compile(backend={opts.compile_backend!r})",
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment_fingerprint=fingerprint(info),
        workload_sha256=WorkloadSpec(Path(spec["workload"])).sha256(),
        cpu_fallback=device == "cpu",
        visible_devices=info.get("visible_devices"),
        device_count=info.get("device_count"),
        device_uuid=info.get("device_uuid"),
        peak_memory_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None,
        device_memory_bytes=info.get("device_memory"),
    )


def _timelines(
    spec: dict[str, Any],
    calls: dict[str, tuple[Any, str]],
    inputs: Any,
    device: str,
    out_dir: Path,
    twins: dict[str, Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Profile each call; a label in ``twins`` (a CUDA-graph variant) is first profiled as its
    uncaptured twin, whose trace places the replayed kernels (``attribution.replay_twin``)."""
    from pytest_opprof.capture.attribution import provenance_file, replay_twin, trace_file
    from pytest_opprof.capture.provenance import collect_inductor_provenance
    from pytest_opprof.capture.timeline import capture_timeline
    from pytest_opprof.schema import write_text_atomic

    stem = Path(spec["workload"]).stem
    folder = out_dir / "profiler_output"
    provenance = collect_inductor_provenance()
    write_text_atomic(
        provenance_file(folder, stem, calls), json.dumps(provenance, indent=1, sort_keys=True)
    )
    timelines: list[Any] = []
    flags: list[Any] = []

    def profile(fn: Any, label: str, mode: str, twin: Any = None) -> tuple[Any, list[Any]]:
        return capture_timeline(
            fn,
            inputs,
            device=device,
            label=label,
            compile_mode=mode,
            warmup=3,
            iterations=spec.get("timeline_iters", 3),
            trace_path=trace_file(folder, stem, label),
            provenance=provenance,
            twin=twin,
        )

    for label, (fn, mode) in calls.items():
        twin = None
        if twins and label in twins:
            uncaptured, _ = profile(twins[label], f"{label}_uncaptured", f"{mode} without graphs")
            twin = replay_twin(uncaptured)
        timeline, found = profile(fn, label, mode, twin)
        timelines.append(timeline)
        flags += [f for f in found if f.name not in {x.name for x in flags}]
    return timelines, flags


def _gpu_time(
    calls: dict[str, Any],
    inputs: Any,
    device: str,
    samples: RoundSamples,
    timelines: list[Any],
) -> dict[str, float]:
    """The GPU time of each call with the host hidden (capture.timing.gpu_time), its first
    attempt sized by the timing pass (its calls per round and latencies, ``samples``) and the
    timeline's kernels per call."""
    import statistics

    from pytest_opprof.capture.timing import gpu_time
    from pytest_opprof.schema import timing_variant

    return gpu_time(
        calls,
        inputs,
        device=device,
        calls_per_sample=samples.calls,
        latency_ms={k: statistics.median(v) for k, v in samples.items() if v},
        launches={
            timing_variant(t.label): t.summary.launches_per_iter or t.summary.kernels_per_iter
            for t in timelines
        },
    )


def _timing(
    samples: RoundSamples,
    device: str,
    pairs: list[tuple[str, str]],
    timelines: list[Any],
    compile_s: dict[str, float],
    gpu_ms: dict[str, float],
) -> Any:
    from pytest_opprof.measure import latency_stats, slow_host_rounds, speedup
    from pytest_opprof.schema import Timing

    slow = slow_host_rounds(samples.host_us)
    return Timing(
        device=device,
        clock="cuda_event" if device == "cuda" else "perf_counter",
        variants={
            k: latency_stats(
                v,
                samples.calls[k],
                cpu_share=samples.cpu_share.get(k, ()),
                preempted=samples.preempted.get(k, ()),
                set_aside=slow,
            )
            for k, v in samples.items()
        },
        gpu_kernel_ms={t.label: t.summary.device_time_per_iter_us / 1000.0 for t in timelines},
        gpu_time_ms=gpu_ms,
        speedups=[
            speedup(a, samples[a], b, samples[b], set_aside=slow)
            for a, b in pairs
            if a in samples and b in samples
        ],
        compile_seconds=compile_s,
        host=[samples.host] if samples.host is not None else [],
        host_us=samples.host_us,
    )


# --------------------------------------------------------------------------------- tasks


def task_capture(spec: dict[str, Any]) -> None:
    """Stage 0: graph summary, timing (eager vs compiled, interleaved), both timelines, and
    each call's GPU time with the host hidden (what the timelines' kernel time is checked
    against)."""
    from pytest_opprof.capture.graph import capture_graph
    from pytest_opprof.capture.system import environment, resolve_device
    from pytest_opprof.schema import Profile, write_artifact

    _setup_torch()
    opts = _options(spec)
    out_dir = Path(spec["out_dir"])
    device = resolve_device(opts.device)
    w = _load_baseline(spec, device)
    info = environment(device)
    write_artifact(out_dir / "graph.json", capture_graph(w.model, w.inputs))
    compiled, compile_s = _compile_timed(w.model, opts.compile_backend, w.inputs, device)
    baselines = {"eager": w.model, "compile": compiled}
    mode = f"torch.compile(backend={opts.compile_backend!r})"
    # The counters pass, if it runs, shares the GPU again first (counters_for_capture).
    with devicelock.measuring(share_after=False, quiet=True):
        samples = _time_calls(spec, baselines, w.inputs, device)
        timelines, flags = _timelines(
            spec,
            {"eager": (w.model, "eager"), "compiled": (compiled, mode)},
            w.inputs,
            device,
            out_dir,
        )
        gpu_ms = _gpu_time(baselines, w.inputs, device, samples, timelines)
    phase("timed and profiled")
    timing = _timing(
        samples,
        device,
        [("eager", "compile")],
        timelines,
        {"compile": compile_s},
        gpu_ms,
    )
    from pytest_opprof.capture.counters import counters_for_capture

    meta = _metadata(spec, w, device, info)
    timelines, counters, notes = counters_for_capture(
        spec, timelines, info, opts, meta.dtype, device
    )
    phase("counters pass")
    _step_done(device)  # after the Nsight Compute pass, if it ran
    profile = Profile(
        capture_metadata=meta,
        counters=counters,
        timing=timing,
        timelines=timelines,
        edge_case_flags=flags,
        warnings=notes
        if device == "cuda"
        else [
            "CPU fallback: no CUDA device, so CPU operators were profiled and no hardware "
            "counters were read"
        ],
    )
    write_artifact(out_dir / spec.get("profile_name", "profile.json"), profile)


def task_counters_target(spec: dict[str, Any]) -> None:
    """The process ncu profiles (capture.counters): one call inside the NVTX range."""
    from pytest_opprof.capture.counters import counters_target_task

    counters_target_task(spec)


def _captured_graph(out_dir: Path) -> FxGraphSummary | None:
    """The capture stage's FX graph summary (``graph.json``, validated on read), or None where
    capture wrote none."""
    from pytest_opprof.schema import FxGraphSummary, read_artifact

    path = out_dir / "graph.json"
    return read_artifact(path, FxGraphSummary) if path.is_file() else None


def task_select(spec: dict[str, Any]) -> None:
    """Measured selection: climb the ladder of proposals, keeping a rung only when it is
    confidently faster than the plan below it (paired, interleaved rounds), by at least
    ``MIN_RUNG_GAIN``, and numerically equivalent to the eager baseline; then give each rung
    dropped before the last kept one a second chance on top of the final plan, since some
    gains only appear together (bf16 pays once layouts match). The rungs:
    :func:`selection_rungs`."""
    import torch

    from pytest_opprof.backend.build import build
    from pytest_opprof.backend.plan import add_proposal, cannot_change
    from pytest_opprof.backend.selection import (
        applied_nowhere,
        climbed,
        faster_enough,
        over_twice_as_slow,
        second_pass,
        timed_rung,
        verdict,
        worth_a_second_pass,
    )
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize, time_interleaved
    from pytest_opprof.measure import latency_stats, paired_gain, slow_host_rounds
    from pytest_opprof.schema import (
        BackendPlan,
        BackendSelection,
        DroppedProposal,
        Optimizations,
        VariantResult,
        WaterfallStep,
        read_artifact,
        write_artifact,
    )
    from pytest_opprof.tolerances import TF32, numerics_dtype, tolerance_for
    from pytest_opprof.validate import calibrated, check_numerics, describe, same_precision
    from pytest_opprof.workload import fresh_inputs

    _setup_torch()
    opts = _options(spec)
    device = resolve_device(opts.device)
    out_dir = Path(spec["out_dir"])
    opt = read_artifact(out_dir / "optimizations.json", Optimizations)
    w = _load_baseline(spec, device)
    eager = w.model
    compiled, _ = _compile_timed(eager, opts.compile_backend, w.inputs, device)
    check_in = fresh_inputs(w.inputs, 7)
    with torch.no_grad():
        reference_out = [t.clone() for t in _flat(eager(*check_in))]
    # eager's own error at each compute dtype a rung tries, which bounds that rung's
    same_dtype: dict[str, Any] = {}
    calls = max(3, _setting(spec, "measure_iters") // 2)
    rounds = max(5, min(9, _setting(spec, "rounds")))
    brief = {"device": device, "warmup": 3, "calls_per_round": calls, "rounds": rounds}

    # Each rung shares the GPU again as it starts (attempt()); after the last, nothing runs.
    with devicelock.measuring(share_after=False):
        base = time_interleaved({"eager": eager, "compile": compiled}, w.inputs, **brief)
    aside = slow_host_rounds(base.host_us)
    stats = {k: latency_stats(v, base.calls[k], set_aside=aside) for k, v in base.items()}
    ref_name = min(stats, key=lambda k: stats[k].median_ms)
    ref_ms = stats[ref_name].median_ms
    variants = [
        VariantResult(name=k, plan=BackendPlan(), latency=v, speedup=ref_ms / v.median_ms)
        for k, v in stats.items()
    ]
    state = {
        "plan": BackendPlan(),
        "fn": compiled if ref_name == "compile" else eager,
        "name": ref_name,
    }
    waterfall = [
        WaterfallStep(
            step=ref_name,
            latency_ms=ref_ms,
            speedup_cumulative=1.0,
            speedup_added=1.0,
            measured_ms=ref_ms,
        )
    ]
    skip = set(spec.get("overrides", {}).get("skip", []))
    not_built, rungs = climbed(opt.proposals, device, skip, _captured_graph(out_dir))
    dropped = {
        pid: DroppedProposal(id=pid, type=kind, reason=reason)
        for pid, (kind, reason) in not_built.items()
    }

    def attempt(rung: Rung, second_chance: bool) -> bool:
        plan = state["plan"]
        moot = next(filter(None, (cannot_change(plan, p) for p in rung.proposals)), None)
        if moot is not None:
            for p in rung.proposals:
                before = dropped.get(p.id)
                reason = (
                    f"{before.reason}; not tried again: {moot}" if before else f"not tried: {moot}"
                )
                dropped[p.id] = DroppedProposal(id=p.id, type=p.type, reason=reason)
            return False
        for p in rung.proposals:
            plan = add_proposal(plan, p)
        name = "+".join(plan.proposals)
        _step_done(device)  # after the rung before, built and dropped without a measurement
        devicelock.resume()  # or measured: then the GPU was released
        t0 = time.perf_counter()
        fresh = _pristine_copy(eager, lambda: _load_baseline(spec, device).model)
        t1 = time.perf_counter()
        clock = compile_clock()
        _compile_off_gpu(device)
        try:
            built = build(fresh, w.inputs, plan)
            with torch.no_grad():
                got = [t.clone() for t in _flat(built.fn(*check_in))]
            synchronize(device)
        except Exception as exc:  # a pass or Inductor failed on this rung: drop it, go on
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            variants.append(VariantResult(name=name, plan=plan, error=reason[:300]))
            for p in rung.proposals:
                dropped[p.id] = DroppedProposal(
                    id=p.id, type=p.type, reason=f"failed to build: {reason[:200]}"
                )
            return False
        note = compile_note(clock)
        phase(
            f"built {name}: model {t1 - t0:.1f} s, compile and first call "
            f"{time.perf_counter() - t1:.1f} s" + (f" ({note})" if note else "")
        )
        note_tuned_gemms()
        unchanged = applied_nowhere(rung.proposals, built.results)
        if unchanged is not None:
            # Timing an identical program only measures noise; a lucky CI must not keep it.
            variants.append(VariantResult(name=name, plan=plan, error="applied nowhere"))
            for p in rung.proposals:
                dropped[p.id] = DroppedProposal(
                    id=p.id, type=p.type, reason=f"applied nowhere: {unchanged[:200]}"
                )
            return False
        checked_as = numerics_dtype(plan.dtype, tf32=_runs_tf32(eager, plan, device))
        rtol, atol = tolerance_for(checked_as, spec.get("overrides"))
        if calibrated(spec.get("overrides")) and checked_as not in same_dtype:
            with torch.no_grad():
                same_dtype[checked_as] = same_precision(eager, check_in, checked_as, reference_out)
        numerics = check_numerics(
            reference_out,
            got,
            dtype=checked_as,
            rtol=rtol,
            atol=atol,
            reference=same_dtype.get(checked_as),
        )
        if not numerics.ok:
            variants.append(
                VariantResult(
                    name=name, plan=plan, numerics=numerics, error="numerics out of tolerance"
                )
            )
            for p in rung.proposals:
                dropped[p.id] = DroppedProposal(
                    id=p.id,
                    type=p.type,
                    reason=(f"changed the output: {describe(numerics)}"),
                )
            return False
        with devicelock.measuring(share_after=False):
            s = time_interleaved(
                {"current": state["fn"], "candidate": built.fn},
                w.inputs,
                **brief,
                enough=over_twice_as_slow,
            )
        gain, cand, below = paired_gain(s, s.calls, s.host_us, "current", "candidate")
        aside = f" ({len(cand.set_aside)} rounds set aside)" if cand.set_aside else ""
        timed = len(s["candidate"])  # fewer than planned: stopped, over twice as slow in each
        early = f", timed for {timed} rounds, each over twice as slow" if timed < rounds else ""
        phase(f"timed {name}: {gain.ratio:.3f}x{aside}{early}")
        ids = ", ".join(p.id for p in rung.proposals)
        variant, step = timed_rung(
            name,
            plan,
            gain,
            cand,
            label=f"+{rung.name} ({ids})" + (" [second pass]" if second_chance else ""),
            below_name=state["name"],
            below_latency=below,
            below_step=waterfall[-1],  # the plan below: the last step kept
            numerics=numerics,
        )
        variants.append(variant)
        if faster_enough(gain):
            state.update(plan=plan, fn=built.fn, name=name)
            for p in rung.proposals:
                dropped.pop(p.id, None)
            waterfall.append(step)
            return True
        for p in rung.proposals:
            dropped[p.id] = DroppedProposal(
                id=p.id,
                type=p.type,
                reason=(
                    verdict(gain) + f": {gain.ratio:.3f}x (95% CI {gain.ci_low:.3f}–"
                    f"{gain.ci_high:.3f}) against the plan without it"
                    + early
                    + (", also on the second pass" if second_chance else "")
                ),
            )
        return False

    kept = [attempt(r, second_chance=False) for r in rungs]
    # A rung dropped before the last kept one met a plan that has changed since: try it again.
    # One that applied nowhere is tried again once a rung before it was kept on this pass
    # (gemm_out_dtype finds its bf16 GEMMs only once dtype_promotion is in).
    revived = False
    for i in second_pass(kept):
        rung = rungs[i]
        reasons = [dropped[p.id].reason for p in rung.proposals]
        if worth_a_second_pass(reasons, revived) and attempt(rung, second_chance=True):
            revived = True
    final = state["plan"]
    checked_as = numerics_dtype(final.dtype, tf32=_runs_tf32(eager, final, device))
    selection = BackendSelection(
        workload=Path(spec["workload"]).stem,
        reference=ref_name,
        reference_ms=ref_ms,
        variants=variants,
        chosen=state["name"],
        plan=final,
        dropped=list(dropped.values()),
        waterfall=waterfall,
        numerics_dtype=checked_as if checked_as == TF32 else None,
    )
    write_artifact(out_dir / "profiler_output" / "backend_selection.json", selection)


def _pristine_copy(model: Any, reload: Callable[[], Any]) -> Any:
    """A copy of the untouched baseline for one variant to change (non-graph passes change
    the model in place): a deep copy, on the device, instead of building the model again (1.2 s
    each for GPT-2 on the H200 host, nine times in one selection); ``reload()`` under seed 0,
    as the baseline was made, where the model cannot be deep-copied."""
    import copy

    import torch

    try:
        return copy.deepcopy(model)
    except Exception:  # a module holding something deepcopy refuses (a lock, a C handle)
        torch.manual_seed(0)
        return reload()


def _runs_tf32(model: Any, plan: Any, device: str) -> bool:
    """Whether an fp32 ``plan`` of ``model`` computes on TF32 tensor cores: its convolutions
    where cuDNN allows TF32 (PyTorch's default), its matmuls where the process or the plan's
    algorithm_selection allows it."""
    import torch

    from pytest_opprof.passes.base import ALLOW_TF32

    if device != "cuda":
        return False
    if torch.backends.cuda.matmul.allow_tf32 or plan.config_patches.get(ALLOW_TF32):
        return True
    convs = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    return bool(convs and torch.backends.cudnn.allow_tf32)


def _flat(value: Any) -> list[Any]:
    from pytest_opprof.workload import flatten_tensors

    return flatten_tensors(value)


def task_validate(spec: dict[str, Any]) -> None:
    """Validation steps 2 to 6 in one process, so torch is imported once (~8 s on the H200
    host, where three processes spent ~25 s on it): the generated file imports and registers
    its backend, its generated tests pass (run here by ``pytest.main``), a smoke run, then the
    numerics and anti-cheating checks. The first failure ends the task; the parent marks the
    later steps as blocked."""
    _setup_torch()
    steps: dict[str, Any] = {}
    from pytest_opprof.capture.system import resolve_device

    device = resolve_device(_options(spec).device)
    module = _validate_import(spec, steps)
    if module is not None:
        _compile_off_gpu(device)
        steps["tests"] = _generated_tests(spec)
        phase("generated tests")
        _step_done(device)
    if module is None or steps["tests"].status == "fail":
        _write_steps(spec, steps)
        return
    import torch

    torch._dynamo.reset()  # the tests' compiled graphs are not the smoke run's
    _compile_off_gpu(device)  # the reset cleared Dynamo's callbacks
    # The tests imported the file again and re-registered its backend, which now records into
    # that copy's PASS_RESULTS: import it once more, so what the smoke run applies is ours.
    module = _import_generated(Path(spec["generated"]))
    _validate_run(spec, module, steps)


def _validate_import(spec: dict[str, Any], steps: dict[str, Any]) -> Any:
    """Steps 2 and 3: import, registration. Returns the module, or None after a failure."""
    import torch

    from pytest_opprof.schema import StepResult

    path = Path(spec["generated"])
    try:
        module = _import_generated(path)
        steps["import"] = StepResult(status="pass", detail=f"imported {path.name}")
    except BaseException as exc:
        steps["import"] = StepResult(status="fail", detail=f"{type(exc).__name__}: {exc}")
        return None
    name = getattr(module, "BACKEND", None)
    listed = torch._dynamo.list_backends(exclude_tags=())
    ok = isinstance(name, str) and name in listed
    steps["registration"] = StepResult(
        status="pass" if ok else "fail",
        detail=f"backend {name!r} is registered"
        if ok
        else f"backend {name!r} is not in torch._dynamo.list_backends(); the file must call "
        "runtime.register_backend(BACKEND, ...) at import",
    )
    return module if ok else None


def _generated_tests(spec: dict[str, Any]) -> Any:
    """Step 4: ``test_<stem>_optimized.py`` by ``pytest.main`` in this process, its output in
    ``generated_tests.log``; a failure names the failing tests."""
    import contextlib
    import io

    import pytest

    from pytest_opprof.schema import StepResult, write_text_atomic

    generated = Path(spec["generated"])
    test_file = generated.with_name(f"test_{generated.name}")
    log = Path(spec["tests_log"])
    if not test_file.exists():
        return StepResult(status="fail", detail=f"{test_file.name} is missing; re-run backend")
    args = [
        str(test_file),
        "-q",
        "-rf",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:opprof",
        "--rootdir",
        str(test_file.parent),
        "-c",
        os.devnull,
        # the user's conftests above the output folder are not the generated tests' (and,
        # with the plugin off, their pytest_opprof_* hooks would be unknown hooks)
        "--confcutdir",
        str(test_file.parent),
    ]
    os.environ["COLUMNS"] = "400"  # untruncated short summary lines
    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(test_file.parent)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = int(pytest.main(args))
    finally:
        os.chdir(cwd)
    text = out.getvalue()
    write_text_atomic(log, text)
    lines = text.strip().splitlines() or ["no output"]
    if code == 0:
        return StepResult(status="pass", detail=lines[-1].strip("= "))
    # Name the failing checks: pytest's short summary ("FAILED file::test[seed] - reason").
    failed = [line.split("::", 1)[-1] for line in lines if line.startswith("FAILED ")]
    shown = "; ".join(failed[:3]) + (f"; … {len(failed) - 3} more" if len(failed) > 3 else "")
    return StepResult(
        status="fail",
        detail=f"{test_file.name}: {lines[-1].strip('= ')}: {shown} (see {log.name})",
    )


def _write_steps(spec: dict[str, Any], steps: dict[str, Any], **extra: Any) -> None:
    payload = {"steps": {k: v.model_dump() for k, v in steps.items()}, **extra}
    from pytest_opprof.schema import write_text_atomic

    write_text_atomic(Path(spec["result"]), json.dumps(payload, indent=2))


def _validate_run(spec: dict[str, Any], module: Any, steps: dict[str, Any]) -> None:
    """Validation step 5, a smoke run (1 warmup, 1 measured call), and the candidate's outputs
    for step 6 (``task_validate_numerics``), saved to ``spec["outputs"]``."""
    import torch

    from pytest_opprof.backend import runtime
    from pytest_opprof.backend.model_graph import ModelGraph
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize
    from pytest_opprof.schema import PassStatus, StepResult
    from pytest_opprof.validate import SEEDS, run_candidate

    opts = _options(spec)
    device = resolve_device(opts.device)
    try:
        # The file's input serves as the template of the fresh inputs only: the judge draws
        # its own from the workload's, with the same seeds.
        model, x = module.get_model_and_input()
        template = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        fn = runtime.optimized_callable(module, model)
        with torch.no_grad():
            fn(*template)
            synchronize(device)
            t0 = time.perf_counter()
            fn(*template)
            synchronize(device)
        steps["smoke"] = StepResult(
            status="pass",
            detail=(f"1 warmup + 1 measured call ran ({(time.perf_counter() - t0) * 1000:.3f} ms)"),
        )
        _step_done(device)
    except BaseException as exc:
        steps["smoke"] = StepResult(status="fail", detail=f"{type(exc).__name__}: {exc}"[:500])
        steps["numerics"] = StepResult(status="skipped", detail="blocked by smoke")
        _write_steps(spec, steps)
        return
    # The outputs only: they are judged in a process that never imported this file
    # (task_validate_numerics), which could otherwise patch torch or the checks themselves.
    run_candidate(fn, template, SEEDS).save(Path(spec["outputs"]))
    phase("candidate outputs")
    results = list(getattr(module, "PASS_RESULTS", []))
    passes = [
        PassStatus(name=r.name, status=r.status, detail=r.detail, matches=r.matches)
        for r in results
    ]
    if isinstance(fn, ModelGraph):
        recorded = fn.captured and fn.replays > 0
        passes.append(
            PassStatus(
                name="cuda_graphs-model",
                status="APPLIED" if recorded and not fn.fallbacks else "NOT_APPLIED",
                detail=f"whole-model CUDA graph {'recorded' if fn.captured else 'not recorded'}: "
                f"{fn.replays} replays, {fn.fallbacks} calls ran uncaptured",
                matches=int(recorded),
            )
        )
    _write_steps(spec, steps, passes=[p.model_dump() for p in passes])


def task_validate_numerics(spec: dict[str, Any]) -> None:
    """Validation step 6 in a process that never imported the file under test: the workload
    loaded here is the reference (seeded as the generated file seeds its copy), the
    candidate's outputs are read from ``spec["outputs"]`` (tensors only), and the tolerances
    come from the plan's compute dtype and the workload's OPPROF, never from the file."""
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.schema import StepResult
    from pytest_opprof.tolerances import tolerance_for
    from pytest_opprof.validate import CandidateOutputs, calibrated, judge

    _setup_torch()
    device = resolve_device(_options(spec).device)
    reference = _load_baseline(spec, device)
    got = CandidateOutputs.load(Path(spec["outputs"]))
    dtype = spec.get("dtype")
    rtol, atol = tolerance_for(dtype, spec.get("overrides"))
    numerics, checks = judge(
        reference.model,
        reference.inputs,
        got,
        dtype=dtype,
        rtol=rtol,
        atol=atol,
        calibrate=calibrated(spec.get("overrides")),
    )
    failed = [k for k, v in checks.items() if v.status == "fail"]
    step = StepResult(
        status="fail" if failed else "pass",
        detail="; ".join(f"{k}: {checks[k].detail}" for k in failed)
        if failed
        else checks["equivalent"].detail,
    )
    _write_steps(
        spec,
        {"numerics": step},
        numerics=numerics.model_dump(),
        checks={k: v.model_dump() for k, v in checks.items()},
    )


def task_validate_llm_passes(spec: dict[str, Any]) -> None:
    """Stage 3 for LLM-written passes (``spec["passes"]``: proposal id and file): each is
    imported here, in a child process, run on the baseline's Dynamo graph (no Inductor, no
    other pass) and checked against a separate eager copy of the model with the backend's
    checks at the baseline dtype. None of them enters the generated backend."""
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.schema import write_text_atomic
    from pytest_opprof.validate import check_llm_pass

    _setup_torch()
    device = resolve_device(_options(spec).device)

    def load() -> Any:
        return _load_baseline(spec, device)

    checked = [
        check_llm_pass(e["id"], Path(e["file"]), load, spec.get("overrides")).model_dump()
        for e in spec["passes"]
    ]
    write_text_atomic(Path(spec["result"]), json.dumps({"llm_passes": checked}, indent=2))


def _optimized_calls(
    spec: dict[str, Any], device: str, w: Any, *, retime: bool = False
) -> dict[str, Any]:
    """What the recapture times: eager, the compiled baseline, the optimized workload through
    its backend (in its CUDA graph where the plan says so) and, when the dtype changed, the
    same plan at the baseline dtype; with the pairs whose ratios are reported, the twins the
    timeline profiles first (a CUDA-graph variant uncaptured) and the compile seconds. A
    ``retime`` process builds neither the baseline-dtype plan nor a twin compiled anew: it
    times, it draws no timeline."""
    import torch

    from pytest_opprof.backend.build import build
    from pytest_opprof.backend.model_graph import ModelGraph, uncaptured
    from pytest_opprof.schema import BackendSelection, read_artifact

    opts = _options(spec)
    out_dir = Path(spec["out_dir"])
    module = _import_generated(Path(spec["generated"]), sha256=spec.get("sha256"))
    model, _ = module.get_model_and_input()
    compile_s: dict[str, float] = {}
    compiled, compile_s["compile"] = _compile_timed(w.model, opts.compile_backend, w.inputs, device)
    if getattr(module, "COMPILE", True):
        optimized, compile_s["optimized"] = _compile_timed(model, module.BACKEND, w.inputs, device)
    else:
        optimized = model
    twins: dict[str, Any] = {}
    if getattr(module, "CUDA_GRAPH", False) and device == "cuda":
        optimized = ModelGraph(optimized)
        t0 = time.perf_counter()
        with torch.no_grad():
            optimized(*w.inputs)  # warmup and recording
        compile_s["cuda_graph_capture"] = time.perf_counter() - t0
        twins["optimized"] = uncaptured(optimized)
        _step_done(device)
    calls: dict[str, Any] = {"eager": w.model, "compile": compiled, "optimized": optimized}
    pairs = [("eager", "compile"), ("eager", "optimized"), ("compile", "optimized")]
    selection_path = out_dir / "profiler_output" / "backend_selection.json"
    if selection_path.exists():
        plan = read_artifact(selection_path, BackendSelection).plan
        if not retime and device == "cuda" and plan.config_patches.get("triton.cudagraphs"):
            # Inductor's graphs: the same plan compiled without them is the twin.
            torch.manual_seed(0)
            patches = {k: v for k, v in plan.config_patches.items() if k != "triton.cudagraphs"}
            without = plan.model_copy(update={"config_patches": patches})
            twins["optimized"] = build(_load_baseline(spec, device).model, w.inputs, without).fn
            _step_done(device)
        if not retime and plan.dtype not in (None, "float32"):
            torch.manual_seed(0)
            same = build(_load_baseline(spec, device).model, w.inputs, plan.without_dtype())
            with torch.no_grad():
                t0 = time.perf_counter()
                same.fn(*w.inputs)
            compile_s["optimized_baseline_dtype"] = time.perf_counter() - t0
            _step_done(device)
            calls["optimized_baseline_dtype"] = same.fn
            pairs += [
                ("eager", "optimized_baseline_dtype"),
                ("compile", "optimized_baseline_dtype"),
            ]
    note_tuned_gemms()
    return {
        "calls": calls,
        "pairs": pairs,
        "twins": twins,
        "compile_s": compile_s,
        "backend": module.BACKEND,
    }


def _time_calls(spec: dict[str, Any], calls: dict[str, Any], inputs: Any, device: str) -> Any:
    from pytest_opprof.capture.timing import time_interleaved

    return time_interleaved(
        calls,
        inputs,
        device=device,
        warmup=_setting(spec, "warmup_iters"),
        calls_per_round=_setting(spec, "measure_iters"),
        rounds=_setting(spec, "rounds"),
        any_cpu=devicelock.quiet_now(),
    )


def task_recapture(spec: dict[str, Any]) -> None:
    """Stage 4: the optimized workload through its backend, timed interleaved with eager and
    the compiled baseline (and, when the dtype changed, the same plan at the baseline dtype),
    its timeline, and each call's GPU time with the host hidden."""
    from pytest_opprof.capture.system import environment, resolve_device
    from pytest_opprof.schema import Profile, write_artifact

    _setup_torch()
    device = resolve_device(_options(spec).device)
    out_dir = Path(spec["out_dir"])
    w = _load_baseline(spec, device)
    info = environment(device)
    built = _optimized_calls(spec, device, w)
    optimized = built["calls"]["optimized"]
    with devicelock.measuring(share_after=False, quiet=True):  # its last GPU work
        samples = _time_calls(spec, built["calls"], w.inputs, device)
        timelines, flags = _timelines(
            spec,
            {"optimized": (optimized, f"torch.compile(backend={built['backend']!r})")},
            w.inputs,
            device,
            out_dir,
            built["twins"],
        )
        gpu_ms = _gpu_time(built["calls"], w.inputs, device, samples, timelines)
    timing = _timing(
        samples,
        device,
        built["pairs"],
        timelines,
        built["compile_s"],
        gpu_ms,
    )
    profile = Profile(
        capture_metadata=_metadata(spec, w, device, info),
        timing=timing,
        timelines=timelines,
        edge_case_flags=flags,
    )
    write_artifact(out_dir / "profile_optimized.json", profile)


def task_retime(spec: dict[str, Any]) -> None:
    """Stage 4, once more in a fresh process: the recapture's calls built and timed again the
    same way (no timeline), the samples written to ``spec["result"]`` for the parent to pool.
    A host-bound baseline runs at a different speed in each process; only more processes show
    how much. The same plan at the baseline dtype is left out (one more compile per process):
    its ratios stay the recapture's own."""
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.schema import write_text_atomic

    _setup_torch()
    device = resolve_device(_options(spec).device)
    w = _load_baseline(spec, device)
    built = _optimized_calls(spec, device, w, retime=True)
    with devicelock.measuring(share_after=False, quiet=True):  # its last GPU work
        samples = _time_calls(spec, built["calls"], w.inputs, device)
    phase("timed again")
    write_text_atomic(Path(spec["result"]), json.dumps(samples.to_json()))


TASKS = {
    "capture": task_capture,
    "counters_target": task_counters_target,
    "select": task_select,
    "validate": task_validate,
    "validate_numerics": task_validate_numerics,
    "validate_llm_passes": task_validate_llm_passes,
    "recapture": task_recapture,
    "retime": task_retime,
}


if __name__ == "__main__":
    phase(f"started at {wall_clock()}")
    sys.exit(main())
