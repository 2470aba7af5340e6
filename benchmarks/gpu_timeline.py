"""Lay a run's stage logs on one timeline: who held the GPU alone when, and what each wait for it
was behind.

Every stage log starts with the wall clock of its process's start (``runner.wall_clock``) and
says each wait for the GPU ("had the GPU after N s") and each measurement's end ("let go of the
GPU, held to itself for N s": ``devicelock.MEASURED``). Laid on one clock, a wait that overlaps
another process's measurement was behind that measurement; the rest of it was a drain (the
measurer it queued behind waiting for its neighbours' steps of shared work to end) or the
turnstile. The compiles' holds of the GPU shared for a quarter second or more
(``devicelock.SHARED``), which such drains wait for, are summed by what they were.

    python benchmarks/gpu_timeline.py OUT_DIR        # the --opprof-out of a run (w-p/)
    python benchmarks/gpu_timeline.py OUT_DIR --until 547   # its first 547 s only

Where the run folder holds ``host_load.txt`` (``benchmarks/host_load.py``, which
``gpu_session.sh`` runs beside pytest), it also says how busy the host's CPUs were over the
same span: a run whose processes wait for the GPU while the CPUs are full is bound by its
compiles, not by the GPU's lock.

It also sums the measurements' GPU-time passes (``stages.capture.GPU_TIMES``), and for the
recaptures started beside validation (``stages.recapture.VALIDATED``) says how long their
processes ran while their workload's validation did, and how long they then waited for it;
and per workload, selection's builds, how many the FX graph cache answered, and the rung
warmers' builds ahead of it (``--opprof-warm-rungs``) with selection's waits for them.

``--until`` lays a whole run beside one cut short (a lent machine taken back mid-run, only
the stage logs so far brought back): the same span of both, from each run's first process.

Logs without the wall clock (runs before 2026-12-03's 32af259) are skipped, said on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pytest_opprof import devicelock
from pytest_opprof.stages import capture, recapture

LINE = re.compile(r"^\[opprof\] \+\s*([\d.]+) s  (.*)$")
START = re.compile(r"(?:forked from the fork server of pid \d+|started) at ([\d:.]+) UTC$")
WAITED = re.compile(r"^had the GPU after ([\d.]+) s$")
QUIET = re.compile(r"^the host was quiet after ([\d.]+) s$")
"""A quiet measurement's wait for the host's compiles with the GPU held (logs before the wait
came first): the GPU idled through it."""
HUSHED = re.compile(rf"^{re.escape(devicelock.QUIETED)} ([\d.]+) s$")
"""The same wait holding nothing of the GPU (``devicelock.QUIETED``)."""
MEASURED = re.compile(rf"^{re.escape(devicelock.MEASURED)} ([\d.]+) s$")
SHARED = re.compile(rf"^{re.escape(devicelock.SHARED)} ([\d.]+) s: (.*)$")
HELD_BACK = re.compile(rf"^{re.escape(devicelock.COMPILES_AGAIN)} ([\d.]+) s$")
"""A compile's wait at the turnstile of a quiet measurement (``devicelock.COMPILES_AGAIN``)."""
PAUSED = re.compile(rf"^{re.escape(devicelock.PAUSED)} (\d+) processes(?:, (\d+) .*)?$")
"""A quiet measurement that paused the compiles under way (``devicelock.PAUSED``)."""
"""A compile's long hold of the GPU shared (``devicelock.SHARED``): what drains wait for."""
GPU_TIMES = re.compile(rf"^{re.escape(capture.GPU_TIMES)} ([\d.]+) s$")
"""A measurement's GPU-time pass, with the GPU held alone (``stages.capture.GPU_TIMES``)."""
GATED = re.compile(rf"^{re.escape(recapture.VALIDATED)} after ([\d.]+) s of waiting$")
"""A recapture's process started beside validation, past its gate (``recapture.VALIDATED``)."""

Span = tuple[float, float]


