"""The stage runner's helpers that selection leans on: a variant's copy of the baseline, and the
compile-time split in the stage log."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_opprof.schema import ChildSpec
from pytest_opprof.stages.backend import pristine_copy
from pytest_opprof.stages.common import compile_clock, compile_note


def test_a_variants_copy_is_independent_of_the_baseline() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = pristine_copy(model, reload=lambda: None)
    assert copy is not model
    with torch.no_grad():
        copy[0].weight.mul_(2)  # what a non-graph pass does to its model, in place
    copy.to(memory_format=torch.channels_last)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_model_that_cannot_be_copied_is_built_again_under_seed_0() -> None:
    class Locked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()  # deepcopy refuses a lock
            self.lin = torch.nn.Linear(2, 2)

    def reload() -> torch.nn.Module:
        return Locked()

    torch.manual_seed(123)
    first = pristine_copy(Locked(), reload)
    torch.manual_seed(0)
    expected = Locked()
    assert torch.equal(first.lin.weight, expected.lin.weight)


def test_the_compile_note_splits_a_compile_and_counts_the_fx_graph_cache() -> None:
    clock = compile_clock()
    fn = torch.compile(torch.nn.Linear(3, 3), backend="inductor")
    fn(torch.randn(2, 3))
    note = compile_note(clock)
    assert note.startswith("trace ")
    for part in ("aot", "inductor", "kernels", "FX graph cache"):
        assert part in note
    hits, misses = (int(note.split("cache ")[1].split()[i]) for i in (0, 2))
    assert hits + misses >= 1  # the graph was compiled, answered by the cache or not
    # the difference since the reading, not the process's running totals
    assert compile_note(compile_clock()).endswith("FX graph cache 0 hit, 0 miss")
    assert compile_note({}) == ""


def test_a_compile_is_a_step_after_which_a_waiting_measurer_goes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage processes sharing a GPU make way at the end of each compile (devicelock)."""
    from pytest_opprof import devicelock
    from pytest_opprof.stages import common

    made_way: list[bool] = []
    monkeypatch.setattr(devicelock, "make_way", lambda: made_way.append(True))
    model = torch.nn.Linear(4, 2).eval()
    _, seconds = common.compile_timed(model, "eager", (torch.randn(3, 4),), "cpu")
    assert made_way == [True] and seconds >= 0
    common.step_done("cpu")  # any other step: the same, once its GPU work has finished
    assert made_way == [True, True]


