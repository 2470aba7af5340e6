"""Probe: how fast can one bf16 GEMM that writes fp32 run on this GPU, and who picks the kernel?

The shape defaults to embedding_projection's logits (8192 x 512 @ 512 x 32000, weight stored
(N, K) as nn.Linear keeps it). Each variant is timed with CUDA events (median of ``--reps``
calls after warmup) and its kernels named by torch.profiler, so a run says whether Inductor's
autotuner (Triton templates, with and without persistent TMA), cuBLASLt as torch's preferred
library, or our own persistent TMA kernel (``persistent_mm.py``, autotuned over its tiles, with
and without warp specialization) beats cuBLAS for the fp32-output GEMM, and what the
bf16-output GEMM costs beside it. The ``_cuda_graph`` variants are replays of one captured
call, without the host's launch cost. Writes one JSON line per variant.

    python benchmarks/gemm_probe.py [--m 8192 --k 512 --n 32000] [--only a,b] > probe.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(fn: Callable[[], Any]) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})


def compiled(fn: Callable[..., Any], mode: str | None, **patches: Any) -> Callable[..., Any]:
    torch._dynamo.reset()
    with torch._inductor.config.patch(patches):
        c = torch.compile(fn, mode=mode, fullgraph=True)
        return c


def graphed(fn: Callable[..., Any], *args: torch.Tensor) -> Callable[..., Any]:
    """``fn`` on these arguments captured in one CUDA graph (warmed up first, so autotuning
    is over before the capture); the returned callable replays it and returns its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)

    def replay(*_: Any) -> torch.Tensor:
        graph.replay()
        return out

    return replay


def lt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with cuBLASLt as torch's preferred BLAS library while it runs."""

    def run(*args: Any) -> Any:
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return fn(*args)
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--n", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    args = parser.parse_args()
    m, k, n = args.m, args.k, args.n
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # nn.Linear's (out, in)

    def mm_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return aten.mm.dtype(x, weight.t(), torch.float32)

    def mm_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, weight.t())

    flops = 2 * m * k * n
    has_tma = hasattr(torch._inductor.config.triton, "enable_persistent_tma_matmul")
    variants: list[tuple[str, Callable[[], Callable[..., Any]]]] = [
        ("cublas_fp32_out", lambda: mm_fp32),
        ("cublas_bf16_out", lambda: mm_bf16),
        ("inductor_default_fp32_out", lambda: compiled(mm_fp32, None)),
        ("inductor_max_autotune_fp32_out", lambda: compiled(mm_fp32, "max-autotune-no-cudagraphs")),
        ("inductor_max_autotune_bf16_out", lambda: compiled(mm_bf16, "max-autotune-no-cudagraphs")),
    ]
    import persistent_mm  # beside this script

    def triton_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return persistent_mm.mm(x, weight.t(), torch.float32)

    specialized = persistent_mm.autotuned(warp_specialize=True)

    def triton_fp32_ws(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return persistent_mm.mm(x, weight.t(), torch.float32, specialized)

    def triton_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return persistent_mm.mm(x, weight.t(), torch.bfloat16)

    variants += [
        ("cublas_fp32_out_cuda_graph", lambda: graphed(mm_fp32, a, w)),
        ("cublaslt_fp32_out_cuda_graph", lambda: graphed(lt(mm_fp32), a, w)),
        ("opprof_persistent_tma_fp32_out_cuda_graph", lambda: graphed(triton_fp32, a, w)),
        ("opprof_ws_tma_fp32_out_cuda_graph", lambda: graphed(triton_fp32_ws, a, w)),
        ("opprof_persistent_tma_fp32_out", lambda: triton_fp32),
        ("opprof_persistent_tma_bf16_out", lambda: triton_bf16),
    ]
    if has_tma:
        variants.append(
            (
                "inductor_max_autotune_tma_fp32_out",
                lambda: compiled(
                    mm_fp32,
                    "max-autotune-no-cudagraphs",
                    **{"triton.enable_persistent_tma_matmul": True},
                ),
            )
        )
    if args.only:
        wanted = args.only.split(",")
        names = [v[0] for v in variants]
        variants = [v for v in variants if any(part in v[0] for part in wanted)]
        if not variants:
            raise SystemExit(f"--only {args.only}: no variant matches; they are {', '.join(names)}")
    reference = mm_fp32(a, w).float()
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(),
                "m": m,
                "k": k,
                "n": n,
                "persistent_tma_config": has_tma,
            }
        ),
        flush=True,
    )
    for name, make in variants:
        row: dict[str, Any] = {"variant": name}
        try:
            started = time.perf_counter()
            fn = make()
            patches = {"triton.enable_persistent_tma_matmul": True} if "tma" in name else {}
            with torch._inductor.config.patch(patches):
                out = fn(a, w)
                torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - started, 1)
                ms = median_ms(functools.partial(fn, a, w), args.reps)
                row["kernels"] = kernels(functools.partial(fn, a, w))
            row["ms"] = round(ms, 4)
            if name.startswith("opprof_"):
                tuner = specialized if "_ws_" in name else persistent_mm._mm_kernel
                row["best_config"] = str(tuner.best_config)
                timings = getattr(tuner, "configs_timings", None) or {}
                row["configs_ms"] = sorted(
                    (round(float(t[0] if isinstance(t, list | tuple) else t), 4), str(c))
                    for c, t in timings.items()
                )[:8]
            row["tflops"] = round(flops / ms / 1e9, 1)
            row["out_dtype"] = str(out.dtype)
            row["rel_err"] = float(
                (out.float() - reference).norm() / reference.norm().clamp_min(1e-30)
            )
        except Exception as exc:  # one variant's failure is its row, not the probe's end
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
