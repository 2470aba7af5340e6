"""Stored runs and comparisons across commits (issue #40), without a pipeline run: the
unpaired interval between runs, the rules of --opprof-compare-fail, the warnings where the
device or the software differ, the storage, and the github-action-benchmark export."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import pytest

from pytest_opprof import cli, history
from pytest_opprof.errors import OpprofWarning
from pytest_opprof.history import (
    Fingerprint,
    StoredRun,
    StoredWorkload,
    TimingSettings,
    compare_workload,
    find_run,
    judge,
    list_runs,
    save_run,
    slug,
)
from pytest_opprof.measure import RunRounds, between_runs, latency_stats, speedup
from pytest_opprof.options import parse_compare_fail
from pytest_opprof.report.trend import benchmark_action_entries, comparison_section
from pytest_opprof.schema import WorkloadSummary

SCHEMA = Path(__file__).parents[1] / "data" / "github-action-benchmark.schema.json"
H200 = Fingerprint(
    device_type="cuda",
    device_name="NVIDIA H200",
    torch_version="2.11.0+cu128",
    cuda_version="12.8",
    triton_version="3.5.0",
    python_version="3.11.7",
)


def rounds(median: float, n: int = 15, spread: float = 0.01, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [median * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def workload(
    eager_ms: float = 4.0,
    optimized_ms: float = 2.0,
    *,
    seed: int = 0,
    fingerprint: Fingerprint = H200,
    name: str = "conv_block",
) -> StoredWorkload:
    samples = {
        "eager": rounds(eager_ms, seed=seed),
        "compile": rounds(eager_ms * 0.8, seed=seed + 1),
        "optimized": rounds(optimized_ms, seed=seed + 2),
    }
    return StoredWorkload(
        name=name,
        path=f"{name}.py",
        status="passed",
        gate_baseline="compile",
        fingerprint=fingerprint,
        timing=TimingSettings(warmup_iters=10, measure_iters=30, rounds=15, clock="cuda_event"),
        variants={k: latency_stats(v, 30) for k, v in samples.items()},
        speedups=[
            speedup(b, samples[b], "optimized", samples["optimized"]) for b in ("eager", "compile")
        ],
    )


def run_of(*workloads: StoredWorkload, number: int = 3, **fields: object) -> StoredRun:
    defaults: dict[str, object] = {
        "name": "main",
        "created": "2026-12-01T10:00:00+00:00",
        "commit": "abc1234def5678",
        "branch": "main",
        "device": "NVIDIA H200",
    }
    defaults.update(fields)
    return StoredRun(number=number, workloads=list(workloads), **defaults)  # type: ignore[arg-type]


# --- the interval between runs ----------------------------------------------------------------


def test_the_same_rounds_give_a_ratio_of_one_whose_interval_holds_one() -> None:
    samples = rounds(3.0, spread=0.05)
    ratio, lo, hi = between_runs(RunRounds((samples,)), RunRounds((samples,)))
    assert ratio == pytest.approx(1.0)
    assert lo < 1.0 < hi


def test_a_latency_twice_as_long_lies_wholly_above_one() -> None:
    ratio, lo, hi = between_runs(
        RunRounds((rounds(3.0, seed=1),)), RunRounds((rounds(6.0, seed=2),))
    )
    assert ratio == pytest.approx(2.0, rel=0.03)
    assert 1.9 < lo <= ratio <= hi < 2.1


def test_a_speedup_keeps_each_runs_pairs() -> None:
    """A drift that hits both sides of every pair (the second run's machine 30% slower) moves
    no speedup: the figure of each run is its own ratio, resampled with its pairs."""
    base, cand = rounds(4.0, spread=0.2, seed=3), rounds(2.0, spread=0.01, seed=4)
    drift = [1 + 0.3 * (i % 2) for i in range(15)]  # pairs share the drift of their round
    before = RunRounds((base, cand))

    def drifted(xs: list[float]) -> list[float]:
        return [x * d for x, d in zip(xs, drift, strict=True)]

    after = RunRounds((drifted(base), drifted(cand)))
    ratio, lo, hi = between_runs(before, after)
    assert lo < 1.0 < hi
    assert 0.8 < ratio < 1.2


def test_several_processes_widen_to_what_their_own_figures_allow() -> None:
    groups = [5, 5, 5]

    def processes(*speeds: float) -> list[float]:
        return [x * f for f in speeds for x in rounds(3.0, 5, 0.001, seed=int(f * 100))]

    before, after = processes(1.0, 1.1, 0.9), processes(1.0, 1.12, 0.92)
    plain = between_runs(RunRounds((before,)), RunRounds((after,)))
    pooled = between_runs(RunRounds((before,), groups), RunRounds((after,), groups))
    assert pooled[2] - pooled[1] > plain[2] - plain[1]
    assert pooled[1] < 1.0 < pooled[2]


def test_rounds_set_aside_count_in_neither_run() -> None:
    slowed = [*rounds(3.0, 10), 30.0, 30.0, 30.0]
    with_aside = between_runs(
        RunRounds((slowed,), set_aside=[10, 11, 12]), RunRounds((rounds(3.0, 10),))
    )
    assert with_aside[0] == pytest.approx(1.0, rel=0.02)


# --- rules ---------------------------------------------------------------------------------


def test_a_regression_past_the_threshold_fails_and_noise_does_not() -> None:
    rules = parse_compare_fail("latency:5%,speedup:10%")
    stored = run_of(workload())
    same = compare_workload(stored.workloads[0], workload(seed=7), rules, stored)
    slower = compare_workload(stored.workloads[0], workload(8.0, 4.0, seed=7), rules, stored)

    assert not any(c.failed for c in same.changes)
    assert {c.verdict for c in same.changes} <= {"unchanged", "improved", "regressed"}
    failed = {(c.metric, c.name) for c in slower.changes if c.failed}
    assert failed == {("latency", "eager"), ("latency", "compile"), ("latency", "optimized")}
    [gate] = [c for c in slower.changes if c.metric == "speedup" and c.gate]
    assert gate.name == "compile" and gate.verdict == "unchanged" and not gate.failed


def test_a_shrunk_speedup_fails_only_the_speedup_rule() -> None:
    stored = run_of(workload())
    gain_lost = workload(4.0, 3.0, seed=5)  # the model as fast, the backend a third slower
    only_latency = compare_workload(
        stored.workloads[0], gain_lost, parse_compare_fail("eager:5%"), stored
    )
    with_speedup = compare_workload(
        stored.workloads[0], gain_lost, parse_compare_fail("eager:5%,speedup:10%"), stored
    )
    assert not any(c.failed for c in only_latency.changes)
    [failed] = [c for c in with_speedup.changes if c.failed]
    assert (failed.metric, failed.name, failed.limit) == ("speedup", "compile", 0.9)
    assert failed.ci_high < 0.9


def test_a_regression_within_the_threshold_is_shown_not_failed() -> None:
    stored = run_of(workload())
    comp = compare_workload(
        stored.workloads[0], workload(4.12, 2.06, seed=9), parse_compare_fail("latency:10%"), stored
    )
    [eager] = [c for c in comp.changes if c.name == "eager" and c.metric == "latency"]
    assert eager.verdict == "regressed" and eager.limit == pytest.approx(1.1)
    assert not eager.failed


def test_another_gpu_is_compared_with_a_warning_and_never_failed() -> None:
    a100 = H200.model_copy(update={"device_name": "NVIDIA A100-SXM4-80GB"})
    stored = run_of(workload(fingerprint=a100))
    comp = compare_workload(
        stored.workloads[0], workload(8.0, 4.0), parse_compare_fail("latency:5%"), stored
    )
    assert not comp.gated
    assert comp.changes and not any(c.failed for c in comp.changes)
    assert "measured on NVIDIA A100-SXM4-80GB, this run on NVIDIA H200" in comp.warnings[0]


def test_other_software_is_compared_with_a_warning_and_still_gated() -> None:
    newer = H200.model_copy(update={"torch_version": "2.13.0+cu130", "cuda_version": "13.0"})
    stored = run_of(workload(fingerprint=newer))
    comp = compare_workload(
        stored.workloads[0], workload(8.0, 4.0), parse_compare_fail("latency:5%"), stored
    )
    assert comp.gated and any(c.failed for c in comp.changes)
    assert comp.warnings == [
        "conv_block: the software differs from run #3 main @ abc1234 (torch 2.13.0+cu130 → "
        "2.11.0+cu128, CUDA 13.0 → 12.8): a change may come from the stack as well as from "
        "the code"
    ]


def test_judge_fails_the_summary_with_the_workload_metric_ratio_and_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = run_of(workload())
    summary = WorkloadSummary(name="conv_block", path="conv_block.py", status="passed", stage="x")
    summary.message = "1.60x (95% CI 1.5–1.7) against compile: meets the minimum 1.00"
    # no artifacts on disk: this run's figures come through record_workload
    monkeypatch.setattr(history, "record_workload", lambda *a, **k: workload(8.0, 4.0))

    judge(summary, tmp_path, stored, parse_compare_fail("eager:5%"))

    assert summary.status == "failed"
    assert summary.message.startswith("regression against run #3 main @ abc1234: conv_block: ")
    shown = "eager latency 4.001 → 8.002 ms, 2.00× run #3 main @ abc1234's (95% CI "
    assert shown in summary.message
    assert "wholly past 1.05× (--opprof-compare-fail=eager:5%)" in summary.message
    assert summary.message.endswith(
        "; 1.60x (95% CI 1.5–1.7) against compile: meets the minimum 1.00"
    )
    title, body = comparison_section(summary)
    assert title == "Across runs" and "❌ regressed, wholly past 1.05× (eager:5%)" in body


def test_judge_warns_with_an_opprof_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newer = H200.model_copy(update={"triton_version": "3.6.0"})
    stored = run_of(workload(fingerprint=newer))
    summary = WorkloadSummary(name="conv_block", path="conv_block.py", status="passed", stage="x")
    monkeypatch.setattr(history, "record_workload", lambda *a, **k: workload())

    with pytest.warns(OpprofWarning, match=r"Triton 3\.6\.0 → 3\.5\.0"):
        judge(summary, tmp_path, stored, ())
    assert summary.status == "passed"


def test_a_workload_the_stored_run_lacks_is_noted(tmp_path: Path) -> None:
    summary = WorkloadSummary(name="new_model", path="new_model.py", status="passed", stage="x")
    comp = judge(summary, tmp_path, run_of(workload()), parse_compare_fail("latency:5%"))
    assert comp.changes == []
    assert comp.notes == ["run #3 main @ abc1234 has no workload 'new_model': nothing to compare"]
    assert summary.status == "passed"


# --- storage -------------------------------------------------------------------------------


def test_saved_runs_are_numbered_and_found_by_number_name_branch_and_path(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    first = save_run(storage, run_of(workload(), name="main", branch="main"))
    second = save_run(storage, run_of(workload(), name=None, branch="dev", commit=None))
    third = save_run(storage, run_of(workload(), name="nightly", branch="main"))
    (storage / "0004_broken.json").write_text("{")

    assert [p.name for p in (first, second, third)] == [
        "0001_main.json",
        "0002.json",
        "0003_nightly.json",
    ]
    entries = list_runs(storage)
    assert [e.number for e in entries] == [1, 2, 3, 4]
    assert entries[-1].run is None and "not valid JSON" in str(entries[-1].error)
    assert find_run("last", storage)[0] == third
    assert find_run("2", storage)[0] == second
    assert find_run("main", storage)[0] == first  # a name before a branch
    assert find_run("dev", storage)[0] == second  # the branch it was saved on
    assert find_run(str(second), storage)[0] == second
    assert find_run(str(storage), tmp_path / "elsewhere")[0] == third
    assert find_run("nightly", storage)[1].label == "#3 nightly @ abc1234"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("9", r"no run #9 in .*; stored: #1"),
        ("4", r"0004_broken.json: not valid JSON"),
        ("release", r"no run named 'release' or saved on branch 'release'"),
        ("missing.json", r"missing.json: not found"),
    ],
)
def test_a_run_that_is_not_there_is_a_usage_error(tmp_path: Path, spec: str, message: str) -> None:
    storage = tmp_path / "runs"
    save_run(storage, run_of(workload()))
    (storage / "0004_broken.json").write_text("{")
    with pytest.raises(pytest.UsageError, match=message):
        find_run(spec, storage)


def test_an_empty_storage_says_to_save_first(tmp_path: Path) -> None:
    with pytest.raises(pytest.UsageError, match=r"no stored run in .*: save one first"):
        find_run("last", tmp_path / "nothing")


def test_sessions_saving_at_once_get_distinct_numbers(tmp_path: Path) -> None:
    storage = tmp_path / "runs"
    paths: list[Path] = []

    def save(i: int) -> None:
        paths.append(save_run(storage, run_of(workload(), name=f"job{i}")))

    threads = [threading.Thread(target=save, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(p.name[:4]) for p in paths) == [1, 2, 3, 4, 5, 6]


def test_a_branch_becomes_a_run_name() -> None:
    assert slug("feature/faster conv") == "feature-faster-conv"
    assert slug("///") == "run"


def test_a_stored_run_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "0001.json"
    data = json.loads(run_of(workload()).model_dump_json())
    data["schema_version"] = "2.0"
    path.write_text(json.dumps(data))
    with pytest.raises(pytest.UsageError, match=r"schema_version 2.0 is newer"):
        find_run(str(path), tmp_path)


# --- export and the commands ---------------------------------------------------------------


def test_the_export_validates_against_github_action_benchmarks_format() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    smaller, bigger = benchmark_action_entries(run_of(workload(), workload(name="gpt2")))

    for entries in (smaller, bigger):
        jsonschema.validate(entries, schema)
    assert [e["name"] for e in smaller[:3]] == [
        "conv_block/eager",
        "conv_block/compile",
        "conv_block/optimized",
    ]
    assert {e["unit"] for e in smaller} == {"ms"} and {e["unit"] for e in bigger} == {"x"}
    assert bigger[1]["name"] == "conv_block/speedup vs compile"
    assert bigger[1]["extra"].startswith("95% CI ") and "(gate)" in bigger[1]["extra"]
    assert smaller[0]["range"].startswith("± ")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "x", "unit": "ms", "value": "fast"}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_the_commands_list_chart_and_export_stored_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage, out = tmp_path / "runs", tmp_path / "out"
    save_run(storage, run_of(workload()))
    save_run(storage, run_of(workload(5.0, 2.5, seed=4), name="pr", branch="feature"))

    assert cli.main(["runs", "--storage", str(storage)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("#1    main ") and "1/1 passed" in listed[0]
    assert listed[1].startswith("#2    pr ")

    assert cli.main(["trend", "--storage", str(storage), "--out", str(out), "--no-plots"]) == 0
    page = (out / "trend.md").read_text()
    assert "## conv_block" in page and "#2 pr @ abc1234" in page
    assert re.search(r"\| 4\.9\d\d ms \(4\.9\d\d–\d\.\d{3}\) \|", page)  # with its CI

    assert cli.main(["export", "1", "--storage", str(storage), "--out", str(out)]) == 0
    latency = json.loads((out / "benchmark-latency.json").read_text())
    assert latency[0]["name"] == "conv_block/eager" and "run #1 main" in latency[0]["extra"]

    assert cli.main(["export", "7", "--storage", str(storage), "--out", str(out)]) == 1
    assert "no run #7" in capsys.readouterr().err


# --- the order of the next parallel run ----------------------------------------------------


def test_the_newest_run_with_stage_seconds_orders_the_next(tmp_path: Path) -> None:
    """A newer run without seconds (saved by an older version, or a resumed run) is passed
    over, and so is a file that does not read; none within the look-back: no order."""
    storage = tmp_path / "runs"
    assert history.last_seconds(storage) == {}
    timed = workload(name="resnet18")
    timed.seconds = 120.0
    save_run(storage, run_of(timed, workload(name="conv_block")))
    save_run(storage, run_of(workload(name="resnet18")))  # newer, says nothing
    (storage / "0003_broken.json").write_text("{")
    assert history.last_seconds(storage) == {"resnet18": 120.0}
    for _ in range(history.LOOK_BACK):
        save_run(storage, run_of(workload(name="resnet18")))
    assert history.last_seconds(storage) == {}


def test_longest_first_puts_the_unknown_first_and_keeps_ties_in_order() -> None:
    seconds = {"a": 10.0, "b": 300.0, "c": 10.0}
    assert history.longest_first(["a", "b", "new", "c", None], seconds) == [2, 4, 1, 0, 3]
