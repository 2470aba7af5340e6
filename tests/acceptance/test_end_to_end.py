"""What a user runs: ``pytest --opprof`` over a folder, end to end on the CPU fallback."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FAST = [
    "--opprof-warmup-iters=1",
    "--opprof-measure-iters=2",
    "--opprof-rounds=3",
    "--opprof-device=cpu",
]

TINY = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean(dim=(2, 3)))


def get_model_and_input():
    model = Tiny().to("cuda").eval()
    return model, torch.randn(2, 3, 8, 8, device="cuda")
"""

CRASH = """
import os, signal

def get_model_and_input():
    os.kill(os.getpid(), signal.SIGSEGV)
"""

HANG = """
import time

OPPROF = {"timeout": 3}

def get_model_and_input():
    time.sleep(600)
"""

BROKEN = """
import torch

def get_model_and_input():
    return torch.nn.Linear(4, 4), torch.randn(2, 4, device="cuda")
"""


@pytest.mark.reliability
def test_all_stages_on_a_tiny_workload(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        **{
            "work/tiny": textwrap.dedent(TINY),
            "work/broken": textwrap.dedent(BROKEN),
            "work/crash": textwrap.dedent(CRASH),
            "work/hang": textwrap.dedent(HANG),
        }
    )
    result = pytester.runpytest_subprocess(
        "--opprof",
        "work",
        *FAST,
        "-v",
        "--opprof-junit=stages.xml",
        "--junitxml=junit.xml",
        "--opprof-timing-processes=2",
        "--opprof-timing-servers=2",
    )
    result.stdout.fnmatch_lines(
        [
            "*broken.py::capture FAILED*",
            "*broken.py::propose SKIPPED*blocked by capture*",
            "*tiny.py::capture PASSED*",
            "*tiny.py::propose PASSED*",
            "*tiny.py::backend PASSED*",
            "*tiny.py::validate PASSED*",
            "*tiny.py::recapture PASSED*",
            "*tiny.py::speedup PASSED*",
        ]
    )
    result.stdout.fnmatch_lines(["*training mode*call .eval()*"])
    result.stdout.fnmatch_lines(["*the capture process was killed by SIGSEGV*"])
    result.stdout.fnmatch_lines(["*capture did not finish within 3 s and was stopped*"])
    result.stdout.fnmatch_lines(["*hang.py::propose SKIPPED*blocked by capture*"])
    out = pytester.path / "opprof-results"
    for rel in (
        "profile.json",
        "graph.json",
        "optimizations.json",
        "tiny_optimized.py",
        "test_tiny_optimized.py",
        "profiler_output/validation_report.json",
        "profiler_output/implementation_notes.md",
        "profile_optimized.json",
        "report.md",
    ):
        assert (out / "tiny" / rel).exists(), rel
    # The recapture's timing ran in two processes (the recapture's and one more), pooled.
    timing = json.loads((out / "tiny/profile_optimized.json").read_text())["timing"]
    assert timing["variants"]["optimized"]["processes"] == 2
    # three rounds each, and up to as many more where a round ran on a slowed host
    per_process = timing["variants"]["optimized"]["samples_per_process"]
    assert len(per_process) == 2 and all(3 <= n <= 6 for n in per_process), per_process
    pooled = [s for s in timing["speedups"] if s["candidate"] != "optimized_baseline_dtype"]
    assert pooled and all(len(s["process_ratios"]) == 2 for s in pooled)
    assert "timed again" in (out / "tiny/profiler_output/retime1.log").read_text()
    # the recapture started beside validation and timed once it had passed (the retime after
    # it, one after another without a GPU lock, found it passed)
    for name in ("recapture", "retime1"):
        log = (out / "tiny/profiler_output" / f"{name}.log").read_text()
        assert "validation passed the file compiled here" in log, log
    # the second timing process forked from a fork server of its own, the first from the
    # server every stage is forked from
    servers = {
        name: re.findall(r"forked from the fork server of pid (\d+)", log.read_text())
        for name in ("capture", "recapture", "retime1")
        for log in [out / "tiny/profiler_output" / f"{name}.log"]
    }
    assert servers["capture"] == servers["recapture"] != servers["retime1"]
    assert all(len(pids) == 1 for pids in servers.values()), servers
    # selection's reference: eager and torch.compile as the capture timed them
    captured = json.loads((out / "tiny/profile.json").read_text())["timing"]["variants"]
    selected = json.loads((out / "tiny/profiler_output/backend_selection.json").read_text())
    base = {v["name"]: v["latency"] for v in selected["variants"] if v["name"] in captured}
    assert base == {k: captured[k] for k in ("eager", "compile")}
    report = json.loads((out / "tiny/profiler_output/validation_report.json").read_text())
    assert report["overall"] == "READY_FOR_PROFILING"
    assert [s["status"] for s in report["steps"].values()] == ["pass"] * 6
    session = json.loads((out / "session.json").read_text())
    assert {w["name"]: w["status"] for w in session["workloads"]} == {
        "tiny": "passed",
        "broken": "error",
        "crash": "failed",
        "hang": "failed",
    }
    assert (out / "report.md").exists() and (pytester.path / "stages.xml").exists()
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="opprof.speedup"' in junit and 'name="opprof.optimized_ms"' in junit
    assert result.ret == 1  # the broken workload fails its items

    # A second run over the same tree: generated files and the output folder are not
    # collected, and the unchanged stages are read back from disk.
    again = pytester.runpytest_subprocess("--opprof", ".", *FAST, "-v", "-k", "tiny")
    again.stdout.no_fnmatch_line("*_optimized.py*")
    again.stdout.fnmatch_lines(["*tiny.py::speedup PASSED*"])
    assert again.ret == 0
    collected = pytester.runpytest_subprocess("--opprof", ".", "--collect-only", "-q")
    collected.stdout.fnmatch_lines(["*24 tests collected*"])

    # --opprof-from recomputes from a stage on and reads the earlier ones from disk; here
    # with the stock baseline as the gate's, measured beside the others and validated.
    profile = out / "tiny" / "profile.json"
    selection = out / "tiny" / "profiler_output" / "backend_selection.json"
    before = (profile.stat().st_mtime_ns, selection.stat().st_mtime_ns)
    resumed = pytester.runpytest_subprocess(
        "--opprof",
        "work/tiny.py",
        *FAST,
        "--opprof-from=backend",
        "--opprof-baseline=stock",
        "--opprof-timing-processes=2",
    )
    assert resumed.ret == 0
    assert profile.stat().st_mtime_ns == before[0]
    assert selection.stat().st_mtime_ns > before[1]
    # selection tried the stock recipe the stock task kept in place of the ladder's plan
    chosen = json.loads(selection.read_text())
    assert any("stock-recipe" in v["name"] for v in chosen["variants"]), chosen["variants"]
    stock = json.loads((out / "tiny/profiler_output/stock_baseline.json").read_text())
    assert stock["recipe"] in ("autocast", "cast") and stock["dtype"] == "bfloat16", stock
    assert all(t["numerics"]["ok"] for t in stock["trials"] if t["error"] is None)
    timing = json.loads((out / "tiny/profile_optimized.json").read_text())["timing"]
    assert timing["variants"]["stock"]["processes"] == 2  # timed in every timing process
    tiny = json.loads((out / "session.json").read_text())["workloads"][0]
    assert tiny["baseline"] == "stock" and tiny["speedup_vs_stock"] == tiny["speedup"]
    assert "stock PyTorch (gate)" in (out / "tiny/report.md").read_text()
    assert "over stock (95% CI)" in (out / "report.md").read_text()

    # Validation again with the later stages deselected: nothing starts beside it.
    recaptured = out / "tiny/profiler_output/recapture.log"
    before_log = recaptured.stat().st_mtime_ns
    deselected = pytester.runpytest_subprocess(
        "--opprof", "work/tiny.py", *FAST, "-v", "--opprof-from=validate", "-k", "validate"
    )
    deselected.stdout.fnmatch_lines(["*tiny.py::validate PASSED*", "*1 passed*"])
    assert recaptured.stat().st_mtime_ns == before_log

    # --opprof-stage runs one stage; a missing artifact before it is a clear error.
    only = pytester.runpytest_subprocess(
        "--opprof", "work/tiny.py", *FAST, "-v", "--opprof-stage=propose"
    )
    only.stdout.fnmatch_lines(["*tiny.py::propose PASSED*", "*1 passed*"])
    profile.unlink()
    missing = pytester.runpytest_subprocess(
        "--opprof", "work/tiny.py", *FAST, "--opprof-stage=propose"
    )
    missing.stdout.fnmatch_lines(["*profile.json: not found*"])


