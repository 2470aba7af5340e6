"""Stage 4, recapture: the optimized workload, through its backend, timed interleaved with
both baselines in one or more timing processes (pooled), with its timeline. Only the file
the validation report's sha256 names is timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pytest_opprof import devicelock, forkserver
from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.errors import OpprofError, StageBlocked, StageError
from pytest_opprof.measure import Replica, pooled_timing, processes_kept, processes_set_aside
from pytest_opprof.pipeline import STOCK_FILE, WorkloadRun, file_sha256, rel_path
from pytest_opprof.schema import (
    BackendSelection,
    ChildSpec,
    Profile,
    Timing,
    ValidationReport,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages import capture, common
from pytest_opprof.stages.common import side_by_side, timing_processes

NAME = "recapture"


def warm_timing_servers(run: WorkloadRun) -> None:
    """Where ``--opprof-timing-servers`` spreads the recapture's timing processes over several
    fork servers (``_retime_one``), start those past the first in the background at the
    workload's first stage, so that their torch import is over long before the recapture.
    Each import holds the host's CPU work (``devicelock.host_work``): a quiet measurement
    waits until it ends. Nothing where the timing processes are new interpreters or one. The
    device is the capture's, or before it a GPU wherever the session named a GPU lock."""
    servers = timing_servers(run)
    if run.setting("fresh_timing") or servers <= 1:
        return
    device_type = "cuda" if os.environ.get(LOCK_ENV) else "cpu"
    profile = run.out_dir / "profile.json"
    if profile.exists():
        with contextlib.suppress(OpprofError):  # the stages say what is wrong with it
            device_type = read_artifact(profile, Profile).capture_metadata.device_type
    processes = timing_processes(run, device_type)
    slots = {forkserver.slot_of(i, servers) for i in range(1, processes)} - {0}
    if slots:
        forkserver.warm(sorted(slots), devicelock.host_work)


def run(run: WorkloadRun) -> str:
    report = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
    if report.overall != "READY_FOR_PROFILING":
        raise StageBlocked(f"blocked by validate: {report.message}")
    digest = validated_digest(run, report)
    ahead = run.ahead.pop(NAME, None)
    if isinstance(ahead, Ahead) and ahead.digest == digest:
        timed = ahead.timed()  # started while validate ran: its error is this stage's
    else:
        with tempfile.TemporaryDirectory(prefix="opprof-retime-") as tmp:
            timed = _timed(run, digest, Path(tmp))
    replicas, processes, together = timed
    path = run.out_dir / "profile_optimized.json"
    prof = read_artifact(path, Profile)
    retimed = ""
    if processes > 1:
        warnings = list(prof.warnings)
        warnings += [
            f"timing process {i + 1} of {processes} failed: {r}"
            for i, r in enumerate(replicas, start=1)
            if isinstance(r, str)
        ]
        measured = {i: r for i, r in enumerate(replicas, start=1) if isinstance(r, Replica)}
        timing, retimed, failed = _replacing_set_aside(
            run, digest, prof.timing, measured, processes
        )
        warnings += [*failed, retimed] if retimed else failed
        prof = prof.model_copy(update={"timing": timing, "warnings": warnings})
        write_artifact(path, prof)
    opt = prof.timing.variants["optimized"]
    stock = prof.timing.variants.get("stock")
    also = f"; stock {stock.median_ms:.4f} ms" if stock else ""
    if opt.processes == 1:
        return f"optimized {opt.median_ms:.4f} ms{also}"
    how = "side by side" if together else "one after another"
    said = f"optimized {opt.median_ms:.4f} ms ({opt.processes} processes, {how}){also}"
    return f"{said}; {retimed}" if retimed else said


RETIMES = 3
"""At most this many timing processes are added, one after another, in place of processes
whose every round was set aside (``_replacing_set_aside``): as many as a GPU's default asks
for. A host slowed through that many more processes is slowed for the run, and more would
only lengthen the stage; the timing then stands as measured."""


