"""What machine a capture ran on: device, versions, and a fingerprint for caching."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any


def resolve_device(requested: str) -> str:
    """``auto`` → ``cuda`` when a GPU is usable, else ``cpu`` (the fallback, docs/options.md)."""
    import torch

    if requested == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        from pytest_opprof.errors import StageError

        raise StageError(
            "--opprof-device=cuda but torch sees no CUDA device; use --opprof-device=auto for "
            "the CPU fallback, or install a CUDA build of torch"
        )
    return "cpu"


def environment(device: str) -> dict[str, Any]:
    """Device and software versions; no paths of this machine."""
    import torch

    info: dict[str, Any] = {
        "device_type": device,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "cuda_version": torch.version.cuda,
        "triton_version": _triton_version(),
        "device_name": platform.processor() or platform.machine(),
        "sm_count": None,
        "compute_capability": None,
        "driver": None,
        "visible_devices": None,
        "device_count": None,
        "device_uuid": None,
        "device_memory": None,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["device_name"] = props.name
        info["sm_count"] = props.multi_processor_count
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["device_memory"] = props.total_memory
        info["driver"] = _driver_version()
        # Which GPU this process measured, and how many it saw: the evidence that an xdist
        # worker owned exactly one.
        info["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        info["device_count"] = torch.cuda.device_count()
        uuid = getattr(props, "uuid", None)
        info["device_uuid"] = f"GPU-{uuid}" if uuid is not None else None
    else:
        info["device_name"] = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return info


def fingerprint(info: dict[str, Any]) -> str:
    keys = (
        "device_type",
        "device_name",
        "torch_version",
        "cuda_version",
        "triton_version",
        "driver",
    )
    blob = json.dumps({k: info.get(k) for k in keys}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return None


def _driver_version() -> str | None:
    from pytest_opprof.gpus import nvidia_smi_query

    return nvidia_smi_query("driver_version")


CpuTimes = dict[int, tuple[float, float]]
"""Per CPU of the host: its busy and its stolen seconds since boot (``/proc/stat``)."""


def cpu_times() -> CpuTimes | None:
    """Every CPU's busy and stolen seconds so far, from ``/proc/stat`` (Linux); None elsewhere
    or where it cannot be read. Busy is user, nice, system, irq and softirq time; stolen is the
    time the hypervisor ran something else while this vCPU wanted to run."""
    try:
        lines = Path("/proc/stat").read_text(encoding="ascii").splitlines()
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None
    out: CpuTimes = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            v = [int(x) for x in rest.split()]
        except ValueError:
            continue
        if len(v) < 8:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
        out[cpu] = ((user + nice + system + irq + softirq) / tick, steal / tick)
    return out or None


def host_window(before: CpuTimes | None, after: CpuTimes | None, seconds: float) -> Any:
    """What the host's CPUs did over ``seconds`` between two :func:`cpu_times` readings, split
    into this process's CPUs (its affinity) and the others: a ``schema.HostWindow``, or None
    where either reading is missing. ``/proc/stat`` counts in ticks (10 ms), so a window of a
    fraction of a second is coarse."""
    from pytest_opprof.schema import HostWindow

    if not before or not after or seconds <= 0:
        return None
    own = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(after)
    cpus = sorted(set(before) & set(after))

    def used(group: list[int], i: int) -> float:
        return sum(after[c][i] - before[c][i] for c in group) / seconds

    mine = [c for c in cpus if c in own]
    others = [c for c in cpus if c not in own]
    return HostWindow(
        seconds=seconds,
        own_cpus=len(mine),
        own_busy=used(mine, 0),
        own_steal=used(mine, 1),
        other_cpus=len(others),
        other_busy=used(others, 0),
        other_steal=used(others, 1),
    )
