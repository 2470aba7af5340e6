"""The GPU lock: processes work side by side and measure alone, waiting measurers come first,
and a dead holder never blocks the GPU. Real processes on a real ``flock``."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pytest_opprof import devicelock
from pytest_opprof.devicelock import DeviceLock, lock_path

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")

# Each script below joins the lock (shared) and writes when each phase began to its last
# argument, a log (one line per event: name, event, time); its first argument is its name.
PRELUDE = """
import sys, time
from pytest_opprof import devicelock
name, log = sys.argv[1], sys.argv[-1]
def note(event):
    with open(log, "a") as fh:
        fh.write(f"{name} {event} {time.time():.4f}\\n")
devicelock.join()
"""

# It works `work` s, then measures `measure` s.
WORKER = (
    PRELUDE
    + """
work, measure = float(sys.argv[2]), float(sys.argv[3])
note("work")
time.sleep(work)
note("wait")
with devicelock.measuring():
    note("measure")
    time.sleep(measure)
    note("measured")
note("done")
"""
)

# It works in `steps` steps of `step` s each, making way between them.
STEPPER = (
    PRELUDE
    + """
steps, step = int(sys.argv[2]), float(sys.argv[3])
for i in range(steps):
    note(f"step{i}")
    time.sleep(step)
    note(f"stepped{i}")
    devicelock.make_way()
note("done")
"""
)


def _spawn(
    script: str, lock: Path, log: Path, *args: object, session: bool = False
) -> subprocess.Popen[str]:
    """``script`` in a process of its own under the lock ``lock``; with ``session``, the leader
    of a process group of its own (a stage process, which a pause stops as a group)."""
    env = {**os.environ, devicelock.LOCK_ENV: str(lock)}
    argv = [sys.executable, "-c", script, *map(str, args), str(log)]
    return subprocess.Popen(argv, env=env, text=True, start_new_session=session)


def _start(lock: Path, log: Path, name: str, work: float, measure: float) -> subprocess.Popen[str]:
    return _spawn(WORKER, lock, log, name, work, measure)


def _events(log: Path) -> dict[tuple[str, str], float]:
    out = {}
    for line in log.read_text().splitlines():
        name, event, t = line.split()
        out[(name, event)] = float(t)
    return out


def test_measurements_never_overlap_each_other_or_anyones_work(tmp_path: Path) -> None:
    lock, log = tmp_path / "gpu.lock", tmp_path / "log"
    procs = [_start(lock, log, f"p{i}", work, 0.4) for i, work in enumerate((0.2, 0.5, 1.0))]
    for p in procs:
        assert p.wait(timeout=60) == 0
    ev = _events(log)
    names = [f"p{i}" for i in range(3)]
    measured = sorted((ev[(n, "measure")], ev[(n, "measured")]) for n in names)
    for (_, end), (start, _) in itertools.pairwise(measured):
        assert start >= end  # one at a time
    for n in names:
        for other in names:
            if other != n:  # nobody worked while n measured
                assert ev[(other, "wait")] <= ev[(n, "measure")]
    # the works ran side by side: all three had begun before the first measurement
    assert max(ev[(n, "work")] for n in names) < measured[0][0]


def test_a_waiting_measurer_goes_before_new_work(tmp_path: Path) -> None:
    path = tmp_path / "gpu.lock"
    holder = DeviceLock(path)
    holder.share()  # someone at work
    log = tmp_path / "log"
    measurer = _start(path, log, "m", 0.0, 0.3)
    time.sleep(1.0)  # m has joined and now waits to measure
    late = _start(path, log, "late", 0.0, 0.0)  # new work arriving while m waits
    time.sleep(1.0)
    assert not (tmp_path / "log").exists() or ("late", "work") not in _events(log)
    holder.release()
    assert measurer.wait(timeout=30) == 0 and late.wait(timeout=30) == 0
    ev = _events(log)
    assert ev[("late", "work")] >= ev[("m", "measure")]
    assert holder.waited_s < 0.1  # it never waited: the lock was free
    holder.close()


def test_a_process_at_work_makes_way_between_its_steps(tmp_path: Path) -> None:
    """A measurer waits for the step a neighbour is in, not for the neighbour's whole work,
    and no step of the neighbour's runs while it measures."""
    path, log = tmp_path / "gpu.lock", tmp_path / "log"
    stepper = _spawn(STEPPER, path, log, "s", 12, 0.25)
    measurer = _start(path, log, "m", 0.8, 0.4)
    assert measurer.wait(timeout=60) == 0 and stepper.wait(timeout=60) == 0
    ev = _events(log)
    start, end = ev[("m", "measure")], ev[("m", "measured")]
    assert start < ev[("s", "done")] - 1.0  # it did not wait for all twelve steps
    assert start - ev[("m", "wait")] < 0.25 + 0.5  # at most one step, and process noise
    for i in range(12):  # no step overlaps the measurement
        assert ev[("s", f"stepped{i}")] <= start or ev[("s", f"step{i}")] >= end