def _replacing_set_aside(
    run: WorkloadRun, digest: str, own: Timing, replicas: dict[int, Replica], asked: int
) -> tuple[Timing, str, list[str]]:
    """``own`` (the recapture's timing) pooled with its other timing processes' ``replicas``
    (by ``_retime_one``'s index), and, where a process's every round ran on a slowed host and
    was set aside, more processes timed one after another (``_retime_one``, indices past the
    ``asked`` ones) until as many keep rounds (``measure.processes_kept``) as timed, at most
    :data:`RETIMES`. Every process's rounds stay pooled and the set-aside is found anew over
    all of them. With the timing: what was retimed and why (empty where nothing was), and a
    warning for each added process that failed.

    A process counts while it keeps any round, as the statistics count it (``measure._kept``):
    its kept rounds ran on a fast host, where a call's speed is steady within a process
    (``common.TIMING_PROCESSES_GPU``), so even a few give its level and a degree of freedom to the
    interval. A process that failed is not replaced: its cause (a compile error, memory) would
    most often fail the next one too, and its own warning says the timing has fewer processes.

    The added processes run after the others have ended, in a folder of their own (an
    ``Ahead``'s is removed with its processes), and after validation passed the file: no gate.
    """
    replicas = dict(replicas)
    timing = pooled_timing(own, list(replicas.values()))
    wanted = 1 + len(replicas)
    if processes_kept(timing) >= wanted:
        return timing, "", []
    index = [0, *replicas]  # each pooled process's _retime_one index (0: the recapture's one)
    named: list[int] = []
    failed: list[str] = []
    more = 0
    fresh = bool(run.setting("fresh_timing"))
    with tempfile.TemporaryDirectory(prefix="opprof-retime-") as tmp:
        while processes_kept(timing) < wanted and more < RETIMES:
            named += [index[p] for p in processes_set_aside(timing) if index[p] not in named]
            i = asked + more
            more += 1
            got = _retime_one(run, i, Path(tmp), digest, fresh=fresh)
            if isinstance(got, str):
                failed.append(f"timing process {i + 1} failed: {got}")
                continue
            replicas[i] = got
            index.append(i)
            timing = pooled_timing(own, list(replicas.values()))
    named += [index[p] for p in processes_set_aside(timing) if index[p] not in named]
    which = ", ".join(str(i + 1) for i in named)
    times = {1: "once", 2: "twice"}.get(more, f"{more} times")
    said = f"timing process{'es' * (len(named) > 1)} {which} set aside whole (host slowed); "
    said += f"timed {times} more"
    kept = processes_kept(timing)
    if kept < wanted:
        said += f"; {kept} keep rounds of the {asked} asked for: the timing stands as measured"
    return timing, said, failed


Timed = tuple[list[Replica | str], int, bool]
"""The timing processes past the first (their rounds, or why one failed), how many processes
timed, and whether side by side."""


