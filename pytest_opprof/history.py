"""Stored runs and comparisons across commits (docs/regressions.md): what ``--opprof-save`` keeps,
``--opprof-compare`` reads and ``--opprof-compare-fail`` judges.

A stored run is one JSON file per session, ``<storage>/NNNN[_NAME].json``, numbered in the
order saved (like pytest-benchmark's ``.benchmarks``): per workload the latencies of every
variant timed with their rounds (so an interval between two runs can be resampled), the
speedups, the plan, the validation, the machine and software it measured on, and the git
commit and branch. A comparison puts each figure of this run over the stored run's, with a
95% CI from both runs' rounds (``measure.between_runs``); a rule fails a workload only where
the whole CI lies past its threshold, so noise alone never fails it. Pure Python: no torch.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from pydantic import Field

from pytest_opprof import __version__
from pytest_opprof.errors import ArtifactError, OpprofError, OpprofWarning
from pytest_opprof.measure import RunRounds, between_runs
from pytest_opprof.options import CompareRule, OpprofOptions
from pytest_opprof.schema import (
    Artifact,
    BackendPlan,
    BackendSelection,
    CaptureMetadata,
    Change,
    Comparison,
    LatencyStats,
    Model,
    Numerics,
    Profile,
    SessionSummary,
    Speedup,
    ValidationReport,
    WorkloadSummary,
    read_artifact,
    write_artifact,
)

RUN_FILE = re.compile(r"^(\d{4,})(?:_([A-Za-z0-9._-]+))?\.json$")
VARIANT_ORDER = ("eager", "compile", "stock", "optimized", "optimized_baseline_dtype")
SOFTWARE = (
    ("torch_version", "torch"),
    ("cuda_version", "CUDA"),
    ("triton_version", "Triton"),
    ("python_version", "Python"),
    ("driver", "driver"),
)


# ---------------------------------------------------------------------------------- records


class Fingerprint(Model):
    """What a latency depends on besides the code: the device and the software stack."""

    device_type: str
    device_name: str
    compute_capability: str | None = None
    driver: str | None = None
    torch_version: str
    cuda_version: str | None = None
    triton_version: str | None = None
    python_version: str

    @classmethod
    def of(cls, meta: CaptureMetadata) -> Fingerprint:
        return cls(**{k: getattr(meta, k) for k in cls.model_fields})


class TimingSettings(Model):
    warmup_iters: int
    measure_iters: int
    rounds: int
    processes: int = 1
    clock: str


class StoredWorkload(Model):
    """One workload of a stored run; ``variants`` is empty where it stopped before its
    recapture (``status`` and ``message`` say why)."""

    name: str
    path: str
    status: str
    enforced: bool = True
    message: str = ""
    gate_baseline: str | None = None
    dtype: str | None = Field(default=None, description="the backend's compute dtype, if new")
    baseline_dtype: str | None = None
    input_shapes: list[list[int]] = Field(default_factory=list)
    passes: list[str] = Field(default_factory=list)
    plan: BackendPlan | None = None
    validation: str | None = Field(default=None, description="validation_report's overall")
    numerics: Numerics | None = None
    fingerprint: Fingerprint | None = None
    timing: TimingSettings | None = None
    variants: dict[str, LatencyStats] = Field(default_factory=dict)
    speedups: list[Speedup] = Field(default_factory=list)
    seconds: float | None = Field(
        default=None,
        description="its stages' seconds in all, as its items took them: the next parallel "
        "run starts the longest workloads first (longest_first)",
    )

    def speedup(self, baseline: str, candidate: str = "optimized") -> Speedup | None:
        return next(
            (s for s in self.speedups if s.baseline == baseline and s.candidate == candidate),
            None,
        )


class StoredRun(Artifact):
    """``<storage>/NNNN[_NAME].json``: one session, kept by ``--opprof-save``."""

    SCHEMA_VERSION: ClassVar[str] = "1.1"

    number: int
    name: str | None = None
    created: str = Field(description="when it was saved, ISO 8601 UTC")
    commit: str | None = None
    branch: str | None = None
    dirty: bool | None = None
    device: str
    version: str = Field(default=__version__, description="pytest-opprof's version")
    workloads: list[StoredWorkload] = Field(default_factory=list)

    @property
    def label(self) -> str:
        """``#3 main @ abc1234``: how reports name the run."""
        text = f"#{self.number}"
        if self.name or self.branch:
            text += f" {self.name or self.branch}"
        return text + (f" @ {self.commit[:7]}" if self.commit else "")

    def workload(self, name: str) -> StoredWorkload | None:
        return next((w for w in self.workloads if w.name == name), None)


