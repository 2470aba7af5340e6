"""The generated tests in a process of their own beside the smoke run and the judge
(``stages.validate``): where they run, and a report that reads as the steps in order give it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.schema import Profile, read_artifact, write_artifact
from pytest_opprof.stages import validate

H200 = Path(__file__).parents[1] / "data" / "h200" / "conv_block"
GIB = 1 << 30


class StandIn:
    """What ``validate_file`` uses of a ``WorkloadRun``: each child writes the steps
    ``answers`` gives for its task, after ``seconds`` (the tests' child twice as long)."""

    def __init__(self, folder: Path, answers: dict[str, dict[str, Any]], seconds: float) -> None:
        self.spec = SimpleNamespace(stem="w")
        self.out_dir = folder / "out"
        self.profiler_output = self.out_dir / "profiler_output"
        self.profiler_output.mkdir(parents=True)
        self.answers = answers
        self.seconds = seconds
        self.children: list[tuple[str, float, float, dict[str, Any]]] = []
        self._guard = threading.Lock()

    def setting(self, name: str) -> Any:
        return {"timing_processes": 3}.get(name)

    def run_child(self, task: str, stage: str, *, log_name: str = "", **extra: Any) -> None:
        start = time.monotonic()
        time.sleep(self.seconds * (2 if task == "validate_tests" else 1))
        Path(extra["result"]).write_text(json.dumps(self.answers[task]))
        if task == "validate" and "outputs" in self.answers[task]:
            Path(extra["outputs"]).write_bytes(b"")
        with self._guard:
            self.children.append((task, start, time.monotonic(), extra))


def _profile(run: StandIn, device: str, peak: int) -> None:
    base = read_artifact(H200 / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(
        update={
            "device_type": device,
            "peak_memory_bytes": peak,
            "device_memory_bytes": 140 * GIB,
        }
    )
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))


def _generated(folder: Path) -> Path:
    path = folder / "w_optimized.py"
    path.write_text("BACKEND = 'opprof_w'\n")
    return path


PASS = {"status": "pass", "detail": "ok"}
SMOKE: dict[str, Any] = {
    "steps": {"import": PASS, "registration": PASS, "smoke": PASS},
    "passes": [{"name": "bn_fold", "status": "APPLIED", "detail": "", "matches": 1}],
    "outputs": True,
}
JUDGED = {
    "steps": {"numerics": PASS},
    "numerics": {
        "max_abs_err": 0.0,
        "rel_err": 1e-4,
        "rtol": 1e-2,
        "atol": 1e-3,
        "dtype": "bfloat16",
        "ok": True,
    },
}


def test_on_the_cpu_the_tests_run_beside_the_smoke_run_and_the_judge(tmp_path: Path) -> None:
    tests = {"steps": {"tests": {"status": "pass", "detail": "5 passed"}}}
    run = StandIn(
        tmp_path, {"validate": SMOKE, "validate_numerics": JUDGED, "validate_tests": tests}, 0.3
    )
    _profile(run, "cpu", GIB)
    report = validate.validate_file(run, _generated(tmp_path))  # type: ignore[arg-type]
    assert report.overall == "READY_FOR_PROFILING", report.message
    assert report.steps["tests"].detail == "5 passed" and report.passes[0].name == "bn_fold"
    spans = {task: (a, b) for task, a, b, _ in run.children}
    # the tests overlapped both other children; the import step was told not to run them
    assert spans["validate_tests"][0] < spans["validate"][1]
    assert spans["validate_tests"][1] > spans["validate_numerics"][0]
    given = {task: extra for task, _, _, extra in run.children}
    assert given["validate"]["tests_log"] is None
    assert given["validate_tests"]["tests_log"].endswith("generated_tests.log")


def test_failed_tests_block_the_steps_after_them_though_those_ran_beside(tmp_path: Path) -> None:
    """The report the steps in order give: the smoke run and the judge passed beside, but
    the first failure is step 4's, so they are blocked by it and their record is not kept."""
    failed = {"steps": {"tests": {"status": "fail", "detail": "1 failed"}}}
    run = StandIn(
        tmp_path, {"validate": SMOKE, "validate_numerics": JUDGED, "validate_tests": failed}, 0.0
    )
    _profile(run, "cpu", GIB)
    report = validate.validate_file(run, _generated(tmp_path))  # type: ignore[arg-type]
    assert report.overall == "BLOCKED"
    assert report.message.startswith("BLOCKED — fix step 4 (tests): 1 failed")
    assert {k: v.status for k, v in report.steps.items()} == {
        "syntax": "pass",
        "import": "pass",
        "registration": "pass",
        "tests": "fail",
        "smoke": "skipped",
        "numerics": "skipped",
    }
    assert report.steps["smoke"].detail == "blocked by tests"
    assert report.passes == [] and report.numerics is None


def test_a_failed_import_blocks_the_tests_that_ran_beside_it(tmp_path: Path) -> None:
    broken = {"steps": {"import": {"status": "fail", "detail": "ImportError: no module named x"}}}
    passed = {"steps": {"tests": {"status": "pass", "detail": "5 passed"}}}
    run = StandIn(tmp_path, {"validate": broken, "validate_tests": passed}, 0.0)
    _profile(run, "cpu", GIB)
    report = validate.validate_file(run, _generated(tmp_path))  # type: ignore[arg-type]
    assert report.message.startswith("BLOCKED — fix step 2 (import)")
    assert report.steps["tests"].detail == "blocked by import"
    assert {task for task, *_ in run.children} == {"validate", "validate_tests"}


def test_on_a_gpu_the_tests_run_beside_only_where_one_process_more_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three timing processes, validation, the counters pass and the tests: six processes at
    twice the capture's peak in 80% of 140 GiB fit at a 9 GiB peak, not at 10 GiB; without a
    GPU lock nothing runs beside."""
    run = StandIn(tmp_path, {}, 0.0)
    _profile(run, "cuda", 9 * GIB)
    monkeypatch.delenv(LOCK_ENV, raising=False)
    assert not validate.tests_beside(run)  # type: ignore[arg-type]
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    assert validate.tests_beside(run)  # type: ignore[arg-type]
    _profile(run, "cuda", 10 * GIB)
    assert not validate.tests_beside(run)  # type: ignore[arg-type]
    (run.out_dir / "profile.json").write_text("{not json")
    assert not validate.tests_beside(run)  # type: ignore[arg-type]


def test_where_the_tests_do_not_fit_the_import_step_runs_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    steps = {**SMOKE, "steps": {**SMOKE["steps"], "tests": PASS}}
    run = StandIn(tmp_path, {"validate": steps, "validate_numerics": JUDGED}, 0.0)
    _profile(run, "cuda", 40 * GIB)
    report = validate.validate_file(run, _generated(tmp_path))  # type: ignore[arg-type]
    assert report.overall == "READY_FOR_PROFILING"
    assert [task for task, *_ in run.children] == ["validate", "validate_numerics"]
    assert run.children[0][3]["tests_log"].endswith("generated_tests.log")
