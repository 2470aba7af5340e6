"""The session's ``report.md`` — one table of every workload, the problems, the GPUs they were
measured on and links to their reports — and the pull-request comment built from it.

Figures are copied from each workload's ``WorkloadSummary``; the GPU of each comes from the
``capture_metadata`` of its profiles.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pytest_opprof import ITEM_NAMES
from pytest_opprof.errors import ArtifactError
from pytest_opprof.report.format import (
    BASELINE_LABELS,
    DASH,
    bullet,
    fmt_dtype,
    fmt_ms,
    fmt_speedup,
    one_line,
    para,
    table,
    verdict,
)
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
    Profile,
    Speedup,
    WorkloadSummary,
    read_artifact,
)

COMMENT_MARKER = "<!-- pytest-opprof -->"
"""Hidden first line of the pull-request comment; ci/post_comment.py finds the comment by it."""


def summary_row(s: WorkloadSummary, *, stock: bool = False) -> list[str]:
    """One workload's row; with ``stock``, the speedup over the stock baseline beside the
    gate's (a dash where it was not measured)."""
    row = [
        s.name,
        verdict(s),
        BASELINE_LABELS.get(s.baseline or "", s.baseline or DASH),
        fmt_ms(s.baseline_ms, unit=False),
        fmt_ms(s.optimized_ms, unit=False),
        fmt_speedup(s.speedup, s.ci_low, s.ci_high),
    ]
    if stock:
        over = stock_speedup(s)
        row.append(fmt_speedup(over.ratio, over.ci_low, over.ci_high) if over else DASH)
    return [*row, fmt_dtype(s.dtype), ", ".join(s.passes) or DASH]


def stock_speedup(s: WorkloadSummary) -> Speedup | None:
    """The optimized backend over the stock baseline, with its CI, where it was measured."""
    return next(
        (r for r in s.speedups if (r.baseline, r.candidate) == ("stock", "optimized")), None
    )


def _report_link(s: WorkloadSummary, out_dir: Path) -> str | None:
    if s.report:
        target = Path(s.report)
        if target.is_absolute():
            try:
                return Path(os.path.relpath(target, Path(out_dir).resolve())).as_posix()
            except ValueError:
                return target.as_posix()
        return target.as_posix()
    default = Path(out_dir) / s.name / "report.md"
    return f"{s.name}/report.md" if default.is_file() else None


def _gpus_measured(
    items: Sequence[WorkloadSummary], out_dir: Path
) -> dict[str, tuple[list[str], set[int | None]]]:
    """GPU UUID -> (the workloads whose capture or recapture measured on it, the GPU counts
    those processes saw), from each workload's two profiles; empty where none recorded a
    UUID (CPU runs, profiles from before Profile 2.3)."""
    gpus: dict[str, tuple[list[str], set[int | None]]] = {}
    for s in items:
        for name in ("profile_optimized.json", "profile.json"):
            path = Path(out_dir) / s.name / name
            if not path.is_file():
                continue
            try:
                meta = read_artifact(path, Profile).capture_metadata
            except ArtifactError:
                continue
            if meta.device_uuid:
                names, counts = gpus.setdefault(meta.device_uuid, ([], set()))
                if s.name not in names:
                    names.append(s.name)
                counts.add(meta.device_count)
    return gpus


def _gpus_line(gpus: dict[str, tuple[list[str], set[int | None]]]) -> str:
    counts = {c for _, seen in gpus.values() for c in seen}
    alone = " Each process saw one GPU." if counts == {1} else ""
    if len(gpus) == 1:
        ((uuid, _),) = gpus.items()
        return f"Measured on one GPU, `{uuid}`.{alone}"
    parts = [f"`{uuid}`: {', '.join(names)}" for uuid, (names, _) in gpus.items()]
    return f"Measured on {len(gpus)} GPUs: {'; '.join(parts)}.{alone}"


def render_session_report(items: Sequence[WorkloadSummary], *, device: str, out_dir: Path) -> str:
    """The session's ``report.md``: one table of every workload, then links to their reports."""
    verdicts = [verdict(s) for s in items]
    counts = {
        k: verdicts.count(k) for k in ("passed", CPU_NOT_ENFORCED, "failed", "error", "skipped")
    }
    tally = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no workload"
    lines = [
        "# pytest-opprof session report",
        "",
        f"Device: {device} · {len(items)} workload{'s' if len(items) != 1 else ''}: {tally}",
        "",
    ]
    if counts[CPU_NOT_ENFORCED]:
        lines += para(
            f"**{CPU_NOT_ENFORCED}** where a workload ran on the CPU: its speedup is a CPU "
            "figure, not a verdict; `--opprof-gate-on-cpu` enforces it."
        )
    gpus = _gpus_measured(items, out_dir)
    if gpus:
        lines += para(_gpus_line(gpus))
    if items:
        stock = any(stock_speedup(s) for s in items)
        heads = ["workload", "status", "baseline", "baseline (ms)", "optimized (ms)"]
        heads += ["speedup (95% CI)", *(["over stock (95% CI)"] if stock else [])]
        lines += table([*heads, "dtype", "passes"], [summary_row(s, stock=stock) for s in items])
        if stock:
            lines += para(
                "Stock: the faster of two stock PyTorch recipes at bf16 (autocast, or the model "
                'cast with weight freezing; both torch.compile mode="max-autotune"), validated '
                "like the backend; each workload's report names the recipe."
            )
    problems = [s for s in items if s.status in ("failed", "error") and s.message]
    if problems:
        lines += ["## Problems", ""]
        for s in problems:
            name = s.name.replace("|", "\\|")
            where = ITEM_NAMES.get(s.stage, s.stage)
            lines += bullet(f"**{name}** ({s.status} at {where}): {one_line(s.message)}")
        lines.append("")
    lines += ["## Reports", ""]
    links = 0
    for s in items:
        link = _report_link(s, out_dir)
        if link:
            links += 1
            label = s.name.replace("[", "\\[").replace("]", "\\]")
            lines.append(f"- [{label}]({link.replace(' ', '%20')})")
    if not links:
        lines.append("_No workload report was written._")
    return "\n".join(lines).rstrip("\n") + "\n"


def render_comment_body(session_md: str) -> str:
    """The pull-request comment: the session report behind the hidden marker."""
    return f"{COMMENT_MARKER}\n{session_md}"
