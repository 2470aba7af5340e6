"""The timeline pass: torch.profiler over the measured iterations only.

Warmup (and with it compilation and autotuning) runs before the profiler starts, and the
profiler's own schedule drops one more warm step, so the trace holds exactly ``iterations``
calls, each inside a ``opprof::iteration#i`` mark that attribution uses as the window.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from pytest_opprof.capture.attribution import Twin, build_timeline
from pytest_opprof.capture.timing import synchronize
from pytest_opprof.capture.trace import ITERATION_MARK, load_trace
from pytest_opprof.schema import EdgeCaseFlag, Timeline


def capture_timeline(
    fn: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    *,
    device: str,
    label: str,
    compile_mode: str,
    warmup: int,
    iterations: int,
    trace_path: Path,
    provenance: dict[str, list[str]] | None = None,
    twin: Twin | None = None,
) -> tuple[Timeline, list[EdgeCaseFlag]]:
    """Profile ``iterations`` calls of ``fn`` and attribute them; ``twin`` places the kernels
    of CUDA-graph replays (``attribution.replay_twin``)."""
    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        synchronize(device)
        steps = schedule(wait=0, warmup=1, active=iterations, repeat=1)
        with profile(activities=activities, schedule=steps, record_shapes=True) as prof:
            for i in range(1 + iterations):
                with record_function(f"{ITERATION_MARK}#{i}"):
                    fn(*inputs)
                synchronize(device)
                prof.step()
    tmp = trace_path.with_name(f".{trace_path.name}.tmp")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(trace_path)
    trace = load_trace(trace_path)
    return build_timeline(
        trace,
        label=label,
        compile_mode=compile_mode,
        device_type="cuda" if device == "cuda" else "cpu",
        provenance=provenance,
        trace_file=trace_path.name,
        twin=twin,
    )
