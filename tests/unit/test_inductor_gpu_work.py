"""Under max-autotune a compile goes off the GPU, and only Inductor's own GPU work takes it
back: an op's autotuning warmed one shared step at a time, then timed alone as one; other
timings alone, and freezing's fold shared (``stages.common.autotuning``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.stages import common

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")


def _joined(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, note: Callable[[str], None] | None = None
) -> Any:
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join(note=note)
    assert lock is not None
    return lock


def test_an_op_is_warmed_in_one_shared_hold_then_timed_alone_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One op's autotuning: warmed first (its inputs made, then each choice first called
    beside the GPU's other work, its timing skipped), all in one shared hold, then run again
    with the GPU alone for the whole op: the compile asks for the GPU twice per op, not once
    per choice. A Triton kernel's config is first called shared and timed alone."""
    from torch._inductor import freezing, select_algorithm
    from torch._inductor.runtime import benchmarking, triton_heuristics

    seen: list[tuple[str, str | None, bool]] = []
    lock_holder: list[Any] = []

    def record(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> str:
            lock = lock_holder[0]
            seen.append((name, lock.held, lock.aside))
            return name

        return fn

    bench = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", record("benchmark_gpu"), raising=False)
    monkeypatch.setattr(freezing, "freeze", record("freeze"))
    cache = select_algorithm.AlgorithmSelectorCache
    autotuner = triton_heuristics.CachingAutotuner

    def choice(cls: Any, name: str) -> Any:
        record(name)()
        return bench.benchmark_gpu()

    def op(cls: Any) -> list[Any]:  # Inductor's: the inputs, then each choice
        cls.get_inputs()
        return [cls.benchmark_choice(n) for n in ("a", "b")]

    def config(self: Any, launcher: str) -> Any:
        record(launcher)()
        return bench.benchmark_gpu()

    monkeypatch.setattr(cache, "get_inputs", classmethod(lambda cls: record("inputs")()))
    monkeypatch.setattr(cache, "benchmark_choice", classmethod(choice))
    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(op))
    monkeypatch.setattr(autotuner, "bench", config)
    wrapped = ("get_inputs", "benchmark_choice", "benchmark_in_current_process")
    originals = (
        bench.benchmark_gpu,
        freezing.freeze,
        *(vars(cache)[n] for n in wrapped),
        vars(autotuner)["bench"],
    )
    lock = _joined(monkeypatch, tmp_path)
    lock_holder.append(lock)
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            b: Any = bench  # called with none of their arguments: the fakes take any
            f: Any = freezing
            c: Any = cache
            assert b.benchmark_gpu() == "benchmark_gpu"
            assert f.freeze() == "freeze"
            assert seen == [("benchmark_gpu", "exclusive", False), ("freeze", "shared", False)]
            seen.clear()
            steps: list[tuple[str, str | None, bool]] = []
            real_go_aside = lock.go_aside

            def go_aside() -> None:  # the compile letting go of the GPU between two steps
                real_go_aside()
                steps.append(("aside", lock.held, lock.aside))

            monkeypatch.setattr(lock, "go_aside", go_aside)
            alone = 0
            real_exclusive = lock.exclusive

            def exclusive() -> None:
                nonlocal alone
                alone += lock.held != "exclusive"
                real_exclusive()

            monkeypatch.setattr(lock, "exclusive", exclusive)
            assert c.benchmark_in_current_process() == ["benchmark_gpu", "benchmark_gpu"]
            assert alone == 1  # once for the op, not once per choice
            assert autotuner.bench(None, "config") == "benchmark_gpu"  # type: ignore[arg-type]
            assert lock.held is None and lock.aside  # the compile off the GPU again
        assert seen == [
            ("inputs", "shared", False),  # warming: no timing
            ("a", "shared", False),
            ("b", "shared", False),
            ("inputs", "exclusive", False),  # timing: the op alone
            ("a", "exclusive", False),
            ("benchmark_gpu", "exclusive", False),
            ("b", "exclusive", False),
            ("benchmark_gpu", "exclusive", False),
            ("config", "shared", False),
            ("benchmark_gpu", "exclusive", False),
        ]
        # aside after the op warmed, the op timed, and the config
        assert len(steps) == 3
        # as they were after the block
        assert (
            bench.benchmark_gpu,
            freezing.freeze,
            *(vars(cache)[n] for n in wrapped),
            vars(autotuner)["bench"],
        ) == originals
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_without_the_steps_entry_points_the_op_s_warming_shares_the_gpu_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A torch whose select_algorithm has no ``benchmark_choice`` still keeps the op's GPU
    work under the lock: shared over the op's whole warming, then alone for its timing."""
    from torch._inductor import select_algorithm

    cache = select_algorithm.AlgorithmSelectorCache
    held: list[str | None] = []
    monkeypatch.delattr(cache, "benchmark_choice")
    lock = _joined(monkeypatch, tmp_path)
    monkeypatch.setattr(
        cache, "benchmark_in_current_process", classmethod(lambda cls: held.append(lock.held))
    )
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            c: Any = cache
            c.benchmark_in_current_process()
        assert held == ["shared", "exclusive"]
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_timed_kernel_is_first_called_sharing_the_gpu_then_timed_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first call of a timed callable builds or loads its kernel on the CPU: it shares the
    GPU, and only the timing (which calls it again) holds it alone. A first call that fails is
    left to the timing, which fails as Inductor expects."""
    from torch._inductor.runtime import benchmarking

    lock = _joined(monkeypatch, tmp_path)
    calls: list[tuple[str, str | None]] = []

    def timing(kernel: Any, rep: int = 100) -> float:
        calls.append(("timing", lock.held))
        for _ in range(2):
            kernel()
        return 0.01

    def kernel() -> None:
        calls.append(("kernel", lock.held))

    def broken() -> None:
        calls.append(("broken", lock.held))
        raise RuntimeError("invalid configuration argument")

    bench: Any = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", timing, raising=False)
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            assert bench.benchmark_gpu(kernel, rep=40) == 0.01
            assert calls == [
                ("kernel", "shared"),
                ("timing", "exclusive"),
                ("kernel", "exclusive"),
                ("kernel", "exclusive"),
            ]
            calls.clear()
            with pytest.raises(RuntimeError, match="invalid configuration"):
                bench.benchmark_gpu(broken)
            assert calls == [("broken", "shared"), ("timing", "exclusive"), ("broken", "exclusive")]
            assert f"{common.FIRST_CALL} took" not in capsys.readouterr().out  # quick ones
            monkeypatch.setattr(devicelock, "SHARED_NOTE_S", 0.0)
            bench.benchmark_gpu(kernel)
            assert f"{common.FIRST_CALL} took " in capsys.readouterr().out  # where a step goes
            assert lock.held is None and lock.aside  # the compile off the GPU again
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_an_op_s_kernels_stay_loaded_from_warming_to_timing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Warming calls each choice's kernel once, sharing the GPU, and times nothing; the
    kernels it loaded stay loaded (torch 2.13 unloads a choice's after its timing), so the
    timing pass, alone on the GPU, calls them with no first call apart and unloads them."""
    from torch._inductor import autotune_process, select_algorithm
    from torch._inductor.runtime import benchmarking

    lock = _joined(monkeypatch, tmp_path)
    calls: list[tuple[str, str | None]] = []

    def timing(kernel: Any, rep: int = 100) -> float:
        calls.append(("timing", lock.held))
        kernel()
        return 0.01

    def kernel() -> None:
        calls.append(("kernel", lock.held))

    request = autotune_process.TritonBenchmarkRequest

    def cleanup(self: Any) -> None:
        calls.append(("unloaded", lock.held))

    def op(cls: Any) -> float:  # one choice: timed, then its kernels unloaded
        try:
            return float(bench.benchmark_gpu(kernel))
        finally:
            request.cleanup_run_fn(None)  # type: ignore[arg-type]

    bench: Any = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", timing, raising=False)
    monkeypatch.setattr(request, "cleanup_run_fn", cleanup)
    cache: Any = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(op))
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            assert cache.benchmark_in_current_process() == 0.01
        assert calls == [
            ("kernel", "shared"),  # warming: loaded and first called, kept loaded
            ("timing", "exclusive"),
            ("kernel", "exclusive"),
            ("unloaded", "exclusive"),
        ]
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_an_op_whose_warming_fails_is_timed_as_inductor_would(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A warming that raises is set aside: the timing runs the op again, and what it raises
    or returns is Inductor's answer. With no lock joined the op runs once, as it was."""
    from torch._inductor import select_algorithm

    runs: list[str | None] = []

    def op(cls: Any) -> str:
        runs.append(devicelock._LOCK.held if devicelock._LOCK is not None else None)
        if len(runs) == 1:
            raise RuntimeError("first run fails")
        return "timed"

    cache: Any = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(op))
    monkeypatch.setattr(devicelock, "_LOCK", None)
    with common._inductor_gpu_work(), pytest.raises(RuntimeError, match="first run fails"):
        cache.benchmark_in_current_process()
    assert runs == [None]  # no lock: once
    runs.clear()
    lock = _joined(monkeypatch, tmp_path)
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            assert cache.benchmark_in_current_process() == "timed"
        assert runs == ["shared", "exclusive"]  # warmed in one shared hold, timed alone
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_an_op_s_triton_kernels_are_built_before_its_warming_holds_the_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before the op's warming takes the GPU, each Triton choice's kernel is built or loaded
    (``TritonBenchmarkRequest.precompile``) holding nothing, and stays loaded for the warming
    (no cleanup meanwhile); other choices are left as they are, and a build that fails is
    left to the warming. Then the warming shares the GPU once and the timing holds it alone."""
    from torch._inductor import autotune_process, select_algorithm

    lock = _joined(monkeypatch, tmp_path)
    events: list[tuple[str, str | None]] = []
    request = autotune_process.TritonBenchmarkRequest

    def precompile(self: Any) -> None:
        events.append((f"build {self.name}", lock.held))
        if self.name == "broken":
            raise RuntimeError("out of resource: shared memory")

    def cleanup(self: Any) -> None:
        events.append(("unloaded", lock.held))

    def triton(name: str) -> Any:
        req = object.__new__(request)
        req.name = name  # type: ignore[attr-defined]
        return SimpleNamespace(bmreq=req)

    def op(cls: Any, choices: list[Any], *rest: Any) -> str:
        events.append(("op", lock.held))
        return "timed"

    monkeypatch.setattr(request, "precompile", precompile)
    monkeypatch.setattr(request, "cleanup_run_fn", cleanup)
    cache: Any = select_algorithm.AlgorithmSelectorCache
    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(op))
    choices = [triton("a"), SimpleNamespace(bmreq=None), triton("broken"), SimpleNamespace()]
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            assert cache.benchmark_in_current_process(choices, [], None, None) == "timed"
        assert events == [
            ("build a", None),
            ("build broken", None),
            ("op", "shared"),  # warming
            ("op", "exclusive"),  # timing
        ]
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


@pytest.mark.parametrize("own_cpus", [True, False])
def test_a_kernel_s_build_on_its_first_call_lets_go_of_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    own_cpus: bool,
) -> None:
    """A Triton kernel built or loaded on its first call (``CachingAutotuner.precompile``) is
    CPU work: inside a shared step, the process lets go of the GPU for it, so a measurer does
    not wait for it, and shares again for the launch. The step's note counts only what it
    held. A process whose CPU work must not run beside a measurement keeps its share."""
    from torch._inductor.runtime import benchmarking, triton_heuristics

    from pytest_opprof.capture import timing as capture_timing

    monkeypatch.setattr(common, "_OWN_CPUS", own_cpus)
    monkeypatch.setattr(capture_timing, "synchronize", lambda device: None)  # no GPU here
    notes: list[str] = []
    lock = _joined(monkeypatch, tmp_path, notes.append)
    calls: list[tuple[str, str | None]] = []
    autotuner: Any = triton_heuristics.CachingAutotuner

    def precompile(self: Any) -> None:
        calls.append(("built", lock.held))
        time.sleep(0.3)

    def kernel() -> None:
        autotuner.precompile(None)
        calls.append(("launched", lock.held))

    def timing(fn: Any, rep: int = 100) -> float:
        return 0.01

    bench: Any = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", timing, raising=False)
    monkeypatch.setattr(autotuner, "precompile", precompile)
    monkeypatch.setattr(devicelock, "SHARED_NOTE_S", 0.2)
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            bench.benchmark_gpu(kernel)
            assert lock.held is None and lock.aside  # the compile off the GPU again
        held_while_built = None if own_cpus else "shared"
        assert calls == [("built", held_while_built), ("launched", "shared")]
        assert f"{common.FIRST_CALL} took " in capsys.readouterr().out  # build and launch
        shared = [n for n in notes if n.startswith(devicelock.SHARED)]
        assert bool(shared) is not own_cpus, notes  # held 0.3 s only where it kept it
        calls.clear()
        built = threading.Thread(target=lambda: autotuner.precompile(None))  # a pool's thread
        with (
            common._inductor_gpu_work(),
            devicelock.off_gpu(lambda: None),
            devicelock.on_gpu(lambda: None, "a step"),
        ):
            built.start()
            built.join()
        assert calls == [("built", "shared")]  # the step's share left as it was
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_this_torch_has_the_autotuning_entry_points() -> None:
    """The names ``_inductor_gpu_work`` wraps: where one goes missing in a new torch, its
    fallback holds the GPU for longer, so the change is caught here, not in a run's wall time."""
    from torch._inductor import select_algorithm
    from torch._inductor.runtime import benchmarking, triton_heuristics

    steps = {"get_inputs", "benchmark_choice", "benchmark_in_current_process"}
    assert steps <= set(vars(select_algorithm.AlgorithmSelectorCache))
    assert {"bench", "precompile"} <= set(vars(triton_heuristics.CachingAutotuner))
    assert callable(getattr(benchmarking.benchmarker, "benchmark_gpu", None))


