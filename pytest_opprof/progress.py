"""Live progress of long stages in the terminal: which workload, which stage process, for how
long, and what it last did — also under pytest-xdist, whose workers cannot write to it.

Each stage process runs inside :func:`running`, which keeps a small JSON file in the session's
progress folder (``<out>/.progress/``) for its span: the workload, the task, when it started
and its log. The process that owns the terminal (pytest's, or xdist's controller, which runs
no item) runs a :class:`Ticker`: every ``interval`` seconds it reads the folder and writes one
line per stage process running longer than that, with the last phase its log names
(``[opprof] +  N s  what``, ``stages.common.phase``). The lines go through pytest's terminal
reporter, which ends a line of progress dots first, so the items' own output stays whole.
Importing it imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

FOLDER = ".progress"
"""Under the session's ``--opprof-out``: one file per stage process running."""

MARK = "[opprof] +"


def folder(out: Path) -> Path:
    return Path(out) / FOLDER


@contextlib.contextmanager
def running(out: Path, workload: str, task: str, log: Path) -> Iterator[None]:
    """The stage process of ``task`` for ``workload`` runs in the block, its output in
    ``log``: a progress file for its span. A progress folder that cannot be written to costs
    the progress lines, never the stage."""
    path = folder(out) / f"{workload}.{task}.{os.getpid()}.json"
    record = {"workload": workload, "task": task, "started": time.time(), "log": str(log)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def last_phase(log: Path) -> str | None:
    """The last ``[opprof] +  N s  what`` line of a stage log, without its clock: what its
    process last finished. Only the log's tail is read."""
    try:
        with Path(log).open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    marks = [line.split(" s  ", 1)[-1] for line in tail.splitlines() if line.startswith(MARK)]
    return marks[-1].strip() if marks else None


def lines(where: Path, now: float, older_than: float) -> list[str]:
    """One line per stage process in the progress folder ``where`` that has run longer than
    ``older_than`` seconds at ``now``, by workload: ``name task 95 s: what it last did``."""
    found = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            workload, task = str(record["workload"]), str(record["task"])
            elapsed = now - float(record["started"])
            log = Path(str(record["log"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # written or removed meanwhile: the next tick reads it
        if elapsed < older_than:
            continue
        what = last_phase(log)
        found.append(f"{workload} {task} {elapsed:.0f} s" + (f": {what}" if what else ""))
    return found


class Ticker:
    """Writes :func:`lines` through ``write`` every ``interval`` seconds, from a daemon thread,
    until :meth:`stop`."""

    def __init__(self, where: Path, interval: float, write: Callable[[str], None]) -> None:
        self.where, self.interval, self.write = where, interval, write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="opprof-progress", daemon=True)

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for line in lines(self.where, time.time(), self.interval):
                self.write(line)

    def stop(self) -> None:
        """No more lines; the progress folder goes where no stage process is left in it."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self.where.rmdir()
