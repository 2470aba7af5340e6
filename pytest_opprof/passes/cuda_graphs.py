"""cuda_graphs (Inductor config): record the compiled graph as a CUDA graph (cudagraph trees) and
replay it, removing per-kernel launch overhead for launch-bound workloads. A no-op on the CPU;
Inductor skips graphs with CPU tensors, dynamic shapes or input mutation and says why."""

from __future__ import annotations

from typing import Any

from pytest_opprof.passes.base import supported_config


def config_patches(**_: Any) -> dict[str, Any]:
    # "triton.cudagraphs" is the key in torch 2.0 through 2.13.
    return supported_config({"triton.cudagraphs": True})
