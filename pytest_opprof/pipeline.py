"""The six stages of one workload, as functions from artifacts on disk to artifacts on disk.

The parent process (pytest or the CLI) runs this; the stages that execute user code delegate to
the runner's child process. Each stage writes an input key beside its artifact so an unchanged
stage is read back from disk, and ``--opprof-from`` recomputes from a given stage on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import py_compile
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import STAGES, __version__, devicelock, forkserver
from pytest_opprof.backend.plan import EXTRA_PASSES_ENV, PassRegistry, extra_targets
from pytest_opprof.devicelock import LOCK_ENV, WAITING
from pytest_opprof.errors import ArtifactError, OpprofError, StageBlocked, StageError, WorkloadError
from pytest_opprof.measure import Replica, pooled_timing
from pytest_opprof.options import BY_FIELD, OpprofOptions
from pytest_opprof.schema import (
    VALIDATION_STEPS,
    BackendSelection,
    CaptureMetadata,
    ChildFailure,
    FxGraphSummary,
    Numerics,
    Optimizations,
    PassStatus,
    Profile,
    Proposal,
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


TIMING_KEYS: tuple[str, ...] = ("warmup_iters", "measure_iters", "rounds")


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes, or "" where it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def source_digest(root: Path) -> str:
    """A hash of the Python files under ``root``, their paths and their bytes."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """This package's own source: part of every stage's cache key, so that a changed pass,
    rule or check recomputes what it produced (the version alone does not move between
    releases)."""
    return source_digest(Path(__file__).parent)


@functools.lru_cache(maxsize=1)
def default_hooks() -> Any:
    """The hooks with only the plugin's own implementations: what runs where no pytest session
    is (the ``opprof`` command), so that both go through the same code."""
    import pluggy

    from pytest_opprof import hookspecs, plugin

    manager = pluggy.PluginManager("pytest")
    manager.add_hookspecs(hookspecs)
    manager.register(plugin, "opprof")
    return manager.hook


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
    hook: Any = field(default=None, repr=False)
    """The ``pytest_opprof_*`` hooks that apply to this workload (pytest's hook proxy for its
    path, so conftests apply by folder); ``None``: the plugin's own implementations only."""
    _decided: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def hooks(self) -> Any:
        if self.hook is None:
            self.hook = default_hooks()
        return self.hook

    @property
    def path(self) -> Path:
        return self.spec.path

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.spec.overrides)

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
        """The value of option ``name`` for this workload: the hooks' choice for the timing
        settings and the threshold, else the workload's ``OPPROF`` entry, else the option."""
        if name in TIMING_KEYS:
            return self.timing_settings()[name]
        if name == "min_speedup":
            return self.min_speedup()
        return self.base_setting(name)

    def base_setting(self, name: str) -> Any:
        return self.spec.overrides.get(name, getattr(self.options, name, None))

    # --------------------------------------------------------------------------- hooks

    def timing_settings(self) -> dict[str, int]:
        """``pytest_opprof_timing_settings``, asked once per run, checked like the options."""
        if "timing" not in self._decided:
            base = {k: int(self.base_setting(k)) for k in TIMING_KEYS}
            chosen = self.hooks.pytest_opprof_timing_settings(workload=self, settings=dict(base))
            checked = _checked("pytest_opprof_timing_settings", chosen or {}, TIMING_KEYS)
            self._decided["timing"] = {**base, **checked}
        return dict(self._decided["timing"])

    def min_speedup(self) -> float:
        """``pytest_opprof_min_speedup``, asked once per run."""
        if "min_speedup" not in self._decided:
            base = float(self.base_setting("min_speedup"))
            chosen = self.hooks.pytest_opprof_min_speedup(workload=self, min_speedup=base)
            if chosen is not None:
                chosen = _checked(
                    "pytest_opprof_min_speedup", {"min_speedup": chosen}, ("min_speedup",)
                )["min_speedup"]
            self._decided["min_speedup"] = base if chosen is None else chosen
        return float(self._decided["min_speedup"])

    def extra_passes(self) -> PassRegistry:
        """The user passes of this workload (``pytest_opprof_register_passes``)."""
        if "passes" not in self._decided:
            fresh = PassRegistry()
            try:
                self.hooks.pytest_opprof_register_passes(registry=fresh)
            except ValueError as exc:
                raise StageError(f"pytest_opprof_register_passes: {exc}") from None
            self._decided["passes"] = fresh
        registry: PassRegistry = self._decided["passes"]
        return registry

    def _hook_identity(self, name: str) -> list[str]:
        """Who implements hook ``name`` here, and a hash of their source: part of the cache
        key of the stage the hook feeds, so a new or edited rule recomputes it."""
        found = []
        for impl in getattr(self.hooks, name).get_hookimpls():
            fn = impl.function
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                source = ""
            digest = hashlib.sha256(source.encode()).hexdigest()[:16]
            found.append(f"{fn.__module__}:{fn.__qualname__}:{digest}")
        return sorted(found)

    def _passes_identity(self) -> list[str]:
        found = []
        for p in self.extra_passes().values():
            file = p.source_file()
            digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16] if file else ""
            found.append(f"{p.name}={p.target}@{p.level}:{digest}")
        return found

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
            "propose": (
                opts.min_confidence,
                opts.max_opts,
                self.setting("skip") or [],
                opts.llm,
                self._hook_identity("pytest_opprof_propose"),
                self._passes_identity(),
            ),
            "backend": (
                self.setting("rtol") if "rtol" in self.spec.overrides else None,
                self._passes_identity(),
            ),
            # the file under test as it is now: an edited one is validated again
            "validate": (file_sha256(self.generated),),
            "recapture": (
                self.setting("timing_processes"),
                bool(opts.fresh_timing),
                int(opts.timing_servers),
            ),
        }.get(stage, ())
        index = STAGES.index(stage)
        previous = self.key(STAGES[index - 1]) if index else ""
        blob = json.dumps(
            [
                stage,
                previous,
                self.spec.sha256(),
                __version__,
                package_digest(),
                _torch_version(),
                _device_identity(),
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

    def run_child(
        self,
        task: str,
        stage: str,
        *,
        log_name: str = "",
        fresh: bool = False,
        server: int = 0,
        **extra: Any,
    ) -> None:
        """Run one runner task in a child process, with the stage timeout; its output goes to
        ``profiler_output/<log_name or task>.log``. ``fresh``: a new interpreter, never one
        forked from the session's fork servers; else forked from server ``server``
        (:func:`_start_child`)."""
        self.profiler_output.mkdir(parents=True, exist_ok=True)
        user_passes = self.extra_passes().values()
        spec = {
            "task": task,
            "workload": str(self.spec.path.resolve()),
            "out_dir": str(self.out_dir.resolve()),
            "options": self.options.to_child(),
            "overrides": {**self.spec.overrides, **self.timing_settings()},
            # a record of the user passes; the child loads them from the environment below
            "extra_passes": {p.name: {**p.child_entry(), "path": str(p.path)} for p in user_passes},
            **extra,
        }
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if user_passes:
            folders = list(dict.fromkeys(str(p.path) for p in user_passes if p.path))
            env["PYTHONPATH"] = os.pathsep.join(
                [*folders, *filter(None, [os.environ.get("PYTHONPATH")])]
            )
            env[EXTRA_PASSES_ENV] = json.dumps({p.name: p.child_entry() for p in user_passes})
        with tempfile.TemporaryDirectory(prefix="opprof-") as tmp:
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec, default=str), encoding="utf-8")
            log = self.profiler_output / f"{log_name or task}.log"
            timeout = float(self.setting("timeout"))
            try:
                code = _start_child(spec_path, log, env, timeout, fresh=fresh, server=server)
            except subprocess.TimeoutExpired:
                why = (
                    "it was waiting for its GPU, which other processes shared — run fewer "
                    "pytest-xdist workers per GPU or raise --opprof-timeout"
                    if _last_phase(log) == WAITING
                    else "the workload hangs or is too slow — raise --opprof-timeout or "
                    "OPPROF['timeout']"
                )
                raise StageError(
                    f"{self.spec.path.name}: {stage} did not finish within {timeout:.0f} s "
                    f"and was stopped; {why} (log: {_rel(log)})"
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


def _last_phase(log: Path) -> str | None:
    """The last ``[opprof] +  N s  what`` line of a stage log: what its process was doing."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    marks = [line.split(" s  ", 1)[-1] for line in lines if line.startswith("[opprof] +")]
    return marks[-1] if marks else None


def _device_identity() -> str | None:
    """The GPU a stage ran on, for its cache key: its model where nvidia-smi names it (so a
    resumed xdist run reuses a stage another worker's identical GPU computed), else the
    ``CUDA_VISIBLE_DEVICES`` value itself."""
    from pytest_opprof.gpus import gpu_kind

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return gpu_kind(visible) or visible


def _checked(hook: str, values: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """A hook's settings, parsed like the options of the same name."""
    if not isinstance(values, dict):
        raise StageError(f"{hook} returned {values!r}, not a dict of {', '.join(keys)}")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in keys:
            raise StageError(f"{hook}: unknown key {key!r}; accepted keys: {', '.join(keys)}")
        try:
            out[key] = BY_FIELD[key].parse(str(value))
        except pytest.UsageError as exc:
            raise StageError(f"{hook}: {exc}") from None
    return out


def _start_child(
    spec_path: Path,
    log: Path,
    env: dict[str, str],
    timeout: float,
    *,
    fresh: bool = False,
    server: int = 0,
) -> int:
    """Run ``python -m pytest_opprof.runner SPEC`` as a process of its own, output in ``log``:
    forked from this session's fork server ``server`` (torch already imported) where it runs
    and the child need not be ``fresh``, else started plainly. Its exit status;
    ``subprocess.TimeoutExpired`` once it has been killed."""
    forks = None if fresh else forkserver.get(server)
    if forks is not None:
        try:
            return forks.run(spec_path, log, env, timeout)
        except OSError as exc:  # the server is gone or refused: a plain child does the stage
            print(f"pytest-opprof: fork server: {exc}; starting the stage plainly", file=sys.stderr)
    with log.open("w", encoding="utf-8") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_opprof.runner", str(spec_path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        try:
            return proc.wait(timeout=timeout)
        except BaseException:
            # A timeout, or the session itself interrupted (Ctrl-C): the child runs in its own
            # process group and must not outlive us to write artifacts later.
            forkserver.kill_group(proc.pid)
            proc.wait()
            raise


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
    found = run.hooks.pytest_opprof_propose(profile=profile, graph=graph, optimizations=result)
    result = merge_hook_proposals(run, result, [p for batch in found for p in batch or ()])
    write_artifact(run.out_dir / "optimizations.json", result)
    summary = f"{len(result.proposals)} proposals: " + ", ".join(p.type for p in result.proposals)
    return summary + (f" ({note})" if note else "")


def merge_hook_proposals(
    run: WorkloadRun, result: Optimizations, found: list[Any]
) -> Optimizations:
    """Add what ``pytest_opprof_propose`` returned: marked ``source="hook"``, renumbered where
    an id is taken, routed at its pass's level, filtered as the rules' proposals are, and the
    whole set put back in dependency order."""
    from pydantic import ValidationError

    from pytest_opprof.options import TRANSFORMATION_TYPES
    from pytest_opprof.propose import CONFIDENCE_RANK, order

    if not found:
        return result
    user_passes = run.extra_passes()
    skip = set(run.setting("skip") or ())
    floor = CONFIDENCE_RANK[run.options.min_confidence]
    taken = {p.id for p in result.proposals}
    proposals, notes = list(result.proposals), list(result.global_notes)
    for item in found:
        try:
            p = item if isinstance(item, Proposal) else Proposal.model_validate(item)
        except ValidationError as exc:
            raise StageError(
                f"pytest_opprof_propose returned a proposal that does not validate: "
                f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
            ) from None
        p = p.model_copy(update={"source": "hook"}, deep=True)
        if p.type in user_passes:
            p.ir_level = user_passes[p.type].level  # type: ignore[assignment]
        elif p.type not in TRANSFORMATION_TYPES:
            notes.append(
                f"hook proposal {p.id} dropped: type {p.type!r} is not a pass; register it "
                "with pytest_opprof_register_passes"
            )
            continue
        if p.type in skip or CONFIDENCE_RANK[p.confidence] < floor:
            why = (
                "OPPROF['skip']"
                if p.type in skip
                else f"min_confidence={run.options.min_confidence}"
            )
            notes.append(f"{why}: dropped hook proposal {p.id}")
            continue
        if p.id in taken:
            n = 1
            while f"{p.type}-hook-{n}" in taken:
                n += 1
            p.id = f"{p.type}-hook-{n}"
        taken.add(p.id)
        proposals.append(p)
    return result.model_copy(update={"proposals": order(proposals, notes), "global_notes": notes})


def stage_backend(run: WorkloadRun) -> str:
    from pytest_opprof.backend.codegen import render_notes, render_optimized, render_test
    from pytest_opprof.tolerances import tolerance_for

    optimizations = read_artifact(run.out_dir / "optimizations.json", Optimizations)
    run.run_child("select", "backend")
    sel_path = run.profiler_output / "backend_selection.json"
    selection = read_artifact(sel_path, BackendSelection)
    user_passes = run.extra_passes()
    used = extra_targets(selection.plan, user_passes)
    if used:  # the plan names where its user passes come from (the child only routed them)
        selection.plan.extra_passes = used
        write_artifact(sel_path, selection)
    rtol, atol = tolerance_for(selection.numerics_dtype or selection.plan.dtype, run.spec.overrides)
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
            extra_passes=[user_passes[name] for name in used],
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
    """The six steps of DESIGN §2.4, in order; the first failure blocks the rest. Steps 2 to
    5 run in a child that imports the file and saves its outputs; step 6 judges them in
    another child that never imports it (``runner.task_validate_numerics``)."""
    steps: dict[str, StepResult] = {}
    extra: dict[str, Any] = {}
    digest = file_sha256(generated)
    dtype = None
    sel_path = run.profiler_output / "backend_selection.json"
    if sel_path.exists():
        selection = read_artifact(sel_path, BackendSelection)
        # the dtype whose tolerance selection held the plan to (TF32 for an fp32 plan on TF32
        # tensor cores), as the generated file's own tests are
        dtype = selection.numerics_dtype or selection.plan.dtype

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
        with tempfile.TemporaryDirectory() as tmp:
            result, outputs = Path(tmp) / "result.json", Path(tmp) / "outputs.pt"
            run.run_child(
                "validate",
                "validate",
                generated=str(generated.resolve()),
                result=str(result),
                outputs=str(outputs),
                tests_log=str((run.profiler_output / "generated_tests.log").resolve()),
                dtype=dtype,
            )
            data = json.loads(result.read_text())
            steps.update({k: StepResult(**v) for k, v in data["steps"].items()})
            extra.update({k: v for k, v in data.items() if k != "steps"})
            if outputs.exists():
                # judged where the file under test was never imported
                run.run_child(
                    "validate_numerics",
                    "validate",
                    result=str(result),
                    outputs=str(outputs),
                    dtype=dtype,
                )
                data = json.loads(result.read_text())
                steps.update({k: StepResult(**v) for k, v in data["steps"].items()})
                extra.update({k: v for k, v in data.items() if k != "steps"})
    llm_passes = _validate_llm_passes(run, dtype) if steps["syntax"].status == "pass" else []
    if digest and file_sha256(generated) != digest:
        steps["syntax"] = StepResult(
            status="fail", detail=f"{generated.name} changed while it was validated; run again"
        )
    failed = next((n for n in VALIDATION_STEPS if n in steps and steps[n].status == "fail"), None)
    blocked_after(failed or "nothing")
    ordered = {n: steps[n] for n in VALIDATION_STEPS}
    message = ""
    if failed:
        number = VALIDATION_STEPS.index(failed) + 1
        message = f"BLOCKED — fix step {number} ({failed}): {steps[failed].detail}"
    return ValidationReport(
        file=generated.name,
        sha256=digest,
        backend=f"opprof_{run.spec.stem}",
        steps=ordered,
        passes=[PassStatus(**p) for p in extra.get("passes", [])],
        numerics=Numerics(**extra["numerics"]) if "numerics" in extra else None,
        checks={k: StepResult(**v) for k, v in extra.get("checks", {}).items()},
        overall="BLOCKED" if failed else "READY_FOR_PROFILING",
        message=message,
        llm_passes=llm_passes,
    )


def _validate_llm_passes(run: WorkloadRun, dtype: str | None) -> list[PassStatus]:
    """Stage 3 for LLM-written pass code (``optimizations.json`` proposals with a
    ``pass_file``): each runs in a child process on the baseline's Dynamo graph and is checked
    against eager like the backend. It never enters the backend; the report says what it did."""
    opt_path = run.out_dir / "optimizations.json"
    if not opt_path.exists():
        return []
    proposals = read_artifact(opt_path, Optimizations).proposals
    files = [
        {"id": p.id, "file": str((run.out_dir / str(p.params["pass_file"])).resolve())}
        for p in proposals
        if p.params.get("pass_file") and p.params.get("implemented") is False
    ]
    if not files:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            run.run_child(
                "validate_llm_passes", "validate", passes=files, result=str(result), dtype=dtype
            )
            data = json.loads(result.read_text())
        except (OpprofError, OSError, ValueError) as exc:
            detail = f"the check itself did not finish: {str(exc).splitlines()[0][:300]}"
            return [PassStatus(name=f["id"], status="FAILED", detail=detail) for f in files]
    return [PassStatus(**p) for p in data["llm_passes"]]


def warm_timing_servers(run: WorkloadRun) -> None:
    """Where ``--opprof-timing-servers`` spreads the recapture's timing processes over several
    fork servers (``_retime_one``), start those past the first in the background at the
    workload's first stage, so that their torch import is over long before the recapture.
    Each import holds the host's CPU work (``devicelock.host_work``): a quiet measurement
    waits until it ends. Nothing where the timing processes are new interpreters or one. The
    device is the capture's, or before it a GPU wherever the session named a GPU lock."""
    servers = timing_servers(run)
    if run.setting("fresh_timing") or servers <= 1:
        return
    device_type = "cuda" if os.environ.get(LOCK_ENV) else "cpu"
    profile = run.out_dir / "profile.json"
    if profile.exists():
        with contextlib.suppress(OpprofError):  # the stages say what is wrong with it
            device_type = read_artifact(profile, Profile).capture_metadata.device_type
    processes = timing_processes(run, device_type)
    slots = {forkserver.slot_of(i, servers) for i in range(1, processes)} - {0}
    if slots:
        forkserver.warm(sorted(slots), devicelock.host_work)


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
    digest = validated_digest(run, report)
    baseline = read_artifact(run.out_dir / "profile.json", Profile).capture_metadata
    processes = timing_processes(run, baseline.device_type)
    together = processes > 1 and side_by_side(baseline, processes)
    fresh = bool(run.setting("fresh_timing"))
    generated = str(run.generated.resolve())
    with tempfile.TemporaryDirectory(prefix="opprof-retime-") as tmp:
        if together:
            # Each process compiles while the others do; they measure one at a time, none
            # beside another's compile (the siblings' lock: devicelock).
            siblings = Path(tmp) / "siblings.lock"
            pool = ThreadPoolExecutor(processes - 1)
            pending = [
                pool.submit(_retime_one, run, i, Path(tmp), siblings=siblings, fresh=fresh)
                for i in range(1, processes)
            ]
            try:
                run.run_child(
                    "recapture",
                    "recapture",
                    generated=generated,
                    sha256=digest,
                    shares_cpus=True,
                    siblings_lock=str(siblings),
                )
            except BaseException as exc:
                # A failed recapture waits for its timing processes (none outlives its stage
                # or its folder); an interrupt does not (the session's end stops them).
                pool.shutdown(wait=not isinstance(exc, KeyboardInterrupt), cancel_futures=True)
                raise
            replicas = [f.result() for f in pending]
            pool.shutdown()
        else:
            run.run_child("recapture", "recapture", generated=generated, sha256=digest)
            replicas = [_retime_one(run, i, Path(tmp), fresh=fresh) for i in range(1, processes)]
    path = run.out_dir / "profile_optimized.json"
    prof = read_artifact(path, Profile)
    if processes > 1:
        warnings = list(prof.warnings)
        warnings += [
            f"timing process {i + 1} of {processes} failed: {r}"
            for i, r in enumerate(replicas, start=1)
            if isinstance(r, str)
        ]
        timing = pooled_timing(prof.timing, [r for r in replicas if not isinstance(r, str)])
        prof = prof.model_copy(update={"timing": timing, "warnings": warnings})
        write_artifact(path, prof)
    opt = prof.timing.variants["optimized"]
    if opt.processes == 1:
        return f"optimized {opt.median_ms:.4f} ms"
    how = "side by side" if together else "one after another"
    return f"optimized {opt.median_ms:.4f} ms ({opt.processes} processes, {how})"


def validated_digest(run: WorkloadRun, report: ValidationReport) -> str:
    """The sha256 of the generated file, which must be the one ``report`` validated: the
    recapture never times a file that was edited after its validation."""
    digest = file_sha256(run.generated)
    if not report.sha256 or digest != report.sha256:
        raise StageError(
            f"{run.generated.name} is not the file validate checked (its sha256 differs from "
            "validation_report.json's): validate it again — `opprof validate "
            f"{_rel(run.generated)}`, or run without --opprof-from/--opprof-stage"
        )
    return digest


TIMING_PROCESSES_GPU = 3
"""Timing processes on a GPU when the option says auto: on the lent H200 host the same eager
call ran at 0.28 ms in some fresh processes and 0.36-0.54 ms in others, steady within each
(benchmarks/affinity_probe.py), so one process's interval does not cover the next run."""


def timing_processes(run: WorkloadRun, device_type: str) -> int:
    chosen = run.setting("timing_processes")
    if chosen is None:
        return TIMING_PROCESSES_GPU if device_type == "cuda" else 1
    return int(chosen)


def timing_servers(run: WorkloadRun) -> int:
    """The fork servers the timing processes are spread over (``--opprof-timing-servers``)."""
    return int(run.setting("timing_servers") or 1)


SIDE_BY_SIDE_MEMORY = 0.8
"""The share of the GPU's memory a workload's timing processes may plan on together, each
counted at twice the capture's peak (it holds the optimized plan besides both baselines)."""


def side_by_side(baseline: CaptureMetadata, processes: int) -> bool:
    """Whether the recapture's timing processes start together: only under a GPU lock, which
    keeps their measurements apart (``devicelock``), and where the capture's peak memory says
    they all fit."""
    if not os.environ.get(LOCK_ENV):
        return False
    peak, total = baseline.peak_memory_bytes, baseline.device_memory_bytes
    return bool(peak and total and 2 * peak * processes <= SIDE_BY_SIDE_MEMORY * total)


def _retime_one(
    run: WorkloadRun,
    i: int,
    folder: Path,
    *,
    siblings: Path | None = None,
    fresh: bool = False,
) -> Replica | str:
    """The recapture's calls timed again in another process: its samples, or why it failed (a
    process that fails adds a warning, not an error: the others' timing stands).

    Forked processes come from the session's fork server, or with ``--opprof-timing-servers
    N`` from server ``i % N`` (``forkserver.slot_of``; the recapture from server 0, which
    every stage shares). Processes forked from one server share what it fixed at its start
    (its address layout, hash seed, the memory its imports were loaded into), and on the H200
    host a launch-bound call's speed went with the server: conv_block's torch.compile call,
    three children forked from each of four servers (benchmarks/layout_probe.py,
    benchmarks/results/h200-2026-12-02d/probes), took 0.2396, 0.2407 and 0.2412 ms from one
    and 0.2535-0.2576 from another; the servers' means spread 2.9% where their children's
    spread alone predicts 1.6%. Servers started with one layout and seed (``setarch -R``,
    ``PYTHONHASHSEED=0``) still differed by 3%. Processes of one server repeat its offset,
    which their interval cannot show; processes of several draw one each, so their spread
    and the interval include it. Not the default: in the pipeline that offset was lost in
    larger noise. With three servers (benchmarks/results/h200-2026-12-02e) the launch-bound
    baselines' ratios spread over a workload's processes by a median 2.8% (sd / mean, 16
    timings), against 3.3% with one server (151 timings, h200-2026-12-01 to -02d); the same
    backends timed again a minute later still moved by 8-12%, with the host, and the captures
    took 5-20 s longer beside the servers' imports.

    ``fresh`` (``--opprof-fresh-timing``): a new interpreter instead, a draw of its own, at a
    torch import on the stage's own time: with them the seven examples at ``-n 7`` took
    309 s and over 265 s on the H200 host against 203 s forked (h200-2026-12-02d)."""
    result = folder / f"retime{i}.json"
    try:
        run.run_child(
            "retime",
            "recapture",
            log_name=f"retime{i}",
            fresh=fresh,
            server=forkserver.slot_of(i, timing_servers(run)),
            generated=str(run.generated.resolve()),
            sha256=file_sha256(run.generated),
            result=result,
            shares_cpus=siblings is not None,
            siblings_lock=str(siblings) if siblings is not None else None,
        )
        return Replica.from_json(json.loads(result.read_text(encoding="utf-8")))
    except (OpprofError, OSError, ValueError) as exc:
        return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


STAGE_FUNCTIONS: dict[str, Callable[[WorkloadRun], str]] = {
    "capture": stage_capture,
    "propose": stage_propose,
    "backend": stage_backend,
    "validate": stage_validate,
    "recapture": stage_recapture,
}


def run_stage(run: WorkloadRun, stage: str) -> StageOutcome:
    """Run (or reuse) one stage; the outcome carries the user-facing message. The hooks hear
    of it through ``pytest_opprof_stage_finished``."""
    outcome = _run_stage(run, stage)
    run.hooks.pytest_opprof_stage_finished(workload=run, stage=stage, outcome=outcome)
    return outcome


def _run_stage(run: WorkloadRun, stage: str) -> StageOutcome:
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
    # --opprof-from=F recomputes F and later stages; --opprof-stage=S runs S alone, reading
    # what comes before it from disk (or F..S when both are given).
    first = STAGES.index(opts.from_) if opts.from_ else None
    if opts.stage is not None:
        only = STAGES.index(opts.stage)
        first = only if first is None else min(first, only)
    forced = first is not None and index >= first
    reuse_only = first is not None and index < first
    if reuse_only and stage == "validate" and _edited_since_validation(run):
        reuse_only = False  # an edited file is validated again before anything times it
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
        elif not forced and run.cached(stage) and _artifacts_valid(run, stage):
            outcome = StageOutcome(stage, "passed", "unchanged inputs: read from disk", cached=True)
        else:
            run.invalidate_from(stage)
            if stage != "recapture":
                warm_timing_servers(run)
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


def _edited_since_validation(run: WorkloadRun) -> bool:
    """The generated file exists and is not the one its validation report checked."""
    path = run.profiler_output / "validation_report.json"
    if not path.exists() or not run.generated.exists():
        return False
    try:
        report = read_artifact(path, ValidationReport)
    except ArtifactError:
        return False
    return report.sha256 != file_sha256(run.generated)


def _artifacts_valid(run: WorkloadRun, stage: str) -> bool:
    """A cached stage whose artifacts no longer validate (truncated by a crash, edited by hand)
    is recomputed rather than failed: its inputs are all still there."""
    try:
        _check_artifacts(run, stage)
    except ArtifactError:
        return False
    return True


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
        if report.sha256 != file_sha256(run.generated):
            raise ArtifactError(
                f"{run.generated.name} changed since validation_report.json was written"
            )
        if report.overall != "READY_FOR_PROFILING":
            raise StageError(f"{run.generated.name}: {report.message}")
