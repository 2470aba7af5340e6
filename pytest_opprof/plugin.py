"""pytest hooks of pytest-opprof: options, collection of workloads, one item per stage, the
summary, the ``opprof`` fixture, and the plugin's own (``trylast``) implementations of its
decision hooks (``hookspecs.py``). Hook functions only; the work is in ``session.py`` and
``pipeline.py``. Importing this module imports no torch."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_opprof import ITEM_NAMES, STAGES
from pytest_opprof.options import OPTIONS, OpprofOptions
from pytest_opprof.workload import WorkloadSpec, discover, is_generated

if TYPE_CHECKING:
    from pytest_opprof.progress import Ticker  # noqa: F401 (used in a string)
    from pytest_opprof.schema import SessionSummary
    from pytest_opprof.session import OpprofSession, Optimizer  # noqa: F401 (used in a string)

SESSION_KEY = pytest.StashKey["OpprofSession"]()
RECORDER_KEY = pytest.StashKey["StageRecorder"]()
WRITTEN_KEY = pytest.StashKey[tuple[Path, "SessionSummary"]]()
TICKER_KEY = pytest.StashKey["Ticker"]()
"""The session report's path and ``session.json`` as written at the session's end."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_opprof import defaults, hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    pluginmanager.register(defaults, "opprof-defaults")  # the trylast decision hooks


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opprof", "GPU optimization gate (pytest-opprof)")
    group.addoption(
        "--opprof",
        action="store_true",
        dest="opprof",
        default=False,
        help="profile, optimize, validate and gate every workload found",
    )
    for spec in OPTIONS:
        flag = f"--opprof-{spec.noun}"
        if spec.flag:
            group.addoption(
                flag, action="store_true", dest=spec.dest, default=None, help=spec.argparse_help
            )
        else:
            group.addoption(
                flag,
                dest=spec.dest,
                default=None,
                metavar=spec.metavar,
                help=spec.argparse_help,
                **spec.optional_value,
            )
        parser.addini(spec.dest, help=spec.help, default=None)