def _timed(run: WorkloadRun, digest: str, folder: Path, gate: Path | None = None) -> Timed:
    """The recapture's timing processes, run in ``folder``: the recapture's own (which writes
    ``profile_optimized.json``) and the ones past it (``_retime_one``). With ``gate``, each
    waits there before it times (:func:`_await_validation`)."""
    baseline = read_artifact(run.out_dir / "profile.json", Profile).capture_metadata
    processes = timing_processes(run, baseline.device_type)
    together = processes > 1 and side_by_side(baseline, processes)
    fresh = bool(run.setting("fresh_timing"))
    generated = str(run.generated.resolve())
    awaits = str(gate) if gate is not None else None
    if not together:
        run.run_child("recapture", "recapture", generated=generated, sha256=digest, gate=awaits)
        replicas = [
            _retime_one(run, i, folder, digest, fresh=fresh, gate=gate) for i in range(1, processes)
        ]
        return replicas, processes, together
    # Each process compiles while the others do; they measure one at a time, none beside
    # another's compile (the siblings' lock: devicelock).
    siblings = folder / "siblings.lock"
    pool = ThreadPoolExecutor(processes - 1)
    pending = [
        pool.submit(_retime_one, run, i, folder, digest, siblings=siblings, fresh=fresh, gate=gate)
        for i in range(1, processes)
    ]
    try:
        run.run_child(
            "recapture",
            "recapture",
            generated=generated,
            sha256=digest,
            shares_cpus=True,
            compile_pool=tunes_anew(run),
            siblings_lock=str(siblings),
            gate=awaits,
        )
    except BaseException as exc:
        # A failed recapture waits for its timing processes (none outlives its stage or its
        # folder); an interrupt does not (the session's end stops them).
        pool.shutdown(wait=not isinstance(exc, KeyboardInterrupt), cancel_futures=True)
        raise
    replicas = [f.result() for f in pending]
    pool.shutdown()
    return replicas, processes, together


class Ahead:
    """The recapture started while validate runs (:func:`start_ahead`): its processes import
    the generated file and compile it (the longest part of the stage, Inductor's caches
    answering) beside the validation, and wait before they time until validate has ended
    (:meth:`validation_ended`), the gate then holding the sha256 it passed. Nothing is timed that
    validation did not pass, byte for byte (``_await_validation``); where it blocked the file,
    they end untimed."""

    def __init__(self, run: WorkloadRun, digest: str) -> None:
        self.digest = digest
        self.folder = Path(tempfile.mkdtemp(prefix="opprof-retime-"))
        self.gate = self.folder / "validated"
        self._future = common.in_background(lambda: self._run(run), f"opprof-recapture-{run.name}")

    def _run(self, run: WorkloadRun) -> Timed:
        try:
            return _timed(run, self.digest, self.folder, self.gate)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def validation_ended(self, report: ValidationReport | None) -> None:
        """Validation's end: the processes time where ``report`` passed the file they compiled
        (the gate holds its sha256), and end untimed where it blocked the file or none was
        written (the gate holds nothing)."""
        passed = report.sha256 if report and report.overall == "READY_FOR_PROFILING" else ""
        write_text_atomic(self.gate, passed)

    def timed(self) -> Timed:
        """What :func:`_timed` returned, once every process has ended; its error, raised."""
        return self._future.result()


def start_ahead(run: WorkloadRun) -> Ahead | None:
    """At the validate stage's start, the recapture started beside it (:class:`Ahead`, kept
    in ``run.ahead`` for :func:`run` to take up), where this session runs the recapture next
    (``run.planned``), the capture's profile it reads is there and, on a GPU, the timing
    processes fit in its memory beside validation's (``side_by_side``); None elsewhere. The
    recapture's processes spend most of their time compiling, and validation mostly waits on
    its own compiles and the GPU: one after the other they made a workload's longest wait
    (docs/design-notes.md#the-recapture-starts-beside-validation)."""
    profile = run.out_dir / "profile.json"
    if NAME not in run.planned or not profile.is_file() or not run.generated.is_file():
        return None
    if os.environ.get(LOCK_ENV):
        # beside validation's process, which holds as much as a timing process
        baseline = read_artifact(profile, Profile).capture_metadata
        processes = timing_processes(run, baseline.device_type)
        early = processes if processes > 1 and side_by_side(baseline, processes) else 1
        if not side_by_side(baseline, early + 1):
            return None
    run.timing_settings(), run.extra_passes()  # the hooks asked here, not in its thread
    ahead = Ahead(run, file_sha256(run.generated))
    run.ahead[NAME] = ahead
    return ahead


VALIDATED = "validation passed the file compiled here"
"""The phase a recapture started beside validation logs before it times (``_await_validation``)."""
UNVALIDATED = "nothing timed"
"""How that phase begins where validation did not pass the file, or never ended."""


