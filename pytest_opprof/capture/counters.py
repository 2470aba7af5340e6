"""The counters pass (docs/how-it-works.md#nsight-compute): Nsight Compute over exactly one
measured iteration.

Why an NVTX range and not ``--launch-skip``: the number of kernels launched before the
measured call (model set-up, Inductor compile and autotuning, warmup) changes from run to run
with the autotune and FX-graph caches, so a skip count taken from the timeline is not exact. The
target process (``stages.capture.task_counters_target``) wraps the one measured call in
``torch.cuda.nvtx.range("opprof_iteration")``, a push/pop range, which ncu selects with
``--nvtx --nvtx-include "opprof_iteration/"`` (the trailing ``/`` names a push/pop range).
``--launch-count`` is only a safety bound (twice the timeline's kernel count, at least +16): if
the range somehow matched more, the join below reports the surplus instead of ncu replaying
kernels for an hour. One ncu process serves every timeline of a capture: each label's
iteration runs in its own range (``opprof_iteration_eager``, ``opprof_iteration_compiled``)
and each CSV row names its range, so rows go back to their timeline exactly; the process start,
model set-up and compile under ncu are paid once.

Replay ``unique`` (``--opprof-ncu-replay``; ``auto`` picks it above ``UNIQUE_ABOVE`` kernels):
``--filter-mode per-launch-config --launch-count 1`` replays the first launch of each launch
configuration only — GPT-2's twelve identical layers, an LSTM's 128 time steps — and the other
launches of the same kernel with the same grid, block and shared memory carry its counters,
marked ``counters_source="same_launch_config"`` (``measured`` for the replayed one). Each
replay pass costs every kernel launch tens of milliseconds (12 passes for this metric list),
which took minutes for gpt2 and the LSTM replayed in full
(docs/design-notes.md#nsight-computes-unique-replay).

Kernel names: ncu prints names with ``--print-kernel-base demangled``, the torch profiler
(CUPTI) its own demangled form, and with ncu 2025.3.1 and torch 2.11 the two differ in
more than spacing: ncu drops inner namespaces (CUPTI's ``at::native::(anonymous
namespace)::max_pool_forward_nchw<float, int>(int, float const*, ...)`` is ncu's
``at::<unnamed>::max_pool_forward_nchw<float, int>(T2, const T1 *, ...)``, and
``cask_plugin__5x_cudnn::xmma__5x_cudnn::init_device_workspace_kernel`` is
``cask_plugin__5x_cudnn::init_device_workspace_kernel``). ``ncu_metrics.kernel_key`` keeps the
function's own name only — no namespaces, return type, template arguments or parameters. The
join is by key *and* ordinal among the kernels of that key in launch order, and each pair must
agree on its launch geometry (grid and block) where both sides know it; a key whose counts or
geometries differ is a warning naming the kernels, never a shifted join. Keys compare exactly,
so ``triton_poi_fused_add_1`` never matches ``triton_poi_fused_add_10``.

Everything here is data in, data out: failures come back as ``CountersResult.note`` and
``warnings``, never raised. No torch here: the target process is a stage child (``stages.capture``).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_opprof import devicelock
from pytest_opprof.capture.ncu_metrics import (
    METRICS,
    NVTX_RANGE,
    CountersResult,
    apply_to_timeline,
    join,
    join_unique,
    parse_raw_csv,
    resolve,
    timeline_kernels,
)
from pytest_opprof.schema import KernelRecord, Profile, Timeline, write_text_atomic

PENDING = "pending"
"""The ``Profile.counters`` key of a profile whose counters pass runs beside the later stages
(``--opprof-ncu-when=beside``, ``stages.capture.CountersBeside``), its value saying so until
the pass rewrites the profile with its counters. A profile still pending is not reused by a
later session (``stages._check_artifacts``): its pass may never have ended."""
REPLAY_MODES = ("auto", "all", "unique")
UNIQUE_ABOVE = 96
"""``--opprof-ncu-replay=auto``: replay every launch up to this many kernels (all labels)."""
TARGET_TASK = "counters_target"
LOG_NAME = "ncu.log"
PARAMS_FILE = Path("/proc/driver/nvidia/params")
NCU_LOCATIONS = (
    "/usr/local/cuda/bin/ncu",
    "/opt/nvidia/nsight-compute/*/ncu",
    "/usr/local/NVIDIA-Nsight-Compute*/ncu",
)


# ------------------------------------------------------------------------------- detection


def find_ncu(path: str | None = None, locations: Sequence[str] = NCU_LOCATIONS) -> str | None:
    """``ncu`` on ``path`` (default ``$PATH``), else the newest of the usual install places."""
    found = shutil.which("ncu", path=path)
    if found:
        return found
    for pattern in locations:
        hits = sorted(glob.glob(pattern), key=_version_key, reverse=True)
        for hit in hits:
            if os.path.isfile(hit) and os.access(hit, os.X_OK):
                return hit
    return None


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def needs_sudo(mode: str, params_file: Path = PARAMS_FILE, euid: int | None = None) -> bool:
    """``--opprof-ncu-sudo``: ``auto`` uses sudo when the driver restricts the counters to
    admins (``RmProfilingAdminOnly: 1``) and we are not root."""
    if mode == "true":
        return True
    if mode == "false":
        return False
    uid = os.geteuid() if euid is None else euid
    if uid == 0:
        return False
    try:
        text = params_file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    match = re.search(r"^\s*RmProfilingAdminOnly\s*:\s*(\d+)", text, re.MULTILINE)
    return bool(match and match.group(1) == "1")


# -------------------------------------------------------------------------------- command


def launch_bound(kernels_per_iteration: int) -> int:
    """``--launch-count``: a bound, not the selector (the NVTX range is)."""
    return max(2 * kernels_per_iteration, kernels_per_iteration + 16)


def range_name(label: str) -> str:
    """The NVTX push/pop range around ``label``'s measured iteration."""
    return f"{NVTX_RANGE}_{label}"


