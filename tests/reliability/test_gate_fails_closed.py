"""The gate fails closed: a workload that never reached a measured speedup fails its gate item
and the session's exit status, whatever was selected (issue #37)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_opprof.options import OpprofOptions
from pytest_opprof.pipeline import StageOutcome, WorkloadRun
from pytest_opprof.session import OpprofSession
from pytest_opprof.workload import discover

RAISES = """
def get_model_and_input():
    raise RuntimeError("no weights on this machine")
"""

FAST = [
    "--opprof-warmup-iters=1",
    "--opprof-measure-iters=2",
    "--opprof-rounds=3",
    "--opprof-device=cpu",
    "-p",
    "no:cacheprovider",
]


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--opprof", *FAST, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.reliability
@pytest.mark.parametrize(
    "selection",
    [["-k", "speedup"], ["raises.py::speedup"], ["--opprof-stage=report"]],
    ids=["k-speedup", "node-id", "stage-report"],
)
def test_a_broken_workload_fails_its_gate_item_selected_alone(
    tmp_path: Path, selection: list[str]
) -> None:
    """Before: "1 skipped", exit 0, while session.json said gate_passed false."""
    (tmp_path / "raises.py").write_text(textwrap.dedent(RAISES))
    args = selection if selection[0].startswith("raises.py") else ["raises.py", *selection]
    result = _pytest(tmp_path, "-v", *args)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "raises.py::speedup FAILED" in out
    assert "gate not passed: capture: " in out
    # with --opprof-stage=report the capture is read from disk, where there is none
    assert ("no weights on this machine" in out) != ("--opprof-stage=report" in selection)
    session = json.loads((tmp_path / "opprof-results" / "session.json").read_text())
    assert session["gate_passed"] is False
    assert [w["status"] for w in session["workloads"]] in (["error"], ["failed"])


@pytest.mark.slow
@pytest.mark.reliability
def test_a_session_whose_gate_failed_exits_non_zero_whatever_was_selected(
    tmp_path: Path,
) -> None:
    """A workload summary that failed in this session (another worker's, say) fails the
    session even where no item of this process failed: the exit status follows session.json."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import json
            from pathlib import Path

            def pytest_sessionstart(session):
                folder = Path("opprof-results/elsewhere")
                folder.mkdir(parents=True)
                (folder / "workload_summary.json").write_text(json.dumps({
                    "name": "elsewhere", "path": "elsewhere.py", "status": "failed",
                    "stage": "validate", "message": "validate: BLOCKED",
                }))
            """
        )
    )
    (tmp_path / "test_plain.py").write_text("def test_ok():\n    pass\n")
    result = _pytest(tmp_path, "test_plain.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "opprof gate FAILED for elsewhere: exit status 1" in result.stdout
    session = json.loads((tmp_path / "opprof-results" / "session.json").read_text())
    assert session["gate_passed"] is False


def _passed_through_recapture(tmp_path: Path) -> tuple[OpprofSession, WorkloadRun]:
    path = tmp_path / "w.py"
    path.write_text("def get_model_and_input():\n    return None\n")
    spec = discover(path)
    assert spec is not None
    session = OpprofSession(options=OpprofOptions(out=tmp_path / "out", device="cpu"))
    wr = session.workload(spec)
    for stage in ("capture", "propose", "backend", "validate", "recapture"):
        wr.outcomes[stage] = StageOutcome(stage, "passed", "ok")
    return session, wr


@pytest.mark.parametrize("content", [None, "{", '{"schema_version": "2.0"}'])
def test_a_passed_recapture_without_a_readable_profile_is_an_error(
    tmp_path: Path, content: str | None
) -> None:
    """Before: the summary stayed "passed" with no speedup at all."""
    session, wr = _passed_through_recapture(tmp_path)
    if content is not None:
        (tmp_path / "out" / "w").mkdir(parents=True)
        (tmp_path / "out" / "w" / "profile_optimized.json").write_text(content)
    summary = session.summarize(wr)
    assert summary.status == "error"
    assert summary.message.startswith("recapture: ") and "profile_optimized.json" in summary.message
    outcome = session.report(wr)
    assert outcome.status == "failed" and "gate not passed" in outcome.message


def test_a_blocked_workload_fails_the_report_stage_with_the_cause(tmp_path: Path) -> None:
    session, wr = _passed_through_recapture(tmp_path)
    wr.outcomes["validate"] = StageOutcome("validate", "failed", "BLOCKED — fix step 6")
    wr.outcomes["recapture"] = StageOutcome("recapture", "skipped", "blocked by validate")
    outcome = session.report(wr)
    assert outcome.status == "failed"
    assert outcome.message == "gate not passed: validate: BLOCKED — fix step 6"
