"""Selection's rungs compiled ahead (``--opprof-warm-rungs``): selection names the plans it will
likely build next, nearest first, the rung warmers beside it each claim and build one, selection
waits for a plan a warmer claimed (not for one none did) and stops every warmer while it
measures. The protocol runs here on real files with threads, the pause on real processes; the
parent half with stand-in children as in test_stock_beside_selection.py; and, marked slow, a
warmer's real task on the CPU, whose compile Inductor's FX graph cache answers in another
process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.backend.plan import Rung, add_proposal
from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.errors import StageError, StageTimedOut, WorkloadError
from pytest_opprof.schema import (
    BackendPlan,
    BackendSelection,
    Optimizations,
    Profile,
    read_artifact,
    write_artifact,
)
from pytest_opprof.stages import backend, rung_warmer
from pytest_opprof.stages.rung_warmer import ENDED, FINISHED, WARMERS, Ahead, Folder

H200 = Path(__file__).parents[1] / "data" / "h200"
GIB = 1 << 30
PATIENCE_S = 10.0
"""How long a test waits for the other side: past it, the protocol is broken."""
ROOT = Path(__file__).parents[2]


def _proposals() -> dict[str, Any]:
    found = read_artifact(H200 / "conv_block" / "optimizations.json.gz", Optimizations)
    by_type = {p.type: p for p in found.proposals}
    other = read_artifact(H200 / "embedding_projection" / "optimizations.json.gz", Optimizations)
    by_type["gemm_epilogue"] = next(p for p in other.proposals if p.type == "gemm_epilogue")
    by_type["max_autotune"] = by_type["cuda_graphs"].model_copy(
        update={
            "id": "algorithm_selection-1",
            "type": "algorithm_selection",
            "params": {"config_patches": {"max_autotune": True}},
        }
    )
    return by_type


P = _proposals()


def _rung(kind: str) -> Rung:
    return Rung(kind, (P[kind],))


def _plan(*kinds: str) -> BackendPlan:
    plan = BackendPlan()
    for kind in kinds:
        plan = add_proposal(plan, P[kind])
    return plan


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.01)


class Warmer:
    """``rung_warmer.serve`` in a thread, with a stand-in build: each plan recorded; a build
    waits for ``release`` where given, and raises where its plan's name is in ``fails``."""

    def __init__(self, folder: Path, release: threading.Event | None = None, fails: str = ""):
        self.folder, self.release, self.fails = Folder(folder), release, fails
        self.built: list[str] = []
        self.started: list[str] = []
        self.building = threading.Event()
        self.returned: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _warm(self, plan: BackendPlan) -> None:
        self.started.append(rung_warmer.plan_name(plan))
        self.building.set()
        if self.release is not None:
            assert self.release.wait(PATIENCE_S)
        self.built.append(rung_warmer.plan_name(plan))
        if rung_warmer.plan_name(plan) == self.fails:
            raise RuntimeError("Inductor failed on it")

    def _serve(self) -> None:
        self.returned.append(rung_warmer.serve(self.folder, self._warm))

    def finish(self) -> int:
        (self.folder.path / FINISHED).touch()
        self.thread.join(PATIENCE_S)
        assert not self.thread.is_alive(), "the warmer did not end"
        return self.returned[0]


@pytest.fixture
def gpu_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GPU lock's let-go and resume, recorded (a wait holds nothing of the GPU)."""
    calls: list[str] = []
    monkeypatch.setattr(devicelock, "let_go", lambda: calls.append("let go"))
    monkeypatch.setattr(devicelock, "resume", lambda: calls.append("resume"))
    return calls


def _before_build(ahead: Ahead, plan: BackendPlan, synced: list[str]) -> threading.Thread:
    waiter = threading.Thread(
        target=ahead.before_build, args=(plan, lambda: synced.append("sync")), daemon=True
    )
    waiter.start()
    return waiter


