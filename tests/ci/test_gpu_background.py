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
    got = _wait(*running)
    assert (got / "logs-so-far.tar.xz").is_file()
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
