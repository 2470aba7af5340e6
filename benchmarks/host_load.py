"""Sample the host's CPUs through a benchmark run: how busy they were, and how many threads
wanted one, on the wall clock the stage logs use.

A stage process that waits for the GPU's lock waits either for the GPU (another process
measuring, or a drain) or, underneath, for the CPUs its siblings' compiles keep busy; the
stage logs tell the first apart, not the second. Laid beside them
(``benchmarks/gpu_timeline.py``), these samples say whether a run's wall time was the GPU's
or the CPUs'.

    python benchmarks/host_load.py OUT_FILE [--every SECONDS]

Every ``--every`` seconds (default 2) it appends one line ``HH:MM:SS.ffffff busy runnable
cpus``: the UTC clock, the share of the host's CPU time over the interval that was not idle
or waiting for I/O (``/proc/stat``'s first line), the threads runnable at the sample
(``procs_running``, the sampler's own included), and the CPUs counted. Lines are flushed as
written, so a run stopped at any point keeps what was sampled. It runs until killed; where
``/proc/stat`` is absent (not Linux) it says so and exits 0, and the run goes on without it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, TextIO

STAT = Path("/proc/stat")
IDLE_FIELDS = (3, 4)
"""``idle`` and ``iowait`` of a ``cpu`` line's counters (user nice system idle iowait irq
softirq steal …): time the CPUs had nothing to run."""


class Ticks(NamedTuple):
    busy: int
    total: int
    runnable: int
    cpus: int


def read_stat(text: str) -> Ticks:
    """The host's CPU counters (in ticks, since boot) and the runnable threads now, from the
    text of ``/proc/stat``. Guest time is already inside user and nice, so only the first
    eight counters are summed."""
    busy = total = runnable = cpus = 0
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "cpu":
            ticks = [int(v) for v in parts[1:9]]
            total = sum(ticks)
            busy = total - sum(ticks[i] for i in IDLE_FIELDS if i < len(ticks))
        elif parts[0].startswith("cpu"):
            cpus += 1
        elif parts[0] == "procs_running":
            runnable = int(parts[1])
    if total == 0:
        raise ValueError("no 'cpu' line in /proc/stat")
    return Ticks(busy, total, runnable, cpus)


def sample_line(before: Ticks, after: Ticks, at: datetime) -> str:
    """One output line for the interval between two readings, stamped ``at`` (UTC)."""
    spent = after.total - before.total
    busy = (after.busy - before.busy) / spent if spent > 0 else 0.0
    return f"{at:%H:%M:%S.%f} {busy:.3f} {after.runnable} {after.cpus}"


def parse_line(line: str) -> tuple[str, float, int, int] | None:
    """A written line as (clock, busy share, runnable threads, CPUs); None for a line that
    does not parse (the sampler stopped mid-line)."""
    parts = line.split()
    try:
        return parts[0], float(parts[1]), int(parts[2]), int(parts[3])
    except (IndexError, ValueError):
        return None


def mean_busy(path: Path) -> float | None:
    """The busy share averaged over a file's samples; None without one."""
    if not path.is_file():
        return None
    busy = [x[1] for x in map(parse_line, path.read_text(encoding="utf-8").splitlines()) if x]
    return sum(busy) / len(busy) if busy else None


def run(out: TextIO, every: float, stat: Path = STAT, samples: int | None = None) -> None:
    """Append a line to ``out`` every ``every`` seconds (``samples`` lines, or until killed)."""
    before = read_stat(stat.read_text())
    written = 0
    while samples is None or written < samples:
        time.sleep(every)
        after = read_stat(stat.read_text())
        out.write(sample_line(before, after, datetime.now(timezone.utc)) + "\n")
        out.flush()
        before = after
        written += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_file", type=Path, help="appended to, one line per sample")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error("--every takes a number of seconds above 0")
    if not STAT.exists():
        print(f"host_load: no {STAT} on this host; the run goes on unsampled", file=sys.stderr)
        return 0
    with args.out_file.open("a", encoding="utf-8") as out, contextlib.suppress(KeyboardInterrupt):
        run(out, args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
