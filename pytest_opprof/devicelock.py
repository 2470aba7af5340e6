"""One GPU, several processes: they compile side by side and measure one at a time.

Every stage process on a GPU holds that GPU's lock *shared* while it works (loads the model,
compiles, validates, reads counters) and takes it *exclusively* while it measures (timing
rounds, timelines, GPU time). A measurement therefore never runs beside another process's GPU
work, on this GPU, from this session or any other on the host, while the compiles of several
workloads (pytest-xdist workers sharing the GPU, or one workload's timing processes) run at
once. The GPU idles during a compile anyway: what parallel compiles save is wall time, not
accuracy. (Where a compile may even run beside a measurement, and which measurements it may
not run beside, is below.)

The lock is ``flock(2)`` on a file named after the GPU's UUID, so the kernel releases it when a
process dies, however it dies. Waiting measurers come first: a process about to measure takes
a turnstile that new work must pass (the classic writer-preferring lock), so a stream of new
compiles cannot keep a measurement waiting; the compiles already running finish first. Between
its steps (one compile, one selection rung) a working process :func:`makes way <make_way>`: where
a measurer waits, it steps aside until the measurement is done. So a measurer waits for the step
each neighbour is in, not for the neighbour's next measurement or its end.

Measurements go in batches. Every measurer holds a third file, ``path.want``, shared from the
moment it asks until it has measured, and work resumes only once nobody holds it. So the
measurers that queue while the GPU drains all measure before any work starts again, and one
drain (the neighbours finishing their steps) serves them all; otherwise each would wait for a
neighbour's fresh step in turn. A measurement that ends a process's use of the GPU
(``measuring(share_after=False)``) does not queue to share again: its process is done, or
shares again (:func:`resume`) right before its next GPU work.

A process that joins removes :data:`LOCK_ENV` from its own environment, so the processes it
starts (ncu's target, Inductor's compile workers) work under its share instead of waiting on a
measurement that waits on them.

Compiles need the CPU, not the GPU: Dynamo's tracing, AOT autograd's and Inductor's code
generation run on fake tensors. A process on CPUs of its own (:data:`OWN_CPUS_ENV`: an xdist
worker's slice, no sibling stage process on it) therefore lets go of its share while it compiles
(:func:`off_gpu`), and a measurer does not wait for that compile to end. The compile's own GPU
work (weights folded or converted on real tensors) takes the share back for its span
(:func:`on_gpu`), its own measurements (Inductor's autotuning under max-autotune) take the GPU
alone for theirs (:func:`measuring_within`), and the process shares again, behind any
measurer, before it runs what it compiled. A measurement therefore still runs beside no other
GPU work, and beside no CPU work on its own CPUs.

Neighbours' compiles on other CPUs still slow a launch-bound call by sharing the host (caches,
memory, the hypervisor; docs/design-notes.md#quiet-measurements). So a measurement whose
figures are reported (``measuring(quiet=True)``) also waits until no compile runs off the GPU:
compiles hold a fourth file, ``path.cpu``, shared while they run off it (never while they wait
for the GPU), and a quiet measurer takes it exclusively *before* it asks for the GPU. It waits
for the compiles under way holding nothing of the GPU, so the GPU's other work (selection's
measurements, Inductor's autotuning, validation) goes on meanwhile; held the other way round,
the GPU idled through every such wait and all of that queued behind it
(docs/design-notes.md#quiet-before-the-gpu). New compiles pass a turnstile, ``path.cpu.turn``,
that a quiet measurer holds while it waits, so a stream of them cannot keep it waiting; the
quiet measurers queued behind it measure before any compile starts again. Selection's
measurements, which compare two calls round by round, do not wait for it.

Waiting for the compiles to end, a quiet measurement waited for the longest stretch of CPU work
under way on the host (a max-autotune compile's, minutes), and the compiles that reached the
turnstile meanwhile stood idle behind it (docs/design-notes.md#pausing-the-compiles). So where
the host allows, a quiet measurement pauses them instead (:meth:`DeviceLock.pause_compiles`,
the default; ``OPPROF_QUIET=wait`` keeps the wait): with the GPU to itself, it takes
``path.cpu.turn`` (no compile starts), then stops with ``SIGSTOP`` every process that holds
``path.cpu`` (each says so by a file in ``path.cpu.d`` for the span), its process group with
it (Inductor's compile workers), and the compile workers of every other stage process on
the GPU (listed in ``path.joined.d``: they compile ahead while their process waits), and
continues them once it has measured. A stopped process
holds nothing of the GPU, nor anything the measurement waits on, so the pause cannot close a
cycle of waits. A guardian process continues them too, should the measurer die, and after
:data:`MAX_PAUSE_S` whatever happens. Where a compile's process cannot be stopped (another
user's), or holds ``path.cpu`` without being listed (``/proc/locks``), the measurement waits
for the compiles as before.

A recapture's timing processes run side by side on one CPU slice (:data:`OWN_CPUS_ENV` is not
theirs alone), so each of their measurements must run beside no compile of the others. Holding
the GPU shared through their compiles did that, but it held every other process's measurement
back too, waiting while nobody measured (docs/design-notes.md#the-siblings-lock). So siblings
hold a file of their own, ``siblings_lock`` (:func:`join`): a compile lets go of the GPU
and holds it shared instead, and a measurement takes it exclusively *before* it asks for the
GPU, so that it waits for its siblings' compiles without holding the GPU idle. Every process
takes the locks in one order (siblings, then ``path.cpu``, then the GPU) and never waits for
one while holding one later in that order: no wait can close a cycle.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no lock, one process per GPU as before
    fcntl = None  # type: ignore[assignment]

LOCK_ENV = "OPPROF_DEVICE_LOCK"
"""The lock file of the GPU a stage process measures on; set by the session for its children."""
OWN_CPUS_ENV = "OPPROF_OWN_CPUS"
"""Set (to 1) where this process's CPUs are its own: an xdist worker pinned to its slice. Its
stage processes may then compile while another process measures (:func:`off_gpu`)."""
WAITING = "waiting for the GPU: another process on it is at work or measuring"
WAITING_QUIET = (
    "waiting for the compiles of other processes on the host to end, holding nothing of the GPU"
)
QUIETED = "the host's compiles were done after"
"""Said, with the seconds waited, as a quiet measurement's wait for the host's compiles ends
and it asks for the GPU. (Before that order, the wait came with the GPU held and was said as
"the host was quiet after".)"""
WAITING_TO_COMPILE = "waiting to compile: a quiet measurement has the host"
COMPILES_AGAIN = "compiling again after"
"""Said, with the seconds waited, as a compile passes the turnstile a quiet measurement held."""
WAITING_SIBLINGS = "waiting for the compiles of this workload's sibling processes to end"
MEASURED = "let go of the GPU, held to itself for"
"""Said as a measurement ends, with its seconds: with the waits, and the wall clock each stage
log starts with, a run's logs say who had the GPU when (``benchmarks/gpu_timeline.py``)."""
SHARED = "held the GPU shared inside a compile for"
"""Said, with its seconds and what it was, as a hold of :func:`on_gpu` of ``SHARED_NOTE_S`` or
more ends: what a measurer's wait drained behind (``benchmarks/gpu_timeline.py``)."""
QUIET_ENV = "OPPROF_QUIET"
"""``wait``: a quiet measurement waits for the host's compiles to end, not pausing them."""
PAUSED = "paused the host's compiles for the measurement:"
"""Said, with the number of processes, as a quiet measurement pauses the compiles under way."""
WORKERS_PAUSED = "compile workers of processes waiting"
"""Said after :data:`PAUSED`'s count: the other processes' compile workers it stopped."""
MAX_PAUSE_S = 120.0
"""The longest a pause lasts: the guardian continues the compiles after it even if the
measurement goes on (its figures then beside them, as under a lock without pausing)."""
SHARED_NOTE_S = 0.25
"""Shorter holds are too many to say; one max-autotune choice's step is longer
(docs/design-notes.md#autotuning-holds)."""


