"""Bad artifacts, interruptions and environment faults lose nothing and explain themselves.

One real capture of a tiny workload (CPU fallback) is made once per module and copied into each
test's folder, so every case starts from artifacts the pipeline really wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

FAST = [
    "--opprof-warmup-iters=1",
    "--opprof-measure-iters=2",
    "--opprof-rounds=3",
    "--opprof-device=cpu",
    "-p",
    "no:cacheprovider",
]

TINY = """
import torch
from torch import nn


def get_model_and_input():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("cuda").eval()
    return model, torch.randn(4, 8, device="cuda")
"""


def pytest_run(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--opprof", *FAST, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("captured")
    (root / "tiny.py").write_text(textwrap.dedent(TINY))
    result = pytest_run(root, "tiny.py", "--opprof-stage=capture")
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.fixture
def work(captured: Path, tmp_path: Path) -> Path:
    shutil.copytree(captured, tmp_path / "w")
    return tmp_path / "w"


def _no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    text = result.stdout + result.stderr
    assert "INTERNALERROR" not in text
    assert "Traceback (most recent call last)" not in text


def test_truncated_profile_names_the_file_and_resumes_after_the_fix(work: Path) -> None:
    profile = work / "opprof-results" / "tiny" / "profile.json"
    profile.write_text(profile.read_text()[:200])
    bad = pytest_run(work, "tiny.py", "--opprof-stage=propose")
    assert bad.returncode == 1
    assert "profile.json: not valid JSON" in bad.stdout
    _no_traceback(bad)
    fixed = pytest_run(work, "tiny.py", "--opprof-from=capture", "--opprof-stage=capture")
    assert fixed.returncode == 0, fixed.stdout
    again = pytest_run(work, "tiny.py", "--opprof-stage=propose")
    assert again.returncode == 0, again.stdout
    assert (work / "opprof-results" / "tiny" / "optimizations.json").exists()


def test_hand_edited_field_names_the_field(work: Path) -> None:
    profile = work / "opprof-results" / "tiny" / "profile.json"
    data = json.loads(profile.read_text())
    data["timing"]["clock"] = "sundial"
    profile.write_text(json.dumps(data))
    bad = pytest_run(work, "tiny.py", "--opprof-stage=propose")
    assert "field 'timing.clock'" in bad.stdout
    _no_traceback(bad)


def test_schema_from_the_future(work: Path) -> None:
    profile = work / "opprof-results" / "tiny" / "profile.json"
    data = json.loads(profile.read_text())
    data["schema_version"] = "9.0"
    profile.write_text(json.dumps(data))
    bad = pytest_run(work, "tiny.py", "--opprof-stage=propose")
    assert "newer than this pytest-opprof reads" in bad.stdout
    assert "upgrade pytest-opprof" in bad.stdout
    _no_traceback(bad)


def test_a_corrupt_cached_artifact_is_recomputed_on_a_plain_run(work: Path) -> None:
    profile = work / "opprof-results" / "tiny" / "profile.json"
    profile.write_text("{")
    result = pytest_run(work, "tiny.py", "--opprof-stage=capture")
    assert result.returncode == 0, result.stdout
    json.loads(profile.read_text())


def test_generated_backend_deleted_between_stages(work: Path) -> None:
    done = pytest_run(work, "tiny.py", "--opprof-from=propose", "--opprof-stage=backend")
    assert done.returncode == 0, done.stdout
    generated = work / "opprof-results" / "tiny" / "tiny_optimized.py"
    generated.unlink()
    bad = pytest_run(work, "tiny.py", "--opprof-stage=validate")
    assert "tiny_optimized.py" in bad.stdout and "missing" in bad.stdout
    assert "--opprof-from=backend" in bad.stdout
    _no_traceback(bad)
    fixed = pytest_run(work, "tiny.py", "--opprof-from=backend", "--opprof-stage=validate")
    assert fixed.returncode == 0, fixed.stdout


def interrupt(cwd: Path, started: Path, *args: str) -> None:
    """Run ``pytest --opprof slow.py`` and press Ctrl-C a second after ``started`` (the stage
    child's log) appears."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--opprof", *FAST, "slow.py", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # Ctrl-C as at a terminal: a test run started in the background (nohup, `&`) ignores
        # SIGINT, and an ignored signal stays ignored across exec, so Python would too.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    while not started.exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=60)


def test_interrupted_capture_leaves_no_half_written_artifact(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(TINY).replace(
            "def get_model_and_input():",
            "import time\n\ndef get_model_and_input():\n    time.sleep(3)",
        )
    )
    out = tmp_path / "opprof-results" / "slow"
    interrupt(tmp_path, out / "profiler_output" / "capture.log")
    time.sleep(4)  # a runaway child would write profile.json by now
    assert not (out / "profile.json").exists()
    assert not list(out.rglob("*.tmp"))
    again = pytest_run(tmp_path, "slow.py", "--opprof-stage=capture")
    assert again.returncode == 0, again.stdout
    assert (out / "profile.json").exists()


def test_interrupted_backend_leaves_no_artifact_and_only_it_reruns(tmp_path: Path) -> None:
    """Killed while measured selection runs: no selection, no generated file; the next run
    takes capture and propose from the cache and recomputes the backend only."""
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(TINY).replace(
            "def get_model_and_input():",
            "import os, time\n\ndef get_model_and_input():\n"
            "    if os.path.exists('slow-now'):\n        time.sleep(3)",
        )
    )
    first = pytest_run(tmp_path, "slow.py", "--opprof-stage=capture")
    assert first.returncode == 0, first.stdout
    second = pytest_run(tmp_path, "slow.py", "--opprof-stage=propose")
    assert second.returncode == 0, second.stdout
    out = tmp_path / "opprof-results" / "slow"
    before = {f: (out / f).stat().st_mtime_ns for f in ("profile.json", "optimizations.json")}
    (tmp_path / "slow-now").touch()
    interrupt(tmp_path, out / "profiler_output" / "backend.log", "--opprof-stage=backend")
    time.sleep(4)  # a runaway child would write the selection by now
    assert not (out / "profiler_output" / "backend_selection.json").exists()
    assert not (out / "slow_optimized.py").exists()
    assert not list(out.rglob("*.tmp"))
    (tmp_path / "slow-now").unlink()
    again = pytest_run(tmp_path, "slow.py", "-v")
    assert again.returncode == 0, again.stdout
    assert (out / "slow_optimized.py").exists()
    after = {f: (out / f).stat().st_mtime_ns for f in before}
    assert after == before  # capture and propose came from the cache