def _await_validation(spec: ChildSpec, device: str) -> None:
    """In a recapture's process started beside validation (``spec.gate``): before anything is
    timed, wait until validate opens the gate, holding nothing of the GPU's lock meanwhile,
    and go on only where it passed the file this process imported (the gate holds the sha256
    validation passed; ``spec.sha256`` is the one imported). A parent gone, or the gate's
    folder with it, ends the wait with an error, as a blocked file does
    (``common.wait_for_file``)."""
    if spec.gate is None:
        return
    from pytest_opprof.capture.timing import synchronize

    gate = Path(spec.gate)
    synchronize(device)
    try:
        waited = common.wait_for_file(
            gate, "waiting for validation to end before timing", "validation did"
        )
    except StageError as exc:
        common.phase(f"{UNVALIDATED}: {exc}")
        raise StageError(f"{UNVALIDATED}: {exc}") from None
    if gate.read_text(encoding="utf-8").strip() != spec.sha256:
        common.phase(f"{UNVALIDATED}: validation did not pass the file compiled here")
        raise StageError(f"{UNVALIDATED}: validation did not pass the file compiled here")
    common.phase(f"{VALIDATED} after {waited or 0.0:.1f} s of waiting")


def tunes_anew(run: WorkloadRun) -> bool:
    """Whether the recapture's own process compiles a max-autotune plan no earlier stage
    compiled: the plan at the baseline dtype, where the plan autotunes and lowered precision
    (a plan that is the stock recipe is not compiled at the baseline dtype). Its templates
    are hundreds of new Triton kernels, which one thread compiles one by one while its timing
    processes wait (their compiles the caches answer): it keeps Inductor's compile workers
    (``ChildSpec.compile_pool``). Other plans compile far fewer kernels anew, and starting
    the workers would add to the wait."""
    path = run.profiler_output / "backend_selection.json"
    if not path.exists():
        return False
    plan = read_artifact(path, BackendSelection).plan
    autotunes = plan.stock_recipe is None and bool(plan.config_patches.get("max_autotune"))
    return autotunes and plan.dtype not in (None, "float32")


def validated_digest(run: WorkloadRun, report: ValidationReport) -> str:
    """The sha256 of the generated file, which must be the one ``report`` validated: the
    recapture never times a file that was edited after its validation."""
    digest = file_sha256(run.generated)
    if not report.sha256 or digest != report.sha256:
        raise StageError(
            f"{run.generated.name} is not the file validate checked (its sha256 differs from "
            "validation_report.json's): validate it again — `opprof validate "
            f"{rel_path(run.generated)}`, or run without --opprof-from/--opprof-stage"
        )
    return digest


def timing_servers(run: WorkloadRun) -> int:
    """The fork servers the timing processes are spread over (``--opprof-timing-servers``)."""
    return int(run.setting("timing_servers") or 1)


