"""The six stages of one workload, as functions from artifacts on disk to artifacts on disk.

The parent process (pytest or the CLI) runs this; the stages that execute user code delegate to
the runner's child process. Each stage writes an input key beside its artifact so an unchanged
stage is read back from disk, and ``--opprof-from`` recomputes from a given stage on.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import STAGES, __version__, forkserver, progress
from pytest_opprof.backend.plan import EXTRA_PASSES_ENV, PassRegistry
from pytest_opprof.devicelock import WAITING
from pytest_opprof.errors import StageError, StageTimedOut, WorkloadError
from pytest_opprof.options import BY_FIELD, OpprofOptions
from pytest_opprof.schema import (
    ChildFailure,
    read_artifact,
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


STOCK_FILE = "profiler_output/stock_baseline.json"
"""The stock recipe the recapture times, where the stock baseline is measured (written by its
``stock`` task; not an artifact every run has)."""

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

    from pytest_opprof import defaults, hookspecs

    manager = pluggy.PluginManager("pytest")
    manager.add_hookspecs(hookspecs)
    manager.register(defaults, "opprof-defaults")
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
    planned: frozenset[str] = frozenset()
    """The stages this session runs for this workload (its selected items; the ``opprof``
    command's stages): a stage may start the next one's work ahead only where that one runs
    (``stages.recapture.start_ahead``). Empty where nobody said."""
    ahead: dict[str, Any] = field(default_factory=dict, repr=False)
    """Work a stage started for a later one, by the later stage's name, for it to take up."""
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

    def measures_stock(self) -> bool:
        """Whether the stock baseline is measured: asked for, or the gate's baseline."""
        return bool(self.options.stock) or self.base_setting("baseline") == "stock"

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
                opts.ncu_when,  # first: the proposals read the counters too
                self._hook_identity("pytest_opprof_propose"),
                self._passes_identity(),
            ),
            "backend": (
                self.setting("rtol") if "rtol" in self.spec.overrides else None,
                self._passes_identity(),
                self.measures_stock(),  # selection tries the stock recipe as a plan
            ),
            # the file under test as it is now: an edited one is validated again
            "validate": (file_sha256(self.generated),),
            "recapture": (
                self.setting("timing_processes"),
                bool(opts.fresh_timing),
                int(opts.timing_servers),
                self.measures_stock(),
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
        timeout: float | None = None,
        **extra: Any,
    ) -> None:
        """Run one runner task in a child process, with the stage timeout (or ``timeout``
        seconds); its output goes to ``profiler_output/<log_name or task>.log``. ``fresh``: a
        new interpreter, never one forked from the session's fork servers; else forked from
        server ``server`` (:func:`_start_child`)."""
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
            if timeout is None:
                timeout = float(self.setting("timeout"))
            try:
                with progress.running(self.options.out, self.name, log_name or task, log):
                    code = _start_child(spec_path, log, env, timeout, fresh=fresh, server=server)
            except subprocess.TimeoutExpired:
                why = (
                    "it was waiting for its GPU, which other processes shared — run fewer "
                    "pytest-xdist workers per GPU or raise --opprof-timeout"
                    if progress.last_phase(log) == WAITING
                    else "the workload hangs or is too slow — raise --opprof-timeout or "
                    "OPPROF['timeout']"
                )
                raise StageTimedOut(
                    f"{self.spec.path.name}: {stage} did not finish within {timeout:.0f} s "
                    f"and was stopped; {why} (log: {rel_path(log)})"
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
                f"workload (or a library it calls) crashed — see {rel_path(log)}"
            )
        if code != 0:
            tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:])
            raise StageError(
                f"{self.spec.path.name}: the {stage} process failed (exit {code}); this is "
                f"likely a bug in pytest-opprof or torch. Last lines of {rel_path(log)}:\n{tail}"
            )


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


def rel_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------- stages
