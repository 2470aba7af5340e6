"""Under max-autotune a compile goes off the GPU, and only Inductor's own GPU work takes it
back: its timings alone, each step of the autotuning around them and freezing's fold shared
(``stages.common.autotuning``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.stages import common

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")


def _joined(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join()
    assert lock is not None
    return lock


def test_inductor_timings_hold_the_gpu_alone_and_each_step_around_them_shares_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One op's autotuning: its inputs made, then each choice loaded and first called beside
    the GPU's other work, and timed alone. Between two steps the compile holds nothing, so a
    measurement of another process waits for one step, not for the op."""
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
            assert c.benchmark_in_current_process() == ["benchmark_gpu", "benchmark_gpu"]
            assert autotuner.bench(None, "config") == "benchmark_gpu"  # type: ignore[arg-type]
            assert lock.held is None and lock.aside  # the compile off the GPU again
        assert seen == [
            ("inputs", "shared", False),
            ("a", "shared", False),
            ("benchmark_gpu", "exclusive", False),
            ("b", "shared", False),
            ("benchmark_gpu", "exclusive", False),
            ("config", "shared", False),
            ("benchmark_gpu", "exclusive", False),
        ]
        assert len(steps) == 4  # after the inputs, each choice and the config
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


def test_without_the_steps_entry_points_the_op_s_autotuning_shares_the_gpu_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A torch whose select_algorithm has no ``benchmark_choice`` still keeps the op's GPU
    work under the lock: shared over the op's whole autotuning."""
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
        assert held == ["shared"]
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
