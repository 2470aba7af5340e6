"""Selection's rungs compiled ahead (``--opprof-warm-rungs``): sibling processes, the rung
warmers, compile the plans measured selection will most likely build next, so that Inductor's
FX graph cache, which the session's processes share, answers selection's own builds of them.

They talk through files in a folder their parent makes (``ChildSpec.rung_warmer``). Selection
alone decides what to warm (:class:`Ahead`): as it starts a rung on the plan so far, on
either pass, it names in :data:`WANTED` the plans it may build next, whether this rung and the
ones after it are kept or dropped, nearest first, two for each warmer (:func:`plans_after`),
or none. Each warmer (:func:`serve`), at idle priority (:func:`idle_priority`), claims
the nearest wanted plan nobody has claimed, by creating its claim file exclusively, so no two
processes build one plan; it builds it and marks it done, however its build ended. Selection
claims each plan it builds too: one a warmer claimed first it waits for (until done, until
that warmer's process is gone, or until every warmer has :data:`ENDED`), holding nothing of
the GPU, then builds it itself, the cache answering; one selection claimed no warmer builds.
Before a build of its own that autotunes it waits for every warmer's build under way. While
it measures it stops every warmer that named itself (``devicelock.stopped``), so no compile
of theirs runs beside a timing on their shared CPUs. The warmers end once selection has
(:data:`FINISHED`). Nothing of theirs can fail the stage: a warmer's failure costs selection
at most a wait. The parent half (:func:`selected_beside_warmers`) runs them all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter

from pytest_opprof import devicelock
from pytest_opprof.errors import OpprofError
from pytest_opprof.schema import BackendPlan, Profile, read_artifact, write_text_atomic
from pytest_opprof.stages import common

if TYPE_CHECKING:
    from pytest_opprof.backend.plan import Rung
    from pytest_opprof.pipeline import WorkloadRun

TASK = "warm_rungs"
"""The rung warmers' task, and the first one's log's name (``profiler_output/warm_rungs.log``;
the others' :func:`log_name`)."""
MAX_WARMERS = 3
"""The most warmers beside one selection, which runs one for each CPU of its slice up to this.
Each compiles at idle priority with its own pool of compile workers, on the CPU time
selection leaves (its waits for the GPU; its timings stop the warmers), so a slice of two
CPUs runs selection and two warmers: the next build whether the rung under way is kept or
dropped. Past a few, a plan further ahead is less likely to be built, and each warmer holds a
copy of the model in the GPU's memory."""
WANTED = "wanted.json"
"""The plans selection wants compiled ahead, nearest first (a JSON array of ``BackendPlan``);
an empty array, or no file, wants nothing."""
WARMERS = "warmers"
"""How many warmers the parent starts, written before it starts any: selection wants that
many plans ahead (one where the file is missing)."""
ANNOUNCED = ".warmer"
"""The suffix of the file each warmer writes as it starts (``<pid>.warmer``), holding its
``devicelock.identity``: whom selection stops."""
FINISHED = "finished"
"""Created by the parent once selection has ended, however it ended: the warmers end too."""
ENDED = "ended"
"""Created by the parent once every warmer has ended, however each ended: no wait goes on."""
POLL_S = 0.1
"""How often a warmer reads what selection wants while it has nothing to build."""

_PLANS = TypeAdapter(list[BackendPlan])


