"""The recapture's timing processes: started together under a GPU lock where the capture's
peak memory says they fit (they compile side by side and measure one at a time), one after
another otherwise; pooled either way, a failed one a warning. The children here are stand-ins
that sleep and write real artifacts from the H200 run; the lock itself is tested with real
processes in test_devicelock.py."""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pytest_opprof import pipeline
from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.errors import StageError
from pytest_opprof.pipeline import STOCK_FILE
from pytest_opprof.schema import (
    BackendPlan,
    BackendSelection,
    Profile,
    ValidationReport,
    read_artifact,
    write_artifact,
)
from pytest_opprof.stages import common, recapture

H200 = Path(__file__).parents[1] / "data" / "h200" / "conv_block"
GIB = 1 << 30


class StandIn:
    """What ``stage_recapture`` uses of a ``WorkloadRun``; each child sleeps ``seconds``."""

    def __init__(
        self,
        folder: Path,
        processes: int,
        fail_retime: bool = False,
        fail_recapture: bool = False,
        fresh_timing: bool = False,
        timing_servers: int = 1,
        stock: bool = False,
    ) -> None:
        self.stock = stock
        self.name = "conv_block"
        self.planned: frozenset[str] = frozenset()
        self.ahead: dict[str, Any] = {}
        self.gates: dict[str, str | None] = {}
        self.out_dir = folder / "out"
        self.profiler_output = self.out_dir / "profiler_output"
        self.profiler_output.mkdir(parents=True)
        self.generated = folder / "conv_block_optimized.py"
        self.processes = processes
        self.fail_retime = fail_retime
        self.fail_recapture = fail_recapture
        self.fresh_timing = fresh_timing
        self.timing_servers = timing_servers
        self.children: list[tuple[str, float, float]] = []
        self.shares_cpus: dict[str, bool] = {}
        self.compile_pool: dict[str, bool] = {}
        self.sha256: dict[str, str | None] = {}
        self.edit_during_recapture = False
        self.siblings: dict[str, str | None] = {}
        self.fresh: dict[str, bool] = {}
        self.server: dict[str, int] = {}
        self._guard = threading.Lock()
        # the generated file the validation report vouches for (the recapture checks its hash)
        self.generated.write_text("# generated\n")
        validated = H200 / "profiler_output" / "validation_report.json"
        report = read_artifact(validated, ValidationReport)
        report.sha256 = hashlib.sha256(self.generated.read_bytes()).hexdigest()
        write_artifact(self.profiler_output / "validation_report.json", report)

    def measures_stock(self) -> bool:
        return self.stock

    def timing_settings(self) -> dict[str, int]:
        return {}

    def extra_passes(self) -> dict[str, Any]:
        return {}

    def setting(self, name: str) -> Any:
        return {
            "timing_processes": self.processes,
            "fresh_timing": self.fresh_timing,
            "timing_servers": self.timing_servers,
        }.get(name)

    def run_child(
        self,
        task: str,
        stage: str,
        *,
        log_name: str = "",
        fresh: bool = False,
        server: int = 0,
        **extra: Any,
    ) -> None:
        start = time.monotonic()
        self.shares_cpus[log_name or task] = bool(extra.get("shares_cpus"))
        self.compile_pool[log_name or task] = bool(extra.get("compile_pool"))
        self.sha256[log_name or task] = extra.get("sha256")
        self.siblings[log_name or task] = extra.get("siblings_lock")
        self.fresh[log_name or task] = fresh
        self.server[log_name or task] = server
        if task == "stock":
            with self._guard:
                self.children.append((task, start, time.monotonic()))
            return
        if task == "recapture" and self.fail_recapture:
            time.sleep(0.1)  # before the others end
            raise StageError("the recapture process failed (exit 1)")
        time.sleep(0.5)
        gate = extra.get("gate")
        self.gates[log_name or task] = gate
        if gate is not None:  # as recapture._await_validation: time only what passed
            while not Path(gate).exists():
                time.sleep(0.02)
            if Path(gate).read_text() != extra.get("sha256"):
                with self._guard:
                    self.children.append((log_name or task, start, time.monotonic()))
                raise StageError(f"{recapture.UNVALIDATED}: validation did not pass")
        optimized = read_artifact(H200 / "profile_optimized.json.gz", Profile)
        if task == "recapture":
            write_artifact(self.out_dir / "profile_optimized.json", optimized)
            if self.edit_during_recapture:
                self.generated.write_text("# generated, edited while it was timed\n")
        elif self.fail_retime:
            raise StageError("the retime process failed (exit 1)")
        else:
            samples = {k: v.samples_ms[:5] for k, v in optimized.timing.variants.items()}
            Path(extra["result"]).write_text(json.dumps({"samples": samples}))
        with self._guard:
            self.children.append((log_name or task, start, time.monotonic()))


