"""The fork server: stage processes forked with torch already imported, each what a plain child
was — its own process group, its output in the stage log, the request's environment and
folder, killed on a timeout, on an interrupt, and when the server goes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import forkserver
from pytest_opprof.options import OpprofOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


@pytest.fixture
def server() -> Iterator[forkserver.ForkServer]:
    started = forkserver.ForkServer()
    yield started
    started.close()


def _spec(tmp_path: Path, body: str, task: str = "capture") -> Path:
    workload = tmp_path / "w.py"
    workload.write_text(body, encoding="utf-8")
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "task": task,
                "workload": str(workload),
                "out_dir": str(tmp_path / "out"),
                "options": OpprofOptions(device="cpu").to_child(),
                "overrides": {},
            }
        ),
        encoding="utf-8",
    )
    return spec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


def _sleeper(pid_file: Path) -> str:
    """A workload that writes its process id to ``pid_file`` and sleeps."""
    return (
        "import os, time\n"
        "def get_model_and_input():\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
    )


def _wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _still_serves(server: forkserver.ForkServer, tmp_path: Path) -> bool:
    """The server runs the next request (a workload's own error: the runner's exit 3)."""
    env = {**os.environ, "OPPROF_TEST_OUT": str(tmp_path / "info.json")}
    return server.run(_spec(tmp_path, RECORD), tmp_path / "log2", env, timeout=120) == 3


RECORD = (
    "import json, os, sys\n"
    "def get_model_and_input():\n"
    "    info = {'env': os.environ.get('OPPROF_TEST_VALUE'), 'cwd': os.getcwd(),\n"
    "            'torch_loaded_before': 'torch._inductor.compile_fx' in sys.modules,\n"
    "            'pid': os.getpid(), 'pgid': os.getpgid(0)}\n"
    "    open(os.environ['OPPROF_TEST_OUT'], 'w').write(json.dumps(info))\n"
    "    print('hello from the workload')\n"
    "    raise ValueError('recorded')\n"
)


def test_a_stage_child_gets_the_request_environment_folder_and_log(
    server: forkserver.ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "info.json"
    env = {**os.environ, "OPPROF_TEST_VALUE": "42", "OPPROF_TEST_OUT": str(out)}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    log = tmp_path / "capture.log"
    code = server.run(_spec(tmp_path, RECORD), log, env, timeout=120)
    info = json.loads(out.read_text())
    assert info["env"] == "42" and info["cwd"] == str(elsewhere)
    assert info["torch_loaded_before"]  # imported by the server, before the fork
    assert info["pgid"] == info["pid"] != server.proc.pid  # a process group of its own
    assert code == 3  # the runner's exit status for a workload's own error
    text = log.read_text()
    assert "hello from the workload" in text and "torch imported" in text
    assert f"forked from the fork server of pid {server.proc.pid} at " in text
    # its first line says when it started, on the clock every stage log shares
    first = text.splitlines()[0]
    assert re.search(r"forked from .* at \d\d:\d\d:\d\d\.\d{3} UTC$", first), first
    assert (tmp_path / "failure.json").exists()  # written beside the spec, as a plain child


def test_a_child_that_outlives_its_timeout_is_killed_with_its_group(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    body = (
        "import os, subprocess, sys, time\n"
        "def get_model_and_input():\n"
        f"    sub = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"    open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{sub.pid}}')\n"
        "    time.sleep(300)\n"
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(_spec(tmp_path, body), tmp_path / "log", dict(os.environ), timeout=8)
    assert time.monotonic() - started < 30
    child, grandchild = map(int, pid_file.read_text().split())
    _wait_until(lambda: not (_alive(child) or _alive(grandchild)), 10)
    assert not _alive(child) and not _alive(grandchild)
    # the server goes on serving
    assert _still_serves(server, tmp_path)


def test_a_child_whose_client_went_away_is_killed(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    """The session interrupted before it read the child's pid (so it cannot kill it): the
    server sees the connection close and kills the child, then serves the next request."""
    import socket

    pid_file = tmp_path / "pid"
    body = _sleeper(pid_file)
    request = {
        "spec": str(_spec(tmp_path, body)),
        "log": str(tmp_path / "log"),
        "env": dict(os.environ),
        "cwd": os.getcwd(),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.socket_path)
    conn.sendall((json.dumps(request) + "\n").encode())
    _wait_until(pid_file.exists, 60)
    child = int(pid_file.read_text())
    conn.close()  # without reading the pid
    _wait_until(lambda: not _alive(child), 10)
    assert not _alive(child)
    assert _still_serves(server, tmp_path)


def test_a_crash_is_reported_as_its_signal(server: forkserver.ForkServer, tmp_path: Path) -> None:
    body = (
        "import os, signal\ndef get_model_and_input():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    code = server.run(_spec(tmp_path, body), tmp_path / "log", dict(os.environ), timeout=120)
    assert code == -signal.SIGSEGV


def test_children_die_with_the_server(server: forkserver.ForkServer, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    body = _sleeper(pid_file)
    import threading

    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(_spec(tmp_path, body), tmp_path / "log", dict(os.environ), timeout=120)
        except BaseException as exc:  # the server going away mid-stage
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    _wait_until(pid_file.exists, 60)
    child = int(pid_file.read_text())
    os.kill(server.proc.pid, signal.SIGKILL)
    thread.join(timeout=30)
    _wait_until(lambda: not _alive(child), 10)
    assert not _alive(child)
    assert errors and isinstance(errors[0], OSError)


class _Isa:
    """A stand-in for one of Inductor's vector ISAs: its flags, and whether it was checked."""

    def __init__(self, flags: str) -> None:
        self.flags = flags
        self.checked = False

    def __str__(self) -> str:
        return self.flags

    def __bool__(self) -> bool:
        self.checked = True
        return True


