"""Cut the test fixtures of tests/data/h200/<name>/ and tests/data/results/ from the raw runs.

    git worktree add ../opprof-results results
    python tests/data/results/make_fixtures.py ../opprof-results

The raw H200 runs live on the orphan ``results`` branch (docs/results.md), at the paths they had
on main. The tests read only what this script copies or extracts from them, so a test's input is
a file of tests/data/, small enough to commit, and the figures they check (docs/results.md,
docs/reproducibility.md) can still be recomputed from the GPU's own rounds:

- ``tests/data/h200/<name>/``: the example artifacts of h200-2026-12-02c/counters-n7 (the run
  whose traces are tests/data/h200/*.trace.json.gz), profiles and selections gzipped, with the
  run's stage JUnit and summary table beside them;
- ``tests/data/report/two-gpus/``: the session file of h200x2-2026-11-30e/two-gpus and each
  workload's capture metadata (profiles without their timelines);
- ``tests/data/results/<session>/<run>/``: stage JUnit files, summary JSONs, wall times, one
  run's stage logs and two workloads of another, copied as they are;
- ``tests/data/results/timings.json.gz``: per workload of every run timed twice (``*-retimed``
  beside its run) the recapture's rounds that the statistics read;
- ``tests/data/results/selections.json.gz`` and ``details.json``: the fields of the selections,
  validation reports, optimized timelines, logs and capture metadata the history tests read.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
EXAMPLES = (
    "conv_block",
    "mlp_activations",
    "sdpa_attention",
    "depthwise_separable_conv",
    "embedding_projection",
    "gpt2",
    "lstm_sequence_encoder",
)
FIXTURE_RUN = "h200-2026-12-02c/counters-n7"
"""The run whose example artifacts were committed as examples/<name>/h200/."""

SUMMARIES = (
    "h200-2026-12-04/examples-stock-n7",
    "h200-2026-12-04/models-stock-n8b",
    "h200-2026-12-04/bert-alone",
    "h200x2-2026-11-30e/one-gpu",
    "h200x2-2026-11-30e/two-gpus",
    "h200-2026-11-30j/offgpu-n7",
    "h200-2026-11-30j/quiet-n7",
    "h200-2026-11-30j/quiet-n7-again",
    "h200-2026-11-30j/counters-n7",
    "h200-2026-11-30j/nopool-n7",
    "h200-2026-12-01/ref-n7",
    "h200-2026-12-01/fastcpu-n7",
    "h200-2026-12-01/fastcpu-n7-again",
    "h200-2026-12-01/same-n7",
    "h200-2026-12-01/same-n7-retimed",
    "h200-2026-12-01b/first-n7",
    "h200-2026-12-01b/first-n7-retimed",
    "h200-2026-12-01b/second-n7",
    "h200-2026-12-01b/second-n7-retimed",
    "h200-2026-12-01b/third-n7",
    "h200-2026-12-01b/third-n7-retimed",
    "h200-2026-12-02d/fresh-retime/fresh-n7",
    "h200-2026-12-02d/fresh-retime/fresh-n7-retimed",
    "h200-2026-12-03b/again-n7",
    "h200-2026-12-03b/again-n7-retimed",
)
WALLS = (
    "h200-2026-12-01b/third-n7",
    "h200-2026-12-01b/fourth-n7",
    "h200-2026-12-01c/first-n7",
    "h200-2026-12-01c/second-n7",
    "h200-2026-12-03b/again-n7",
)
SELECTIONS = (
    [f"h200-2026-12-01/{r}/{w}" for r in ("same-n7", "same-n7-retimed") for w in EXAMPLES]
    + [f"h200-2026-12-01b/{r}/{w}" for r in ("third-n7", "fourth-n7") for w in EXAMPLES]
    + [
        f"h200-2026-12-01c/{r}/{w}"
        for r in ("counters-n7", "first-n7", "second-n7", "third-n7")
        for w in EXAMPLES
    ]
    + [
        f"h200-2026-12-02/{r}/{w}"
        for r in ("counters-n7", "counters-n7-retimed", "plain-n7", "plain-n7-retimed")
        for w in ("embedding_projection", "mlp_activations")
    ]
    + [
        f"h200-2026-12-02b/{r}/embedding_projection"
        for r in ("counters-n7", "counters-n7-retimed", "plain-n7", "plain-n7-retimed")
    ]
)
WIDER_RUNS = ("counters-n7", "counters-n7-retimed", "plain-n7", "plain-n7-retimed")


def _json(path: Path) -> Any:
    """A JSON artifact, or its gzip copy (``name.gz``) where the run was packed so."""
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.exists():
        return json.loads(gzip.decompress(packed.read_bytes()))
    return json.loads(path.read_bytes())


def _gzip_json(data: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    path.write_bytes(gzip.compress(text, 9, mtime=0))


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _gzip_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(gzip.compress(src.read_bytes(), 9, mtime=0))


def _run_folder(src: Path, dst: Path, workloads: tuple[str, ...]) -> None:
    """A packed run's workload folders as summarize.py reads them (no reports)."""
    for name in workloads:
        for f in (src / name).rglob("*"):
            if f.is_file() and not f.name.startswith(("report.md", "workload_summary")):
                _copy(f, dst / name / f.relative_to(src / name))


