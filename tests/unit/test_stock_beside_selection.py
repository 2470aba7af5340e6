"""The stock baseline's task runs beside measured selection, not before it: two sibling
processes on one CPU slice under the GPU's lock, selection waiting for the stock task's end
(a marker its parent creates however that task ended) only before the stock rung. A failed
stock task still fails the stage, once selection is over. The children here are stand-ins
that write real artifacts from the H200 run; the lock itself is tested in test_devicelock.py."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.errors import StageError, StageTimedOut
from pytest_opprof.pipeline import STOCK_FILE
from pytest_opprof.schema import (
    BackendSelection,
    Optimizations,
    Profile,
    StockBaseline,
    read_artifact,
    write_artifact,
)
from pytest_opprof.stages import backend

H200 = Path(__file__).parents[1] / "data" / "h200" / "conv_block"
GIB = 1 << 30
PATIENCE_S = 10.0
"""How long a stand-in waits for the other child: past it, the two ran one after another."""


class StandIn:
    """What ``backend.run`` uses of a ``WorkloadRun``. The stock child, where ``beside``, ends
    only once selection has started; selection, given a marker, waits for it as
    ``task_select`` does and notes whether the stock child had ended by then."""

    def __init__(
        self,
        folder: Path,
        *,
        stock: bool = True,
        beside: bool = True,
        fail_stock: bool = False,
        stock_out_of_time: bool = False,
        baseline: str = "compile",
        fail_select: bool = False,
        interrupt: bool = False,
        stock_lingers: float = 0.3,
    ) -> None:
        self.out_dir = folder / "out"
        self.profiler_output = self.out_dir / "profiler_output"
        self.profiler_output.mkdir(parents=True)
        self.spec = SimpleNamespace(stem="conv_block", path=folder / "conv_block.py", overrides={})
        self.generated = self.out_dir / "conv_block_optimized.py"
        self.generated_test = self.out_dir / "test_conv_block_optimized.py"
        self.stock, self.beside = stock, beside
        self.fail_stock, self.fail_select = fail_stock, fail_select
        self.stock_out_of_time, self.baseline = stock_out_of_time, baseline
        self.interrupt, self.stock_lingers = interrupt, stock_lingers
        self.extras: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.selecting = threading.Event()
        self.stock_ended = threading.Event()
        self.marker_after_stock: bool | None = None
        self.selection_done = False
        optimizations = read_artifact(H200 / "optimizations.json.gz", Optimizations)
        write_artifact(self.out_dir / "optimizations.json", optimizations)

    def measures_stock(self) -> bool:
        return self.stock

    def extra_passes(self) -> dict[str, Any]:
        return {}

    def setting(self, name: str) -> Any:
        return {"timeout": 900}[name]

    def base_setting(self, name: str) -> Any:
        return {"baseline": self.baseline}[name]

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert stage == "backend"
        self.extras[task] = extra
        self.order.append(task)
        if task == "stock":
            try:
                if self.beside:  # one after the other, this never returns early
                    assert self.selecting.wait(PATIENCE_S), "selection did not start beside it"
                    time.sleep(self.stock_lingers)  # still at work as selection goes on
                if self.fail_stock:
                    raise StageError("w.py: the stock process failed (exit 1)")
                if self.stock_out_of_time:
                    raise StageTimedOut("w.py: backend did not finish within 810 s")
            finally:
                self.stock_ended.set()
            return
        self.selecting.set()
        if self.interrupt:  # during the ladder
            raise KeyboardInterrupt
        if self.fail_select:  # during the ladder, the stock task still at work
            raise StageError("w.py: the backend process failed (exit 1)")
        if extra.get("stock_done"):
            marker = Path(extra["stock_done"])
            deadline = time.monotonic() + PATIENCE_S
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.marker_after_stock = marker.exists() and self.stock_ended.is_set()
        selection = read_artifact(
            H200 / "profiler_output" / "backend_selection.json.gz", BackendSelection
        )
        write_artifact(self.out_dir / backend.SELECTION_FILE, selection)
        self.selection_done = True


def _stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, lock: bool = True, **kwargs: Any
) -> StandIn:
    """A stand-in run, under a GPU lock where ``lock``, whose capture's peak memory fits two
    processes side by side."""
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, **kwargs)
    base = read_artifact(H200 / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(
        update={"peak_memory_bytes": GIB, "device_memory_bytes": 140 * GIB}
    )
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))
    return run


def test_the_stock_task_runs_beside_selection_as_its_sibling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch)
    said = backend.run(run)  # type: ignore[arg-type]
    assert said.startswith("kept ")
    assert sorted(run.extras) == ["backend", "stock"]
    stock, select = run.extras["stock"], run.extras["backend"]
    assert stock["shares_cpus"] and select["shares_cpus"]
    assert stock["compile_pool"] and select["compile_pool"]  # both compile new graphs
    assert stock["siblings_lock"] and stock["siblings_lock"] == select["siblings_lock"]
    assert "stock_done" not in stock
    # it stops early enough for selection, which waits for it, to finish in the same time
    assert stock["timeout"] == backend.STOCK_SHARE * 900
    # the marker is created once the stock child has ended, in the siblings' folder
    assert run.marker_after_stock is True
    assert Path(select["stock_done"]).parent == Path(select["siblings_lock"]).parent
    assert not Path(select["stock_done"]).parent.exists()  # the stage's own, removed after it


@pytest.mark.parametrize("fail_select", [False, True], ids=["selection-kept", "both-failed"])
def test_a_failed_stock_task_fails_the_stage_once_selection_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_select: bool
) -> None:
    """Selection is not cut short (its marker appears all the same); the stock task's own
    error is the stage's, the selection's failure, if any, its cause."""
    run = _stand_in(tmp_path, monkeypatch, fail_stock=True, fail_select=fail_select)
    with pytest.raises(StageError, match="the stock process failed") as raised:
        backend.run(run)  # type: ignore[arg-type]
    assert run.selection_done is not fail_select
    if not fail_select:
        assert run.marker_after_stock is True
    else:
        assert "the backend process failed" in str(raised.value.__cause__)
    assert not run.generated.exists()


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "before"])
@pytest.mark.parametrize("baseline", ["compile", "stock"])
def test_a_stock_task_out_of_time_fails_the_stage_only_as_the_gate_s_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, baseline: str, beside: bool
) -> None:
    """With --opprof-stock the stock baseline is a bar beside the gate's: where max-autotune's
    compiles outlast their time, the stage goes on without it, ``STOCK_FILE`` saying why (the
    reports read it: ``stages.report._why_no_stock``). As the gate's baseline, it fails the
    stage: the gate has nothing to compare with."""
    run = _stand_in(  # without a GPU lock, the stock task runs before selection
        tmp_path,
        monkeypatch,
        lock=beside,
        beside=beside,
        baseline=baseline,
        stock_out_of_time=True,
    )
    if baseline == "stock":
        with pytest.raises(StageTimedOut):
            backend.run(run)  # type: ignore[arg-type]
        assert not (run.out_dir / STOCK_FILE).exists()
        return
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert ("timeout" in run.extras["stock"]) is beside
    written = read_artifact(run.out_dir / STOCK_FILE, StockBaseline)
    assert written.recipe is None
    assert written.message == "not measured: w.py: backend did not finish within 810 s"
    assert run.generated.exists()


def test_a_failed_selection_alone_fails_the_stage_with_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch, fail_select=True)
    with pytest.raises(StageError, match="the backend process failed"):
        backend.run(run)  # type: ignore[arg-type]
    assert run.stock_ended.is_set()  # waited for: it does not outlive its stage


def test_an_interrupt_does_not_wait_for_the_stock_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch, interrupt=True, stock_lingers=2.0)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        backend.run(run)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 1.5 and not run.stock_ended.is_set()
    assert run.stock_ended.wait(PATIENCE_S)  # the stand-in's thread ends before the next test


@pytest.mark.parametrize("stock", [True, False], ids=["stock", "no-stock"])
def test_without_a_gpu_lock_or_the_stock_baseline_nothing_runs_beside_selection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stock: bool
) -> None:
    """Without a lock to keep their measurements apart the stock task runs first, as
    without the stock baseline selection runs alone: no siblings, no marker."""
    run = _stand_in(tmp_path, monkeypatch, lock=False, stock=stock, beside=False)
    backend.run(run)  # type: ignore[arg-type]
    assert run.order == (["stock", "backend"] if stock else ["backend"])
    assert all(extra == {} for extra in run.extras.values())


def _waiting(done: Path) -> tuple[float, BaseException | None]:
    """``wait_for_stock(done)`` in a thread: how long it took, and what it raised. A wait
    that does not end within ``PATIENCE_S`` fails the test instead of hanging it."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            backend.wait_for_stock(done)
        except BaseException as exc:
            raised.append(exc)

    t0 = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive(), "still waiting"
    return time.monotonic() - t0, (raised[0] if raised else None)