def _baseline(run: StandIn, peak: int | None) -> None:
    base = read_artifact(H200 / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(
        update={"peak_memory_bytes": peak, "device_memory_bytes": 140 * GIB}
    )
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))


def _under_a_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peak: int | None, **stand_in: Any
) -> StandIn:
    """A stand-in run whose session named a GPU lock, its capture's peak memory ``peak``."""
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    run = StandIn(tmp_path, **stand_in)
    _baseline(run, peak=peak)
    return run


def _overlapping(children: list[tuple[str, float, float]]) -> bool:
    return max(start for _, start, _ in children) < min(end for _, _, end in children)


def test_under_a_gpu_lock_the_timing_processes_start_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _under_a_lock(tmp_path, monkeypatch, 2 * GIB, processes=3)
    said = recapture.run(run)  # type: ignore[arg-type]
    assert len(run.children) == 3 and _overlapping(run.children)
    assert "side by side" in said
    # on one CPU slice, none may compile while another measures: they share a lock for it
    # (devicelock: siblings)
    assert run.shares_cpus == {"recapture": True, "retime1": True, "retime2": True}
    assert len(set(run.siblings.values())) == 1 and run.siblings["recapture"]
    # all forked from the session's fork server, unless --opprof-fresh-timing or
    # --opprof-timing-servers
    assert not any(run.fresh.values())
    assert run.server == {"recapture": 0, "retime1": 0, "retime2": 0}
    before = read_artifact(H200 / "profile_optimized.json.gz", Profile).timing.variants["optimized"]
    pooled = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    assert pooled.timing.variants["optimized"].processes == before.processes + 2


@pytest.mark.parametrize(
    ("lock", "peak"),
    [(False, 2 * GIB), (True, None), (True, 30 * GIB)],
    ids=["no lock", "peak unknown", "would not fit"],
)
def test_otherwise_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: bool, peak: int | None
) -> None:
    """Without a lock their measurements could overlap; without room they could run out of
    memory: the recapture first, then each retime, as before."""
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, processes=3)
    _baseline(run, peak=peak)
    said = recapture.run(run)  # type: ignore[arg-type]
    assert [name for name, _, _ in run.children] == ["recapture", "retime1", "retime2"]
    assert not any(run.shares_cpus.values()) and not any(run.siblings.values())
    for (_, _, end), (_, start, _) in zip(run.children, run.children[1:], strict=False):
        assert start >= end
    assert "one after another" in said


@pytest.mark.parametrize("lock", [True, False], ids=["side by side", "one after another"])
def test_fresh_timing_starts_the_timing_processes_past_the_first_as_new_interpreters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: bool
) -> None:
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, processes=3, fresh_timing=True)
    _baseline(run, peak=2 * GIB)
    recapture.run(run)  # type: ignore[arg-type]
    assert run.fresh == {"recapture": False, "retime1": True, "retime2": True}


def test_a_failed_timing_process_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=2, fail_retime=True)
    recapture.run(run)  # type: ignore[arg-type]
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    assert any(
        w.startswith("timing process 2 of 2 failed: the retime process failed")
        for w in prof.warnings
    )