def build_command(
    ncu: str,
    spec_path: Path,
    *,
    kernels_per_iteration: int,
    log_file: Path,
    metrics: Sequence[str],
    clock_control: str = "none",
    sudo: bool = False,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    labels: Sequence[str] = ("eager",),
    unique: bool = False,
) -> list[str]:
    """The ncu command line over ``python -m pytest_opprof.runner SPEC``: one iteration of
    each label, ``kernels_per_iteration`` counting all of them. ``unique``: the first launch
    of each launch configuration only.

    ncu's own output (the raw CSV included) goes to ``log_file`` so the workload's prints
    cannot interleave with it. Kernel replay (the default) replays each kernel in place, not
    the whole process (application replay took ~65 s for a tiny script). ``application-only``
    keeps ncu out of Inductor's compile workers, which launch nothing inside the range.
    """
    if clock_control not in ("none", "base"):
        raise ValueError(f"clock control must be none or base, got {clock_control!r}")
    cmd = [ncu, "--nvtx"]
    for label in labels:  # include statements are alternatives: a kernel in any range
        cmd += ["--nvtx-include", f"{range_name(label)}/"]
    if unique:
        cmd += ["--filter-mode", "per-launch-config", "--launch-count", "1"]
    else:
        cmd += ["--launch-count", str(launch_bound(kernels_per_iteration))]
    cmd += [
        "--replay-mode",
        "kernel",
        "--target-processes",
        "application-only",
        "--clock-control",
        clock_control,
        "--print-kernel-base",
        "demangled",
        "--metrics",
        ",".join(metrics),
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        "--log-file",
        str(log_file),
        python,
        "-m",
        "pytest_opprof.runner",
        str(spec_path),
    ]
    if not sudo:
        return cmd
    environ = os.environ if env is None else env
    # sudo resets the environment: pass PATH (ncu's own tools) and PYTHONPATH (this package)
    # through explicitly; -n fails at once instead of waiting for a password nobody types.
    passthrough = [f"PATH={environ.get('PATH', '')}", f"PYTHONPATH={_pythonpath(environ)}"]
    passthrough += [f"{k}={environ[k]}" for k in _KEEP_THROUGH_SUDO if k in environ]
    return ["sudo", "-n", "-E", "env", *passthrough, *cmd]