def test_selection_waits_for_the_marker_holding_nothing_of_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    let_go: list[float] = []
    monkeypatch.setattr(devicelock, "let_go", lambda: let_go.append(time.monotonic()))
    done = tmp_path / "stock.done"
    done.touch()
    waited, raised = _waiting(done)
    assert raised is None and waited < 0.5
    assert not let_go  # ended already: the GPU is kept
    done.unlink()
    threading.Timer(0.5, done.touch).start()
    waited, raised = _waiting(done)
    assert raised is None and waited >= 0.5
    assert len(let_go) == 1
    log = capsys.readouterr().out
    assert "waiting for the stock baseline's task to end" in log
    assert "the stock baseline's task ended after" in log


def test_selection_stops_waiting_once_its_parent_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devicelock, "let_go", lambda: None)
    parents = itertools.chain([os.getppid()], itertools.repeat(1))  # then reparented to init
    monkeypatch.setattr(os, "getppid", lambda: next(parents))
    _, raised = _waiting(tmp_path / "stock.done")
    assert isinstance(raised, StageError) and "has ended" in str(raised)


def test_selection_stops_waiting_once_the_markers_folder_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder is the parent stage's own, removed as that stage ends."""
    monkeypatch.setattr(devicelock, "let_go", lambda: None)
    _, raised = _waiting(tmp_path / "removed" / "stock.done")
    assert isinstance(raised, StageError) and "removed" in str(raised)