def test_the_warmer_builds_the_plan_selection_wants_next_and_marks_it_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Selection, starting the dtype rung with the layout rung last, wants both built: the
    plan it builds next where the dtype rung is kept (one warmer, where the parent does not
    say how many). The warmer claims that plan, builds it once, marks it done, and builds
    nothing more while nothing new is wanted; selection then finds it done and waits for
    nothing."""
    warmer = Warmer(tmp_path)
    ahead = Ahead(str(tmp_path))
    now = _plan("dtype_promotion")
    ahead.want(now, [_rung("memory_layout")])
    following = _plan("dtype_promotion", "memory_layout")
    assert Folder(tmp_path).wanted() == [following]
    _until(Folder(tmp_path).done(following).exists, "the warmer's build")
    assert Folder(tmp_path).claimed(following).exists()
    time.sleep(0.3)  # polled again meanwhile: the same plan is not built twice
    synced: list[str] = []
    ahead.before_build(following, lambda: synced.append("sync"))
    assert synced == []  # built already: no wait
    assert warmer.finish() == 1
    assert warmer.built == ["dtype_promotion-1+memory_layout-1"]
    assert "rung warmer" not in capsys.readouterr().out


def test_selection_waits_for_a_plan_the_warmer_claimed_holding_nothing_of_the_gpu(
    tmp_path: Path, gpu_calls: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    release = threading.Event()
    warmer = Warmer(tmp_path, release)
    ahead = Ahead(str(tmp_path))
    plan = _plan("dtype_promotion", "memory_layout")
    ahead.want(_plan("dtype_promotion"), [_rung("memory_layout")])
    assert warmer.building.wait(PATIENCE_S)
    synced: list[str] = []
    waiter = _before_build(ahead, plan, synced)
    time.sleep(0.4)
    assert waiter.is_alive(), "selection built a plan the warmer was building"
    assert synced == ["sync"] and gpu_calls == ["let go"]
    release.set()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive()
    assert gpu_calls == ["let go", "resume"]
    log = capsys.readouterr().out
    assert "waiting for the rung warmer's build of dtype_promotion-1+memory_layout-1" in log
    waited = re.search(r"waited ([\d.]+) s for the rung warmer's build", log)
    assert waited is not None and float(waited.group(1)) >= 0.3
    warmer.finish()


def test_selection_builds_an_unclaimed_plan_at_once_and_the_warmer_never_builds_it(
    tmp_path: Path, gpu_calls: list[str]
) -> None:
    """Selection claims what it builds: a plan wanted too late is not built twice."""
    ahead = Ahead(str(tmp_path))
    plan = _plan("dtype_promotion", "memory_layout")
    synced: list[str] = []
    ahead.before_build(plan, lambda: synced.append("sync"))
    assert synced == [] and gpu_calls == []
    assert Folder(tmp_path).claimed(plan).exists()
    Folder(tmp_path).want([plan])  # read by a warmer only now
    warmer = Warmer(tmp_path)
    time.sleep(0.4)
    assert warmer.finish() == 0 and warmer.built == []
    ahead.before_build(plan, lambda: synced.append("sync"))  # built again: its own claim
    assert synced == [] and gpu_calls == []


def test_the_warmers_end_ends_a_wait(tmp_path: Path, gpu_calls: list[str]) -> None:
    """A warmer that crashed mid-build never marks its plan done: the parent's marker of its
    end ends selection's wait, and selection builds the plan itself."""
    plan = _plan("dtype_promotion")
    assert Folder(tmp_path).claim(plan)  # the warmer's, which then dies
    synced: list[str] = []
    t0 = time.monotonic()
    waiter = _before_build(Ahead(str(tmp_path)), plan, synced)
    threading.Timer(0.3, (tmp_path / ENDED).touch).start()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive() and time.monotonic() - t0 >= 0.3
    assert gpu_calls == ["let go", "resume"]
    # once it has ended, no wait at all
    assert Folder(tmp_path).claim(_plan("memory_layout"))
    gpu_calls.clear()
    Ahead(str(tmp_path)).before_build(_plan("memory_layout"), lambda: synced.append("again"))
    assert gpu_calls == [] and "again" not in synced


def test_a_build_that_failed_is_marked_done_and_the_warmer_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    warmer = Warmer(tmp_path, fails="dtype_promotion-1+memory_layout-1")
    ahead = Ahead(str(tmp_path))
    failing, after = _plan("dtype_promotion", "memory_layout"), _plan("memory_layout", "bn_fold")
    ahead.want(_plan("dtype_promotion"), [_rung("memory_layout")])
    _until(Folder(tmp_path).done(failing).exists, "the failed build's mark")
    ahead.want(_plan("memory_layout"), [_rung("bn_fold")])
    _until(Folder(tmp_path).done(after).exists, "the next build")
    assert warmer.finish() == 1  # built: the one that did not fail
    assert warmer.built == ["dtype_promotion-1+memory_layout-1", "memory_layout-1+bn_fold-1"]
    log = capsys.readouterr().out
    assert "failed to build dtype_promotion-1+memory_layout-1: RuntimeError: Inductor" in log


def test_the_warmer_ends_once_selection_has_or_its_folder_is_gone(tmp_path: Path) -> None:
    folder = tmp_path / "rungs"
    folder.mkdir()
    warmer = Warmer(folder)
    time.sleep(0.2)
    assert warmer.thread.is_alive()  # nothing wanted: it polls
    assert warmer.finish() == 0
    gone = Warmer(tmp_path / "removed")
    gone.thread.join(PATIENCE_S)
    assert not gone.thread.is_alive() and gone.returned == [0]


