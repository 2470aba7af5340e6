"""Shared test settings: tiny workloads and fast timing for the CPU."""

from __future__ import annotations

import os

import pytest

# Inductor on 2 CPU cores: keep compile threads low so tests do not oversubscribe.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
