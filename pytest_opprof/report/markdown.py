"""``report.md`` of one workload (docs/how-it-works.md): the first screen, then the details.

The first screen (``headline``) holds the verdict, the headline table, what was applied and the
plots; the sections after it (timing, hardware, operators, proposals, selection, validation,
waterfall, a plugin's own sections, reproduction, caveats) each come from the module of their
concern. Each section is a function from the artifacts to Markdown lines; a section whose
artifact is missing says which stage did not run and why, and the rest still renders.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_opprof.report.context import section_caveats, section_hardware, section_reproduction
from pytest_opprof.report.format import fit_markdown, one_line
from pytest_opprof.report.headline import section_headline, title_block
from pytest_opprof.report.lookups import proposal_status
from pytest_opprof.report.operators import section_before_after, section_operators
from pytest_opprof.report.optimizations import (
    section_estimated_vs_measured,
    section_optimizations,
    section_remaining,
)
from pytest_opprof.report.selection import (
    section_implementation,
    section_validation,
    section_waterfall,
)
from pytest_opprof.report.timing import section_timing
from pytest_opprof.schema import write_text_atomic

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

__all__ = ["proposal_status", "render_workload_report", "section_extra", "write_workload_report"]
# proposal_status: tests/unit/test_llm_passes.py imports it from here


def section_extra(sections: Sequence[tuple[str, str]]) -> list[str]:
    """The sections ``pytest_opprof_report_sections`` returned, as ``## title`` + markdown,
    held to the report's line width like its own."""
    lines: list[str] = []
    for title, body in sections:
        lines += [f"## {one_line(title, 200)}", "", *fit_markdown(body), ""]
    return lines


def render_workload_report(
    a: WorkloadArtifacts, *, plots: bool = True, extra_sections: Sequence[tuple[str, str]] = ()
) -> str:
    """The whole ``report.md`` of one workload. With ``plots`` and matplotlib present, the PNGs
    are written to ``a.out_dir / "profiler_output"`` and linked from the first screen.
    ``extra_sections`` (title, markdown) come after the analysis, before the reproduction
    commands."""
    lines: list[str] = []
    lines += title_block(a)
    lines += section_headline(a, plots)
    lines += section_timing(a)
    lines += section_hardware(a)
    lines += section_operators(a)
    lines += section_optimizations(a)
    lines += section_implementation(a)
    lines += section_validation(a)
    lines += section_before_after(a)
    lines += section_waterfall(a)
    lines += section_estimated_vs_measured(a)
    lines += section_remaining(a)
    lines += section_extra(extra_sections)
    lines += section_reproduction(a)
    lines += section_caveats(a)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_workload_report(a: WorkloadArtifacts, *, plots: bool = True) -> Path:
    """Render and write ``a.out_dir / "report.md"`` atomically; returns its path."""
    path = Path(a.out_dir) / "report.md"
    write_text_atomic(path, render_workload_report(a, plots=plots))
    return path