def _maybe(path: Path, model: Any) -> Any:
    try:
        return read_artifact(path, model) if path.exists() else None
    except ArtifactError:
        return None


def record_workload(
    summary: WorkloadSummary, folder: Path, optimized: Profile | None = None
) -> StoredWorkload:
    """The stored record of a workload, from its summary and the artifacts in ``folder``
    (``<out>/<workload>/``); ``optimized``: profile_optimized.json where already read."""
    if optimized is None:
        optimized = _maybe(folder / "profile_optimized.json", Profile)
    selection = _maybe(folder / "profiler_output" / "backend_selection.json", BackendSelection)
    validation = _maybe(folder / "profiler_output" / "validation_report.json", ValidationReport)
    record = StoredWorkload(
        name=summary.name,
        path=summary.path,
        status=summary.status,
        enforced=summary.enforced,
        message=summary.message,
        gate_baseline=summary.baseline,
        dtype=summary.dtype,
        passes=list(summary.passes),
        plan=selection.plan if selection is not None else None,
        validation=validation.overall if validation is not None else None,
        numerics=validation.numerics if validation is not None else None,
    )
    if optimized is None:
        return record
    meta, timing = optimized.capture_metadata, optimized.timing
    record.baseline_dtype = meta.dtype
    record.input_shapes = meta.input_shapes
    record.fingerprint = Fingerprint.of(meta)
    record.timing = TimingSettings(
        warmup_iters=meta.warmup_iters,
        measure_iters=meta.measure_iters,
        rounds=meta.rounds,
        processes=timing.processes,
        clock=timing.clock,
    )
    # per-round CPU shares and preemptions explain a report; a comparison needs the rounds
    record.variants = {
        k: v.model_copy(update={"cpu_share": [], "preempted": []})
        for k, v in timing.variants.items()
    }
    record.speedups = list(timing.speedups)
    return record


# ----------------------------------------------------------------------------------- source


@dataclass(frozen=True)
class Source:
    """The git commit measured: HEAD where the session ran, and its branch."""

    commit: str | None = None
    branch: str | None = None
    dirty: bool | None = None


def git_source(cwd: Path, env: Mapping[str, str] | None = None) -> Source:
    """HEAD's commit and branch in ``cwd``; a detached HEAD (a CI checkout) takes its branch
    from GitHub Actions' variables: the pull request's head branch, or the pushed branch."""
    env = os.environ if env is None else env

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    ref = env.get("GITHUB_REF", "")
    ci_branch = env.get("GITHUB_HEAD_REF") or (
        ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None
    )
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return Source(branch=ci_branch or None)
    status = git("status", "--porcelain", "--untracked-files=no")
    return Source(
        commit=commit,
        branch=git("symbolic-ref", "--short", "-q", "HEAD") or ci_branch or None,
        dirty=None if status is None else bool(status),
    )


