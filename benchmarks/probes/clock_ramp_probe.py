"""Probe: how long does an idle GPU take to reach its working clock once work arrives?

The timing pass warmed each measurement up for at least 0.5 s because an idle H200 reads
345 MHz and the first rounds of a short call would otherwise time the clock's ramp. Between two
measurements of a pipeline run the GPU idles for seconds at most. This probe
idles the GPU for each of several pauses, then keeps it busy with back-to-back spin kernels
(``torch.cuda._sleep``, a fixed number of cycles each) and reads each kernel's duration from
CUDA events: cycles per microsecond is the SM clock. It prints one JSON line per pause: the
clock (MHz) in each 10 ms window of the first 600 ms, and when it first came within 2% of the
last 100 ms.

Each pause is taken twice: idle (the host sleeps, the GPU has nothing), and behind one long
spin kernel, as the GPU-time pass (capture.timing.gpu_time) queues its calls behind one. A
clock that sagged during the spin would show in the second.

    python benchmarks/probes/clock_ramp_probe.py [pauses in s, default 0.5 2 5 10]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

SPIN_CYCLES = 200_000  # ~0.1 ms at 2 GHz: a fine sample, long enough to time with events
WINDOW_MS = 10.0
SPAN_MS = 600.0


def ramp(pause_s: float, behind_spin: bool) -> dict[str, object]:
    torch.cuda.synchronize()
    if behind_spin:  # the GPU spins for the pause; the events below queue behind it
        torch.cuda._sleep(int(pause_s * 1000 * _cycles_per_ms()))
    else:
        time.sleep(pause_s)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(int(SPAN_MS / 0.09))
    ]
    for start, end in events:  # enqueued far ahead of the GPU: they run back to back
        start.record()
        torch.cuda._sleep(SPIN_CYCLES)
        end.record()
    torch.cuda.synchronize()
    first = events[0][0]
    samples = [
        (first.elapsed_time(start), SPIN_CYCLES / (start.elapsed_time(end) * 1000.0))
        for start, end in events
    ]  # (ms since the first, MHz)
    samples = [(t, mhz) for t, mhz in samples if t < SPAN_MS]
    windows: dict[int, list[float]] = {}
    for t, mhz in samples:
        windows.setdefault(int(t // WINDOW_MS), []).append(mhz)
    mhz_by_window = [round(statistics.median(windows[w])) for w in sorted(windows)]
    settled = statistics.median(mhz for t, mhz in samples if t >= SPAN_MS - 100.0)
    at = next((t for t, mhz in samples if mhz >= 0.98 * settled), None)
    return {
        "pause_s": pause_s,
        "before": "spin" if behind_spin else "idle",
        "first_mhz": round(samples[0][1]),
        "settled_mhz": round(settled),
        "within_2pct_after_ms": None if at is None else round(at, 2),
        "mhz_per_10ms": mhz_by_window,
    }


def _cycles_per_ms() -> float:
    """Spin cycles per millisecond, the GPU busy (from capture.timing, which sizes its sleeps
    by it)."""
    from pytest_opprof.capture.timing import _sleep_cycles_per_ms

    return _sleep_cycles_per_ms()


def main(argv: list[str]) -> int:
    pauses = [float(a) for a in argv] or [0.5, 2.0, 5.0, 10.0]
    torch.cuda._sleep(1000)  # the context and the module loaded
    torch.cuda.synchronize()
    for pause in pauses:
        for behind_spin in (False, True):
            print(json.dumps(ramp(pause, behind_spin)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
