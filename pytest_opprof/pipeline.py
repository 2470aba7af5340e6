"""The six stages of one workload, as functions from artifacts on disk to artifacts on disk.

The parent process (pytest or the CLI) runs this; the stages that execute user code delegate to
the runner's child process. Each stage writes an input key beside its artifact so an unchanged
stage is read back from disk, and ``--opprof-from`` recomputes from a given stage on.
"""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from pytest_opprof import STAGES, __version__
from pytest_opprof.errors import ArtifactError, OpprofError, StageBlocked, StageError, WorkloadError
from pytest_opprof.options import OpprofOptions
from pytest_opprof.schema import (
    VALIDATION_STEPS,
    BackendSelection,
    ChildFailure,
    FxGraphSummary,
    Numerics,
    Optimizations,
    PassStatus,
    Profile,
    StepResult,
    ValidationReport,
    read_artifact,
    write_artifact,
    write_text_atomic,
)
from pytest_opprof.workload import WorkloadSpec


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "absent"


ARTIFACTS: dict[str, tuple[str, ...]] = {
    "capture": ("profile.json", "graph.json"),
    "propose": ("optimizations.json",),
    "backend": ("profiler_output/backend_selection.json",),
    "validate": ("profiler_output/validation_report.json",),
    "recapture": ("profile_optimized.json",),
    "report": ("report.md",),
}


@dataclass
class StageOutcome:
    stage: str
    status: str  # "passed" | "failed" | "error" | "skipped"
    message: str = ""
    seconds: float = 0.0
    cached: bool = False


@dataclass
class WorkloadRun:
    """The state of one workload through the stages (artifact paths and outcomes)."""

    spec: WorkloadSpec
    options: OpprofOptions
    name: str
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)

    @property
    def out_dir(self) -> Path:
        return self.options.out / self.name

    @property
    def profiler_output(self) -> Path:
        return self.out_dir / "profiler_output"

    @property
    def generated(self) -> Path:
        return self.out_dir / f"{self.spec.stem}_optimized.py"

    @property
    def generated_test(self) -> Path:
        return self.out_dir / f"test_{self.spec.stem}_optimized.py"

    def setting(self, name: str) -> Any:
        return self.spec.overrides.get(name, getattr(self.options, name, None))

    # ----------------------------------------------------------------------- artifacts

    def artifact_paths(self, stage: str) -> list[Path]:
        return [self.out_dir / rel for rel in ARTIFACTS[stage]]

    def key(self, stage: str) -> str:
        """What a stage's result depends on: the workload, the options that matter, the
        software, and the keys of the stages before it."""
        opts = self.options
        relevant = {
            "capture": (
                opts.device,
                opts.compile_backend,
                self.setting("warmup_iters"),
                self.setting("measure_iters"),
                self.setting("rounds"),
            ),
            "propose": (opts.min_confidence, opts.max_opts, self.setting("skip") or [], opts.llm),
            "backend": (self.setting("rtol") if "rtol" in self.spec.overrides else None,),
        }.get(stage, ())
        index = STAGES.index(stage)
        previous = self.key(STAGES[index - 1]) if index else ""
        blob = json.dumps(
            [
                stage,
                previous,
                self.spec.sha256(),
                __version__,
                _torch_version(),
                os.environ.get("CUDA_VISIBLE_DEVICES"),
                list(relevant),
            ],
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _key_file(self, stage: str) -> Path:
        return self.profiler_output / f".{stage}.key"

    def cached(self, stage: str) -> bool:
        """Reuse a stage only when its artifacts exist and its key matches."""
        if stage == "report":
            return False
        kf = self._key_file(stage)
        if not kf.exists() or not all(p.exists() for p in self.artifact_paths(stage)):
            return False
        return kf.read_text().strip() == self.key(stage)

    def mark_done(self, stage: str) -> None:
        write_text_atomic(self._key_file(stage), self.key(stage) + "\n")

    def invalidate_from(self, stage: str) -> None:
        for later in STAGES[STAGES.index(stage) :]:
            self._key_file(later).unlink(missing_ok=True)

    # ---------------------------------------------------------------------- child runs

    def run_child(self, task: str, stage: str, **extra: Any) -> None:
        """Run one runner task in a child process, with the stage timeout."""
        self.profiler_output.mkdir(parents=True, exist_ok=True)
        spec = {
            "task": task,
            "workload": str(self.spec.path.resolve()),
            "out_dir": str(self.out_dir.resolve()),
            "options": self.options.to_child(),
            "overrides": self.spec.overrides,
            **extra,
        }
        with tempfile.TemporaryDirectory(prefix="opprof-") as tmp:
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec, default=str), encoding="utf-8")
            log = self.profiler_output / f"{task}.log"
            timeout = float(self.setting("timeout"))
            with log.open("w", encoding="utf-8") as fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pytest_opprof.runner", str(spec_path)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )
                try:
                    code = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    raise StageError(
                        f"{self.spec.path.name}: {stage} did not finish within {timeout:.0f} s "
                        f"and was stopped; the workload hangs or is too slow — raise "
                        f"--opprof-timeout or OPPROF['timeout'] (log: {_rel(log)})"
                    ) from None
            failure = spec_path.with_name("failure.json")
            if failure.exists():
                found = read_artifact(failure, ChildFailure)
                cls = WorkloadError if found.kind == "WorkloadError" else StageError
                raise cls(found.message)
        if code < 0:
            name = (
                signal.Signals(-code).name
                if -code in signal.Signals._value2member_map_
                else str(-code)
            )
            raise StageError(
                f"{self.spec.path.name}: the {stage} process was killed by {name}; the "
                f"workload (or a library it calls) crashed — see {_rel(log)}"
            )
        if code != 0:
            tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:])
            raise StageError(
                f"{self.spec.path.name}: the {stage} process failed (exit {code}); this is "
                f"likely a bug in pytest-opprof or torch. Last lines of {_rel(log)}:\n{tail}"
            )


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------- stages


