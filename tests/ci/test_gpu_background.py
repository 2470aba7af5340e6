"""benchmarks/gpu_background.sh: a run longer than one call of a lent machine. A `wait` that
returns before the run ends brings back its stage logs so far, and with OPPROF_PARTIAL=1 the
workloads finished so far, in a folder pack_results.sh takes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONV_BLOCK = ROOT / "tests" / "data" / "h200" / "conv_block"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A run still going (its process a sleep), its session output and env, and a work folder
    holding one finished workload; the scripts in a checkout without .whl/."""
    (tmp_path / "repo" / "benchmarks").mkdir(parents=True)
    for script in ("gpu_background.sh", "gpu_env.sh", "summarize.py"):
        shutil.copy(ROOT / "benchmarks" / script, tmp_path / "repo" / "benchmarks" / script)
    shutil.copytree(CONV_BLOCK, tmp_path / "work" / "conv_block")
    name = f"test-{uuid.uuid4().hex[:8]}"
    folder = Path("/tmp/opprof-background") / name  # the script's own place for its runs
    folder.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    (folder / "pid").write_text(str(sleeper.pid))
    (folder / "session.out").write_text("the session's output so far\n")
    (folder / "env.txt").write_text("NVIDIA H200\n")
    try:
        yield name, tmp_path
    finally:
        sleeper.kill()
        sleeper.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait(name: str, tmp_path: Path, **env: str) -> Path:
    out = tmp_path / "out"
    run_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OUT": str(out),
        "OPPROF_WORK": str(tmp_path / "work"),
        **env,
    }
    script = tmp_path / "repo" / "benchmarks" / "gpu_background.sh"
    done = subprocess.run(
        ["bash", str(script), "wait", name, "0"], env=run_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "still running after 0 s" in done.stdout
    return out / name


def test_a_wait_cut_short_brings_back_the_logs_so_far(running: tuple[str, Path]) -> None:
    name, tmp_path = running
    (tmp_path / "work" / "host_load.txt").write_text("21:27:30.000000 0.950 20 16\n")
    got = _wait(name, tmp_path)
    with tarfile.open(got / "logs-so-far.tar.xz") as packed:
        names = packed.getnames()
    assert "work/conv_block/profiler_output/capture.log" in names
    assert "work/host_load.txt" in names  # the host's CPUs, beside the stage logs
    assert not (got / "partial").exists()  # only where asked


def test_with_partial_it_brings_back_the_workloads_finished_so_far(
    running: tuple[str, Path],
) -> None:
    part = _wait(*running, OPPROF_PARTIAL="1") / "partial"
    assert "| conv_block |" in (part / "summary.md").read_text()
    assert (part / "summary.json").is_file()
    assert (part / "pytest.log").read_text() == "the session's output so far\n"
    assert (part / "env.txt").read_text() == "NVIDIA H200\n"
    with tarfile.open(part / "results.tar.xz") as packed:
        assert "work/conv_block/profile.json.gz" in packed.getnames()


def test_a_table_that_failed_keeps_its_error_beside_the_archive(
    running: tuple[str, Path],
) -> None:
    """summarize.py failing on the GPU host leaves the archive to make the table from
    elsewhere, and says why it failed."""
    name, tmp_path = running
    broken = tmp_path / "repo" / "benchmarks" / "summarize.py"
    broken.write_text("import sys\nsys.exit('no module named pydantic')\n")
    part = _wait(name, tmp_path, OPPROF_PARTIAL="1") / "partial"
    assert "see summarize.err" in (part / "summary.md").read_text()
    assert "no module named pydantic" in (part / "summarize.err").read_text()
    assert (part / "results.tar.xz").is_file()


@pytest.mark.parametrize("ends", [True, False])
def test_a_run_that_ends_within_the_grace_comes_back_whole(
    running: tuple[str, Path], ends: bool
) -> None:
    """The last call's partial results are made while the run goes on; where the run packs
    its own archive within OPPROF_GRACE seconds after, that comes back too, so a workload
    that finished meanwhile is not lost. Where it does not, the call returns at the grace's
    end with the partial results alone."""
    import threading
    import time

    name, tmp_path = running
    folder = Path("/tmp/opprof-background") / name

    def finish() -> None:
        for f in ("results.tar.xz", "pytest.log", "summary.md", "summary.json"):
            (folder / f).write_text(f"the whole run's {f}\n")
        with (folder / "session.out").open("a") as out:
            out.write(f"packed: {folder}/results.tar.xz\n")

    timer = threading.Timer(1.0, finish)
    if ends:
        timer.start()
    t0 = time.perf_counter()
    try:
        got = _wait(name, tmp_path, OPPROF_PARTIAL="1", OPPROF_GRACE="4")
    finally:
        timer.cancel()
    assert (got / "partial" / "summary.md").is_file()
    if ends:
        assert (got / "results.tar.xz").read_text() == "the whole run's results.tar.xz\n"
        assert (got / "summary.md").read_text() == "the whole run's summary.md\n"
    else:
        assert not (got / "results.tar.xz").exists()
        assert time.perf_counter() - t0 >= 4  # it waited out the grace
