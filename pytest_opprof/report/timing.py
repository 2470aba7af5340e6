"""The report's "Timing" section: how the headline's latencies were measured — one process or
several pooled, rounds set aside on a slowed host, and where a baseline waits on the host so
that its ratio moves with the host's speed.

Every figure comes from ``profile_optimized.json``'s ``timing``; this module only says what
the headline's numbers are, never a number of its own.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from pytest_opprof.measure import SLOW_HOST
from pytest_opprof.report.format import BASELINE_LABELS, fmt_ms, para
from pytest_opprof.report.lookups import not_available
from pytest_opprof.schema import Timing

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

HOST_BOUND_SHARE = 0.8
"""A baseline whose GPU time (host hidden) is below this share of its latency waits on the host."""
PROCESS_SPREAD = 1.1
"""Processes' ratios further apart than this (max / min) are explained where the host can be."""


def section_timing(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Timing", ""]
    if a.optimized is None:
        return [*lines, *para(not_available(a, "recapture"))]
    return [*lines, *para(timing_note(a.optimized.timing))]


def timing_note(timing: Timing) -> str:
    """How the headline figures were timed: one process, or several pooled (with how far the
    processes' own ratios spread)."""
    head = "Median latency per call from `profile_optimized.json` (`timing`)"
    processes = timing.processes
    if processes <= 1:
        return (
            f"{head}, baseline and candidate timed interleaved in one process; the CI is a "
            "paired bootstrap." + _slow_host_note(timing) + _host_speed_note(timing)
        )
    spread = [
        f"{BASELINE_LABELS.get(r.baseline, r.baseline)} → {r.candidate}: "
        + ", ".join(f"{x:.2f}×" for x in r.process_ratios)
        for r in timing.speedups
        if r.process_ratios and r.candidate == "optimized"
    ]
    note = (
        f"{head}, baseline and candidate timed interleaved in each of {processes} fresh "
        "processes, pooled; the CI is a paired bootstrap that resamples processes, then rounds "
        "within each, widened to Student's t over the processes' own ratios where that reaches "
        "further."
    )
    if spread:
        note += " Each process's own ratio: " + "; ".join(spread) + "."
    bound = _host_bound_note(timing)
    note += _slow_host_note(timing) + bound + _host_speed_note(timing, said=bool(bound))
    alone = [n for n, v in timing.variants.items() if v.processes < processes]
    if alone:
        note += (
            " Timed in the first process only: "
            + ", ".join(
                "the plan at the baseline dtype"
                if n == "optimized_baseline_dtype"
                else BASELINE_LABELS.get(n, n)
                for n in alone
            )
            + "."
        )
    return note


def _slow_host_note(timing: Timing) -> str:
    """How many rounds were set aside because the host's CPU ran slowed during them."""
    most = max(timing.variants.values(), key=lambda v: v.rounds, default=None)
    if most is None or not most.set_aside:
        return ""
    us = sorted(timing.host_us)
    fast = f" (fast rounds: {us[len(us) // 10]:.1f} µs)" if us else ""
    return (
        f" {len(most.set_aside)} of {most.rounds} rounds are set aside: the host's CPU ran a "
        f"fixed piece of work more than {SLOW_HOST:.2f}× slower at their start than in its "
        f"fast rounds{fast}, which slows a launch-bound call alike (`timing.host_us`, each "
        "variant's `set_aside`)."
    )


def _host_speed_note(timing: Timing, *, said: bool = False) -> str:
    """The host's speed the figures were measured at, where a baseline is host-bound: its
    ratio moves with that speed between hosts (docs/reproducibility.md#the-host), so two runs
    compare at the same reference. ``said``: the note before already called it host-bound."""
    if not timing.host_us:
        return ""
    bound = []
    for name in ("compile", "eager"):
        if (split := _host_bound(timing, name)) is not None:
            label = BASELINE_LABELS.get(name, name)
            bound.append(f"{label} (GPU {fmt_ms(split[0])} of {fmt_ms(split[1])})")
    if not bound:
        return ""
    us = statistics.median(timing.host_us)
    if said:
        return (
            f" The host ran its reference CPU work at a median {us:.2f} µs per call "
            "(`timing.host_us`): compare runs at the same reference."
        )
    return (
        f" The host ran its reference CPU work at a median {us:.2f} µs per call "
        f"(`timing.host_us`); {' and '.join(bound)} {'is' if len(bound) == 1 else 'are'} "
        "host-bound, so a ratio against it moves with the host's speed: compare runs at "
        "the same reference."
    )


def _host_bound(timing: Timing, name: str) -> tuple[float, float] | None:
    """A baseline's GPU time and latency (ms) where its call is host-bound: the GPU works less
    than ``HOST_BOUND_SHARE`` of it. None where it is not, or either figure is missing."""
    gpu_ms, base = timing.gpu_time_ms.get(name), timing.variants.get(name)
    if not gpu_ms or base is None or gpu_ms >= HOST_BOUND_SHARE * base.median_ms:
        return None
    return gpu_ms, base.median_ms


def _host_bound_note(timing: Timing) -> str:
    """Why the processes' ratios disagree, where the baseline's call is host-bound: its latency
    is the host CPU's speed in that process, and that speed differs between processes on a
    shared host (benchmarks/probes/launch_probe.py), while the GPU's does not."""
    parts = []
    for r in timing.speedups:
        if r.candidate != "optimized" or len(r.process_ratios) < 2 or min(r.process_ratios) <= 0:
            continue
        if max(r.process_ratios) / min(r.process_ratios) <= PROCESS_SPREAD:
            continue
        if (split := _host_bound(timing, r.baseline)) is not None:
            gpu_ms, base_ms = split
            label = BASELINE_LABELS.get(r.baseline, r.baseline)
            parts.append(
                f"{fmt_ms(gpu_ms)} of {label}'s {fmt_ms(base_ms)} ({gpu_ms / base_ms:.0%})"
            )
    if not parts:
        return ""
    one = len(parts) == 1
    return (
        f" The processes disagree because the baseline{'' if one else 's'} "
        f"{'is' if one else 'are'} host-bound: the GPU works {'; '.join(parts)}, so "
        f"{'its latency' if one else 'their latencies'}, and the ratio, follow the speed of "
        "the CPU each process ran on."
    )