def stage_capture(run: WorkloadRun) -> str:
    run.run_child("capture", "capture")
    profile = read_artifact(run.out_dir / "profile.json", Profile)
    t = profile.timing
    eager, comp = t.variants["eager"], t.variants["compile"]
    return (
        f"eager {eager.median_ms:.4f} ms, torch.compile {comp.median_ms:.4f} ms on "
        f"{profile.capture_metadata.device_name}"
    )


def stage_propose(run: WorkloadRun) -> str:
    from pytest_opprof.propose import propose

    profile = read_artifact(run.out_dir / "profile.json", Profile)
    graph_path = run.out_dir / "graph.json"
    graph = read_artifact(graph_path, FxGraphSummary) if graph_path.exists() else None
    result = propose(
        profile,
        graph,
        min_confidence=run.options.min_confidence,
        max_opts=run.options.max_opts,
        skip=run.setting("skip") or (),
    )
    note = ""
    if run.options.llm:
        from pytest_opprof.propose.llm import strategize

        result, note = strategize(profile, graph, result, run.options)
    write_artifact(run.out_dir / "optimizations.json", result)
    summary = f"{len(result.proposals)} proposals: " + ", ".join(p.type for p in result.proposals)
    return summary + (f" ({note})" if note else "")


def stage_backend(run: WorkloadRun) -> str:
    from pytest_opprof.backend.codegen import render_notes, render_optimized, render_test
    from pytest_opprof.tolerances import tolerance_for

    optimizations = read_artifact(run.out_dir / "optimizations.json", Optimizations)
    run.run_child("select", "backend")
    sel_path = run.profiler_output / "backend_selection.json"
    selection = read_artifact(sel_path, BackendSelection)
    rtol, atol = tolerance_for(selection.plan.dtype, run.spec.overrides)
    write_text_atomic(
        run.generated,
        render_optimized(
            stem=run.spec.stem,
            workload=run.spec.path,
            out_file=run.generated,
            selection=selection,
            proposals=optimizations.proposals,
            rtol=rtol,
            atol=atol,
        ),
    )
    write_text_atomic(run.generated_test, render_test(stem=run.spec.stem))
    write_text_atomic(
        run.profiler_output / "implementation_notes.md",
        render_notes(selection, optimizations.proposals),
    )
    kept = ", ".join(selection.plan.proposals) or "none (the baseline is kept)"
    return f"kept {kept}; dropped {len(selection.dropped)}"


