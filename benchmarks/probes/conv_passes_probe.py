"""Probe: do ``conv_im2col`` and ``depthwise_taps`` beat cuDNN on the layers they are for?

Selection decides per workload, on the whole call; this probe asks it of the layers alone, so
that a rung dropped in a model can be told apart from a pass that loses on its own layer. Each
layer (a stem on RGB images, a patch embedding, depthwise blocks with their batch norm and
activation) is built in bf16, channels_last, eval mode, through the package's backend with
Inductor freezing and ``bn_fold``, once without the pass and once with it, each recorded in a
CUDA graph as the pipeline's whole-call graphs are. The two replay interleaved: R rounds of
50 replays between CUDA events, the median per replay of each, and the ratio of the medians.
Each variant's largest relative error against eager is recorded.

It may run beside a benchmark on the same GPU: it joins the package's GPU lock, so each of its
compiles lets go of the GPU as a stage's compile does (the benchmark's quiet measurements pause
it), and its timing rounds are quiet measurements (``pytest_opprof.devicelock``).

One JSON line per layer, then nothing else:

    python benchmarks/probes/conv_passes_probe.py [rounds, 30]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pytest_opprof import devicelock
from pytest_opprof.gpus import gpu_uuid

REPLAYS = 50


def layers() -> dict[str, tuple[str, Callable[[], nn.Module], tuple[int, ...]]]:
    """name → (the pass, the layer, its input shape): the shapes of the examples and models."""

    def dw_block(c: int, k: int, stride: int, act: nn.Module) -> nn.Module:
        conv = nn.Conv2d(c, c, k, stride, k // 2, groups=c, bias=False)
        return nn.Sequential(conv, nn.BatchNorm2d(c), act)

    return {
        "conv_block stem 3x3": (
            "conv_im2col",
            lambda: nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.ReLU()),
            (16, 3, 64, 64),
        ),
        "resnet18 stem 7x7/2": (
            "conv_im2col",
            lambda: nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()
            ),
            (32, 3, 224, 224),
        ),
        "vit_b16 patchify 16x16/16": (
            "conv_im2col",
            lambda: nn.Conv2d(3, 768, 16, 16),
            (8, 3, 224, 224),
        ),
        "depthwise 3x3 x32 @56": (
            "depthwise_taps",
            lambda: dw_block(32, 3, 1, nn.ReLU6()),
            (16, 32, 56, 56),
        ),
        "depthwise 3x3 x128 @56": (
            "depthwise_taps",
            lambda: dw_block(128, 3, 1, nn.ReLU6()),
            (16, 128, 56, 56),
        ),
        "depthwise 5x5/2 x72 @56": (
            "depthwise_taps",
            lambda: dw_block(72, 5, 2, nn.Hardswish()),
            (32, 72, 56, 56),
        ),
    }


def graphed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], Any]:
    """``fn(x)`` recorded in a CUDA graph after warming; the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    return graph.replay


def round_ms(replay: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPLAYS


def probe(
    name: str, kind: str, make: Callable[[], nn.Module], shape: tuple[int, ...], rounds: int
) -> dict[str, Any]:
    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    torch.manual_seed(0)
    model = make().eval().to("cuda", torch.bfloat16)
    model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    replays, statuses = {}, {}
    with torch.no_grad():
        want = model(x).float()
        for variant, aten in (("cudnn", ["bn_fold"]), (kind, ["bn_fold", kind])):
            torch._dynamo.reset()
            results: list[PassResult] = []
            backend = make_backend(aten=aten, config_patches={"freezing": True}, results=results)
            fn = torch.compile(model, backend=backend)
            with devicelock.off_gpu(torch.cuda.synchronize):  # the compile, as a stage's
                fn(x)
            got = fn(x).float()
            error = float(((got - want).abs() / (1 + want.abs())).max())
            statuses[variant] = {
                "passes": [f"{r.name}: {r.status} {r.detail}" for r in results],
                "max_rel_error": error,
            }
            replays[variant] = graphed(fn, x)
        times: dict[str, list[float]] = {v: [] for v in replays}
        with devicelock.measuring(quiet=True):
            for _ in range(rounds):
                for variant, replay in replays.items():
                    times[variant].append(round_ms(replay))
    medians = {v: statistics.median(t) for v, t in times.items()}
    return {
        "layer": name,
        "pass": kind,
        "input": list(shape),
        "median_ms": medians,
        "speedup": medians["cudnn"] / medians[kind],
        "checks": statuses,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    os.environ.setdefault(devicelock.LOCK_ENV, str(devicelock.lock_path(gpu_uuid(visible))))
    devicelock.join()
    for name, (kind, make, shape) in layers().items():
        try:
            row = probe(name, kind, make, shape, rounds)
        except Exception as exc:  # one layer's failure is its answer; the others still run
            row = {"layer": name, "pass": kind, "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
