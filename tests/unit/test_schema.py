from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_opprof.errors import ArtifactError
from pytest_opprof.schema import (
    FxGraphSummary,
    SessionSummary,
    WorkloadSummary,
    read_artifact,
    write_artifact,
)


def _session() -> SessionSummary:
    return SessionSummary(
        device="cpu",
        gate_passed=True,
        workloads=[WorkloadSummary(name="a", path="a.py", status="passed", stage="report")],
    )


def test_round_trip_and_version(tmp_path: Path) -> None:
    path = write_artifact(tmp_path / "s.json", _session())
    loaded = read_artifact(path, SessionSummary)
    assert loaded == _session() and loaded.schema_version == "1.4"
    assert not list(tmp_path.glob(".*.tmp"))


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    path = write_artifact(tmp_path / "s.json", _session())
    path.write_text(path.read_text()[:40])
    with pytest.raises(ArtifactError, match=r"s\.json: not valid JSON"):
        read_artifact(path, SessionSummary)


def test_edited_field_names_the_field(tmp_path: Path) -> None:
    path = write_artifact(tmp_path / "s.json", _session())
    data = json.loads(path.read_text())
    data["workloads"][0]["status"] = "great"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=r"field 'workloads\.0\.status'"):
        read_artifact(path, SessionSummary)


def test_future_schema_version(tmp_path: Path) -> None:
    path = write_artifact(tmp_path / "g.json", FxGraphSummary(graphs=[]))
    data = json.loads(path.read_text())
    data["schema_version"] = "7.0"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="newer than this pytest-opprof reads"):
        read_artifact(path, FxGraphSummary)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        read_artifact(tmp_path / "nope.json", FxGraphSummary)


def test_real_graph_summaries_validate() -> None:
    data = Path(__file__).parents[1] / "data" / "graphs"
    files = sorted(data.glob("*.graph.json"))
    assert len(files) == 7
    for f in files:
        g = read_artifact(f, FxGraphSummary)
        assert g.parameters


def test_a_gzipped_artifact_reads_as_its_json_and_a_broken_one_says_so(tmp_path: Path) -> None:
    import gzip

    path = write_artifact(tmp_path / "s.json", _session())
    packed = tmp_path / "s.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_artifact(packed, SessionSummary) == _session()
    packed.write_bytes(gzip.compress(path.read_bytes())[:30])  # cut short
    with pytest.raises(ArtifactError, match=r"s\.json\.gz: cannot be read"):
        read_artifact(packed, SessionSummary)
    packed.write_bytes(b"not gzip at all")
    with pytest.raises(ArtifactError, match=r"s\.json\.gz: cannot be read"):
        read_artifact(packed, SessionSummary)
