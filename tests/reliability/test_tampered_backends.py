"""Generated backends edited by hand or by an adversary, end to end on the CPU fallback: the
validator takes nothing from the file it checks, and nothing unvalidated is timed (issue #37).

One real run of a tiny workload is made once per module and copied into each
test's folder."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
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

SCALED = """

class _Scaled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args) * 1.05


def _scaled(entry):
    def get_model_and_input():
        model, x = entry()
        return _Scaled(model).eval(), x

    return get_model_and_input

"""

TAMPERS = {
    # the file's own tolerance, loose enough for its own generated tests to pass
    "own tolerance": SCALED
    + "get_model_and_input = _scaled(get_model_and_input)\nRTOL, ATOL = 1.0, 1.0\n",
    # the checks themselves patched in the process that imports the file
    "patched checker": SCALED
    + "get_model_and_input = _scaled(get_model_and_input)\nRTOL, ATOL = 1.0, 1.0\n"
    + "import pytest_opprof.numerics as _v\n"
    + "_v.check_numerics = lambda *a, **k: _v.Numerics(max_abs_err=0, rel_err=0, rtol=1, "
    + "atol=1, dtype='float32', ok=True)\n",
    # the reference taken through the file's imports: its tests compare the cheat with itself
    "own reference": SCALED
    + "baseline.get_model_and_input = _scaled(baseline.get_model_and_input)\n",
}


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=900, check=False
    )


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("validated")
    (root / "tiny.py").write_text(textwrap.dedent(TINY))
    result = _run(root, "-m", "pytest", "--opprof", "tiny.py", *FAST)
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.fixture
def work(validated: Path, tmp_path: Path) -> Path:
    shutil.copytree(validated, tmp_path / "w")
    return tmp_path / "w"


def _generated(work: Path) -> Path:
    return work / "opprof-results" / "tiny" / "tiny_optimized.py"


def _report(work: Path) -> dict[str, object]:
    path = work / "opprof-results" / "tiny" / "profiler_output" / "validation_report.json"
    data: dict[str, object] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_opprof_validate_blocks_a_tampered_file_naming_the_check(work: Path, tamper: str) -> None:
    """Before: each passed, held to the file's RTOL, compared with the file's own baseline, or
    judged by checks the file had patched in the process that imported it."""
    generated = _generated(work)
    generated.write_text(generated.read_text() + TAMPERS[tamper])
    result = _run(work, "-m", "pytest_opprof.cli", "validate", str(generated), "--device=cpu")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    # the file's own tests are fooled; the validator is not
    assert re.search(r"^tests +pass ", out, re.MULTILINE), out
    assert "BLOCKED — fix step 6 (numerics): equivalent: relative error 5.00e-02 > limit" in out
    report = _report(work)
    assert report["overall"] == "BLOCKED"
    assert report["sha256"] == hashlib.sha256(generated.read_bytes()).hexdigest()


def test_resuming_at_the_recapture_validates_an_edited_file_first(work: Path) -> None:
    """Before: --opprof-from=recapture reused the old report and timed the edited file."""
    generated = _generated(work)
    generated.write_text(generated.read_text() + TAMPERS["own tolerance"])
    timed = work / "opprof-results" / "tiny" / "profile_optimized.json"
    before = timed.read_bytes()  # the honest file's, from the first run
    result = _run(
        work, "-m", "pytest", "--opprof", "tiny.py", *FAST, "--opprof-from=recapture", "-v"
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "tiny.py::validate FAILED" in out and "BLOCKED — fix step 6 (numerics)" in out
    assert "tiny.py::recapture SKIPPED" in out and "tiny.py::speedup FAILED" in out
    assert timed.read_bytes() == before
    # the recapture started beside validation compiled the edited file and timed nothing
    log = (work / "opprof-results" / "tiny" / "profiler_output" / "recapture.log").read_text()
    assert "nothing timed: validation did not pass the file compiled here" in log, log
    assert _report(work)["overall"] == "BLOCKED"


def test_an_honest_edit_is_validated_again_then_timed(work: Path) -> None:
    generated = _generated(work)
    before = _report(work)["sha256"]
    generated.write_text(generated.read_text() + "\n# reviewed by hand\n")
    result = _run(
        work, "-m", "pytest", "--opprof", "tiny.py", *FAST, "--opprof-from=recapture", "-v"
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "tiny.py::recapture PASSED" in out
    report = _report(work)
    assert report["overall"] == "READY_FOR_PROFILING" and report["sha256"] != before
    assert (work / "opprof-results" / "tiny" / "profile_optimized.json").exists()
