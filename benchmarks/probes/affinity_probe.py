"""Probe: does the CPU a host-bound timing runs on move its latency?

Times two launch-bound eager workloads of examples/ (lstm_sequence_encoder, conv_block) in fresh
processes: unpinned, and pinned (taskset) to each NUMA node's CPUs in turn, twice over, so the
spread between runs of one placement can be set beside the spread between placements. Prints
`nvidia-smi topo -m` (the GPU's CPU affinity) and one JSON line per process.

    python benchmarks/probes/affinity_probe.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import importlib.util, json, statistics, sys, torch
out = {}
for name in ("lstm_sequence_encoder", "conv_block"):
    spec = importlib.util.spec_from_file_location(name, f"examples/{name}/{name}.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    model, x = mod.get_model_and_input()
    with torch.no_grad():
        for _ in range(10):
            model(x)
        torch.cuda.synchronize()
        rounds = []
        for _ in range(15):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                model(x)
            e.record(); e.synchronize()
            rounds.append(s.elapsed_time(e) / 20)
    out[name] = {"median": round(statistics.median(rounds), 4),
                 "min": round(min(rounds), 4), "max": round(max(rounds), 4)}
print(json.dumps(out))
"""


def nodes() -> dict[str, str]:
    found = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        found[node.name] = (node / "cpulist").read_text().strip()
    return found


def main() -> None:
    print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout)
    placements = {"unpinned": None, **nodes()}
    print(json.dumps({"placements": placements, "cpus": os.cpu_count()}), flush=True)
    for attempt in range(2):
        for label, cpus in placements.items():
            cmd = [sys.executable, "-c", CHILD]
            if cpus:
                cmd = ["taskset", "-c", cpus, *cmd]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            line = done.stdout.strip().splitlines()[-1:] or [done.stderr[-300:]]
            row = {"attempt": attempt, "placement": label, "result": line[0]}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