@pytest.mark.parametrize("edit", ["edited", "no hash"])
def test_a_file_edited_after_its_validation_is_never_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: str
) -> None:
    """Before: the recapture timed whatever the generated file held by then."""
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=2)
    if edit == "edited":
        run.generated.write_text("# generated, then edited\n")
    else:  # a report written before the hash was recorded
        path = run.profiler_output / "validation_report.json"
        write_artifact(
            path, read_artifact(path, ValidationReport).model_copy(update={"sha256": ""})
        )
    with pytest.raises(StageError, match="is not the file validate checked"):
        recapture.run(run)  # type: ignore[arg-type]
    assert run.children == [] and not (run.out_dir / "profile_optimized.json").exists()


def test_every_timing_process_runs_the_validated_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each process is told the hash the validation report names, taken once before any
    starts: a file edited while the recapture runs is refused by the timing processes after
    it, not timed as its new bytes."""
    monkeypatch.delenv(LOCK_ENV, raising=False)  # one after another
    run = StandIn(tmp_path, processes=3)
    _baseline(run, peak=None)
    run.edit_during_recapture = True
    recapture.run(run)  # type: ignore[arg-type]
    validated = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
    assert set(run.sha256) == {"recapture", "retime1", "retime2"}
    assert set(run.sha256.values()) == {validated.sha256}


def test_a_failed_recapture_waits_for_its_timing_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None of them outlives the stage (or writes into its deleted folder)."""
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=3, fail_recapture=True)
    with pytest.raises(StageError, match="the recapture process failed"):
        recapture.run(run)  # type: ignore[arg-type]
    assert sorted(name for name, _, _ in run.children) == ["retime1", "retime2"]
    assert all(end <= time.monotonic() for _, _, end in run.children)


class _Server:
    def __init__(self) -> None:
        self.specs: list[Path] = []

    def run(self, spec: Path, log: Path, env: dict[str, str], timeout: float) -> int:
        self.specs.append(spec)
        return 0


class _Plain:
    """``subprocess.Popen`` as ``_start_child`` calls it, recording the command."""

    started: ClassVar[list[list[str]]] = []

    def __init__(self, argv: list[str], **kwargs: Any) -> None:
        _Plain.started.append(argv)
        self.pid = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_fresh_child_is_never_forked_from_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: bool
) -> None:
    """A fresh child is a new interpreter (its own address layout and hash seed), even where
    the session's fork server runs; any other stage is forked from it."""
    from pytest_opprof import forkserver

    server = _Server()
    asked: list[int] = []

    def get(slot: int = 0) -> _Server:
        asked.append(slot)
        return server

    monkeypatch.setattr(forkserver, "get", get)
    _Plain.started = []
    monkeypatch.setattr(pipeline.subprocess, "Popen", _Plain)
    spec = tmp_path / "spec.json"
    code = pipeline._start_child(spec, tmp_path / "stage.log", {}, 5.0, fresh=fresh, server=2)
    assert code == 0
    if fresh:
        assert server.specs == [] and asked == []
        assert _Plain.started == [[sys.executable, "-m", "pytest_opprof.runner", str(spec)]]
    else:
        assert server.specs == [spec] and _Plain.started == []
        assert asked == [2]  # the server it was to be forked from


@pytest.mark.parametrize("lock", [True, False], ids=["side by side", "one after another"])
def test_timing_servers_spread_the_timing_processes_over_servers_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: bool
) -> None:
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, processes=5, timing_servers=3)
    _baseline(run, peak=GIB)
    recapture.run(run)  # type: ignore[arg-type]
    assert run.server == {"recapture": 0, "retime1": 1, "retime2": 2, "retime3": 0, "retime4": 1}