def example_run(raw: Path) -> None:
    run = raw / "benchmarks" / "results" / FIXTURE_RUN
    out = DATA / "h200"
    _run_folder(run, out, EXAMPLES)
    for name in EXAMPLES:
        graph = raw / "examples" / name / "h200" / "graph.json"
        if graph.exists():
            _gzip_file(graph, out / name / "graph.json.gz")
    for f in ("opprof-junit.xml", "summary.md"):
        _copy(run / f, out / f)


def two_gpus(raw: Path) -> None:
    """The session file and each workload's capture metadata: what the session report reads to
    name the GPU each workload was measured on."""
    run = raw / "benchmarks" / "results" / "h200x2-2026-11-30e" / "two-gpus"
    out = DATA / "report" / "two-gpus"
    _copy(run / "session.json", out / "session.json")
    for name in EXAMPLES:
        profile = _json(run / name / "profile_optimized.json")
        profile["timelines"] = []
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "profile_optimized.json").write_text(json.dumps(profile, indent=1) + "\n")


def copied(raw: Path) -> None:
    results = raw / "benchmarks" / "results"
    for i in range(1, 5):
        f = f"h200x2-2026-11-30c/call{i}-opprof-junit.xml"
        _copy(results / f, HERE / f)
    missed = "h200-2026-12-02/counters-n7"
    _copy(results / missed / "opprof-junit.xml", HERE / missed / "opprof-junit.xml")
    _run_folder(results / missed, HERE / missed, ("embedding_projection", "mlp_activations"))
    timeline = "h200-2026-12-03b/plain-n7"  # the stage logs gpu_timeline.py lays on one clock
    for log in sorted((results / timeline).glob("*/profiler_output/*.log")):
        _copy(log, HERE / log.relative_to(results))
    for run in SUMMARIES:
        _gzip_file(results / run / "summary.json", HERE / run / "summary.json.gz")
    for run in WALLS:
        _copy(results / run / "wall_seconds.txt", HERE / run / "wall_seconds.txt")


def _timing(profile: dict[str, Any]) -> dict[str, Any]:
    t = profile["timing"]
    compile_, optimized = t["variants"]["compile"], t["variants"]["optimized"]
    return {
        "host_us": t["host_us"],
        "other_busy": [h["other_busy"] for h in t["host"]],
        "compile": {
            k: compile_[k] for k in ("samples_ms", "samples_per_process", "set_aside", "median_ms")
        },
        "optimized": {k: optimized[k] for k in ("samples_ms", "median_ms")},
    }


