"""What a whole-model CUDA graph's call costs when it hands out its recorded outputs against
when it clones them (backend.model_graph), on a small host-bound model and on one with a 51 MB
output: per-call latency of back-to-back calls, paired rounds, medians. GPU only.

    python benchmarks/probes/model_graph_probe.py > model_graph_probe.json
"""

from __future__ import annotations

import json
import statistics

import torch

from pytest_opprof.backend.model_graph import ModelGraph


def _per_call_us(fn: ModelGraph, x: torch.Tensor, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def main() -> None:
    torch.manual_seed(0)
    cases = {
        "small output (64x256 fp32), host-bound": (
            torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()),
            torch.randn(64, 256),
        ),
        "51 MB output (4096x3136 fp32)": (
            torch.nn.Sequential(torch.nn.Linear(256, 3136), torch.nn.ReLU()),
            torch.randn(4096, 256),
        ),
    }
    results = {}
    with torch.no_grad():
        for name, (model, x) in cases.items():
            model, x = model.cuda().eval(), x.cuda()
            graphs = {
                "hand_out": ModelGraph(torch.compile(model)),
                "clone": ModelGraph(torch.compile(model)),
            }
            graphs["clone"]._release = False
            for g in graphs.values():
                for _ in range(5):
                    g(x)
            rounds: dict[str, list[float]] = {k: [] for k in graphs}
            for _ in range(15):
                for k, g in graphs.items():
                    rounds[k].append(_per_call_us(g, x, 200))
            results[name] = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
            results[name]["ratio clone/hand_out"] = round(
                statistics.median(
                    c / h for c, h in zip(rounds["clone"], rounds["hand_out"], strict=True)
                ),
                3,
            )
    print(json.dumps({"device": torch.cuda.get_device_name(), "us_per_call": results}, indent=2))


if __name__ == "__main__":
    main()