def validate_file(run: WorkloadRun, generated: Path) -> ValidationReport:
    """The six steps of DESIGN §2.4, in order; the first failure blocks the rest."""
    steps: dict[str, StepResult] = {}
    extra: dict[str, Any] = {}
    dtype = None
    sel_path = run.profiler_output / "backend_selection.json"
    if sel_path.exists():
        dtype = read_artifact(sel_path, BackendSelection).plan.dtype

    def blocked_after(failed: str) -> None:
        for name in VALIDATION_STEPS:
            steps.setdefault(name, StepResult(status="skipped", detail=f"blocked by {failed}"))

    try:
        with tempfile.TemporaryDirectory() as tmp:
            py_compile.compile(str(generated), doraise=True, cfile=str(Path(tmp) / "x.pyc"))
        steps["syntax"] = StepResult(status="pass", detail="py_compile accepted the file")
    except py_compile.PyCompileError as exc:
        steps["syntax"] = StepResult(status="fail", detail=str(exc.msg).strip())
    except FileNotFoundError:
        steps["syntax"] = StepResult(
            status="fail", detail=f"{generated} does not exist; re-run the backend stage"
        )
    if steps["syntax"].status == "pass":
        for task in ("validate_import", "tests", "validate_run"):
            if task == "tests":
                steps["tests"] = _run_generated_tests(run, generated)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    result = Path(tmp) / "result.json"
                    run.run_child(
                        task,
                        "validate",
                        generated=str(generated.resolve()),
                        result=str(result),
                        dtype=dtype,
                    )
                    data = json.loads(result.read_text())
                steps.update({k: StepResult(**v) for k, v in data["steps"].items()})
                extra.update({k: v for k, v in data.items() if k != "steps"})
            if any(s.status == "fail" for s in steps.values()):
                break
    failed = next((n for n in VALIDATION_STEPS if n in steps and steps[n].status == "fail"), None)
    blocked_after(failed or "nothing")
    ordered = {n: steps[n] for n in VALIDATION_STEPS}
    message = ""
    if failed:
        number = VALIDATION_STEPS.index(failed) + 1
        message = f"BLOCKED — fix step {number} ({failed}): {steps[failed].detail}"
    return ValidationReport(
        file=generated.name,
        backend=f"opprof_{run.spec.stem}",
        steps=ordered,
        passes=[PassStatus(**p) for p in extra.get("passes", [])],
        numerics=Numerics(**extra["numerics"]) if "numerics" in extra else None,
        checks={k: StepResult(**v) for k, v in extra.get("checks", {}).items()},
        overall="BLOCKED" if failed else "READY_FOR_PROFILING",
        message=message,
    )


def _run_generated_tests(run: WorkloadRun, generated: Path) -> StepResult:
    test_file = generated.resolve().with_name(f"test_{generated.name}")
    if not test_file.exists():
        return StepResult(status="fail", detail=f"{test_file.name} is missing; re-run backend")
    log = run.profiler_output / "generated_tests.log"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(test_file),
        "-q",
        "-rf",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:opprof",
        "--rootdir",
        str(test_file.parent),
        "-c",
        os.devnull,
    ]
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=run.setting("timeout"),
            cwd=test_file.parent,
            check=False,
            env={**os.environ, "COLUMNS": "400"},  # untruncated short summary lines
        )
    except subprocess.TimeoutExpired:
        return StepResult(status="fail", detail="the generated tests timed out")
    write_text_atomic(log, out.stdout + out.stderr)
    lines = out.stdout.strip().splitlines() or ["no output"]
    if out.returncode == 0:
        return StepResult(status="pass", detail=lines[-1])
    # Name the failing checks: pytest's short summary ("FAILED file::test[seed] - reason").
    failed = [line.split("::", 1)[-1] for line in lines if line.startswith("FAILED ")]
    shown = "; ".join(failed[:3]) + (f"; … {len(failed) - 3} more" if len(failed) > 3 else "")
    return StepResult(
        status="fail", detail=f"{test_file.name}: {lines[-1]}: {shown} (see {_rel(log)})"
    )