def test_nothing_is_wanted_after_the_last_rung_a_moot_one_or_one_that_autotunes(
    tmp_path: Path,
) -> None:
    """Selection would not build a moot rung; an autotuning compile times kernels on the GPU,
    which a compile ahead must not do beside selection's work."""
    ahead, folder = Ahead(str(tmp_path)), Folder(tmp_path)
    plan = _plan("dtype_promotion")
    ahead.want(plan, [_rung("bn_fold")])
    assert folder.wanted() == [_plan("dtype_promotion", "bn_fold")]
    for after in ([], [_rung("max_autotune"), _rung("bn_fold")]):
        ahead.want(plan, after)
        assert folder.wanted() == []
    ahead.want(BackendPlan(), [_rung("gemm_epilogue")])  # exact GELUs on fp32 GEMMs: moot
    assert folder.wanted() == []
    Ahead(None).want(plan, [_rung("bn_fold")])  # no warmer: nothing written anywhere
    assert rung_warmer.autotunes(BackendPlan(stock_recipe="cast"))


def test_an_autotuning_build_waits_for_the_warmers_build_under_way(
    tmp_path: Path, gpu_calls: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Even of a plan selection will not build (its rung was dropped): its compile must not
    run beside the autotuning's timings."""
    release = threading.Event()
    warmer = Warmer(tmp_path, release)
    ahead = Ahead(str(tmp_path))
    ahead.want(_plan("dtype_promotion"), [_rung("memory_layout")])
    assert warmer.building.wait(PATIENCE_S)
    plain, tuned = _plan("bn_fold"), _plan("bn_fold", "max_autotune")
    synced: list[str] = []
    ahead.before_build(plain, lambda: synced.append("sync"))  # not the warmer's: no wait
    assert synced == []
    waiter = _before_build(ahead, tuned, synced)
    time.sleep(0.3)
    assert waiter.is_alive() and synced == ["sync"]
    release.set()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive()
    assert "before bn_fold-1+algorithm_selection-1 autotunes" in capsys.readouterr().out
    warmer.finish()


def test_selection_wants_the_next_build_of_every_branch_first_two_plans_for_each_warmer(
    tmp_path: Path,
) -> None:
    """Three warmers, six plans: level by level over the rungs' outcomes, each rung kept or
    dropped, the branch that kept more first on each level; a rung that cannot change a
    branch's plan is skipped there (selection does not build it), nothing is wanted past a
    plan that autotunes, and after the last rung nothing is wanted."""
    ahead, folder = Ahead(str(tmp_path)), Folder(tmp_path)
    folder.start(3)
    rungs = [_rung(k) for k in ("dtype_promotion", "memory_layout", "bn_fold", "cuda_graphs")]
    ahead.want(BackendPlan(), rungs)
    assert folder.wanted() == [
        _plan("dtype_promotion"),
        _plan("dtype_promotion", "memory_layout"),
        _plan("memory_layout"),
        _plan("dtype_promotion", "memory_layout", "bn_fold"),
        _plan("dtype_promotion", "bn_fold"),
        _plan("memory_layout", "bn_fold"),
    ]
    # exact GELUs on GEMMs the plan keeps in fp32: moot, and the layout rung meets bn_fold
    ahead.want(BackendPlan(), [_rung("bn_fold"), _rung("gemm_epilogue"), _rung("memory_layout")])
    assert folder.wanted() == [
        _plan("bn_fold"),
        _plan("bn_fold", "memory_layout"),
        _plan("memory_layout"),
    ]
    ahead.want(BackendPlan(), [_rung("bn_fold"), _rung("max_autotune"), _rung("memory_layout")])
    assert folder.wanted() == [_plan("bn_fold")]
    ahead.want(_plan("bn_fold"), [])
    assert folder.wanted() == []
    folder.start(2)
    ahead.want(BackendPlan(), rungs)
    assert len(folder.wanted()) == 4
    assert rung_warmer.plans_after(BackendPlan(), rungs, 1) == [_plan("dtype_promotion")]


def test_the_next_build_is_wanted_whether_the_rung_under_way_is_kept_or_dropped(
    tmp_path: Path,
) -> None:
    """Selection builds the dtype rung on the plan below it: one warmer is asked for the
    layout rung on top of each, the dtype rung kept first, so that one of the two is always
    selection's next build, whatever it decides (the kept branch alone misses it wherever the
    rung is dropped)."""
    ahead, folder = Ahead(str(tmp_path)), Folder(tmp_path)
    now, below = _plan("dtype_promotion"), BackendPlan()
    ahead.want(now, [_rung("memory_layout"), _rung("bn_fold")], below)
    assert folder.wanted() == [_plan("dtype_promotion", "memory_layout"), _plan("memory_layout")]
    folder.start(2)
    ahead.want(now, [_rung("memory_layout"), _rung("bn_fold")], below)
    assert folder.wanted() == [
        _plan("dtype_promotion", "memory_layout"),
        _plan("memory_layout"),
        _plan("dtype_promotion", "memory_layout", "bn_fold"),
        _plan("dtype_promotion", "bn_fold"),
    ]
    ahead.want(now, [_rung("memory_layout")], now)  # the plan either way: one branch
    assert folder.wanted() == [_plan("dtype_promotion", "memory_layout")]
    # nothing ahead of a rung that autotunes, not even on the branch that drops it
    tuned = _plan("bn_fold", "max_autotune")
    ahead.want(tuned, [_rung("memory_layout")], _plan("bn_fold"))
    assert folder.wanted() == []


def test_two_warmers_never_build_one_plan_each_taking_the_nearest_unclaimed_one(
    tmp_path: Path,
) -> None:
    """Selection claimed the nearest plan itself (it builds it now): the first warmer takes the
    next, the second the one after; the last plan is built once, by whichever is free."""
    release = threading.Event()
    folder = Folder(tmp_path)
    folder.start(3)
    plans = [
        _plan("dtype_promotion"),
        _plan("dtype_promotion", "memory_layout"),
        _plan("dtype_promotion", "memory_layout", "bn_fold"),
        _plan("dtype_promotion", "memory_layout", "bn_fold", "cuda_graphs"),
    ]
    folder.want(plans)
    assert folder.claim(plans[0])  # selection's
    first = Warmer(tmp_path, release)
    assert first.building.wait(PATIENCE_S)
    second = Warmer(tmp_path, release)
    assert second.building.wait(PATIENCE_S)
    names = [rung_warmer.plan_name(p) for p in plans]
    assert first.started == [names[1]] and second.started == [names[2]]
    release.set()
    _until(folder.done(plans[3]).exists, "the farthest plan's build")
    time.sleep(0.3)  # polled again meanwhile: nothing is built twice
    assert first.finish() + second.finish() == 3
    assert sorted(first.built + second.built) == sorted(names[1:])


def test_a_plan_no_longer_wanted_as_it_is_claimed_is_let_go_unbuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selection, about to build a plan that autotunes, wants nothing and then waits for the
    claims it sees: a warmer that read the former list and claims a plan of it after that
    must not build it beside the autotuning."""
    folder = Folder(tmp_path)
    stale = _plan("dtype_promotion", "memory_layout")
    folder.want([stale])
    claim = Folder.claim

    def late(self: Folder, plan: BackendPlan) -> bool:
        self.want([])  # selection moved on between the warmer's read and its claim
        return claim(self, plan)

    monkeypatch.setattr(Folder, "claim", late)
    warmer = Warmer(tmp_path)
    _until(folder.done(stale).exists, "the plan let go")
    assert warmer.finish() == 0 and warmer.started == []


def test_a_wait_for_a_plan_ends_with_the_warmer_that_claimed_it_while_others_go_on(
    tmp_path: Path, gpu_calls: list[str]
) -> None:
    """A warmer killed mid-build never marks its plan done, and :data:`ENDED` waits for the
    other warmers, which end only after selection: its process gone ends the wait."""
    claimer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _until(lambda: devicelock.identity(claimer.pid) is not None, "the claimer's start")
        plan = _plan("dtype_promotion")
        Folder(tmp_path).claimed(plan).write_text(str(devicelock.identity(claimer.pid)))
        synced: list[str] = []
        waiter = _before_build(Ahead(str(tmp_path)), plan, synced)
        time.sleep(0.4)
        assert waiter.is_alive() and synced == ["sync"]  # its build is under way
    finally:
        claimer.kill()
        claimer.wait()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive(), "selection still waits for a warmer that is gone"
    assert gpu_calls == ["let go", "resume"] and not (tmp_path / ENDED).exists()


# ------------------------------------------------------------------------------ the pause

COUNTER = """import sys, time
n = 0
while True:
    n += 1
    with open(sys.argv[1], "w") as fh:
        fh.write(str(n))
    time.sleep(0.01)
"""


@pytest.fixture
def busy(tmp_path: Path) -> Any:
    """A process leading its own group, as a stage process does, that counts in a file."""
    count = tmp_path / "count"
    proc = subprocess.Popen([sys.executable, "-c", COUNTER, str(count)], start_new_session=True)
    _until(lambda: count.exists() and count.read_text(), "the counter's start")
    yield SimpleNamespace(proc=proc, count=count)
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def _counts(count: Path) -> bool:
    """Whether the counter moves over a moment."""
    before = count.read_text()
    time.sleep(0.3)
    return count.read_text() != before


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_process_is_stopped_for_the_block_and_continued_after(busy: Any) -> None:
    me = devicelock.identity(busy.proc.pid)
    assert me is not None
    with devicelock.stopped([me]) as targets:
        assert targets == [-busy.proc.pid]  # its group: a stage process's compile workers too
        _until(lambda: _state(busy.proc.pid) == "T", "the stop")
        assert not _counts(busy.count)
    assert _state(busy.proc.pid) != "T" and _counts(busy.count)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_process_it_cannot_name_is_left_alone(busy: Any) -> None:
    """A pid whose start time is not the one named is a later process: never stopped."""
    pid = busy.proc.pid
    for name in (f"{pid}-1", "", f"{os.getpid()}-{devicelock.identity()}"):
        with devicelock.stopped([name]) as targets:
            assert targets == []
            assert _counts(busy.count)


PAUSER = """import sys, time
from pytest_opprof import devicelock
with devicelock.stopped([sys.argv[1]]):
    print("stopped", flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_guardian_continues_the_process_should_selection_die_mid_pause(busy: Any) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pauser = subprocess.Popen(
        [sys.executable, "-c", PAUSER, str(devicelock.identity(busy.proc.pid))],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert pauser.stdout is not None
    assert pauser.stdout.readline().strip() == "stopped"
    pauser.stdout.close()
    _until(lambda: _state(busy.proc.pid) == "T", "the stop")
    pauser.kill()  # selection dies measuring
    pauser.wait()
    _until(lambda: _state(busy.proc.pid) != "T", "the guardian's continue")
    assert _counts(busy.count)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_selection_stops_the_warmer_that_named_itself_while_it_measures(
    tmp_path: Path, busy: Any
) -> None:
    ahead = Ahead(str(tmp_path))
    with ahead.paused():  # not started yet: nothing to stop
        assert _counts(busy.count)
    (tmp_path / f"{busy.proc.pid}.warmer").write_text(str(devicelock.identity(busy.proc.pid)))
    with ahead.paused():
        _until(lambda: _state(busy.proc.pid) == "T", "the stop")
    assert _counts(busy.count)
    (tmp_path / ENDED).touch()
    with ahead.paused():  # ended: its pid may be another's by now
        assert _counts(busy.count)
    with Ahead(None).paused():
        assert _counts(busy.count)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_selection_stops_every_warmer_that_named_itself_while_it_measures(
    tmp_path: Path, busy: Any
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    count = other / "count"
    second = subprocess.Popen([sys.executable, "-c", COUNTER, str(count)], start_new_session=True)
    try:
        _until(lambda: count.exists() and count.read_text(), "the second counter's start")
        for proc in (busy.proc, second):
            me = devicelock.identity(proc.pid)
            (tmp_path / f"{proc.pid}.warmer").write_text(str(me))
        with Ahead(str(tmp_path)).paused():
            _until(lambda: _state(busy.proc.pid) == _state(second.pid) == "T", "both stops")
            assert not _counts(count)
        assert _counts(busy.count) and _counts(count)
    finally:
        os.kill(second.pid, signal.SIGCONT)
        second.kill()
        second.wait()


# ------------------------------------------------------------------------ the parent half

WARMER_ENDS = {
    "failed": StageError("w.py: the backend process failed (exit 1)"),
    "out-of-time": StageTimedOut("w.py: backend did not finish within 900 s"),
    "crashed": StageError("w.py: the backend process was killed by SIGSEGV"),
    "out-of-memory": WorkloadError("w.py: out of GPU memory during warm_rungs"),
}


class StandIn:
    """What ``backend.run`` uses of a ``WorkloadRun``. Each warmer's child starts, notes
    whether selection runs, and ends once ``FINISHED`` is there (``ends``: else it fails at
    once, each warmer or those whose logs ``ending`` names), noting whether selection had
    ended by then; selection, given the folder, waits until a warmer has started (or, where
    they fail, until ``ENDED``, or until those ``ending`` have ended), as a selection whose
    rungs take a while does, and notes how many plans it would want ahead."""

    def __init__(
        self,
        folder: Path,
        *,
        warm_rungs: bool = True,
        stock: bool = False,
        ends: str | None = None,
        ending: tuple[str, ...] | None = None,
        fail_select: bool = False,
        interrupt: bool = False,
    ) -> None:
        self.out_dir = folder / "out"
        self.profiler_output = self.out_dir / "profiler_output"
        self.profiler_output.mkdir(parents=True)
        self.spec = SimpleNamespace(stem="conv_block", path=folder / "conv_block.py", overrides={})
        self.generated = self.out_dir / "conv_block_optimized.py"
        self.generated_test = self.out_dir / "test_conv_block_optimized.py"
        self.warm_rungs, self.stock, self.ends, self.ending = warm_rungs, stock, ends, ending
        self.fail_select, self.interrupt = fail_select, interrupt
        self.extras: dict[str, dict[str, Any]] = {}
        self.warming = threading.Event()
        self.warm_ended = threading.Event()
        self.ended_logs: list[str] = []
        self.selection_ended = False
        self.finished_after_selection: list[bool] = []
        self.ended_seen: bool | None = None
        self.depth: int | None = None
        optimizations = read_artifact(H200 / "conv_block" / "optimizations.json.gz", Optimizations)
        write_artifact(self.out_dir / "optimizations.json", optimizations)

    def measures_stock(self) -> bool:
        return self.stock

    def extra_passes(self) -> dict[str, Any]:
        return {}

    def setting(self, name: str) -> Any:
        return {"timeout": 900, "warm_rungs": self.warm_rungs}[name]

    def base_setting(self, name: str) -> Any:
        return {"baseline": "compile"}[name]

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert stage == "backend"
        self.extras[extra.get("log_name") or task] = extra
        if task in ("stock", backend.STOCK_WARM):
            return
        if task == rung_warmer.TASK:
            folder = Path(extra["rung_warmer"])
            warmers = int((folder / WARMERS).read_text())  # before selection may go on
            self.warming.set()
            try:
                failing = self.ending is None or extra["log_name"] in self.ending
                if self.ends is not None and failing:
                    raise WARMER_ENDS[self.ends]
                finished = folder / FINISHED
                deadline = time.monotonic() + PATIENCE_S
                while not finished.exists() and time.monotonic() < deadline:
                    if not finished.parent.is_dir():  # the stage is over (an interrupt)
                        break
                    time.sleep(0.01)
                self.finished_after_selection.append(finished.exists() and self.selection_ended)
                if self.interrupt:
                    time.sleep(2.0)  # still ending as the session stops
            finally:
                self.ended_logs.append(extra["log_name"])
                if len(self.ended_logs) == warmers:
                    self.warm_ended.set()
            return
        if "rung_warmer" in extra:
            ended = Path(extra["rung_warmer"]) / ENDED
            self.depth = Folder(Path(extra["rung_warmer"])).depth()
            assert self.warming.wait(PATIENCE_S), "the warmer did not start beside selection"
            if self.ends is not None and self.ending is None:
                _until(ended.exists, "the failed warmers' end marker")
            elif self.ends is not None:
                _until(lambda: set(self.ending or ()) <= set(self.ended_logs), "their end")
                time.sleep(0.3)  # the parent's marker, were it made at the first end
            self.ended_seen = ended.exists()
        try:
            if self.interrupt:
                raise KeyboardInterrupt
            if self.fail_select:
                raise StageError("w.py: the backend process failed (exit 1)")
            selection = read_artifact(
                H200 / "conv_block" / "profiler_output" / "backend_selection.json.gz",
                BackendSelection,
            )
            write_artifact(self.out_dir / backend.SELECTION_FILE, selection)
        finally:
            self.selection_ended = True


def _stand_in(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    lock: bool = True,
    peak: int | None = GIB,
    cpus: int = 1,
    **kwargs: Any,
) -> StandIn:
    """A stand-in run under a GPU lock where ``lock``, its capture's peak memory ``peak``
    (None: a capture on the CPU) on a 140 GiB GPU, its worker's slice ``cpus`` CPUs."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, **kwargs)
    base = read_artifact(H200 / "conv_block" / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(
        update={"peak_memory_bytes": peak, "device_memory_bytes": 140 * GIB}
    )
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))
    return run


@pytest.mark.parametrize("stock", [False, True], ids=["alone", "beside-the-stock-task"])
def test_the_rung_warmer_runs_beside_selection_and_ends_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stock: bool
) -> None:
    """One folder for both; the warmer on selection's CPU slice, outside the siblings' lock
    (selection stops it instead) and without a pool of compile workers; it ends once
    selection has, and the folder is the stage's own."""
    run = _stand_in(tmp_path, monkeypatch, stock=stock)
    formers = [run.profiler_output / f"{name}.log" for name in ("warm_rungs", "warm_rungs2")]
    for former in formers:
        former.write_text("[opprof] +   10.0 s  task warm_rungs done\n", encoding="utf-8")
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    warm, select = run.extras[rung_warmer.TASK], run.extras["backend"]
    assert warm == {
        "log_name": rung_warmer.TASK,
        "shares_cpus": True,
        "compile_pool": True,
        "rung_warmer": select["rung_warmer"],
    }
    assert run.finished_after_selection == [True] and run.depth == 1
    assert not Path(select["rung_warmer"]).exists()
    assert not any(former.exists() for former in formers)  # not this run's
    if stock:  # selection's own siblings are the stock task's
        assert select["siblings_lock"] == run.extras["stock"]["siblings_lock"]
        assert select["stock_done"] and select["compile_pool"]


def test_the_parent_runs_a_warmer_for_each_cpu_of_the_slice_each_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three CPUs: three warmers, logs ``warm_rungs``, ``warm_rungs2``, ``warm_rungs3``, one
    folder for all, each with Inductor's compile workers (at its idle priority); selection
    wants plans ahead for three; every warmer ends after it."""
    run = _stand_in(tmp_path, monkeypatch, cpus=3)
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    folder = run.extras["backend"]["rung_warmer"]
    names = ["warm_rungs", "warm_rungs2", "warm_rungs3"]
    assert sorted(n for n in run.extras if n != "backend") == names
    for name in names:
        assert run.extras[name] == {
            "log_name": name,
            "shares_cpus": True,
            "compile_pool": True,
            "rung_warmer": folder,
        }
    assert run.depth == 3
    assert run.finished_after_selection == [True] * 3 and sorted(run.ended_logs) == names


def test_how_many_warmers_the_cpus_of_the_slice_the_most_and_memory_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cases = [  # CPUs of the slice (None: the platform does not say), peak GiB, beside, warmers
        (1, 1, 0, 1),
        (2, 1, 0, 2),
        (3, 1, 0, 3),
        (16, 1, 0, rung_warmer.MAX_WARMERS),  # a wide slice: no more than the most
        (16, 18, 0, 2),  # selection and two warmers fit in memory, not a third
        (16, 12, 1, 2),  # the stock task beside counted
        (16, 15, 2, 0),  # and its warmer: no room for one more
        (None, 1, 0, 1),
    ]
    got = []
    for i, (cpus, peak_gib, beside, _) in enumerate(cases):
        run = _stand_in(tmp_path / str(i), monkeypatch, peak=peak_gib * GIB, cpus=cpus or 1)
        if cpus is None:
            monkeypatch.delattr(os, "sched_getaffinity")
        got.append(rung_warmer.warms_rungs(run, beside))  # type: ignore[arg-type]
    assert got == [warmers for *_, warmers in cases]


def test_the_warmers_end_is_marked_once_every_warmer_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of two warmers crashes at once: selection goes on beside the other, no marker
    made meanwhile, which would end its waits for the other's builds; nothing fails."""
    run = _stand_in(tmp_path, monkeypatch, cpus=2, ends="crashed", ending=("warm_rungs2",))
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert run.ended_seen is False
    assert run.warm_ended.is_set() and run.finished_after_selection == [True]
    assert run.generated.exists()


@pytest.mark.parametrize("where", ["option-off", "no-lock", "no-room", "cpu"])
def test_no_rung_warmer_without_the_option_a_gpu_lock_room_or_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    peak = {"option-off": GIB, "no-lock": GIB, "no-room": 30 * GIB, "cpu": None}[where]
    run = _stand_in(
        tmp_path,
        monkeypatch,
        lock=where != "no-lock",
        peak=peak,
        warm_rungs=where != "option-off",
    )
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert list(run.extras) == ["backend"] and run.extras["backend"] == {}


def test_the_rung_warmer_counts_the_stock_task_and_its_warmer_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the stock task and its warmer fit beside selection, but not a fourth process."""
    run = _stand_in(tmp_path, monkeypatch, stock=True, peak=15 * GIB)
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert backend.STOCK_WARM in run.extras and rung_warmer.TASK not in run.extras
    assert "rung_warmer" not in run.extras["backend"]


@pytest.mark.parametrize("ends", sorted(WARMER_ENDS))
def test_a_rung_warmer_that_did_not_end_well_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """Its end marker is created all the same, which ends any wait of selection's."""
    run = _stand_in(tmp_path, monkeypatch, ends=ends)
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert run.ended_seen is True and run.warm_ended.is_set()
    assert run.generated.exists()


def test_a_failed_selection_fails_the_stage_once_the_warmer_has_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch, fail_select=True)
    with pytest.raises(StageError, match="the backend process failed"):
        backend.run(run)  # type: ignore[arg-type]
    assert run.warm_ended.is_set()  # told to end, and waited for
    assert run.finished_after_selection == [True]


def test_an_interrupt_does_not_wait_for_the_rung_warmer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch, interrupt=True)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        backend.run(run)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 1.5 and not run.warm_ended.is_set()
    assert run.warm_ended.wait(PATIENCE_S)  # the stand-in's thread ends before the next test


# --------------------------------------------------------------------- end to end, on the CPU

WORKLOAD = """import torch


def get_model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()
    ).to("cuda").eval()
    return model, torch.randn(2, 3, 16, 16, device="cuda")
"""

SELECTION_BUILDS = """import copy, sys
from pathlib import Path

import torch

from pytest_opprof.backend.build import build
from pytest_opprof.numerics import GateCheck
from pytest_opprof.schema import BackendPlan
from pytest_opprof.stages import common

common.setup_torch()
from pytest_opprof.workload import load

w = load(Path(sys.argv[1]), "cpu")
plan = BackendPlan.model_validate_json(Path(sys.argv[2]).read_text())
clock = common.compile_clock()
with torch.no_grad():
    GateCheck(w.model, w.inputs).outputs(build(copy.deepcopy(w.model), w.inputs, plan).fn)
print(common.compile_note(clock))
"""
"""Selection's build of a plan, as ``task_select``'s ``compiled_plan`` makes it."""


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_a_warmer_runs_at_idle_priority_and_so_do_the_processes_it_starts() -> None:
    """Linux sets the policy per thread: the warmer's, in a thread of its own here, and a
    process it starts after (Inductor's compile workers) inherits it; this thread keeps its
    own."""
    seen: dict[str, Any] = {}

    def warmer() -> None:
        seen["set"] = rung_warmer.idle_priority()
        seen["policy"] = os.sched_getscheduler(0)
        child = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
        seen["child"] = int(subprocess.run(child, capture_output=True, text=True).stdout)

    thread = threading.Thread(target=warmer)
    thread.start()
    thread.join(60)
    assert seen == {"set": True, "policy": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) != os.SCHED_IDLE


HOST = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(HOST) < 2, reason="needs two CPUs to pin to one")
def test_a_warmer_moves_onto_the_host_s_cpus_and_so_do_the_processes_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinned to a slice of one CPU, a warmer told the host's CPUs moves there (this thread,
    as Linux sets affinity per thread), and a process it starts after inherits them; told
    none, it stays on its slice."""
    from pytest_opprof.gpus import HOST_CPUS_ENV

    seen: dict[str, Any] = {}

    def warmer() -> None:
        os.sched_setaffinity(0, HOST[:1])
        monkeypatch.delenv(HOST_CPUS_ENV, raising=False)
        seen["untold"] = rung_warmer.on_host_cpus(), sorted(os.sched_getaffinity(0))
        monkeypatch.setenv(HOST_CPUS_ENV, ",".join(map(str, HOST)))
        seen["told"] = rung_warmer.on_host_cpus(), sorted(os.sched_getaffinity(0))
        child = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
        seen["child"] = subprocess.run(child, capture_output=True, text=True).stdout.strip()

    thread = threading.Thread(target=warmer)
    thread.start()
    thread.join(60)
    assert seen == {
        "untold": (None, HOST[:1]),
        "told": (len(HOST), HOST),
        "child": str(HOST),
    }


@pytest.mark.slow
def test_a_plan_the_warmer_compiled_is_answered_by_the_fx_graph_cache_in_selection(
    tmp_path: Path,
) -> None:
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.schema import ChildSpec

    workload = tmp_path / "tiny.py"
    workload.write_text(WORKLOAD, encoding="utf-8")
    folder = tmp_path / "rungs"
    folder.mkdir()
    plan = _plan("bn_fold")
    Folder(folder).want([plan])
    spec = ChildSpec(
        task=rung_warmer.TASK,
        workload=str(workload),
        out_dir=str(tmp_path),
        options=OpprofOptions.from_values({"out": str(tmp_path), "device": "cpu"}).to_child(),
        shares_cpus=True,
        rung_warmer=str(folder),
    )
    (tmp_path / "spec.json").write_text(spec.model_dump_json(), encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        # one hash seed, as processes forked from one fork server share theirs: bn_fold's
        # graph hashes differently under another seed (torch 2.13), a miss of the cache
        "PYTHONHASHSEED": "0",
    }
    env.pop(LOCK_ENV, None)
    if len(HOST) > 1:  # a worker's slice of one CPU, the host named: the warmer moves there
        # with the slice's OpenMP threads, as gpus.pin_worker sets them for every process
        env.update(OPPROF_HOST_CPUS=",".join(map(str, HOST)), OMP_NUM_THREADS="1")
    log = tmp_path / "warm_rungs.log"
    with log.open("w") as fh:
        warmer = subprocess.Popen(
            [sys.executable, "-m", "pytest_opprof.runner", str(tmp_path / "spec.json")],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, HOST[:1])) if len(HOST) > 1 else None,
        )
        deadline = time.monotonic() + 240
        while not Folder(folder).done(plan).exists() and warmer.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        (folder / FINISHED).touch()
        assert warmer.wait(60) == 0, log.read_text()
    said = log.read_text()
    assert "not at idle priority" not in said or not hasattr(os, "SCHED_IDLE")
    if len(HOST) > 1 and hasattr(os, "SCHED_IDLE"):
        assert f"at idle priority on the host's {len(HOST)} CPUs" in said, said
    assert re.search(r"built bn_fold-1 ahead of selection: .*FX graph cache 0 hit, 1 miss", said)
    assert "built 1 plans ahead of selection" in said
    (tmp_path / "plan.json").write_text(plan.model_dump_json(), encoding="utf-8")
    selection = subprocess.run(
        [sys.executable, "-c", SELECTION_BUILDS, str(workload), str(tmp_path / "plan.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert selection.returncode == 0, selection.stderr
    assert "FX graph cache 1 hit, 0 miss" in selection.stdout, selection.stdout
