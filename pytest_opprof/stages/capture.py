"""Stage 0, capture: the workload's timing (eager and the compiled baseline, interleaved), its
timelines and, on a GPU with Nsight Compute, its hardware counters.

The parent half (``run``) starts the child and reads ``profile.json`` back; the child half
(``task_capture``) does the work in the stage process. By default the counters pass is not
the capture's: the child leaves the profile's counters pending and the parent runs the pass
in a process of its own (``task_counters``) beside the later stages, which the report waits
for (:class:`CountersBeside`). ``metadata``, ``timelines``,
``gpu_time`` and ``timing_of`` are shared with the recapture, which profiles the optimized
workload the same way.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof import devicelock
from pytest_opprof.capture.counters import pending
from pytest_opprof.errors import OpprofError
from pytest_opprof.pipeline import WorkloadRun
from pytest_opprof.schema import (
    CaptureMetadata,
    ChildSpec,
    Profile,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages import common

if TYPE_CHECKING:
    from pytest_opprof.capture.timing import RoundSamples

NAME = "capture"


REPORT = "report"
"""The stage that takes up the counters pass run beside (``run.ahead[REPORT]``): the report
reads the counters, nothing before it does."""


def run(run: WorkloadRun) -> str:
    later = run.base_setting("ncu_when") == "beside" and REPORT in run.planned
    run.run_child("capture", "capture", counters_beside=later)
    profile = read_artifact(run.out_dir / "profile.json", Profile)
    t = profile.timing
    eager, comp = t.variants["eager"], t.variants["compile"]
    said = (
        f"eager {eager.median_ms:.4f} ms, torch.compile {comp.median_ms:.4f} ms on "
        f"{profile.capture_metadata.device_name}"
    )
    if not pending(profile):
        return said
    if fits_beside(run, profile):
        run.ahead[REPORT] = CountersBeside(run)
        return said + "; the counters pass runs beside the later stages"
    counters_pass(run)
    return said


def fits_beside(run: WorkloadRun, profile: Profile) -> bool:
    """Whether the counters pass may run beside the later stages: under a GPU lock, which
    keeps the other processes' measurements apart from its replay, and where the capture's
    peak memory says its target fits beside the most processes a workload runs at once (the
    recapture's timing processes beside validation's)."""
    meta = profile.capture_metadata
    return common.side_by_side(meta, common.timing_processes(run, meta.device_type) + 2)


def counters_pass(run: WorkloadRun) -> None:
    """The counters pass of a profile the capture left pending, in a process of its own
    (``task_counters``), which rewrites the profile with them. A pass that fails leaves the
    profile without counters and says why in its warnings, never pending: the report stands
    without counters, as where ncu is absent."""
    try:
        run.run_child("counters", "capture", log_name="counters")
    except OpprofError as exc:
        path = run.out_dir / "profile.json"
        profile = read_artifact(path, Profile)
        if pending(profile):
            note = f"the counters pass failed: {exc}"
            update = {"counters": {"note": note}, "warnings": [*profile.warnings, note]}
            write_artifact(path, profile.model_copy(update=update))


class CountersBeside:
    """The counters pass in a thread of the parent (its process, :func:`counters_pass`) while
    the later stages run; the report waits for it (:func:`await_counters`). The pass and the
    stages share the GPU through its lock like any two processes of the session: the
    target's replay holds it shared, measurements alone. Started only where the proposals
    need no counters (``--opprof-ncu-when=beside``): on the real profiles of the examples
    the rules propose the same from the timeline alone."""

    def __init__(self, run: WorkloadRun) -> None:
        self._future = common.in_background(
            lambda: counters_pass(run), f"opprof-counters-{run.name}"
        )

    def wait(self) -> None:
        self._future.result()


def await_counters(run: WorkloadRun) -> None:
    """The counters pass started beside the later stages, ended: the profile then holds its
    counters (or why there are none). Nothing where none was started."""
    beside = run.ahead.pop(REPORT, None)
    if isinstance(beside, CountersBeside):
        beside.wait()


def run_metadata(spec: ChildSpec, w: Any, device: str, info: dict[str, Any]) -> Any:
    import torch

    from pytest_opprof.capture.system import fingerprint
    from pytest_opprof.workload import WorkloadSpec

    opts = common.options(spec)
    params = list(w.model.parameters())
    return CaptureMetadata(
        workload=Path(spec.workload).stem,
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
        warmup_iters=common.setting(spec, "warmup_iters"),
        measure_iters=common.setting(spec, "measure_iters"),
        rounds=common.setting(spec, "rounds"),
        compile_mode=f"torch.compile(backend={opts.compile_backend!r})",
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment_fingerprint=fingerprint(info),
        workload_sha256=WorkloadSpec(Path(spec.workload)).sha256(),
        cpu_fallback=device == "cpu",
        visible_devices=info.get("visible_devices"),
        device_count=info.get("device_count"),
        device_uuid=info.get("device_uuid"),
        peak_memory_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None,
        device_memory_bytes=info.get("device_memory"),
    )


def draw_timelines(
    spec: ChildSpec,
    calls: dict[str, tuple[Any, str]],
    inputs: Any,
    device: str,
    out_dir: Path,
    twins: dict[str, Any] | None = None,
) -> tuple[list[Any], list[Any]]:
    """Profile each call; a label in ``twins`` (a CUDA-graph variant) is first profiled as its
    uncaptured twin, whose trace places the replayed kernels (``attribution.replay_twin``)."""
    from pytest_opprof.capture.attribution import replay_twin
    from pytest_opprof.capture.provenance import collect_inductor_provenance
    from pytest_opprof.capture.timeline import capture_timeline
    from pytest_opprof.capture.trace import provenance_file, trace_file

    stem = Path(spec.workload).stem
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
            iterations=spec.timeline_iters,
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


GPU_TIMES = "GPU times with the host hidden in"
"""The phase that says how long a measurement's GPU-time pass took (``benchmarks/gpu_timeline.py``
sums them)."""


def gpu_time(
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

    t0 = time.perf_counter()
    got = gpu_time(
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
    if got:  # what the pass held the GPU for, from the stage log
        common.phase(f"{GPU_TIMES} {time.perf_counter() - t0:.2f} s")
    return got


def timing_of(
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


def time_calls(spec: ChildSpec, calls: dict[str, Any], inputs: Any, device: str) -> Any:
    from pytest_opprof.capture.timing import time_interleaved

    return time_interleaved(
        calls,
        inputs,
        device=device,
        warmup=common.setting(spec, "warmup_iters"),
        calls_per_round=common.setting(spec, "measure_iters"),
        rounds=common.setting(spec, "rounds"),
        any_cpu=devicelock.quiet_now(),
    )


def task_capture(spec: ChildSpec) -> None:
    """Stage 0: graph summary, timing (eager vs compiled, interleaved), both timelines, and
    each call's GPU time with the host hidden (what the timelines' kernel time is checked
    against)."""
    from pytest_opprof.capture.graph import capture_graph
    from pytest_opprof.capture.system import environment, resolve_device
    from pytest_opprof.schema import Profile

    common.setup_torch()
    opts = common.options(spec)
    out_dir = Path(spec.out_dir)
    device = resolve_device(opts.device)
    w = common.load_baseline(spec, device)
    info = environment(device)
    write_artifact(out_dir / "graph.json", capture_graph(w.model, w.inputs))
    compiled, compile_s = common.compile_timed(w.model, opts.compile_backend, w.inputs, device)
    baselines = {"eager": w.model, "compile": compiled}
    mode = f"torch.compile(backend={opts.compile_backend!r})"
    # The counters pass, if it runs, shares the GPU again first (counters_for_capture).
    with devicelock.measuring(share_after=False, quiet=True):
        samples = time_calls(spec, baselines, w.inputs, device)
        timelines, flags = draw_timelines(
            spec,
            {"eager": (w.model, "eager"), "compiled": (compiled, mode)},
            w.inputs,
            device,
            out_dir,
        )
        gpu_ms = gpu_time(baselines, w.inputs, device, samples, timelines)
    common.phase("timed and profiled")
    timing = timing_of(
        samples,
        device,
        [("eager", "compile")],
        timelines,
        {"compile": compile_s},
        gpu_ms,
    )
    from pytest_opprof.capture.counters import PENDING, counters_for_capture, find_ncu

    meta = run_metadata(spec, w, device, info)
    counters: dict[str, Any] | None
    notes: list[str]
    if spec.counters_beside and device == "cuda" and opts.ncu != "off" and find_ncu():
        # The parent runs the pass beside the later stages (task_counters).
        counters, notes = {PENDING: "the counters pass runs beside the later stages"}, []
    else:
        timelines, counters, notes = counters_for_capture(
            spec.model_dump(mode="json"), timelines, info, opts, meta.dtype, device
        )
        common.phase("counters pass")
    common.step_done(device)  # after the Nsight Compute pass, if it ran
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
    write_artifact(out_dir / spec.profile_name, profile)


def task_counters(spec: ChildSpec) -> None:
    """The counters pass of a profile the capture left pending (``--opprof-ncu-when=beside``),
    run beside the later stages: the profile rewritten with its counters, atomically (a stage
    reading it meanwhile reads the one or the other; they differ in the counters alone). Its
    proposals were made from the timeline alone: where the counters make the rules propose
    what the timeline did not, the profile says which and how to try them."""
    from pytest_opprof.capture.counters import counters_for_capture, pending

    opts = common.options(spec)
    path = Path(spec.out_dir) / spec.profile_name
    profile = read_artifact(path, Profile)
    if not pending(profile):
        return
    meta = profile.capture_metadata
    timelines, counters, notes = counters_for_capture(
        spec.model_dump(mode="json"),
        profile.timelines,
        meta.model_dump(),
        opts,
        meta.dtype,
        meta.device_type,
    )
    common.phase("counters pass")
    done = profile.model_copy(update={"timelines": timelines, "counters": counters})
    try:
        notes += proposals_counters_add(spec, profile, done)
    except Exception as exc:  # a bug of ours comparing: said, the counters kept
        notes.append(f"the proposals were not compared with the counters: {exc!r}")
    write_artifact(path, done.model_copy(update={"warnings": [*profile.warnings, *notes]}))


def proposals_counters_add(spec: ChildSpec, before: Profile, after: Profile) -> list[str]:
    """A warning naming the rules' proposals for ``after`` (with counters) that ``before``
    (the timeline alone) did not give, by type and targets; none where they agree."""
    from pytest_opprof.propose import propose
    from pytest_opprof.schema import FxGraphSummary

    graph_path = Path(spec.out_dir) / "graph.json"
    graph = read_artifact(graph_path, FxGraphSummary) if graph_path.exists() else None
    opts = common.options(spec)
    kwargs = {
        "min_confidence": opts.min_confidence,
        "max_opts": opts.max_opts,
        "skip": common.setting(spec, "skip") or (),
    }
    made = {(p.type, tuple(p.targets)) for p in propose(before, graph, **kwargs).proposals}
    now = propose(after, graph, **kwargs).proposals
    added = [p for p in now if (p.type, tuple(p.targets)) not in made]
    if not added:
        return []
    named = ", ".join(f"{p.type} ({', '.join(p.targets) or 'the model'})" for p in added)
    return [
        f"the counters, read beside the later stages, add proposals the timeline alone did "
        f"not give: {named}; run with --opprof-ncu-when=first to try them"
    ]


def task_counters_target(spec: ChildSpec) -> None:
    """The process ncu profiles: for each of ``counters_labels`` in turn, compile as the
    timeline did (``compiled``) or not (``eager``), warm up, one call inside that label's NVTX
    range (``capture.counters.range_name``), synchronize. With ``gpu_lock`` it joins the GPU's
    lock once torch is imported and holds it shared for its GPU work, its compile off the GPU
    where its CPUs are its own, making way between labels; its parent holds nothing of it."""
    import torch

    from pytest_opprof.capture.counters import range_name
    from pytest_opprof.workload import load

    common.setup_torch()  # the timeline's Dynamo/Inductor settings
    common.phase("torch imported (under ncu)")
    if spec.gpu_lock:
        os.environ[devicelock.LOCK_ENV] = spec.gpu_lock
        devicelock.join(note=common.phase)
    opts = common.options(spec)
    w = load(Path(spec.workload), "cuda")
    common.phase("workload loaded")
    for label in spec.counters_labels or [spec.counters_label]:
        fn: Any = w.model
        if label != "eager":
            common.compile_off_gpu("cuda")
            fn = torch.compile(w.model, backend=opts.compile_backend)
        with torch.no_grad():
            for _ in range(spec.counters_warmup):
                fn(*w.inputs)
            torch.cuda.synchronize()
            common.phase(f"{label}: warmed up")
            with torch.cuda.nvtx.range(range_name(label)):
                fn(*w.inputs)
            torch.cuda.synchronize()
            common.phase(f"{label}: iteration replayed")
        devicelock.make_way()  # a measurer waiting goes before the next label's work


TASKS: dict[str, Callable[[ChildSpec], None]] = {
    "capture": task_capture,
    "counters": task_counters,
    "counters_target": task_counters_target,
}
"""The child halves, by the task name a spec carries (``runner`` dispatches them)."""