@pytest.mark.parametrize(
    ("processes", "servers", "fresh_timing", "device", "warmed"),
    [
        (3, 3, False, "cuda", [1, 2]),
        (5, 3, False, "cuda", [1, 2]),
        (3, 2, False, "cuda", [1]),
        (2, 3, False, "cuda", [1]),
        (3, 1, False, "cuda", None),  # the default: every process from the stages' server
        (1, 3, False, "cuda", None),
        (3, 3, True, "cuda", None),
        (None, 3, False, "cuda", [1, 2]),  # auto: three on a GPU
        (None, 3, False, "cpu", None),  # auto: one on the CPU
    ],
)
def test_the_timing_processes_servers_start_beforehand(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    processes: int | None,
    servers: int,
    fresh_timing: bool,
    device: str,
    warmed: list[int] | None,
) -> None:
    """With --opprof-timing-servers, their torch import runs in the background from the
    workload's first stage on, holding the host's CPU work, not in the recapture's time; not
    where the timing processes are new interpreters, or one. The device is the capture's once
    it ran."""
    from pytest_opprof import devicelock, forkserver

    monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(
        tmp_path,
        processes=processes,  # type: ignore[arg-type]
        fresh_timing=fresh_timing,
        timing_servers=servers,
    )
    base = read_artifact(H200 / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(update={"device_type": device})
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))
    calls: list[tuple[list[int], Any]] = []
    monkeypatch.setattr(forkserver, "warm", lambda slots, hold: calls.append((list(slots), hold)))
    recapture.warm_timing_servers(run)  # type: ignore[arg-type]
    if warmed is None:
        assert calls == []
    else:
        assert calls == [(warmed, devicelock.host_work)]


@pytest.mark.parametrize("lock", [True, False], ids=["GPU lock", "no lock"])
def test_before_the_capture_the_device_is_a_gpu_where_the_session_named_a_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: bool
) -> None:
    """The first stage has no capture to read (or one that does not parse): auto means three
    timing processes under a GPU lock, one otherwise."""
    from pytest_opprof import forkserver

    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, processes=None, timing_servers=3)  # type: ignore[arg-type]
    calls: list[list[int]] = []
    monkeypatch.setattr(forkserver, "warm", lambda slots, hold: calls.append(list(slots)))
    recapture.warm_timing_servers(run)  # type: ignore[arg-type]
    (run.out_dir / "profile.json").write_text("{not json")
    recapture.warm_timing_servers(run)  # type: ignore[arg-type]
    assert calls == ([[1, 2], [1, 2]] if lock else [])


