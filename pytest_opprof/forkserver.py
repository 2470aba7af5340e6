"""Stage processes forked from a process that has already imported torch.

Every stage runs its user code in a child process (``python -m pytest_opprof.runner SPEC``),
and each child spent most of its start importing torch, Dynamo and Inductor: seconds per
process, five processes per workload (docs/design-notes.md#importing-torch-once). The fork
server is one process per pytest process (each xdist worker has its own) that imports them
once, never touches CUDA, and forks a child per stage: the child starts with the imports done
and no CUDA context, a state that forking is safe from (as PyTorch's DataLoader workers are
forked). Each child is what the plain child was: its own process group, its output in the stage
log, the request's environment and working folder, killed when the server goes, which is killed
when its parent goes.

Protocol (a Unix socket, one request per connection, JSON lines): the client sends ``{"spec",
"log", "env", "cwd"}``; the server answers ``{"pid"}`` once forked, then ``{"exit"}`` with the
child's exit status (negative: the signal that killed it), as ``subprocess.Popen.returncode``.
Requests are served side by side (one loop over the listener and every running child's
connection), so a workload's timing processes compile at once.

Linux only; where the server cannot start, or CUDA was initialised before a fork, ``run_child``
falls back to a plain child process (``PLAIN``). ``OPPROF_FORKSERVER=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "pytest_opprof.stages")
BAD_FORK = 75
"""A child's exit status when torch says its CUDA was poisoned by the server (something the
server imported had initialised the driver): the stage is then run as a plain process."""
ENV_SWITCH = "OPPROF_FORKSERVER"
START_TIMEOUT_S = 120.0


# ------------------------------------------------------------------------------- server side


def serve(socket_path: str, run: Callable[[str], int]) -> int:
    """Import ``PRELOAD`` and fork a child per request until the parent goes; each child calls
    ``run(spec_path)`` (the stage bootstrap, ``runner.forked``) and exits with its status."""
    die_with_parent()
    # torch.cuda.is_available() by NVML, which leaves the driver uninitialised (the default
    # cudaGetDeviceCount poisons fork) should an imported module ask at import time.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # a check that fails here (no working compiler) fails again in the stage process, which
    # says so in the stage's own words: the server must start regardless
    with contextlib.suppress(Exception):
        warm_cpu_codegen()
    import torch

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    print("ready", flush=True)  # the client waits for this line
    running: dict[socket.socket, int] = {}  # a connection, and the pid of its child
    while True:
        readable, _, _ = select.select([listener, *running], [], [], WATCH_INTERVAL_S)
        for conn in readable:
            if conn is listener:
                accepted, _ = listener.accept()
                # A client that went away (a timeout, an interrupt) is its own business: the
                # server goes on with the others whatever happened on this connection.
                with contextlib.suppress(OSError, ValueError):
                    pid = _fork_one(accepted, listener, running, torch.cuda.is_initialized, run)
                    if pid is not None:
                        running[accepted] = pid
                        continue
                accepted.close()
            else:
                # The client sends nothing after its request: the connection turning readable
                # means the client went away (interrupted, perhaps before it even read the
                # pid). Its child is killed then: no stage outlives the session that asked.
                try:
                    gone = not conn.recv(1, socket.MSG_PEEK)
                except OSError:
                    gone = True
                if gone:
                    pid = running.pop(conn)
                    kill_group(pid)
                    os.waitpid(pid, 0)
                    conn.close()
        for conn, pid in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del running[conn]
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                with conn, contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"exit": code}) + "\n").encode())


def warm_cpu_codegen() -> None:
    """Where the stages compile for the CPU (the session named no GPU lock: ``devicelock``),
    Inductor's C++ backend first checks which vector ISAs the compiler builds and the CPU
    loads: a test library per ISA, built one after another into its cache (seconds each where
    the cache is empty), then loaded in a subprocess each, once per process. Checked here,
    the ISAs side by side, before any fork, every stage process inherits the answer. Where
    torch's internals differ from these (torch 2.13's ``cpu_vec_isa``), the stage processes
    check for themselves, as they would have."""
    from pytest_opprof.devicelock import LOCK_ENV

    if os.environ.get(LOCK_ENV):
        return
    from concurrent.futures import ThreadPoolExecutor

    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return
    candidates = getattr(cpu_vec_isa, "supported_vec_isa_list", None)
    flags_of = getattr(cpu_vec_isa, "x86_isa_checker", None)
    valid = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if candidates is not None and flags_of is not None and platform.machine() in X86:
        flags = flags_of()
        wanted = [isa for isa in candidates if all(f in flags for f in str(isa).split())]
        # each check is cached on its ISA object (functools.cache), which the list then reads
        with ThreadPoolExecutor(max(len(wanted), 1)) as pool:
            list(pool.map(bool, wanted))
    if valid is not None:
        valid()


X86 = ("x86_64", "AMD64")
"""``platform.machine()`` of the hosts whose ISAs Inductor checks from the CPU's own flags."""


