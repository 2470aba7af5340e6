"""Stage 2, backend: measured selection of the proposals (the child half, ``task_select``,
builds and times each rung of the ladder) and the generated ``<stem>_optimized.py``, its
test file and the implementation notes (the parent half, ``run``).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof import devicelock
from pytest_opprof.backend.plan import extra_targets
from pytest_opprof.errors import ArtifactError, OpprofError, StageError, StageTimedOut
from pytest_opprof.pipeline import STOCK_FILE, WorkloadRun
from pytest_opprof.schema import (
    BackendSelection,
    ChildSpec,
    FxGraphSummary,
    LadderProgress,
    LatencyStats,
    Optimizations,
    Profile,
    StockBaseline,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.stages import common, rung_warmer

if TYPE_CHECKING:
    from pytest_opprof.backend.plan import Rung

NAME = "backend"

SELECTION_FILE = "profiler_output/backend_selection.json"
STOCK_RUNG_PENDING = "profiler_output/stock_rung.pending"
"""Present while selection times the stock recipe against the ladder's plan, whose selection
is written already: a selection process that dies meanwhile leaves both behind."""
STOCK_RUNG_LOG = "select_stock_rung"
"""The log of the fresh process that times the stock recipe against the ladder's plan again."""
PROGRESS_FILE = "profiler_output/selection_progress.json"
"""Selection's ladder as it stands (``LadderProgress``), written before and after each rung:
what a fresh process climbs on from where the one before died on a rung."""
RESUMED_LOG = "select_resumed"
"""The logs of the fresh processes that take the ladder over: ``select_resumed1``, ``…2``."""
MAX_RESUMES = 2
"""Fresh processes that may take over a ladder, each after one died on a rung: a third death
is no longer a rung's (the plan so far fails to build again, say) and fails the stage."""
CRASHED = "crashed the selection process"
"""A dropped rung's reason where its build or timing killed the process; never tried again."""
STOCK_WARM = "stock_warm"
"""The stock warmer's task, and its log's name: the process beside the stock task that compiles
:data:`WARMED` for it (:func:`warms_stock`)."""
WARMED = ("cast", "bfloat16")
"""The recipe and dtype the stock warmer compiles: ``backend.stock``'s last recipe at its first
dtype (``LOW_PRECISION``), the build the stock task reaches last in its first round."""


def run(run: WorkloadRun) -> str:
    from pytest_opprof.backend.codegen import render_notes, render_optimized, render_test
    from pytest_opprof.tolerances import tolerance_for

    optimizations = read_artifact(run.out_dir / "optimizations.json", Optimizations)
    stale = (
        STOCK_FILE,
        STOCK_RUNG_PENDING,
        SELECTION_FILE,
        PROGRESS_FILE,
        f"profiler_output/{STOCK_RUNG_LOG}.log",
        *(f"profiler_output/{RESUMED_LOG}{i}.log" for i in range(1, MAX_RESUMES + 1)),
        f"profiler_output/{STOCK_WARM}.log",
        *(f"profiler_output/{rung_warmer.log_name(i)}.log" for i in range(rung_warmer.MAX_WARMERS)),
    )
    for former in stale:  # not this run's
        (run.out_dir / former).unlink(missing_ok=True)
    if not run.measures_stock():
        selection = selected(run)
    elif stock_runs_beside(run):
        selection = selected_beside_stock(run)
    else:
        stock_task(run)
        selection = selected(run)
    user_passes = run.extra_passes()
    used = extra_targets(selection.plan, user_passes)
    if used:  # the plan names where its user passes come from (the child only routed them)
        selection.plan.extra_passes = used
        write_artifact(run.out_dir / SELECTION_FILE, selection)
    rtol, atol = tolerance_for(selection.numerics_dtype or selection.plan.dtype, run.spec.overrides)
    write_text_atomic(
        run.generated,
        render_optimized(
            stem=run.spec.stem,
            workload=run.spec.path,
            out_file=run.generated,
            selection=selection,
            proposals=optimizations.proposals,
            rtol=rtol,
            atol=atol,
            extra_passes=[user_passes[name] for name in used],
        ),
    )
    write_text_atomic(run.generated_test, render_test(stem=run.spec.stem))
    write_text_atomic(
        run.profiler_output / "implementation_notes.md",
        render_notes(selection, optimizations.proposals),
    )
    kept = ", ".join(selection.plan.proposals) or "none (the baseline is kept)"
    return f"kept {kept}; dropped {len(selection.dropped)}"


def selected(run: WorkloadRun, beside: int = 0, **extra: Any) -> BackendSelection:
    """Selection's process run (``extra``: more of its spec), with as many rung warmers beside
    it as ``rung_warmer.warms_rungs`` says (``beside``: how many of the workload's other
    processes run meanwhile), and its selection read. Where it died timing the stock recipe
    against the ladder's plan (a CUDA error leaves a process unusable), the two are timed once
    more in a fresh process, alone (``stock_rung_only``, its log ``STOCK_RUNG_LOG``); where
    that fails too, or the first ran out of time there, the ladder's selection stands
    (:func:`ladder_kept`)."""
    try:
        warmers = rung_warmer.warms_rungs(run, beside)
        if warmers:
            rung_warmer.selected_beside_warmers(run, NAME, warmers, **extra)
        else:
            run.run_child(NAME, NAME, **extra)
    except StageError as exc:
        return recovered(run, exc, **extra)
    return read_artifact(run.out_dir / SELECTION_FILE, BackendSelection)