def test_two_shards_merged_give_the_unsharded_report(pytester: pytest.Pytester) -> None:
    """Each shard runs on a copy of the unsharded run's output folder, so its stages are read
    back from disk and every measurement is the unsharded run's: what differs, if anything, is
    the sharding and the merge."""
    import shutil

    pytester.makepyfile(
        **{"work/tiny": textwrap.dedent(TINY), "work/broken": textwrap.dedent(BROKEN)}
    )
    whole = pytester.path / "whole"
    pytester.runpytest_subprocess("--opprof", "work", *FAST, f"--opprof-out={whole}")
    shards = []
    for k in (1, 2):
        shard = pytester.path / f"shard{k}"
        shutil.copytree(whole, shard)
        (shard / "session.json").unlink()
        shard_run = pytester.runpytest_subprocess(
            "--opprof", "work", *FAST, f"--opprof-out={shard}", f"--opprof-shard={k}/2", "-v"
        )
        shard_run.stdout.fnmatch_lines(["*::speedup*"])
        shards.append(shard)
    ran = [
        {w["name"] for w in json.loads((s / "session.json").read_text())["workloads"]}
        for s in shards
    ]
    assert ran[0] | ran[1] == {"broken", "tiny"} and not ran[0] & ran[1]
    merged_dir = pytester.path / "merged"
    merge = pytester.run(
        sys.executable, "-m", "pytest_opprof.cli", "merge", *shards, "--out", merged_dir
    )
    assert "merged 2 shard(s)" in merge.stdout.str()

    def text(folder: Path, name: str) -> str:
        """The file with its output folder's name (in paths) as OUT."""
        return (folder / name).read_text().replace(str(folder), "OUT").replace(folder.name, "OUT")

    session = text(whole, "session.json")
    assert '"report": "OUT/tiny/report.md"' in session
    assert text(merged_dir, "session.json") == session
    assert text(merged_dir, "report.md") == text(whole, "report.md")