def timings(raw: Path) -> None:
    """Every run timed twice (``*-retimed`` beside its run), and the run whose rounds first
    showed the host's slowed stretches (h200-2026-12-01/ref-n7)."""
    results = raw / "benchmarks" / "results"
    out: dict[str, Any] = {}
    for again in sorted(results.glob("h200-*/*-retimed")):
        first = again.with_name(again.name.removesuffix("-retimed"))
        for w in sorted(p.name for p in again.iterdir() if p.is_dir()):
            for run in (first, again):
                key = (run / w).relative_to(results).as_posix()
                out[key] = _timing(_json(run / w / "profile_optimized.json"))
    for w in ("conv_block", "depthwise_separable_conv"):
        run = results / "h200-2026-12-01" / "ref-n7" / w
        out[run.relative_to(results).as_posix()] = _timing(_json(run / "profile_optimized.json"))
    _gzip_json(out, HERE / "timings.json.gz")


def selections(raw: Path) -> None:
    results = raw / "benchmarks" / "results"
    out = {}
    for key in SELECTIONS:
        sel = _json(results / key / "profiler_output" / "backend_selection.json")
        out[key] = {
            "plan": sel["plan"],
            "chosen": sel["chosen"],
            "variants": [v["name"] for v in sel["variants"]],
            "waterfall": [
                {"step": s["step"], "speedup_added": s["speedup_added"]} for s in sel["waterfall"]
            ],
            "dropped": [{"id": d["id"], "reason": d["reason"]} for d in sel["dropped"]],
        }
    _gzip_json(out, HERE / "selections.json.gz")


def details(raw: Path) -> None:
    """What the history tests read of validation reports, optimized timelines, stage logs and
    capture metadata."""
    results = raw / "benchmarks" / "results"
    gemm_epilogue: dict[str, Any] = {}
    optimized: dict[str, Any] = {}
    tuned_mm_lines: dict[str, list[str]] = {}
    for session, workloads in (
        ("h200-2026-12-02", ("embedding_projection", "mlp_activations")),
        ("h200-2026-12-02b", ("embedding_projection",)),
    ):
        for run in WIDER_RUNS:
            for w in workloads:
                key = f"{session}/{run}/{w}"
                folder = results / key
                report = _json(folder / "profiler_output" / "validation_report.json")
                gemm_epilogue[key] = [p for p in report["passes"] if p["name"] == "gemm_epilogue"]
                if w != "embedding_projection":
                    continue
                profile = _json(folder / "profile_optimized.json")
                (timeline,) = [t for t in profile["timelines"] if t["label"] == "optimized"]
                optimized[key] = {
                    "median_ms": profile["timing"]["variants"]["optimized"]["median_ms"],
                    "attributed_share": timeline["summary"]["attributed_share"],
                    "operators": [
                        [op["name"], [k["name"] for k in op["kernels"]]]
                        for op in timeline["operators"]
                    ],
                }
                lines = [
                    line
                    for log in sorted((folder / "profiler_output").glob("*.log"))
                    for line in log.read_text(encoding="utf-8").splitlines()
                    if "tuned_mm [" in line
                ]
                if lines:
                    tuned_mm_lines[key] = lines
    memory = {}
    for name in EXAMPLES:
        key = f"h200-2026-11-30g/two-gpus/{name}"
        meta = _json(results / key / "profile.json")["capture_metadata"]
        memory[key] = {k: meta[k] for k in ("peak_memory_bytes", "device_memory_bytes")}
    out = {
        "gemm_epilogue": gemm_epilogue,
        "optimized": optimized,
        "tuned_mm_lines": tuned_mm_lines,
        "capture_memory": memory,
    }
    (HERE / "details.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "benchmarks" / "results").is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    raw = Path(argv[0])
    example_run(raw)
    two_gpus(raw)
    copied(raw)
    timings(raw)
    selections(raw)
    details(raw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