def recovered(run: WorkloadRun, failure: StageError, **extra: Any) -> BackendSelection:
    """After selection's process failed (``failure``): where it died building or timing a
    rung of the ladder (:func:`rung_under_way`), a fresh process takes the ladder over, that
    rung dropped as having crashed it, at most ``MAX_RESUMES`` times (``extra``: more of its
    spec, as the first had). Where one died timing the stock recipe, that rung once more in a
    fresh process alone, then the ladder's selection (:func:`ladder_kept`). Any other failure,
    a timeout among them, is raised as it was."""
    resumes = 0
    while not isinstance(failure, StageTimedOut) and rung_under_way(run.out_dir):
        if resumes == MAX_RESUMES:
            raise failure
        resumes += 1
        try:
            run.run_child(
                NAME,
                NAME,
                log_name=f"{RESUMED_LOG}{resumes}",
                resume_ladder=error_line(failure),
                **extra,
            )
        except StageError as again:
            failure = again
            continue
        return read_artifact(run.out_dir / SELECTION_FILE, BackendSelection)
    if isinstance(failure, StageTimedOut) or not stock_rung_pending(run.out_dir):
        return ladder_kept(run.out_dir, failure)  # raises it where the ladder was not done
    try:
        run.run_child(NAME, NAME, log_name=STOCK_RUNG_LOG, stock_rung_only=True)
    except StageError as again:
        return ladder_kept(run.out_dir, again, first=failure)
    return read_artifact(run.out_dir / SELECTION_FILE, BackendSelection)


def rung_under_way(out_dir: Path) -> bool:
    """Whether selection's ladder names a rung under way (``PROGRESS_FILE``): its process died
    building or timing that rung. A progress file that does not validate names none."""
    path = out_dir / PROGRESS_FILE
    try:
        progress = read_artifact(path, LadderProgress) if path.exists() else None
    except ArtifactError:  # written atomically: only another version's would not validate
        return False
    return progress is not None and progress.under_way is not None


def error_line(error: StageError) -> str:
    """A failed process's last error line (else the failure's first line), for a record."""
    said = str(error).splitlines()
    errors = [ln.strip() for ln in said if "Error" in ln]
    return (errors[-1] if errors else said[0])[:200]


STOCK_SHARE = 0.9
"""The share of the stage's timeout that the stock task beside selection may take: selection,
started with it, waits for it at the ladder's end and must still write its selection within
its own timeout."""


def stock_task(run: WorkloadRun, beside_selection: bool = False, **extra: Any) -> None:
    """The stock task's process (``extra``: more of its spec), with the stock warmer beside it
    where :func:`warms_stock` (``beside_selection``: selection runs meanwhile). Where it runs
    out of time and the stock baseline is only measured beside the gate's
    (``--opprof-stock``), the stage goes on without it: ``STOCK_FILE`` says why, and so do the
    reports; as the gate's baseline (``--opprof-baseline=stock``), its timeout fails the
    stage, as any failure of it does. max-autotune's compiles of a large model, beside other
    workloads' compiles on shared CPUs, can outlast the stage (docs/results.md)."""
    try:
        if warms_stock(run, beside_selection):
            stock_beside_warmer(run, **extra)
        else:
            run.run_child("stock", NAME, **extra)
    except StageTimedOut as exc:
        if run.base_setting("baseline") == "stock":
            raise
        write_artifact(run.out_dir / STOCK_FILE, StockBaseline(message=f"not measured: {exc}"))


def warms_stock(run: WorkloadRun, beside_selection: bool) -> bool:
    """Whether the stock warmer compiles :data:`WARMED` beside the stock task, which compiles
    its other recipe meanwhile: the two max-autotune compiles are independent, minutes each on
    a large model, and once the warmer has ended Inductor's FX graph cache, which the session's
    processes share, answers the stock task's own compile of that recipe; so the task takes
    about the longer compile, not both. By the rule of the recapture's timing processes
    (``common.side_by_side``): under a GPU lock, which keeps the warmer's autotuning apart
    from the others' measurements, and where the capture's peak memory says all of this
    workload's processes then running fit: the stock task and the warmer, and selection
    where the stock task runs beside it. Elsewhere (the CPU, no lock, no profile) the stock
    task compiles both recipes itself, one after the other."""
    path = run.out_dir / "profile.json"
    if not path.is_file():
        return False
    baseline = read_artifact(path, Profile).capture_metadata
    return common.side_by_side(baseline, 3 if beside_selection else 2)