def test_measurers_queued_during_one_drain_measure_before_work_resumes(tmp_path: Path) -> None:
    """m1 asks to measure while s is in a step and m2 at work. s makes way first and asks to
    work again; m2 asks to measure after it. m2 still measures right after m1, before s's
    next step: one drain serves both. (Let s work again in the order they asked, and m2
    waits for s's whole next step.)"""
    path, log = tmp_path / "gpu.lock", tmp_path / "log"
    stepper = _spawn(STEPPER, path, log, "s", 3, 0.6)
    deadline = time.monotonic() + 30
    while not (log.exists() and ("s", "step0") in _events(log)):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    m1 = _start(path, log, "m1", 0.1, 1.0)
    m2 = _start(path, log, "m2", 1.0, 0.4)
    for p in (m1, m2, stepper):
        assert p.wait(timeout=60) == 0
    ev = _events(log)
    # m1 waited on s's step and m2's work; s made way before m2 asked
    assert ev[("m1", "wait")] < ev[("s", "stepped0")] < ev[("m2", "wait")] < ev[("m1", "measure")]
    assert 0.0 <= ev[("m2", "measure")] - ev[("m1", "measured")] < 0.3  # not after s's step
    assert ev[("s", "step1")] >= ev[("m2", "measured")]


def test_a_measurement_that_ends_the_gpu_work_does_not_share_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After ``measuring(share_after=False)`` the process holds nothing, so it does not
    queue behind the next measurer; ``resume()`` shares again for more GPU work."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    try:
        with devicelock.measuring(share_after=False):
            assert lock.held == "exclusive"
        assert lock.held is None
        devicelock.make_way()  # nothing held, nothing to make way for
        assert lock.held is None
        other = DeviceLock(path)
        other.exclusive()  # at once: nobody holds the GPU
        assert other.held == "exclusive" and other.waited_s < 0.1
        other.close()
        devicelock.resume()
        assert lock.held == "shared"
        devicelock.resume()  # held already: nothing
        assert lock.held == "shared"
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_process_that_lets_go_holds_nothing_of_the_gpu_nor_of_its_siblings_lock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before it waits on a sibling's end (selection, on the stock task) a process lets go of
    every lock: the sibling's measurement takes both exclusively at once; ``resume()`` shares
    the GPU again after."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path, siblings = tmp_path / "gpu.lock", tmp_path / "siblings.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join(siblings=str(siblings))
    assert lock is not None and lock.held == "shared"
    other = DeviceLock(path)
    fd = os.open(siblings, os.O_RDWR)
    try:
        lock._siblings_compiling()  # held shared, as by a compile off the GPU
        devicelock.let_go()
        assert lock.held is None and lock.siblings_held is None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises where still held
        assert other._at_once(fcntl.LOCK_EX)
        fcntl.flock(other._main, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_UN)
        devicelock.resume()
        assert lock.held == "shared"
    finally:
        os.close(fd)
        other.close()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_measurement_within_gpu_work_holds_the_gpu_as_before_after(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An op tuning itself on its first call measures alone, then holds the GPU as before:
    shared while at work, nothing where it held nothing; inside a measurement it changes
    nothing."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None and lock.held == "shared"
    try:
        with devicelock.measuring_within():
            assert lock.held == "exclusive"
            other = DeviceLock(path)
            assert not other._at_once(fcntl.LOCK_SH)  # nobody works beside it
            other.close()
        assert lock.held == "shared"
        with devicelock.measuring(share_after=False):
            with devicelock.measuring_within():
                assert lock.held == "exclusive"
            assert lock.held == "exclusive"
        assert lock.held is None
        with devicelock.measuring_within():
            assert lock.held == "exclusive"
        assert lock.held is None
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_measurer_interrupted_while_waiting_holds_no_work_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpu.lock"
    measurer = DeviceLock(path)

    def interrupted(mode: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(measurer, "_through_turnstile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measurer.exclusive()
    worker = DeviceLock(path)
    assert not worker._measurer_waits()  # work would otherwise wait for it forever
    worker.share()
    assert worker.held == "shared" and worker.waited_s < 0.1
    worker.close()
    measurer.close()


def test_a_killed_holder_releases_the_gpu(tmp_path: Path) -> None:
    path, log = tmp_path / "gpu.lock", tmp_path / "log"
    stuck = _start(path, log, "stuck", 0.0, 300.0)
    deadline = time.monotonic() + 30
    while not (log.exists() and ("stuck", "measure") in _events(log)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(stuck.pid, signal.SIGKILL)
    stuck.wait(timeout=10)
    lock = DeviceLock(path)
    lock.exclusive()  # would block for 300 s had the kernel kept the dead process's lock
    assert lock.held == "exclusive"
    lock.close()


def test_join_without_a_lock_leaves_measuring_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devicelock.LOCK_ENV, raising=False)
    monkeypatch.setattr(devicelock, "_LOCK", None)
    assert devicelock.join() is None
    with devicelock.measuring():
        pass
    assert devicelock.waited_s() == 0.0


def test_join_hands_no_lock_to_the_processes_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ncu's target runs under its parent's share: were it to queue behind a measurer that
    waits for that parent, neither would ever run."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "locks" / "gpu.lock"))
    lock = devicelock.join()
    try:
        assert lock is not None and lock.held == "shared"
        assert devicelock.LOCK_ENV not in os.environ
        with devicelock.measuring():
            assert lock.held == "exclusive"
            time.sleep(0.2)
        assert lock.held == "shared"
        # the time it held the GPU alone, and only that, is counted
        assert 0.2 <= devicelock.alone_s() < 1.0
        time.sleep(0.2)
        devicelock.make_way()  # nobody waits: it keeps its share
        assert lock.held == "shared" and devicelock.alone_s() < 1.0
    finally:
        assert lock is not None
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_lock_that_cannot_be_opened_is_said_and_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(devicelock, "_LOCK", None)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(devicelock.LOCK_ENV, str(blocker / "gpu.lock"))
    said: list[str] = []
    assert devicelock.join(note=said.append) is None
    assert len(said) == 1 and said[0].startswith("no GPU lock (")


def test_lock_names_are_file_names(tmp_path: Path) -> None:
    assert lock_path("GPU-12ab-34cd", tmp_path) == tmp_path / "GPU-12ab-34cd.lock"
    assert lock_path("../0", tmp_path).parent == tmp_path


TINY = """
import torch
def get_model_and_input():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval(), torch.randn(4, 16)
"""


def test_a_stage_process_measures_only_once_the_gpu_is_its_alone(tmp_path: Path) -> None:
    """The capture process: it loads and compiles beside another process at work, then
    waits for that work to end before it times and profiles, and says how long it waited."""
    import json

    from pytest_opprof.options import OpprofOptions

    workload = tmp_path / "tiny.py"
    workload.write_text(TINY, encoding="utf-8")
    spec = tmp_path / "spec.json"
    options = OpprofOptions(device="cpu", warmup_iters=1, measure_iters=2, rounds=3)
    spec.write_text(
        json.dumps(
            {
                "task": "capture",
                "workload": str(workload),
                "out_dir": str(tmp_path / "out"),
                "options": options.to_child(),
                "overrides": {},
            }
        ),
        encoding="utf-8",
    )
    path = tmp_path / "gpu.lock"
    other = DeviceLock(path)
    other.share()
    log = tmp_path / "capture.log"
    with log.open("w") as fh:
        child = subprocess.Popen(
            [sys.executable, "-m", "pytest_opprof.runner", str(spec)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, devicelock.LOCK_ENV: str(path)},
        )
    try:
        deadline = time.monotonic() + 240
        while "compiled (backend='inductor')" not in log.read_text():
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        time.sleep(2.0)
        assert child.poll() is None and "timed and profiled" not in log.read_text()
    finally:
        other.close()
    assert child.wait(timeout=240) == 0, log.read_text()
    text = log.read_text()
    assert "timed and profiled" in text
    assert "s of it waiting for the GPU" in text.splitlines()[-1]
    assert "s with the GPU to itself" in text.splitlines()[-1]  # its timing and profiling
    lines = text.splitlines()
    waiting = next(i for i, line in enumerate(lines) if line.endswith(devicelock.WAITING))
    assert "timed and profiled" not in "".join(lines[:waiting])  # it waited before measuring
    assert "had the GPU after" in lines[waiting + 1]
    assert (tmp_path / "out" / "profile.json").exists()


def test_a_stage_that_times_out_waiting_for_the_gpu_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its log shows the wait, and the stage's error names it instead of a hung workload: a
    ``StageTimedOut``, which selection does not run again (``stages.backend.selected``)."""
    from pytest_opprof.errors import StageTimedOut
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.pipeline import WorkloadRun
    from pytest_opprof.workload import WorkloadSpec

    workload = tmp_path / "tiny.py"
    workload.write_text(TINY, encoding="utf-8")
    path = tmp_path / "gpu.lock"
    other = DeviceLock(path)
    other.exclusive()  # another process measuring for longer than the stage may run
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    options = OpprofOptions(device="cpu", out=tmp_path / "out", timeout=6.0)
    run = WorkloadRun(spec=WorkloadSpec(workload), options=options, name="tiny")
    try:
        with pytest.raises(StageTimedOut, match="it was waiting for its GPU, which other"):
            run.run_child("capture", "capture")
    finally:
        other.close()
    log = (run.profiler_output / "capture.log").read_text()
    assert devicelock.WAITING in log


def test_preflight_says_whether_this_user_can_open_gpu_locks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.cli import _lock_folder_usable

    monkeypatch.setattr(devicelock, "lock_path", lambda gpu: tmp_path / "locks" / f"{gpu}.lock")
    ok, said = _lock_folder_usable()
    assert ok and said == f"GPU lock folder {tmp_path / 'locks'} usable"
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(devicelock, "lock_path", lambda gpu: blocker / f"{gpu}.lock")
    ok, said = _lock_folder_usable()
    assert not ok and said.startswith(f"GPU lock folder {blocker}: ")


def test_a_compile_lets_go_of_the_gpu_and_takes_it_back_for_its_gpu_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Inside ``off_gpu`` a measurer gets the GPU at once; GPU work inside it (``on_gpu``)
    waits for that measurement; after it the process shares again. Each letting go is
    preceded by the sync."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    synced: list[str] = []
    measurer = DeviceLock(path)
    try:
        with devicelock.off_gpu(lambda: synced.append("off")):
            assert synced == ["off"] and lock.held is None
            measurer.exclusive()  # at once: the compile holds nothing
            assert measurer.waited_s < 0.1
            folded: list[float] = []

            def fold() -> None:
                with devicelock.on_gpu(lambda: synced.append("on")):
                    folded.append(time.monotonic())
                    assert lock.held == "shared"

            thread = threading.Thread(target=fold)
            thread.start()
            time.sleep(0.5)
            assert not folded  # it waits for the measurement
            released = time.monotonic()
            measurer.release()
            thread.join(timeout=10)
            assert folded and folded[0] >= released
            assert synced == ["off", "on"] and lock.held is None and lock.aside
            measurer.exclusive()  # let go again after its GPU work
            measurer.release()
        assert lock.held == "shared" and not lock.aside
        with devicelock.measuring(), devicelock.off_gpu(lambda: synced.append("no")):
            assert lock.held == "exclusive"  # never lets go of a measurement
        with devicelock.on_gpu(lambda: synced.append("no")):
            assert lock.held == "shared"  # outside off_gpu: nothing to take back
        assert synced == ["off", "on"]
    finally:
        measurer.close()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_quiet_measurement_waits_for_the_compiles_off_the_gpu_and_holds_back_new_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A measurement whose figures are reported runs beside no compile on the host: it waits
    for one under way off the GPU, and none starts from the moment it waits until it is done.
    It waits holding nothing of the GPU: a selection measurement (not quiet) has the GPU
    meanwhile, beside the compile."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    measurer, selection, late = DeviceLock(path), DeviceLock(path), DeviceLock(path)
    entered, leave = threading.Event(), threading.Event()

    def compile_off_gpu() -> None:
        with devicelock.off_gpu(lambda: None):
            entered.set()
            leave.wait(10)

    compiler = threading.Thread(target=compile_off_gpu)
    compiler.start()
    try:
        assert entered.wait(10)
        quiet_at: list[float] = []

        def go_quiet() -> None:
            measurer.quiet()
            measurer.exclusive()
            quiet_at.append(time.monotonic())

        quiet = threading.Thread(target=go_quiet)
        quiet.start()
        time.sleep(0.5)
        assert not quiet_at  # waits for the compile
        assert measurer.held is None  # holding nothing of the GPU
        selection.exclusive()  # so another measurement has it at once, the compile beside it
        assert selection.waited_s < 0.1
        selection.release()
        started: list[float] = []

        def compile_late() -> None:
            late.compiling()
            started.append(time.monotonic())

        newcomer = threading.Thread(target=compile_late)
        newcomer.start()
        time.sleep(0.3)
        assert not started  # no compile off the GPU begins while it waits
        ended = time.monotonic()
        leave.set()
        # The compile ends and its process shares the GPU again for its next step, behind the
        # quiet measurer or ahead of it: the two threads race for the GPU, and either order is
        # right. Ahead of it, the measurer (holding the host) waits for that step to end.
        deadline = time.monotonic() + 10
        while lock.held != "shared" and not quiet_at and time.monotonic() < deadline:
            time.sleep(0.01)
        stepped: threading.Thread | None = None
        if lock.held == "shared":
            time.sleep(0.2)
            assert not quiet_at  # the quiet measurer has the host, and waits for that step
            stepped = threading.Thread(target=devicelock.make_way)  # the step ends
            stepped.start()
        quiet.join(10)
        assert quiet_at and quiet_at[0] >= ended
        assert measurer.held == "exclusive" and measurer.waited_s >= 0.7  # waiting, not measuring
        time.sleep(0.3)
        assert not started  # nor while it measures
        measurer.unquiet()
        newcomer.join(10)
        assert started
        late.compiled()
        measurer.release()
        assert measurer.alone_s < time.monotonic() - ended  # from the GPU on, not the wait
        compiler.join(10)
        if stepped is not None:
            stepped.join(10)
        assert not compiler.is_alive()
        assert lock.held == "shared"  # the step's process shares again after it
    finally:
        leave.set()
        measurer.unquiet()
        measurer.release()
        compiler.join(10)
        for held in (measurer, selection, late):
            held.close()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_quiet_measurers_queued_behind_one_go_before_new_compiles(tmp_path: Path) -> None:
    """A compile that asks while a quiet measurer waits for the host starts only after it, and
    one more quiet measurer that arrived before the compile asked measures first too: no
    stream of new compiles keeps a quiet measurement waiting."""
    path = tmp_path / "gpu.lock"
    running, first, second, late = (DeviceLock(path) for _ in range(4))
    order: list[str] = []
    running.compiling()  # a compile under way

    def measure(lock: DeviceLock, name: str) -> None:
        lock.quiet()
        lock.exclusive()
        order.append(name)
        time.sleep(0.2)
        lock.unquiet()
        lock.release()

    def compile_late() -> None:
        late.compiling()
        order.append("compile")
        late.compiled()

    threads = [threading.Thread(target=measure, args=(first, "first"))]
    threads[0].start()
    time.sleep(0.3)
    threads.append(threading.Thread(target=measure, args=(second, "second")))
    threads[1].start()
    time.sleep(0.3)
    threads.append(threading.Thread(target=compile_late))
    threads[2].start()
    time.sleep(0.3)
    try:
        assert order == []  # all behind the compile under way
        running.compiled()
        for t in threads:
            t.join(10)
        assert order == ["first", "second", "compile"]
    finally:
        for held in (running, first, second, late):
            held.close()


def test_only_a_quiet_measurement_under_a_lock_may_borrow_the_hosts_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(devicelock, "_LOCK", None)
    assert not devicelock.quiet_now()  # no lock: nothing says the host is quiet
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    assert devicelock.join() is not None
    assert not devicelock.quiet_now()
    with devicelock.measuring():
        assert not devicelock.quiet_now()  # selection's: the GPU alone, compiles beside it
    with devicelock.measuring(quiet=True):
        assert devicelock.quiet_now()
    assert not devicelock.quiet_now()


# A recapture's timing process: joins with its siblings' lock, waits `delay` s, then compiles
# off the GPU for `seconds` s ("compile") or measures for `seconds` s ("measure").
SIBLING = """
import sys, time
from pytest_opprof import devicelock
name, siblings, mode, delay, seconds, log = sys.argv[1:7]
def note(event):
    with open(log, "a") as fh:
        fh.write(f"{name} {event} {time.time():.4f}\\n")
devicelock.join(siblings=siblings or None)
time.sleep(float(delay))
if mode == "compile":
    with devicelock.off_gpu(lambda: None):
        note("compile")
        time.sleep(float(seconds))
        note("compiled")
else:
    note("wait")
    with devicelock.measuring():
        note("measure")
        time.sleep(float(seconds))
        note("measured")
note("done")
"""


def test_a_siblings_compile_holds_back_its_siblings_measurements_not_the_gpu(
    tmp_path: Path,
) -> None:
    """Timing processes on one CPU slice compile off the GPU under their own lock: a sibling's
    measurement waits for that compile to end, holding nothing of the GPU meanwhile, while
    another workload's process (no siblings) measures beside the compile at once."""
    lock, log = tmp_path / "gpu.lock", tmp_path / "log"
    siblings = tmp_path / "siblings.lock"

    def start(
        name: str, group: Path | None, mode: str, delay: float, seconds: float
    ) -> subprocess.Popen[bytes]:
        env = {**os.environ, devicelock.LOCK_ENV: str(lock)}
        argv = [sys.executable, "-c", SIBLING, name, str(group or ""), mode]
        return subprocess.Popen([*argv, str(delay), str(seconds), str(log)], env=env)

    procs = [
        start("compiler", siblings, "compile", 0.0, 4.0),
        start("sibling", siblings, "measure", 1.0, 0.3),
        start("other", None, "measure", 1.8, 0.3),
    ]
    for p in procs:
        assert p.wait(timeout=60) == 0
    ev = _events(log)
    # the compile was under way when both asked for the GPU
    assert ev[("compiler", "compile")] < ev[("sibling", "wait")]
    assert ev[("other", "wait")] < ev[("compiler", "compiled")]
    # the sibling measured only after it, the other process beside it
    assert ev[("sibling", "measure")] >= ev[("compiler", "compiled")]
    assert ev[("other", "measured")] < ev[("compiler", "compiled")]


def test_a_siblings_measurement_holds_their_lock_for_its_span_and_no_longer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Inside a measurement the siblings' lock is held exclusively (a sibling's compile waits
    to start), and asked again it is neither taken twice nor does it let go of the GPU; after
    the measurement it is free."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path, siblings = tmp_path / "gpu.lock", tmp_path / "siblings.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join(siblings=str(siblings))
    assert lock is not None and devicelock.has_siblings()
    sibling = DeviceLock(path)
    sibling.join_siblings(siblings)
    started: list[float] = []
    try:
        with devicelock.measuring():
            assert lock.held == "exclusive" and lock.siblings_held == "exclusive"
            assert not lock.siblings_apart() and lock.held == "exclusive"

            def compile_beside() -> None:
                sibling._siblings_compiling()
                started.append(time.monotonic())

            compiler = threading.Thread(target=compile_beside)
            compiler.start()
            time.sleep(0.3)
            assert not started  # the sibling's compile waits for the measurement
            ended = time.monotonic()
        compiler.join(10)
        assert started and started[0] >= ended
        assert lock.held == "shared" and lock.siblings_held is None
    finally:
        sibling.close()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_each_measurement_says_as_it_ends_how_long_it_held_the_gpu_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The line ``benchmarks/gpu_timeline.py`` reads a measurement's span from; sharing says
    nothing."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    said: list[str] = []
    lock = devicelock.join(note=said.append)
    assert lock is not None
    try:
        with devicelock.measuring():
            time.sleep(0.2)
        ends = [s for s in said if s.startswith(devicelock.MEASURED)]
        assert len(ends) == 1
        assert 0.2 <= float(ends[0].removeprefix(devicelock.MEASURED).split()[0]) < 5
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_long_shared_hold_inside_a_compile_says_what_it_was(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The line ``benchmarks/gpu_timeline.py`` reads a compile's long shared hold from, the
    hold a measurer drains behind; a short one says nothing."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    monkeypatch.setattr(devicelock, "SHARED_NOTE_S", 0.1)
    said: list[str] = []
    lock = devicelock.join(note=said.append)
    assert lock is not None
    try:
        with devicelock.off_gpu(lambda: None):
            with devicelock.on_gpu(lambda: None, "a short fold"):
                pass
            with devicelock.on_gpu(lambda: None, "freezing"):
                time.sleep(0.15)
        held = [s for s in said if s.startswith(devicelock.SHARED)]
        assert len(held) == 1 and held[0].endswith(" s: freezing")
        assert 0.15 <= float(held[0].removeprefix(devicelock.SHARED).split()[0]) < 5
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_shared_hold_s_note_counts_only_what_it_held(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Inside a shared hold, a measurement (the share let go of for it) and a block off the GPU
    are not held shared; nor is the wait to go aside after it (a sibling's or a quiet
    measurement), the GPU let go of already. The note says the hold, not the span."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    monkeypatch.setattr(devicelock, "SHARED_NOTE_S", 0.2)
    said: list[str] = []
    lock = devicelock.join(note=said.append)
    assert lock is not None
    real_go_aside = lock.go_aside

    def go_aside() -> None:  # waits, as behind a quiet measurement, holding nothing
        real_go_aside()
        time.sleep(0.3)

    try:
        with devicelock.off_gpu(lambda: None):
            monkeypatch.setattr(lock, "go_aside", go_aside)
            with devicelock.on_gpu(lambda: None, "a choice"):
                with devicelock.measuring_within(lambda: None):
                    time.sleep(0.3)
                assert lock.held == "shared"
                with devicelock.off_gpu(lambda: None):
                    time.sleep(0.3)
                time.sleep(0.05)
        assert not [s for s in said if s.startswith(devicelock.SHARED)], said
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_measurement_within_a_compile_holds_the_gpu_alone_then_goes_aside_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Inductor's autotuning inside a compile that let go of the GPU: alone for the block,
    after the compile's locks are let go of (their order), then aside again, ``sync`` first."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    synced: list[str | None] = []
    try:
        with devicelock.off_gpu(lambda: None):
            assert lock.held is None and lock.aside
            with devicelock.measuring_within(lambda: synced.append(lock.held)):
                assert lock.held == "exclusive" and not lock.aside
                other = DeviceLock(path)
                assert not other._at_once(fcntl.LOCK_SH)  # nobody works beside it
                other.close()
            assert synced == ["exclusive"]  # its GPU work waited for before letting go
            assert lock.held is None and lock.aside
            quiet = DeviceLock(path)
            with pytest.raises(BlockingIOError):  # the compile holds path.cpu again
                fcntl.flock(quiet._cpu, fcntl.LOCK_EX | fcntl.LOCK_NB)
            quiet.close()
        assert lock.held == "shared" and not lock.aside
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


# A compile worker: a child in its stage process's group (as Inductor's are) that writes a
# tick to the log every 20 ms.
COMPILE_WORKER = """
import subprocess
child = subprocess.Popen([sys.executable, "-c", '''
import sys, time
while True:
    with open(sys.argv[1], "a") as fh:
        fh.write(f"worker tick {time.time():.4f}\\\\n")
    time.sleep(0.02)
''', log])
"""

# A compile off the GPU that never ends on its own, with a compile worker; it writes a tick
# every 20 ms too. It leads its own process group, as a stage process does.
COMPILER = (
    PRELUDE
    + COMPILE_WORKER
    + """
with devicelock.off_gpu(lambda: None):
    note("compiling")
    while True:
        note("tick")
        time.sleep(0.02)
"""
)

# Measures quietly for a minute; says when it has the GPU and the host.
QUIET_MEASURER = (
    PRELUDE
    + """
with devicelock.measuring(quiet=True):
    note("measure")
    time.sleep(60)
"""
)


def _ticks(log: Path, who: str) -> list[float]:
    if not log.exists():
        return []
    return [
        float(t)
        for name, event, t in (line.split() for line in log.read_text().splitlines())
        if name == who and event == "tick"
    ]


def _ticked_after(log: Path, who: str, t: float) -> bool:
    return any(tick > t for tick in _ticks(log, who))


def _until(check: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pausing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A GPU lock for this process to join (:data:`devicelock.LOCK_ENV` names it), quiet
    measurements pausing the compiles (the default); the lock it joins closed after."""
    path = tmp_path / "gpu.lock"
    monkeypatch.delenv(devicelock.QUIET_ENV, raising=False)
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    yield path
    if devicelock._LOCK is not None:
        devicelock._LOCK.close()
    monkeypatch.setattr(devicelock, "_LOCK", None)


def _compiler(path: Path, log: Path) -> subprocess.Popen[str]:
    proc = _spawn(COMPILER, path, log, "c", session=True)
    if not _until(lambda: len(_ticks(log, "c")) > 3 and len(_ticks(log, "worker")) > 3):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pytest.fail("the compiler did not start ticking")
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="names processes by /proc")
def test_a_quiet_measurement_pauses_the_compiles_under_way_and_continues_them(
    pausing: Path, tmp_path: Path
) -> None:
    """It does not wait for a compile that would not end: it stops the compile's process and
    its compile workers for the measurement, and they go on after it."""
    path, log = pausing, tmp_path / "log"
    compiler = _compiler(path, log)
    notes: list[str] = []
    try:
        lock = devicelock.join(notes.append)
        assert lock is not None
        inside, spans = threading.Event(), []

        def measure() -> None:
            with devicelock.measuring(quiet=True):
                inside.set()
                time.sleep(0.2)  # a tick under way when the pause came has ended
                start = time.time()
                time.sleep(0.6)
                spans.append((start, time.time(), devicelock.quiet_now()))

        measurer = threading.Thread(target=measure, daemon=True)
        measurer.start()
        assert inside.wait(5)  # not at the compile's end: it has none
        measurer.join(10)
        ((start, end, quiet),) = spans
        assert quiet
        assert f"{devicelock.PAUSED} 1 processes, 0 {devicelock.WORKERS_PAUSED}" in notes
        for who in ("c", "worker"):
            assert _until(functools.partial(_ticked_after, log, who, end))  # going on again
            assert not [t for t in _ticks(log, who) if start <= t <= end], who
        assert not devicelock.quiet_now()
    finally:
        os.killpg(compiler.pid, signal.SIGKILL)
        compiler.wait(10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="names processes by /proc")
def test_a_measurer_that_dies_mid_pause_leaves_no_compile_stopped(tmp_path: Path) -> None:
    """A stopped process cannot continue itself: the measurer's guardian continues it."""
    path, log = tmp_path / "gpu.lock", tmp_path / "log"
    compiler = _compiler(path, log)
    measurer = _spawn(QUIET_MEASURER, path, log, "m")
    try:
        assert _until(lambda: "m measure" in log.read_text())
        time.sleep(0.3)
        paused_at = time.time()
        assert not [t for t in _ticks(log, "c") if t > paused_at]
        measurer.kill()
        measurer.wait(10)
        died = time.time()
        assert _until(functools.partial(_ticked_after, log, "c", died), 10)
        assert _until(functools.partial(_ticked_after, log, "worker", died), 10)
    finally:
        measurer.kill()
        os.killpg(compiler.pid, signal.SIGKILL)
        compiler.wait(10)


def test_with_quiet_wait_a_quiet_measurement_waits_for_the_compiles_instead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """OPPROF_QUIET=wait: the compile under way ends before the measurement starts."""
    monkeypatch.setenv(devicelock.QUIET_ENV, "wait")
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    compiler = DeviceLock(path)
    compiler.compiling()
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    ended: list[float] = []

    def end_compile() -> None:
        time.sleep(0.5)
        ended.append(time.monotonic())
        compiler.compiled()

    ender = threading.Thread(target=end_compile)
    ender.start()
    try:
        with devicelock.measuring(quiet=True):
            assert ended and time.monotonic() >= ended[0]
    finally:
        ender.join(10)
        compiler.close()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="names processes by /proc")
def test_a_fork_servers_import_is_waited_for_not_paused(pausing: Path, tmp_path: Path) -> None:
    """``host_work`` holds the host for CPU work another process does (a fork server's
    import): a quiet measurement cannot name that process, so it waits for the work."""
    path, log = pausing, tmp_path / "log"
    script = PRELUDE.replace("devicelock.join()\n", "") + (
        "with devicelock.host_work():\n"
        "    note('importing')\n"
        "    time.sleep(1.0)\n"
        "    note('imported')\n"
    )
    importer = _spawn(script, path, log, "server")
    try:
        assert _until(lambda: log.exists() and "server importing" in log.read_text())
        lock = devicelock.join()
        assert lock is not None
        with devicelock.measuring(quiet=True):
            measured = time.time()
        assert measured >= _events(log)[("server", "imported")]
        assert importer.wait(10) == 0
    finally:
        importer.kill()


def test_a_compile_held_back_by_a_quiet_measurement_says_how_long(tmp_path: Path) -> None:
    """Its stage log shows the wait, which holds nothing of the GPU's lock (not a wait for
    the GPU: gpu_timeline.py would not see it otherwise)."""
    path = tmp_path / "gpu.lock"
    measurer, compiler = DeviceLock(path), DeviceLock(path)
    notes: list[str] = []
    compiler.note = notes.append
    compiler.compiling()  # nobody in the way: nothing said
    compiler.compiled()
    assert notes == []
    measurer.quiet()
    waiter = threading.Thread(target=compiler.compiling)
    waiter.start()
    time.sleep(0.4)
    try:
        assert notes == [devicelock.WAITING_TO_COMPILE]
    finally:
        measurer.unquiet()
        waiter.join(10)
    assert notes[1].startswith(devicelock.COMPILES_AGAIN)
    assert float(notes[1].split()[-2]) >= 0.3
    compiler.compiled()
    measurer.close()
    compiler.close()


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="reads /proc/locks")
def test_a_compile_that_did_not_list_itself_is_waited_for(pausing: Path, tmp_path: Path) -> None:
    """A process that holds the host's compile lock without listing itself (a session of an
    older version) is CPU work a pause would leave running: the measurement waits for it,
    holding nothing of the GPU meanwhile (another measurement has it at once), and says one
    measurement, not two."""
    path, log = pausing, tmp_path / "log"
    DeviceLock(path).close()  # the lock's files
    script = PRELUDE.replace("devicelock.join()\n", "") + (
        "import fcntl, os\n"
        f"fd = os.open({str(path) + '.cpu'!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH)\n"
        "note('holding')\n"
        "time.sleep(1.0)\n"
        "note('released')\n"
    )
    holder = _spawn(script, path, log, "old")
    try:
        assert _until(lambda: log.exists() and "old holding" in log.read_text())
        notes: list[str] = []
        lock = devicelock.join(notes.append)
        assert lock is not None
        measured: list[float] = []

        def measure() -> None:
            with devicelock.measuring(quiet=True):
                measured.append(time.time())

        measurer = threading.Thread(target=measure)
        measurer.start()
        assert _until(lambda: devicelock.WAITING_QUIET in notes, 5)
        gpu = os.open(path, os.O_RDWR)
        try:  # the GPU is free while the measurer waits for the host
            fcntl.flock(gpu, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(gpu, fcntl.LOCK_UN)
        finally:
            os.close(gpu)
        measurer.join(10)
        assert measured and measured[0] >= _events(log)[("old", "released")]
        assert sum(n.startswith(devicelock.MEASURED) for n in notes) == 1
        assert holder.wait(10) == 0
    finally:
        holder.kill()


# A stage process on the GPU, not compiling (waiting): its compile worker, in its process
# group, compiles ahead; it and the worker each write a tick every 20 ms.
WAITING_WITH_WORKER = (
    PRELUDE
    + COMPILE_WORKER
    + """
devicelock.let_go()  # holds nothing of the GPU, as while it waits for it
while True:
    note("tick")
    time.sleep(0.02)
"""
)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="names processes by /proc")
def test_a_pause_stops_the_compile_workers_of_a_process_that_waits(
    pausing: Path, tmp_path: Path
) -> None:
    """A stage process that waits (not compiling) is not stopped, but its compile workers,
    which go on compiling ahead, are, for the measurement."""
    log = tmp_path / "log"
    stage = _spawn(WAITING_WITH_WORKER, pausing, log, "c", session=True)
    notes: list[str] = []
    try:
        assert _until(lambda: len(_ticks(log, "c")) > 3 and len(_ticks(log, "worker")) > 3)
        lock = devicelock.join(notes.append)
        assert lock is not None
        with devicelock.measuring(quiet=True):
            time.sleep(0.2)
            start = time.time()
            time.sleep(0.6)
            end = time.time()
        assert f"{devicelock.PAUSED} 0 processes, 1 {devicelock.WORKERS_PAUSED}" in notes
        assert [t for t in _ticks(log, "c") if start <= t <= end]  # the process goes on
        assert not [t for t in _ticks(log, "worker") if start <= t <= end]
        assert _until(functools.partial(_ticked_after, log, "worker", end))
    finally:
        os.killpg(stage.pid, signal.SIGKILL)
        stage.wait(10)


# A stage process with CUDA in use, compiling off the GPU until told to stop, then using CUDA
# again: a pause in between must leave its context working.
CUDA_COMPILER = (
    PRELUDE
    + """
import os, torch
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
stop = log + ".stop"
with devicelock.off_gpu(torch.cuda.synchronize):
    while not os.path.exists(stop):
        note("tick")
        time.sleep(0.02)
note(f"sum{int((x * 2).sum().item())}")
"""
)


@pytest.mark.gpu
def test_a_pause_leaves_a_cuda_process_working(pausing: Path, tmp_path: Path) -> None:
    """A process stopped while it compiles, CUDA initialised, goes on after the measurement
    and its CUDA work runs right; the measurement's own CUDA work runs during the pause."""
    import torch

    log = tmp_path / "log"
    stage = _spawn(CUDA_COMPILER, pausing, log, "c", session=True)
    notes: list[str] = []
    try:
        assert _until(lambda: len(_ticks(log, "c")) > 3, 60)
        lock = devicelock.join(notes.append)
        assert lock is not None
        a = torch.randn(1024, 1024, device="cuda")
        with devicelock.measuring(quiet=True):
            time.sleep(0.2)
            start = time.time()
            for _ in range(50):
                a = a @ a / 1024
            torch.cuda.synchronize()
            time.sleep(0.3)
            end = time.time()
        assert any(n.startswith(f"{devicelock.PAUSED} 1 processes") for n in notes)
        assert not [t for t in _ticks(log, "c") if start <= t <= end]
        Path(str(log) + ".stop").write_text("")
        assert stage.wait(60) == 0
        assert f"c sum{2 << 20}" in log.read_text()
    finally:
        with contextlib.suppress(OSError):
            os.killpg(stage.pid, signal.SIGKILL)
        stage.wait(10)
