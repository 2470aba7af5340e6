"""The pipeline's own benchmark (issue #39): how its wall time grows with the number of workloads.

Runs ``pytest --opprof`` on the first K workloads of a suite for each K in turn, each run from
empty Inductor and Triton caches (as on a fresh CI runner) and in a folder of its own, and
writes a table of, per K: the wall time, the workloads that finished, the seconds each added
workload cost past the first, the share of the wall time the GPU spent measuring (the stage
processes' exclusive holds of its lock, which never overlap on one GPU), the process-seconds
spent waiting for the GPU, and the wall time per stage summed over the workloads.

    python benchmarks/scaling.py models --counts 1,4,8,16 --out scaling [-- pytest args]
    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/scaling.py models --counts 8 --label "2 GPUs"
    python benchmarks/scaling.py --table a/scaling.json b/scaling.json --out merged

The runs (artifacts, compile caches) go under ``--work``; ``--out`` gets only the table
(``scaling.json``, ``scaling.md``), small enough to bring back from a lent GPU machine. Counts
run in separate calls (one run of 16 workloads can take a call's whole time) are put in one
table by ``--table``, their growth figures computed anew over all of them.

A suite is ``models`` (benchmarks/models), ``examples`` (the seven), or a folder of workload
folders (``NAME/NAME.py``). A count past the suite's size repeats its workloads as copies
named ``NAME_2``, ``NAME_3`` …: new workloads to the pipeline, whose compiles the caches filled
by the original may answer, so a count past the suite measures the pipeline's reuse too.
``--workers`` is pytest-xdist's ``-n`` (default: one per workload, at most ``--max-workers``).
Each run stops (SIGINT: its artifacts are still written) after ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _benchmark_module(name: str) -> Any:
    """benchmarks/NAME.py, loaded by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summarize() -> Any:
    """benchmarks/summarize.py, which reads the stage JUnit and the stage logs."""
    return _benchmark_module("summarize")


def suite_workloads(suite: str) -> list[Path]:
    """The suite's workload files, sorted by name."""
    folder = {"models": ROOT / "benchmarks" / "models", "examples": ROOT / "examples"}.get(
        suite, Path(suite)
    )
    if not folder.is_dir():
        raise SystemExit(f"scaling: no suite {suite!r}: name models, examples or a folder")
    found = sorted(
        d / f"{d.name}.py"
        for d in folder.iterdir()
        if d.is_dir() and (d / f"{d.name}.py").is_file()
    )
    if not found:
        raise SystemExit(f"scaling: {folder} holds no workload folder (NAME/NAME.py)")
    return found


def workloads_for(files: list[Path], count: int, into: Path) -> list[Path]:
    """The first ``count`` workloads, cycling through ``files``; the n-th repeat of a file is
    copied into ``into`` as ``NAME_n/NAME_n.py`` (a new name: a new workload to the pipeline)."""
    chosen: list[Path] = []
    for i in range(count):
        src = files[i % len(files)]
        turn = i // len(files) + 1
        if turn == 1:
            chosen.append(src)
            continue
        name = f"{src.stem}_{turn}"
        dest = into / name / f"{name}.py"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        chosen.append(dest)
    return chosen


def plugin_args() -> list[str]:
    """``-p pytest_opprof.plugin`` where the package is importable but not installed (a
    checkout on PYTHONPATH, as benchmarks/gpu_env.sh sets up on a GPU host); nothing where its
    entry point loads it already (naming it twice is an error)."""
    from importlib.metadata import entry_points

    installed = any(ep.value.startswith("pytest_opprof") for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "pytest_opprof.plugin"]


def run_point(
    files: list[Path], count: int, workers: int, folder: Path, budget: float, extra: list[str]
) -> dict[str, Any]:
    """One run of the pipeline on ``count`` workloads in ``folder`` (made empty first), from
    empty compile caches; its wall time and exit status."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    paths = workloads_for(files, count, folder / "workloads")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"),
        "TRITON_CACHE_DIR": str(folder / "triton-cache"),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:benchmark",
        *plugin_args(),
        "--opprof",
        *map(str, paths),
        f"--opprof-out={folder / 'run'}",
        f"--opprof-junit={folder / 'opprof-junit.xml'}",
        "-n",
        str(workers),
        "-q",
        *extra,
    ]
    # the host's CPUs beside the run (benchmarks/host_load.py): a run bound by its compiles
    # shows them full
    sampler = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "host_load.py"), str(folder / "host_load.txt")]
    )
    start = time.monotonic()
    with open(folder / "pytest.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest still writes its JUnit and reports
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    wall = time.monotonic() - start
    sampler.terminate()
    sampler.wait()
    return {
        "count": count,
        "workers": workers,
        "workloads": [p.stem for p in paths],
        "wall_s": round(wall, 1),
        "exit": code,
        "stopped": wall >= budget,
    }


def measure_point(point: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``point`` with what its artifacts say: the workloads that finished, the stage wall time
    summed over the workloads, and the stage processes' seconds waiting for and holding the
    GPU (``summarize.child_seconds``)."""
    tool = _summarize()
    junit = folder / "opprof-junit.xml"
    stages = tool.stage_seconds([junit]) if junit.is_file() else {}
    per_stage: dict[str, float] = {}
    for seconds in stages.values():
        for stage, s in seconds.items():
            per_stage[stage] = per_stage.get(stage, 0.0) + s
    finished = [n for n in point["workloads"] if "speedup" in stages.get(n, {})]
    waiting = alone = 0.0
    for name in point["workloads"]:
        child = tool.child_seconds(folder / "run" / name)
        waiting += child.get("waiting", 0.0)
        alone += child.get("alone", 0.0)
    wall = point["wall_s"]
    return {
        **point,
        "finished": finished,
        "stage_s": {k: round(v, 1) for k, v in per_stage.items()},
        "waiting_s": round(waiting, 1),
        "measuring_s": round(alone, 1),
        "measuring_share": round(alone / wall, 3) if wall > 0 else None,
        "host_busy": _rounded(_benchmark_module("host_load").mean_busy(folder / "host_load.txt")),
    }


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 3)


