"""capture.timing.gpu_time on a simulated GPU: a host and a device clock, a launch queue, and
CUDA events that complete when the device reaches them. The real thing runs on the H200
(tests/gpu); here the logic that keeps only samples where the host got ahead is pinned down."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pytest_opprof.capture import timing

RATE = 1_980_000.0  # spin cycles per ms


class FakeGPU:
    """One stream: ops run in order on the device, each after it is launched; the host blocks
    where the launch queue is full."""

    def __init__(self, queue: int = 1024) -> None:
        self.host = 0.0  # ms
        self.queue = queue
        self.ends: list[float] = []  # device end time of each op launched

    def launch(self, duration: float) -> float:
        pending = [e for e in self.ends if e > self.host]
        if len(pending) >= self.queue:
            self.host = sorted(pending)[len(pending) - self.queue]
        start = max(self.host, self.ends[-1] if self.ends else 0.0)
        self.ends.append(start + duration)
        return start + duration

    def synchronize(self) -> None:
        self.host = max(self.host, self.ends[-1] if self.ends else 0.0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at: float | None = None

            def record(self) -> None:
                gpu.host += 0.002
                self.at = gpu.launch(0.0)

            def query(self) -> bool:
                assert self.at is not None
                return gpu.host >= self.at

            def synchronize(self) -> None:
                assert self.at is not None
                gpu.host = max(gpu.host, self.at)

            def elapsed_time(self, other: Event) -> float:
                assert self.at is not None and other.at is not None
                return other.at - self.at

        def sleep(cycles: int) -> None:
            gpu.host += 0.005
            gpu.launch(cycles / RATE)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
        monkeypatch.setattr(timing.time, "perf_counter", lambda: gpu.host / 1000.0)
        timing._sleep_cycles_per_ms.cache_clear()

    def call(self, host_ms: float, kernels: list[float], sync: bool = False) -> Any:
        def fn(*_: Any) -> None:
            for k in kernels:
                self.host += host_ms / len(kernels)
                self.launch(k)
            if sync:
                self.synchronize()

        return fn


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    g = FakeGPU(queue=64)
    g.install(monkeypatch)
    yield g
    timing._sleep_cycles_per_ms.cache_clear()


def measure(calls: dict[str, Any], n: int = 30) -> dict[str, float]:
    return timing.gpu_time(
        calls, (torch.zeros(2),), device="cuda", calls_per_sample=dict.fromkeys(calls, n)
    )


def test_sleep_calibration_reads_the_spin_rate(gpu: FakeGPU) -> None:
    assert timing._sleep_cycles_per_ms() == pytest.approx(RATE)


def test_a_launch_bound_call_gets_its_kernel_time_not_its_latency(gpu: FakeGPU) -> None:
    # 0.3 ms of host work per call launching 0.1 ms of kernels: latency 0.3, GPU time 0.1
    got = measure({"launch_bound": gpu.call(0.3, [0.02] * 5), "busy": gpu.call(0.01, [0.4])})
    assert got["launch_bound"] == pytest.approx(0.1)
    assert got["busy"] == pytest.approx(0.4)


def test_more_launches_than_the_queue_holds_fall_back_to_fewer_calls(gpu: FakeGPU) -> None:
    # 20 kernels a call: 30 calls overflow a 64-deep queue, 3 calls fit
    got = measure({"many_kernels": gpu.call(0.5, [0.01] * 20)})
    assert got["many_kernels"] == pytest.approx(0.2)


def test_latency_and_kernel_counts_size_the_first_attempt(
    gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told the call's latency and launches, every attempt keeps its sample; not told, the
    first attempts miss (a sleep too short, a queue too small) before the same figure."""
    sleeps: list[int] = []
    real_sleep = torch.cuda._sleep

    def counted_sleep(cycles: int) -> None:
        sleeps.append(cycles)
        real_sleep(cycles)

    monkeypatch.setattr(torch.cuda, "_sleep", counted_sleep)
    monkeypatch.setattr(timing, "LAUNCH_QUEUE", 60)  # the fake queue holds 64
    fn = gpu.call(0.5, [0.01] * 20)
    args = ({"f": fn}, (torch.zeros(2),))

    told = timing.gpu_time(
        *args,
        device="cuda",
        calls_per_sample={"f": 30},
        latency_ms={"f": 0.5},
        launches={"f": 20},
    )
    attempts_told = len(sleeps) - 2  # two calibrate the sleep
    sleeps.clear()
    untold = timing.gpu_time(*args, device="cuda", calls_per_sample={"f": 30})

    assert told["f"] == pytest.approx(0.2) and untold["f"] == pytest.approx(0.2)
    assert attempts_told == 5 < len(sleeps)


@pytest.mark.parametrize(
    ("round_calls", "latency_ms", "launches", "calls"),
    [
        (30, None, None, 30),  # nothing known: a timing round's calls
        (30, 0.035, 1.0, 30),  # a short replay: a round is under the window
        (30, 0.85, 1.0, 12),  # about 10 ms of a 0.85 ms call
        (5, 10.0, 200.0, 1),  # one call of a 10 ms eager model
        (30, 0.5, 100.0, 9),  # the launch queue bounds it below the window
    ],
)
def test_a_sample_queues_about_ten_milliseconds_of_calls(
    round_calls: int, latency_ms: float | None, launches: float | None, calls: int
) -> None:
    assert timing.calls_per_gpu_sample(round_calls, latency_ms, launches) == calls