def test_the_recapture_times_the_stock_recipe_the_backend_stage_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stock task runs in the backend stage (selection tries its recipe); the recapture
    starts only its timing processes, which read the choice, and leaves the file alone."""
    run = _under_a_lock(tmp_path, monkeypatch, 2 * GIB, processes=3, stock=True)
    chosen = run.out_dir / STOCK_FILE
    chosen.write_text("{}")
    recapture.run(run)  # type: ignore[arg-type]
    assert sorted(name for name, _, _ in run.children) == ["recapture", "retime1", "retime2"]
    assert chosen.exists()


@pytest.mark.parametrize(
    ("plan", "pool"),
    [
        ({"stock_recipe": "cast", "dtype": "bfloat16"}, False),
        ({"config_patches": {"max_autotune": True}, "dtype": "bfloat16"}, True),
        ({"dtype": "bfloat16"}, False),
        ({"stock_recipe": "cast", "dtype": "float32"}, False),
        (None, False),
    ],
    ids=["stock-recipe-bf16", "max-autotune-bf16", "bf16", "stock-recipe-fp32", "no-selection"],
)
def test_only_a_recapture_that_autotunes_a_new_plan_keeps_the_compile_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: dict[str, Any] | None, pool: bool
) -> None:
    """The recapture's own process compiles the plan at the baseline dtype anew; where that
    plan autotunes, it compiles with Inductor's workers (``ChildSpec.compile_pool``), its
    timing processes, answered by the caches, never. A plan that is the stock recipe is not
    compiled at the baseline dtype: no workers."""
    run = _under_a_lock(tmp_path, monkeypatch, 2 * GIB, processes=3)
    if plan is not None:
        selection = BackendSelection(
            workload="conv_block",
            reference="compile",
            reference_ms=1.0,
            variants=[],
            chosen="x",
            plan=BackendPlan(**plan),
        )
        write_artifact(run.profiler_output / "backend_selection.json", selection)
    recapture.run(run)  # type: ignore[arg-type]
    assert run.compile_pool == {"recapture": pool, "retime1": False, "retime2": False}


@pytest.mark.parametrize("ships_stock", [True, False], ids=["plan-is-stock", "plan-is-own"])
def test_a_plan_that_is_the_stock_recipe_is_timed_as_the_stock_baseline_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ships_stock: bool
) -> None:
    """Where selection shipped the stock recipe, the timing processes time the one program
    under both names: compiled twice, max-autotune's own timing noise could pick other
    kernels for each, and the ratio over stock would measure that instead of the tool."""
    import types

    import torch

    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.schema import ChildSpec
    from pytest_opprof.stages import common

    model = torch.nn.Linear(2, 2)
    w = types.SimpleNamespace(model=model, inputs=(torch.randn(1, 2),))
    generated = types.SimpleNamespace(
        get_model_and_input=lambda: (model, w.inputs[0]), BACKEND="b", COMPILE=False
    )
    monkeypatch.setattr(common, "import_generated", lambda path, sha256=None: generated)
    monkeypatch.setattr(common, "compile_timed", lambda m, backend, inputs, device: (m, 0.0))
    built_stock = object()
    monkeypatch.setattr(recapture, "_stock_call", lambda *a: (built_stock, 9.0))
    (tmp_path / "profiler_output").mkdir()
    plan = BackendPlan(stock_recipe="cast", dtype="bfloat16") if ships_stock else BackendPlan()
    selection = BackendSelection(
        workload="w", reference="compile", reference_ms=1.0, variants=[], chosen="x", plan=plan
    )
    write_artifact(tmp_path / "profiler_output" / "backend_selection.json", selection)
    values = {"out": str(tmp_path), "device": "cpu", "stock": "true"}
    spec = ChildSpec(
        task="retime",
        workload=str(tmp_path / "w.py"),
        out_dir=str(tmp_path),
        options=OpprofOptions.from_values(values).to_child(),
        generated=tmp_path / "w_optimized.py",
    )

    got = recapture._optimized_calls(spec, "cpu", w, retime=True)

    assert got["calls"]["stock"] is (model if ships_stock else built_stock)
    assert ("stock" in got["compile_s"]) is not ships_stock
    assert ("stock", "optimized") in got["pairs"] and ("compile", "stock") in got["pairs"]


@pytest.mark.parametrize("ships_stock", [True, False], ids=["plan-is-stock", "plan-is-own"])
def test_a_plan_that_is_the_stock_recipe_is_not_timed_at_the_baseline_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ships_stock: bool
) -> None:
    """A bf16 plan of the backend's own is built again at float32 (its graph changes apart
    from its precision); the stock recipe at float32 would be a max-autotune compile of its
    own, splitting no change of the tool's from its precision, and is not built."""
    import types

    import torch

    from pytest_opprof.backend import build as build_module
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.schema import ChildSpec
    from pytest_opprof.stages import common

    model = torch.nn.Linear(2, 2)
    w = types.SimpleNamespace(model=model, inputs=(torch.randn(1, 2),))
    generated = types.SimpleNamespace(
        get_model_and_input=lambda: (model, w.inputs[0]), BACKEND="b", COMPILE=False
    )
    monkeypatch.setattr(common, "import_generated", lambda path, sha256=None: generated)
    monkeypatch.setattr(common, "compile_timed", lambda m, backend, inputs, device: (m, 0.0))
    monkeypatch.setattr(common, "load_baseline", lambda spec, device: w)
    monkeypatch.setattr(recapture, "_stock_call", lambda *a: (None, 0.0))
    built: list[BackendPlan] = []

    def build(model: Any, inputs: Any, plan: BackendPlan) -> Any:
        built.append(plan)
        return types.SimpleNamespace(fn=lambda *a: None)

    monkeypatch.setattr(build_module, "build", build)
    (tmp_path / "profiler_output").mkdir()
    if ships_stock:
        plan = BackendPlan(stock_recipe="cast", dtype="bfloat16")
    else:
        plan = BackendPlan(dtype="bfloat16", channels_last=True)
    selection = BackendSelection(
        workload="w", reference="compile", reference_ms=1.0, variants=[], chosen="x", plan=plan
    )
    write_artifact(tmp_path / "profiler_output" / "backend_selection.json", selection)
    spec = ChildSpec(
        task="recapture",
        workload=str(tmp_path / "w.py"),
        out_dir=str(tmp_path),
        options=OpprofOptions.from_values({"out": str(tmp_path), "device": "cpu"}).to_child(),
        generated=tmp_path / "w_optimized.py",
    )

    got = recapture._optimized_calls(spec, "cpu", w)

    assert ("optimized_baseline_dtype" in got["calls"]) is not ships_stock
    assert built == ([] if ships_stock else [plan.without_dtype()])