def with_growth(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each point with the seconds each workload past the first cost, against the run of one
    workload where there is one (all its workloads finished, else None)."""
    one = next((p for p in points if p["count"] == 1 and len(p["finished"]) == 1), None)
    out = []
    for p in points:
        added = None
        if one is not None and p["count"] > 1 and len(p["finished"]) == p["count"]:
            added = round((p["wall_s"] - one["wall_s"]) / (p["count"] - 1), 1)
        out.append({**p, "per_added_s": added})
    return out


STAGES = ("capture", "propose", "backend", "validate", "recapture", "speedup")


def markdown(points: list[dict[str, Any]], label: str) -> str:
    head = (
        "| workloads | -n | wall s | finished | s per added workload | GPU measuring "
        "| waiting for the GPU (process-s) | host CPUs busy | " + " | ".join(STAGES) + " |"
    )
    lines = [
        f"Pipeline wall time by number of workloads ({label}; each run from empty Inductor "
        "and Triton caches; stage columns: wall seconds summed over the workloads, from the "
        "stage JUnit):",
        "",
        head,
        "|" + "---|" * (8 + len(STAGES)),
    ]
    for p in points:
        share = p["measuring_share"]
        cells = [
            str(p["count"]),
            str(p["workers"]),
            f"{p['wall_s']:.0f}" + (" (stopped)" if p["stopped"] else ""),
            f"{len(p['finished'])} of {p['count']}",
            "—" if p["per_added_s"] is None else f"{p['per_added_s']:.1f}",
            "—" if share is None else f"{p['measuring_s']:.0f} s ({share:.0%})",
            f"{p['waiting_s']:.0f}",
            "—" if p.get("host_busy") is None else f"{p['host_busy']:.0%}",
            *(f"{p['stage_s'][s]:.0f}" if s in p["stage_s"] else "—" for s in STAGES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args:
        at = args.index("--")
        args, extra = args[:at], args[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "suite", nargs="?", help="models, examples, or a folder of NAME/NAME.py folders"
    )
    parser.add_argument(
        "--table", type=Path, nargs="+", help="only tabulate these scaling.json files, merged"
    )
    parser.add_argument("--counts", default="1,4,8,16", help="workload counts (default 1,4,8,16)")
    parser.add_argument("--workers", type=int, default=0, help="-n per run (default: per count)")
    parser.add_argument("--max-workers", type=int, default=8, help="default -n's cap (default 8)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds per run (540)")
    parser.add_argument("--out", type=Path, default=Path("scaling"), help="table's folder")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/opprof-scaling"), help="runs' folder"
    )
    parser.add_argument("--label", default="one GPU", help="what the runs ran on, for the table")
    ns = parser.parse_args(args)
    if ns.table:
        return write_table(merged(ns.table), ns.label, ns.out)
    if ns.suite is None:
        parser.error("name a suite (models, examples or a folder), or --table FILES")
    try:
        counts = [int(c) for c in ns.counts.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--counts takes whole numbers separated by commas, not {ns.counts!r}")
    if not counts or min(counts) < 1:
        parser.error("--counts needs at least one count, each 1 or more")
    files = suite_workloads(ns.suite)
    points = []
    for count in counts:
        workers = ns.workers or min(count, ns.max_workers)
        folder = ns.work / f"n{count}"
        point = run_point(files, count, workers, folder, ns.budget, extra)
        points.append(measure_point(point, folder))
        print(
            f"scaling: {count} workloads, -n {workers}: {point['wall_s']:.0f} s, "
            f"{len(points[-1]['finished'])} finished",
            flush=True,
        )
    return write_table(points, ns.label, ns.out)


def merged(files: list[Path]) -> list[dict[str, Any]]:
    """The points of several ``scaling.json`` files, one per count (a later file's replaces an
    earlier one's), by count."""
    by_count: dict[int, dict[str, Any]] = {}
    for path in files:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            points = data["points"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"scaling: {path}: not a scaling.json ({exc})") from None
        for p in points:
            by_count[int(p["count"])] = p
    return [by_count[c] for c in sorted(by_count)]


def write_table(points: list[dict[str, Any]], label: str, out: Path) -> int:
    """``scaling.json`` and ``scaling.md`` of ``points`` (their growth computed anew) in
    ``out``; the table printed."""
    points = with_growth(points)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(
        json.dumps({"label": label, "points": points}, indent=1), encoding="utf-8"
    )
    (out / "scaling.md").write_text(markdown(points, label), encoding="utf-8")
    print(markdown(points, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