def test_the_gpu_time_pass_is_sized_by_host_launches_not_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA-graph replay is one launch whatever its kernels: the launch queue takes a full
    sample of its calls (the LSTM's graph of 545 kernels got one call a sample by its kernels).
    A profile written before the launch count existed falls back to the kernels."""
    from types import SimpleNamespace

    from pytest_opprof.capture import timing
    from pytest_opprof.capture.timing import RoundSamples
    from pytest_opprof.stages import capture

    seen: dict[str, object] = {}

    def record(calls: object, inputs: object, **kwargs: object) -> dict[str, float]:
        seen.update(kwargs)
        return {}

    monkeypatch.setattr(timing, "gpu_time", record)
    samples = RoundSamples({"optimized": [1.0], "eager": [4.0]}, {"optimized": 30, "eager": 12})

    def timeline(label: str, kernels: float, launches: float | None) -> SimpleNamespace:
        summary = SimpleNamespace(kernels_per_iter=kernels, launches_per_iter=launches)
        return SimpleNamespace(label=label, summary=summary)

    timelines = [timeline("optimized", 545.0, 1.0), timeline("eager", 536.0, None)]
    capture.gpu_time({}, (), "cuda", samples, timelines)
    assert seen["launches"] == {"optimized": 1.0, "eager": 536.0}
    assert seen["calls_per_sample"] == {"optimized": 30, "eager": 12}


def test_a_process_on_its_own_cpus_compiles_without_holding_the_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """From Dynamo's compile start to its end the stage process holds no share, so a measurer
    takes the GPU at once; it shares again before running what it compiled. A CUDA-graph
    recording (the other trigger of the same callbacks) lets go of nothing, a process whose
    CPUs are not its own never lets go, and a ``torch._dynamo.reset()`` (which clears the
    callbacks) is undone at the next compile."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    from pytest_opprof import devicelock
    from pytest_opprof.capture import timing
    from pytest_opprof.stages import common

    monkeypatch.setattr(timing, "synchronize", lambda device: None)  # "cuda" on this CPU
    monkeypatch.setattr(devicelock, "_LOCK", None)
    path = tmp_path / "gpu.lock"
    monkeypatch.setenv(devicelock.LOCK_ENV, str(path))
    lock = devicelock.join()
    assert lock is not None
    seen: list[tuple[str | None, bool]] = []

    def gpu_free() -> bool:  # whether a measurer would have the GPU at once
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        seen.append((lock.held, gpu_free()))
        return gm.forward

    try:
        monkeypatch.setattr(common, "_OWN_CPUS", True)
        for attempt in range(2):
            torch._dynamo.reset()  # the second time: after a reset cleared the callbacks
            common.compile_timed(torch.nn.Linear(4, 2), backend, (torch.randn(3, 4),), "cuda")
            assert seen[-1] == (None, True) and lock.held == "shared", attempt
            assert not gpu_free()
        with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0"):
            assert lock.held == "shared"
        monkeypatch.setattr(common, "_OWN_CPUS", False)
        torch._dynamo.reset()
        common.compile_off_gpu("cuda")
        assert common._off_gpu_start not in callback_handler.start_callbacks
    finally:
        torch._dynamo.reset()
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_timing_process_beside_its_siblings_compiles_without_a_worker_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's compile workers start at a process's first compile, each importing torch on
    the CPUs a sibling timing process measures on; a recapture's side-by-side processes compile
    in-process instead (the caches answer them). A process on CPUs of its own keeps the pool."""
    import torch._inductor.config
    from torch._inductor.async_compile import AsyncCompile

    from pytest_opprof.stages import common

    # config.patch, not monkeypatch: monkeypatch's undo leaves Inductor's config without the
    # key (a later compile in this process then fails on config.compile_threads)
    with torch._inductor.config.patch(compile_threads=4):
        monkeypatch.setattr(common, "_SHARES_CPUS", False)
        common.setup_torch()
        assert torch._inductor.config.compile_threads == 4
        monkeypatch.setattr(common, "_SHARES_CPUS", True)
        common.setup_torch()
        assert torch._inductor.config.compile_threads == 1
        assert not AsyncCompile.use_process_pool()  # no pool, none started


@pytest.mark.parametrize(
    ("shares", "siblings", "off_gpu"),
    [(False, False, True), (True, True, True), (True, False, False)],
    ids=["alone on its slice", "siblings with their lock", "siblings without one"],
)
def test_the_spec_says_whether_a_stage_process_may_compile_off_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    shares: bool,
    siblings: bool,
    off_gpu: bool,
) -> None:
    """On a slice of its own a stage process compiles off the GPU; so do siblings on one
    slice (a recapture's timing processes) that hold their lock, whose measurements wait for
    each other's compiles; siblings without it compile holding the GPU."""
    import json

    from torch._dynamo.callback import callback_handler

    from pytest_opprof import devicelock, runner, stages
    from pytest_opprof.stages import common

    seen: dict[str, bool] = {}

    def task(spec: dict[str, object]) -> None:
        common.compile_off_gpu("cuda")
        seen.update(
            shares=common._SHARES_CPUS,
            off_gpu=common._off_gpu_start in callback_handler.start_callbacks,
        )

    monkeypatch.setitem(stages.TASKS, "probe", task)
    monkeypatch.setattr(runner, "die_with_parent", lambda: None)
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    monkeypatch.setenv(devicelock.OWN_CPUS_ENV, "1")
    monkeypatch.setattr(common, "_SHARES_CPUS", False)
    monkeypatch.setattr(common, "_OWN_CPUS", False)
    spec = tmp_path / "spec.json"
    body: dict[str, object] = {"task": "probe", "workload": "w.py", "shares_cpus": shares}
    if siblings:
        body["siblings_lock"] = str(tmp_path / "siblings.lock")
    spec.write_text(json.dumps(body))
    torch._dynamo.reset()
    try:
        assert runner.main([str(spec)]) == 0
        assert seen == {"shares": shares, "off_gpu": off_gpu}
    finally:
        torch._dynamo.reset()  # the callbacks registered here
        if devicelock._LOCK is not None:
            devicelock._LOCK.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_validation_compiles_off_the_gpu_in_its_tests_and_after_its_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Validation compiles twice: in the generated tests, and in the smoke run after a
    ``torch._dynamo.reset()`` that clears Dynamo's callbacks. Both times they let go of the
    GPU, on a process whose CPUs are its own."""
    from types import SimpleNamespace

    from torch._dynamo.callback import callback_handler

    from pytest_opprof.capture import system, timing
    from pytest_opprof.stages import common
    from pytest_opprof.stages import validate as validate_stage

    registered: dict[str, bool] = {}

    def seen(step: str) -> None:
        registered[step] = common._off_gpu_start in callback_handler.start_callbacks

    def tests(spec: object) -> SimpleNamespace:
        seen("tests")
        return SimpleNamespace(status="pass")

    monkeypatch.setattr(common, "_OWN_CPUS", True)
    monkeypatch.setattr(common, "options", lambda spec: SimpleNamespace(device="cuda"))
    monkeypatch.setattr(system, "resolve_device", lambda requested: "cuda")
    monkeypatch.setattr(timing, "synchronize", lambda device: None)  # "cuda" on this CPU
    monkeypatch.setattr(validate_stage, "_validate_import", lambda spec, steps: object())
    monkeypatch.setattr(validate_stage, "_generated_tests", tests)
    monkeypatch.setattr(common, "import_generated", lambda path: object())
    monkeypatch.setattr(
        validate_stage, "_validate_run", lambda spec, module, steps: seen("smoke run")
    )
    torch._dynamo.reset()
    spec = ChildSpec(
        task="validate",
        workload="w.py",
        generated=Path("x_optimized.py"),
        tests_log=Path("generated_tests.log"),
    )
    try:
        validate_stage.task_validate(spec)
    finally:
        torch._dynamo.reset()
    assert registered == {"tests": True, "smoke run": True}
    # where a process beside runs the tests (no log named), this one only smoke-runs the file;
    # the one beside lets go of the GPU as it compiles, too
    registered.clear()
    written: list[dict[str, Any]] = []
    monkeypatch.setattr(validate_stage, "_write_steps", lambda spec, steps: written.append(steps))
    try:
        validate_stage.task_validate(spec.model_copy(update={"tests_log": None}))
        assert registered == {"smoke run": True}
        torch._dynamo.reset()
        validate_stage.task_validate_tests(spec.model_copy(update={"task": "validate_tests"}))
    finally:
        torch._dynamo.reset()
    assert registered == {"smoke run": True, "tests": True}
    assert [set(steps) for steps in written] == [{"tests"}]


def test_only_the_reported_measurements_may_time_from_any_cpu_of_the_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The capture's, recapture's and retime's timing (quiet, under the lock) may move its
    launching thread to any CPU of the host; selection's (not quiet) stays on its own."""
    from pytest_opprof import devicelock
    from pytest_opprof.capture import timing
    from pytest_opprof.stages import capture, common

    seen: list[bool] = []

    def time_interleaved(*args: Any, any_cpu: bool, **kwargs: Any) -> dict[str, Any]:
        seen.append(any_cpu)
        return {}

    monkeypatch.setattr(timing, "time_interleaved", time_interleaved)
    monkeypatch.setattr(common, "setting", lambda spec, name: 1)
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    assert devicelock.join() is not None
    with devicelock.measuring(quiet=True):
        capture.time_calls(ChildSpec(task="recapture", workload="w.py"), {}, (), "cuda")
    with devicelock.measuring():
        capture.time_calls(ChildSpec(task="recapture", workload="w.py"), {}, (), "cuda")
    assert seen == [True, False]