def plan_key(plan: BackendPlan) -> str:
    """A plan's name in the folder: the same plan, the same key, in every process."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:32]


def autotunes(plan: BackendPlan) -> bool:
    """Whether building ``plan`` times kernels on the GPU (Inductor's max-autotune, a stock
    recipe's ``mode="max-autotune"``): such a compile is never made ahead, and none of the
    warmers' runs beside it."""
    return bool(plan.config_patches.get("max_autotune") or plan.stock_recipe)


def plans_after(
    plan: BackendPlan, rungs: Sequence[Rung], depth: int, below: BackendPlan | None = None
) -> list[BackendPlan]:
    """The plans selection may build next, whatever it decides, nearest first: ``plan`` is
    the plan with the rung under way, ``below`` the plan without it (where selection may drop
    it; None where ``plan`` is the plan either way), and each rung of ``rungs`` after it is
    kept or dropped in turn. Level by level, so that the next build of every branch comes
    before any build after it, and on each level the branch that kept more first; a rung
    selection would not build on a branch (a proposal of it cannot change that branch's plan:
    ``backend.plan.cannot_change``) is skipped there, and the branch's next rung meets its plan
    as it is. Up to ``depth`` plans; none past the first that autotunes, and none at all where
    ``plan`` autotunes (no compile ahead runs beside selection's autotuning)."""
    from pytest_opprof.backend.plan import add_proposal, cannot_change

    if autotunes(plan):
        return []
    # each branch: its plan, and the index of the first rung of ``rungs`` it has not met
    level = [(plan, 0)] + ([(below, 0)] if below is not None and below != plan else [])
    plans: list[BackendPlan] = []
    while level and len(plans) < depth:
        deeper: list[tuple[BackendPlan, int]] = []
        for base, start in level:
            at = next(
                (
                    i
                    for i in range(start, len(rungs))
                    if not any(cannot_change(base, p) for p in rungs[i].proposals)
                ),
                None,
            )
            if at is None:
                continue
            built = base
            for p in rungs[at].proposals:
                built = add_proposal(built, p)
            if autotunes(built):
                return plans[:depth]
            if built not in plans:
                plans.append(built)
            deeper += [(built, at + 1), (base, at + 1)]  # kept, then dropped
        level = deeper
    return plans[:depth]


def plan_name(plan: BackendPlan) -> str:
    return "+".join(plan.proposals) or "the baseline"


def log_name(index: int) -> str:
    """Warmer ``index``'s log's name: ``warm_rungs``, then ``warm_rungs2``, ``warm_rungs3``."""
    return TASK if index == 0 else f"{TASK}{index + 1}"


def _gone(owner: str) -> bool:
    """Whether the process named ``owner`` (``devicelock.identity``) has ended; False where
    it cannot tell (no name: a platform without ``/proc``)."""
    pid, _, _ = owner.partition("-")
    return pid.isdigit() and devicelock.identity(int(pid)) != owner


class Folder:
    """The files of one selection and its warmers (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def want(self, plans: Sequence[BackendPlan]) -> None:
        write_text_atomic(self.path / WANTED, _PLANS.dump_json(list(plans)).decode())

    def wanted(self) -> list[BackendPlan]:
        try:
            text = (self.path / WANTED).read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return _PLANS.validate_json(text)

    def start(self, warmers: int) -> None:
        """Say how many warmers run (:data:`WARMERS`): the parent, before it starts any."""
        write_text_atomic(self.path / WARMERS, str(warmers))

    def depth(self) -> int:
        """How many plans selection wants ahead: one for each warmer."""
        try:
            return int((self.path / WARMERS).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 1

    def claim(self, plan: BackendPlan) -> bool:
        """Claim ``plan`` for this process: False where another claimed it first. The claim
        file names its owner (``devicelock.identity``), written before it appears."""
        fd, tmp = tempfile.mkstemp(prefix=".claim.", dir=self.path)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(devicelock.identity() or "")
            os.link(tmp, self.claimed(plan))  # fails where the claim file exists: exclusive
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        return True

    def claimed(self, plan: BackendPlan) -> Path:
        return self.path / f"{plan_key(plan)}.claimed"

    def done(self, plan: BackendPlan) -> Path:
        return self.path / f"{plan_key(plan)}.done"

    def mark_done(self, plan: BackendPlan) -> None:
        self.done(plan).touch()

    def under_way(self, besides: set[str]) -> list[Path]:
        """The done files of the plans claimed and not yet done, but for the keys ``besides``
        (those the caller claimed itself)."""
        keys = [c.name.removesuffix(".claimed") for c in self.path.glob("*.claimed")]
        return [
            self.path / f"{k}.done"
            for k in sorted(keys)
            if k not in besides and not (self.path / f"{k}.done").exists()
        ]

    def gone(self, done: Path) -> bool:
        """Whether the process that claimed the plan of ``done`` has ended without marking it
        (a warmer that crashed or ran out of time mid-build): its build is under way no more."""
        try:
            owner = done.with_suffix(".claimed").read_text(encoding="utf-8").strip()
        except OSError:  # not claimed, or the folder gone with the stage
            return False
        return _gone(owner)

    def announce(self) -> None:
        """Name this process as a warmer, for selection to stop while it measures."""
        me = devicelock.identity()
        if me is not None:
            write_text_atomic(self.path / f"{os.getpid()}{ANNOUNCED}", me)

    def warmers(self) -> list[str]:
        """The ``devicelock.identity`` of each warmer that has started, until they all have
        ended (one that ended alone is left alone by ``devicelock.stopped``)."""
        if (self.path / ENDED).exists():
            return []
        names = []
        for path in sorted(self.path.glob(f"*{ANNOUNCED}")):
            with contextlib.suppress(OSError):
                names.append(path.read_text(encoding="utf-8").strip())
        return [n for n in names if n]


class Ahead:
    """Selection's half, a no-op without warmers (``folder`` None): what to want, when to
    wait, and the warmers stopped while selection measures."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Folder(Path(folder)) if folder is not None else None
        self._mine: set[str] = set()
        """The keys of the plans selection claimed: no warmer builds those."""

    def want(
        self, plan: BackendPlan, rungs: Sequence[Rung], below: BackendPlan | None = None
    ) -> None:
        """At the start of a rung whose plan is ``plan`` (``below`` without it, where
        selection may drop it): want compiled the plans selection may build next, of the
        rungs after it, ``rungs`` (:func:`plans_after`), two for each warmer (the next build
        whether this rung is kept or dropped), or nothing."""
        if self.folder is not None:
            self.folder.want(plans_after(plan, rungs, 2 * self.folder.depth(), below))

    def before_build(self, plan: BackendPlan, sync: Callable[[], None]) -> None:
        """Before selection builds ``plan``: claim it, or, where a warmer has, wait for its
        build to end; before a build that autotunes, wait for every warmer's build under way
        too, so that no compile of theirs runs beside its timings. The wait holds nothing of
        the GPU (``sync`` first: this process's GPU work done), is said in the stage log, and
        the GPU is shared again after it."""
        if self.folder is None:
            return
        folder, key = self.folder, plan_key(plan)
        awaited: list[Path] = []
        if folder.claim(plan):
            self._mine.add(key)
        elif key not in self._mine:  # a warmer's
            awaited.append(folder.done(plan))
        if autotunes(plan):
            awaited += folder.under_way(besides=self._mine)
        pending = [p for p in dict.fromkeys(awaited) if not p.exists() and not folder.gone(p)]
        if not pending or (folder.path / ENDED).exists():
            return
        sync()
        name = plan_name(plan)
        for done in pending:
            what = (
                f"the rung warmer's build of {name}"
                if done == folder.done(plan)
                else f"the rung warmers' builds under way, before {name} autotunes"
            )
            waited = common.wait_for_file(
                [done, folder.path / ENDED],
                f"waiting for {what}",
                f"{what} ended",
                over=functools.partial(folder.gone, done),
            )
            if waited is not None:
                common.phase(f"waited {waited:.1f} s for {what}")
        devicelock.resume()

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        """A measurement's block, inside ``devicelock.measuring`` (the GPU held alone): every
        warmer and its process group stopped for it, where they run."""
        warmers = self.folder.warmers() if self.folder is not None else []
        return devicelock.stopped(warmers) if warmers else contextlib.nullcontext()


def serve(
    folder: Folder,
    warm: Callable[[BackendPlan], None],
    idle: Callable[[], None] = lambda: None,
) -> int:
    """A warmer's loop: the nearest plan selection wants that nobody has claimed, claimed,
    built (``warm``) and marked done, whether its build failed or not (done means ended: a
    failure here is only a miss of the cache for selection, said in the log); ``idle()``
    between builds, where the warmer holds nothing of the GPU. A plan selection stopped
    wanting as it was claimed is marked done unbuilt: selection, about to build one that
    autotunes, has wanted nothing and waits only for the claims it saw. Ends once
    :data:`FINISHED` exists, or the folder or this process's parent is gone. Returns how
    many plans it built."""
    parent, built = os.getppid(), 0
    while True:
        if (folder.path / FINISHED).exists() or not folder.path.is_dir():
            return built
        if os.getppid() != parent:
            return built
        plan = next(  # a done plan is claimed too
            (p for p in folder.wanted() if not folder.claimed(p).exists() and folder.claim(p)),
            None,
        )
        if plan is None:
            time.sleep(POLL_S)
            continue
        if plan not in folder.wanted():
            folder.mark_done(plan)
            continue
        try:
            warm(plan)
            built += 1
        except Exception as exc:  # a pass or Inductor failed: selection's own build will say
            said = str(exc).splitlines()[0] if str(exc) else ""
            common.phase(f"failed to build {plan_name(plan)}: {type(exc).__name__}: {said[:200]}")
        finally:
            folder.mark_done(plan)
            idle()


def idle_priority() -> bool:
    """Run this process, and the threads and compile workers it starts, only on CPU time
    nothing else on the host wants (Linux's ``SCHED_IDLE``): a compile ahead is a guess, and
    must not slow selection's own build on the CPUs it shares. False where the platform has
    no such policy, or refuses it."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        return False
    return True


def on_host_cpus() -> int | None:
    """Move this process, the threads and compile workers it starts after, onto every CPU the
    session had before it pinned its worker to a slice (``gpus.HOST_CPUS_ENV``): a warmer at
    idle priority takes only CPU time nobody else wants, anywhere on the host, where on its
    slice it had only what selection left of two CPUs, and a build is one thread of Python.
    The number of CPUs, or None where nothing names more than the slice."""
    from pytest_opprof.gpus import onto_host

    return None if onto_host() is None else len(os.sched_getaffinity(0))


def slice_cpus() -> int:
    """The CPUs of this worker's slice (the session's affinity, ``gpus.pin_worker``); one
    where the platform does not say."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return 1