def slug(text: str) -> str:
    """A branch name as a run name: ``feature/x`` → ``feature-x``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:64] or "run"


# ---------------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class Entry:
    """A file of the storage folder: its run, or why it could not be read."""

    path: Path
    number: int
    run: StoredRun | None
    error: str | None = None


def list_runs(storage: Path) -> list[Entry]:
    """Every stored run in ``storage``, by number; a file that does not validate is listed
    with its error (``opprof runs`` shows it), never dropped in silence."""
    entries = []
    if Path(storage).is_dir():
        for path in Path(storage).iterdir():
            match = RUN_FILE.match(path.name)
            if not match or not path.is_file():
                continue
            try:
                entries.append(Entry(path, int(match[1]), read_artifact(path, StoredRun)))
            except ArtifactError as exc:
                entries.append(Entry(path, int(match[1]), None, str(exc)))
    return sorted(entries, key=lambda e: (e.number, e.path.name))


def find_run(spec: str, storage: Path) -> tuple[Path, StoredRun]:
    """The run ``--opprof-compare`` names: ``last``, a number, a name (or the branch it was
    saved on: its latest run), or the path of a run's file or of a storage folder (its last
    run). A ``pytest.UsageError`` says what was found where nothing matches."""
    where = Path(spec)
    if spec.endswith(".json") or "/" in spec or os.sep in spec or where.exists():
        if where.is_file():
            try:
                return where, read_artifact(where, StoredRun)
            except ArtifactError as exc:
                raise pytest.UsageError(f"--opprof-compare: {exc}") from None
        if not where.is_dir():
            raise pytest.UsageError(f"--opprof-compare: {spec}: not found")
        storage, spec = where, "last"
    entries = list_runs(storage)
    runs = [e for e in entries if e.run is not None]
    if not runs:
        broken = f" ({len(entries)} unreadable)" if entries else ""
        raise pytest.UsageError(
            f"--opprof-compare: no stored run in {storage}{broken}: save one first with "
            "--opprof-save (a bare --opprof-compare takes the next word as the run: write "
            "--opprof-compare=RUN before paths)"
        )
    if spec == "last":
        chosen = runs[-1]
    elif spec.isdigit():
        numbered = [e for e in entries if e.number == int(spec)]
        if not numbered:
            raise pytest.UsageError(
                f"--opprof-compare: no run #{int(spec)} in {storage}; stored: "
                + ", ".join(f"#{e.number}" for e in entries)
            )
        if numbered[0].run is None:
            raise pytest.UsageError(f"--opprof-compare: {numbered[0].error}")
        chosen = numbered[0]
    else:
        named = [e for e in runs if e.run is not None and e.run.name == spec] or [
            e for e in runs if e.run is not None and e.run.branch == spec
        ]
        if not named:
            raise pytest.UsageError(
                f"--opprof-compare: no run named {spec!r} or saved on branch {spec!r} in "
                f"{storage}; `opprof runs --storage {storage}` lists them"
            )
        chosen = named[-1]
    assert chosen.run is not None
    return chosen.path, chosen.run


@contextlib.contextmanager
def _locked(storage: Path) -> Iterator[None]:
    """Sessions saving at once get distinct numbers: one holds the folder's lock at a time."""
    try:
        import fcntl
    except ImportError:  # not POSIX: numbers are claimed without a lock
        yield
        return
    with open(storage / ".lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def save_run(storage: Path, run: StoredRun) -> Path:
    """Write ``run`` as the next number in ``storage``; sets ``run.number``; returns the file."""
    storage = Path(storage)
    storage.mkdir(parents=True, exist_ok=True)
    with _locked(storage):
        taken = [int(m[1]) for p in storage.iterdir() if (m := RUN_FILE.match(p.name))]
        run.number = max(taken, default=0) + 1
        path = storage / f"{run.number:04d}{'_' + run.name if run.name else ''}.json"
        write_artifact(path, run)
    return path


def build_run(
    summaries: Sequence[WorkloadSummary],
    out: Path,
    device: str,
    source: Source,
    name: str | None,
    seconds: Mapping[str, float] | None = None,
) -> StoredRun:
    """This session as a stored run (number 0 until saved). ``name``: ``auto`` takes the
    branch's; ``seconds``: each workload's stage seconds in all, by name."""
    if name == "auto":
        name = slug(source.branch) if source.branch else None
    workloads = [record_workload(s, Path(out) / s.name) for s in summaries]
    for w in workloads:
        w.seconds = (seconds or {}).get(w.name)
    return StoredRun(
        number=0,
        name=name,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=source.commit,
        branch=source.branch,
        dirty=source.dirty,
        device=device,
        workloads=workloads,
    )


LOOK_BACK = 5
"""Stored runs read, newest first, for the last one that says how long its workloads took:
a run saved by an older version says nothing, and reading the whole store would slow every
collection of a long-kept one."""


def last_seconds(storage: Path) -> dict[str, float]:
    """Each workload's stage seconds in the newest stored run in ``storage`` that has them
    (of the newest :data:`LOOK_BACK`); empty where none does. A file that does not read is
    passed over: the order of a run is a guess, and never fails it."""
    if not Path(storage).is_dir():
        return {}
    files = [(int(m[1]), p) for p in Path(storage).iterdir() if (m := RUN_FILE.match(p.name))]
    for _, path in sorted(files, reverse=True)[:LOOK_BACK]:
        try:
            run = read_artifact(path, StoredRun)
        except (ArtifactError, OSError):
            continue
        found = {w.name: w.seconds for w in run.workloads if w.seconds is not None}
        if found:
            return found
    return {}


def longest_first(names: Sequence[str | None], seconds: Mapping[str, float]) -> list[int]:
    """The order to start workloads in (indices into ``names``) so that several workers end
    together: the longest first (the classic longest-processing-time rule), by ``seconds``
    from a stored run; a workload it does not know (new, or ``None``: no workload) first of
    all, as one that may be long, and ties in the given order."""
    return sorted(
        range(len(names)),
        key=lambda i: -seconds.get(names[i] or "", float("inf")),
    )


# ---------------------------------------------------------------------------------- compare


def _ordered(names: Sequence[str] | set[str]) -> list[str]:
    return sorted(names, key=lambda n: (VARIANT_ORDER.index(n) if n in VARIANT_ORDER else 9, n))


def _rounds(*stats: LatencyStats) -> RunRounds:
    first = stats[0]
    return RunRounds(
        series=tuple(s.samples_ms for s in stats),
        groups=first.samples_per_process or None,
        set_aside=first.set_aside,
    )


def _verdict(metric: str, lo: float, hi: float) -> Literal["regressed", "improved", "unchanged"]:
    worse, better = (lo > 1, hi < 1) if metric == "latency" else (hi < 1, lo > 1)
    return "regressed" if worse else "improved" if better else "unchanged"


def _judged(change: Change, rules: Sequence[CompareRule], gated: bool) -> Change:
    """The strictest rule that applies to ``change``: its limit, and whether the CI lies
    wholly past it (a failure only where the comparison is gated)."""
    latency = change.metric == "latency"
    best: tuple[float, CompareRule] | None = None
    for rule in rules:
        if latency and rule.metric not in ("latency", change.name):
            continue
        if not latency and (rule.metric != "speedup" or not change.gate):
            continue
        limit = 1 + rule.threshold if latency else 1 - rule.threshold
        if best is None or (limit < best[0] if latency else limit > best[0]):
            best = (limit, rule)
    if best is not None:
        change.limit, change.rule = best[0], str(best[1])
        past = change.ci_low > best[0] if latency else change.ci_high < best[0]
        change.failed = gated and past
    return change


def compare_workload(
    before: StoredWorkload, after: StoredWorkload, rules: Sequence[CompareRule], run: StoredRun
) -> Comparison:
    """Every latency both runs timed and every speedup of the optimized backend both measured,
    this run's over the stored run's; warnings where the device or the software differ."""
    comp = Comparison(run=run.number, label=run.label, commit=run.commit, branch=run.branch)
    fb, fa = before.fingerprint, after.fingerprint
    if fb is not None and fa is not None:
        if (fb.device_type, fb.device_name) != (fa.device_type, fa.device_name):
            comp.gated = False
            comp.warnings.append(
                f"{after.name}: run {run.label} measured on {fb.device_name}, this run on "
                f"{fa.device_name}: its changes mix the hardware's difference with the code's, "
                "so --opprof-compare-fail does not fail them"
            )
        diffs = [
            f"{label} {getattr(fb, key) or '—'} → {getattr(fa, key) or '—'}"
            for key, label in SOFTWARE
            if getattr(fb, key) != getattr(fa, key)
        ]
        if diffs:
            comp.warnings.append(
                f"{after.name}: the software differs from run {run.label} ({', '.join(diffs)}): "
                "a change may come from the stack as well as from the code"
            )
    if before.timing and after.timing and before.timing != after.timing:
        then, now = before.timing, after.timing
        comp.notes.append(
            f"timing differs: {then.rounds} rounds × {then.measure_iters} calls in "
            f"{then.processes} process(es) then, {now.rounds} × {now.measure_iters} in "
            f"{now.processes} now"
        )
    if before.input_shapes and before.input_shapes != after.input_shapes:
        comp.notes.append(f"inputs differ: {before.input_shapes} then, {after.input_shapes} now")
    if (before.dtype or None) != (after.dtype or None):
        comp.notes.append(f"backend dtype differs: {before.dtype or '—'} → {after.dtype or '—'}")
    for name in _ordered(set(before.variants) & set(after.variants)):
        b, a = before.variants[name], after.variants[name]
        ratio, lo, hi = between_runs(_rounds(b), _rounds(a))
        change = Change(
            metric="latency",
            name=name,
            before=b.median_ms,
            after=a.median_ms,
            ratio=ratio,
            ci_low=lo,
            ci_high=hi,
            verdict=_verdict("latency", lo, hi),
        )
        comp.changes.append(_judged(change, rules, comp.gated))
    for s in after.speedups:
        old = before.speedup(s.baseline, s.candidate)
        if s.candidate != "optimized" or old is None:
            continue
        pair = (s.baseline, s.candidate)
        sides = [[w.variants.get(v) for v in pair] for w in (before, after)]
        usable = [
            st
            for st in sides
            if st[0] is not None
            and st[1] is not None
            and len(st[0].samples_ms) == len(st[1].samples_ms)
            and st[0].samples_per_process == st[1].samples_per_process
        ]
        if len(usable) != 2:
            comp.notes.append(f"speedup against {s.baseline}: its rounds are not paired")
            continue
        ratio, lo, hi = between_runs(_rounds(*usable[0]), _rounds(*usable[1]))  # type: ignore[arg-type]
        change = Change(
            metric="speedup",
            name=s.baseline,
            before=old.ratio,
            after=s.ratio,
            ratio=ratio,
            ci_low=lo,
            ci_high=hi,
            verdict=_verdict("speedup", lo, hi),
            gate=s.baseline == after.gate_baseline,
        )
        comp.changes.append(_judged(change, rules, comp.gated))
    return comp


def describe(workload: str, c: Change, label: str) -> str:
    """One failed change in words: the workload, the metric, the ratio and its CI."""
    if c.metric == "latency":
        what = f"{c.name} latency {c.before:.4g} → {c.after:.4g} ms"
    else:
        what = f"speedup against {c.name} {c.before:.2f}× → {c.after:.2f}×"
    return (
        f"{workload}: {what}, {c.ratio:.2f}× run {label}'s (95% CI {c.ci_low:.2f}–"
        f"{c.ci_high:.2f}), wholly past {c.limit:.2f}× (--opprof-compare-fail={c.rule})"
    )


def judge(
    summary: WorkloadSummary,
    folder: Path,
    run: StoredRun,
    rules: Sequence[CompareRule],
    optimized: Profile | None = None,
) -> Comparison:
    """Compare ``summary``'s workload with its namesake in ``run``: sets
    ``summary.comparison``, warns (``OpprofWarning``) where the device or the software differ,
    and fails the summary where a rule's threshold is past with certainty."""
    before = run.workload(summary.name)
    comp = Comparison(run=run.number, label=run.label, commit=run.commit, branch=run.branch)
    if before is None:
        comp.notes.append(f"run {run.label} has no workload {summary.name!r}: nothing to compare")
    elif not before.variants:
        comp.notes.append(
            f"run {run.label} has no timing of {summary.name} ({before.status}): nothing to compare"
        )
    else:
        comp = compare_workload(before, record_workload(summary, folder, optimized), rules, run)
    summary.comparison = comp
    for text in comp.warnings:
        warnings.warn(OpprofWarning(text), stacklevel=2)
    failed = [c for c in comp.changes if c.failed]
    if failed:
        summary.status = "failed"
        why = "; ".join(describe(summary.name, c, run.label) for c in failed)
        rest = f"; {summary.message}" if summary.message else ""
        summary.message = f"regression against run {run.label}: {why}{rest}"
    return comp


# ---------------------------------------------------------------------------------- session


def record_session(
    options: OpprofOptions,
    compared: StoredRun | None,
    verdict: SessionSummary,
    summaries: Sequence[WorkloadSummary],
    seconds: Mapping[str, float] | None = None,
) -> str:
    """The session's end: the measured commit into ``verdict``; with ``--opprof-save`` the
    run stored, with each workload's stage ``seconds`` (and its github-action-benchmark
    exports beside session.json); with save or compare, the session report's section across
    runs (Markdown, else empty)."""
    source = git_source(Path.cwd())
    verdict.commit, verdict.branch, verdict.dirty = source.commit, source.branch, source.dirty
    if compared is not None:
        verdict.compared_with = compared.label
    if options.save is None and compared is None:
        return ""
    from pytest_opprof.report.trend import (
        EXPORT_FILES,
        benchmark_action_entries,
        history_section,
        write_json,
    )

    run = build_run(summaries, options.out, verdict.device, source, options.save, seconds)
    if options.save is not None:
        try:
            path = save_run(options.storage, run)
        except OSError as exc:  # the session's results stand; the run is not kept
            warnings.warn(
                OpprofWarning(f"--opprof-save: cannot write to {options.storage}: {exc}"),
                stacklevel=2,
            )
        else:
            verdict.saved_as = str(path)
        for kind, entries in zip(EXPORT_FILES, benchmark_action_entries(run), strict=True):
            if entries:
                write_json(Path(options.out) / EXPORT_FILES[kind], entries)
    stored = [e.run for e in list_runs(options.storage) if e.run is not None]
    return history_section(
        summaries, stored, current=run, out_dir=Path(options.out), saved=bool(verdict.saved_as)
    )


def load_for_cli(spec: str | None, storage: Path) -> StoredRun:
    """The run a command names (default: the last), as an ``OpprofError`` where none."""
    try:
        return find_run(spec or "last", storage)[1]
    except pytest.UsageError as exc:
        raise OpprofError(str(exc).removeprefix("--opprof-compare: ")) from None
