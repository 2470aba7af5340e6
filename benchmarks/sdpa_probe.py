"""Probe: which SDPA backend is fastest inside a CUDA graph, and what does each one launch?

On the H200 the optimized gpt2 replays twelve cuDNN attentions, each preceded by a
``Memset (Device)`` that the CUDA graph runs on the copy engine: the GPU idles about 1 µs before
it and 3.5 µs after it, 12 times a call (tests/data/h200/gpt2.optimized.trace.json.gz). This
probe times one attention block (QKV projection, SDPA, output projection, in bf16) per backend
(cuDNN, flash, memory-efficient), eager and compiled by Inductor with the backend chosen while
it traces, each replayed as one CUDA graph of ``--layers`` blocks in a row, and names every GPU
activity of one replay with the idle time before it. One JSON line per variant.

    python benchmarks/sdpa_probe.py > sdpa_probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch._functorch.config
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
SHAPES = {  # name: (batch, heads, seq, head_dim, causal)
    "gpt2": (4, 12, 128, 64, True),
    "sdpa_attention": (8, 8, 512, 64, False),
}


class Block(torch.nn.Module):
    def __init__(self, heads: int, dim: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, layers: int) -> Any:
    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            t = fn(t)
        return t

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            chain(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x)
    return g, out


def replay_ms(g: Any, reps: int, rounds: int) -> tuple[float, list[float]]:
    per = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / reps)
    return statistics.median(per), [round(p, 5) for p in per]


def activities(g: Any) -> list[tuple[str, float, float]]:
    """(name, µs, idle µs before it) of each GPU activity of one replay."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    evs = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    out, prev = [], None
    for e in evs:
        gap = 0.0 if prev is None else e.time_range.start - prev
        out.append((e.name[:60], round(e.time_range.elapsed_us(), 2), round(gap, 2)))
        prev = e.time_range.end
    return out


def setup() -> argparse.Namespace:
    """The probes' options (``--layers`` blocks per graph, ``--reps`` replays per round,
    ``--rounds``), AOTAutograd's cache off, and the header line naming torch and the GPU."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shapes", default="", help="comma-separated shape names (all if empty)")
    args = parser.parse_args()
    # AOTAutograd's cache keys on the Dynamo graph, not on the SDPA backend flags: a hit would
    # serve the first backend's graph to the others
    torch._functorch.config.enable_autograd_cache = False
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)
    return args


def measured(g: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One variant's figures from its CUDA graph of ``--layers`` blocks (``graphed``): the
    median replay (ms) and each round's, and one replay's GPU activities: their µs, the idle
    µs before them, and those of the first layer by name."""
    ms, per = replay_ms(g, args.reps, args.rounds)
    acts = activities(g)
    return {
        "ms": round(ms, 5),
        "rounds_ms": per,
        "kernels_us": round(sum(a[1] for a in acts), 2),
        "idle_us": round(sum(a[2] for a in acts), 2),
        "per_layer": acts[: max(1, len(acts) // args.layers)],
    }


def main() -> None:
    args = setup()
    for shape, (b, h, s, d, causal) in SHAPES.items():
        torch.manual_seed(0)
        block = Block(h, h * d, causal).cuda().to(torch.bfloat16).eval()
        x = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            reference = block(x).float()
        for mode in ("eager", "inductor"):
            for name, backend in BACKENDS.items():
                row: dict[str, Any] = {"shape": shape, "mode": mode, "backend": name}
                try:
                    with torch.no_grad():
                        started = time.perf_counter()
                        if mode == "inductor":
                            torch._dynamo.reset()
                            fn = torch.compile(block, fullgraph=True)
                            with sdpa_kernel(backend):  # the choice is made while tracing
                                fn(x)
                        else:
                            fn = block
                        with sdpa_kernel(backend) if mode == "eager" else nullcontext():
                            err = (fn(x).float() - reference).norm() / reference.norm()
                            g, _ = graphed(fn, x, args.layers)
                        row["build_s"] = round(time.perf_counter() - started, 1)
                        row.update(rel_err=float(err), **measured(g, args))
                except Exception as exc:  # one variant's failure is its row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
