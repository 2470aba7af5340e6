"""Probe: how long does a max-autotune compile hold the GPU alone, and how much of it is timing?

The stock baseline compiles each recipe with ``mode="max-autotune"``: Inductor times every
template choice and Triton config on the GPU, and the pipeline gives each timing the GPU alone
(``stages.common.autotuning``). Held alone over one op's whole autotuning (``--holds coarse``,
the pipeline at f7d10fd), a hold also spans the choices' kernels loaded, built or fetched from
the compile workers; held alone over each whole timing call (``--holds calls``, b35da0f), it
spans the timed callable's first call, which builds or loads its kernel; held alone only around
the timing (``--holds op-shared``, a08d4795: that first call shares the GPU, as does the op's
whole autotuning around it), neither; shared one step at a time (``--holds steps``, 72b8cd6:
an op's inputs, each choice, each Triton config), the compile holds nothing between two steps,
so another process's measurement waits for one step, not for the op, but each timing asks
for the GPU alone; and with an op warmed that way, then timed alone as a whole (``--holds
fine``, the pipeline's now), one ask per op. Every mode but ``fine`` runs an op's autotuning
once, as Inductor does.

One process compiles the ``cast`` stock recipe (bf16, freezing, max-autotune) of one workload as
the stock task does (off the GPU, under the GPU's lock, with Inductor's compile workers), while a
neighbour thread asks for the GPU alone every 0.5 s and measures for 50 ms, as another
workload's measurements do. Prints one JSON line: the compile's seconds; its holds (count,
total, longest); the seconds inside Inductor's timings, in its whole timing calls (with the
first call the pipeline makes beside the GPU's other work, and the waits for the GPU), and in
the choices' kernel loads; the neighbour's waits for the GPU (count, median, longest). Run each
mode in a fresh process with empty Inductor and Triton caches:

    python benchmarks/probes/autotune_holds.py examples/mlp_activations --holds fine
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timed(into: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return run


def neighbour(path: Path, stop: threading.Event, waits: list[float]) -> None:
    """Another workload's measurements: the GPU alone for 50 ms every 0.5 s."""
    import torch

    from pytest_opprof.devicelock import DeviceLock

    lock = DeviceLock(path)
    a = torch.randn(2048, 2048, device="cuda")
    try:
        while not stop.wait(0.5):
            t0 = time.perf_counter()
            lock.exclusive()
            waits.append(time.perf_counter() - t0)
            until = time.perf_counter() + 0.05
            while time.perf_counter() < until:
                a @ a
                torch.cuda.synchronize()
            lock.release()
    finally:
        lock.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", type=Path, help="a workload folder or file")
    parser.add_argument(
        "--holds", choices=("coarse", "calls", "op-shared", "steps", "fine"), required=True
    )
    args = parser.parse_args()

    import os

    from pytest_opprof import devicelock

    folder = Path(tempfile.mkdtemp(prefix="autotune-holds-"))
    os.environ[devicelock.LOCK_ENV] = str(folder / "gpu.lock")
    notes: list[str] = []
    lock = devicelock.join(note=notes.append, siblings=str(folder / "siblings.lock"))
    assert lock is not None

    import torch
    from torch._inductor import autotune_process, select_algorithm
    from torch._inductor.runtime import benchmarking, triton_heuristics

    from pytest_opprof.backend import stock
    from pytest_opprof.stages import common
    from pytest_opprof.workload import load

    common.configure(shares_cpus=True, own_cpus=True, compile_pool=True)  # as the stock task
    common.setup_torch()
    path = args.workload
    w = load(path / f"{path.name}.py" if path.is_dir() else path, "cuda")
    torch.cuda.synchronize()

    timing: list[float] = []
    loads: list[float] = []
    bench = benchmarking.benchmarker
    for name in ("benchmark_gpu", "benchmark_gpu_with_cuda_graph"):
        if callable(getattr(bench, name, None)):  # inside the lock's wrap
            setattr(bench, name, timed(timing, getattr(bench, name)))
    request = autotune_process.TritonBenchmarkRequest
    request.make_run_fn = timed(loads, request.make_run_fn)  # type: ignore[method-assign]

    stop, waits = threading.Event(), []  # type: ignore[var-annotated]
    other = threading.Thread(target=neighbour, args=(Path(lock.path), stop, waits))
    other.start()
    try:
        fn = stock.Compiled("cast", w.model, w.inputs, "bfloat16")
        cache = select_algorithm.AlgorithmSelectorCache
        once = vars(cache)["benchmark_in_current_process"]
        with common.autotuning("cuda"):
            undo: list[tuple[Any, str, Any]] = []
            if args.holds != "fine":  # the op autotuned once, its steps' holds kept
                undo.append(
                    (
                        cache,
                        "benchmark_in_current_process",
                        vars(cache)["benchmark_in_current_process"],
                    )
                )
                cache.benchmark_in_current_process = once  # type: ignore[method-assign]
            calls: list[float] = []  # whole calls: the first call, the lock's waits, the timing
            for name in ("benchmark_gpu", "benchmark_gpu_with_cuda_graph"):
                if name in vars(bench):
                    undo.append((bench, name, vars(bench)[name]))
                    setattr(bench, name, timed(calls, vars(bench)[name]))
            alone_over = {
                # one op's whole autotuning alone, outside the pipeline's wraps
                "coarse": (
                    (select_algorithm.AlgorithmSelectorCache, "benchmark_in_current_process"),
                    (triton_heuristics.CachingAutotuner, "benchmark_all_configs"),
                ),
                # each whole timing call alone, its first call included
                "calls": tuple(
                    (bench, name)
                    for name in ("benchmark_gpu", "benchmark_gpu_with_cuda_graph")
                    if name in vars(bench)
                ),
            }.get(args.holds, ())
            # one op's whole autotuning shared, its steps' own holds inside it
            shared_over = {
                "op-shared": (
                    (select_algorithm.AlgorithmSelectorCache, "benchmark_in_current_process"),
                    (triton_heuristics.CachingAutotuner, "benchmark_all_configs"),
                )
            }.get(args.holds, ())
            holds = [(o, n, devicelock.measuring_within) for o, n in alone_over]
            holds += [(o, n, devicelock.on_gpu) for o, n in shared_over]
            for owner, name, hold in holds:
                found = vars(owner)[name]
                inner = found.__func__ if isinstance(found, classmethod) else found

                def held(*a: Any, _inner: Any = inner, _hold: Any = hold, **k: Any) -> Any:
                    with _hold(torch.cuda.synchronize):
                        return _inner(*a, **k)

                setattr(owner, name, classmethod(held) if inner is not found else held)
                undo.append((owner, name, found))
            t0 = time.perf_counter()
            with torch.no_grad():
                fn(*w.inputs)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            for owner, name, found in reversed(undo):
                setattr(owner, name, found)
    finally:
        stop.set()
        other.join()
    holds = [
        float(n[len(devicelock.MEASURED) :].split()[0])
        for n in notes
        if n.startswith(devicelock.MEASURED)
    ]
    print(
        json.dumps(
            {
                "workload": path.name,
                "holds_mode": args.holds,
                "torch": torch.__version__,
                "compile_s": round(compile_s, 2),
                "holds": len(holds),
                "held_alone_s": round(sum(holds), 2),
                "longest_hold_s": round(max(holds, default=0.0), 3),
                "holds_over_1s": sum(h > 1 for h in holds),
                "timings": len(timing),
                "timing_s": round(sum(timing), 2),
                "timing_calls_s": round(sum(calls), 2),
                "loads": len(loads),
                "load_s": round(sum(loads), 2),
                "neighbour_takes": len(waits),
                "neighbour_wait_median_s": round(statistics.median(waits), 3) if waits else None,
                "neighbour_wait_max_s": round(max(waits, default=0.0), 3),
                "neighbour_waited_s": round(sum(waits), 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
