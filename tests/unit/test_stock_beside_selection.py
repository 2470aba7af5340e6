"""The stock baseline's task runs beside measured selection, not before it: two sibling
processes on one CPU slice under the GPU's lock, selection waiting for the stock task's end
(a marker its parent creates however that task ended) only before the stock rung. A failed
stock task still fails the stage, once selection is over. Where all fit, the stock warmer, a
third sibling, compiles the stock task's last recipe while that task compiles its first, and
the stock task waits for the warmer's end (a marker again) before building that recipe
itself; the warmer's failure fails nothing. The children here are stand-ins that write real
artifacts from the H200 run; the lock itself is tested in test_devicelock.py."""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.devicelock import LOCK_ENV
from pytest_opprof.errors import StageError, StageTimedOut, WorkloadError
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


WARMER_ENDS = {
    "failed": StageError("w.py: the backend process failed (exit 1)"),
    "out-of-time": StageTimedOut("w.py: backend did not finish within 810 s"),
    "crashed": StageError("w.py: the backend process was killed by SIGSEGV"),
    "out-of-memory": WorkloadError("w.py: out of GPU memory during stock_warm"),
}
"""How a stock warmer's process can end, other than well: what ``run_child`` raises."""


class StandIn:
    """What ``backend.run`` uses of a ``WorkloadRun``. The stock child, where ``beside``, ends
    only once selection has started; selection, given a marker, waits for it as
    ``task_select`` does and notes whether the stock child had ended by then. The stock
    warmer's child ends (as ``warmer_ends``, else well) only once the stock child has started;
    the stock child, given the warmer's marker, builds its first recipe once the warmer has
    started, then waits for the marker before its last, as ``task_stock`` does, and notes
    whether the warmer had ended by then."""

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
        warmer_ends: str | None = None,
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
        self.warmer_ends = warmer_ends
        self.stock_started = threading.Event()
        self.warming = threading.Event()
        self.warm_ended = threading.Event()
        self.marker_after_warmer: bool | None = None
        self.built: list[str] = []
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
        return {"timeout": 900, "warm_rungs": False}[name]

    def base_setting(self, name: str) -> Any:
        return {"baseline": self.baseline}[name]

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        assert stage == "backend"
        self.extras[task] = extra
        self.order.append(task)
        if task == backend.STOCK_WARM:
            self.warming.set()
            try:
                assert self.stock_started.wait(PATIENCE_S), "the stock task did not start beside it"
                time.sleep(0.3)  # compiling as the stock task compiles its first recipe
                if self.warmer_ends is not None:
                    raise WARMER_ENDS[self.warmer_ends]
            finally:
                self.warm_ended.set()
            return
        if task == "stock":
            self.stock_started.set()
            try:
                if self.beside:  # one after the other, this never returns early
                    assert self.selecting.wait(PATIENCE_S), "selection did not start beside it"
                    time.sleep(self.stock_lingers)  # still at work as selection goes on
                self._build_recipes(extra.get("stock_warm_done"))
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

    def _build_recipes(self, warm_done: str | None) -> None:
        """``task_stock``'s builds: with the warmer's marker, the first beside the warmer at
        work, the last once the marker is there."""
        first, last = "autocast", backend.WARMED[0]
        if warm_done is not None:
            assert self.warming.wait(PATIENCE_S), "the warmer did not start beside it"
        self.built.append(first)
        if warm_done is not None:
            marker = Path(warm_done)
            deadline = time.monotonic() + PATIENCE_S
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.marker_after_warmer = marker.exists() and self.warm_ended.is_set()
        self.built.append(last)


def _stand_in(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    lock: bool = True,
    peak: int | None = GIB,
    **kwargs: Any,
) -> StandIn:
    """A stand-in run, under a GPU lock where ``lock``, whose capture's peak memory (``peak``;
    None: a capture on the CPU) fits many processes side by side on a 140 GiB GPU."""
    if lock:
        monkeypatch.setenv(LOCK_ENV, str(tmp_path / "gpu.lock"))
    else:
        monkeypatch.delenv(LOCK_ENV, raising=False)
    run = StandIn(tmp_path, **kwargs)
    base = read_artifact(H200 / "profile.json.gz", Profile)
    meta = base.capture_metadata.model_copy(
        update={"peak_memory_bytes": peak, "device_memory_bytes": 140 * GIB}
    )
    write_artifact(run.out_dir / "profile.json", base.model_copy(update={"capture_metadata": meta}))
    return run


