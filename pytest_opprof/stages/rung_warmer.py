"""Selection's rungs compiled ahead (``--opprof-warm-rungs``): a sibling process, the rung
warmer, compiles the plan measured selection will most likely build next, so that Inductor's
FX graph cache, which the session's processes share, answers selection's own build of it.

The two talk through files in a folder their parent makes (``ChildSpec.rung_warmer``).
Selection alone decides what to warm (:class:`Ahead`): as it starts a rung of its first pass
it names in :data:`WANTED` one plan, the one it builds next where this rung is kept, or none.
The warmer (:func:`serve`) claims a wanted plan by creating its claim file exclusively, builds
it and marks it done, however its build ended. Selection claims each plan it builds too: one
the warmer claimed first it waits for (until done, or until the warmer has :data:`ENDED`),
holding nothing of the GPU, then builds it itself, the cache answering; one selection claimed
the warmer never builds. While selection measures it stops the warmer (``devicelock.stopped``),
so no compile of the warmer's runs beside a timing on their shared CPUs. The warmer ends once
selection has (:data:`FINISHED`). Nothing of the warmer's can fail the stage: its failure
costs selection at most a wait. The parent half (:func:`selected_beside_warmer`) runs the two.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_opprof import devicelock
from pytest_opprof.errors import OpprofError
from pytest_opprof.schema import BackendPlan, Profile, read_artifact, write_text_atomic
from pytest_opprof.stages import common, recapture

if TYPE_CHECKING:
    from pytest_opprof.backend.plan import Rung
    from pytest_opprof.pipeline import WorkloadRun

TASK = "warm_rungs"
"""The rung warmer's task, and its log's name (``profiler_output/warm_rungs.log``)."""
WANTED = "wanted.json"
"""The plan selection wants compiled ahead (a ``BackendPlan`` as JSON), or nothing (empty)."""
PID = "warmer.pid"
"""The warmer's ``devicelock.identity``, written as it starts: whom selection stops."""
FINISHED = "finished"
"""Created by the parent once selection has ended, however it ended: the warmer ends too."""
ENDED = "ended"
"""Created by the parent once the warmer has ended, however it ended: no wait goes on."""
POLL_S = 0.1
"""How often the warmer reads what selection wants while it has nothing to build."""