def stock_beside_warmer(run: WorkloadRun, **extra: Any) -> None:
    """The stock task's process (``extra``: more of its spec) and the stock warmer's beside it,
    siblings on the same CPU slice (``extra``'s siblings' lock where selection is a third,
    else one of their own), each with Inductor's pool of compile workers and the same
    timeout. The stock task waits for ``stock_warm_done``, created once the warmer has ended,
    however it ended, before it builds :data:`WARMED` itself: a warmer that failed, ran out of
    time or crashed costs the stock task only that wait (it then compiles the recipe, as
    without a warmer) and never fails the stage; its log says why
    (``profiler_output/stock_warm.log``). Returns, or raises the stock task's error, once
    both have ended: the warmer does not outlive its stage."""
    with tempfile.TemporaryDirectory(prefix="opprof-stock-warm-") as tmp:
        done = Path(tmp) / "warm.done"
        siblings = {
            "shares_cpus": True,
            "compile_pool": True,  # both compile new graphs
            **extra,
            "siblings_lock": extra.get("siblings_lock") or str(Path(tmp) / "siblings.lock"),
        }

        def warm() -> None:
            try:
                run.run_child(STOCK_WARM, NAME, **siblings)
            except OpprofError:  # the stock task compiles the recipe itself
                pass
            finally:
                done.touch()

        with common.beside(warm) as warmed:
            run.run_child("stock", NAME, **siblings, stock_warm_done=str(done))
        warmed.result()  # a bug of ours in the thread, not the warmer's failure


def wait_for_warmer(done: Path) -> None:
    """In the stock task's process, before it builds :data:`WARMED`: wait until ``done``
    exists (the stock warmer beside it has ended), holding nothing of the GPU's lock, and say
    how long it waited; the caller has synchronized and shares the GPU again after it
    (``common.wait_for_file``)."""
    waited = common.wait_for_file(
        done, "waiting for the stock warmer to end", "the stock warmer did"
    )
    common.phase(f"waited {waited or 0.0:.1f} s for the stock warmer to end")


def stock_rung_pending(out_dir: Path) -> bool:
    """Whether a selection process died timing the stock recipe (:data:`STOCK_RUNG_PENDING`),
    the ladder's selection written before it."""
    return (out_dir / STOCK_RUNG_PENDING).exists() and (out_dir / SELECTION_FILE).exists()


def stock_runs_beside(run: WorkloadRun) -> bool:
    """Whether the stock task runs beside selection rather than before it: by the rule of the
    recapture's timing processes (``common.side_by_side``), under a GPU lock, which keeps
    each one's measurements apart from the other's work, and where both fit in its memory."""
    baseline = read_artifact(run.out_dir / "profile.json", Profile).capture_metadata
    return common.side_by_side(baseline, 2)


def selected_beside_stock(run: WorkloadRun) -> BackendSelection:
    """:func:`selected`, with the stock task in a sibling process on the same CPU slice
    (the siblings' lock: ``devicelock``): its max-autotune compiles overlap the ladder, which
    needs the recipe it keeps only at its end (``task_select`` waits there for ``stock_done``,
    created once the stock task has ended, however it ended), and gives it ``STOCK_SHARE`` of
    the stage's timeout. A failed stock task fails the stage once selection is over, as it did
    running first (but for a timeout: :func:`stock_task`)."""
    with tempfile.TemporaryDirectory(prefix="opprof-stock-") as tmp:
        siblings = str(Path(tmp) / "siblings.lock")
        done = Path(tmp) / "stock.done"

        def stock() -> None:
            try:
                stock_task(
                    run,
                    beside_selection=True,
                    shares_cpus=True,
                    compile_pool=True,
                    siblings_lock=siblings,
                    timeout=STOCK_SHARE * float(run.setting("timeout")),
                )
            finally:
                done.touch()

        try:
            with common.beside(stock) as stocked:
                selection = selected(
                    run,
                    beside=2 if warms_stock(run, beside_selection=True) else 1,
                    shares_cpus=True,
                    compile_pool=True,  # both compile new graphs: each with Inductor's workers
                    siblings_lock=siblings,
                    stock_done=str(done),
                )
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            failed = stocked.exception()  # done: beside() waited for it
            if failed is not None:  # its failure first, as when it ran before selection
                raise failed from exc
            raise
        stocked.result()
    return selection


def wait_for_stock(done: Path) -> None:
    """In selection's process, before the stock rung: wait until ``done`` exists (the stock
    task beside it has ended), holding nothing of the GPU's lock, which the stock task's
    measurements take exclusively; the caller has synchronized (``common.wait_for_file``)."""
    waited = common.wait_for_file(
        done, "waiting for the stock baseline's task to end", "the stock baseline's task did"
    )
    if waited is not None:
        common.phase(f"the stock baseline's task ended after {waited:.1f} s")


