"""Probe: is the torch.compile baseline's per-process offset a property of the fork server?

The pipeline's stage processes are forked from one fork server per pytest process
(``pytest_opprof.forkserver``): a workload's timing processes share its address layout and
Python's hash seed, and a second pytest session (a retiming) gets a new server. On the H200
host conv_block's torch.compile call moved 5-6% between fresh processes that no host reference
tracked (docs/reproducibility.md, "What moves a launch-bound baseline"), and a retiming's ratios
moved more than the spread of one run's three processes predicts.

This probe starts S fork servers per condition, alternating the conditions, each importing
torch as the fork server does and forking C children one after another; each child compiles
conv_block's model (the Inductor cache answers all but the first), moves to the fastest CPU
as the timing pass does (``capture.timing.FastCpu``) and times R rounds of 30 calls between
CUDA events, with the host reference before each. Conditions:

- ``random``: as the pipeline starts its server (a new layout and hash seed per server);
- ``fixed``: ``PYTHONHASHSEED=0`` and, where ``setarch -R`` may run here, no address space
  randomisation: every server gets the same layout.

One JSON line per child (server, condition, medians, the server's addresses), then a summary:
per condition the spread of the children's medians within a server and of the servers' means.

    python benchmarks/probes/layout_probe.py [servers per condition, 4] [children, 3] [rounds, 200]

On the H200 host (``4 3 150``, benchmarks/results/h200-2026-12-02d/probes and its README) the
servers' means spread 2.9% where their children's spread predicts 1.6%, and servers with one
layout and hash seed still differed by 3%.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

CALLS = 30


def _addresses() -> dict[str, int]:
    import ctypes

    libc = ctypes.CDLL(None)
    return {
        "malloc": ctypes.cast(libc.malloc, ctypes.c_void_p).value or 0,
        "object": id(object()),
        "hash_ab": hash("ab"),
    }


def child(server: int, condition: str, index: int, rounds: int) -> dict[str, Any]:
    import torch

    from pytest_opprof.capture.timing import FastCpu, _one_round, host_reference_us
    from pytest_opprof.workload import load

    w = load(Path("examples/conv_block/conv_block.py"), "cuda")
    fn = torch.compile(w.model.eval())
    x = w.inputs
    ms, refs = [], []
    with torch.no_grad():
        for _ in range(50):
            fn(*x)
        torch.cuda.synchronize()
        FastCpu(any_cpu=True).move()
        cpu = sorted(os.sched_getaffinity(0))
        for _ in range(rounds):
            refs.append(host_reference_us())
            ms.append(_one_round(fn, x, "cuda", CALLS).ms)  # as the timing pass times a round
    ms_sorted = sorted(ms)
    return {
        "server": server,
        "condition": condition,
        "child": index,
        "cpu": cpu,
        "median_ms": round(statistics.median(ms), 5),
        "p10_ms": round(ms_sorted[len(ms) // 10], 5),
        "ref_us": round(statistics.median(refs), 3),
        "ms": [round(m, 5) for m in ms],
    }


def server(index: int, condition: str, children: int, rounds: int) -> None:
    """Imports what the fork server imports, as it does (CUDA's availability asked of NVML,
    which leaves the driver uninitialised), then forks the children one after another."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import importlib

    from pytest_opprof.forkserver import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)

    here = _addresses()
    for c in range(children):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                row = child(index, condition, c, rounds) | {"server_addresses": here}
            except BaseException:
                row = {"server": index, "condition": condition, "error": traceback.format_exc()}
            try:
                os.write(write, json.dumps(row).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        if text:
            print(text, flush=True)


def _setarch_works() -> bool:
    try:
        done = subprocess.run(
            ["setarch", platform.machine(), "-R", "true"], capture_output=True, check=False
        )
    except OSError:
        return False
    return done.returncode == 0


def _spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    servers: dict[int, list[float]] = {}
    for r in rows:
        servers.setdefault(r["server"], []).append(math.log(r["median_ms"]))
    within = [statistics.variance(v) for v in servers.values() if len(v) > 1]
    means = [statistics.fmean(v) for v in servers.values()]
    return {
        "servers": len(servers),
        "server_means_ms": [round(math.exp(m), 4) for m in means],
        "within_server_sd_pct": round(100 * math.sqrt(statistics.fmean(within)), 2)
        if within
        else None,
        "between_server_means_sd_pct": round(100 * statistics.stdev(means), 2)
        if len(means) > 1
        else None,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "server":
        server(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    servers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    children = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    norandom = _setarch_works()
    rows: list[dict[str, Any]] = []
    for s in range(servers):
        for condition in ("random", "fixed"):
            argv = [sys.executable, __file__, "server", str(s), condition, str(children)]
            argv.append(str(rounds))
            env = dict(os.environ)
            if condition == "fixed":
                env["PYTHONHASHSEED"] = "0"
                if norandom:
                    argv = ["setarch", platform.machine(), "-R", *argv]
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row = json.loads(line)
                    if "error" in row:
                        print(row["error"], file=sys.stderr, flush=True)
                        continue
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "ms"}), flush=True)
    summary = {"setarch_R": norandom} | {
        c: _spread([r for r in rows if r["condition"] == c]) for c in ("random", "fixed")
    }
    print(json.dumps({"summary": summary}), flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "layout_rounds.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
