"""Sibling processes that compile new graphs (selection and the stock task, side by side) keep
Inductor's pool of compile workers, started inside the siblings' compile lock, so its workers
never import torch beside a sibling's measurement; siblings whose compiles the caches answer
(a recapture's timing processes) compile in-process, as before."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile

from pytest_opprof import devicelock
from pytest_opprof.stages import common


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[devicelock.DeviceLock]:
    """This process's GPU lock, with siblings, held shared as a stage process holds it after
    ``devicelock.join``; ``compile_threads`` restored after the test."""
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join(siblings=str(tmp_path / "siblings.lock"))
    assert lock is not None and lock.held == "shared"
    try:
        with torch._inductor.config.patch(compile_threads=2):
            yield lock
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)
        common.configure(shares_cpus=False, own_cpus=False)


def test_new_compiles_beside_a_sibling_start_the_pool_inside_the_compile_lock(
    joined: devicelock.DeviceLock, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[str, bool, str | None, str | None]] = []

    def record(step: str) -> None:
        # while the pool starts: off the GPU, the siblings' lock and path.cpu held shared
        seen.append((step, joined.aside, joined.held, joined.siblings_held))
        probe = os.open(tmp_path / "siblings.lock", os.O_RDWR)
        try:  # a sibling's measurement could not start now
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)

    monkeypatch.setattr(AsyncCompile, "warm_pool", classmethod(lambda cls: record("warm")))
    monkeypatch.setattr(
        AsyncCompile, "wait_pool_ready", classmethod(lambda cls, timeout=120: record("ready"))
    )
    common.configure(shares_cpus=True, own_cpus=True, compile_pool=True)
    common.setup_torch()
    assert seen == [("warm", True, None, "shared"), ("ready", True, None, "shared")]
    assert torch._inductor.config.compile_threads == 2  # the slice's workers, kept
    assert joined.held == "shared" and not joined.aside and joined.siblings_held is None


def test_siblings_the_caches_answer_compile_in_process(
    joined: devicelock.DeviceLock, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    monkeypatch.setattr(AsyncCompile, "warm_pool", classmethod(lambda cls: started.append("warm")))
    common.configure(shares_cpus=True, own_cpus=True)
    common.setup_torch()
    assert started == [] and torch._inductor.config.compile_threads == 1


def test_a_torch_without_the_pool_s_calls_compiles_in_process(
    joined: devicelock.DeviceLock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(AsyncCompile, "wait_pool_ready")
    common.configure(shares_cpus=True, own_cpus=True, compile_pool=True)
    common.setup_torch()
    assert torch._inductor.config.compile_threads == 1
    assert joined.held == "shared" and not joined.aside


def test_a_pool_that_never_answers_leaves_the_process_compiling_in_process(
    joined: devicelock.DeviceLock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(cls: type, timeout: float = 120) -> None:
        raise TimeoutError("the pool did not answer")

    monkeypatch.setattr(AsyncCompile, "warm_pool", classmethod(lambda cls: None))
    monkeypatch.setattr(AsyncCompile, "wait_pool_ready", classmethod(never))
    common.configure(shares_cpus=True, own_cpus=True, compile_pool=True)
    common.setup_torch()
    assert torch._inductor.config.compile_threads == 1
    assert joined.held == "shared" and not joined.aside and joined.siblings_held is None


POOL_ON_HOST = """
import json, os, sys, time
from pathlib import Path
host = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, host[:1])  # the worker's slice: one CPU of the host
os.environ["OPPROF_HOST_CPUS"] = ",".join(map(str, host))
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the slice's, as gpus.pin_worker sets it
from pytest_opprof.stages import common
from torch._inductor.async_compile import AsyncCompile
workers = common.compile_pool_on_host()
seen = {"workers": workers, "mine": sorted(os.sched_getaffinity(0))}
if workers:
    sidecar = AsyncCompile.process_pool().process.pid
    AsyncCompile.wakeup()  # the sidecar forks its workers
    deadline, forked = time.monotonic() + 60, []
    while len(forked) < workers and time.monotonic() < deadline:
        time.sleep(0.2)
        forked = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                  and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(sidecar)]
    seen["procs"] = [(sorted(os.sched_getaffinity(p)), os.getpriority(os.PRIO_PROCESS, p))
                     for p in [sidecar, *forked]]
print(json.dumps(seen))
"""


def _pool_on_host(environ: dict[str, str]) -> dict[str, object]:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", POOL_ON_HOST],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **environ},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin to one",
)
def test_a_pinned_process_s_compile_workers_run_on_the_whole_host_below_normal_priority() -> None:
    """Asked to, the stage process stays on its slice (its measurements launch from it) and
    Inductor's workers, sized past the slice, may use every CPU the session had, niced."""
    host = sorted(os.sched_getaffinity(0))
    seen = _pool_on_host({common.COMPILE_POOL_ENV: "host"})
    assert seen["mine"] == host[:1]
    assert seen["workers"] == min(len(host), common.POOL_PER_SLICE_CPU)
    procs = seen["procs"]
    assert isinstance(procs, list) and len(procs) == 1 + int(str(seen["workers"]))
    for cpus, nice in procs:  # the sidecar and each worker it forked
        assert cpus == host and nice == common.POOL_NICE


def test_by_default_the_workers_start_as_inductor_starts_them() -> None:
    seen = _pool_on_host({common.COMPILE_POOL_ENV: ""})
    assert seen["workers"] is None and "procs" not in seen
