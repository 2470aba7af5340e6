"""Timing settings for the workloads under this folder.

These are large models, a second or more per call: the session's defaults (30 calls per
round, 15 rounds) would make the capture slow. Fewer calls per round and fewer rounds keep it
short; the speedup's confidence interval widens accordingly, which the gate accounts for (it
fails only when the whole interval lies below the threshold). A workload's own ``OPPROF``
timing keys are left alone.
"""

from __future__ import annotations


def pytest_opprof_timing_settings(workload, settings):
    if any(key in workload.overrides for key in settings):
        return None
    return {
        "warmup_iters": 2,
        "measure_iters": max(2, settings["measure_iters"] // 10),
        "rounds": 5,
    }