def stage_validate(run: WorkloadRun) -> str:
    report = validate_file(run, run.generated)
    write_artifact(run.profiler_output / "validation_report.json", report)
    if report.overall == "BLOCKED":
        raise StageError(f"{run.generated.name}: {report.message}")
    n = report.numerics
    return "READY_FOR_PROFILING" + (f" (relative error {n.rel_err:.2e})" if n else "")


def stage_recapture(run: WorkloadRun) -> str:
    report = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
    if report.overall != "READY_FOR_PROFILING":
        raise StageBlocked(f"blocked by validate: {report.message}")
    run.run_child("recapture", "recapture", generated=str(run.generated.resolve()))
    prof = read_artifact(run.out_dir / "profile_optimized.json", Profile)
    return f"optimized {prof.timing.variants['optimized'].median_ms:.4f} ms"


STAGE_FUNCTIONS: dict[str, Callable[[WorkloadRun], str]] = {
    "capture": stage_capture,
    "propose": stage_propose,
    "backend": stage_backend,
    "validate": stage_validate,
    "recapture": stage_recapture,
}


def run_stage(run: WorkloadRun, stage: str) -> StageOutcome:
    """Run (or reuse) one stage; the outcome carries the user-facing message."""
    index = STAGES.index(stage)
    for earlier in STAGES[:index]:
        prior = run.outcomes.get(earlier)
        if prior is not None and prior.status != "passed":
            if run.options.stage == stage and prior.status != "skipped":
                # The one stage asked for cannot run: say why as its own failure.
                outcome = StageOutcome(stage, "error", f"needs {earlier}: {prior.message}")
            else:
                outcome = StageOutcome(stage, "skipped", f"blocked by {earlier}")
            run.outcomes[stage] = outcome
            return outcome
    if run.spec.override_error:
        outcome = StageOutcome(stage, "error", run.spec.override_error)
        run.outcomes[stage] = outcome
        return outcome
    start = time.perf_counter()
    opts = run.options
    forced = opts.from_ is not None and index >= STAGES.index(opts.from_)
    reuse_only = (opts.from_ is not None and index < STAGES.index(opts.from_)) or (
        opts.stage is not None and stage != opts.stage
    )
    try:
        if reuse_only:
            for path in run.artifact_paths(stage):
                if not path.exists():
                    raise ArtifactError(
                        f"{path}: not found, but --opprof-from/--opprof-stage reuses it; run "
                        f"the {stage} stage first (drop --opprof-from)"
                    )
            _check_artifacts(run, stage)
            outcome = StageOutcome(stage, "passed", "reused from disk", cached=True)
        elif not forced and run.cached(stage):
            _check_artifacts(run, stage)
            outcome = StageOutcome(stage, "passed", "unchanged inputs: read from disk", cached=True)
        else:
            run.invalidate_from(stage)
            message = STAGE_FUNCTIONS[stage](run)
            run.mark_done(stage)
            outcome = StageOutcome(stage, "passed", message)
    except StageBlocked as exc:
        outcome = StageOutcome(stage, "skipped", str(exc))
    except WorkloadError as exc:
        outcome = StageOutcome(stage, "error", str(exc))
    except OpprofError as exc:
        outcome = StageOutcome(stage, "failed", str(exc))
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        outcome = StageOutcome(
            stage,
            "error",
            f"{where}{exc.strerror or exc}; check that "
            f"--opprof-out ({run.options.out}) is writable",
        )
    outcome.seconds = time.perf_counter() - start
    run.outcomes[stage] = outcome
    return outcome


def _check_artifacts(run: WorkloadRun, stage: str) -> None:
    models: dict[str, Any] = {
        "profile.json": Profile,
        "graph.json": FxGraphSummary,
        "optimizations.json": Optimizations,
        "backend_selection.json": BackendSelection,
        "validation_report.json": ValidationReport,
        "profile_optimized.json": Profile,
    }
    for path in run.artifact_paths(stage):
        model = models.get(path.name)
        if model is not None:
            read_artifact(path, model)
    if stage == "backend" and not run.generated.exists():
        raise ArtifactError(
            f"{run.generated}: the generated backend is missing; re-run with --opprof-from=backend"
        )
    if stage == "validate":
        report = read_artifact(run.profiler_output / "validation_report.json", ValidationReport)
        if report.overall != "READY_FOR_PROFILING":
            raise StageError(f"{run.generated.name}: {report.message}")
