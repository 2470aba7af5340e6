"""The README's main command works as written: the pipeline on an example, end to end."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def main_command() -> list[str]:
    """The pytest part of the command under ``<!-- main-command -->`` (the install before it is
    what this session already did)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- main-command -->", 1)[1]
    line = re.search(r"^pip install .*$", block, re.MULTILINE)
    assert line, "no command under <!-- main-command -->"
    run = line[0].split("&&", 1)[1].strip()
    words = shlex.split(run)
    assert words[0] == "pytest", run
    return words[1:]


@pytest.mark.slow
def test_the_readme_main_command_runs_the_pipeline(tmp_path: Path) -> None:
    args = main_command()
    assert "--opprof" in args
    # its artifacts in a folder of the test's, not the checkout's
    found = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *args,
            f"--opprof-out={tmp_path}",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert found.returncode == 0, found.stdout[-3000:] + found.stderr[-2000:]
    assert re.search(r"\b6 passed\b", found.stdout), found.stdout[-2000:]
    workload = next(a for a in args if not a.startswith("-"))
    assert (tmp_path / Path(workload).name / "report.md").is_file()
