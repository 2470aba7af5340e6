"""``opprof``: the pipeline without pytest, over the same code (docs/usage.md#command-line).

    opprof optimize examples/conv_block/conv_block.py [more.py …] [--out DIR] [--from STAGE]
    opprof capture workload.py
    opprof recapture workload.py
    opprof propose out/conv_block/profile.json [--out PATH]
    opprof backend workload.py out/conv_block/optimizations.json
    opprof validate out/conv_block/conv_block_optimized.py
    opprof report workload.py
    opprof merge shard-1/ shard-2/ --out merged/
    opprof runs [--storage DIR]
    opprof trend [--storage DIR] [--out DIR] [--last N]
    opprof export [RUN] [--storage DIR] [--out DIR]
    opprof preflight

Each subcommand takes the options that change what it does (``opprof COMMAND --help`` lists
them with their defaults and accepted values).

Exit status: 0 when every gate passed, 1 when one failed or an input could not be used (a file
not found, not a workload, not valid), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_opprof import STAGES, __version__
from pytest_opprof.errors import OpprofError
from pytest_opprof.options import OPTIONS, OpprofOptions, add_cli_arguments, cli_spelling

if TYPE_CHECKING:
    from pytest_opprof.session import OpprofSession
    from pytest_opprof.workload import WorkloadSpec

# The options each stage reads (by field); a subcommand offers those of the stages it runs.
# (The backend's selection times with a fixed warmup: it reads no --warmup-iters.)
RUN = ("out", "device", "timeout")
TIMING = ("warmup_iters", "measure_iters", "rounds")
NCU = ("ncu", "ncu_when", "ncu_sudo", "ncu_clock_control", "ncu_replay")
STAGE_OPTIONS: dict[str, tuple[str, ...]] = {
    "capture": ("compile_backend", *TIMING, *NCU),
    "propose": ("min_confidence", "max_opts", "llm"),
    "backend": ("compile_backend", "measure_iters", "rounds", "stock", "warm_rungs"),
    "validate": (),
    "recapture": (
        "compile_backend",
        *TIMING,
        "timing_processes",
        "fresh_timing",
        "timing_servers",
        "stock",
    ),
    "report": (
        "min_speedup",
        "baseline",
        "strict_gate",
        "gate_on_cpu",
        "save",
        "compare",
        "compare_fail",
        "storage",
    ),
}


def _of(*stages: str) -> tuple[str, ...]:
    """The options of these stages, each once, in the order of ``OPTIONS``."""
    wanted = {name for stage in stages for name in STAGE_OPTIONS[stage]}
    return tuple(spec.field for spec in OPTIONS if spec.field in wanted)


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_text: str,
    options: Sequence[str],
    inputs: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """A subcommand with these options; ``inputs``: its arguments that name files or folders,
    which must exist."""
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(inputs=tuple(inputs))
    add_cli_arguments(p, [spec.field for spec in OPTIONS if spec.field in options])
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opprof",
        description="The pytest-opprof pipeline without pytest: profile a PyTorch workload, "
        "generate and validate a torch.compile backend, and gate on its measured speedup.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = _command(
        sub,
        "optimize",
        "all six stages",
        (*RUN, "from", "stage", *_of(*STAGES)),
        inputs=["workloads"],
    )
    _workloads(p)
    p = _command(
        sub,
        "capture",
        "stage 0: profile the workload (writes profile.json)",
        (*RUN, *_of("capture")),
        inputs=["workloads"],
    )
    _workloads(p)
    p = _command(
        sub,
        "recapture",
        "stage 4: profile and time the workload's optimized backend against its baselines "
        "(writes profile_optimized.json; the earlier stages are read from disk, or run where "
        "missing)",
        (*RUN, *_of("recapture")),
        inputs=["workloads"],
    )
    _workloads(p)
    p = _command(
        sub,
        "report",
        "stage 5: write report.md from the artifacts on disk (a backend file edited since "
        "its validation is validated again first)",
        (*RUN, *_of("report")),
        inputs=["workloads"],
    )
    _workloads(p)
    p = _command(sub, "propose", "stage 1 from a profile.json", _of("propose"), inputs=["profile"])
    p.add_argument(
        "profile",
        type=Path,
        metavar="PROFILE",
        help="a profile.json written by the capture (graph.json beside it is read too, if there)",
    )
    p.add_argument(
        "--out",
        dest="destination",
        default=None,
        metavar="PATH",
        help="where to write the proposals "
        "(default: optimizations.json beside the profile; a file, or a folder to write "
        "optimizations.json into)",
    )
    p = _command(
        sub,
        "backend",
        "stage 2 from a workload and its optimizations.json (artifacts beside the latter)",
        ("device", "timeout", *_of("backend")),
        inputs=["workload", "optimizations"],
    )
    p.add_argument(
        "workload",
        type=Path,
        metavar="WORKLOAD",
        help="the workload file (a Python file with a top-level get_model_and_input())",
    )
    p.add_argument(
        "optimizations",
        type=Path,
        metavar="OPTIMIZATIONS",
        help="its optimizations.json, in <out>/<workload>/ beside the capture's artifacts",
    )
    p = _command(
        sub,
        "validate",
        "stage 3 on any backend file, generated or edited",
        ("device", "timeout"),
        inputs=["file"],
    )
    p.add_argument(
        "file",
        type=Path,
        metavar="FILE",
        help="a backend file, <out>/<workload>/<workload>_optimized.py, generated or edited",
    )
    p = _command(
        sub,
        "merge",
        "combine the --opprof-out folders of shards into one report in --out",
        ("out",),
        inputs=["dirs"],
    )
    p.add_argument(
        "dirs",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="a shard's --out folder, its --opprof-out under pytest (one or more)",
    )
    _command(sub, "preflight", "check Python, torch, CUDA, the GPU, ncu and permissions", ())
    _command(sub, "runs", "list the stored runs (optimize --save)", ("storage",))
    p = _command(
        sub,
        "trend",
        "each workload's latencies and speedup over stored runs, in --out",
        ("storage", "out"),
    )
    p.add_argument(
        "--last",
        type=_positive,
        default=None,
        metavar="N",
        help="the latest N runs only (default: all; an integer ≥ 1)",
    )
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNG (default: off)")
    p = _command(
        sub,
        "export",
        "a stored run as github-action-benchmark's custom JSON (two files in --out)",
        ("storage", "out"),
    )
    p.add_argument(
        "run",
        nargs="?",
        default="last",
        metavar="RUN",
        help="the stored run to export (default: last; last, NUMBER, NAME or PATH)",
    )
    return parser


def _workloads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "workloads",
        nargs="+",
        type=Path,
        metavar="WORKLOAD",
        help="a workload file, a Python file with a top-level get_model_and_input() (one or more)",
    )


def _positive(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer ≥ 1")
    return number


def _options(ns: argparse.Namespace) -> OpprofOptions:
    values = {spec.field: getattr(ns, spec.field) for spec in OPTIONS if hasattr(ns, spec.field)}
    return OpprofOptions.from_values(values)


def _check_inputs(ns: argparse.Namespace) -> None:
    """Every file or folder the command line names exists, before anything runs."""
    for dest in ns.inputs:
        value = getattr(ns, dest)
        for path in value if isinstance(value, list) else [value]:
            if not path.exists():
                raise OpprofError(f"{path}: not found")


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        if ns.command == "preflight":
            return preflight()
        options = _options(ns)  # a usage error first, as argparse's own
        _check_inputs(ns)
        return COMMANDS[ns.command](ns, options)
    except pytest.UsageError as exc:
        print(f"opprof: error: {cli_spelling(str(exc))}", file=sys.stderr)
        return 2
    except OpprofError as exc:
        print(f"opprof: {cli_spelling(str(exc))}", file=sys.stderr)
        return 1


def _session(options: OpprofOptions) -> OpprofSession:
    from pytest_opprof.gpus import assign
    from pytest_opprof.session import OpprofSession

    assign(options.device, None)  # measure under the GPU's lock, beside any pytest session
    return OpprofSession(options=options)


def _spec(path: Path) -> WorkloadSpec:
    from pytest_opprof.workload import discover

    spec = discover(path)
    if spec is None:
        raise OpprofError(f"{path}: not a workload (no top-level def get_model_and_input)")
    return spec


def _print(name: str, stage: str, status: str, message: str) -> None:
    mark = {"passed": "ok", "skipped": "skip", "failed": "FAIL", "error": "ERROR"}[status]
    first, *rest = cli_spelling(message or "").splitlines() or [""]
    print(f"[{name}] {stage:<9} {mark:<5} {first}", flush=True)
    for line in rest:
        print(f"    {line}")


def _run_stages(ns: argparse.Namespace, options: OpprofOptions, stages: Sequence[str]) -> int:
    session = _session(options)
    failed = False
    for path in ns.workloads:
        spec = _spec(path)
        name = session.workload(spec).name
        # every stage before the last asked for runs too (OpprofSession.run)
        session.workload(spec).planned = frozenset(STAGES[: max(map(STAGES.index, stages)) + 1])
        for stage in stages:
            print(f"[{name}] {stage} …", flush=True)
            outcome = session.run(spec, stage)
            _print(name, stage, outcome.status, outcome.message)
            failed |= outcome.status in ("failed", "error")
    if "report" in stages:
        from pytest_opprof.report import terminal_summary_lines
        from pytest_opprof.session import session_device

        summaries = session.collect_summaries()
        device = session_device(summaries, options.out, options.device)
        report, verdict = session.write_session(summaries, device)
        print(cli_spelling("\n".join(terminal_summary_lines(summaries))))
        print(f"session report: {report}")
        failed |= not verdict.gate_passed
    return 1 if failed else 0


def cmd_optimize(ns: argparse.Namespace, options: OpprofOptions) -> int:
    return _run_stages(ns, options, options.stages_to_run())


def cmd_capture(ns: argparse.Namespace, options: OpprofOptions) -> int:
    return _run_stages(ns, options, ["capture"])


def cmd_recapture(ns: argparse.Namespace, options: OpprofOptions) -> int:
    return _run_stages(ns, options, ["recapture"])


def cmd_report(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from dataclasses import replace

    return _run_stages(ns, replace(options, from_="report"), STAGES)


def cmd_propose(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from pytest_opprof.propose import propose
    from pytest_opprof.schema import FxGraphSummary, Profile, read_artifact, write_artifact

    profile = read_artifact(ns.profile, Profile)
    graph_path = ns.profile.with_name("graph.json")
    graph = read_artifact(graph_path, FxGraphSummary) if graph_path.exists() else None
    result = propose(
        profile, graph, min_confidence=options.min_confidence, max_opts=options.max_opts
    )
    out = _destination(ns.destination, ns.profile)
    if options.llm:
        from pytest_opprof.propose.llm import strategize

        result, note = strategize(profile, graph, result, options, workload_dir=out.parent)
        if note:
            print(cli_spelling(note))
    write_artifact(out, result)
    for p in result.proposals:
        print(f"{p.id:<28} {p.type:<24} {p.confidence:<6} ~{p.impact.estimated_saving_us:.1f} µs")
    print(f"wrote {out}")
    return 0


def _destination(target: str | None, profile: Path) -> Path:
    """Where ``propose --out`` says: a file, or ``optimizations.json`` in a folder (one that
    exists, or a path ending in ``/``); beside the profile without it."""
    if not target:
        return profile.with_name("optimizations.json")
    if Path(target).is_dir() or target.endswith(("/", os.sep)):
        return Path(target) / "optimizations.json"
    return Path(target)


def cmd_backend(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from dataclasses import replace

    out = ns.optimizations.resolve().parent.parent
    options = replace(options, out=out, from_="backend", stage="backend")
    ns.workloads = [ns.workload]
    return _run_stages(ns, options, ["backend"])


def cmd_validate(ns: argparse.Namespace, options: OpprofOptions) -> int:
    """Validate any backend file: it must sit in ``<out>/<stem>/`` beside its test file and
    import its baseline itself, as generated files do."""
    from dataclasses import replace

    from pytest_opprof.pipeline import WorkloadRun
    from pytest_opprof.schema import write_artifact
    from pytest_opprof.stages.validate import validate_file
    from pytest_opprof.workload import WorkloadSpec

    file = ns.file.resolve()
    stem = file.name.removesuffix("_optimized.py")
    run = WorkloadRun(
        spec=WorkloadSpec(path=_baseline_of(file) or file),
        name=stem,
        options=replace(options, out=file.parent.parent),
    )
    report = validate_file(run, file)
    write_artifact(run.profiler_output / "validation_report.json", report)
    for step, result in report.steps.items():
        print(f"{step:<13} {result.status:<8} {result.detail}")
    for p in report.passes:
        print(f"pass {p.name:<24} {p.status:<12} {p.detail}")
    print(report.overall + (f": {report.message}" if report.message else ""))
    return 0 if report.overall == "READY_FOR_PROFILING" else 1


def _baseline_of(generated: Path) -> Path | None:
    """The workload a generated file imports: the path in its ``import_baseline`` call."""
    import ast

    try:
        tree = ast.parse(generated.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_baseline"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            return (generated.parent / str(node.args[1].value)).resolve()
    return None


def preflight() -> int:
    """Check what the pipeline needs and print what to fix; non-zero when something is off."""
    problems = 0

    def line(ok: bool, what: str, fix: str = "") -> None:
        nonlocal problems
        problems += 0 if ok else 1
        print(f"[{'ok' if ok else 'FIX'}] {what}" + (f" — {fix}" if fix and not ok else ""))

    line(sys.version_info >= (3, 10), f"Python {sys.version.split()[0]}", "use Python ≥ 3.10")
    has_torch = importlib.util.find_spec("torch") is not None
    line(has_torch, "torch installed", "pip install torch")
    if has_torch:
        import torch

        line(True, f"torch {torch.__version__} (CUDA {torch.version.cuda})")
        cuda = torch.cuda.is_available()
        print(
            f"[{'ok' if cuda else 'note'}] CUDA device: "
            + (torch.cuda.get_device_name(0) if cuda else "none — the CPU fallback is used")
        )
    ncu = shutil.which("ncu")
    print(f"[{'ok' if ncu else 'note'}] ncu: {ncu or 'not found; no hardware counters'}")
    params = Path("/proc/driver/nvidia/params")
    if params.exists():
        restricted = "RmProfilingAdminOnly: 1" in params.read_text(errors="replace")
        root = os.geteuid() == 0
        line(
            not restricted or root,
            "GPU counters readable by this user",
            "run with --ncu-sudo=true (pytest: --opprof-ncu-sudo=true), or set the driver option "
            "NVreg_RestrictProfilingToAdminUsers=0",
        )
    if has_torch and torch.cuda.is_available():
        line(*_lock_folder_usable(), "make it writable by every user of the runner (chmod 1777)")
    return 1 if problems else 0


def _lock_folder_usable() -> tuple[bool, str]:
    """Whether this user can open GPU locks (``devicelock``): without one, processes sharing a
    GPU measure beside each other's work."""
    from pytest_opprof.devicelock import DeviceLock, lock_path

    probe = lock_path("preflight")
    try:
        DeviceLock(probe).close()
    except OSError as exc:
        return False, f"GPU lock folder {probe.parent}: {exc.strerror or exc}"
    return True, f"GPU lock folder {probe.parent} usable"