def _ahead_of(run: StandIn) -> recapture.Ahead:
    run.planned = frozenset({"capture", "validate", "recapture"})
    ahead = recapture.start_ahead(run)  # type: ignore[arg-type]
    assert ahead is not None and run.ahead == {"recapture": ahead}
    return ahead


def test_the_recapture_compiles_beside_validation_and_times_once_it_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started as validate starts, the timing processes wait at the gate until validation has
    passed the file (the gate holding its hash); the recapture stage then takes them up and
    starts none."""
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=3)
    ahead = _ahead_of(run)
    time.sleep(0.8)  # validation under way: the processes have compiled and wait
    assert run.children == []
    assert set(run.gates) == {"recapture", "retime1", "retime2"}
    assert set(run.gates.values()) == {str(ahead.gate)}
    opened = time.monotonic()
    validated = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
    ahead.validation_ended(validated)
    said = recapture.run(run)  # type: ignore[arg-type]
    assert "side by side" in said and run.ahead == {}
    assert sorted(name for name, _, _ in run.children) == ["recapture", "retime1", "retime2"]
    assert all(start < opened < end for _, start, end in run.children)
    pooled = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    assert pooled.timing.variants["optimized"].processes == 3 + 2
    assert not ahead.folder.exists()  # the gate's folder goes with the processes


def test_a_file_validation_blocked_is_never_timed_by_the_recapture_started_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=2)
    ahead = _ahead_of(run)
    blocked = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
    ahead.validation_ended(blocked.model_copy(update={"overall": "BLOCKED"}))
    with pytest.raises(StageError, match=recapture.UNVALIDATED):
        ahead.timed()
    assert not (run.out_dir / "profile_optimized.json").exists()
    again = _ahead_of(run)
    again.validation_ended(None)  # validate ended without a report (an error, an interrupt)
    with pytest.raises(StageError, match=recapture.UNVALIDATED):
        again.timed()


def test_nothing_starts_ahead_where_the_session_does_not_run_the_recapture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _under_a_lock(tmp_path, monkeypatch, GIB, processes=2)
    run.planned = frozenset({"capture", "validate"})  # `-k validate`, `opprof validate`
    assert recapture.start_ahead(run) is None  # type: ignore[arg-type]
    run.planned = frozenset({"validate", "recapture"})
    (run.out_dir / "profile.json").unlink()  # no capture to read: the stage would fail
    assert recapture.start_ahead(run) is None  # type: ignore[arg-type]
    assert run.ahead == {} and run.children == []


def test_nothing_starts_ahead_where_the_timing_processes_and_validation_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three timing processes at twice a 15 GiB peak each fit in 80% of 140 GiB; beside
    validation's process, a fourth, they would not."""
    run = _under_a_lock(tmp_path, monkeypatch, 15 * GIB, processes=3)
    run.planned = frozenset({"validate", "recapture"})
    assert common.side_by_side(
        read_artifact(run.out_dir / "profile.json", Profile).capture_metadata, 3
    )
    assert recapture.start_ahead(run) is None  # type: ignore[arg-type]
    said = recapture.run(run)  # type: ignore[arg-type]
    assert "side by side" in said and set(run.gates.values()) == {None}


def _gated(folder: Path, sha: str = "abc") -> Any:
    from pytest_opprof.schema import ChildSpec

    gate = folder / "gate" / "validated"
    gate.parent.mkdir()
    return gate, ChildSpec(task="recapture", workload="w.py", sha256=sha, gate=str(gate))


def test_a_timing_process_waits_at_the_gate_and_times_only_the_file_validated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gate, spec = _gated(tmp_path)
    threading.Timer(0.3, lambda: gate.write_text("abc")).start()
    t0 = time.monotonic()
    recapture._await_validation(spec, "cpu")
    assert time.monotonic() - t0 >= 0.3
    out = capsys.readouterr().out
    assert "waiting for validation to end before timing" in out and recapture.VALIDATED in out
    gate.write_text("another file's hash")
    with pytest.raises(StageError, match="did not pass the file compiled here"):
        recapture._await_validation(spec, "cpu")
    gate.write_text("")  # blocked
    with pytest.raises(StageError, match=recapture.UNVALIDATED):
        recapture._await_validation(spec, "cpu")