def ladder_kept(
    out_dir: Path, failure: StageError, first: StageError | None = None
) -> BackendSelection:
    """The ladder's selection, where the selection process failed timing the stock recipe
    against it (:data:`STOCK_RUNG_PENDING`), and ``failure`` is that process's error (or, with
    ``first``, the fresh process's that tried again): the stock rung is an addition to the
    ladder, and its failure (say, a CUDA error in the recipe's CUDA graphs) loses none of the
    ladder's work. The recipe is recorded as dropped, with each failure's last error line (else
    its first line). Any other failure is raised as it was."""
    from pytest_opprof.schema import DroppedProposal

    pending, path = out_dir / STOCK_RUNG_PENDING, out_dir / SELECTION_FILE
    if not stock_rung_pending(out_dir):
        raise failure
    selection = read_artifact(path, BackendSelection)

    why = (
        f"the selection process failed timing it against the plan ({error_line(first or failure)})"
    )
    if first is not None:
        why += f", and so did a fresh process alone ({error_line(failure)})"
    selection.dropped.append(
        DroppedProposal(id="stock-recipe", type="stock_recipe", reason=f"not compared: {why}")
    )
    write_artifact(path, selection)
    pending.unlink()
    return selection


def captured_reference(out_dir: Path) -> dict[str, LatencyStats] | None:
    """Eager's and the compiled baseline's latencies as the capture timed them, in one
    interleaved run with the host's compiles held off (``profile.json``): selection's
    reference, the faster of the two, and the plan its first rung is timed against. None
    where there is no profile or it lacks either. Selection timed the two again in its own
    process, with the GPU alone, only to pick the faster and start the waterfall, whose later
    steps are chained from paired ratios anyway (docs/design-notes.md#selections-reference)."""
    from pytest_opprof.schema import Profile, read_artifact

    path = out_dir / "profile.json"
    if not path.is_file():
        return None
    variants = read_artifact(path, Profile).timing.variants
    if not {"eager", "compile"} <= variants.keys():
        return None
    return {k: variants[k] for k in ("eager", "compile")}


def captured_graph(out_dir: Path) -> FxGraphSummary | None:
    """The capture stage's FX graph summary (``graph.json``, validated on read), or None where
    capture wrote none."""
    from pytest_opprof.schema import FxGraphSummary, read_artifact

    path = out_dir / "graph.json"
    return read_artifact(path, FxGraphSummary) if path.is_file() else None


