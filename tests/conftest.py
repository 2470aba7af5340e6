"""Shared test settings: tiny workloads and fast timing for the CPU."""

from __future__ import annotations

import os

import pytest

# Inductor on 2 CPU cores: keep compile threads low so tests do not oversubscribe.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def fast_opprof_args() -> list[str]:
    """``pytest --opprof`` arguments for a quick run on the CPU fallback."""
    return [
        "--opprof-warmup-iters=1",
        "--opprof-measure-iters=2",
        "--opprof-rounds=3",
        "--opprof-device=cpu",
        "-p",
        "no:cacheprovider",
    ]


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