class DeviceLock:
    """A writer-preferring reader-writer lock on the GPU (``path``, with ``path.turn`` and
    ``path.want``) and one on the host's compiles (``path.cpu``, with ``path.cpu.turn``)."""

    def __init__(self, path: Path) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # every user's sessions share the GPU
                path.parent.chmod(0o1777)
        self.path = path
        self._main = _open_shared(path)
        self._turn = _open_shared(path.with_name(path.name + ".turn"))
        self._want = _open_shared(path.with_name(path.name + ".want"))
        self._cpu = _open_shared(path.with_name(path.name + ".cpu"))
        self._cpu_turn = _open_shared(path.with_name(path.name + ".cpu.turn"))
        self._compiles = path.with_name(path.name + ".cpu.d")
        self._entry: Path | None = None
        self._joined = path.with_name(path.name + ".joined.d")
        self._joined_entry: Path | None = None
        self.held: str | None = None
        self.waited_s = 0.0
        self.alone_s = 0.0
        """Seconds this process has held the GPU exclusively (its measurements)."""
        self.let_go_s = 0.0
        """Seconds this process let go of a share inside a block that held it (an
        :func:`off_gpu` block, a measurement within), until it shared again: what a hold of
        :func:`on_gpu` around such a block did not hold."""
        self._since = 0.0
        self.aside = False
        """The share was let go for CPU-only work (:func:`off_gpu`), to be taken back after."""
        self.is_quiet = False
        """Inside a quiet measurement: the GPU and the host's compiles held off."""
        self.note: Callable[[str], None] | None = None
        self._siblings: int | None = None
        self.siblings_held: str | None = None

    def join_siblings(self, path: Path) -> None:
        """Coordinate with the stage processes that share this one's CPUs through ``path``:
        compiles go off the GPU holding it shared, measurements hold it exclusively."""
        if self._siblings is None:
            self._siblings = _open_shared(path)

    @property
    def has_siblings(self) -> bool:
        return self._siblings is not None

    def siblings_apart(self) -> bool:
        """Before a measurement: hold the siblings' lock exclusively, once none of them
        compiles, holding nothing of the GPU while waiting (the order of the locks). Returns
        whether this call took it (False: no siblings, held already, or the GPU held alone
        already, which must not be let go of here)."""
        if self._siblings is None or "exclusive" in (self.siblings_held, self.held):
            return False
        try:
            fcntl.flock(self._siblings, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            t0 = time.perf_counter()
            if self.note is not None:
                self.note(WAITING_SIBLINGS)
            fcntl.flock(self._siblings, fcntl.LOCK_EX)
            waited = time.perf_counter() - t0
            self.waited_s += waited
            if self.note is not None:
                self.note(f"the sibling processes were done compiling after {waited:.1f} s")
        self.siblings_held = "exclusive"
        return True

    def _siblings_compiling(self) -> None:
        """Off the GPU for a compile: hold the siblings' lock shared (after any sibling's
        measurement under way); nothing of the GPU is held here."""
        if self._siblings is None:
            return
        t0 = time.perf_counter()
        fcntl.flock(self._siblings, fcntl.LOCK_SH)
        self.waited_s += time.perf_counter() - t0
        self.siblings_held = "shared"

    def _siblings_unlock(self) -> None:
        if self._siblings is not None and self.siblings_held is not None:
            fcntl.flock(self._siblings, fcntl.LOCK_UN)
            self.siblings_held = None

    def _through_turnstile(self, mode: int) -> None:
        """Take ``path`` in ``mode``; never called while holding it (no deadlock on the turn).
        Work (``LOCK_SH``) first waits until no measurer wants the GPU. A wait is told to
        ``note`` as it starts and ends, so a stage log shows it."""
        t0 = time.perf_counter()
        work = mode == fcntl.LOCK_SH
        if (not work or not self._measurer_waits()) and self._at_once(mode):
            return
        if self.note is not None:
            self.note(WAITING)
        if work:  # after every measurer queued now (they hold it shared until measured)
            fcntl.flock(self._want, fcntl.LOCK_EX)
            fcntl.flock(self._want, fcntl.LOCK_UN)
        _take_in_turn(self._turn, self._main, mode)
        waited = time.perf_counter() - t0
        self.waited_s += waited
        if self.note is not None:
            self.note(f"had the GPU after {waited:.1f} s")

    def _measurer_waits(self) -> bool:
        """Whether a measurer has asked for the GPU and not yet measured (or another process
        is checking this same thing this instant: then it only costs a needless wait)."""
        try:
            fcntl.flock(self._want, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._want, fcntl.LOCK_UN)
        return False

    def _at_once(self, mode: int) -> bool:
        """Take ``path`` in ``mode`` if nobody is in the way (nobody waits at the turnstile)."""
        return _take_at_once(self._turn, self._main, mode)

    def share(self) -> None:
        if self.held != "shared":
            self.release()
            self._through_turnstile(fcntl.LOCK_SH)
            self.held = "shared"

    def quiet(self) -> None:
        """Before the GPU: wait until no process compiles off the GPU (``path.cpu`` held
        exclusively), holding nothing of the GPU meanwhile; the compiles under way finish, and
        none starts until :meth:`unquiet` (the turnstile). The wait counts as waiting. (Held
        exclusively already, a measurement within a measurement, it keeps the GPU: no compile
        waits for the GPU holding ``path.cpu``.)"""
        if self.held == "shared":
            self.release()
        t0 = time.perf_counter()
        self.is_quiet = True
        if _take_at_once(self._cpu_turn, self._cpu, fcntl.LOCK_EX):
            return
        if self.note is not None:
            self.note(WAITING_QUIET)
        _take_in_turn(self._cpu_turn, self._cpu, fcntl.LOCK_EX)
        waited = time.perf_counter() - t0
        self.waited_s += waited
        if self.note is not None:
            self.note(f"{QUIETED} {waited:.1f} s")

    def unquiet(self) -> None:
        self.is_quiet = False
        fcntl.flock(self._cpu, fcntl.LOCK_UN)

    def compiling(self) -> None:
        """Off the GPU: hold ``path.cpu`` shared, after any quiet measurement under way or
        waiting (its turnstile); this process is listed in ``path.cpu.d`` from before the
        turnstile, so a quiet measurement that takes the turnstile next finds it (and may
        pause it, holding nothing of the GPU) until :meth:`compiled`."""
        t0 = time.perf_counter()
        if self._entry is None:
            self._entry = _listed(self._compiles)
        if not _take_at_once(self._cpu_turn, self._cpu, fcntl.LOCK_SH):
            if self.note is not None:
                self.note(WAITING_TO_COMPILE)
            _pass_turnstile(self._cpu_turn)
            fcntl.flock(self._cpu, fcntl.LOCK_SH)
            if self.note is not None:
                self.note(f"{COMPILES_AGAIN} {time.perf_counter() - t0:.1f} s")
        self.waited_s += time.perf_counter() - t0

    def compiled(self) -> None:
        _unlisted(self._entry)  # first: a process listed never holds or waits for the GPU
        self._entry = None
        fcntl.flock(self._cpu, fcntl.LOCK_UN)

    def pause_compiles(self) -> Paused | None:
        """Holding the GPU alone, for a quiet measurement: no compile starts (``path.cpu.turn``
        held) and every one under way is stopped until :meth:`Paused.resume`. None where one
        could not be stopped (another user's process), holds ``path.cpu`` unlisted, or is
        listed to be waited for (:func:`host_work`): the caller then waits for them
        (:meth:`quiet`), nothing paused and the turnstile let go of."""
        fcntl.flock(self._cpu_turn, fcntl.LOCK_EX)
        targets = _compiling_processes(self._compiles)
        if targets is None or _unlisted_holders(self._cpu, targets):
            fcntl.flock(self._cpu_turn, fcntl.LOCK_UN)
            return None
        workers = _workers_of(self._joined, {-t for t in targets if t < 0})
        paused = Paused(self, targets + workers)
        try:
            paused.stop()
        except OSError:  # not ours to stop, or no guardian: wait for them instead
            paused.resume()
            return None
        self.is_quiet = True
        if paused.targets and self.note is not None:
            self.note(f"{PAUSED} {len(targets)} processes, {len(workers)} {WORKERS_PAUSED}")
        return paused

    def go_aside(self) -> None:
        """Holding nothing of the GPU, start CPU-only work (a compile): the siblings' lock
        and ``path.cpu`` held shared, in the order of the locks."""
        self.release()
        self._siblings_compiling()
        self.compiling()
        self.aside = True

    def leave_aside(self) -> None:
        """End CPU-only work: ``path.cpu`` and the siblings' lock let go of, so that nothing
        of the compile is held while the caller waits for the GPU."""
        self.compiled()
        self._siblings_unlock()
        self.aside = False

    def exclusive(self) -> None:
        if self.held != "exclusive":
            self.release()
            fcntl.flock(self._want, fcntl.LOCK_SH)  # work waits from now on
            try:
                self._through_turnstile(fcntl.LOCK_EX)
            except BaseException:  # interrupted while waiting: work must not wait on us
                fcntl.flock(self._want, fcntl.LOCK_UN)
                raise
            self.held = "exclusive"
            self._since = time.perf_counter()

    def make_way(self) -> None:
        """Held shared, between two steps of work: where a measurer waits, let it (and every
        measurer queued behind it) measure first, then share again. Costs two system calls
        where nobody waits."""
        if self.held != "shared" or not self._measurer_waits():
            return
        self.release()
        self.share()  # after the measurers

    def give_back(self) -> None:
        """Let go of the GPU held alone without having measured: no note, no time alone."""
        if self.held == "exclusive":
            fcntl.flock(self._main, fcntl.LOCK_UN)
            fcntl.flock(self._want, fcntl.LOCK_UN)
            self.held = None

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self._main, fcntl.LOCK_UN)
            if self.held == "exclusive":
                alone = time.perf_counter() - self._since
                self.alone_s += alone
                fcntl.flock(self._want, fcntl.LOCK_UN)
                if self.note is not None:
                    self.note(f"{MEASURED} {alone:.2f} s")
            self.held = None

    def close(self) -> None:
        self.release()
        _unlisted(self._entry)
        _unlisted(self._joined_entry)
        self._entry = self._joined_entry = None
        for fd in (self._main, self._turn, self._want, self._cpu, self._cpu_turn):
            os.close(fd)
        if self._siblings is not None:
            os.close(self._siblings)
            self._siblings = None
            self.siblings_held = None