def cmd_merge(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from pytest_opprof.report import terminal_summary_lines
    from pytest_opprof.session import merge_sessions

    merged = merge_sessions(list(ns.dirs), options.out)
    print(cli_spelling("\n".join(terminal_summary_lines(merged.workloads))))
    print(f"merged {len(ns.dirs)} shard(s) into {options.out / 'report.md'}")
    return 0 if merged.gate_passed else 1


def cmd_runs(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from pytest_opprof.history import list_runs

    entries = list_runs(options.storage)
    if not entries:
        print(
            f"no stored run in {options.storage} "
            "(save one with opprof optimize --save, or pytest --opprof --opprof-save)"
        )
        return 0
    for e in entries:
        if e.run is None:
            print(f"#{e.number:<4} unreadable: {e.error}")
            continue
        r = e.run
        passed = sum(w.status == "passed" for w in r.workloads)
        print(
            f"#{r.number:<4} {r.name or '-':<16} {r.created:<25} {r.branch or '-':<16} "
            f"{(r.commit or '-')[:7]:<8}{'+' if r.dirty else ' '} {r.device}  "
            f"{passed}/{len(r.workloads)} passed  {e.path}"
        )
    return 0


def cmd_trend(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from pytest_opprof.history import list_runs
    from pytest_opprof.report.trend import trend_page
    from pytest_opprof.schema import write_text_atomic

    runs = [e.run for e in list_runs(options.storage) if e.run is not None]
    if ns.last is not None:
        runs = runs[-ns.last :]
    if not runs:
        raise OpprofError(
            f"no stored run in {options.storage}: save one with opprof optimize --save, or "
            "pytest --opprof --opprof-save"
        )
    page = options.out / "trend.md"
    write_text_atomic(page, trend_page(runs, options.out, plots=not ns.no_plots))
    for run in runs:
        figures = [
            f"{w.name} {w.variants['optimized'].median_ms:.4g} ms"
            + (f" {s.ratio:.2f}×" if (s := w.speedup(w.gate_baseline or "")) else "")
            for w in run.workloads
            if "optimized" in w.variants
        ]
        print(f"{run.label:<28} " + "; ".join(figures))
    print(f"trend of {len(runs)} run(s): {page}")
    return 0


def cmd_export(ns: argparse.Namespace, options: OpprofOptions) -> int:
    from pytest_opprof.history import load_for_cli
    from pytest_opprof.report.trend import EXPORT_FILES, benchmark_action_entries, write_json

    run = load_for_cli(ns.run, options.storage)
    entries = dict(zip(EXPORT_FILES, benchmark_action_entries(run), strict=True))
    if not any(entries.values()):
        raise OpprofError(f"run {run.label} holds no timed workload: nothing to export")
    for kind, data in entries.items():
        path = options.out / EXPORT_FILES[kind]
        write_json(path, data)
        print(f"{path} ({len(data)} {kind} entries of run {run.label})")
    return 0


COMMANDS = {
    "runs": cmd_runs,
    "trend": cmd_trend,
    "export": cmd_export,
    "merge": cmd_merge,
    "optimize": cmd_optimize,
    "capture": cmd_capture,
    "recapture": cmd_recapture,
    "report": cmd_report,
    "propose": cmd_propose,
    "backend": cmd_backend,
    "validate": cmd_validate,
}


if __name__ == "__main__":
    sys.exit(main())