def test_a_timing_process_whose_stage_is_gone_stops_waiting(tmp_path: Path) -> None:
    gate, spec = _gated(tmp_path)
    threading.Timer(0.2, lambda: gate.parent.rmdir()).start()
    with pytest.raises(StageError, match="is gone"):
        recapture._await_validation(spec, "cpu")


# ------------------------------------------------------------------ a process set aside whole

FAST, SLOW = 3.0, 4.8
"""Host references (µs): a round at SLOW ran on a host slowed past ``measure.SLOW_HOST``."""


def _rounds(host_us: list[float]) -> tuple[dict[str, list[float]], list[float]]:
    """Six rounds of a launch-bound baseline at 0.25 ms over an optimized call at 0.1 ms."""
    return {"compile": [0.25] * 6, "optimized": [0.1] * 6}, host_us


class _OwnRoundsKnown(StandIn):
    """The recapture's own process writes one process's rounds, their host references fast."""

    def run_child(self, task: str, stage: str, **kwargs: Any) -> None:
        super().run_child(task, stage, **kwargs)
        if task != "recapture":
            return
        from pytest_opprof.measure import latency_stats, speedup

        samples, host_us = _rounds([FAST] * 6)
        path = self.out_dir / "profile_optimized.json"
        prof = read_artifact(path, Profile)
        timing = prof.timing.model_copy(
            update={
                "variants": {k: latency_stats(v, 20) for k, v in samples.items()},
                "speedups": [speedup("compile", samples["compile"], "optimized", [0.1] * 6)],
                "host_us": host_us,
                "host": [],
            }
        )
        write_artifact(path, prof.model_copy(update={"timing": timing}))


class _Retimes:
    """Stands in for ``recapture._retime_one``: timing process ``i`` returns six rounds at the
    host reference ``host[i]`` (``extra`` past those named), waiting at its gate as a real one
    does; what each was handed and when it ran are kept."""

    def __init__(self, host: dict[int, list[float]], extra: list[float]) -> None:
        self.host, self.extra = host, extra
        self.calls: list[dict[str, Any]] = []
        self._guard = threading.Lock()

    def __call__(
        self,
        run: StandIn,
        i: int,
        folder: Path,
        digest: str,
        *,
        siblings: Path | None = None,
        fresh: bool = False,
        gate: Path | None = None,
    ) -> Any:
        from pytest_opprof.measure import Replica

        start = time.monotonic()
        in_folder = folder.is_dir()
        while gate is not None and not gate.exists():
            time.sleep(0.02)
        time.sleep(0.1)
        samples, host_us = _rounds(self.host.get(i, self.extra))
        with self._guard:
            self.calls.append(
                {
                    "i": i,
                    "folder": folder,
                    "in_folder": in_folder,
                    "gate": gate,
                    "siblings": siblings,
                    "start": start,
                    "end": time.monotonic(),
                }
            )
        return Replica(samples, host_us=host_us)


def _retimed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, retimes: Callable[..., Any]
) -> tuple[StandIn, str]:
    """Three timing processes, through ``path``: started one after another, side by side, or
    beside validation (an ``Ahead``)."""
    monkeypatch.setattr(recapture, "_retime_one", retimes)
    if path == "one after another":
        monkeypatch.delenv(LOCK_ENV, raising=False)
    else:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    run = _OwnRoundsKnown(tmp_path, processes=3)
    _baseline(run, peak=GIB)
    if path == "ahead":
        ahead = _ahead_of(run)
        validated = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
        ahead.validation_ended(validated)
    return run, recapture.run(run)  # type: ignore[arg-type]


PATHS = ["one after another", "side by side", "ahead"]


