"""One GPU per xdist worker, deterministic shards, and merging shard results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from pytest_opprof import devicelock
from pytest_opprof.gpus import assign, gpu_uuid, visible_gpus, worker_gpu
from pytest_opprof.schema import SessionSummary, WorkloadSummary, read_artifact, write_artifact
from pytest_opprof.session import merge_sessions


def test_workers_get_distinct_gpus_within_the_outer_restriction() -> None:
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"})
    assert gpus == ["3", "5"]
    assert [worker_gpu(f"gw{i}", gpus) for i in range(2)] == ["3", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_more_workers_than_gpus_share_them_round_robin() -> None:
    assert [worker_gpu(f"gw{i}", ["0", "1"]) for i in range(5)] == ["0", "1", "0", "1", "0"]


def test_each_worker_measures_under_the_lock_of_its_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Workers sharing a GPU name the same lock, by the GPU's UUID; a UUID entry is its own
    name; no GPU, no lock."""
    # absent again after the test: a delenv of an absent variable records nothing to undo, and
    # the one below would restore the lock assign() set, for every later test to see
    monkeypatch.setenv(devicelock.LOCK_ENV, "")
    monkeypatch.delenv(devicelock.LOCK_ENV)
    monkeypatch.setattr("pytest_opprof.gpus.pin_worker", lambda worker, count: None)
    monkeypatch.setattr("pytest_opprof.gpus._smi_first_line", lambda args: f"GPU-uuid-of-{args[1]}")
    locks = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        assign("auto", {"workerid": worker, "workercount": 3})
        locks.append((os.environ["CUDA_VISIBLE_DEVICES"], os.environ[devicelock.LOCK_ENV]))
    assert [gpu for gpu, _ in locks] == ["0", "1", "0"]
    assert locks[0][1] == locks[2][1] != locks[1][1]
    assert locks[0][1].endswith("GPU-uuid-of-0.lock")
    assert gpu_uuid("GPU-1234-abcd") == "GPU-1234-abcd"
    monkeypatch.delenv(devicelock.LOCK_ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assign("auto", None)
    assert devicelock.LOCK_ENV not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assign("cpu", None)
    assert devicelock.LOCK_ENV not in os.environ


Status = Literal["passed", "failed", "error", "skipped"]


def _shard(folder: Path, names: list[str], status: Status = "passed") -> None:
    summaries = [
        WorkloadSummary(
            name=n,
            path=f"{n}.py",
            status=status,
            stage="report",
            speedup=2.0,
            ci_low=1.9,
            ci_high=2.1,
            baseline="compile",
            baseline_ms=1.0,
            optimized_ms=0.5,
        )
        for n in names
    ]
    write_artifact(
        folder / "session.json",
        SessionSummary(device="NVIDIA H200", workloads=summaries, gate_passed=True),
    )
    for n in names:
        (folder / n).mkdir(parents=True)
        (folder / n / "report.md").write_text(f"# {n}\n")


def test_merge_two_shards(tmp_path: Path) -> None:
    _shard(tmp_path / "s1", ["a", "c"])
    _shard(tmp_path / "s2", ["b"])
    merged = merge_sessions([tmp_path / "s1", tmp_path / "s2"], tmp_path / "all")
    assert [w.name for w in merged.workloads] == ["a", "b", "c"] and merged.gate_passed
    assert read_artifact(tmp_path / "all" / "session.json", SessionSummary) == merged
    assert (tmp_path / "all" / "b" / "report.md").exists()
    assert (tmp_path / "all" / "comment.md").read_text().startswith("<!-- pytest-opprof -->")


def test_merge_rejects_overlapping_shards(tmp_path: Path) -> None:
    _shard(tmp_path / "s1", ["a"])
    _shard(tmp_path / "s2", ["a"])
    from pytest_opprof.errors import OpprofError

    with pytest.raises(OpprofError, match="in two shards"):
        merge_sessions([tmp_path / "s1", tmp_path / "s2"], tmp_path / "all")


def test_merge_command_fails_when_a_shard_failed(tmp_path: Path) -> None:
    _shard(tmp_path / "s1", ["a"])
    _shard(tmp_path / "s2", ["b"], status="failed")
    out = subprocess.run(
        [sys.executable, "-m", "pytest_opprof.cli", "merge", "s1", "s2", "--out", "all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert "merged 2 shard(s)" in out.stdout


def test_shards_partition_the_workloads(pytester: pytest.Pytester) -> None:
    for i in range(6):
        pytester.makepyfile(**{f"w{i}": "def get_model_and_input():\n    pass\n"})
    seen: list[str] = []
    for k in (1, 2):
        result = pytester.runpytest("--opprof", f"--opprof-shard={k}/2", "--collect-only", "-q")
        ids = [line for line in result.outlines if "::capture" in line]
        seen += ids
        again = pytester.runpytest("--opprof", f"--opprof-shard={k}/2", "--collect-only", "-q")
        assert [line for line in again.outlines if "::capture" in line] == ids
    assert sorted(seen) == sorted(f"w{i}.py::capture" for i in range(6))


def test_xdist_keeps_a_workloads_items_on_one_worker(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(
        w1="def get_model_and_input():\n    pass\n", w2="def get_model_and_input():\n    pass\n"
    )
    verbose = pytester.runpytest_subprocess(
        "--opprof", "-n", "2", "--opprof-device=cpu", "--opprof-stage=capture", "-v"
    )
    verbose.stdout.fnmatch_lines(["*scheduling tests via LoadFileScheduling*"])


def test_stage_junit_under_xdist_holds_every_workers_stages(pytester: pytest.Pytester) -> None:
    """The controller runs no item: the stage-level JUnit is built from the workers' reports."""
    pytest.importorskip("xdist")
    body = "def get_model_and_input():\n    raise ValueError('no model here')\n"
    pytester.makepyfile(w1=body, w2=body)
    pytester.runpytest_subprocess(
        "--opprof", "-n", "2", "--opprof-device=cpu", "--opprof-junit=stages.xml"
    )
    import xml.etree.ElementTree as ET

    root = ET.parse(pytester.path / "stages.xml").getroot()
    suites = {s.get("name"): [c.get("name") for c in s.findall("testcase")] for s in root}
    assert set(suites) == {"w1", "w2"}
    assert all(len(cases) == 6 for cases in suites.values())
    assert "no model here" in (pytester.path / "stages.xml").read_text()


def test_nvidia_smi_query_and_listing_with_a_stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_opprof.gpus import nvidia_smi_query

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  -L) printf "GPU 0: NVIDIA H200 (UUID: a)\\nGPU 1: NVIDIA H200 (UUID: b)\\n";;\n'
        '  *) echo "NVIDIA H200";;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvidia_smi_query("name") == "NVIDIA H200"
    assert visible_gpus() == ["0", "1"]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert nvidia_smi_query("name") is None and visible_gpus() == []


def test_cache_key_names_the_gpu_model_not_the_worker_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two identical GPUs: a stage computed on one is reused on the other (an xdist run resumed
    with the workload on the other worker); a different model is not."""
    import pytest_opprof.gpus as gpus
    from pytest_opprof import pipeline

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$2" in 0|1) echo "NVIDIA H200";; 2) echo "NVIDIA A100-SXM4-80GB";; *) exit 6;; '
        "esac\n",
        encoding="utf-8",
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    gpus.gpu_kind.cache_clear()
    seen = {}
    for visible in ("0", "1", "2", "7"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        seen[visible] = pipeline._device_identity()
    gpus.gpu_kind.cache_clear()
    assert seen["0"] == seen["1"] == "NVIDIA H200"
    assert seen["2"] == "NVIDIA A100-SXM4-80GB"
    assert seen["7"] == "7"  # nvidia-smi did not answer: the index itself


def test_worker_cpu_slices_are_disjoint_and_cover_everything() -> None:
    from pytest_opprof.gpus import worker_cpus

    cpus = list(range(10))
    slices = [worker_cpus(f"gw{i}", 3, cpus) for i in range(3)]
    assert slices == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert worker_cpus("gw1", 2, [3, 7]) == [7]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_xdist_workers_and_their_children_get_their_own_cpus(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each workload's child process (where get_model_and_input runs) sees only its worker's
    CPU slice, Inductor's compile threads sized to it, and the host's CPUs named for its pool
    of compile workers; compile threads the user chose are kept, with no host named."""
    pytest.importorskip("xdist")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")  # the tests' own (conftest)
    body = (
        "import json, os, pathlib\n"
        "def get_model_and_input():\n"
        "    seen = {'cpus': sorted(os.sched_getaffinity(0)),\n"
        "            'threads': os.environ.get('TORCHINDUCTOR_COMPILE_THREADS'),\n"
        "            'own': os.environ.get('OPPROF_OWN_CPUS'),\n"
        "            'host': os.environ.get('OPPROF_HOST_CPUS')}\n"
        "    pathlib.Path(__file__).with_suffix('.json').write_text(json.dumps(seen))\n"
        "    raise ValueError('recorded')\n"
    )
    pytester.makepyfile(w1=body, w2=body)
    pytester.runpytest_subprocess("--opprof", "-n", "2", "--opprof-device=cpu")
    total = len(os.sched_getaffinity(0))
    import json

    for name in ("w1", "w2"):
        seen = json.loads((pytester.path / f"{name}.json").read_text())
        assert len(seen["cpus"]) in (total // 2, total - total // 2)
        assert seen["threads"] == str(len(seen["cpus"]))
        assert seen["own"] == "1"  # so its stage processes may compile beside a measurement
        # where Inductor's compile workers may run: every CPU the session had
        assert seen["host"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    pytester.runpytest_subprocess("--opprof", "-n", "2", "--opprof-device=cpu")
    seen = json.loads((pytester.path / "w1.json").read_text())
    assert seen["threads"] == "3" and seen["host"] is None


def test_under_xdist_the_workloads_start_longest_first(pytester: pytest.Pytester) -> None:
    """By the stage seconds of the newest stored run that has them: a workload it does not
    know first, then the longest; each workload's items in their order. Without ``-n`` the
    order is the given one."""
    pytest.importorskip("xdist")
    from pytest_opprof.history import StoredRun, StoredWorkload, save_run

    for name in ("w1", "w2", "w3", "w4"):
        pytester.makepyfile(**{name: "def get_model_and_input():\n    pass\n"})
    took = {"w1": 50.0, "w2": 10.0, "w3": 100.0}
    run = StoredRun(
        number=0,
        created="2026-12-04T10:00:00+00:00",
        device="NVIDIA H200",
        workloads=[
            StoredWorkload(name=n, path=f"{n}.py", status="passed", seconds=s)
            for n, s in took.items()
        ],
    )
    save_run(pytester.path / ".opprof-runs", run)
    (pytester.path / ".opprof-runs" / "0002.json").write_text("{not json")  # passed over

    def order(*args: str) -> list[str]:
        result = pytester.runpytest("--opprof", "--collect-only", "-q", *args)
        return [line for line in result.outlines if line.startswith("w")]

    parallel = order("-p", "xdist", "-n", "2")
    assert [i.split(".py")[0] for i in parallel[::6]] == ["w4", "w3", "w1", "w2"]
    assert [i.split("::")[1] for i in parallel[:6]] == [i.split("::")[1] for i in order()[:6]]
    assert [i.split(".py")[0] for i in order()[::6]] == ["w1", "w2", "w3", "w4"]


def test_a_stored_run_keeps_each_workloads_stage_seconds(pytester: pytest.Pytester) -> None:
    """What the next run orders by: every workload's stage seconds in all, from the items'
    reports on the xdist controller."""
    pytest.importorskip("xdist")
    from pytest_opprof.history import StoredRun, list_runs

    body = "def get_model_and_input():\n    raise ValueError('no model here')\n"
    pytester.makepyfile(w1=body, w2=body)
    pytester.runpytest_subprocess(
        "--opprof", "-n", "2", "--opprof-device=cpu", "--opprof-save", "-p", "no:cacheprovider"
    )
    (entry,) = list_runs(pytester.path / ".opprof-runs")
    assert isinstance(entry.run, StoredRun)
    seconds = {w.name: w.seconds for w in entry.run.workloads}
    assert set(seconds) == {"w1", "w2"}
    assert all(s is not None and s > 0 for s in seconds.values()), seconds
