"""Hear what happened: one JSON line per finished stage and per gate verdict.

A dashboard, a chat bot or a metrics exporter can follow ``opprof-events.jsonl`` (written in
the output folder) instead of parsing the terminal. The notification hooks are called in the
process that runs the workload (an xdist worker, under ``-n``), so each line is appended whole.
"""

from __future__ import annotations

import json


def _append(workload, event):
    path = workload.options.out / "opprof-events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"workload": workload.name, **event}) + "\n")


def pytest_opprof_stage_finished(workload, stage, outcome):
    _append(
        workload,
        {
            "event": "stage",
            "stage": stage,
            "status": outcome.status,
            "seconds": round(outcome.seconds, 3),
            "cached": outcome.cached,
        },
    )


def pytest_opprof_gate_decided(workload, summary, passed):
    _append(
        workload,
        {
            "event": "gate",
            "passed": passed,
            "baseline": summary.baseline,
            "speedup": summary.speedup,
            "ci_low": summary.ci_low,
        },
    )
