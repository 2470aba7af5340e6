"""benchmarks/host_load.py: the host's CPUs sampled through a benchmark run, on the stage
logs' clock."""

from __future__ import annotations

import importlib.util
import io
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# /proc/stat of a 2-CPU host: the aggregate line, one per CPU, then the run queue
STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 12345
procs_running {running}
procs_blocked 0
"""


def _host_load() -> Any:
    spec = importlib.util.spec_from_file_location("host_load", ROOT / "benchmarks" / "host_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_busy_is_the_share_of_the_interval_not_idle_or_waiting_for_io() -> None:
    hl = _host_load()
    before = hl.read_stat(STAT.format(user=100, system=50, idle=800, iowait=50, running=1))
    # over the interval: 300 user + 60 system busy, 100 idle + 40 iowait: 360 of 500
    after = hl.read_stat(STAT.format(user=400, system=110, idle=900, iowait=90, running=5))
    assert after.cpus == 2 and after.runnable == 5
    at = datetime(2026, 12, 4, 21, 27, 36, 243000, tzinfo=timezone.utc)
    assert hl.sample_line(before, after, at) == "21:27:36.243000 0.720 5 2"


def test_a_stat_without_the_aggregate_line_is_refused() -> None:
    with pytest.raises(ValueError, match="no 'cpu' line"):
        _host_load().read_stat("intr 1\nprocs_running 2\n")


def test_samples_of_this_host_are_written_line_by_line(tmp_path: Path) -> None:
    stat = Path("/proc/stat")
    if not stat.exists():
        pytest.skip("needs Linux's /proc/stat")
    out = io.StringIO()
    _host_load().run(out, every=0.01, stat=stat, samples=2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    clock, busy, runnable, cpus = lines[0].split()
    datetime.strptime(clock, "%H:%M:%S.%f")
    assert 0.0 <= float(busy) <= 1.0 and int(runnable) >= 1 and int(cpus) >= 1