def _fork_one(
    conn: socket.socket,
    listener: socket.socket,
    running: dict[socket.socket, int],
    cuda_initialized: Any,
    run: Callable[[str], int],
) -> int | None:
    """One request: fork its child and answer its pid (None where no child runs). Several
    run at once: a workload's timing processes compile side by side (``devicelock``)."""
    request = json.loads(_read_line(conn))
    if cuda_initialized():  # never fork a CUDA context
        conn.sendall((json.dumps({"error": "CUDA is initialised in the server"}) + "\n").encode())
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in (conn, *running):
            other.close()
        _child(request, run)  # never returns
    try:
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    except OSError:  # the client went away: its child must not run on unwatched
        kill_group(pid)
        os.waitpid(pid, 0)
        return None
    return pid


def _read_line(conn: socket.socket) -> str:
    """The request: one line, which the client writes at once after connecting."""
    conn.settimeout(START_TIMEOUT_S)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the client closed the connection before its request")
        data += chunk
    conn.settimeout(None)
    return data.decode("utf-8")


def _child(request: dict[str, Any], run: Callable[[str], int]) -> None:
    code = 1
    try:
        os.setsid()  # its own process group, which the client kills on a timeout
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        import torch

        if torch.cuda._is_in_bad_fork():
            code = BAD_FORK
            return
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        for folder in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if folder not in sys.path:
                sys.path.insert(0, folder)
        os.chdir(request["cwd"])
        die_with_parent()  # the server is the parent now
        code = run(request["spec"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------------------- client side


class ForkServer:
    """The client of one server process (started lazily by ``get``)."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self._folder = tempfile.mkdtemp(prefix="opprof-fork-")
        self.socket_path = os.path.join(self._folder, "socket")
        log = open(os.path.join(self._folder, "server.log"), "w+", encoding="utf-8")  # noqa: SIM115
        self._log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_opprof.runner", "--fork-server", self.socket_path],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        ready = ""
        if self.proc.stdout is not None:
            readable, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
            ready = self.proc.stdout.readline() if readable else ""
        if ready.strip() != "ready":
            log.flush()
            log.seek(0)
            said = log.read()[-500:]  # before close(), which closes the log
            self.close()
            raise OSError(f"the fork server did not start: {said}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, spec: Path, log: Path, env: dict[str, str], timeout: float) -> int:
        """Run ``runner.main([spec])`` in a forked child, its output in ``log``; its exit
        status, or ``subprocess.TimeoutExpired`` after killing its process group."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        with conn, conn.makefile("rw", encoding="utf-8") as stream:
            request = {"spec": str(spec), "log": str(log), "env": env, "cwd": os.getcwd()}
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            # Interrupted before the pid came back, the connection closes on the way out and
            # the server, watching it, kills the child.
            answer = json.loads(stream.readline() or "{}")
            if "pid" not in answer:
                why = answer.get("error", "the fork server did not fork")
                disable(why)
                raise OSError(why)
            pid = int(answer["pid"])
            conn.settimeout(timeout)
            try:
                line = stream.readline()
            except TimeoutError:
                kill_group(pid)
                raise subprocess.TimeoutExpired(str(spec), timeout) from None
            except BaseException:  # the session interrupted: no child outlives it
                kill_group(pid)
                raise
            if not line:
                raise OSError("the fork server went away during the stage")
            code = int(json.loads(line)["exit"])
            if code == BAD_FORK:
                disable("CUDA was initialised in the fork server before the fork")
                raise OSError("a forked child cannot use CUDA here")
            return code

    def close(self) -> None:
        self.closed.set()
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        for name in ("socket", "server.log"):
            Path(self._folder, name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.rmdir(self._folder)


def kill_group(pid: int) -> None:
    """Kill a stage child's process group, and the child itself should it not have made its
    group yet; its parent reaps it."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


WATCH_INTERVAL_S = 0.2
"""How often the server reaps its children and looks at their connections for a client gone."""

_SERVERS: dict[int, ForkServer] = {}
_FAILED = False
_LOCK = threading.Lock()
_SLOT_LOCKS: dict[int, threading.Lock] = {}
_WARMING: set[int] = set()


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1") != "0"


def slot_of(process: int, servers: int) -> int:
    """The server a workload's timing process ``process`` (0: the recapture, which every
    stage shares) is forked from, of ``servers`` (``--opprof-timing-servers``). Processes
    forked from one server share an offset in a launch-bound call's speed that a new server
    draws anew (``pipeline._retime_one``)."""
    return process % max(servers, 1)


def get(slot: int = 0) -> ForkServer | None:
    """This process's server ``slot``, started on first use; None where servers are off or
    server 0 cannot start (then the caller starts a plain child, once told why on stderr).
    Another slot that cannot start falls back to server 0, told on stderr."""
    global _FAILED
    if not enabled() or _FAILED:
        return None
    with _LOCK:
        slot_lock = _SLOT_LOCKS.setdefault(slot, threading.Lock())
    with slot_lock:  # one start per slot; a caller of a slot that is starting waits for it
        server = _SERVERS.get(slot)
        if server is not None and server.alive():
            return server
        try:
            server = _started_to_last()
        except OSError as exc:
            if slot != 0:
                print(f"pytest-opprof: fork server {slot}: {exc}; using server 0", file=sys.stderr)
                return get(0)
            _FAILED = True
            print(f"pytest-opprof: plain stage processes ({exc})", file=sys.stderr)
            return None
        with _LOCK:
            if _FAILED:  # disabled while it started (a warming thread)
                server.close()
                return None
            _SERVERS[slot] = server
        atexit.register(server.close)
        return server


def _started_to_last() -> ForkServer:
    """A server started from a thread of its own that waits until the server is closed: the
    server dies with the thread that started it (``PR_SET_PDEATHSIG`` watches the parent
    *thread*), and the caller may be a thread that ends first (``warm``'s, the recapture's
    pool)."""
    done = threading.Event()
    started: list[ForkServer] = []
    failed: list[OSError] = []

    def keep() -> None:
        try:
            server = ForkServer()
            started.append(server)
        except OSError as exc:
            failed.append(exc)
            return
        except Exception as exc:  # its caller falls back to fresh interpreters on OSError
            failed.append(OSError(f"the fork server did not start: {exc!r}"))
            return
        finally:
            done.set()
        server.closed.wait()

    threading.Thread(target=keep, name="opprof-forkserver-keeper", daemon=True).start()
    done.wait()
    if failed:
        raise failed[0]
    return started[0]


def warm(slots: Iterable[int], hold: Callable[[], AbstractContextManager[object]]) -> None:
    """Start servers ``slots`` in the background (a thread each, returning at once), each
    after server 0 (which the stages need first: its import is not slowed by theirs) and
    inside ``hold()`` for its import (the host's CPU work, which a quiet measurement waits
    out: ``devicelock.host_work``). Those already running, or starting, are left as they
    are."""
    if not enabled() or _FAILED:
        return
    for slot in slots:
        with _LOCK:
            if slot in _WARMING or (slot in _SERVERS and _SERVERS[slot].alive()):
                continue
            _WARMING.add(slot)

        def start(slot: int = slot) -> None:
            try:
                if get(0) is not None:
                    with hold():
                        get(slot)
            finally:
                with _LOCK:
                    _WARMING.discard(slot)

        threading.Thread(target=start, name=f"opprof-forkserver-{slot}", daemon=True).start()


def disable(why: str) -> None:
    """No fork server for the rest of this process (told once on stderr)."""
    global _FAILED
    _FAILED = True
    print(f"pytest-opprof: plain stage processes from now on ({why})", file=sys.stderr)
    shutdown()


def shutdown() -> None:
    """Stop this process's servers (the end of a session)."""
    with _LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()


def die_with_parent() -> None:
    """Linux: be killed when the parent (pytest, the CLI, the fork server) dies, even by
    SIGKILL, so no child writes artifacts after its session is gone. Elsewhere the parent's
    own cleanup must do."""
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
