"""The report's plots, drawn beside it and linked from its first screen: the roofline of the
measured kernels under the device's roofs, operator time before and after, and the per-pass
waterfall.

A plot whose data is missing, or whose extra (matplotlib) is not installed, becomes one line
that says so; a plot that fails to draw becomes a line with the error, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_opprof.report import plots as _plots
from pytest_opprof.report.format import one_line
from pytest_opprof.report.lookups import time_label
from pytest_opprof.report.operators import before_after, roofline_series
from pytest_opprof.report.selection import waterfall_bars

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

FIGURES = ("roofline.png", "operators_before_after.png", "waterfall.png")
"""The PNGs under ``profiler_output/``, in the order the report links them."""


def _draw(a: WorkloadArtifacts, filename: str, alt: str, draw: Callable[[Path], object]) -> str:
    target = a.out_dir / "profiler_output" / filename
    try:
        draw(target)
    except (OSError, ValueError, RuntimeError) as exc:
        return f"_Plot {filename} not drawn: {type(exc).__name__}: {one_line(str(exc), 200)}._"
    return f"![{alt}](profiler_output/{filename})"


def figure_lines(a: WorkloadArtifacts, plots: bool) -> list[str]:
    """Draw every plot the artifacts allow and return a link to each (or why it is missing),
    one paragraph apiece. Nothing at all without ``plots``."""
    if not plots:
        return []
    if not _plots.have_matplotlib():
        return [f"_{_plots.PLOTS_MISSING}: no roofline, operator or waterfall plot._", ""]
    lines = []
    series = roofline_series(a)
    if a.profile is None:
        pass  # nothing measured: the headline already says which stage did not run
    elif not any(series.values()):
        lines.append("_No roofline: no kernel carries both FLOP and DRAM-byte counters._")
    else:
        roofs = _plots.device_roofs(a.profile.capture_metadata)
        lines.append(
            _draw(
                a,
                FIGURES[0],
                "roofline of the measured kernels under the device's roofs",
                lambda p: _plots.roofline(p, series, roofs),
            )
        )
    found = before_after(a)
    if found is not None:
        chart = [(c.name, c.before_us, c.after_us) for c in found.changes]
        what = time_label(found.cpu)
        lines.append(
            _draw(
                a,
                FIGURES[1],
                f"{what} per operator, before and after",
                lambda p: _plots.operator_bars(
                    p, chart, found.before.label, found.after.label, what
                ),
            )
        )
    bars = waterfall_bars(a)
    if bars:
        lines.append(
            _draw(a, FIGURES[2], "per-pass waterfall", lambda p: _plots.waterfall(p, bars))
        )
    return [x for line in lines for x in (line, "")]
