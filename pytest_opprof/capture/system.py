"""What machine a capture ran on: device, versions, and a fingerprint for caching."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from typing import Any


def resolve_device(requested: str) -> str:
    """``auto`` → ``cuda`` when a GPU is usable, else ``cpu`` (the fallback of DESIGN §1)."""
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
