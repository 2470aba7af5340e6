"""Probe: does any cuBLASLt algorithm beat the one torch's cuBLAS call picks for a bf16 GEMM
(embedding_projection's logits, writing fp32, by default)?

torch runs the first algorithm cuBLAS's heuristic names; nothing in torch lists the others.
This asks the heuristic for up to ``--algos`` candidates for ``out[M, N] = a[M, K] @ w[N, K].T``
through ``pytest_opprof.backend.cublaslt`` (ctypes on the libcublasLt torch loaded) and times
each inside a CUDA graph of ``--calls`` back-to-back calls beside torch's own ``mm`` /
``mm.dtype`` (median of ``--reps`` replays), naming each one's kernels with torch.profiler.
Each is also timed as a model's graph runs it (``behind_ms``): every call behind a kernel that
writes its input ``a`` (a copy), less the copies alone; ``gaps_us`` is the GPU's idle time
before each of the call's kernels and memsets in one replay of that graph. Writes JSON lines.

    python benchmarks/probes/cublaslt_algos.py [--m 8192 --k 512 --n 32000 --out float32] > a.jsonl
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from gemm_probe import graphed, kernels, median_ms  # beside this file
from sdpa_probe import activities

from pytest_opprof.backend import cublaslt


def graphed_ms(fn: Callable[[], Any], calls: int, reps: int) -> float:
    """Median per-call time of ``calls`` back-to-back ``fn()`` captured in one CUDA graph."""

    def back_to_back() -> None:
        for _ in range(calls):
            fn()

    return median_ms(graphed(back_to_back), reps) / calls


CONFIG = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
"""``cublasLtMatmulAlgoConfigAttributes_t``: the candidate's configuration, as read back."""


def config(lib: Any, algo: Any) -> dict[str, int]:
    out = {}
    for name, attr in CONFIG.items():
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written)
        )
        if status == 0:
            out[name] = value.value
    return out


def behind_ms(fn: Callable[[], Any], produce: Callable[[], Any], calls: int, reps: int) -> float:
    """Per-call time of ``fn()`` where each call follows ``produce()`` in one CUDA graph (as a
    GEMM follows the kernel that writes its input in a model's graph), less ``produce`` alone."""

    def paired() -> None:
        for _ in range(calls):
            produce()
            fn()

    def alone() -> None:
        for _ in range(calls):
            produce()

    return (median_ms(graphed(paired), reps) - median_ms(graphed(alone), reps)) / calls


def gaps_us(fn: Callable[[], Any], produce: Callable[[], Any]) -> list[list[Any]]:
    """[name, idle µs before it, µs] of each GPU activity of one replay of ``produce(); fn()``
    captured in a CUDA graph, in order (``sdpa_probe.activities``)."""

    def paired() -> None:
        produce()
        fn()

    replay = graphed(paired)
    replay()
    torch.cuda.synchronize()
    return [[name, gap, us] for name, us, gap in activities(SimpleNamespace(replay=replay))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=32000)
    parser.add_argument("--out", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--algos", type=int, default=64)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    out_dtype = getattr(torch, args.out)
    torch.manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) / args.k**0.5
    b = w.t()
    out = torch.empty(args.m, args.n, device="cuda", dtype=out_dtype)
    a_src = a.clone()

    def produce() -> None:
        a.copy_(a_src)

    reference = cublaslt.reference_mm(a, b, out_dtype).float()
    flops = 2 * args.m * args.k * args.n
    shape = {"m": args.m, "k": args.k, "n": args.n, "out_dtype": args.out}
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()} | shape))

    def emit(row: dict[str, Any], fn: Callable[[], Any]) -> None:
        ms = graphed_ms(fn, args.calls, args.reps)
        row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        row |= {"behind_ms": round(behind_ms(fn, produce, args.calls, args.reps), 4)}
        row |= {"gaps_us": gaps_us(fn, produce)}
        print(json.dumps(row | {"kernels": kernels(fn)}), flush=True)

    emit({"variant": "torch"}, lambda: cublaslt.reference_mm(a, b, out_dtype))
    tuner = cublaslt._tuner(a.device)
    if not tuner._start() or tuner.libs is None:
        raise SystemExit("libcublasLt is not loaded in this process")
    a_op, b_op = cublaslt._column_major(a), cublaslt._column_major(b)
    assert a_op is not None and b_op is not None
    problem = cublaslt._Problem(
        tuner.libs.lt,
        tuner.handle,
        b_op,
        a_op,
        args.m,
        args.n,
        cublaslt._CUDA_TYPES[a.dtype],
        cublaslt._CUDA_TYPES[out_dtype],
        (cublaslt._alignment(b), cublaslt._alignment(a), 256),
    )
    candidates = problem.heuristics(args.algos)
    print(json.dumps({"heuristics_returned": len(candidates)}), flush=True)
    for index, algo in enumerate(candidates):
        row: dict[str, Any] = {"variant": f"lt_heuristic_{index}"}
        row |= {"workspace": algo.workspace_size, "waves": round(algo.waves, 2)}
        row |= {"config": config(tuner.libs.lt, algo.algo)}

        def lt_mm(algo: Any = algo) -> None:
            problem.run(a, b, out, algo, tuner.workspace)

        try:
            lt_mm()
            torch.cuda.synchronize()
        except cublaslt.CublasLtError as error:
            print(json.dumps(row | {"error": str(error)}), flush=True)
            continue
        row["rel_err"] = float((out.float() - reference).norm() / reference.norm())
        emit(row, lt_mm)
    # What the op itself keeps for this shape, tuned as the pipeline tunes it.
    cublaslt.tuned_mm(a, b, out_dtype)
    print(json.dumps({"tuned": cublaslt.choices()[-1].describe()}), flush=True)


if __name__ == "__main__":
    main()
