"""Live progress of long stages (``progress``): the files a stage process keeps for its span,
the lines read from them, and the lines in a real pytest session's terminal."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest

from pytest_opprof import progress


def test_a_stage_process_has_a_progress_file_for_its_span(tmp_path: Path) -> None:
    log = tmp_path / "capture.log"
    with progress.running(tmp_path, "conv_block", "capture", log):
        (found,) = list(progress.folder(tmp_path).glob("*.json"))
        record = json.loads(found.read_text())
        assert (record["workload"], record["task"], record["log"]) == (
            "conv_block",
            "capture",
            str(log),
        )
        assert abs(record["started"] - time.time()) < 60
    assert not list(progress.folder(tmp_path).glob("*"))


def test_an_unwritable_progress_folder_costs_the_lines_not_the_stage(tmp_path: Path) -> None:
    blocker = tmp_path / "out"
    blocker.write_text("a file where the folder would be")
    with progress.running(blocker, "w", "capture", tmp_path / "x.log"):
        ran = True
    assert ran


def test_the_lines_name_workload_task_time_and_last_phase(tmp_path: Path) -> None:
    log = tmp_path / "backend.log"
    log.write_text(
        "[opprof] +    1.2 s  torch imported\nnoise\n"
        "[opprof] +   40.0 s  timed cuda_graphs-model: 1.023x\nmore noise\n"
    )
    where = progress.folder(tmp_path)
    with (
        progress.running(tmp_path, "gpt2", "backend", log),
        progress.running(tmp_path, "mlp", "capture", tmp_path / "missing.log"),
    ):
        now = time.time()
        assert progress.lines(where, now, older_than=60) == []
        later = progress.lines(where, now + 95, older_than=60)
    assert later == ["gpt2 backend 95 s: timed cuda_graphs-model: 1.023x", "mlp capture 95 s"]
    (where / "torn.json").write_text("{")
    assert progress.lines(where, time.time(), 0) == []


def test_the_ticker_writes_until_stopped(tmp_path: Path) -> None:
    written: list[str] = []
    with progress.running(tmp_path, "w", "recapture", tmp_path / "r.log"):
        ticker = progress.Ticker(progress.folder(tmp_path), 0.05, written.append).start()
        deadline = time.time() + 10
        while not written and time.time() < deadline:
            time.sleep(0.05)
    ticker.stop()
    assert written and written[0].startswith("w recapture ")
    count = len(written)
    time.sleep(0.2)
    assert len(written) == count
    assert not progress.folder(tmp_path).exists()  # emptied, then removed


HANG = """
import time

OPPROF = {"timeout": 4}

def get_model_and_input():
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_long_stage_shows_in_the_terminal(pytester: pytest.Pytester) -> None:
    """A stage process that runs for seconds shows, once a second, as a line of its own."""
    pytester.makepyfile(**{"work/hang": textwrap.dedent(HANG)})
    result = pytester.runpytest_subprocess(
        "--opprof", "work", "--opprof-device=cpu", "--opprof-progress=1", "-p", "no:cacheprovider"
    )
    result.stdout.fnmatch_lines(["opprof: hang capture * s*"])
    result.stdout.fnmatch_lines(["*capture did not finish within 4 s*"])
    quiet = pytester.runpytest_subprocess(
        "--opprof", "work", "--opprof-device=cpu", "--opprof-progress=0", "-p", "no:cacheprovider"
    )
    quiet.stdout.no_fnmatch_line("opprof: hang capture*")