@pytest.fixture
def isas(monkeypatch: pytest.MonkeyPatch) -> tuple[_Isa, _Isa, list[str]]:
    """Inductor's ISA check with two candidates, of which the CPU has the first's flags."""
    from torch._inductor import cpu_vec_isa

    has, lacks, listed = _Isa("avx2"), _Isa("avx512f avx512bw"), []
    monkeypatch.setattr(cpu_vec_isa, "supported_vec_isa_list", [lacks, has])
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["avx2"])
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: listed.append("listed"))
    monkeypatch.setattr(forkserver.platform, "machine", lambda: "x86_64")
    return has, lacks, listed


def test_a_cpu_session_server_checks_the_isas_the_cpu_has_before_it_forks(
    isas: tuple[_Isa, _Isa, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.devicelock import LOCK_ENV

    monkeypatch.delenv(LOCK_ENV, raising=False)
    has, lacks, listed = isas
    forkserver.warm_cpu_codegen()
    assert has.checked and not lacks.checked
    assert listed == ["listed"]  # Inductor's own list, cached for the children to inherit


def test_a_gpu_session_server_checks_no_isa(
    isas: tuple[_Isa, _Isa, list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pytest_opprof.devicelock import LOCK_ENV

    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    has, lacks, listed = isas
    forkserver.warm_cpu_codegen()
    assert not has.checked and not lacks.checked and listed == []


def test_a_child_of_a_cpu_session_inherits_the_isa_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.devicelock import LOCK_ENV

    monkeypatch.delenv(LOCK_ENV, raising=False)
    out = tmp_path / "info.json"
    body = (
        "import json, os\n"
        "from torch._inductor import cpu_vec_isa\n"
        "def get_model_and_input():\n"
        "    known = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize\n"
        "    open(os.environ['OPPROF_TEST_OUT'], 'w').write(json.dumps(known))\n"
        "    raise ValueError('recorded')\n"
    )
    server = forkserver.ForkServer()
    try:
        env = {**os.environ, "OPPROF_TEST_OUT": str(out)}
        assert server.run(_spec(tmp_path, body), tmp_path / "log", env, timeout=120) == 3
    finally:
        server.close()
    assert json.loads(out.read_text()) == 1  # answered before the fork, not by the child


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forkserver.ENV_SWITCH, "0")
    assert forkserver.get() is None


def test_disabled_for_the_rest_of_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a child reports that CUDA was poisoned in the server, stages start plainly."""
    monkeypatch.setattr(forkserver, "_FAILED", False)
    forkserver.disable("a test")
    assert forkserver.get() is None
    monkeypatch.setattr(forkserver, "_FAILED", False)  # the next session may try again


def test_requests_are_served_side_by_side(server: forkserver.ForkServer, tmp_path: Path) -> None:
    """A workload's timing processes run at once (they compile together and measure one at a
    time under the GPU's lock): two children of one server are alive together."""
    import threading

    pid_files = [tmp_path / "a" / "pid", tmp_path / "b" / "pid"]
    codes: list[int] = []
    threads = []
    for pid_file in pid_files:
        pid_file.parent.mkdir()
        spec = _spec(pid_file.parent, _sleeper(pid_file))
        log = pid_file.parent / "log"
        threads.append(
            threading.Thread(
                target=lambda s=spec, lg=log: codes.append(
                    server.run(s, lg, dict(os.environ), timeout=120)
                )
            )
        )
    for t in threads:
        t.start()
    _wait_until(lambda: all(p.exists() and p.read_text() for p in pid_files), 60)
    pids = [int(p.read_text()) for p in pid_files]
    assert all(_alive(pid) for pid in pids)  # both at once
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=30)
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    assert _still_serves(server, tmp_path)


@pytest.fixture
def slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's servers as a test starts them, stopped after it."""
    monkeypatch.setattr(forkserver, "_SERVERS", {})
    monkeypatch.setattr(forkserver, "_SLOT_LOCKS", {})
    monkeypatch.setattr(forkserver, "_FAILED", False)
    yield
    forkserver.shutdown()


def _parent_of(server: forkserver.ForkServer, tmp_path: Path) -> int:
    """The process a child of ``server`` was forked from."""
    out = tmp_path / "info.json"
    body = (
        "import json, os\n"
        "def get_model_and_input():\n"
        f"    open({str(out)!r}, 'w').write(json.dumps(os.getppid()))\n"
        "    raise ValueError('recorded')\n"
    )
    assert server.run(_spec(tmp_path, body), tmp_path / "log", dict(os.environ), 120) == 3
    return int(json.loads(out.read_text()))


@pytest.mark.usefixtures("slots")
def test_each_slot_is_a_server_of_its_own(tmp_path: Path) -> None:
    """A workload's timing processes are forked from several servers, which each import torch
    anew: children of two slots have two parents; a slot asked again is the same server."""
    first, second = forkserver.get(0), forkserver.get(1)
    assert first is not None and second is not None
    assert first.proc.pid != second.proc.pid
    assert forkserver.get(1) is second
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _parent_of(first, tmp_path / "a") == first.proc.pid
    assert _parent_of(second, tmp_path / "b") == second.proc.pid
    assert [forkserver.slot_of(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]
    assert [forkserver.slot_of(i, 1) for i in range(3)] == [0, 0, 0]


@pytest.mark.usefixtures("slots")
def test_warm_starts_servers_in_the_background_inside_hold() -> None:
    import contextlib
    import threading

    held = threading.Event()
    release = threading.Event()

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        held.set()
        release.wait(60)
        yield

    started = time.monotonic()
    forkserver.warm([1], hold)
    assert time.monotonic() - started < 1.0  # returns at once
    assert held.wait(120)
    assert 0 in forkserver._SERVERS  # the stages' server first, its import not slowed
    assert 1 not in forkserver._SERVERS  # the import waits for what it holds
    release.set()
    _wait_until(lambda: 1 in forkserver._SERVERS, 120)
    warmed = forkserver._SERVERS[1]
    assert forkserver.get(1) is warmed  # the recapture's timing process finds it running
    forkserver.warm([1], hold)  # already running: left as it is
    assert forkserver._SERVERS[1] is warmed


@pytest.mark.usefixtures("slots")
def test_a_slot_that_cannot_start_falls_back_to_server_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    first = forkserver.get(0)
    assert first is not None

    def refuse() -> forkserver.ForkServer:
        raise OSError("the fork server did not start: a test")

    monkeypatch.setattr(forkserver, "ForkServer", refuse)
    assert forkserver.get(2) is first
    assert "fork server 2: the fork server did not start: a test; using server 0" in (
        capsys.readouterr().err
    )
    assert forkserver.get(0) is first  # stages go on being forked


def test_host_work_holds_the_cpu_lock_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork server's import counts as a compile: a quiet measurement (the ``.cpu`` file
    taken exclusively) waits until it ends."""
    import fcntl

    from pytest_opprof import devicelock

    lock = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(lock))
    probe = os.open(tmp_path / "gpu.lock.cpu", os.O_RDWR | os.O_CREAT, 0o666)

    def quiet_now() -> bool:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(probe, fcntl.LOCK_UN)
        return True

    try:
        with devicelock.host_work():
            assert not quiet_now()
        assert quiet_now()
        monkeypatch.delenv(devicelock.LOCK_ENV)
        with devicelock.host_work():  # no lock named: nothing held
            assert quiet_now()
    finally:
        os.close(probe)


@pytest.mark.usefixtures("slots")
def test_a_server_outlives_the_thread_that_asked_for_it() -> None:
    """The server dies with the thread that started it (``PR_SET_PDEATHSIG``): a server asked
    for by a thread that ends (a warming thread, the recapture's pool) still serves after."""
    import threading

    asked: list[forkserver.ForkServer | None] = []
    thread = threading.Thread(target=lambda: asked.append(forkserver.get(1)))
    thread.start()
    thread.join(120)
    server = asked[0]
    assert server is not None
    time.sleep(1.0)  # the kernel's signal, were it sent, has arrived
    assert server.alive()
    assert forkserver.get(1) is server


def test_a_server_that_dies_starting_says_what_it_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that exits before "ready" (say, its imports fail): an OSError carrying the
    end of its log, for the caller's fallback to fresh interpreters."""

    real = subprocess.Popen

    def dies(args: list[str], **kwargs: Any) -> Any:
        script = "import sys; sys.stderr.write('no torch here\\n'); sys.exit(3)"
        return real([sys.executable, "-c", script], **kwargs)

    monkeypatch.setattr(forkserver.subprocess, "Popen", dies)
    with pytest.raises(OSError, match="did not start: no torch here"):
        forkserver.ForkServer()
