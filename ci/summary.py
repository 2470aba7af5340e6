"""Turn a pytest-opprof out-dir into the job summary, the PR comment body and the step outputs.

Reads ``<out>/session.json`` (the machine-readable contract; the speedup table is built from it,
not scraped from Markdown) and ``<out>/report.md`` (shown folded below the table). Writes
``<out>/speedup-table.md`` and ``<out>/comment.md``, appends to ``$GITHUB_STEP_SUMMARY`` and
sets ``report``, ``speedup-table``, ``comment-body``, ``passed`` and ``gate-enforced`` in
``$GITHUB_OUTPUT``.

A CPU fallback never reads as a green gate: a workload whose gate was not enforced (``enforced``
false in session.json) shows a neutral icon and "CPU fallback: gate not enforced", and so does
the headline when the session's gate was not enforced; ``passed`` is then false (no speedup was
proven), with ``gate-enforced`` false to tell it from a failed gate. Files written before these
keys existed are read as enforced.

Standard library only, like post_comment.py: it runs on whatever Python the runner has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from post_comment import MARKER, artifacts_url

# GitHub refuses a step summary over 1 MiB; keep well under it.
MAX_SUMMARY_BYTES = 1_000_000
STATUS_ICONS = {"passed": "✅", "failed": "❌", "error": "⚠️", "skipped": "⏭️"}
NEUTRAL_ICON = "⚪"
# The plugin's words (pytest_opprof.schema.CPU_NOT_ENFORCED); a test keeps the two equal.
CPU_NOT_ENFORCED = "CPU fallback: gate not enforced"
COLUMNS = ("Workload", "Status", "Speedup (95% CI)", "Baseline ms", "Optimized ms", "Passes")


@dataclass
class Session:
    """What the out-dir says; ``problem`` is set when there is nothing usable to show."""

    workloads: list[dict[str, Any]]
    gate_passed: bool
    problem: str | None = None
    gate_enforced: bool = True


def load_session(out_dir: Path) -> Session:
    path = out_dir / "session.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Session([], False, f"`{path}` was not written: pytest --opprof did not finish")
    except (OSError, ValueError) as err:
        return Session([], False, f"`{path}` is not readable JSON ({err})")
    version = str(data.get("schema_version", "")) if isinstance(data, dict) else ""
    if version.split(".")[0] != "1":
        return Session([], False, f"`{path}` has schema_version {version!r}; this action reads 1.x")
    workloads = [w for w in data.get("workloads") or [] if isinstance(w, dict)]
    enforced = data.get("gate_enforced") is not False and all(map(_enforced, workloads))
    return Session(workloads, data.get("gate_passed") is True, gate_enforced=enforced)


def _enforced(workload: dict[str, Any]) -> bool:
    return workload.get("enforced") is not False


def _cell(value: object) -> str:
    """Text for a table cell: untrusted names must not break the table."""
    return str(value).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def _ms(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "—"


def _speedup(workload: dict[str, Any]) -> str:
    speedup = workload.get("speedup")
    if not isinstance(speedup, (int, float)):
        return "—"
    low, high = workload.get("ci_low"), workload.get("ci_high")
    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
        return f"{speedup:.2f}× ({low:.2f}–{high:.2f})"
    return f"{speedup:.2f}×"


def _passes(workload: dict[str, Any]) -> str:
    names = []
    for item in workload.get("passes") or []:
        names.append(item.get("name", "?") if isinstance(item, dict) else item)
    return ", ".join(str(n) for n in names) or "—"


def speedup_table(workloads: list[dict[str, Any]]) -> str:
    """The Markdown table of every workload: the part both the summary and the comment show."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for w in workloads:
        status = str(w.get("status", "?"))
        if status == "passed" and not _enforced(w):
            shown = f"{NEUTRAL_ICON} {CPU_NOT_ENFORCED}"
        else:
            shown = f"{STATUS_ICONS.get(status, '')} {_cell(status)}".strip()
        row = (
            _cell(w.get("name", "?")),
            shown,
            _speedup(w),
            _ms(w.get("baseline_ms")),
            _ms(w.get("optimized_ms")),
            _cell(_passes(w)),
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def headline(session: Session, held: bool, args: argparse.Namespace) -> str:
    """``held``: no workload failed and pytest passed, whether or not the gate was enforced."""
    if not held:
        verdict = "❌ speedup gate failed"
    elif not session.gate_enforced:
        verdict = f"{NEUTRAL_ICON} {CPU_NOT_ENFORCED}"
    else:
        verdict = "✅ speedup gate passed"
    terms = []
    if args.min_speedup:
        terms.append(f"minimum speedup {args.min_speedup}×")
    if args.baseline:
        terms.append(f"baseline `{args.baseline}`")
    n = len(session.workloads)
    text = f"### pytest-opprof: {verdict}\n\n{n} workload{'s' if n != 1 else ''}"
    text += f"; {', '.join(terms)}" if terms else ""
    if args.exit_code not in (None, 0):
        text += f"; pytest exited with status {args.exit_code}"
    return text + ".\n"


def render(out_dir: Path, args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """Build the texts; returns table, summary, comment, passed and gate_enforced."""
    session = load_session(out_dir)
    held = session.problem is None and session.gate_passed and args.exit_code in (None, 0)
    table = speedup_table(session.workloads)
    parts = [headline(session, held, args)]
    if session.problem:
        parts.append(f"**No results:** {session.problem}; see the job log.\n")
    else:
        parts.append(table)
    url = artifacts_url(env)
    run = f"[run {env.get('GITHUB_RUN_ID')}]({url})" if url else "this run"
    parts.append(
        f"Reports, profiles, traces and plots: artifact `{args.artifact_name}` of {run}.\n"
    )
    report_path = out_dir / "report.md"
    if report_path.is_file():
        report = report_path.read_text(encoding="utf-8")
        parts.append(
            "<details><summary>Session report (its links point into the artifact)</summary>"
            f"\n\n{report.rstrip()}\n\n</details>\n"
        )
    summary = "\n".join(parts)
    if len(summary.encode("utf-8")) > MAX_SUMMARY_BYTES:
        summary = "\n".join(parts[:-1]) + "\nThe session report is too long to show here.\n"
    return {
        "table": table,
        "summary": summary,
        "comment": f"{MARKER}\n{summary}",
        "passed": "true" if held and session.gate_enforced else "false",
        "gate_enforced": "true" if session.gate_enforced else "false",
    }


def set_outputs(path: str, outputs: dict[str, str]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        for key, value in outputs.items():
            if "\n" in value:
                raise ValueError(f"output {key} must be one line, got {value!r}")
            fh.write(f"{key}={value}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the --opprof-out directory")
    parser.add_argument("--exit-code", type=int, help="pytest's exit status (omit: not run here)")
    parser.add_argument("--min-speedup", default="", help="the gate's threshold, for the headline")
    parser.add_argument("--baseline", default="", help="the gate's baseline, for the headline")
    parser.add_argument("--artifact-name", default="opprof-results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ) if env is None else env
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = render(out_dir, args, env)
    table_path, comment_path = out_dir / "speedup-table.md", out_dir / "comment.md"
    table_path.write_text(texts["table"], encoding="utf-8")
    comment_path.write_text(texts["comment"], encoding="utf-8")
    if env.get("GITHUB_STEP_SUMMARY"):
        with open(env["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as fh:
            fh.write(texts["summary"])
    else:
        print(texts["summary"])
    outputs = {
        "report": str(out_dir / "report.md"),
        "speedup-table": str(table_path),
        "comment-body": str(comment_path),
        "passed": texts["passed"],
        "gate-enforced": texts["gate_enforced"],
    }
    if env.get("GITHUB_OUTPUT"):
        set_outputs(env["GITHUB_OUTPUT"], outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
