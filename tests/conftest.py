"""Shared test settings: tiny workloads and fast timing for the CPU."""

from __future__ import annotations

import os
from typing import Any

import pytest

# Inductor on 2 CPU cores: keep compile threads low so tests do not oversubscribe.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture
def make_proposal() -> Any:
    """A factory of minimal valid proposals: ``make_proposal(id, type, ir_level="functional",
    **fields)``."""
    from pytest_opprof.schema import Evidence, Impact, Proposal

    def make(pid: str, kind: str, level: str = "functional", **kw: Any) -> Proposal:
        return Proposal(
            id=pid,
            type=kind,
            ir_level=level,  # type: ignore[arg-type]
            targets=["x"],
            evidence=[Evidence(metric="m", value=1, source="graph.json")],
            fx_steps=["s"],
            impact=Impact(estimated_saving_us=1.0, estimated_speedup=1.1, basis="b"),
            confidence=kw.pop("confidence", "high"),
            **kw,
        )

    return make


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
