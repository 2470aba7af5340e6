"""The counters pass beside the later stages (``--opprof-ncu-when=beside``, the default): the
capture leaves its profile's counters pending, a sibling process reads them while selection,
validation and the recapture go on, and the report waits for them. The proposals are then made
from the timeline alone, which on the real H200 profiles of the seven examples gives what the
counters give; where the counters would add a proposal, the profile says which. The ncu here
is a stand-in that writes the real H200 output of the run those profiles come from."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_counters import _fake_ncu  # an ncu that writes a saved run's output

import pytest_opprof.capture.counters as c
from pytest_opprof import STAGES, devicelock
from pytest_opprof.errors import ArtifactError, StageError
from pytest_opprof.options import OpprofOptions
from pytest_opprof.propose import propose
from pytest_opprof.schema import (
    ChildSpec,
    FxGraphSummary,
    Optimizations,
    Profile,
    Proposal,
    read_artifact,
    write_artifact,
)
from pytest_opprof.stages import _check_artifacts, capture

DATA = Path(__file__).resolve().parents[1] / "data"
H200 = DATA / "h200"
EXAMPLES = sorted(p.parent.name for p in H200.glob("*/profile.json.gz"))
PATIENCE_S = 10.0
"""How long a stand-in child waits for the test: past it, nothing ran beside."""
GIB = 1 << 30


def without_counters(profile: Profile) -> Profile:
    """``profile`` as the capture writes it with the counters pending: no kernel or operator
    carries a counter."""

    def strip(o: Any) -> Any:
        if isinstance(o, dict):
            return {
                k: {} if k == "metrics" else None if k == "counters_source" else strip(v)
                for k, v in o.items()
            }
        return [strip(x) for x in o] if isinstance(o, list) else o

    data = strip(profile.model_dump(mode="json"))
    data["counters"] = {c.PENDING: "the counters pass runs beside the later stages"}
    data["warnings"] = []
    return Profile.model_validate(data)


def key(optimizations: Optimizations) -> list[tuple[str, tuple[str, ...], str]]:
    return [(p.type, tuple(p.targets), p.confidence) for p in optimizations.proposals]


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_rules_propose_the_same_without_the_counters(name: str) -> None:
    """What makes the pass safe to run beside: on each real profile the rules' proposals
    (type, targets, confidence) are those of the timeline alone. A rule that comes to read a
    counter for its decision fails this, and the default wants weighing again."""
    profile = read_artifact(H200 / name / "profile.json.gz", Profile)
    graph = read_artifact(H200 / name / "graph.json.gz", FxGraphSummary)
    assert any(t.aggregated and any(a.metrics for a in t.aggregated) for t in profile.timelines)
    assert key(propose(profile, graph)) == key(propose(without_counters(profile), graph))


def counters_spec(out: Path, **options: Any) -> ChildSpec:
    opts = OpprofOptions(ncu_sudo="false", **options)
    return ChildSpec(task="counters", workload=str(out / "w.py"), out_dir=str(out),
                     options=opts.to_child())  # fmt: skip


@pytest.mark.parametrize("name", ["conv_block", "gpt2"])
def test_the_pass_beside_gives_the_profile_its_counters(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sibling's task on a pending profile: every kernel the capture's own pass joined
    gets the same counters from the same ncu output, the profile is no longer pending, and
    no proposal is added (the rules agree, above)."""
    real = read_artifact(H200 / name / "profile.json.gz", Profile)
    out = tmp_path / "out"
    write_artifact(out / "profile.json", without_counters(real))
    write_artifact(out / "graph.json", read_artifact(H200 / name / "graph.json.gz", FxGraphSummary))
    fake = _fake_ncu(tmp_path, f"h200/{name}.log")  # the real H200 output
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))

    capture.task_counters(counters_spec(out))

    done = read_artifact(out / "profile.json", Profile)
    assert not c.pending(done) and done.counters is not None
    for label in ("eager", "compiled"):
        assert (
            done.counters[label]["kernels_with_counters"]
            == (real.counters or {})[label]["kernels_with_counters"]
        )
    for got, was in zip(done.timelines, real.timelines, strict=True):
        kernels = [(k.name, k.metrics) for op in got.operators for k in op.kernels]
        assert kernels == [(k.name, k.metrics) for op in was.operators for k in op.kernels]
    assert not any("add proposals" in w for w in done.warnings)