def warms_rungs(run: WorkloadRun, beside: int) -> int:
    """How many rung warmers run beside selection (``beside``: how many of the workload's
    other processes run then: the stock task, the stock warmer); 0 for none. Only with
    ``--opprof-warm-rungs``, and by the rule of the recapture's timing processes
    (``common.side_by_side``): under a GPU lock, and as many as the capture's peak memory
    says fit, selection and the warmers with the others; one for each CPU of this worker's
    slice, :data:`MAX_WARMERS` at most. Elsewhere (the CPU, no lock, no profile, no room)
    selection builds every plan itself, as without the option."""
    if not run.setting("warm_rungs"):
        return 0
    path = run.out_dir / "profile.json"
    if not path.is_file():
        return 0
    baseline = read_artifact(path, Profile).capture_metadata
    most = min(slice_cpus(), MAX_WARMERS)
    return next((n for n in range(most, 0, -1) if common.side_by_side(baseline, 1 + beside + n)), 0)


def selected_beside_warmers(run: WorkloadRun, stage: str, warmers: int, **extra: Any) -> None:
    """Selection's process (task ``stage``; ``extra``: more of its spec) and ``warmers`` rung
    warmers beside it (logs :func:`log_name`), on the same CPU slice (``shares_cpus``, each
    compiling in its own process only: selection stops their process groups while it
    measures; the warmers at idle priority reach the host's other CPUs too,
    :func:`on_host_cpus`), outside the siblings' lock, which would make selection's
    measurements wait for the warmers' compiles. The warmers end once selection has
    (:data:`FINISHED`, created however selection ended); a warmer that failed, ran out of
    time or crashed fails nothing (selection's wait for a plan it claimed ends with its
    process, and every wait once :data:`ENDED` is created, when every warmer has ended,
    however each ended; its log says why). Returns, or raises selection's error, once all
    have ended (an interrupt: at once)."""
    with tempfile.TemporaryDirectory(prefix="opprof-rungs-") as tmp:
        folder = Folder(Path(tmp))
        folder.start(warmers)

        def warm(index: int) -> None:
            # a warmer's error: selection builds itself each plan this one would have
            with contextlib.suppress(OpprofError):
                run.run_child(
                    TASK,
                    stage,
                    log_name=log_name(index),
                    shares_cpus=True,
                    compile_pool=True,  # at idle priority, as the warmer is (task_warm_rungs)
                    rung_warmer=tmp,
                )

        def warm_all() -> None:
            try:
                with ThreadPoolExecutor(warmers) as pool:
                    for each in [pool.submit(warm, i) for i in range(warmers)]:
                        each.result()
            finally:
                (folder.path / ENDED).touch()

        with common.beside(warm_all) as warmed:
            try:
                run.run_child(stage, stage, **extra, rung_warmer=tmp)
            finally:
                (folder.path / FINISHED).touch()
        warmed.result()  # a bug of ours in the threads, not a warmer's failure