def test_unwritable_output_folder(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    (tmp_path / "blocker").write_text("a file where the output folder should be")
    bad = pytest_run(tmp_path, "tiny.py", "--opprof-out=blocker/out", "--opprof-stage=capture")
    assert bad.returncode == 1
    assert "--opprof-out" in bad.stdout and "writable" in bad.stdout
    _no_traceback(bad)


def test_inductor_compile_failure_is_explained(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    env = {**os.environ, "CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ic")}
    bad = subprocess.run(
        [sys.executable, "-m", "pytest", "--opprof", *FAST, "tiny.py", "--opprof-stage=capture"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert bad.returncode == 1
    assert "torch.compile(backend='inductor') failed" in bad.stdout, bad.stdout[-3000:]
    assert "InvalidCxxCompiler" in bad.stdout
    _no_traceback(bad)


@pytest.mark.parametrize(
    ("option", "accepted"),
    [
        ("--opprof-baseline=fastest", "eager, compile, best"),
        ("--opprof-min-speedup=-1", "> 0"),
        ("--opprof-ncu=sometimes", "auto, on, off"),
        ("--opprof-from=compile", "capture, propose"),
    ],
)
def test_invalid_option_is_a_usage_error(tmp_path: Path, option: str, accepted: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--opprof", option],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 4
    assert accepted in result.stderr
    _no_traceback(result)


def test_a_named_file_without_the_entry_point_says_so(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    (tmp_path / "helper.py").write_text("import torch\n\ndef make_model():\n    return None\n")
    result = pytest_run(tmp_path, "helper.py", "tiny.py", "--opprof-stage=capture", "-v")
    assert result.returncode == 1, result.stdout
    assert "helper.py: no top-level `def get_model_and_input()`" in result.stdout
    assert "tiny.py::capture PASSED" in result.stdout
    _no_traceback(result)