def test_reported_measurements_wait_for_the_hosts_compiles_and_selection_does_not(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a GPU lock (here on the CPU, named by the environment as a session on a GPU names
    it), the capture's and the recapture's measurements are quiet: while another process
    compiles off the GPU (holds ``lock.cpu`` shared), they wait for it, and say so in their
    logs. A selection measurement goes ahead beside the same compile."""
    import fcntl
    import os
    import threading
    import time

    from pytest_opprof import devicelock

    lock = pytester.path / "locks" / "gpu.lock"
    lock.parent.mkdir()
    monkeypatch.setenv(devicelock.LOCK_ENV, str(lock))
    logs = pytester.path / "opprof-results" / "tiny" / "profiler_output"
    fd = os.open(lock.with_name("gpu.lock.cpu"), os.O_RDWR | os.O_CREAT, 0o666)
    seen: dict[str, bool] = {}
    stop = threading.Event()

    def said(log: str, line: str) -> bool:
        path = logs / log
        return path.exists() and line in path.read_text(errors="replace")

    def compiling(log: str, until: str, next_log: str) -> None:
        """Once ``log``'s stage has begun, hold the host busy (a neighbour compiling off the
        GPU) until ``log`` says ``until``, or the next stage has begun without it."""
        while not stop.is_set() and not (logs / log).exists():
            time.sleep(0.05)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            while not stop.is_set() and not (logs / next_log).exists():
                if said(log, until):
                    seen[log] = True
                    time.sleep(0.5)  # a compile that goes on a while after the wait began
                    return
                time.sleep(0.05)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def neighbour() -> None:
        compiling("capture.log", devicelock.WAITING_QUIET, "backend.log")
        compiling("backend.log", "task backend done", "validate.log")
        compiling("recapture.log", devicelock.WAITING_QUIET, "speedup.log")

    thread = threading.Thread(target=neighbour, daemon=True)
    thread.start()
    pytester.makepyfile(**{"work/tiny": textwrap.dedent(TINY)})
    try:
        result = pytester.runpytest_subprocess("--opprof", "work", *FAST, "-v")
    finally:
        stop.set()
        thread.join(10)
        os.close(fd)
    result.stdout.fnmatch_lines(["*tiny.py::speedup PASSED*"])
    assert seen == {"capture.log": True, "backend.log": True, "recapture.log": True}
    for log in ("capture.log", "recapture.log"):
        text = (logs / log).read_text()
        waited = float(text.split(devicelock.QUIETED)[1].split()[0])
        assert waited >= 0.4, log  # it waited for the compile, and measured only after it
    select = (logs / "backend.log").read_text()
    assert "timed " in select and devicelock.WAITING_QUIET not in select
