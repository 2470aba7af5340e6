"""What a stage's cache key depends on: an edited generated file or a change to this package's
own source recomputes what it produced (issue #37)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_opprof import pipeline
from pytest_opprof.options import OpprofOptions
from pytest_opprof.pipeline import WorkloadRun
from pytest_opprof.workload import discover


@pytest.fixture
def run(tmp_path: Path) -> WorkloadRun:
    path = tmp_path / "w.py"
    path.write_text("def get_model_and_input():\n    return None\n")
    spec = discover(path)
    assert spec is not None
    wr = WorkloadRun(spec=spec, options=OpprofOptions(out=tmp_path / "out"), name="w")
    wr.generated.parent.mkdir(parents=True)
    wr.generated.write_text("BACKEND = 'opprof_w'\n")
    return wr


def test_an_edited_generated_file_changes_validate_and_recapture_but_not_backend(
    run: WorkloadRun,
) -> None:
    before = {s: run.key(s) for s in ("backend", "validate", "recapture")}
    run.generated.write_text("BACKEND = 'opprof_w'  # edited\n")
    after = {s: run.key(s) for s in ("backend", "validate", "recapture")}
    # the backend stage wrote the file: its key must not move, or an edit would be overwritten
    assert before["backend"] == after["backend"]
    assert before["validate"] != after["validate"]
    assert before["recapture"] != after["recapture"]


def test_the_packages_own_source_is_in_every_key(
    run: WorkloadRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = run.key("capture")
    monkeypatch.setattr(pipeline, "package_digest", lambda: "a pass changed")
    assert run.key("capture") != before


def test_the_source_digest_moves_with_a_pass(tmp_path: Path) -> None:
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "bn_fold.py").write_text("MATCHES = 1\n")
    (tmp_path / "notes.txt").write_text("not source")
    before = pipeline.source_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not source")
    assert pipeline.source_digest(tmp_path) == before
    (tmp_path / "passes" / "bn_fold.py").write_text("MATCHES = 2\n")
    assert pipeline.source_digest(tmp_path) != before
