"""The shape of every workload's ``report.md`` (issue #41): the verdict, the headline table and
the plots on the first screen, the details after it, and no line a reader must scroll sideways
for — on every workload of the H200 run in tests/data/h200/, a failed one, a CPU fallback and
the report fixtures of tests/data/report/."""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_opprof.measure import gate_verdict
from pytest_opprof.report import WorkloadArtifacts, load_workload_artifacts, plots
from pytest_opprof.report.format import (
    LINE_LIMIT,
    WRAP,
    clip,
    fit_markdown,
    fmt_speedup,
    table,
    verdict,
    wrap,
)
from pytest_opprof.report.headline import FIRST_SCREEN
from pytest_opprof.report.lookups import gate_figures
from pytest_opprof.report.markdown import render_workload_report
from pytest_opprof.schema import (
    CPU_NOT_ENFORCED,
    BackendSelection,
    Optimizations,
    Profile,
    SessionSummary,
    ValidationReport,
    WorkloadSummary,
    read_artifact,
)

DATA = Path(__file__).resolve().parents[1] / "data"
H200 = sorted(p.name for p in (DATA / "h200").iterdir() if p.is_dir())
REPORT = Path(__file__).resolve().parents[2] / "pytest_opprof" / "report"
DETAILS = (
    "## Timing",
    "## Hardware context",
    "## Operator summary",
    "## Optimizations",
    "## Implementation notes",
    "## Validation",
    "## Before and after, per operator",
    "## What drove the speedup (per-pass waterfall)",
    "## Estimated vs measured impact",
    "## Remaining opportunities",
    "## Reproduce",
    "## Caveats",
)


def _h200(name: str, out: Path, *, min_speedup: float = 1.0) -> WorkloadArtifacts:
    """One workload of the H200 run, its summary written as the report stage writes it: the
    gate against the faster baseline, passed or failed by ``measure.gate_verdict``."""
    src = DATA / "h200" / name
    optimized = read_artifact(src / "profile_optimized.json.gz", Profile)
    t = optimized.timing
    base = "compile" if t.variants["compile"].median_ms < t.variants["eager"].median_ms else "eager"
    ratio = next(s for s in t.speedups if (s.baseline, s.candidate) == (base, "optimized"))
    ok, why = gate_verdict(ratio, min_speedup, strict=False)
    summary = WorkloadSummary(
        name=name,
        path=f"examples/{name}/{name}.py",
        status="passed" if ok else "failed",
        stage="report",
        message=why if ok else f"{why}; see {name}/report.md",
        baseline=base,
        speedup=ratio.ratio,
        ci_low=ratio.ci_low,
        ci_high=ratio.ci_high,
        baseline_ms=t.variants[base].median_ms,
        optimized_ms=t.variants["optimized"].median_ms,
        speedups=list(t.speedups),
    )
    return WorkloadArtifacts(
        name=name,
        path=summary.path,
        out_dir=out / name,
        summary=summary,
        profile=read_artifact(src / "profile.json.gz", Profile),
        optimizations=read_artifact(src / "optimizations.json.gz", Optimizations),
        selection=read_artifact(
            src / "profiler_output" / "backend_selection.json.gz", BackendSelection
        ),
        validation=read_artifact(
            src / "profiler_output" / "validation_report.json", ValidationReport
        ),
        optimized=optimized,
        min_speedup=min_speedup,
    )


def _conv_block(out: Path) -> WorkloadArtifacts:
    shutil.copytree(DATA / "report" / "conv_block", out / "conv_block")
    session = read_artifact(DATA / "report" / "session.json", SessionSummary)
    return load_workload_artifacts(out / "conv_block", session.workloads[0])


def _cpu_fallback(out: Path) -> WorkloadArtifacts:
    """conv_block's artifacts as the CPU fallback leaves them: measured, the gate not held."""
    a = _conv_block(out)
    for prof in (a.profile, a.optimized):
        assert prof is not None
        prof.capture_metadata.cpu_fallback = True
        prof.capture_metadata.device_type = "cpu"
    a.summary.enforced = False
    a.summary.message = (
        f"{CPU_NOT_ENFORCED} (1.39x (95% CI 1.36–1.42) against compile: meets the minimum "
        "1.00; --opprof-gate-on-cpu enforces it)"
    )
    return a


