"""A speedup threshold for every workload under this folder (``strict/``).

pytest applies a conftest's hooks to the workloads under its folder, so this file demands
1.5x of the workloads here while those elsewhere keep ``--opprof-min-speedup`` (default 1.0).
A workload's own ``OPPROF = {"min_speedup": ...}`` still wins: the hook receives the value it
would get otherwise and keeps it when the workload set one.

Without a hook: ``opprof_min_speedup = 1.5`` in an ini file sets the session's default, and
``OPPROF = {"min_speedup": 1.5}`` in a workload sets one workload's.
"""

from __future__ import annotations

STRICT = 1.5


def pytest_opprof_min_speedup(workload, min_speedup):
    if "min_speedup" in workload.overrides:
        return None  # the workload chose its own: leave it to the plugin's default
    return STRICT