def test_the_stock_task_runs_beside_selection_as_its_sibling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _stand_in(tmp_path, monkeypatch)
    said = backend.run(run)  # type: ignore[arg-type]
    assert said.startswith("kept ")
    assert sorted(run.extras) == ["backend", "stock", "stock_warm"]  # all three fit
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


@pytest.mark.parametrize("beside", [True, False], ids=["beside-selection", "before-selection"])
def test_the_stock_warmer_compiles_beside_the_stock_task_which_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beside: bool
) -> None:
    """The warmer and the stock task run at once, siblings under one lock (selection's where
    it is the third), with one timeout; the stock task builds its first recipe beside the
    warmer at work and the warmer's only once the warmer's marker is there, created after the
    warmer ended. Before selection the pair has a lock of its own; ``backend.run`` does not
    get there under today's memory rule (where two fit, the stock task runs beside
    selection), so the parent half is called itself."""
    run = _stand_in(tmp_path, monkeypatch, beside=beside)
    if beside:
        assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    else:
        backend.stock_task(run)  # type: ignore[arg-type]
    stock, warm = run.extras["stock"], run.extras[backend.STOCK_WARM]
    assert run.built == ["autocast", "cast"]
    assert run.marker_after_warmer is True
    assert stock["shares_cpus"] and warm["shares_cpus"]
    assert stock["compile_pool"] and warm["compile_pool"]  # both compile new graphs
    assert stock["siblings_lock"] and stock["siblings_lock"] == warm["siblings_lock"]
    assert stock.get("timeout") == warm.get("timeout")
    assert "stock_warm_done" not in warm
    done = Path(stock["stock_warm_done"])
    assert not done.parent.exists()  # the stage's own, removed after it
    if beside:
        assert warm["siblings_lock"] == run.extras["backend"]["siblings_lock"]
        assert warm["timeout"] == backend.STOCK_SHARE * 900
    else:
        assert "timeout" not in warm and Path(warm["siblings_lock"]).parent == done.parent


@pytest.mark.parametrize("ends", sorted(WARMER_ENDS))
def test_a_warmer_that_did_not_end_well_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """Its marker is created all the same, the stock task goes on to build the recipe itself,
    and the stage passes; a warmer out of time is not the stock task out of time (which would
    record the stock baseline as not measured)."""
    run = _stand_in(tmp_path, monkeypatch, warmer_ends=ends)
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert run.warm_ended.is_set() and run.marker_after_warmer is True
    assert run.built == ["autocast", "cast"]
    assert run.selection_done and run.generated.exists()
    assert not (run.out_dir / STOCK_FILE).exists()  # the stand-in's stock task writes none


