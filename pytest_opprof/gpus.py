"""A GPU for each pytest-xdist worker, chosen before CUDA starts (no torch import here), and
its own share of the CPUs.

Workers beyond the number of GPUs share them round-robin: their stage processes compile side by
side and measure one at a time, under the GPU's lock (``devicelock``), which this module names
from the GPU's UUID.

The parent process never initialises CUDA (stages run in child processes), so setting
``CUDA_VISIBLE_DEVICES`` in a worker's ``pytest_configure`` is early enough for every child it
starts. An outer restriction is honoured: of the G GPUs already visible, worker ``gwK`` gets
the (K mod G)-th.

The CPUs are split too: a launch-bound timing depends on the CPU that launches the kernels,
which one worker's Inductor compile pool (a process per core) can take from the other worker's
timing loop, moving the torch.compile baselines and the speedups with them between runs
(docs/design-notes.md#cpu-slices-per-worker). Worker ``gwK`` is pinned to the K-th of N contiguous
slices of the CPUs this process may use, and Inductor's compile pool and OpenMP are sized to
that slice; every child process inherits both. Asked to (``OPPROF_COMPILE_POOL=host``),
Inductor's pool of compile workers alone reaches past it, onto every CPU the session had
(:data:`HOST_CPUS_ENV`), below normal priority (``stages.common.compile_pool_on_host``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Any

from pytest_opprof.devicelock import OWN_CPUS_ENV

HOST_CPUS_ENV = "OPPROF_HOST_CPUS"
"""The CPUs the session could use before it pinned its worker to a slice (comma-separated):
where the rung warmers run (``stages.rung_warmer.on_host_cpus``), and Inductor's compile
workers where asked (``stages.common.compile_pool_on_host``)."""


def onto_host() -> set[int] | None:
    """Move this thread (and the threads and processes it starts after) onto the CPUs of
    :data:`HOST_CPUS_ENV`; the CPUs it had, or None where it stays: nothing names more than
    its own (no pinned worker), the platform cannot pin, or a CPU named has since been taken
    from this process."""
    listed = os.environ.get(HOST_CPUS_ENV, "")
    if not listed or not hasattr(os, "sched_setaffinity"):
        return None
    host = {int(c) for c in listed.split(",") if c.strip().isdigit()}
    mine = os.sched_getaffinity(0)
    if not host - mine:
        return None
    try:
        os.sched_setaffinity(0, host)
    except OSError:
        return None
    return mine


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries."""
    env = os.environ if environ is None else environ
    outer = env.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return [d.strip() for d in outer.split(",") if d.strip() and d.strip() != "-1"]
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


def worker_gpu(worker_id: str, gpus: list[str]) -> str:
    """The GPU of xdist worker ``worker_id`` (``gw0``, ``gw1``, …): the K-th, round-robin."""
    index = int(worker_id.removeprefix("gw"))
    return gpus[index % len(gpus)]


def gpu_uuid(visible: str) -> str:
    """The UUID of the GPU a ``CUDA_VISIBLE_DEVICES`` entry names (the entry itself where it is
    one, or where nvidia-smi cannot tell): the name of its lock, the same for every session on
    the host whatever its outer restriction."""
    if visible.startswith(("GPU-", "MIG-")):
        return visible
    return _smi_first_line(["-i", visible, "--query-gpu=uuid", "--format=csv,noheader"]) or visible


def assign(device: str, workerinput: dict[str, Any] | None) -> None:
    """This process's GPU (an xdist worker's, round-robin) and CPU slice, and the lock its
    stage processes measure under (``devicelock``), all by environment for the children; the
    CPU slice also for this process."""
    from pytest_opprof.devicelock import LOCK_ENV, lock_path

    gpus = visible_gpus() if device != "cpu" else []
    if workerinput is not None:
        worker, count = workerinput["workerid"], int(workerinput["workercount"])
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = worker_gpu(worker, gpus)
        pin_worker(worker, count)  # timing never shares the CPU that launches kernels either
    if gpus:
        mine = os.environ.get("CUDA_VISIBLE_DEVICES", gpus[0]).split(",")[0].strip()
        os.environ[LOCK_ENV] = str(lock_path(gpu_uuid(mine)))


def nvidia_smi_query(field: str) -> str | None:
    """The first GPU's ``--query-gpu`` field from nvidia-smi, or None where it is absent or
    does not answer (no torch, no CUDA initialised)."""
    return _smi_first_line([f"--query-gpu={field}", "--format=csv,noheader"])


def _smi_first_line(args: list[str]) -> str | None:
    """The first line nvidia-smi prints for ``args``; None where it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


@functools.lru_cache(maxsize=8)
def gpu_kind(visible: str | None) -> str | None:
    """The model name of the first GPU a ``CUDA_VISIBLE_DEVICES`` value selects (``None``: the
    first GPU), by nvidia-smi; None where it cannot tell. Cached results key on this, not on the
    index: under pytest-xdist a workload lands on whichever worker's GPU is free, and two
    identical GPUs of one host give interchangeable results."""
    first = (visible or "0").split(",")[0].strip()
    if not first or first == "-1":
        return None
    return _smi_first_line(["-i", first, "--query-gpu=name", "--format=csv,noheader"])


def worker_cpus(worker_id: str, worker_count: int, cpus: list[int]) -> list[int]:
    """Worker ``gwK``'s slice: the K-th of ``worker_count`` contiguous, near-equal slices."""
    index = int(worker_id.removeprefix("gw"))
    per, extra = divmod(len(cpus), worker_count)
    start = index * per + min(index, extra)
    return cpus[start : start + per + (1 if index < extra else 0)]


def pin_worker(worker_id: str, worker_count: int) -> list[int] | None:
    """Pin this worker (and the processes it starts) to its CPU slice; None where the platform
    cannot or there are fewer CPUs than workers (then the workers share, as before)."""
    if not hasattr(os, "sched_setaffinity") or worker_count < 2:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < worker_count:
        return None
    mine = worker_cpus(worker_id, worker_count, cpus)
    os.sched_setaffinity(0, mine)
    os.environ[OWN_CPUS_ENV] = "1"  # its stage processes may compile beside a measurement
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:  # else the user's, kept everywhere
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(len(mine))
        os.environ[HOST_CPUS_ENV] = ",".join(map(str, cpus))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))
    return mine