def task_select(spec: ChildSpec) -> None:
    """Measured selection: climb the ladder of proposals, keeping a rung only when it is
    confidently faster than the plan below it (paired, interleaved rounds), by at least
    ``MIN_RUNG_GAIN``, and numerically equivalent to the eager baseline; then give each rung
    dropped before the last kept one a second chance on top of the final plan, since some
    gains only appear together (bf16 pays once layouts match). The rungs:
    :func:`selection_rungs`. With ``spec.stock_rung_only`` (a fresh process, after one died on
    the stock rung: :func:`selected`), no rung is climbed: the ladder's selection is read back,
    its plan built again, and only the stock rung tried against it. With
    ``spec.resume_ladder`` (a fresh process, after one died on a rung: :func:`recovered`),
    the ladder's progress is read back (``PROGRESS_FILE``, written before and after each
    rung), the rung under way dropped as having crashed it, the plan so far built again, and
    the ladder climbed on from the next rung."""
    import torch

    from pytest_opprof.backend.build import build
    from pytest_opprof.backend.plan import add_proposal, cannot_change
    from pytest_opprof.backend.selection import (
        RUNG_BAR,
        STOCK_BAR,
        Bar,
        applied_nowhere,
        autocast_instead,
        climbed,
        dropped_reason,
        over_twice_as_slow,
        second_pass,
        settled,
        stock_rung,
        timed_rung,
        worth_a_second_pass,
    )
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize, time_interleaved
    from pytest_opprof.measure import latency_stats, paired_gain, slow_host_rounds
    from pytest_opprof.numerics import GateCheck, calibrated, describe
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

    common.setup_torch()
    opts = common.options(spec)
    device = resolve_device(opts.device)
    out_dir = Path(spec.out_dir)
    opt = read_artifact(out_dir / "optimizations.json", Optimizations)
    w = common.load_baseline(spec, device)
    eager = w.model
    compiled, _ = common.compile_timed(eager, opts.compile_backend, w.inputs, device)
    gate_check = GateCheck(eager, w.inputs)  # the validate stage's check, on its inputs
    ahead = rung_warmer.Ahead(spec.rung_warmer)  # the rung warmers beside, where they run
    calls = max(3, common.setting(spec, "measure_iters") // 2)
    rounds = max(5, min(9, common.setting(spec, "rounds")))
    brief = {"device": device, "warmup": 3, "calls_per_round": calls, "rounds": rounds}

    # Resumed at the stock rung (``ChildSpec.stock_rung_only``): the ladder as it was written;
    # or on the ladder (``ChildSpec.resume_ladder``): the ladder as far as it had climbed.
    ladder, progress = None, None
    if spec.stock_rung_only:
        ladder = read_artifact(out_dir / SELECTION_FILE, BackendSelection)
    elif spec.resume_ladder is not None:
        progress = read_artifact(out_dir / PROGRESS_FILE, LadderProgress)
        ladder = progress.selection
    skip = set(spec.overrides.get("skip", []))
    state: dict[str, Any]
    if ladder is None:
        stats = captured_reference(out_dir)
        if stats is None:  # a profile without both: timed here
            # Each rung shares the GPU again as it starts (attempt()); after the last, nothing
            with devicelock.measuring(share_after=False), ahead.paused():
                base = time_interleaved({"eager": eager, "compile": compiled}, w.inputs, **brief)
            aside = slow_host_rounds(base.host_us)
            stats = {k: latency_stats(v, base.calls[k], set_aside=aside) for k, v in base.items()}
        ref_name = min(stats, key=lambda k: stats[k].median_ms)
        ref_ms = stats[ref_name].median_ms
        variants = [
            VariantResult(name=k, plan=BackendPlan(), latency=v, speedup=ref_ms / v.median_ms)
            for k, v in stats.items()
        ]
        waterfall = [
            WaterfallStep(
                step=ref_name,
                latency_ms=ref_ms,
                speedup_cumulative=1.0,
                speedup_added=1.0,
                measured_ms=ref_ms,
            )
        ]
        state = {"plan": BackendPlan(), "name": ref_name}
        not_built, rungs = climbed(opt.proposals, device, skip, captured_graph(out_dir))
        dropped = {
            pid: DroppedProposal(id=pid, type=kind, reason=reason)
            for pid, (kind, reason) in not_built.items()
        }
    else:
        ref_name, ref_ms = ladder.reference, ladder.reference_ms
        variants, waterfall = list(ladder.variants), list(ladder.waterfall)
        state = {"plan": ladder.plan, "name": ladder.chosen}
        rungs = []
        dropped = {d.id: d for d in ladder.dropped}
        if progress is not None:  # the same rungs, in the same order, as the first process's
            rungs = climbed(opt.proposals, device, skip, captured_graph(out_dir))[1]
    state["fn"] = compiled if state["name"] == "compile" else eager

    def compiled_plan(fresh: Any, plan: BackendPlan) -> tuple[Any, Any]:
        """``plan`` built on ``fresh`` and called once on the gate's inputs (its compile):
        the built variant and its outputs."""
        common.compile_off_gpu(device)
        # max-autotune times kernels on the GPU while it compiles (at the first call): not
        # beside another process's measurement
        tuning = common.autotuning(device) if rung_warmer.autotunes(plan) else None
        with tuning or contextlib.nullcontext(), torch.no_grad():
            built = build(fresh, w.inputs, plan)
            got = gate_check.outputs(built.fn)
        synchronize(device)
        return built, got

    def drop(rung: Rung, reason: str, second_chance: bool) -> None:
        """Record each of the rung's proposals as dropped for ``reason``; on the second pass
        after what the first pass said (``dropped_reason``)."""
        for p in rung.proposals:
            before = dropped.get(p.id)
            first = before.reason if before is not None else None
            dropped[p.id] = DroppedProposal(
                id=p.id, type=p.type, reason=dropped_reason(first, reason, second_chance)
            )

    def attempt(
        rung: Rung,
        second_chance: bool,
        on: BackendPlan | None = None,
        bar: Bar = RUNG_BAR,
        after: Sequence[Rung] = (),
    ) -> bool:
        """Build ``rung`` on top of the plan so far (or of ``on``, in its place), check its
        outputs, time it against the plan so far and keep it where it clears ``bar``. On the
        plan so far, the rung warmers are asked for the plans selection may build next, of the
        rungs after it, ``after``, whether this one is kept or dropped (``rung_warmer.Ahead``)."""
        below = plan = state["plan"] if on is None else on
        moot = next(filter(None, (cannot_change(plan, p) for p in rung.proposals)), None)
        if moot is not None:
            if on is None:  # not built: the next rung meets the plan as it is
                ahead.want(plan, after)
            drop(rung, f"not tried: {moot}", second_chance)
            return False
        for p in rung.proposals:
            plan = add_proposal(plan, p)
        name = "+".join(plan.proposals)
        if on is None:
            ahead.want(plan, after, below)
        ahead.before_build(plan, lambda: synchronize(device))
        common.step_done(device)  # after the rung before, built and dropped without a measurement
        devicelock.resume()  # or measured: then the GPU was released
        t0 = time.perf_counter()
        fresh = pristine_copy(eager, lambda: common.load_baseline(spec, device).model)
        t1 = time.perf_counter()
        clock = common.compile_clock()
        try:
            built, got = compiled_plan(fresh, plan)
        except Exception as exc:  # a pass or Inductor failed on this rung: drop it, go on
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            variants.append(VariantResult(name=name, plan=plan, error=reason[:300]))
            drop(rung, f"failed to build: {reason[:200]}", second_chance)
            return False
        note = common.compile_note(clock)
        common.phase(
            f"built {name}: model {t1 - t0:.1f} s, compile and first call "
            f"{time.perf_counter() - t1:.1f} s" + (f" ({note})" if note else "")
        )
        common.note_tuned_gemms()
        unchanged = applied_nowhere(rung.proposals, built.results)
        if unchanged is not None:
            # Timing an identical program only measures noise; a lucky CI must not keep it.
            variants.append(VariantResult(name=name, plan=plan, error="applied nowhere"))
            drop(rung, f"applied nowhere: {unchanged[:200]}", second_chance)
            return False
        checked_as = numerics_dtype(plan.dtype, tf32=runs_tf32(eager, plan, device))
        rtol, atol = tolerance_for(checked_as, spec.overrides)
        numerics = gate_check(
            got, dtype=checked_as, rtol=rtol, atol=atol, calibrate=calibrated(spec.overrides)
        )
        if not numerics.ok:
            variants.append(
                VariantResult(
                    name=name, plan=plan, numerics=numerics, error="numerics out of tolerance"
                )
            )
            drop(rung, f"changed the output: {describe(numerics)}", second_chance)
            under_autocast = autocast_instead(rung)
            if under_autocast is not None:
                common.phase(f"{name}: the cast changed the output; trying it under autocast")
                return attempt(under_autocast, second_chance, on, bar, after)
            return False
        with devicelock.measuring(share_after=False), ahead.paused():
            s = time_interleaved(
                {"current": state["fn"], "candidate": built.fn},
                w.inputs,
                **brief,
                enough=settled,
            )
        gain, cand, below = paired_gain(s, s.calls, s.host_us, "current", "candidate")
        aside = f" ({len(cand.set_aside)} rounds set aside)" if cand.set_aside else ""
        timed = len(s["candidate"])  # fewer than planned: settled in each, one way or the other
        how = "over twice as slow" if over_twice_as_slow(s) else "over three times as fast"
        early = f", timed for {timed} rounds, each {how}" if timed < rounds else ""
        common.phase(f"timed {name}: {gain.ratio:.3f}x{aside}{early}")
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
        if bar.keep(gain):
            state.update(plan=plan, fn=built.fn, name=name)
            for p in rung.proposals:
                before = dropped.pop(p.id, None)
                if before is not None and second_chance:
                    # what the first pass said: the kept records have no field for it
                    common.phase(f"kept {p.id} on the second pass; first pass: {before.reason}")
            waterfall.append(step)
            return True
        drop(
            rung,
            bar.verdict(gain) + f": {gain.ratio:.3f}x (95% CI {gain.ci_low:.3f}–"
            f"{gain.ci_high:.3f}) against {bar.against}" + early,
            second_chance,
        )
        return False

    def current() -> BackendSelection:
        """The selection as it stands."""
        final = state["plan"]
        checked_as = numerics_dtype(final.dtype, tf32=runs_tf32(eager, final, device))
        return BackendSelection(
            workload=Path(spec.workload).stem,
            reference=ref_name,
            reference_ms=ref_ms,
            variants=variants,
            chosen=state["name"],
            plan=final,
            dropped=list(dropped.values()),
            waterfall=waterfall,
            numerics_dtype=checked_as if checked_as == TF32 else None,
        )

    def record() -> None:
        """The selection as it stands, written for the parent (atomically)."""
        write_artifact(out_dir / SELECTION_FILE, current())

    kept: list[bool] = []
    revived = False  # a rung kept on the second pass (worth_a_second_pass)

    def climbing(rung: Rung | None, attempted: int = 0) -> None:
        """The ladder's progress, written before a rung (``rung``: the one under way, after
        ``attempted`` of the second pass) and once climbed (None), for a fresh process to
        climb on from. A rung under way is on the second pass where the first is complete."""
        write_artifact(
            out_dir / PROGRESS_FILE,
            LadderProgress(
                selection=current(),
                first_pass=kept,
                second_pass=attempted,
                revived=revived,
                under_way=rung.name if rung is not None else None,
            ),
        )

    second_done = 0  # second-pass rungs attempted
    if progress is not None:
        kept, revived, second_done = (
            list(progress.first_pass),
            progress.revived,
            progress.second_pass,
        )
        if progress.under_way is not None:  # it died on this one: dropped, never tried again
            on_second = len(kept) == len(rungs)
            died = rungs[second_pass(kept)[second_done] if on_second else len(kept)]
            drop(died, f"{CRASHED} ({spec.resume_ladder}); not tried again", on_second)
            common.phase(f"{died.name}: {CRASHED} before this one; dropped, climbing on")
            if on_second:
                second_done += 1
            else:
                kept.append(False)
    if ladder is not None and ladder.plan.proposals:  # the caches answer its compile
        fresh = pristine_copy(eager, lambda: common.load_baseline(spec, device).model)
        state["fn"] = compiled_plan(fresh, ladder.plan)[0].fn
        why = "to climb on" if progress is not None else "to time the stock recipe"
        common.phase(f"built {ladder.chosen} again, the ladder's plan, {why}")

    for i in range(len(kept), len(rungs)):
        climbing(rungs[i])
        kept.append(attempt(rungs[i], second_chance=False, after=rungs[i + 1 :]))
    # A rung dropped before the last kept one met a plan that has changed since: try it again.
    # One that applied nowhere is tried again once a rung before it was kept on this pass
    # (gemm_out_dtype finds its bf16 GEMMs only once dtype_promotion is in).

    def worth(r: Rung) -> bool:
        return worth_a_second_pass([dropped[p.id].reason for p in r.proposals], revived)

    again = second_pass(kept)
    for n in range(second_done, len(again)):
        i = again[n]
        later = [rungs[j] for j in again[n + 1 :] if worth(rungs[j])]  # the warmers' guess
        if worth(rungs[i]):
            climbing(rungs[i], attempted=n)
            if attempt(rungs[i], second_chance=True, after=later):
                revived = True
    if rungs:
        climbing(None, attempted=len(again))  # the ladder climbed: no rung under way
    if spec.stock_done is not None:  # the stock task runs beside this process
        synchronize(device)  # nothing of ours on the GPU while the stock task measures
        wait_for_stock(Path(spec.stock_done))
    recipe = stock_rung(out_dir / STOCK_FILE) if common.measures_stock(spec) else None
    if recipe is not None:
        # The ladder's result first: where this process dies timing the stock recipe (a CUDA
        # error), the parent keeps it and says why the recipe was not compared (``run``).
        record()
        pending = out_dir / STOCK_RUNG_PENDING
        pending.touch()
        # The stock recipe the stock task kept, compiled as a user writes it, in place of the
        # ladder's plan: unless the plan is measured faster, the recipe is what ships.
        ladder_plan = state["plan"]
        if attempt(recipe, second_chance=False, on=BackendPlan(), bar=STOCK_BAR):
            for pid in set(ladder_plan.proposals) - set(state["plan"].proposals):
                kind = next((p.type for p in opt.proposals if p.id == pid), pid)
                dropped[pid] = DroppedProposal(
                    id=pid,
                    type=kind,
                    reason="replaced: the stock recipe (stock-recipe) was measured as fast "
                    "as the plan with it or faster",
                )
        record()
        pending.unlink()
    else:
        record()


def task_stock(spec: ChildSpec) -> None:
    """The backend stage's stock baseline, where it is measured: each stock recipe built
    (``backend.stock``), its outputs held to the validator's checks at the recipe's dtype
    (bf16, else fp32), the passing ones timed briefly side by side; the choice goes to
    ``STOCK_FILE``, where selection tries it against its plan and every timing process of the
    recapture reads which recipe to time. With ``spec.stock_warm_done`` (the stock warmer
    beside it: :func:`stock_beside_warmer`), it waits for the warmer's end before it builds
    :data:`WARMED`, whose compile the FX graph cache then answers."""
    from pytest_opprof.backend import stock
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize, time_interleaved
    from pytest_opprof.numerics import anti_cheat_checks, calibrated
    from pytest_opprof.tolerances import numerics_dtype, tolerance_for

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    out_dir = Path(spec.out_dir)
    w = common.load_baseline(spec, device)

    def check(fn: Callable[..., Any], dtype: str) -> tuple[Any, list[str]]:
        # an fp32 recipe may run its convolutions on TF32 (cuDNN's default)
        checked_as = numerics_dtype(dtype, tf32=device == "cuda")
        rtol, atol = tolerance_for(checked_as, spec.overrides)
        numerics, checks = anti_cheat_checks(
            w.model,
            fn,
            w.inputs,
            dtype=checked_as,
            rtol=rtol,
            atol=atol,
            calibrate=calibrated(spec.overrides),
        )
        return numerics, [f"{k}: {c.detail}" for k, c in checks.items() if c.status == "fail"]

    def time_brief(calls: dict[str, Callable[..., Any]]) -> dict[str, float]:
        import statistics

        with devicelock.measuring():
            s = time_interleaved(
                calls, w.inputs, device=device, warmup=3, calls_per_round=10, rounds=5
            )
        return {k: statistics.median(v) for k, v in s.items()}

    def before_build(recipe: str, dtype: str) -> None:
        if spec.stock_warm_done is not None and (recipe, dtype) == WARMED:
            synchronize(device)  # the wait holds nothing of the GPU: our work done first
            wait_for_warmer(Path(spec.stock_warm_done))
            devicelock.resume()

    call = common.first_call(w, device)

    def first_call(fn: Any) -> None:
        """A recipe's compile (``stock.Compiled``), and where its time went: the FX graph
        cache says whether the warmer's compile answered it."""
        clock, t0 = common.compile_clock(), time.perf_counter()
        call(fn)
        note = common.compile_note(clock)
        common.phase(
            f"built {fn.recipe} at {fn.dtype}: {time.perf_counter() - t0:.1f} s"
            + (f" ({note})" if note else "")
        )

    with common.autotuning(device):
        chosen = stock.choose(
            w.model,
            w.inputs,
            None,
            check=check,
            first_call=first_call,
            time_brief=time_brief,
            before_build=before_build,
        )
    common.phase(f"stock baseline: {chosen.message}")
    write_artifact(out_dir / STOCK_FILE, chosen)


def task_stock_warm(spec: ChildSpec) -> None:
    """The stock warmer, beside the stock task (:func:`warms_stock`): :data:`WARMED` built
    and called once, as the stock task builds it (``stock.build`` under
    ``common.autotuning``: its autotuning holds the GPU alone per op), and nothing else. Its
    compile fills Inductor's FX graph cache, which answers the stock task's own build of the
    recipe once this process has ended; what it built is thrown away, unchecked and untimed."""
    from pytest_opprof.backend import stock
    from pytest_opprof.capture.system import resolve_device

    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    w = common.load_baseline(spec, device)
    recipe, dtype = WARMED
    clock, call = common.compile_clock(), common.first_call(w, device)
    with common.autotuning(device):
        built = stock.build(recipe, w.model, w.inputs, dtype, first_call=call)
    note = common.compile_note(clock)
    common.phase(
        f"built {recipe} at {dtype} for the stock task: {built.compile_s:.1f} s"
        + (f" ({note})" if note else "")
    )


def task_warm_rungs(spec: ChildSpec) -> None:
    """A rung warmer, beside selection (``rung_warmer.warms_rungs``): each plan selection
    wants that no other process has claimed (``rung_warmer.serve``) built as selection builds
    it (a pristine copy of the model, ``build`` under no_grad) and called once on the inputs of
    selection's first call of it (``GateCheck.outputs``: the first seed's), and nothing else.
    Its compile fills Inductor's FX graph cache, which answers selection's own build of the
    plan; what it built is thrown away, unchecked and untimed, Dynamo's in-process caches with
    it. Selection stops this process while it measures (it names itself first,
    ``Folder.announce``), so where its CPUs are the workload's own its compiles let go of the
    GPU, and between builds it holds none."""
    import torch

    from pytest_opprof.backend.build import build
    from pytest_opprof.capture.system import resolve_device
    from pytest_opprof.capture.timing import synchronize
    from pytest_opprof.numerics import SEEDS, fresh_inputs

    if spec.rung_warmer is None:
        raise TypeError(f"the spec of task {spec.task!r} has no rung_warmer: a bug of the parent")
    folder = rung_warmer.Folder(Path(spec.rung_warmer))
    folder.announce()
    common.stopped_while_siblings_measure()
    if not rung_warmer.idle_priority():
        common.phase("not at idle priority: this platform has no SCHED_IDLE")
    elif (cpus := rung_warmer.on_host_cpus()) is not None:  # only at idle priority
        common.phase(f"at idle priority on the host's {cpus} CPUs")
    common.setup_torch()
    device = resolve_device(common.options(spec).device)
    w = common.load_baseline(spec, device)
    first = fresh_inputs(w.inputs, SEEDS[0])

    def warm(plan: Any) -> None:
        devicelock.resume()
        fresh = pristine_copy(w.model, lambda: common.load_baseline(spec, device).model)
        common.compile_off_gpu(device)
        clock, t0 = common.compile_clock(), time.perf_counter()
        with torch.no_grad():
            build(fresh, w.inputs, plan).fn(*first)
        synchronize(device)
        note = common.compile_note(clock)
        common.phase(
            f"built {rung_warmer.plan_name(plan)} ahead of selection: "
            f"{time.perf_counter() - t0:.1f} s" + (f" ({note})" if note else "")
        )
        torch._dynamo.reset()  # what it built, thrown away; the FX graph cache keeps it

    def idle() -> None:
        with contextlib.suppress(Exception):  # a failed build's error is said already
            synchronize(device)
        devicelock.let_go()

    idle()
    built = rung_warmer.serve(folder, warm, idle)
    common.phase(f"built {built} plans ahead of selection")


def pristine_copy(model: Any, reload: Callable[[], Any]) -> Any:
    """A copy of the untouched baseline for one variant to change (non-graph passes change
    the model in place): a deep copy, on the device, instead of building the model again, once
    per variant (docs/design-notes.md#copying-the-baseline-per-variant); ``reload()`` under
    seed 0, as the baseline was made, where the model cannot be deep-copied."""
    import copy

    import torch

    try:
        return copy.deepcopy(model)
    except Exception:  # a module holding something deepcopy refuses (a lock, a C handle)
        torch.manual_seed(0)
        return reload()


def runs_tf32(model: Any, plan: Any, device: str) -> bool:
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


TASKS: dict[str, Callable[[ChildSpec], None]] = {
    NAME: task_select,
    "stock": task_stock,
    STOCK_WARM: task_stock_warm,
    rung_warmer.TASK: task_warm_rungs,
}
"""The child halves, by the task name a spec carries (``runner`` dispatches them): measured
selection under the stage's own name (its log ``backend.log``), and, where the stock baseline
is measured, its task, which runs beside selection (before it where they cannot run side by
side: :func:`stock_runs_beside`), and the stock warmer beside that task where they fit
(:func:`warms_stock`); with ``--opprof-warm-rungs``, the rung warmers beside selection where
they fit (``rung_warmer``)."""
