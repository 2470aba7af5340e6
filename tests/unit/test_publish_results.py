"""benchmarks/publish_results.sh and pack_results.sh's publishing: a packed run's raw files go to
the orphan ``results`` branch at their path, main keeps the run's summary, and main's index,
HEAD and working tree are left as they were. Each test runs in a repository of its own."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
    )
    return env


def _git(repo: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(
        ["git", *args], cwd=repo, env=_env(), capture_output=True, text=True, check=check
    )
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A main branch with one commit, the two scripts, and a change staged but not committed."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for script in ("publish_results.sh", "pack_results.sh"):
        shutil.copy(ROOT / "benchmarks" / script, repo / "benchmarks" / script)
    (repo / "README.md").write_text("main\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "main")
    (repo / "README.md").write_text("main, edited\n")
    _git(repo, "add", "README.md")
    return repo


def _publish(repo: Path, *dirs: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "benchmarks/publish_results.sh", *dirs],
        cwd=repo,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def _run(repo: Path, rel: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = repo / rel / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_run_goes_to_an_orphan_branch_and_main_stays_as_it_was(repo: Path) -> None:
    head, staged = _git(repo, "rev-parse", "HEAD"), _git(repo, "diff", "--cached", "--name-only")
    run = "benchmarks/results/h200-x/plain-n7"
    _run(repo, run, {"summary.md": "| t |\n", "gpt2/profiler_output/capture.log": "[opprof]\n"})
    (repo / run / "tool.sh").write_text("#!/bin/sh\n")
    (repo / run / "tool.sh").chmod(0o755)
    done = _publish(repo, run)
    assert done.returncode == 0, done.stderr
    assert "push with: git push origin results" in done.stdout
    assert _git(repo, "ls-tree", "-r", "--name-only", "results").splitlines() == [
        f"{run}/gpt2/profiler_output/capture.log",
        f"{run}/summary.md",
        f"{run}/tool.sh",
    ]
    assert _git(repo, "ls-tree", "results", f"{run}/tool.sh").startswith("100755 ")
    assert _git(repo, "show", f"results:{run}/summary.md") == "| t |"
    # an orphan: no history shared with main
    assert subprocess.run(
        ["git", "merge-base", "main", "results"], cwd=repo, env=_env(), capture_output=True
    ).returncode
    # main: the same commit, the same staged change, the run still untracked in the tree
    assert _git(repo, "rev-parse", "HEAD") == head
    assert _git(repo, "diff", "--cached", "--name-only") == staged == "README.md"
    assert _git(repo, "ls-files", "benchmarks/results") == ""
    assert (repo / run / "summary.md").is_file()

    # Published again: the run's folder replaced, other runs kept, one commit on top.
    first = _git(repo, "rev-parse", "results")
    other = "benchmarks/results/h200-x/counters-n7"
    _run(repo, other, {"summary.md": "| c |\n"})
    assert _publish(repo, other).returncode == 0
    (repo / run / "gpt2" / "profiler_output" / "capture.log").unlink()
    _run(repo, run, {"summary.md": "| t2 |\n"})
    assert _publish(repo, run).returncode == 0
    assert _git(repo, "rev-parse", "results~2") == first
    assert _git(repo, "ls-tree", "-r", "--name-only", "results").splitlines() == [
        f"{other}/summary.md",
        f"{run}/summary.md",
        f"{run}/tool.sh",
    ]
    assert _git(repo, "show", f"results:{run}/summary.md") == "| t2 |"
    again = _publish(repo, run)
    assert again.returncode == 0 and "already holds" in again.stdout
    assert _git(repo, "rev-parse", "HEAD") == head
    assert _git(repo, "diff", "--cached", "--name-only") == "README.md"


def test_publish_says_what_it_needs(repo: Path, tmp_path: Path) -> None:
    assert "usage:" in _publish(repo).stderr
    outside = tmp_path / "outside"
    outside.mkdir()
    done = _publish(repo, str(outside))
    assert done.returncode == 2 and "not inside" in done.stderr
    missing = _publish(repo, "benchmarks/results/nope")
    assert missing.returncode == 2 and "not a folder" in missing.stderr
    assert _git(repo, "rev-parse", "-q", "--verify", "results", check=False) == ""


def _gpu_session_out(tmp_path: Path) -> Path:
    """A folder as gpu_session.sh writes it under $OUT, with one workload."""
    work = tmp_path / "w-p"
    w = work / "conv_block"
    (w / "profiler_output").mkdir(parents=True)
    (w / "profile.json").write_text('{"name": "profile.json"}')
    (w / "profiler_output" / "capture.log").write_text("[opprof] +  0.0 s  forked\n")
    (work / "wall_seconds.txt").write_text("176 -n 7\n")
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(src / "results.tar.xz", "w:xz") as tar:
        tar.add(work, arcname="w-p")
    for name in ("env.txt", "pytest.log", "summary.md"):
        (src / name).write_text(name)
    (src / "summary.json").write_text('{"workloads": {}}')
    return src


@pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")
def test_pack_into_benchmarks_results_publishes_the_run_and_keeps_its_summary(
    repo: Path, tmp_path: Path
) -> None:
    src = _gpu_session_out(tmp_path)
    run = "benchmarks/results/h200-x/plain-n7"
    done = subprocess.run(
        ["bash", "benchmarks/pack_results.sh", str(src), run],
        cwd=repo,
        env=_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    kept = sorted(p.relative_to(repo / run).as_posix() for p in (repo / run).rglob("*"))
    assert kept == ["env.txt", "summary.json.gz", "summary.md", "wall_seconds.txt"]
    assert json.loads(gzip.decompress((repo / run / "summary.json.gz").read_bytes())) == {
        "workloads": {}
    }
    published = _git(repo, "ls-tree", "-r", "--name-only", "results").splitlines()
    assert f"{run}/conv_block/profile.json.gz" in published
    assert f"{run}/conv_block/profiler_output/capture.log" in published
    assert f"{run}/pytest.log" in published and f"{run}/summary.json" in published
    assert _git(repo, "diff", "--cached", "--name-only") == "README.md"