def test_autotuning_on_the_cpu_changes_nothing() -> None:
    from torch._inductor import freezing

    before = freezing.freeze
    with common.autotuning("cpu"):
        assert freezing.freeze is before


@pytest.mark.gpu
def test_a_max_autotune_compile_measures_alone_and_compiles_off_the_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On this torch's Inductor: the autotuning of a max-autotune compile under a lock holds
    the GPU alone (each hold says so as it ends), and the compile ends sharing it again."""
    import torch

    notes: list[str] = []
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join(note=notes.append)
    assert lock is not None
    monkeypatch.setattr(common, "_OWN_CPUS", True)
    try:
        model = torch.nn.Linear(512, 512).cuda().eval()
        x = torch.randn(256, 512, device="cuda")
        fn = torch.compile(model, mode="max-autotune-no-cudagraphs")
        with common.autotuning("cuda"), torch.no_grad():
            got = fn(x)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, model(x), rtol=2e-2, atol=2e-2)
        held = [n for n in notes if n.startswith(devicelock.MEASURED)]
        assert held, notes  # the choices were timed with the GPU alone
        assert lock.held == "shared" and not lock.aside
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)
        torch._dynamo.reset()


@pytest.mark.gpu
def test_a_max_autotune_op_is_warmed_shared_then_timed_in_one_hold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On this torch's Inductor: each choice of an autotuned op is called twice, first
    sharing the GPU (warming), then with the GPU alone, all of an op's timings in one hold;
    no Triton choice's kernel is built inside the warming's hold (built before it)."""
    import torch
    from torch._inductor import select_algorithm
    from torch._inductor.runtime import triton_heuristics

    lock = _joined(monkeypatch, tmp_path)
    monkeypatch.setattr(common, "_OWN_CPUS", True)
    cache = select_algorithm.AlgorithmSelectorCache
    seen: list[tuple[str | None, float | None]] = []
    ops = 0
    choice_of, op_of = (
        vars(cache)[n].__func__ for n in ("benchmark_choice", "benchmark_in_current_process")
    )

    built_in_hold: list[str] = []
    in_choice: list[str | None] = [None]
    autotuner = triton_heuristics.CachingAutotuner
    precompile_of = vars(autotuner)["precompile"]

    def precompile(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_choice[0] == "shared" and threading.current_thread() is threading.main_thread():
            built_in_hold.append(str(getattr(getattr(self, "fn", None), "__name__", self)))
        return precompile_of(self, *args, **kwargs)

    def choice(cls: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((lock.held, lock._since if lock.held == "exclusive" else None))
        in_choice[0] = lock.held
        try:
            return choice_of(cls, *args, **kwargs)
        finally:
            in_choice[0] = None

    def op(cls: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal ops
        ops += 1
        return op_of(cls, *args, **kwargs)

    monkeypatch.setattr(cache, "benchmark_choice", classmethod(choice))
    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(op))
    monkeypatch.setattr(autotuner, "precompile", precompile)
    try:
        model = torch.nn.Linear(384, 768).cuda().eval()
        x = torch.randn(128, 384, device="cuda")
        fn = torch.compile(model, mode="max-autotune-no-cudagraphs")
        fresh = {"fx_graph_cache": False, "autotune_local_cache": False}  # autotuned here
        with torch._inductor.config.patch(fresh), common.autotuning("cuda"), torch.no_grad():
            fn(x)
        torch.cuda.synchronize()
        warmed = [s for s in seen if s[0] == "shared"]
        timed = [s for s in seen if s[0] == "exclusive"]
        assert ops and ops % 2 == 0, ops  # each op run twice
        assert len(warmed) == len(timed) == len(seen) // 2 > 0, seen
        assert len({since for _, since in timed}) == ops // 2  # one hold per op
        # every Triton choice built before the warming's hold: its first call only launches
        assert built_in_hold == [], built_in_hold
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)
        torch._dynamo.reset()