@pytest.mark.parametrize("where", ["no-lock", "no-room-for-three", "cpu"])
def test_no_warmer_without_a_gpu_lock_room_in_its_memory_or_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Without a lock, or where the capture ran on the CPU (no peak memory), the stock task
    runs before selection and compiles both recipes itself, as where two fit beside each
    other but not three: then the stock task runs beside selection, without a warmer. A
    former run's warmer log is not left to be read as this run's."""
    peak = {"no-lock": GIB, "no-room-for-three": 20 * GIB, "cpu": None}[where]
    run = _stand_in(
        tmp_path,
        monkeypatch,
        lock=where != "no-lock",
        peak=peak,
        beside=where == "no-room-for-three",
    )
    former = run.profiler_output / f"{backend.STOCK_WARM}.log"
    former.write_text("[opprof] +   10.0 s  task stock_warm done\n", encoding="utf-8")
    assert not backend.warms_stock(run, beside_selection=True)  # type: ignore[arg-type]
    assert backend.warms_stock(run, beside_selection=False) is (where == "no-room-for-three")  # type: ignore[arg-type]
    assert backend.run(run).startswith("kept ")  # type: ignore[arg-type]
    assert backend.STOCK_WARM not in run.extras and "stock_warm_done" not in run.extras["stock"]
    assert run.built == ["autocast", "cast"] and run.marker_after_warmer is None
    assert not former.exists()


def _stock_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, done: Path | None) -> list[Any]:
    """``task_stock`` on the CPU with its builds stood in for (each recorded with whether
    ``done`` existed then, its recipe computing the model itself) and the GPU's lock's
    let-go and resume recorded: what it did, in order. ``done``, where given, is the warmer's
    marker, created a moment after the stock task let go of the GPU to wait for it."""
    import torch

    from pytest_opprof.backend import stock
    from pytest_opprof.capture import timing
    from pytest_opprof.options import OpprofOptions
    from pytest_opprof.schema import ChildSpec
    from pytest_opprof.stages import common

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    events: list[Any] = []

    class Recipe:
        def __init__(self, recipe: str, dtype: str) -> None:
            self.recipe, self.dtype = recipe, dtype

        def __call__(self, *args: Any) -> Any:
            return model(*args)

    def build(
        recipe: str, m: Any, inputs: Any, dtype: str, *, first_call: Any
    ) -> stock.StockRecipe:
        events.append((recipe, dtype, done is not None and done.exists()))
        fn = Recipe(recipe, dtype)
        first_call(fn)
        return stock.StockRecipe(recipe, dtype, fn, 0.0)

    def timed(calls: dict[str, Any], inputs: Any, **_: Any) -> dict[str, list[float]]:
        return {k: [1.0 + i] for i, k in enumerate(calls)}

    monkeypatch.setattr(stock, "build", build)
    monkeypatch.setattr(timing, "time_interleaved", timed)

    def let_go() -> None:  # the wait has begun: the warmer ends a moment later
        events.append("let go")
        assert done is not None
        threading.Timer(0.3, done.touch).start()

    monkeypatch.setattr(devicelock, "let_go", let_go)
    monkeypatch.setattr(devicelock, "resume", lambda: events.append("resume"))
    monkeypatch.setattr(common, "setup_torch", lambda: None)
    monkeypatch.setattr(
        common, "load_baseline", lambda spec, device: SimpleNamespace(model=model, inputs=(x,))
    )
    (tmp_path / "profiler_output").mkdir(exist_ok=True)
    spec = ChildSpec(
        task="stock",
        workload=str(tmp_path / "w.py"),
        out_dir=str(tmp_path),
        options=OpprofOptions.from_values({"out": str(tmp_path), "device": "cpu"}).to_child(),
        stock_warm_done=None if done is None else str(done),
    )
    backend.task_stock(spec)
    return events


def test_the_stock_task_builds_the_warmers_recipe_only_once_its_marker_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The child's half: its first recipe built at once; before the warmer's, a wait for the
    marker holding nothing of the GPU, said in its log, then the GPU shared again; the
    checks, the brief timing and the choice as without a warmer."""
    done = tmp_path / "siblings" / "warm.done"
    done.parent.mkdir()
    events = _stock_on_cpu(tmp_path, monkeypatch, done)
    assert events == [
        ("autocast", "bfloat16", False),
        "let go",
        "resume",
        ("cast", "bfloat16", True),
    ]
    log = capsys.readouterr().out
    waited = re.search(r"waited ([\d.]+) s for the stock warmer to end", log)
    assert waited is not None and float(waited.group(1)) >= 0.2
    assert "built autocast at bfloat16: " in log and "built cast at bfloat16: " in log
    chosen = read_artifact(tmp_path / STOCK_FILE, StockBaseline)
    assert (chosen.recipe, chosen.dtype) == ("autocast", "bfloat16")  # timed faster
    assert [t.error for t in chosen.trials] == [None, None]


def test_without_a_warmer_the_stock_task_waits_for_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events = _stock_on_cpu(tmp_path, monkeypatch, None)
    assert events == [("autocast", "bfloat16", False), ("cast", "bfloat16", False)]
    assert "stock warmer" not in capsys.readouterr().out


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