@pytest.mark.parametrize("path", PATHS)
def test_a_process_set_aside_whole_is_timed_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Timing process 2's every round ran on a slowed host: one more process, timed after the
    others ended, in a folder of its own and at no gate, keeps the three the interval asks
    for. All four processes' rounds stay pooled, process 2's set aside over all of them."""
    retimes = _Retimes({1: [SLOW] * 6}, extra=[FAST] * 6)
    run, said = _retimed_run(tmp_path, monkeypatch, path, retimes)
    assert sorted(c["i"] for c in retimes.calls) == [1, 2, 3]
    first, (more,) = retimes.calls[:2], retimes.calls[2:]
    assert more["i"] == 3 and more["in_folder"] and more["gate"] is None
    assert more["siblings"] is None and more["folder"] not in {c["folder"] for c in first}
    ended = max([c["end"] for c in first] + [end for _, _, end in run.children])
    assert more["start"] >= ended
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    v = prof.timing.variants["optimized"]
    assert v.processes == 4 and v.samples_per_process == [6, 6, 6, 6]
    assert v.set_aside == list(range(6, 12))
    assert len(prof.timing.speedups[0].process_ratios) == 3
    note = "timing process 2 set aside whole (host slowed); timed once more"
    assert note in prof.warnings and said.endswith(note)


@pytest.mark.parametrize("path", PATHS)
def test_the_retimes_stop_at_their_bound_and_the_timing_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Every process added is slowed too: after ``RETIMES`` more the timing stands as measured,
    and the profile says how many were timed and how many keep rounds."""
    retimes = _Retimes({1: [SLOW] * 6, 2: [FAST] * 6}, extra=[SLOW] * 6)
    run, said = _retimed_run(tmp_path, monkeypatch, path, retimes)
    extra = [c for c in retimes.calls if c["i"] >= 3]
    assert [c["i"] for c in extra] == [3, 4, 5]
    assert recapture.RETIMES == 3  # these references leave rounds to keep past the bound
    for before, after in itertools.pairwise(extra):  # one after another
        assert after["start"] >= before["end"]
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    v = prof.timing.variants["optimized"]
    assert v.processes == 6 and v.set_aside == [*range(6, 12), *range(18, 36)]
    note = (
        "timing processes 2, 4, 5, 6 set aside whole (host slowed); timed 3 times more; "
        "2 keep rounds of the 3 asked for: the timing stands as measured"
    )
    assert note in prof.warnings and said.endswith(note)


@pytest.mark.parametrize("path", PATHS)
def test_no_process_is_added_where_every_one_keeps_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Process 2 ran slowed for four of its six rounds: it keeps two, its own estimate enters
    the interval, and nothing is timed again, whatever the bound."""
    monkeypatch.setattr(recapture, "RETIMES", 10)
    retimes = _Retimes({1: [FAST, FAST, *[SLOW] * 4]}, extra=[FAST] * 6)
    run, said = _retimed_run(tmp_path, monkeypatch, path, retimes)
    assert sorted(c["i"] for c in retimes.calls) == [1, 2]
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    v = prof.timing.variants["optimized"]
    assert v.processes == 3 and v.set_aside == [8, 9, 10, 11]
    assert not any("set aside whole" in w for w in prof.warnings)
    how = "one after another" if path == "one after another" else "side by side"
    assert said.endswith(f"(3 processes, {how})")


def test_a_failed_process_is_not_replaced_but_an_added_one_that_fails_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process 3 failed (its cause would most often fail the next), process 2 was set aside
    whole: processes are added until two keep rounds, the first added one failing."""
    retimes = _Retimes({1: [SLOW] * 6}, extra=[FAST] * 6)

    def failing(run: StandIn, i: int, folder: Path, digest: str, **kwargs: Any) -> Any:
        return "out of memory" if i in (2, 3) else retimes(run, i, folder, digest, **kwargs)

    run, said = _retimed_run(tmp_path, monkeypatch, "one after another", failing)
    assert [c["i"] for c in retimes.calls] == [1, 4]
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    assert prof.timing.variants["optimized"].processes == 3
    assert "timing process 3 of 3 failed: out of memory" in prof.warnings
    assert "timing process 4 failed: out of memory" in prof.warnings
    assert said.endswith("timing process 2 set aside whole (host slowed); timed twice more")
