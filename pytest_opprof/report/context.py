"""The report's context sections: the hardware and software the figures were measured on, the
commands that reproduce them, and the caveats a reader should weigh them with.

Each row or caveat is copied from ``capture_metadata``, ``counters``, ``edge_case_flags`` and
``warnings`` of the profiles, or from the options the session ran with.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_opprof.capture.counters import pending
from pytest_opprof.report.format import (
    DASH,
    bullet,
    code,
    fmt_dtype,
    fmt_pct,
    fmt_us,
    one_line,
    para,
    table,
)
from pytest_opprof.report.lookups import has_counters, not_available, on_cpu, unattributed_us
from pytest_opprof.schema import CaptureMetadata, Timing

if TYPE_CHECKING:
    from pytest_opprof.report import WorkloadArtifacts

CPU_CAVEAT = "measured on the CPU; not a GPU figure; gate not enforced unless --opprof-gate-on-cpu"


def _iterations(m: CaptureMetadata, timing: Timing) -> str:
    text = f"{m.warmup_iters} warmup, {m.rounds} rounds × {m.measure_iters} calls"
    processes = timing.processes
    return text + (f", in each of {processes} processes" if processes > 1 else "")


def _gpu_identity(m: CaptureMetadata) -> str:
    """Which GPU the measuring process used and how many it saw (one per xdist worker)."""
    if m.device_count is None:
        return DASH
    visible = m.visible_devices if m.visible_devices is not None else "unset"
    return f"{m.device_uuid or DASH}; {m.device_count} visible (CUDA_VISIBLE_DEVICES={visible})"


def section_hardware(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Hardware context", ""]
    prof = a.profile or a.optimized
    if prof is None:
        return [*lines, *para(not_available(a, "capture"))]
    m = prof.capture_metadata
    inputs = ", ".join(
        f"{tuple(shape)} {fmt_dtype(dt)}"
        for shape, dt in zip(m.input_shapes, m.input_dtypes, strict=False)
    )
    rows: list[list[object]] = [
        ["device", f"{m.device_name} ({m.device_type})"],
        ["GPU", _gpu_identity(m)],
        ["SMs", m.sm_count if m.sm_count is not None else DASH],
        ["compute capability", m.compute_capability or DASH],
        ["driver", m.driver or DASH],
        [
            "torch / CUDA / Triton",
            f"{m.torch_version} / {m.cuda_version or DASH} / {m.triton_version or DASH}",
        ],
        ["Python", m.python_version],
        ["model dtype", fmt_dtype(m.dtype)],
        ["inputs", inputs or DASH],
        ["iterations", _iterations(m, prof.timing)],
        ["compile mode", m.compile_mode],
        ["timing clock", prof.timing.clock],
        ["hardware counters", "collected" if has_counters(prof) else "not collected"],
        ["captured", m.timestamp],
        ["environment fingerprint", code(m.environment_fingerprint)],
    ]
    if m.cpu_fallback:
        rows.insert(1, ["CPU fallback", CPU_CAVEAT])
    lines += table(["", "value"], rows, caps={1: 160})
    if a.profile is None:
        lines += para("_From `profile_optimized.json`: " + not_available(a, "capture")[1:])
    elif a.optimized is not None:
        o = a.optimized.capture_metadata
        if (o.device_name, o.torch_version) != (m.device_name, m.torch_version):
            lines += para(
                f"The recapture ran on {o.device_name} with torch {o.torch_version}: the "
                "two profiles do not compare."
            )
    return lines


def _session_out(out_dir: Path) -> str:
    out = Path(out_dir).parent
    try:
        rel = os.path.relpath(out.resolve(), Path.cwd().resolve())
    except ValueError:  # another drive on Windows
        return str(out)
    return str(out) if rel.startswith("..") else rel


def section_reproduction(a: WorkloadArtifacts) -> list[str]:
    out = _session_out(a.out_dir)
    stem = Path(a.path).stem
    extra, cli_extra = [], []
    if a.min_speedup != 1.0:
        extra.append(f"--opprof-min-speedup={a.min_speedup:g}")
        cli_extra.append(f"--min-speedup={a.min_speedup:g}")
    if a.gate_baseline != "best":
        extra.append(f"--opprof-baseline={a.gate_baseline}")
        cli_extra.append(f"--baseline={a.gate_baseline}")
    if a.strict_gate:
        extra.append("--opprof-strict-gate")
        cli_extra.append("--strict-gate")
    prof = a.profile or a.optimized
    if prof is not None and prof.capture_metadata.cpu_fallback:
        extra.append("--opprof-device=cpu")
        cli_extra.append("--device=cpu")
        if a.gate_on_cpu:
            extra.append("--opprof-gate-on-cpu")
            cli_extra.append("--gate-on-cpu")
    q = shlex.quote
    generated = f"{out}/{a.name}/{stem}_optimized.py"
    return [
        "## Reproduce",
        "",
        "From the folder pytest ran in:",
        "",
        "```bash",
        " ".join(["pytest --opprof", q(a.path), f"--opprof-out={q(out)}", *extra]),
        " ".join(["opprof optimize", q(a.path), f"--out={q(out)}", *cli_extra]),
        f"opprof validate {q(generated)}",
        "```",
        "",
    ]


def _counter_caveats(counters: dict[str, object]) -> list[str]:
    clock = counters.get("clock_control")
    lines = bullet(
        "Hardware counters come from Nsight Compute replaying one measured iteration "
        f"(clock control: {clock or 'not recorded'}); replayed kernels run serialised, "
        "so counter durations are not the latencies above."
    )
    if counters.get("replay") == "unique":
        shares = [
            f"{label} {entry['time_coverage_replayed']:.0%}"
            for label, entry in counters.items()
            if isinstance(entry, dict) and entry.get("time_coverage_replayed") is not None
        ]
        lines += bullet(
            "ncu replayed the first launch of each launch configuration (kernel, grid, "
            "block, shared memory); the other launches carry its counters "
            '(`counters_source: "same_launch_config"`). Kernel time replayed directly: '
            + (", ".join(shares) or "not recorded")
            + "; `--opprof-ncu-replay=all` replays every launch."
        )
    return lines


def section_caveats(a: WorkloadArtifacts) -> list[str]:
    lines = ["## Caveats", ""]
    for prof, artifact in ((a.profile, "profile.json"), (a.optimized, "profile_optimized.json")):
        if prof is None or not prof.timelines:
            continue
        t = prof.primary
        n = len(t.unattributed_kernels)
        lines += bullet(
            f"Unattributed: {fmt_pct(1 - t.summary.attributed_share)} of the device time of "
            f"the {t.label} timeline (`{artifact}`) is not tied to an operator "
            f"({n} kernel record{'s' if n != 1 else ''}, "
            f"{fmt_us(unattributed_us(t, on_cpu(a)))} per iteration); it is listed, never "
            "dropped."
        )
    prof = a.profile or a.optimized
    if prof is None:
        lines += bullet(f"Capture: {not_available(a, 'capture')}")
    else:
        if has_counters(prof):
            lines += _counter_caveats(dict(prof.counters or {}))
        elif pending(prof):
            lines += bullet(
                "Hardware counters missing: the counters pass, run beside the later stages, "
                "had not ended when this report was written (its session ended first); "
                "bottleneck classes come from the fallbacks (kernel names, idle gaps)."
            )
        else:
            lines += bullet(
                "Hardware counters missing: Nsight Compute did not run or was not permitted; "
                "bottleneck classes come from the fallbacks (kernel names, idle gaps)."
            )
        if prof.capture_metadata.cpu_fallback:
            lines += bullet(f"CPU fallback: {CPU_CAVEAT}.")
        else:
            lines += bullet(
                f"Clocks: latencies are timed with {prof.timing.clock} at the GPU's own "
                "clocks (not locked); thermal state and other tenants move them, which the "
                "interleaved rounds and the CI account for."
            )
    seen: set[tuple[str, str]] = set()
    for source in (a.profile, a.optimizations, a.optimized):
        for flag in getattr(source, "edge_case_flags", []) or []:
            if (flag.name, flag.detail) not in seen:
                seen.add((flag.name, flag.detail))
                detail = one_line(flag.detail).rstrip(".")
                lines += bullet(f"Edge case {code(flag.name)}: {detail}.")
    for prof, artifact in ((a.profile, "profile.json"), (a.optimized, "profile_optimized.json")):
        for w in prof.warnings if prof else []:
            lines += bullet(f"Warning (`{artifact}`): {one_line(w)}")
    for stage, msg in a.stage_errors.items():
        lines += bullet(f"Stage {stage}: {one_line(msg)}")
    return [*lines, ""]
