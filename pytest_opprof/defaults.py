"""The plugin's own implementations of its decision hooks (``hookspecs.py``), each ``trylast``
so that a conftest's answer comes first. Registered by the plugin in a pytest session and by
``pipeline.default_hooks`` where there is none (the ``opprof`` command), so both decide alike.
Importing it imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_opprof.pipeline import WorkloadRun
    from pytest_opprof.schema import Timing


@pytest.hookimpl(trylast=True)
def pytest_opprof_select_baseline(workload: WorkloadRun, timing: Timing) -> str | None:
    """``--opprof-baseline`` / ``OPPROF['baseline']``: eager, compile, or best (the faster)."""
    choice = str(workload.base_setting("baseline"))
    if choice != "best":
        return choice
    v = timing.variants
    return "eager" if v["eager"].median_ms < v["compile"].median_ms else "compile"


@pytest.hookimpl(trylast=True)
def pytest_opprof_min_speedup(workload: WorkloadRun, min_speedup: float) -> float | None:
    return min_speedup


@pytest.hookimpl(trylast=True)
def pytest_opprof_timing_settings(
    workload: WorkloadRun, settings: dict[str, int]
) -> dict[str, int] | None:
    return settings