# The device the timeline used and where Inductor caches its kernels (else root recompiles).
_KEEP_THROUGH_SUDO = (
    "CUDA_VISIBLE_DEVICES",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    devicelock.OWN_CPUS_ENV,  # the target's compile may then go off the GPU
)


def _pythonpath(environ: Mapping[str, str]) -> str:
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([root, *[p for p in parts if p != root]])


def requested_metrics(available: set[str] | None = None) -> list[str]:
    """Every candidate of ``METRICS``; with ``available`` (base names from ``ncu
    --query-metrics``), only those the chip has, since ncu refuses an unknown metric."""
    out: list[str] = []
    for candidates in METRICS.values():
        for metric in candidates:
            wanted = available is None or metric.split(".")[0] in available
            if wanted and metric not in out:
                out.append(metric)
    return out


def query_available(ncu: str, sudo: bool = False, timeout: float = 120.0) -> set[str] | None:
    """Base metric names the installed GPU supports (``ncu --query-metrics --csv``)."""
    cmd = [ncu, "--query-metrics", "--csv"]
    if sudo:
        cmd = ["sudo", "-n", "-E", *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    names = set()
    for row in csv.reader(io.StringIO(proc.stdout)):
        if row and re.fullmatch(r"[a-z0-9_]+__[a-z0-9_]+", row[0].strip()):
            names.add(row[0].strip())
    return names or None


# ----------------------------------------------------------------------------------- errors

PERMISSION_FIX = (
    "ncu: ERR_NVGPUCTRPERM, this user may not read the GPU performance counters; the profile "
    "is kept without counters. Fix: rerun with --opprof-ncu-sudo=true (ncu through sudo), or "
    "let every user profile with the NVIDIA driver option NVreg_RestrictProfilingToAdminUsers=0 "
    "(a line `options nvidia NVreg_RestrictProfilingToAdminUsers=0` in /etc/modprobe.d/, then "
    "reload the driver or reboot)"
)


def classify_failure(returncode: int, output: str, tail: int = 8) -> str | None:
    """A note for a failed ncu run (None when it succeeded)."""
    if "ERR_NVGPUCTRPERM" in output:
        return PERMISSION_FIX
    if "sudo:" in output and ("password" in output or "not allowed" in output):  # -n, -E
        return (
            "ncu through sudo failed: sudo needs a password here (it is run with -n); allow "
            "ncu without one, or use the driver option NVreg_RestrictProfilingToAdminUsers=0 "
            "with --opprof-ncu-sudo=false"
        )
    errors = [line for line in output.splitlines() if "==ERROR==" in line]
    if returncode == 0 and not errors:
        return None
    lines = [line for line in output.splitlines() if line.strip()][-tail:]
    return f"ncu failed (exit status {returncode}): " + " | ".join(lines)


# ------------------------------------------------------------------------------ parent side


def run_counters_many(
    spec: Mapping[str, Any],
    kernels_by_label: Mapping[str, Sequence[KernelRecord]],
    *,
    work_dir: Path,
    replay: str = "all",
    sudo_mode: str = "auto",
    clock_control: str = "none",
    timeout: float = 600.0,
    ncu: str | None = None,
) -> dict[str, CountersResult]:
    """Replay one iteration of each labelled call (``eager``, ``compiled``) in ONE process
    under ncu and join each range's rows to that label's kernels (one iteration of its
    timeline, launch order). ``replay``: ``all`` launches, or ``unique`` configurations."""
    labels = list(kernels_by_label)
    bad = [x for x in labels if x not in ("eager", "compiled")]
    if bad:
        note = f"counters: no target for the {bad[0]!r} timeline"
        return {x: CountersResult(note=note) for x in labels}
    ncu = ncu or find_ncu()
    if ncu is None:
        note = "counters: ncu (Nsight Compute) not found on PATH or in the usual places; skipped"
        return {x: CountersResult(note=note) for x in labels}
    no_kernels = "counters: the timeline iteration launched no kernels"
    empty = {x: CountersResult(note=no_kernels) for x in labels if not kernels_by_label[x]}
    labels = [x for x in labels if x not in empty]
    if not labels:
        return empty
    work_dir.mkdir(parents=True, exist_ok=True)
    target = dict(spec, task=TARGET_TASK, counters_labels=labels)
    spec_path = work_dir / "counters_target.json"
    spec_path.write_text(json.dumps(target, indent=1, default=str), encoding="utf-8")
    log_file = work_dir / LOG_NAME
    log_file.unlink(missing_ok=True)
    sudo = needs_sudo(sudo_mode)
    metrics = requested_metrics(query_available(ncu, sudo=sudo))
    total = sum(len(kernels_by_label[x]) for x in labels)
    cmd = build_command(
        ncu,
        spec_path,
        kernels_per_iteration=total,
        log_file=log_file,
        metrics=metrics,
        clock_control=clock_control,
        sudo=sudo,
        labels=labels,
        unique=replay == "unique",
    )
    for attempt in range(2):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            note = f"counters: ncu took over {timeout:.0f} s; skipped"
            return {**empty, **{x: CountersResult(note=note, command=cmd) for x in labels}}
        except OSError as exc:
            note = f"counters: could not start ncu: {exc}"
            return {**empty, **{x: CountersResult(note=note, command=cmd) for x in labels}}
        log = log_file.read_text(encoding="utf-8", errors="replace") if log_file.exists() else ""
        output = proc.stdout + proc.stderr
        # the target's own lines: where the pass's time goes (import, compile, replay)
        write_text_atomic(log_file.with_name("target.log"), output)
        unknown = unknown_metrics(log + "\n" + output, metrics)
        if proc.returncode == 0 or not unknown or attempt:
            break
        # The chip lacks a metric that --query-metrics could not rule out: drop it, once.
        metrics = [m for m in metrics if m not in unknown]
        cmd[cmd.index("--metrics") + 1] = ",".join(metrics)
        log_file.unlink(missing_ok=True)
    unique = replay == "unique"
    bound = None if unique else launch_bound(total)
    results = {
        x: parse_run(
            proc.returncode, log, output, kernels_by_label[x], cmd, label=x, unique=unique,
            bound=bound,
        )
        for x in labels
    }  # fmt: skip
    return {**empty, **results}


def unknown_metrics(output: str, requested: Sequence[str]) -> set[str]:
    """Requested metrics that ncu's error lines name (it refuses a metric the chip lacks)."""
    errors = [line for line in output.splitlines() if "==ERROR==" in line]
    return {
        m
        for m in requested
        for line in errors
        if re.search(rf"(?<![\w.]){re.escape(m.split('.')[0])}(?!\w)", line)
    }


def parse_run(
    returncode: int,
    log: str,
    output: str,
    timeline_kernels: Sequence[KernelRecord],
    command: Sequence[str] = (),
    *,
    label: str | None = None,
    unique: bool = False,
    bound: int | None = None,
) -> CountersResult:
    """Turn one ncu run's log (the CSV) and console output into ``label``'s
    ``CountersResult``: the rows of its NVTX range (a log of one unnamed range is all its)."""
    note = classify_failure(returncode, log + "\n" + output)
    all_rows, header = parse_raw_csv(log)
    rows = [r for r in all_rows if r.label in (label, None)]
    if note and (not rows or note == PERMISSION_FIX):
        return CountersResult(note=note, command=list(command))
    if not rows and not (unique and all_rows):
        where = range_name(label) if label else NVTX_RANGE
        return CountersResult(
            note=f"counters: ncu profiled no kernels inside the NVTX range {where!r}: "
            + " | ".join(log.splitlines()[-4:]),
            command=list(command),
        )
    resolved = resolve(header)
    if unique:
        joined, warnings = join_unique(timeline_kernels, all_rows, resolved, label)
    else:
        joined, warnings = join(timeline_kernels, rows, resolved)
    if note:  # ncu reported an error but profiled kernels: keep them, say what it said
        warnings.insert(0, f"counters: {note}")
    if bound is None and not unique and label is None:  # a log of this timeline alone
        bound = launch_bound(len(timeline_kernels))
    if bound is not None and len(all_rows) >= bound:
        warnings.append(
            f"counters: ncu stopped at its bound of {len(all_rows)} kernels; the range held more"
        )
    return CountersResult(
        metrics=joined, warnings=warnings, resolved=resolved, command=list(command)
    )


def pending(profile: Profile) -> bool:
    """Whether ``profile``'s counters pass runs beside the later stages, not yet ended."""
    return bool(profile.counters) and PENDING in (profile.counters or {})


def counters_for_capture(
    spec: Mapping[str, Any],
    timelines: Sequence[Timeline],
    info: Mapping[str, Any],
    options: Any,
    dtype: str,
    device: str = "cuda",
) -> tuple[list[Timeline], dict[str, Any] | None, list[str]]:
    """The counters pass as ``task_capture`` calls it: on CUDA and unless ``--opprof-ncu=off``,
    every ``eager``/``compiled`` timeline gets its counters; returns the timelines,
    ``Profile.counters`` (None when the pass did not run) and warnings for the profile.
    ``--opprof-ncu=auto`` without ncu is a one-line note; ``on`` without it, a warning."""
    if device != "cuda" or options.ncu == "off":
        return list(timelines), None, []
    ncu = find_ncu()
    if ncu is None:
        note = "ncu (Nsight Compute) not found on PATH or in the usual places"
        if options.ncu == "on":
            return list(timelines), {"note": note}, [f"--opprof-ncu=on: {note}; no counters"]
        return list(timelines), {"note": note}, []
    gpu = gpu_of(info)
    work_dir = Path(spec["out_dir"]) / "profiler_output" / "ncu"
    summary: dict[str, Any] = {"ncu": Path(ncu).name, "clock_control": options.ncu_clock_control}
    warnings: list[str] = []
    # The same kernels in the same order (a model Dynamo leaves to eager, as nn.LSTM): one
    # range serves both timelines.
    kernels = {t.label: timeline_kernels(t) for t in timelines}
    first_with: dict[tuple[Any, ...], str] = {}
    same_as: dict[str, str | None] = {}
    for t in timelines:
        launches = tuple(
            (k.name, tuple(k.grid or ()), tuple(k.block or ())) for k in kernels[t.label]
        )
        same_as[t.label] = first_with.get(launches)
        first_with.setdefault(launches, t.label)
    replayed = {x: kernels[x] for x in kernels if same_as[x] is None}
    replay = options.ncu_replay
    if replay == "auto":
        replay = "unique" if sum(map(len, replayed.values())) > UNIQUE_ABOVE else "all"
    # ncu's target process takes the GPU's lock itself, shared, for its GPU work only (from
    # loading the model to the replay, its compile off the GPU where its CPUs are its own);
    # this process holds nothing of it meanwhile. Held here instead, through ncu's start, the
    # target's imports and compile and ncu's report, it kept every measurer on the GPU waiting.
    lock = devicelock.joined_path()
    devicelock.let_go()
    started = time.perf_counter()
    results = run_counters_many(
        {**spec, "gpu_lock": lock},
        replayed,
        work_dir=work_dir,
        replay=replay,
        sudo_mode=options.ncu_sudo,
        clock_control=options.ncu_clock_control,
        ncu=ncu,
        # Inside the capture stage's own timeout, so a slow replay costs the counters, never
        # the profile.
        timeout=min(600.0, float(options.timeout) / 2),
    )
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["replay"] = replay
    out: list[Timeline] = []
    for timeline in timelines:
        source = same_as[timeline.label] or timeline.label
        result = results[source]
        if result.note:
            warnings.append(f"{timeline.label} timeline: {result.note}")
            out.append(timeline)
        else:
            out.append(apply_to_timeline(timeline, result, gpu, dtype))
        warnings += [f"{timeline.label} timeline: {w}" for w in result.warnings]
        summary[timeline.label] = {
            **_summary_entry(kernels[timeline.label], result),
            "reused_from": same_as[timeline.label],
        }
    return out, summary, warnings


def _summary_entry(kernels: Sequence[KernelRecord], result: CountersResult) -> dict[str, Any]:
    total = sum(k.duration_us for k in kernels)
    covered = {c.index for c in result.metrics}
    measured = {c.index for c in result.metrics if c.source == "measured"}

    def share(indices: set[int]) -> float | None:
        if not total:
            return None
        return sum(k.duration_us for i, k in enumerate(kernels) if i in indices) / total

    return {
        "note": result.note,
        "resolved": result.resolved,
        "kernels": len(kernels),
        "kernels_with_counters": len(covered),
        "kernels_replayed": len(measured),
        "time_coverage": share(covered),
        "time_coverage_replayed": share(measured),
        "warnings": result.warnings,
    }


def gpu_of(meta: Mapping[str, Any] | Any) -> Any:
    """The ``knowledge.GpuSpec`` of a device description — ``environment()``'s dict or a
    profile's ``capture_metadata`` — or None where the table has no match."""
    from pytest_opprof.knowledge import lookup_gpu

    fields = meta if isinstance(meta, Mapping) else meta.model_dump()
    cc = str(fields.get("compute_capability") or "")
    major_minor = (int(cc.split(".")[0]), int(cc.split(".")[1])) if "." in cc else None
    match = lookup_gpu(str(fields.get("device_name", "")), fields.get("sm_count"), major_minor)
    return match.spec if match is not None else None


def rejoin(profile: Profile, ncu_dir: Path) -> Profile:
    """``profile`` with the ncu output a run saved in ``ncu_dir`` (``ncu.<label>.log``)
    joined again to its timelines by this version's join — no GPU needed, nothing measured
    anew. Timelines without a log keep what they have; ``counters`` records the new join."""
    gpu = gpu_of(profile.capture_metadata)
    counters = dict(profile.counters or {})
    timelines = []
    for timeline in profile.timelines:
        before = counters.get(timeline.label)
        before = before if isinstance(before, dict) else {}
        source = before.get("reused_from") or timeline.label
        one_log = ncu_dir / LOG_NAME  # every label's range in one log, else one log per label
        log = one_log if one_log.exists() else ncu_dir / f"ncu.{source}.log"
        if not before or not log.exists():  # a timeline the counters pass never replayed
            timelines.append(timeline)
            continue
        kernels = timeline_kernels(timeline)
        result = parse_run(
            0,
            log.read_text(encoding="utf-8", errors="replace"),
            "",
            kernels,
            label=source,
            unique=counters.get("replay") == "unique",
        )
        timelines.append(apply_to_timeline(timeline, result, gpu, profile.capture_metadata.dtype))
        counters[timeline.label] = {
            **before,
            **_summary_entry(kernels, result),
            "rejoined": True,
            # What the run itself said (a replay that outlived its limit still wrote its log).
            "note_at_capture": before.get("note_at_capture", before.get("note")),
        }
    return profile.model_copy(update={"timelines": timelines, "counters": counters})