def test_a_slow_call_holds_the_gpu_a_fraction_of_a_round_sized_pass(
    gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 ms call whose latency the timing pass measured: five samples of five calls (10 ms)
    give its GPU time as five samples of a round's 25 calls did, in about a third of the time
    the pass holds the GPU alone (each sample sleeps twice the host's enqueue time first, the
    first as long as the calls' latency says)."""
    fn = gpu.call(0.05, [2.0])
    spent = {}
    for name, window in (("window", timing.GPU_TIME_WINDOW_MS), ("round", 1e9)):
        monkeypatch.setattr(timing, "GPU_TIME_WINDOW_MS", window)
        t0 = gpu.host
        got = timing.gpu_time(
            {"f": fn},
            (torch.zeros(2),),
            device="cuda",
            calls_per_sample={"f": 25},
            latency_ms={"f": 2.0},
        )
        spent[name] = gpu.host - t0
        assert got["f"] == pytest.approx(2.0)
    assert spent["window"] < 0.35 * spent["round"]


def test_a_call_that_waits_on_the_host_has_no_gpu_time(gpu: FakeGPU) -> None:
    got = measure({"syncs": gpu.call(0.1, [0.05], sync=True), "fine": gpu.call(0.1, [0.05])})
    assert "syncs" not in got
    assert got["fine"] == pytest.approx(0.05)


def test_none_on_the_cpu() -> None:
    got = timing.gpu_time(
        {"f": lambda x: x}, (torch.zeros(2),), device="cpu", calls_per_sample={"f": 3}
    )
    assert got == {}


@pytest.mark.gpu
def test_on_the_gpu_the_profiler_kernel_sum_agrees_with_the_gpu_time() -> None:
    """A call the host holds up (it sleeps between launches): its latency is the host's, its
    GPU time is its kernels', which torch.profiler sums independently. The kernels are long
    (~0.1 ms): between two dependent kernels the GPU idles about a microsecond, which the
    GPU time counts and a kernel sum does not (8 kernels of 7 µs came out 19% apart on the
    H200)."""
    import time

    x = torch.randn(64 << 20, device="cuda")

    def host_bound(t: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            time.sleep(1e-3)
            t = t * 1.0001
        return t

    got = timing.gpu_time({"f": host_bound}, (x,), device="cuda", calls_per_sample={"f": 10})
    latency = timing.time_interleaved(
        {"f": host_bound}, (x,), device="cuda", warmup=2, calls_per_round=10, rounds=3
    )["f"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            host_bound(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 5 * 8
    kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1000.0 / 5
    assert got["f"] < 0.5 * min(latency)
    assert got["f"] == pytest.approx(kernel_ms, rel=0.1)


@pytest.mark.gpu
def test_on_the_gpu_a_ten_millisecond_window_gives_a_rounds_gpu_time() -> None:
    """A GPU-bound call of about 1 ms (a matmul chain): five samples of about 10 ms of calls
    (the latency known) against five of a timing round's 30 calls, the same per-call figure
    within 2%."""
    a = torch.randn(4096, 4096, device="cuda")

    def busy(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = x @ a
        return x

    x = torch.randn(4096, 4096, device="cuda")
    latency = min(
        timing.time_interleaved(
            {"f": busy}, (x,), device="cuda", warmup=3, calls_per_round=10, rounds=3
        )["f"]
    )
    window = timing.gpu_time(
        {"f": busy}, (x,), device="cuda", calls_per_sample={"f": 30}, latency_ms={"f": latency}
    )
    whole = timing.gpu_time({"f": busy}, (x,), device="cuda", calls_per_sample={"f": 30})
    assert timing.calls_per_gpu_sample(30, latency, None) < 30
    assert window["f"] == pytest.approx(whole["f"], rel=0.02)


@pytest.mark.gpu
def test_on_the_gpu_one_program_under_two_names_measures_alike() -> None:
    """A reduction over a tensor that fits in L2, timed after one that reads far more, then
    again under a second name: each round starts from a flushed L2, so neither name finds the
    other's data in the cache."""
    small = torch.randn(4 * 1024 * 1024, device="cuda")  # 16 MiB
    big = torch.randn(64 * 1024 * 1024, device="cuda")  # 256 MiB

    def program(x: torch.Tensor) -> torch.Tensor:
        return small.sum() + x.sum()

    samples = timing.time_interleaved(
        {"other": lambda x: big.sum() + x.sum(), "first": program, "second": program},
        (torch.zeros(8, device="cuda"),),
        device="cuda",
        warmup=3,
        calls_per_round=1,
        rounds=40,
    )
    first, second = (statistics.median(samples[k]) for k in ("first", "second"))
    assert 0.9 < first / second < 1.1