@dataclass
class Process:
    name: str  # workload/log
    start: float  # seconds since midnight UTC
    end: float = 0.0
    waits: list[Span] = field(default_factory=list)
    alone: list[Span] = field(default_factory=list)
    quiet_waits: list[Span] = field(default_factory=list)
    host_waits: list[Span] = field(default_factory=list)
    shared: list[tuple[float, float, str]] = field(default_factory=list)  # span, what
    held_back: list[Span] = field(default_factory=list)  # compiles behind a quiet measurement
    paused: list[tuple[float, int]] = field(default_factory=list)  # when, processes stopped
    gpu_times: list[float] = field(default_factory=list)  # seconds of each GPU-time pass
    gate: Span | None = None  # a recapture's wait for validation to pass


def _seconds(clock: str) -> float:
    t = datetime.strptime(clock, "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def read(log: Path, name: str) -> Process | None:
    """One stage process's spans, on the wall clock; None where its log has no start time."""
    proc: Process | None = None
    for raw in log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = LINE.match(raw)
        if m is None:
            continue
        t, what = float(m.group(1)), m.group(2)
        if proc is None:
            s = START.search(what)
            if s is None:
                return None
            proc = Process(name, _seconds(s.group(1)) - t)
            continue
        at = proc.start + t
        proc.end = max(proc.end, at)
        for pattern, spans in (
            (WAITED, proc.waits),
            (MEASURED, proc.alone),
            (QUIET, proc.quiet_waits),
            (HUSHED, proc.host_waits),
        ):
            w = pattern.match(what)
            if w is not None:
                spans.append((at - float(w.group(1)), at))
        back = HELD_BACK.match(what)
        if back is not None:
            proc.held_back.append((at - float(back.group(1)), at))
        stopped = PAUSED.match(what)
        if stopped is not None:
            proc.paused.append((at, int(stopped.group(1))))
        held = SHARED.match(what)
        if held is not None:
            proc.shared.append((at - float(held.group(1)), at, held.group(2)))
        passed = GPU_TIMES.match(what)
        if passed is not None:
            proc.gpu_times.append(float(passed.group(1)))
        gated = GATED.match(what)
        if gated is not None:
            proc.gate = (at - float(gated.group(1)), at)
    return proc


def past_midnight(procs: list[Process]) -> None:
    """Processes started after midnight UTC in a run that began before it: their clock times
    moved a day on, so that the run reads in order."""
    day = 86400.0
    if not any(p.start < day / 4 for p in procs) or not any(p.start > 3 * day / 4 for p in procs):
        return
    for p in procs:
        if p.start < day / 2:
            p.start += day
            p.end += day
            for spans in (p.waits, p.alone, p.quiet_waits, p.host_waits, p.held_back):
                spans[:] = [(a + day, b + day) for a, b in spans]
            p.shared[:] = [(a + day, b + day, what) for a, b, what in p.shared]
            p.paused[:] = [(t + day, n) for t, n in p.paused]
            if p.gate is not None:
                p.gate = (p.gate[0] + day, p.gate[1] + day)


def cut_at(procs: list[Process], end: float) -> list[Process]:
    """The processes as they stood at ``end`` (clock seconds): those started by then, each span
    clipped to it and those begun after it dropped; a wait or hold under way at ``end`` counts
    up to it, as a cut run's logs would have shown (less its closing line)."""

    def clip(spans: list[Span]) -> list[Span]:
        return [(a, min(b, end)) for a, b in spans if a < end]

    kept = []
    for p in procs:
        if p.start >= end:
            continue
        q = Process(p.name, p.start, min(p.end, end))
        q.waits, q.alone = clip(p.waits), clip(p.alone)
        q.quiet_waits, q.host_waits = clip(p.quiet_waits), clip(p.host_waits)
        q.shared = [(a, min(b, end), what) for a, b, what in p.shared if a < end]
        q.held_back = clip(p.held_back)
        q.paused = [(t, n) for t, n in p.paused if t < end]
        kept.append(q)
    return kept


def _host_load() -> Any:
    """benchmarks/host_load.py, beside this file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "host_load", Path(__file__).with_name("host_load.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_host_load(path: Path, t0: float) -> list[tuple[float, float, float]]:
    """``host_load.txt``'s samples as (clock seconds, busy share, runnable threads per CPU),
    a sample stamped past midnight moved a day on where the run began before it; lines that
    do not parse (a sampler killed mid-line) are skipped."""
    day = 86400.0
    samples = []
    parse_line = _host_load().parse_line
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        sample = parse_line(line)
        if sample is None:
            continue
        clock, busy, runnable, cpus = sample
        try:
            at = _seconds(clock)
        except ValueError:
            continue
        if at < t0 - day / 2:
            at += day
        samples.append((at, busy, runnable / cpus if cpus else 0.0))
    return samples


def host_load(samples: list[tuple[float, float, float]], t0: float, t1: float) -> str | None:
    """One line on the host's CPUs over the run's span, or None without a sample in it."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return None
    busy = sorted(s[1] for s in inside)
    per_cpu = sorted(s[2] for s in inside)
    full = sum(1 for b in busy if b >= FULL) / len(busy)
    return (
        f"Host CPUs ({len(inside)} samples): {sum(busy) / len(busy):.0%} busy on average, "
        f"{FULL:.0%} or more for {full:.0%} of the run; runnable threads per CPU: median "
        f"{per_cpu[len(per_cpu) // 2]:.1f}, most {per_cpu[-1]:.1f}\n"
    )


FULL = 0.9
"""A host whose CPUs are this busy has none to spare for another compile."""


def overlap(span: Span, others: list[Span]) -> float:
    """Seconds of ``span`` covered by the union of ``others``."""
    cut = sorted(
        (max(a, span[0]), min(b, span[1])) for a, b in others if b > span[0] and a < span[1]
    )
    total, reach = 0.0, span[0]
    for a, b in cut:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def main(root: Path, until: float | None = None) -> int:
    procs: list[Process] = []
    skipped = 0
    for log in sorted(root.glob("*/profiler_output/*.log")):
        if log.stem == "generated_tests":
            continue
        p = read(log, f"{log.parent.parent.name}/{log.stem}")
        if p is None:
            skipped += 1
        else:
            procs.append(p)
    if skipped:
        print(f"{skipped} logs without a start time skipped", file=sys.stderr)
    if not procs:
        print(
            f"{root}: no stage log with a start time; pass a run's --opprof-out folder (its "
            "<workload>/profiler_output/*.log), from pytest-opprof at 32af259 or later",
            file=sys.stderr,
        )
        return 1
    past_midnight(procs)
    t0 = min(p.start for p in procs)
    if until is not None:
        procs = cut_at(procs, t0 + until)
    t1 = max(p.end for p in procs)
    every_alone = [s for p in procs for s in p.alone]
    busy = overlap((t0, t1), every_alone)
    print(
        f"{len(procs)} stage processes over {t1 - t0:.0f} s; the GPU held alone (measuring) "
        f"for {busy:.0f} s of it ({busy / (t1 - t0):.0%})\n"
    )
    load = root / "host_load.txt"
    line = host_load(read_host_load(load, t0), t0, t1) if load.is_file() else None
    if line is not None:
        print(line)
    idle = overlap((t0, t1), [s for p in procs for s in p.quiet_waits])
    hushed = overlap((t0, t1), [s for p in procs for s in p.host_waits])
    print(
        f"Held alone but idle, a quiet measurement waiting for the host's compiles to end: "
        f"{idle:.0f} s; quiet measurements waiting for them holding nothing of the GPU: "
        f"{hushed:.0f} s\n"
    )
    back = [s for p in procs for s in p.held_back]
    pauses = [n for p in procs for _, n in p.paused]
    if back or pauses:
        print(
            f"Compiles held back by a quiet measurement: {len(back)} waits, "
            f"{sum(b - a for a, b in back):.0f} s in all; quiet measurements that paused the "
            f"compiles under way: {len(pauses)}, {sum(pauses)} processes stopped in all\n"
        )
    print(
        "| workload | ends at s | waited s | behind another process's measurement | behind a "
        "quiet wait | other (drains) |"
    )
    print("|---|---|---|---|---|---|")
    # each wait: (process, start, end, seconds behind another's measurement, behind any hold)
    waits: list[tuple[Process, float, float, float, float]] = []
    for p in procs:  # behind any other process, its own workload's included
        alone = [s for q in procs if q is not p for s in q.alone]
        held = alone + [s for q in procs if q is not p for s in q.quiet_waits]
        waits += [(p, a, b, overlap((a, b), alone), overlap((a, b), held)) for a, b in p.waits]
    for w in sorted({p.name.split("/")[0] for p in procs}):
        mine = [x for x in waits if x[0].name.startswith(w + "/")]
        waited = sum(b - a for _, a, b, _, _ in mine)
        behind = sum(x[3] for x in mine)
        behind_held = sum(x[4] for x in mine)
        end = max(p.end for p in procs if p.name.startswith(w + "/")) - t0
        print(
            f"| {w} | {end:.0f} | {waited:.1f} | {behind:.1f} | {behind_held - behind:.1f} | "
            f"{waited - behind_held:.1f} |"
        )
    total = sum(b - a for _, a, b, _, _ in waits)
    drains = total - sum(x[4] for x in waits)
    share = f" ({drains / total:.0%})" if total else ""
    print(f"\nAll waits: {total:.0f} s, {drains:.0f} s{share} of them drains")
    print("\nLongest waits that overlapped no hold of the GPU alone for 2 s or more (drains):\n")
    rows = [(b - a - held, p.name, a - t0, b - t0) for p, a, b, _, held in waits]
    rows = [r for r in rows if r[0] >= 2.0]
    for gap, name, a, b in sorted(rows, reverse=True)[:15]:
        print(f"- {name}: {a:.1f}–{b:.1f} s, {gap:.1f} s while nobody held it alone")
    alone_by_stage(procs)
    shared_holds(procs)
    beside_validation(procs)
    selection_builds(root)
    return 0


def alone_by_stage(procs: list[Process]) -> None:
    """The GPU held alone, summed by the stage process that held it (its log's name, a
    trailing number dropped: ``retime1`` and ``retime2`` are one row): which stage's quiet
    measurements a shorter run has to shrink, since they are serial on one GPU."""
    held: dict[str, list[float]] = {}
    for p in procs:
        stage = p.name.split("/")[1].rstrip("0123456789")
        held.setdefault(stage, []).extend(b - a for a, b in p.alone)
    total = sum(sum(v) for v in held.values())
    if not total:
        return
    print(f"\nThe GPU held alone, by stage: {total:.0f} s in all\n")
    print("| stage | holds | s | share | longest s |")
    print("|---|---|---|---|---|")
    for stage, spans in sorted(held.items(), key=lambda kv: (-sum(kv[1]), kv[0])):
        if spans:
            s = sum(spans)
            print(f"| {stage} | {len(spans)} | {s:.1f} | {s / total:.0%} | {max(spans):.1f} |")


BUILT = re.compile(r"^built (\S+): model [\d.]+ s, compile and first call ([\d.]+) s(.*)$")
"""Selection's build of one plan (``stages.backend.task_select``), with where the compile's
time went and whether the FX graph cache answered (``common.compile_note``)."""
CACHE = re.compile(r"FX graph cache (\d+) hit, (\d+) miss")
AHEAD = re.compile(r"^built (\S+) ahead of selection: ([\d.]+) s")
"""A rung warmer's build of a plan selection wanted (``stages.backend.task_warm_rungs``)."""
WAITED_FOR_WARMER = re.compile(r"^waited ([\d.]+) s for the rung warmer")
"""Selection's wait for a rung warmer's build (``stages.rung_warmer.Ahead.before_build``)."""


def selection_builds(root: Path) -> None:
    """Per workload, selection's builds (how many, their compile and first call summed, how
    many the FX graph cache answered in whole), the rung warmers' builds ahead of it, and
    selection's waits for them: the chain of builds the warmers exist to shorten
    (docs/design-notes.md#selections-rungs-compiled-ahead)."""
    rows = []
    for folder in sorted(root.glob("*/profiler_output")):
        built: list[tuple[float, bool]] = []
        ahead: list[float] = []
        waits: list[float] = []
        backend = folder / "backend.log"
        for log in [backend, *sorted(folder.glob("warm_rungs*.log"))]:
            if not log.exists():
                continue
            for line in log.read_text(errors="replace").splitlines():
                m = LINE.match(line)
                what = m.group(2) if m else ""
                if log == backend and (b := BUILT.match(what)):
                    c = CACHE.search(b.group(3))
                    built.append(
                        (float(b.group(2)), bool(c and c.group(1) != "0" and c.group(2) == "0"))
                    )
                elif log == backend and (w := WAITED_FOR_WARMER.match(what)):
                    waits.append(float(w.group(1)))
                elif log != backend and (a := AHEAD.match(what)):
                    ahead.append(float(a.group(2)))
        if built:
            rows.append((folder.parent.name, built, ahead, waits))
    if not rows:
        return
    print(
        "\nSelection's builds (compile and first call), the rung warmers' builds ahead of it, "
        "and selection's waits for them:\n"
    )
    print(
        "| workload | builds | s | answered by the FX graph cache | built ahead | s | waits | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, built, ahead, waits in rows:
        print(
            f"| {name} | {len(built)} | {sum(s for s, _ in built):.1f} | "
            f"{sum(hit for _, hit in built)} | {len(ahead)} | {sum(ahead):.1f} | "
            f"{len(waits)} | {sum(waits):.1f} |"
        )


def beside_validation(procs: list[Process]) -> None:
    """The GPU-time passes, and the recaptures started beside validation: how long their
    processes ran while their workload's validation did (what the overlap took off the
    workload's time, at most), and how long they then waited at the gate."""
    passes = [s for p in procs for s in p.gpu_times]
    if passes:
        print(
            f"\nGPU-time passes (the GPU alone): {len(passes)}, {sum(passes):.1f} s in all, "
            f"the longest {max(passes):.2f} s"
        )
    beside = gated = 0.0
    workloads = 0
    for w in sorted({p.name.split("/")[0] for p in procs}):
        mine = [p for p in procs if p.name.startswith(w + "/")]
        checks = [p for p in mine if p.name.split("/")[1].startswith("validate")]
        timers = [p for p in mine if p.gate is not None]
        if not checks or not timers:
            continue
        workloads += 1
        span = (min(p.start for p in checks), max(p.end for p in checks))
        for p in timers:
            assert p.gate is not None
            beside += overlap((p.start, p.gate[0]), [span])
            gated += p.gate[1] - p.gate[0]
    if workloads:
        print(
            f"\nRecaptures started beside validation: {workloads} workloads; their processes "
            f"ran {beside:.0f} s while validation did, then waited {gated:.0f} s for it to pass"
        )


def shared_holds(procs: list[Process]) -> None:
    """The compiles' holds of the GPU shared for ``devicelock.SHARED_NOTE_S`` or more, by what
    they were: a measurer waits for the one under way in each process (logs from before the
    note say nothing of them)."""
    held = [(b - a, what) for p in procs for a, b, what in p.shared]
    if not held:
        return
    print(
        f"\nHolds of the GPU shared inside compiles for {devicelock.SHARED_NOTE_S:g} s or more "
        f"(a measurement waits for the one under way): {len(held)}, "
        f"{sum(s for s, _ in held):.0f} s in all\n"
    )
    print("| what | holds | s | longest s |")
    print("|---|---|---|---|")
    kinds = sorted(
        {what for _, what in held}, key=lambda k: (-sum(s for s, w in held if w == k), k)
    )
    for kind in kinds:
        mine = [s for s, what in held if what == kind]
        print(f"| {kind} | {len(mine)} | {sum(mine):.1f} | {max(mine):.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="a run's --opprof-out folder")
    parser.add_argument(
        "--until", type=float, help="only the run's first UNTIL seconds, from its first process"
    )
    args = parser.parse_args()
    sys.exit(main(args.out_dir, args.until))