def _cpu_tiny(out: Path) -> WorkloadArtifacts:
    """The real CPU-fallback capture, stopped at propose."""
    shutil.copytree(DATA / "report" / "cpu_tiny", out / "tiny")
    summary = WorkloadSummary(
        name="tiny", path="work/tiny.py", status="error", stage="propose", message="propose: boom"
    )
    return load_workload_artifacts(out / "tiny", summary, stage_errors={"propose": "boom"})


def _only_a_summary(out: Path) -> WorkloadArtifacts:
    summary = WorkloadSummary(
        name="broken",
        path="w/broken.py",
        status="error",
        stage="capture",
        message="child process crashed: CUDA error: out of memory",
    )
    return WorkloadArtifacts(
        name="broken",
        path="w/broken.py",
        out_dir=out / "broken",
        summary=summary,
        stage_errors={"capture": summary.message},
    )


WORKLOADS: dict[str, Callable[[Path], WorkloadArtifacts]] = {
    **{f"h200/{n}": functools.partial(_h200, n) for n in H200},
    "h200/sdpa_attention, failed": lambda out: _h200("sdpa_attention", out, min_speedup=8.0),
    "report/conv_block": _conv_block,
    "report/conv_block, CPU fallback": _cpu_fallback,
    "report/cpu_tiny, CPU fallback stopped at propose": _cpu_tiny,
    "a summary only": _only_a_summary,
}


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[object, ...]]:
    """Each plot the report asks for, by file name, with its arguments: a stand-in file is
    written in its place (test_report_markdown and test_report_plots draw the real ones)."""
    calls: dict[str, tuple[object, ...]] = {}

    def stub(path: Path, *args: object) -> Path:
        calls[Path(path).name] = args
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"\x89PNG")
        return Path(path)

    monkeypatch.setattr(plots, "have_matplotlib", lambda: True)
    for name in ("roofline", "operator_bars", "waterfall"):
        monkeypatch.setattr(plots, name, stub)
    return calls


@pytest.mark.parametrize("which", list(WORKLOADS))
def test_the_first_screen_holds_the_verdict_the_table_and_the_plots(
    which: str, tmp_path: Path, drawn: dict[str, tuple[object, ...]]
) -> None:
    a = WORKLOADS[which](tmp_path)
    lines = render_workload_report(a, plots=True).splitlines()
    first = "\n".join(lines[:FIRST_SCREEN])
    # the details start within the first screen's lines and all come after it
    assert "## Timing" in lines[:FIRST_SCREEN]
    start = lines.index("## Timing")
    positions = [lines.index(h) for h in DETAILS]
    assert positions == sorted(positions) and positions[0] == start
    assert "## Headline" in lines[:start]
    # the verdict, with the gate's figure and its CI where one was measured
    status = verdict(a.summary)
    ratio, low, high, _, _ = gate_figures(a)
    line = next(x for x in lines[:start] if x.startswith(f"**{status}** · "))
    if ratio is not None:
        assert fmt_speedup(ratio, low, high) in line
    else:
        assert "no speedup measured" in line
    if not a.summary.enforced or (a.profile and a.profile.capture_metadata.cpu_fallback):
        assert f"**{CPU_NOT_ENFORCED}**" in first
    # the headline table: one row per baseline, the gate's first, with its CI
    if a.optimized is not None:
        rows = [x for x in lines[:start] if x.startswith("| ")]
        assert rows[0].startswith("| against") and "(gate)" in rows[1] and "95% CI" in rows[1]
        if a.selection is not None and a.selection.plan.dtype:
            assert "→" in rows[0]  # with the dtype change, in a column of its own
    assert any(x.startswith("Applied") for x in lines[:start])
    # a link to every plot drawn, and only those
    links = re.findall(r"!\[[^\]]*\]\((profiler_output/[^)]+)\)", first)
    assert sorted(Path(x).name for x in links) == sorted(drawn)
    assert all((a.out_dir / x).is_file() for x in links)
    assert "![" not in "\n".join(lines[start:])
    if a.optimized is not None and a.selection is not None:
        assert set(drawn) >= {"operators_before_after.png", "waterfall.png"}


@pytest.mark.parametrize("which", list(WORKLOADS))
def test_no_line_is_longer_than_the_limit(
    which: str, tmp_path: Path, drawn: dict[str, tuple[object, ...]]
) -> None:
    a = WORKLOADS[which](tmp_path)
    text = render_workload_report(a, plots=True)
    assert max(map(len, text.splitlines())) <= LINE_LIMIT