def _take_at_once(turn: int, fd: int, mode: int) -> bool:
    """Take ``fd`` in ``mode`` if nobody is in the way: nobody holds it against ``mode`` and
    nobody waits at its turnstile ``turn``."""
    try:
        fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        fcntl.flock(turn, fcntl.LOCK_UN)


def _take_in_turn(turn: int, fd: int, mode: int) -> None:
    """Take ``fd`` in ``mode``, holding its turnstile ``turn`` while waiting, so that those who
    only pass the turnstile (:func:`_pass_turnstile`) queue behind this wait."""
    fcntl.flock(turn, fcntl.LOCK_EX)
    try:
        fcntl.flock(fd, mode)
    finally:
        fcntl.flock(turn, fcntl.LOCK_UN)


def _pass_turnstile(fd: int) -> None:
    """Wait until nobody holds the turnstile ``fd`` (a waiting writer), holding it no longer."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.flock(fd, fcntl.LOCK_UN)


def _open_shared(path: Path) -> int:
    """A lock file every user of the host can open (the umask would leave it the creator's)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # another user's file: theirs to set, already 0o666
        os.fchmod(fd, 0o666)
    return fd


class Paused:
    """The compiles a quiet measurement stopped (:meth:`DeviceLock.pause_compiles`): each
    target a pid, or minus a process group's id where the process leads its own group (a
    stage process, with its compile workers), as ``os.kill`` takes them."""

    def __init__(self, lock: DeviceLock, targets: list[int]) -> None:
        self.lock = lock
        self.targets = targets
        self._guardian: Any = None

    def stop(self) -> None:
        """Start the guardian, then stop every target (a target gone is skipped); raises
        PermissionError where one may not be signalled, the ones before it stopped."""
        self._guardian = _stop(self.targets)

    def resume(self) -> None:
        """Continue the targets, let the guardian go and open the turnstile to compiles."""
        _continue(self.targets, self._guardian)
        self._guardian = None
        self.lock.is_quiet = False
        fcntl.flock(self.lock._cpu_turn, fcntl.LOCK_UN)


def _stop(targets: list[int]) -> Any:
    """Start a guardian (:func:`_guardian`), then stop every target with ``SIGSTOP`` (a
    target gone is skipped): the guardian, or None where there is no target. Raises
    PermissionError where one may not be signalled, the ones before it stopped."""
    import signal

    if not targets:
        return None
    guardian = _guardian(targets)
    try:
        for target in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGSTOP)
    except BaseException:
        _continue(targets, guardian)
        raise
    return guardian