def _options(config: pytest.Config) -> OpprofOptions:
    values: dict[str, Any] = {}
    for spec in OPTIONS:
        value = config.getoption(spec.dest)
        if value is None:
            value = config.getini(spec.dest)
        values[spec.field] = spec.default if value in (None, "") else value
    return OpprofOptions.from_values(values)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "opprof: an item of a pytest-opprof workload stage")
    if not config.getoption("opprof"):
        return
    options = _options(config)  # raises pytest.UsageError naming the accepted values
    from pytest_opprof.gpus import assign

    assign(options.device, getattr(config, "workerinput", None))
    if importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(
            "--opprof needs PyTorch, which is not installed here: `pip install torch` (a CUDA "
            "build for GPU runs), then run again"
        )
    from pytest_opprof.session import OpprofSession

    config.stash[SESSION_KEY] = OpprofSession(options=options)
    recorder = config.stash[RECORDER_KEY] = StageRecorder()
    config.pluginmanager.register(recorder, "opprof-stage-recorder")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` with ``--opprof``: one worker per visible GPU."""
    if not config.getoption("opprof"):
        return None
    from pytest_opprof.gpus import visible_gpus

    return max(len(visible_gpus()), 1)


def pytest_cmdline_main(config: pytest.Config) -> None:
    """Under xdist, a workload's items stay on one worker (their stages share state)."""
    if (
        config.getoption("opprof")
        and getattr(config.option, "dist", "no") in ("load", "no")
        and getattr(config.option, "numprocesses", None)
    ):
        config.option.dist = "loadfile"


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if SESSION_KEY not in config.stash:
        return None
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "absent"
    ncu = shutil.which("ncu")
    gpu = _gpu_name()
    opprof = config.stash[SESSION_KEY]
    opts = opprof.options
    lines = [
        f"opprof: out={opts.out} device={opts.device} ({gpu}) torch {torch_version}",
        f"opprof: ncu {'found at ' + ncu if ncu else 'not found (no hardware counters)'}; "
        f"min speedup {opts.min_speedup} against {opts.baseline}",
    ]
    if opprof.compare_with is not None:
        rules = ",".join(map(str, opts.compare_fail)) or "none (figures shown, never failed)"
        lines.append(
            f"opprof: comparing with stored run {opprof.compare_with.label}; fail: {rules}"
        )
    return lines


def _gpu_name() -> str:
    from pytest_opprof.gpus import nvidia_smi_query

    if not shutil.which("nvidia-smi"):
        return "no NVIDIA GPU found: CPU fallback"
    return nvidia_smi_query("name") or "nvidia-smi listed no GPU"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The output folder and the files the pipeline generates are never collected."""
    if collection_path.name == "opprof-results" or is_generated(collection_path):
        return True
    if SESSION_KEY in config.stash:
        out = config.stash[SESSION_KEY].options.out.resolve()
        if collection_path.resolve() == out:
            return True
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.File | None:
    config = parent.config
    if SESSION_KEY not in config.stash or file_path.suffix != ".py":
        return None
    spec = discover(file_path)
    if spec is None:
        if _named_file_without_entry(file_path, config):
            return NotAWorkload.from_parent(parent, path=file_path)
        return None
    session = config.stash[SESSION_KEY]
    shard = session.options.shard
    if shard and not _in_shard(file_path, config, shard):
        return None
    item = WorkloadFile.from_parent(parent, path=file_path)
    item.spec = spec
    return item


def _named_file_without_entry(path: Path, config: pytest.Config) -> bool:
    """A .py file the user named on the command line that is no workload and no test module:
    they meant it as a workload, so it gets an item that says what it lacks."""
    name = path.name
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
        return False
    if is_generated(path):
        return False
    named = {Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args}
    return path.resolve() in named


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Under xdist (``-n``), the workloads start longest first, by the stage seconds of the
    newest stored run that has them (``history.longest_first``), so the last to start are
    short and the workers end together: started in the given order, a long workload started
    last kept the run going after the others were done. Each workload's items keep their
    order (they stay on one worker: ``loadfile``), and every worker collects the same order
    from the same store."""
    if SESSION_KEY not in config.stash:
        return
    if not hasattr(config, "workerinput") and not getattr(config.option, "numprocesses", None):
        return
    opprof = config.stash[SESSION_KEY]
    from pytest_opprof.history import last_seconds, longest_first

    seconds = last_seconds(opprof.options.storage)
    if not seconds:
        return
    groups: dict[Any, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(item.parent, []).append(item)
    parents = list(groups)
    names = [opprof.workload(p.spec).name if isinstance(p, WorkloadFile) else None for p in parents]
    items[:] = [item for i in longest_first(names, seconds) for item in groups[parents[i]]]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each workload's run learns which of its stages this session runs: those of its items
    left after ``-k``, ``-m`` and the rest, and every stage before them, which a selected item
    runs first (``OpprofSession.run``). A stage starts a later one's work ahead only where that
    one runs (``WorkloadRun.planned``)."""
    config = session.config
    if SESSION_KEY not in config.stash:
        return
    opprof = config.stash[SESSION_KEY]
    last: dict[Any, int] = {}
    for item in session.items:
        if isinstance(item, StageItem) and isinstance(item.parent, WorkloadFile):
            at = STAGES.index(item.stage)
            last[item.parent] = max(at, last.get(item.parent, at))
    for parent, at in last.items():
        opprof.workload(parent.spec, parent.ihook).planned = frozenset(STAGES[: at + 1])


class StageFailure(Exception):
    """A stage's user-facing message; shown without a traceback."""


class OpprofItem(pytest.Item):
    """An item of a workload file: a ``StageFailure`` is shown as its message alone."""

    def repr_failure(
        self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
    ) -> str | Any:
        if isinstance(excinfo.value, StageFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


class NotAWorkload(pytest.File):
    """A file named as a workload that defines no top-level ``get_model_and_input``."""

    def collect(self) -> Iterator[pytest.Item]:
        yield NotAWorkloadItem.from_parent(self, name=STAGES[0])


class NotAWorkloadItem(OpprofItem):
    def runtest(self) -> None:
        raise StageFailure(
            f"{self.path.name}: no top-level `def get_model_and_input()`, so it is not a "
            "workload; define it to return (model, input) with the model in eval mode on CUDA "
            "(the README's 'A workload'), or leave the file off the command line"
        )


def _in_shard(path: Path, config: pytest.Config, shard: tuple[int, int]) -> bool:
    import hashlib

    rel = (
        str(path.resolve().relative_to(config.rootpath.resolve()))
        if path.resolve().is_relative_to(config.rootpath.resolve())
        else path.name
    )
    k, n = shard
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % n == k - 1


class WorkloadFile(pytest.File):
    """A workload file: one item per stage."""

    spec: WorkloadSpec

    def collect(self) -> Iterator[pytest.Item]:
        stages = self.config.stash[SESSION_KEY].options.stages_to_run()
        for stage in STAGES:
            if stage in stages:
                yield StageItem.from_parent(self, name=ITEM_NAMES[stage], stage=stage)


class StageItem(OpprofItem):
    def __init__(self, *, stage: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage
        self.add_marker("opprof")

    def runtest(self) -> None:
        session = self.config.stash[SESSION_KEY]
        spec = self.parent.spec  # type: ignore[union-attr]
        # the hooks of the conftests above the workload's folder, as for pytest's own hooks
        outcome = session.run(spec, self.stage, hook=self.ihook)
        # The stage's outcome rides on the item's report, so the controller of an xdist run
        # (which runs no item itself) can write the stage-level JUnit file for all workers.
        self.user_properties.extend(
            [
                ("opprof.workload", session.workload(spec).name),
                ("opprof.stage", ITEM_NAMES[self.stage]),
                ("opprof.outcome", outcome.status),
                ("opprof.stage_seconds", f"{outcome.seconds:.3f}"),
                ("opprof.message", outcome.message),
            ]
        )
        if self.stage == "report":
            summary = session.summaries.get(session.workload(spec).name)
            if summary is not None:
                from pytest_opprof.report import user_properties

                self.user_properties.extend(user_properties(summary))
        if outcome.status == "skipped":
            pytest.skip(outcome.message)
        if outcome.status in ("failed", "error"):
            raise StageFailure(outcome.message)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    written = config.stash.get(WRITTEN_KEY, None)
    if written is None:
        return
    from pytest_opprof.report import terminal_summary_lines

    path, summary = written
    terminalreporter.section("opprof")
    for line in terminal_summary_lines(summary.workloads):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"session report: {path}")
    if summary.compared_with:
        terminalreporter.write_line(f"compared with stored run {summary.compared_with}")
    if summary.saved_as:
        terminalreporter.write_line(f"run saved as {summary.saved_as}")
    if not summary.gate_passed:
        failed = [w.name for w in summary.workloads if w.status != "passed"]
        terminalreporter.write_line(
            f"opprof gate FAILED for {', '.join(failed)}: exit status 1", red=True, bold=True
        )


class StageRecorder:
    """Collects stage outcomes from every item's report: this process's items, or under xdist
    the workers' reports as they reach the controller (which runs no item itself)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        if report.when != "call" or "opprof.stage" not in props:
            return
        from pytest_opprof.report import StageResultRecord

        self.records.append(
            StageResultRecord(
                workload=str(props["opprof.workload"]),
                stage=str(props["opprof.stage"]),
                outcome=props["opprof.outcome"],  # type: ignore[arg-type]
                seconds=float(str(props["opprof.stage_seconds"])),
                message=str(props["opprof.message"]),
            )
        )

    def seconds(self) -> dict[str, float]:
        """Each workload's stage seconds in all: what a stored run orders the next by."""
        found: dict[str, float] = {}
        for r in self.records:
            found[r.workload] = found.get(r.workload, 0.0) + r.seconds
        return found


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's fork server (stage processes) ends with it."""
    if SESSION_KEY in config.stash:
        from pytest_opprof import forkserver

        forkserver.shutdown()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Live progress of long stages (``--opprof-progress``) in the terminal's process: pytest's,
    or xdist's controller, which reads the workers' progress files (``progress``)."""
    config = session.config
    if SESSION_KEY not in config.stash or hasattr(config, "workerinput"):
        return
    options = config.stash[SESSION_KEY].options
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if not options.progress or reporter is None:
        return
    from pytest_opprof import progress

    def write(line: str) -> None:
        reporter.write_line(f"opprof: {line}")

    where = progress.folder(options.out)
    config.stash[TICKER_KEY] = progress.Ticker(where, options.progress, write).start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's report and ``session.json`` (on the controller, from every worker's
    summaries), and its exit status: a session whose gate did not pass exits 1 whatever was
    selected, even where no failed item said so (runs before the terminal summary)."""
    config = session.config
    ticker = config.stash.get(TICKER_KEY, None)
    if ticker is not None:
        ticker.stop()
    if SESSION_KEY not in config.stash or hasattr(config, "workerinput"):
        return
    opprof = config.stash[SESSION_KEY]
    if opprof.options.junit is not None:
        from pytest_opprof.report import write_stage_junit

        write_stage_junit(opprof.options.junit, config.stash[RECORDER_KEY].records)
    summaries = opprof.collect_summaries()
    if not summaries:
        return
    from pytest_opprof.session import session_device

    device = session_device(summaries, opprof.options.out, opprof.options.device)
    seconds = config.stash[RECORDER_KEY].seconds()
    config.stash[WRITTEN_KEY] = opprof.write_session(summaries, device, seconds)
    if not config.stash[WRITTEN_KEY][1].gate_passed and session.exitstatus in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------------------ fixture


@pytest.fixture
def opprof(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Optimizer:
    """Run the pipeline from your own test, with or without ``--opprof``::

        def test_fast_enough(opprof):
            result = opprof.optimize("workloads/conv_block.py", min_speedup=1.2)
            assert result.validation.overall == "READY_FOR_PROFILING"
            assert result.speedup.ci_low > 1.2

    Keyword arguments override the session's ``--opprof-*`` options (by field name:
    ``device="cpu"``, ``rounds=5``, ``baseline="compile"``, ``out=...``). Artifacts go to
    ``--opprof-out`` when it is given, else to a temporary folder. The conftests that apply to
    the calling test provide the ``pytest_opprof_*`` hooks."""
    from pytest_opprof.session import Optimizer

    config = request.config
    options = _options(config)
    given = config.getoption("opprof_out") is not None or config.getini("opprof_out")
    if not given:
        options = dataclasses.replace(options, out=tmp_path_factory.mktemp("opprof"))
    return Optimizer(options=options, hook=request.node.ihook)
