"""benchmarks/scaling.py, the pipeline's own benchmark: which workloads each count runs, and
its table from a run's stage JUnit and stage logs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _scaling() -> Any:
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_count_past_the_suite_repeats_it_under_new_names(tmp_path: Path) -> None:
    tool = _scaling()
    files = tool.suite_workloads("models")
    assert len(files) >= 6 and [f.stem for f in files] == sorted(f.stem for f in files)
    chosen = tool.workloads_for(files, len(files) + 2, tmp_path)
    assert chosen[: len(files)] == files  # the suite itself first, in place
    extra = chosen[len(files) :]
    assert [p.stem for p in extra] == [f"{files[0].stem}_2", f"{files[1].stem}_2"]
    assert extra[0].parent.name == extra[0].stem  # NAME/NAME.py: a workload folder
    assert extra[0].read_bytes() == files[0].read_bytes()


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="opprof">
{cases}
</testsuite></testsuites>
"""


def _run(folder: Path, name: str, finished: bool, waiting: float, alone: float) -> str:
    logs = folder / "run" / name / "profiler_output"
    logs.mkdir(parents=True)
    (logs / "backend.log").write_text(
        "[opprof] +    0.0 s  forked from the fork server of pid 1 at 10:00:00.000 UTC\n"
        f"[opprof] +   30.0 s  task backend done, {waiting} s of it waiting for the GPU, "
        f"{alone} s with the GPU to itself\n",
        encoding="utf-8",
    )
    stages = ["capture", "propose", "backend"] + (["validate", "recapture", "speedup"] * finished)
    return "\n".join(
        f'<testcase classname="{name}" name="{s}" time="{10.0 + i}"/>' for i, s in enumerate(stages)
    )


def test_the_table_counts_what_finished_and_the_gpu_s_measuring_share(tmp_path: Path) -> None:
    tool = _scaling()
    points = []
    for count, names in ((1, ["a"]), (3, ["a", "b", "c"])):
        folder = tmp_path / f"n{count}"
        cases = [
            _run(folder, n, finished=(n != "c" or count == 1), waiting=5.0, alone=2.0)
            for n in names
        ]
        (folder / "opprof-junit.xml").write_text(
            JUNIT.format(cases="\n".join(cases)), encoding="utf-8"
        )
        if count == 3:  # the host's CPUs over the run (benchmarks/host_load.py)
            (folder / "host_load.txt").write_text(
                "10:00:00.000000 0.900 20 16\n10:00:02.000000 0.700 12 16\n10:00:04.0"
            )
        point = {"count": count, "workers": count, "workloads": names, "stopped": False}
        point["wall_s"] = 100.0 if count == 1 else 160.0
        points.append(tool.measure_point(point, folder))
    one, three = tool.with_growth(points)
    assert one["finished"] == ["a"] and three["finished"] == ["a", "b"]
    assert three["measuring_s"] == 6.0 and three["measuring_share"] == round(6.0 / 160.0, 3)
    assert three["waiting_s"] == 15.0
    assert three["stage_s"]["capture"] == 30.0  # 10 s for each of the three
    assert three["per_added_s"] is None  # one of them did not finish: no growth figure
    table = tool.markdown([one, three], "one GPU")
    assert one["host_busy"] is None and three["host_busy"] == 0.8
    assert "| 1 | 1 | 100 | 1 of 1 | — | 2 s (2%) | 5 | — |" in table
    assert "| 3 | 3 | 160 | 2 of 3 | — | 6 s (4%) | 15 | 80% |" in table
    points[1]["workloads"] = ["a", "b"]
    points[1]["count"] = 2
    points[1] = tool.measure_point({**points[1], "finished": []}, tmp_path / "n3")
    assert tool.with_growth([points[0], points[1]])[1]["per_added_s"] == 60.0


def test_counts_from_separate_calls_make_one_table(tmp_path: Path) -> None:
    """``--table``: points of several runs' scaling.json, one per count, the growth computed
    over all of them (a run of one workload in one call, of four in another)."""
    import json

    tool = _scaling()

    def point(count: int, wall: float) -> dict[str, Any]:
        names = [f"w{i}" for i in range(count)]
        return {
            "count": count,
            "workers": count,
            "workloads": names,
            "wall_s": wall,
            "exit": 0,
            "stopped": False,
            "finished": names,
            "stage_s": {"capture": 10.0 * count},
            "waiting_s": 0.0,
            "measuring_s": 5.0,
            "measuring_share": round(5.0 / wall, 3),
        }

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"label": "one GPU", "points": [point(1, 100.0)]}))
    second.write_text(json.dumps({"label": "one GPU", "points": [point(4, 190.0)]}))
    assert tool.main(["--table", str(second), str(first), "--out", str(tmp_path / "t")]) == 0
    table = json.loads((tmp_path / "t" / "scaling.json").read_text())
    assert [p["count"] for p in table["points"]] == [1, 4]
    assert table["points"][1]["per_added_s"] == 30.0  # (190 - 100) / 3
    assert "| 4 | 4 | 190 | 4 of 4 | 30.0 |" in (tmp_path / "t" / "scaling.md").read_text()
