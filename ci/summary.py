"""Turn a pytest-opprof out-dir into the job summary, the PR comment body and the step outputs.

Reads ``<out>/session.json`` (the machine-readable contract; the speedup table is built from it,
not scraped from Markdown) and ``<out>/report.md`` (shown folded below the table). Writes
``<out>/speedup-table.md`` and ``<out>/comment.md``, appends to ``$GITHUB_STEP_SUMMARY`` and
sets ``report``, ``speedup-table``, ``comment-body``, ``passed``, ``gate-enforced`` and
``saved-run`` in ``$GITHUB_OUTPUT``.

The table fits a reviewer's half minute: one line per workload with its verdict, its speedup
over each baseline (the gate's in bold; where the backend changed the dtype, the speedup at the
baseline's dtype beside it), the dtype, and the change against the base branch's stored run
(``--opprof-compare``): the model's latency and the gate's speedup, this run over the stored
run, with their 95% CIs. The headline names the commit measured; a link leads to the artifact
with the full report and the traces (Perfetto opens them).

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

from post_comment import MARKER, CommentError, artifacts_url, check_marker

# GitHub refuses a step summary over 1 MiB; keep well under it.
MAX_SUMMARY_BYTES = 1_000_000
STATUS_ICONS = {"passed": "✅", "failed": "❌", "error": "⚠️", "skipped": "⏭️"}
NEUTRAL_ICON = "⚪"
# The plugin's words (pytest_opprof.schema.CPU_NOT_ENFORCED); a test keeps the two equal.
CPU_NOT_ENFORCED = "CPU fallback: gate not enforced"
COLUMNS = ("Workload", "Verdict", "vs eager", "vs torch.compile", "dtype", "Δ vs base")
BASELINES = ("eager", "compile")
PERFETTO = "https://ui.perfetto.dev"


@dataclass
class Session:
    """What the out-dir says; ``problem`` is set when there is nothing usable to show."""

    workloads: list[dict[str, Any]]
    gate_passed: bool
    problem: str | None = None
    gate_enforced: bool = True
    commit: str | None = None
    branch: str | None = None
    compared_with: str | None = None
    saved_as: str | None = None


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
    return Session(
        workloads,
        data.get("gate_passed") is True,
        gate_enforced=enforced,
        commit=_text(data.get("commit")),
        branch=_text(data.get("branch")),
        compared_with=_text(data.get("compared_with")),
        saved_as=_text(data.get("saved_as")),
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _enforced(workload: dict[str, Any]) -> bool:
    return workload.get("enforced") is not False


def _cell(value: object) -> str:
    """Text for a table cell: untrusted names must not break the table."""
    return str(value).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _ratio(ratio: float, low: float | None, high: float | None, *, bold: bool = False) -> str:
    text = f"**{ratio:.2f}×**" if bold else f"{ratio:.2f}×"
    return text if low is None or high is None else f"{text} ({low:.2f}–{high:.2f})"


def _measured(workload: dict[str, Any], baseline: str, candidate: str) -> dict[str, Any] | None:
    for item in workload.get("speedups") or []:
        if (
            isinstance(item, dict)
            and item.get("baseline") == baseline
            and item.get("candidate") == candidate
            and _num(item.get("ratio")) is not None
        ):
            return item
    return None


def _dtype_name(dtype: object) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "tensorfloat32": "tf32"}
    text = str(dtype).removeprefix("torch.")
    return _cell(short.get(text, text))


def speedup_cell(workload: dict[str, Any], baseline: str) -> str:
    """The optimized backend against ``baseline``: the ratio and its CI, bold for the gate's
    baseline; with a dtype change, the speedup at the baseline's dtype beside it."""
    found = _measured(workload, baseline, "optimized")
    gate = workload.get("baseline") == baseline
    if found is not None:
        ratio, low, high = (_num(found.get(k)) for k in ("ratio", "ci_low", "ci_high"))
    elif gate:
        ratio, low, high = (_num(workload.get(k)) for k in ("speedup", "ci_low", "ci_high"))
    else:
        ratio, low, high = _num(workload.get(f"speedup_vs_{baseline}")), None, None
    if ratio is None:
        return "—"
    text = _ratio(ratio, low, high, bold=gate)
    same = _measured(workload, baseline, "optimized_baseline_dtype")
    if same is not None and workload.get("dtype"):
        text += f"; {_num(same['ratio']):.2f}× at the baseline dtype"
    return text


def dtype_cell(workload: dict[str, Any]) -> str:
    """The backend's compute dtype where it changed it (``→ bf16``), else ``same``."""
    dtype = workload.get("dtype")
    if dtype:
        return f"→ {_dtype_name(dtype)}"
    return "same" if _num(workload.get("speedup")) is not None else "—"


def _pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%".replace("-", "−")