def _continue(targets: list[int], guardian: Any) -> None:
    """Continue the targets that :func:`_stop` stopped and let its guardian go."""
    import signal

    for target in targets:
        with contextlib.suppress(OSError):
            os.kill(target, signal.SIGCONT)
    if guardian is not None:
        with contextlib.suppress(OSError):
            guardian.stdin.close()  # it wakes, continues them again, and exits
        with contextlib.suppress(Exception):
            guardian.wait(timeout=5)


def identity(pid: int | None = None) -> str | None:
    """``PID-STARTTIME``: one process (this one by default) by its pid and its start time
    since boot, so that a later process given the same pid is not taken for it
    (:func:`stopped`); None where ``/proc`` does not say (no such process, not Linux)."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return None if start is None else f"{pid}-{start}"


@contextlib.contextmanager
def stopped(processes: list[str]) -> Iterator[list[int]]:
    """The processes named (:func:`identity`) stopped with ``SIGSTOP`` for the block and
    continued after it, by a guardian too should this process die meanwhile (and after
    :data:`MAX_PAUSE_S` whatever happens): for a measurement that must not run beside their
    CPU work on its CPUs (a sibling compiling ahead of it). The caller holds the GPU alone,
    so a stopped process holds nothing of it that the block could wait on. A process that
    leads its own group (a stage process) is stopped with its group; one that is gone, whose
    pid a later process has, or this process itself, is left alone, and so are all where one
    may not be signalled (another user's): the block then runs beside them. Yields the
    ``os.kill`` targets stopped."""
    mine = os.getpgid(0)
    targets = []
    for name in processes:
        pid_s, _, start = name.partition("-")
        if not pid_s.isdigit() or int(pid_s) == os.getpid() or _start_time(int(pid_s)) != start:
            continue
        try:
            group = os.getpgid(int(pid_s))
        except OSError:
            continue
        targets.append(-group if group == int(pid_s) and group != mine else int(pid_s))
    try:
        guardian = _stop(targets)
    except OSError:  # not ours to stop: continued already
        targets, guardian = [], None
    try:
        yield targets
    finally:
        _continue(targets, guardian)


_GUARDIAN = """import os, select, signal, sys
select.select([sys.stdin], [], [], float(sys.argv[1]))
for target in sys.argv[2:]:
    try:
        os.kill(int(target), signal.SIGCONT)
    except OSError:
        pass
"""
"""Waits until its stdin closes (the measurer let go of it, or died) or ``MAX_PAUSE_S``,
then continues the targets."""


def _guardian(targets: list[int]) -> Any:
    """A process of its own session that continues ``targets`` should this one die
    mid-pause: a stopped process cannot continue itself, and would hold its stage until the
    stage's timeout."""
    import subprocess
    import sys

    argv = [sys.executable, "-S", "-c", _GUARDIAN, str(MAX_PAUSE_S), *map(str, targets)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,  # not the stage log's pipe, which it would hold open
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,  # nor the locks: a lock's file open in it would outlive the measurer
    )


def _start_time(pid: int) -> str | None:
    """The process's start time since boot (``/proc/PID/stat``'s 22nd field): with the pid,
    it names one process, not a later one given the same pid; None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


_OWN_START: dict[int, str | None] = {}
"""This process's start time, by pid (a forked child has its own)."""

WAIT_FOR = "wait"
"""The suffix of a listing a quiet measurement waits for rather than pauses."""


def _listed(folder: Path, suffix: str = "") -> Path | None:
    """List this process in ``folder`` as compiling (``PID-STARTTIME[-SUFFIX]``, an empty file
    created at once); None where it cannot be (no ``/proc``, a folder it cannot write): a
    quiet measurement then does not find it, as before this list."""
    pid = os.getpid()
    if pid not in _OWN_START:  # a compile is listed thousands of times: read /proc once
        _OWN_START[pid] = _start_time(pid)
    start = _OWN_START[pid]
    if start is None:
        return None
    try:
        if not folder.is_dir():
            folder.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # every user's compiles are listed here
                folder.chmod(0o1777)
        entry = folder / (f"{pid}-{start}-{suffix}" if suffix else f"{pid}-{start}")
        os.close(os.open(entry, os.O_WRONLY | os.O_CREAT, 0o666))
    except OSError:
        return None
    return entry


def _unlisted(entry: Path | None) -> None:
    if entry is not None:
        with contextlib.suppress(OSError):
            entry.unlink()


def _live_entries(folder: Path) -> list[tuple[int, str]]:
    """The processes listed in ``folder``, this one aside, each as (pid, the listing's
    suffix); an entry whose process is gone, or whose pid a later process has, is removed."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    live = []
    for entry in entries:
        pid_s, _, rest = entry.name.partition("-")
        start, _, kind = rest.partition("-")
        if not pid_s.isdigit() or int(pid_s) == os.getpid():
            continue
        if _start_time(int(pid_s)) != start:
            _unlisted(entry)
            continue
        live.append((int(pid_s), kind))
    return live


def _compiling_processes(folder: Path) -> list[int] | None:
    """The processes listed in ``folder`` (this one aside) as ``os.kill`` targets: a process
    that leads its own group (a stage process) as the group, with its compile workers; one in
    this process's group as itself. None where one is listed as CPU work to wait for, not
    stop (:func:`host_work`: a fork server's import, done for another process)."""
    live = _live_entries(folder)
    if any(kind == WAIT_FOR for _, kind in live):
        return None
    mine = os.getpgid(0)
    targets = []
    for pid, _ in live:
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        targets.append(-pid if group == pid and group != mine else pid)
    return targets


def _workers_of(folder: Path, besides: set[int]) -> list[int]:
    """The other members of the process groups led by the processes listed in ``folder`` (the
    stage processes joined to the GPU's lock), groups in ``besides`` and this process's own
    aside: their compile workers, which go on compiling ahead (Inductor's precompiling of an
    op's choices) while their stage process waits for the GPU."""
    mine = os.getpgid(0)
    leaders = set()
    for pid, _ in _live_entries(folder):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid and pid not in besides and pid != mine:
                leaders.add(pid)
    if not leaders:
        return []
    workers = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in leaders:
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in leaders:
            workers.append(int(proc.name))
    return workers


def _unlisted_holders(fd: int, targets: list[int]) -> bool:
    """Whether a process that is not among ``targets`` (nor this one) holds ``fd``'s file
    locked, by ``/proc/locks``: CPU work a pause would leave running (a session of an older
    version, a process that holds the file without listing itself). True where the table
    cannot be read: nothing then says the host is quiet but the wait."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    known = {abs(t) for t in targets} | {os.getpid()}
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return True
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":  # a waiter, not a holder
            continue
        pid, file = fields[4], fields[5]
        if file == where and pid.isdigit() and int(pid) not in known:
            return True
    return False


def pausing() -> bool:
    """Whether a quiet measurement pauses the host's compiles (:data:`QUIET_ENV` not ``wait``,
    and a ``/proc`` to name them by)."""
    return os.environ.get(QUIET_ENV, "pause") != "wait" and Path("/proc/self/stat").exists()


_LOCK: DeviceLock | None = None


def join(
    note: Callable[[str], None] | None = None, siblings: str | None = None
) -> DeviceLock | None:
    """Hold this process's GPU lock shared, where the session named one (:data:`LOCK_ENV`),
    telling ``note`` of every wait; ``siblings``: the lock file of the stage processes that
    share this one's CPUs (:meth:`DeviceLock.join_siblings`). Returns it, or None where there
    is none to take (the CPU, a lock the process cannot open: then nothing is shared, as with
    one process per GPU)."""
    global _LOCK
    name = os.environ.pop(LOCK_ENV, "")
    if _LOCK is not None or not name or fcntl is None:
        return _LOCK
    try:
        lock = DeviceLock(Path(name))
    except OSError as exc:
        if note is not None:
            note(
                f"no GPU lock ({exc}): measuring beside whatever else runs on the GPU; make "
                f"{Path(name).parent} writable by every user of the host (opprof preflight "
                "checks it)"
            )
        return None
    lock.note = note
    if siblings:
        try:
            lock.join_siblings(Path(siblings))
        except OSError as exc:  # its folder is the stage's own: say it, share through compiles
            if note is not None:
                note(f"no lock with the sibling processes ({exc}): compiling on the GPU")
    lock.share()
    # listed as a stage process on this GPU: a quiet measurement pauses its compile workers
    lock._joined_entry = _listed(lock._joined)
    _LOCK = lock
    return lock


@contextlib.contextmanager
def measuring(*, share_after: bool = True, quiet: bool = False) -> Iterator[None]:
    """The GPU to this process alone for the block (a no-op where :func:`join` took no lock);
    shared again after it, or, with ``share_after=False``, released: for a measurement after
    which the process does no GPU work until it calls :func:`resume` (or none at all), so it
    does not wait for the measurers queued behind it to share again. ``quiet``: a measurement
    whose figures are reported, which runs beside no compile on the host either: with the GPU
    to itself it pauses them (:func:`pausing`), or, where it may not, it first waits for them
    to end, holding nothing of the GPU."""
    lock = _LOCK
    if lock is None:
        yield
        return
    apart = lock.siblings_apart()
    paused: Paused | None = None
    try:
        if quiet and pausing() and lock.held != "exclusive":
            lock.exclusive()  # the GPU first: the pause waits for nobody
            paused = lock.pause_compiles()
            if paused is None:  # not paused: the GPU given back for the wait, measuring nothing
                lock.give_back()
        if quiet and paused is None:
            # the host's compiles end first, holding nothing of the GPU (the order of the
            # locks), unless held alone already
            lock.quiet()
        lock.exclusive()
        yield
    finally:
        if paused is not None:
            paused.resume()
        elif quiet:
            lock.unquiet()
        if apart:
            lock._siblings_unlock()
        if share_after:
            lock.share()
        else:
            lock.release()


@contextlib.contextmanager
def measuring_within(sync: Callable[[], None] | None = None) -> Iterator[None]:
    """A measurement in the middle of this process's work: ``opprof::tuned_mm`` timing
    cuBLASLt's algorithms on a shape's first call, Inductor's autotuning inside a compile. The
    GPU to this process alone for the block, then held as it was before: shared, nothing, or
    aside for the compile under way (:func:`off_gpu`: ``sync``, where given, waits for the
    block's GPU work before the GPU is let go of again). A no-op without a lock or while
    measuring already. Tuned beside another process's GPU work, ``tuned_mm`` kept slower GEMMs
    (docs/design-notes.md#tuning-with-the-gpu-alone)."""
    lock = _LOCK
    if lock is None or lock.held == "exclusive":
        yield
        return
    if lock.aside:
        lock.leave_aside()
        lock.exclusive()
        try:
            yield
        finally:
            if sync is not None:
                with contextlib.suppress(Exception):  # a failed block: its error, not the sync's
                    sync()
            lock.go_aside()
        return
    before, t0 = lock.held, time.perf_counter()
    lock.exclusive()
    try:
        yield
    finally:
        if before == "shared":
            lock.share()
            lock.let_go_s += time.perf_counter() - t0
        else:
            lock.release()


@contextlib.contextmanager
def off_gpu(sync: Callable[[], None]) -> Iterator[None]:
    """CPU-only work (a compile): where this process holds the GPU shared, let go of it for the
    block, so that a measurer need not wait for the block to end; share again after it, behind
    any measurer. ``sync`` waits for this process's queued GPU work, which must not run beside a
    measurement; it is called before letting go. A no-op without a lock, while measuring, or
    where the process holds nothing (its next GPU work :func:`resumes <resume>` first)."""
    lock = _LOCK
    if lock is None or lock.held != "shared":  # aside already: held is None
        yield
        return
    sync()
    t0 = time.perf_counter()
    lock.go_aside()
    try:
        yield
    finally:
        lock.leave_aside()
        lock.share()
        lock.let_go_s += time.perf_counter() - t0


@contextlib.contextmanager
def on_gpu(sync: Callable[[], None], what: str = "GPU work") -> Iterator[None]:
    """GPU work inside :func:`off_gpu` (weights folded on real tensors during a compile): the
    share taken back for the block, behind any measurer, and let go again after ``sync``;
    a hold of ``SHARED_NOTE_S`` or more says so, and ``what`` it was (the time a block
    inside it let go of the share, :func:`off_gpu` or :func:`measuring_within`, not counted,
    nor the wait to go aside again). A no-op outside ``off_gpu``."""
    lock = _LOCK
    if lock is None or not lock.aside:
        yield
        return
    lock.leave_aside()
    lock.share()
    since, let_go = time.perf_counter(), lock.let_go_s
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a failed block: its error, not the sync's
            sync()
        # before going aside, which may wait (for a sibling's or a quiet measurement) with
        # the GPU let go of already
        held = time.perf_counter() - since - (lock.let_go_s - let_go)
        lock.go_aside()
        if held >= SHARED_NOTE_S and lock.note is not None:
            lock.note(f"{SHARED} {held:.2f} s: {what}")


@contextlib.contextmanager
def host_work() -> Iterator[None]:
    """CPU work of the session's own process, outside any stage process (a fork server
    importing torch): ``path.cpu`` of the GPU named by :data:`LOCK_ENV` held shared for the
    block, as a compile holds it, so a quiet measurement waits until it ends. A no-op without
    that variable or where the file cannot be opened."""
    path = os.environ.get(LOCK_ENV)
    if not path or fcntl is None:
        yield
        return
    try:
        fd = _open_shared(Path(path + ".cpu"))
    except OSError:
        yield
        return
    try:
        turn = _open_shared(Path(path + ".cpu.turn"))
    except OSError:
        turn = None
    # Listed, so that a quiet measurement that would pause the compiles waits instead: the
    # work is another process's, which this one cannot name.
    entry = _listed(Path(path + ".cpu.d"), WAIT_FOR)
    try:
        if turn is not None:  # after the quiet measurers waiting
            _pass_turnstile(turn)
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        _unlisted(entry)
        os.close(fd)  # lets go of the lock with it
        if turn is not None:
            os.close(turn)


def make_way() -> None:
    """A step of this process's work is done and its GPU work finished (the caller has
    synchronized): a measurer waiting on the GPU goes first (:meth:`DeviceLock.make_way`)."""
    if _LOCK is not None:
        _LOCK.make_way()


def resume() -> None:
    """Share the GPU again before GPU work that follows ``measuring(share_after=False)``;
    nothing where the process holds it already."""
    if _LOCK is not None and _LOCK.held is None:
        _LOCK.share()


def let_go() -> None:
    """Hold nothing of the GPU's lock, nor the siblings' lock, while this process waits on a
    sibling that will measure: held shared, either would hold that measurement back, and with
    it the wait. The caller has synchronized; :func:`resume` shares again before the next GPU
    work."""
    if _LOCK is not None:
        _LOCK.release()
        _LOCK._siblings_unlock()


def joined_path() -> str | None:
    """The lock file this process joined, for a child that must join it itself (its
    :data:`LOCK_ENV` is gone: :func:`join`), or None where it joined none."""
    return str(_LOCK.path) if _LOCK is not None else None


def held_alone() -> bool:
    """Whether this process holds the GPU alone now: a measurement under way."""
    return _LOCK is not None and _LOCK.held == "exclusive"


def has_siblings() -> bool:
    """Whether this process coordinates with siblings on its CPU slice through their own lock
    (:func:`join`'s ``siblings``): then its compiles may go off the GPU."""
    return _LOCK is not None and _LOCK.has_siblings


def quiet_now() -> bool:
    """Whether this process is inside ``measuring(quiet=True)`` under a lock: no other stage
    process on the host works on the GPU or compiles, so its timing may borrow any idle CPU of
    the host (``capture.timing.FastCpu``)."""
    return _LOCK is not None and _LOCK.is_quiet


def waited_s() -> float:
    """Seconds this process has waited on its GPU's lock so far."""
    return _LOCK.waited_s if _LOCK is not None else 0.0


def alone_s() -> float:
    """Seconds this process has held its GPU's lock exclusively so far: what, summed over
    every process on a GPU, no amount of sharing can overlap."""
    return _LOCK.alone_s if _LOCK is not None else 0.0


def lock_path(gpu_id: str, root: Path | None = None) -> Path:
    """The lock file of one GPU (its UUID, or the ``CUDA_VISIBLE_DEVICES`` entry where
    nvidia-smi cannot name it), in a folder every user of the host can reach."""
    import tempfile

    base = root or Path(tempfile.gettempdir()) / "pytest-opprof-gpu-locks"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu_id)
    return base / f"{safe}.lock"