def plan_key(plan: BackendPlan) -> str:
    """A plan's name in the folder: the same plan, the same key, in either process."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()[:32]


def autotunes(plan: BackendPlan) -> bool:
    """Whether building ``plan`` times kernels on the GPU (Inductor's max-autotune, a stock
    recipe's ``mode="max-autotune"``): such a compile is never made ahead, and none of the
    warmer's runs beside it."""
    return bool(plan.config_patches.get("max_autotune") or plan.stock_recipe)


def plan_after(plan: BackendPlan, rung: Rung | None) -> BackendPlan | None:
    """The plan selection builds after ``plan`` where ``plan`` is kept: ``rung`` on top of it;
    None where there is no next rung, where selection would not build it (a proposal of it
    cannot change ``plan``: ``backend.plan.cannot_change``), or where it autotunes."""
    from pytest_opprof.backend.plan import add_proposal, cannot_change

    if rung is None or any(cannot_change(plan, p) for p in rung.proposals):
        return None
    for p in rung.proposals:
        plan = add_proposal(plan, p)
    return None if autotunes(plan) else plan


def plan_name(plan: BackendPlan) -> str:
    return "+".join(plan.proposals) or "the baseline"


class Folder:
    """The files of one selection and its warmer (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def want(self, plan: BackendPlan | None) -> None:
        write_text_atomic(self.path / WANTED, plan.model_dump_json() if plan is not None else "")

    def wanted(self) -> BackendPlan | None:
        try:
            text = (self.path / WANTED).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        return BackendPlan.model_validate_json(text) if text else None

    def claim(self, plan: BackendPlan) -> bool:
        """Claim ``plan`` for this process: False where the other claimed it first."""
        try:
            os.close(os.open(self.claimed(plan), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
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

    def announce(self) -> None:
        """Name this process as the warmer, for selection to stop while it measures."""
        me = devicelock.identity()
        if me is not None:
            write_text_atomic(self.path / PID, me)

    def warmer(self) -> str | None:
        """The warmer's ``devicelock.identity``, where it has started and not yet ended."""
        if (self.path / ENDED).exists():
            return None
        try:
            return (self.path / PID).read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None


class Ahead:
    """Selection's half, a no-op without a warmer (``folder`` None): what to want, when to
    wait, and the warmer stopped while selection measures."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Folder(Path(folder)) if folder is not None else None
        self._mine: set[str] = set()
        """The keys of the plans selection claimed: the warmer never builds those."""

    def want(self, plan: BackendPlan, then: Rung | None) -> None:
        """At the start of a first-pass rung whose plan is ``plan``: want compiled the plan
        of the next rung, ``then``, on top of it (:func:`plan_after`), or nothing."""
        if self.folder is not None:
            self.folder.want(plan_after(plan, then))

    def before_build(self, plan: BackendPlan, sync: Callable[[], None]) -> None:
        """Before selection builds ``plan``: claim it, or, where the warmer has, wait for its
        build to end; before a build that autotunes, wait for any build of the warmer's
        under way too, so that no compile of the warmer's runs beside its timings. The wait
        holds nothing of the GPU (``sync`` first: this process's GPU work done), is said in
        the stage log, and the GPU is shared again after it."""
        if self.folder is None:
            return
        folder, key = self.folder, plan_key(plan)
        awaited: list[Path] = []
        if folder.claim(plan):
            self._mine.add(key)
        elif key not in self._mine:  # the warmer's
            awaited.append(folder.done(plan))
        if autotunes(plan):
            awaited += folder.under_way(besides=self._mine)
        pending = [p for p in dict.fromkeys(awaited) if not p.exists()]
        if not pending or (folder.path / ENDED).exists():
            return
        sync()
        name = plan_name(plan)
        for done in pending:
            what = (
                f"the rung warmer's build of {name}"
                if done == folder.done(plan)
                else f"the rung warmer's build under way, before {name} autotunes"
            )
            waited = common.wait_for_file(
                [done, folder.path / ENDED], f"waiting for {what}", f"{what} ended"
            )
            if waited is not None:
                common.phase(f"waited {waited:.1f} s for {what}")
        devicelock.resume()

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        """A measurement's block, inside ``devicelock.measuring`` (the GPU held alone): the
        warmer and its process group stopped for it, where it runs."""
        warmer = self.folder.warmer() if self.folder is not None else None
        return devicelock.stopped([warmer]) if warmer else contextlib.nullcontext()


def serve(
    folder: Folder,
    warm: Callable[[BackendPlan], None],
    idle: Callable[[], None] = lambda: None,
) -> int:
    """The warmer's loop: each plan selection wants that neither has claimed, claimed, built
    (``warm``) and marked done, whether its build failed or not (done means ended: a failure
    here is only a miss of the cache for selection, said in the log); ``idle()`` between
    builds, where the warmer holds nothing of the GPU. Ends once :data:`FINISHED` exists, or
    the folder or this process's parent is gone. Returns how many plans it built."""
    parent, built = os.getppid(), 0
    while True:
        if (folder.path / FINISHED).exists() or not folder.path.is_dir():
            return built
        if os.getppid() != parent:
            return built
        plan = folder.wanted()
        if plan is None or folder.done(plan).exists() or not folder.claim(plan):
            time.sleep(POLL_S)
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


def warms_rungs(run: WorkloadRun, beside: int) -> bool:
    """Whether the rung warmer runs beside selection (``beside``: how many of the workload's
    other processes run then: the stock task, the stock warmer): only with
    ``--opprof-warm-rungs``, and by the rule of the recapture's timing processes
    (``recapture.side_by_side``): under a GPU lock, and where the capture's peak memory says
    all of them fit, selection and the warmer with the others. Elsewhere (the CPU, no lock,
    no profile, no room) selection builds every plan itself, as without the option."""
    if not run.setting("warm_rungs"):
        return False
    path = run.out_dir / "profile.json"
    if not path.is_file():
        return False
    baseline = read_artifact(path, Profile).capture_metadata
    return recapture.side_by_side(baseline, 2 + beside)


def selected_beside_warmer(run: WorkloadRun, stage: str, **extra: Any) -> None:
    """Selection's process (task ``stage``; ``extra``: more of its spec) and the rung
    warmer's beside it, on the same CPU slice (``shares_cpus``, compiling in its own process
    only: selection stops its process group while it measures), outside the siblings' lock,
    which would make selection's measurements wait for the warmer's compiles. The warmer
    ends once selection has (:data:`FINISHED`, created however selection ended); a warmer
    that failed, ran out of time or crashed fails nothing (:data:`ENDED`, created however it
    ended, ends any wait of selection's for it; its log says why). Returns, or raises
    selection's error, once both have ended (an interrupt: at once)."""
    with tempfile.TemporaryDirectory(prefix="opprof-rungs-") as tmp:
        folder = Path(tmp)

        def warm() -> None:
            try:
                run.run_child(TASK, stage, shares_cpus=True, rung_warmer=tmp)
            except OpprofError:  # selection builds every plan itself
                pass
            finally:
                (folder / ENDED).touch()

        with common.beside(warm) as warmed:
            try:
                run.run_child(stage, stage, **extra, rung_warmer=tmp)
            finally:
                (folder / FINISHED).touch()
        warmed.result()  # a bug of ours in the thread, not the warmer's failure