def _change_text(change: dict[str, Any]) -> str | None:
    ratio, low, high = (_num(change.get(k)) for k in ("ratio", "ci_low", "ci_high"))
    if ratio is None:
        return None
    name = str(change.get("name", "?"))
    what = name if change.get("metric") == "latency" else "speedup"
    ci = f" [{_pct(low)}, {_pct(high)}]" if low is not None and high is not None else ""
    mark = " ❌" if change.get("failed") is True else ""
    return f"{_cell(what)} {_pct(ratio)}{ci}{mark}"


def change_cell(workload: dict[str, Any]) -> str:
    """Against the stored run: every change that failed, then the eager latency (did the model
    regress?) and the gate's speedup (did the gain shrink?); ⚠️ where another device."""
    comparison = workload.get("comparison")
    if not isinstance(comparison, dict):
        return "—"
    changes = [c for c in comparison.get("changes") or [] if isinstance(c, dict)]
    shown = [c for c in changes if c.get("failed") is True]
    for c in changes:
        model = (c.get("metric"), c.get("name")) == ("latency", "eager")
        gain = c.get("metric") == "speedup" and c.get("gate") is True
        if (model or gain) and c not in shown:
            shown.append(c)
    texts = [t for t in map(_change_text, shown) if t]
    if not texts:
        return "not in the stored run"
    return ("⚠️ " if comparison.get("gated") is False else "") + " · ".join(texts)


def verdict_cell(workload: dict[str, Any]) -> str:
    status = str(workload.get("status", "?"))
    if status == "passed" and not _enforced(workload):
        return f"{NEUTRAL_ICON} {CPU_NOT_ENFORCED}"
    comparison = workload.get("comparison")
    changes = comparison.get("changes") or [] if isinstance(comparison, dict) else []
    if status == "failed" and any(isinstance(c, dict) and c.get("failed") is True for c in changes):
        return f"{STATUS_ICONS['failed']} regressed"
    return f"{STATUS_ICONS.get(status, '')} {_cell(status)}".strip()


def speedup_table(workloads: list[dict[str, Any]]) -> str:
    """The Markdown table of every workload, one line each: the part both the summary and the
    comment show."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for w in workloads:
        row = (
            _cell(w.get("name", "?")),
            verdict_cell(w),
            *(speedup_cell(w, b) for b in BASELINES),
            dtype_cell(w),
            change_cell(w),
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def comparison_lines(session: Session, args: argparse.Namespace) -> str:
    """What the Δ column is against, or why it is empty; the comparison's warnings."""
    if session.compared_with:
        text = (
            f"Δ vs base: this run over stored run `{_cell(session.compared_with)}`, with 95% "
            "CIs; ❌ marks a change past `--opprof-compare-fail` with certainty.\n"
        )
    elif args.base_branch:
        text = (
            f"Δ vs base: no stored run of `{_cell(args.base_branch)}` to compare with (restore "
            "the base branch's stored runs into the action's `storage` folder: "
            "docs/regressions.md).\n"
        )
    else:
        return ""
    warnings = [
        str(warning)
        for w in session.workloads
        if isinstance(w.get("comparison"), dict)
        for warning in w["comparison"].get("warnings") or []
    ]
    for warning in warnings[:5]:
        text += f"\n> ⚠️ {_cell(warning)}"
    return text + ("\n" if warnings else "")


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
    if session.commit:
        on = f" on `{_cell(session.branch)}`" if session.branch else ""
        terms.append(f"commit `{session.commit[:12]}`{on}")
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
        compared = comparison_lines(session, args)
        if compared:
            parts.append(compared)
    url = artifacts_url(env)
    run = f"[run {env.get('GITHUB_RUN_ID')}]({url})" if url else "this run"
    artifact = f"`{args.artifact_name}`"
    if args.artifact_url:
        artifact = f"[{artifact}]({args.artifact_url})"
    parts.append(
        f"Full report (`report.md`, one per workload), profiles, plots and traces: artifact "
        f"{artifact} of {run}; open a trace (`<workload>/profiler_output/*.trace.json`) in "
        f"[Perfetto]({PERFETTO}).\n"
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
        "comment": f"{args.marker}\n{summary}",
        "passed": "true" if held and session.gate_enforced else "false",
        "gate_enforced": "true" if session.gate_enforced else "false",
        "saved_run": session.saved_as or "",
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
    parser.add_argument("--artifact-url", default="", help="the uploaded artifact's URL")
    parser.add_argument("--marker", default=MARKER, help=f"the comment's marker ({MARKER})")
    parser.add_argument(
        "--base-branch", default="", help="the branch whose stored run was looked for"
    )
    args = parser.parse_args(argv)
    try:
        check_marker(args.marker)
    except CommentError as err:
        parser.error(str(err))
    return args


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
        "saved-run": texts["saved_run"],
    }
    if env.get("GITHUB_OUTPUT"):
        set_outputs(env["GITHUB_OUTPUT"], outputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
