"""Under max-autotune a compile goes off the GPU, and only Inductor's own GPU work takes it
back: its timings alone, the autotuning around them and freezing's fold shared
(``stages.common.autotuning``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import devicelock
from pytest_opprof.stages import common

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")


def test_inductor_timings_hold_the_gpu_alone_and_the_autotuning_around_them_shares_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch._inductor import freezing, select_algorithm
    from torch._inductor.runtime import benchmarking

    seen: dict[str, tuple[str | None, bool]] = {}
    lock_holder: list[Any] = []

    def record(name: str) -> Any:
        def fn(*args: Any, **kwargs: Any) -> str:
            lock = lock_holder[0]
            seen[name] = (lock.held, lock.aside)
            return name

        return fn

    bench = benchmarking.benchmarker
    monkeypatch.setattr(bench, "benchmark_gpu", record("benchmark_gpu"), raising=False)
    monkeypatch.setattr(freezing, "freeze", record("freeze"))
    cache = select_algorithm.AlgorithmSelectorCache

    def choices(cls: Any) -> tuple[str, Any]:
        # one op's choices: each loaded beside the GPU's other work, then timed alone
        record("choices")()
        return "choices", bench.benchmark_gpu()

    monkeypatch.setattr(cache, "benchmark_in_current_process", classmethod(choices))
    originals = (bench.benchmark_gpu, freezing.freeze, vars(cache)["benchmark_in_current_process"])

    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join()
    assert lock is not None
    lock_holder.append(lock)
    try:
        with common._inductor_gpu_work(), devicelock.off_gpu(lambda: None):
            b: Any = bench  # called with none of their arguments: the fakes take any
            f: Any = freezing
            c: Any = cache
            assert b.benchmark_gpu() == "benchmark_gpu"
            assert f.freeze() == "freeze"
            assert seen == {"benchmark_gpu": ("exclusive", False), "freeze": ("shared", False)}
            seen.clear()
            assert c.benchmark_in_current_process() == ("choices", "benchmark_gpu")
            assert lock.held is None and lock.aside  # the compile off the GPU again
        assert seen == {"choices": ("shared", False), "benchmark_gpu": ("exclusive", False)}
        # as they were after the block
        assert (
            bench.benchmark_gpu,
            freezing.freeze,
            vars(cache)["benchmark_in_current_process"],
        ) == originals
    finally:
        lock.close()
        monkeypatch.setattr(devicelock, "_LOCK", None)


def test_a_timed_kernel_is_first_called_sharing_the_gpu_then_timed_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first call of a timed callable builds or loads its kernel on the CPU: it shares the
    GPU, and only the timing (which calls it again) holds it alone. A first call that fails is
    left to the timing, which fails as Inductor expects."""
    from torch._inductor.runtime import benchmarking

    monkeypatch.setattr(devicelock, "_LOCK", None)
    monkeypatch.setenv(devicelock.LOCK_ENV, str(tmp_path / "gpu.lock"))
    lock = devicelock.join()
    assert lock is not None
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
