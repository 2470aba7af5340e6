"""Probe: what moves a launch-bound call's speed on the GPU host — its neighbours, or its heap?

Two questions about the host-bound baselines whose speedups do not reproduce within ±3%:

1. ``neighbours``: stage processes now compile on their own CPU slices while another process
   measures (``devicelock.off_gpu``). One process, pinned to the first of seven worker slices
   (``gpus.worker_cpus``), times conv_block's eager call (launch-bound) and its model on CPU
   tensors (dispatch only) in phases: the other CPUs idle, then each of them spinning in a
   process of its own (the worst a neighbour's compile can do), idle, spinning again.
2. ``heap``: the same call in fresh processes differs by up to 2x and is steady within each.
   Half the processes here start with glibc's malloc asking for transparent huge pages
   (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``), half without, alternating. Where the spread is
   TLB misses on a process's heap, the first half agree.

Prints the CPU topology (``lscpu -e``), the transparent-huge-page settings, then one JSON line
per phase or process: medians per call of 15 rounds.

    python benchmarks/probes/host_probe.py [processes per heap setting, default 5]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch_probe import PRELUDE  # benchmarks/probes/, this script's folder

CHILD = (
    PRELUDE
    + r"""
def eager_ms(model, x, rounds=15, calls=50):
    out = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            model(x)
        e.record(); e.synchronize()
        out.append(s.elapsed_time(e) / calls)
    return statistics.median(out)

cpu_model = __import__("copy").deepcopy(model).to("cpu")
tiny = torch.randn(1, *x.shape[1:2], 8, 8)
with torch.no_grad():
    for _ in range(50):
        model(x)
    torch.cuda.synchronize()
    def row():
        return {"cpu_dispatch_us": round(median_of(lambda: cpu_model(tiny), calls=100) * 1e6, 1),
                "eager_ms": round(eager_ms(model, x), 4)}
    if sys.argv[1] == "once":
        print(json.dumps(row()), flush=True)
    else:  # phases, told by the parent on stdin
        for line in sys.stdin:
            print(json.dumps({"phase": line.strip(), **row()}), flush=True)
"""
)

SPIN = "while True:\n    sum(i * i for i in range(10000))\n"


def topology() -> None:
    for cmd in (["lscpu", "-e=CPU,CORE,SOCKET,NODE"], ["nproc"]):
        try:
            print(subprocess.run(cmd, capture_output=True, text=True, check=False).stdout)
        except OSError as exc:
            print(f"{cmd[0]}: {exc}")
    for name in ("enabled", "defrag"):
        path = Path("/sys/kernel/mm/transparent_hugepage") / name
        text = path.read_text().strip() if path.exists() else "absent"
        print(f"transparent_hugepage/{name}: {text}")
    print("glibc", os.confstr("CS_GNU_LIBC_VERSION"), flush=True)


def neighbours() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pytest_opprof.gpus import worker_cpus

    cpus = sorted(os.sched_getaffinity(0))
    mine = worker_cpus("gw0", 7, cpus)
    others = [c for c in cpus if c not in mine]
    print(f"measurer on CPUs {mine}; spinners on {others}", flush=True)
    measurer = subprocess.Popen(
        ["taskset", "-c", ",".join(map(str, mine)), sys.executable, "-c", CHILD, "phases"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert measurer.stdin is not None and measurer.stdout is not None
    for phase in ("idle", "spinning", "idle", "spinning", "idle"):
        spinners = []
        if phase == "spinning":
            spinners = [
                subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", SPIN])
                for c in others
            ]
            time.sleep(1.0)
        measurer.stdin.write(phase + "\n")
        measurer.stdin.flush()
        print(measurer.stdout.readline().strip(), flush=True)
        for s in spinners:
            s.kill()
            s.wait()
    measurer.stdin.close()
    measurer.wait()


def heap(n: int) -> None:
    for i in range(2 * n):
        huge = i % 2 == 0
        env = dict(os.environ)
        if huge:
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        out = subprocess.run(
            [sys.executable, "-c", CHILD, "once"], env=env, capture_output=True, text=True
        )
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
        print(json.dumps({"malloc_hugetlb": huge, "result": line}), flush=True)


def main(argv: list[str]) -> int:
    topology()
    neighbours()
    heap(int(argv[0]) if argv else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