def test_a_cut_kernel_name_is_given_in_full_below_its_table(
    tmp_path: Path, drawn: dict[str, tuple[object, ...]]
) -> None:
    a = _h200("gpt2", tmp_path)
    text = render_workload_report(a, plots=False)
    assert a.profile is not None
    linear = next(op for op in a.profile.primary.aggregated if op.name == "aten::linear")
    name = linear.kernel_names[0]
    ops = text[text.index("## Operator summary") : text.index("## Optimizations")]
    row = next(x for x in ops.splitlines() if x.startswith("| 1 "))
    assert name not in row and name[:40] in row and "…`" in row
    full = ops[ops.index("Cut to fit the table above, in full:") :]
    assert f"- `aten::linear` · main kernel: `{name}`" in " ".join(full.split())


def test_a_failed_gate_reads_so_first(tmp_path: Path, drawn: dict[str, tuple[object, ...]]) -> None:
    a = _h200("sdpa_attention", tmp_path, min_speedup=8.0)
    lines = render_workload_report(a, plots=True).splitlines()
    assert lines[0] == "# sdpa_attention: 6.97× faster than torch.compile"
    assert lines[2].startswith("**failed** · 6.97× (95% CI 6.89–7.02) against torch.compile")
    quote = " ".join(x[2:] for x in lines if x.startswith("> "))
    assert "CI wholly below the minimum 8.00" in quote


# ------------------------------------------------------------------------------ the helpers


def test_wrap_keeps_the_width_and_never_starts_a_block() -> None:
    text = "a " * 45 + "- b " + "c " * 40 + "1. d " + "e " * 40 + "# f"
    lines = wrap(text, first="- ", rest="  ")
    assert lines[0].startswith("- ") and all(x.startswith("  ") for x in lines[1:])
    assert all(len(x) <= WRAP + 5 for x in lines)
    assert not any(re.match(r"\s*(?:[-#]|\d+\.)\s", x[2:]) for x in lines[1:])
    assert " ".join(" ".join(x.split()) for x in lines) == "- " + " ".join(text.split())
    word = "x" * 500  # longer than a line: cut into pieces
    assert max(map(len, wrap(word))) <= LINE_LIMIT


def test_clip_closes_a_code_span() -> None:
    assert clip("`abcdefghij`", 8) == "`abcde…`"
    assert clip("plain text here", 8) == "plain t…"
    assert clip("short", 8) == "short"


def test_table_cuts_a_long_cell_and_lists_it_in_full() -> None:
    long = " ".join(["word"] * 100)
    lines = table(["name", "detail"], [["a|b", long], ["c", "short"]], caps={1: 50})
    assert max(map(len, lines)) <= LINE_LIMIT
    row = lines[2]
    assert row.startswith("| a\\|b ") and "word word" in row and "…" in row and len(row) < 70
    listed = lines[lines.index("Cut to fit the table above, in full:") + 2 :]
    assert " ".join(" ".join(listed).split()) == f"- a|b · detail: {long}"
    # no cap, but the row does not fit: the widest column gives way
    wide = table(["a", "b"], [["y" * 250, "z" * 200]])
    assert max(map(len, wide)) <= LINE_LIMIT and "z" * 200 in wide[2]
    assert "y" * 250 in "\n".join(wide[3:]) and "y" * 250 not in wide[2]


def test_markdown_from_elsewhere_is_held_to_the_limit() -> None:
    prose = "- " + "word " * 100
    row = "| " + " | ".join(["v" * 120] * 3) + " |"
    code = "x" * 350
    text = "\n".join(["# Title", "", prose, "", "| a | b | c |", "|---|---|---|", row, ""])
    text += "\n```\n" + code + "\n```\n"
    out = fit_markdown(text)
    assert max(map(len, out)) <= LINE_LIMIT
    assert out[0] == "# Title" and out[2].startswith("- word") and out[3].startswith("  word")
    assert any(x.startswith("| a ") for x in out) and "Cut to fit the table above, in full:" in out
    fence = out.index("```")
    assert "".join(out[fence + 1 : out.index("```", fence + 1)]) == code


# ------------------------------------------------------------------------------ the modules


def test_report_modules_stay_small() -> None:
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in REPORT.glob("*.py")}
    assert max(sizes.values()) < 600, sizes