def _retime_one(
    run: WorkloadRun,
    i: int,
    folder: Path,
    digest: str,
    *,
    siblings: Path | None = None,
    fresh: bool = False,
    gate: Path | None = None,
) -> Replica | str:
    """The recapture's calls timed again in another process: its samples, or why it failed (a
    process that fails adds a warning, not an error: the others' timing stands).

    Forked processes come from the session's fork server, or with ``--opprof-timing-servers
    N`` from server ``i % N`` (``forkserver.slot_of``; the recapture from server 0, which
    every stage shares). Processes forked from one server share what it fixed at its start
    (its address layout, hash seed, the memory its imports were loaded into), and a
    launch-bound call's speed goes with the server, even with one layout and seed for all.
    Processes of one server repeat its offset, which their interval cannot show; processes of
    several draw one each, so their spread and the interval include it. Not the default: in
    the pipeline that offset was lost in larger noise, and the servers' imports slowed the
    captures (docs/design-notes.md#timing-servers).

    ``fresh`` (``--opprof-fresh-timing``): a new interpreter instead, a draw of its own, at a
    torch import on the stage's own time, which made a run much slower
    (docs/design-notes.md#fresh-timing-processes)."""
    result = folder / f"retime{i}.json"
    try:
        run.run_child(
            "retime",
            "recapture",
            log_name=f"retime{i}",
            fresh=fresh,
            server=forkserver.slot_of(i, timing_servers(run)),
            generated=str(run.generated.resolve()),
            sha256=digest,  # the validated bytes, not whatever the file holds by now
            result=result,
            shares_cpus=siblings is not None,
            siblings_lock=str(siblings) if siblings is not None else None,
            gate=str(gate) if gate is not None else None,
        )
        return Replica.from_json(json.loads(result.read_text(encoding="utf-8")))
    except (OpprofError, OSError, ValueError) as exc:
        return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def _optimized_calls(
    spec: ChildSpec, device: str, w: Any, *, retime: bool = False
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
    from pytest_opprof.schema import read_artifact

    opts = common.options(spec)
    out_dir = Path(spec.out_dir)
    module = common.import_generated(spec.need("generated"), sha256=spec.sha256)
    model, _ = module.get_model_and_input()
    compile_s: dict[str, float] = {}
    compiled, compile_s["compile"] = common.compile_timed(
        w.model, opts.compile_backend, w.inputs, device
    )
    if getattr(module, "COMPILE", True):
        optimized, compile_s["optimized"] = common.compile_timed(
            model, module.BACKEND, w.inputs, device
        )
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
        common.step_done(device)
    calls: dict[str, Any] = {"eager": w.model, "compile": compiled, "optimized": optimized}
    pairs = [("eager", "compile"), ("eager", "optimized"), ("compile", "optimized")]
    selection_path = out_dir / "profiler_output" / "backend_selection.json"
    ships_stock = False
    if selection_path.exists():
        plan = read_artifact(selection_path, BackendSelection).plan
        ships_stock = plan.stock_recipe is not None
        if not retime and device == "cuda" and plan.config_patches.get("triton.cudagraphs"):
            # Inductor's graphs: the same plan compiled without them is the twin.
            torch.manual_seed(0)
            patches = {k: v for k, v in plan.config_patches.items() if k != "triton.cudagraphs"}
            without = plan.model_copy(update={"config_patches": patches})
            twins["optimized"] = build(
                common.load_baseline(spec, device).model, w.inputs, without
            ).fn
            common.step_done(device)
        at_baseline_dtype = not retime and plan.dtype not in (None, "float32")
        if at_baseline_dtype and ships_stock:
            # Its graph changes are stock PyTorch's, not the backend's: at the baseline dtype
            # it would be a max-autotune compile no earlier stage made, for a figure that
            # splits no change of the tool's from its precision.
            common.phase("the plan is the stock recipe: not timed again at the baseline dtype")
        elif at_baseline_dtype:
            torch.manual_seed(0)
            same = build(common.load_baseline(spec, device).model, w.inputs, plan.without_dtype())
            with torch.no_grad():
                t0 = time.perf_counter()
                same.fn(*w.inputs)
            compile_s["optimized_baseline_dtype"] = time.perf_counter() - t0
            common.step_done(device)
            calls["optimized_baseline_dtype"] = same.fn
            pairs += [
                ("eager", "optimized_baseline_dtype"),
                ("compile", "optimized_baseline_dtype"),
            ]
    if ships_stock and common.measures_stock(spec):
        # The plan is the stock recipe (selection measured nothing faster): one program, timed
        # under both names rather than compiled twice, whose max-autotune choices could differ
        # by the noise of its own timings. Its ratio over stock is the timing's own spread.
        common.phase("the plan is the stock recipe: its call is timed as the stock baseline too")
        calls["stock"] = optimized
    else:
        stock_fn, stock_s = _stock_call(spec, out_dir, w, device)
        if stock_fn is not None:
            calls["stock"], compile_s["stock"] = stock_fn, stock_s
    if "stock" in calls:
        pairs += [("compile", "stock"), ("stock", "optimized")]
    common.note_tuned_gemms()
    return {
        "calls": calls,
        "pairs": pairs,
        "twins": twins,
        "compile_s": compile_s,
        "backend": module.BACKEND,
    }


def _stock_call(spec: ChildSpec, out_dir: Path, w: Any, device: str) -> tuple[Any, float]:
    """The stock recipe ``task_stock`` kept, compiled here (Inductor's caches answer most of
    it), and its compile seconds; (None, 0) where the stock baseline is not measured or no
    recipe passed."""
    from pytest_opprof.backend import stock
    from pytest_opprof.schema import StockBaseline, read_artifact

    path = out_dir / STOCK_FILE
    if not common.measures_stock(spec) or not path.exists():
        return None, 0.0
    chosen = read_artifact(path, StockBaseline)
    if chosen.recipe is None or chosen.dtype is None:
        return None, 0.0
    with common.autotuning(device):
        built = stock.build(
            chosen.recipe, w.model, w.inputs, chosen.dtype, first_call=common.first_call(w, device)
        )
    common.phase(f"compiled the stock recipe ({chosen.message}) in {built.compile_s:.1f} s")
    common.step_done(device)
    return built.fn, built.compile_s


def task_recapture(spec: ChildSpec) -> None:
    """Stage 4: the optimized workload through its backend, timed interleaved with eager and
    the compiled baseline (and, when the dtype changed, the same plan at the baseline dtype),
    its timeline, and each call's GPU time with the host hidden."""
    from pytest_opprof.capture.system import environment, resolve_device
    from pytest_opprof.schema import Profile, write_artifact

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    out_dir = Path(spec.out_dir)
    w = common.load_baseline(spec, device)
    info = environment(device)
    built = _optimized_calls(spec, device, w)
    optimized = built["calls"]["optimized"]
    _await_validation(spec, device)
    with devicelock.measuring(share_after=False, quiet=True):  # its last GPU work
        samples = capture.time_calls(spec, built["calls"], w.inputs, device)
        timelines, flags = capture.draw_timelines(
            spec,
            {"optimized": (optimized, f"torch.compile(backend={built['backend']!r})")},
            w.inputs,
            device,
            out_dir,
            built["twins"],
        )
        gpu_ms = capture.gpu_time(built["calls"], w.inputs, device, samples, timelines)
    timing = capture.timing_of(
        samples,
        device,
        built["pairs"],
        timelines,
        built["compile_s"],
        gpu_ms,
    )
    profile = Profile(
        capture_metadata=capture.run_metadata(spec, w, device, info),
        timing=timing,
        timelines=timelines,
        edge_case_flags=flags,
    )
    write_artifact(out_dir / "profile_optimized.json", profile)


def task_retime(spec: ChildSpec) -> None:
    """Stage 4, once more in a fresh process: the recapture's calls built and timed again the
    same way (no timeline), the samples written to ``spec.result`` for the parent to pool.
    A host-bound baseline runs at a different speed in each process; only more processes show
    how much. The same plan at the baseline dtype is left out (one more compile per process):
    its ratios stay the recapture's own."""
    from pytest_opprof.capture.system import resolve_device

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    w = common.load_baseline(spec, device)
    built = _optimized_calls(spec, device, w, retime=True)
    _await_validation(spec, device)
    with devicelock.measuring(share_after=False, quiet=True):  # its last GPU work
        samples = capture.time_calls(spec, built["calls"], w.inputs, device)
    common.phase("timed again")
    write_text_atomic(spec.need("result"), json.dumps(samples.to_json()))


TASKS: dict[str, Callable[[ChildSpec], None]] = {
    "recapture": task_recapture,
    "retime": task_retime,
}
"""The child halves, by the task name a spec carries (``runner`` dispatches them)."""
