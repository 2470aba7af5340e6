"""Re-derive a GPU run's timelines and counters from the raw output it saved, with this checkout.

    python benchmarks/refresh_artifacts.py OUT_DIR/<name> [OUT_DIR/<name> ...]

For each workload folder of an ``--opprof-out`` run: every timeline of ``profile.json`` and
``profile_optimized.json`` is attributed again from its saved Chrome trace and Inductor
provenance (``profiler_output/``; the optimized timeline with its uncaptured twin's trace where
one was saved), and the Nsight Compute output (``profiler_output/ncu/ncu.<label>.log``) is
joined again (``capture.counters.rejoin``). Nothing is measured anew: timing, metadata and the
raw files stay as the GPU wrote them, so a fix to attribution or to the join can be applied to
a run without a GPU. Each rewritten profile carries a warning that says so.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pytest_opprof.capture.attribution import build_timeline, replay_twin
from pytest_opprof.capture.counters import rejoin
from pytest_opprof.capture.trace import load_trace, provenance_file, trace_file
from pytest_opprof.schema import Profile, Timeline, read_artifact, write_artifact

NOTE = "timelines and counters re-derived from the saved traces and ncu output by {tool}"


def _provenance(path: Path) -> dict[str, list[str]]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def refresh_profile(path: Path, stem: str) -> bool:
    """Rewrite one profile in place; False where it has no saved traces."""
    if not path.exists():
        return False
    profile = read_artifact(path, Profile)
    out = path.parent / "profiler_output"
    provenance = _provenance(provenance_file(out, stem, (t.label for t in profile.timelines)))
    device = profile.capture_metadata.device_type
    timelines: list[Timeline] = []
    flags = []
    for old in profile.timelines:
        trace = trace_file(out, stem, old.label)
        if not trace.exists():
            return False
        twin = None
        uncaptured = trace_file(out, stem, f"{old.label}_uncaptured")
        if uncaptured.exists():
            twin_timeline, _ = build_timeline(
                load_trace(uncaptured),
                label=f"{old.label}_uncaptured",
                compile_mode=old.compile_mode,
                device_type=device,
                provenance=provenance,
            )
            twin = replay_twin(twin_timeline)
        timeline, found = build_timeline(
            load_trace(trace),
            label=old.label,
            compile_mode=old.compile_mode,
            device_type=device,
            provenance=provenance,
            trace_file=trace.name,
            twin=twin,
        )
        timelines.append(timeline)
        flags += [f for f in found if f.name not in {x.name for x in flags}]
    kernel_ms = {t.label: t.summary.device_time_per_iter_us / 1000.0 for t in timelines}
    timing = profile.timing.model_copy(update={"gpu_kernel_ms": kernel_ms})
    note = NOTE.format(tool=Path(__file__).name)
    warnings = [w for w in profile.warnings if w != note] + [note]
    profile = profile.model_copy(
        update={
            "timelines": timelines,
            "edge_case_flags": flags,
            "timing": timing,
            "warnings": warnings,
        }
    )
    if (out / "ncu").is_dir():
        profile = rejoin(profile, out / "ncu")
    write_artifact(path, profile)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    ns = parser.parse_args(argv)
    for folder in ns.folders:
        stem = folder.name
        for name in ("profile.json", "profile_optimized.json"):
            done = refresh_profile(folder / name, stem)
            print(f"{folder / name}: {'refreshed' if done else 'left as it is (no saved traces)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