def test_a_comparison_that_fails_keeps_the_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = read_artifact(H200 / "conv_block" / "profile.json.gz", Profile)
    out = tmp_path / "out"
    write_artifact(out / "profile.json", without_counters(real))
    fake = _fake_ncu(tmp_path, "h200/conv_block.log")
    monkeypatch.setattr(c, "find_ncu", lambda: str(fake))

    def broken(*args: Any) -> list[str]:
        raise KeyError("targets")

    monkeypatch.setattr(capture, "proposals_counters_add", broken)
    capture.task_counters(counters_spec(out))
    done = read_artifact(out / "profile.json", Profile)
    assert not c.pending(done) and done.counters and done.counters["compiled"]
    assert done.warnings[-1] == (
        "the proposals were not compared with the counters: KeyError('targets')"
    )


def test_counters_that_add_a_proposal_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the rules propose more from the counters than from the timeline alone, the
    warning names what was not tried, by type and targets, and how to try it."""
    real = read_artifact(H200 / "conv_block" / "profile.json.gz", Profile)
    before = without_counters(real)
    graph = read_artifact(H200 / "conv_block" / "graph.json.gz", FxGraphSummary)
    base = propose(real, graph)
    extra = Proposal.model_validate(
        {**base.proposals[0].model_dump(), "id": "x-1", "targets": ["aten::addmm"]}
    )

    def rules(profile: Profile, graph: Any, **kwargs: Any) -> Optimizations:
        if c.pending(profile):
            return base
        return base.model_copy(update={"proposals": [*base.proposals, extra]})

    monkeypatch.setattr("pytest_opprof.propose.propose", rules)
    out = tmp_path / "out"
    out.mkdir()
    said = capture.proposals_counters_add(counters_spec(out), before, real)
    assert said == [
        "the counters, read beside the later stages, add proposals the timeline alone did "
        f"not give: {extra.type} (aten::addmm); run with --opprof-ncu-when=first to try them"
    ]
    assert capture.proposals_counters_add(counters_spec(out), before, before) == []


class StandIn:
    """What ``capture.run`` uses of a ``WorkloadRun``. The capture child writes the real
    profile of conv_block (its peak memory ``peak``), pending where asked; the counters child
    ends only once ``release`` is set (or fails where ``fail``), rewriting the profile with
    its counters."""

    def __init__(
        self, folder: Path, *, planned: frozenset[str], fail: bool = False, peak: int = GIB
    ) -> None:
        self.out_dir = folder / "out"
        self.out_dir.mkdir(parents=True)
        self.name = "conv_block"
        self.planned = planned
        self.ahead: dict[str, Any] = {}
        self.fail = fail
        self.release = threading.Event()
        self.children: list[tuple[str, dict[str, Any]]] = []
        self.spec = SimpleNamespace(overrides={})
        real = read_artifact(H200 / "conv_block" / "profile.json.gz", Profile)
        meta = {"peak_memory_bytes": peak, "device_memory_bytes": 140 * GIB}
        update = {"capture_metadata": real.capture_metadata.model_copy(update=meta)}
        self.real = real.model_copy(update=update)

    def base_setting(self, name: str) -> Any:
        return {"ncu_when": "beside"}[name]

    def setting(self, name: str) -> Any:
        return {"timing_processes": None}[name]

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert stage == "capture"
        self.children.append((task, extra))
        path = self.out_dir / "profile.json"
        if task == "capture":
            pending = without_counters(self.real)
            write_artifact(path, pending if extra.get("counters_beside") else self.real)
            return
        assert task == "counters" and extra == {"log_name": "counters"}
        assert self.release.wait(PATIENCE_S), "the counters pass was not left to run beside"
        if self.fail:
            raise StageError("w.py: the capture process failed (exit 1)")
        write_artifact(path, self.real)


@pytest.fixture
def gpu_lock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))


@pytest.mark.usefixtures("gpu_lock")
def test_the_report_waits_for_the_pass_run_beside(tmp_path: Path) -> None:
    run = StandIn(tmp_path, planned=frozenset(STAGES))
    said = capture.run(run)  # type: ignore[arg-type]  # returns while the pass is at work
    assert said.endswith("; the counters pass runs beside the later stages")
    assert run.children[0] == ("capture", {"counters_beside": True})
    assert c.pending(read_artifact(run.out_dir / "profile.json", Profile))
    assert isinstance(run.ahead.get("report"), capture.CountersBeside)
    run.release.set()
    capture.await_counters(run)  # type: ignore[arg-type]
    assert "report" not in run.ahead
    done = read_artifact(run.out_dir / "profile.json", Profile)
    assert not c.pending(done) and done.counters == run.real.counters


@pytest.mark.usefixtures("gpu_lock")
def test_without_the_report_planned_the_capture_reads_the_counters_itself(
    tmp_path: Path,
) -> None:
    run = StandIn(tmp_path, planned=frozenset({"capture"}))
    said = capture.run(run)  # type: ignore[arg-type]
    assert "beside" not in said
    assert run.children == [("capture", {"counters_beside": False})]
    assert not run.ahead


@pytest.mark.usefixtures("gpu_lock")
def test_where_memory_has_no_room_the_pass_runs_before_the_next_stage(tmp_path: Path) -> None:
    run = StandIn(tmp_path, planned=frozenset(STAGES), peak=20 * GIB)
    run.release.set()
    said = capture.run(run)  # type: ignore[arg-type]
    assert "beside" not in said and not run.ahead
    assert [task for task, _ in run.children] == ["capture", "counters"]
    assert not c.pending(read_artifact(run.out_dir / "profile.json", Profile))


def test_without_a_gpu_lock_the_pass_runs_before_the_next_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(devicelock.LOCK_ENV, raising=False)
    run = StandIn(tmp_path, planned=frozenset(STAGES))
    run.release.set()
    assert "beside" not in capture.run(run)  # type: ignore[arg-type]
    assert not run.ahead


@pytest.mark.usefixtures("gpu_lock")
def test_a_failed_pass_leaves_the_profile_without_counters_and_says_why(
    tmp_path: Path,
) -> None:
    run = StandIn(tmp_path, planned=frozenset(STAGES), fail=True)
    capture.run(run)  # type: ignore[arg-type]
    run.release.set()
    capture.await_counters(run)  # type: ignore[arg-type]  # the failure is not the report's
    done = read_artifact(run.out_dir / "profile.json", Profile)
    why = "the counters pass failed: w.py: the capture process failed (exit 1)"
    assert done.counters == {"note": why} and done.warnings[-1] == why


def test_a_profile_left_pending_is_not_reused(tmp_path: Path) -> None:
    """A session that ended before its pass did leaves the profile pending: the next one
    captures again rather than report without the counters it asked for."""
    out = tmp_path / "out"
    real = read_artifact(H200 / "conv_block" / "profile.json.gz", Profile)
    write_artifact(
        out / "graph.json", read_artifact(H200 / "conv_block" / "graph.json.gz", FxGraphSummary)
    )
    run = SimpleNamespace(artifact_paths=lambda stage: [out / "profile.json", out / "graph.json"])
    write_artifact(out / "profile.json", real)
    _check_artifacts(run, "capture")  # type: ignore[arg-type]
    write_artifact(out / "profile.json", without_counters(real))
    with pytest.raises(ArtifactError, match="counters pass, run beside the later stages, never"):
        _check_artifacts(run, "capture")  # type: ignore[arg-type]
