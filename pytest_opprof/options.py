"""The options of the plugin and the CLI: one table, parsed by named functions.

Each option is ``--opprof-<noun>`` in pytest (with an ini key ``opprof_<noun>``) and ``--<noun>``
in the subcommands of ``opprof`` that it affects. Every value is checked at start-up; a bad one
is a ``pytest.UsageError`` naming the accepted values and the pytest flag, which the command
respells as its own (``cli_spelling``). The parsers and ``OptionSpec`` are in
``option_parsing``; their names are importable from here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import STAGES
from pytest_opprof.option_parsing import (
    COMPARE_METRICS,
    RUN_NAME_CHARS,
    CompareRule,
    OptionSpec,
    choice,
    parse_bool,
    parse_compare,
    parse_compare_fail,
    parse_count,
    parse_junit,
    parse_path,
    parse_positive_float,
    parse_save,
    parse_shard,
    parse_stage,
    parse_storage,
    parse_timing_processes,
    parse_timing_servers,
)

TRANSFORMATION_TYPES: tuple[str, ...] = (
    "dtype_promotion",
    "gemm_out_dtype",
    "memory_layout",
    "bn_fold",
    "conv_im2col",
    "depthwise_taps",
    "qkv_fusion",
    "sdpa_replacement",
    "pretranspose_weights",
    "activation_substitution",
    "gemm_epilogue",
    "gemm_algorithm",
    "attention_backend",
    "batch_padding",
    "cuda_graphs",
    "algorithm_selection",
    "stub_detection",
)


def _opt(noun: str, parse: Callable[[Any], Any], default: Any, help: str, **kw: Any) -> OptionSpec:
    return OptionSpec(noun, parse, default, help, **kw)


def _one_of(noun: str, accepted: tuple[str, ...], default: str, help: str, **kw: Any) -> OptionSpec:
    """An option whose value is one of ``accepted``."""
    parse = choice(f"--opprof-{noun}", accepted)
    return OptionSpec(noun, parse, default, help, accepted="one of: " + ", ".join(accepted), **kw)


STAGE_NAMES = "one of: " + ", ".join(STAGES)
COUNT = "an integer ≥ 1"


OPTIONS: tuple[OptionSpec, ...] = (
    _opt(
        "out",
        parse_path,
        "opprof-results",
        "folder for artifacts and reports",
        metavar="DIR",
        accepted="a folder",
    ),
    _opt(
        "from",
        parse_stage("--opprof-from"),
        None,
        "recompute this stage and the later ones, reusing the artifacts on disk before it "
        "(without it, a stage is reused while its inputs are unchanged)",
        metavar="STAGE",
        accepted=STAGE_NAMES,
        default_text="none",
    ),
    _opt(
        "stage",
        parse_stage("--opprof-stage"),
        None,
        "run only this stage; the earlier ones must be on disk",
        metavar="STAGE",
        accepted=STAGE_NAMES,
        default_text="every stage",
    ),
    _opt(
        "min-speedup",
        parse_positive_float("--opprof-min-speedup"),
        1.0,
        "speedup the gate demands",
        metavar="X",
        accepted="a number > 0",
    ),
    _one_of(
        "baseline",
        ("eager", "compile", "best", "stock"),
        "best",
        "baseline the gate compares against; best is the faster of eager and compile; stock "
        "is the stock PyTorch recipe (measured as --opprof-stock says)",
        metavar="NAME",
    ),
    _opt(
        "stock",
        lambda v: parse_bool(v, "--opprof-stock"),
        False,
        "measure the stock baseline too: the faster of two stock PyTorch recipes at bf16 "
        "(autocast, or the model cast with weight freezing; both torch.compile mode="
        '"max-autotune", which compiles for minutes on a large model); selection then tries '
        "the faster recipe in place of its own plan and ships it where measured faster",
        flag=True,
    ),
    _opt(
        "warm-rungs",
        lambda v: parse_bool(v, "--opprof-warm-rungs"),
        False,
        "experimental: sibling processes at idle priority compile ahead the plans measured "
        "selection may build next (whether the rung under way is kept or dropped), so that "
        "Inductor's FX graph cache answers selection's own builds; they are stopped while "
        "selection measures. One for each CPU of the worker's slice, at most 3, and only on a "
        "GPU under its lock, as many as the capture's peak memory says fit; not yet measured "
        "beside a run without them",
        flag=True,
    ),
    _one_of(
        "compile-backend",
        ("inductor",),
        "inductor",
        "torch.compile backend of the compiled baseline",
        metavar="NAME",
    ),
    _one_of(
        "device",
        ("auto", "cuda", "cpu"),
        "auto",
        "device to run on; auto is CUDA when present, else the CPU fallback",
        metavar="DEV",
    ),
    _one_of(
        "ncu",
        ("auto", "on", "off"),
        "auto",
        "Nsight Compute counters: auto (when ncu is found), on (required), off",
        metavar="MODE",
    ),
    _one_of(
        "ncu-when",
        ("beside", "first"),
        "beside",
        "when the counters pass runs: beside (a sibling process while selection, validation "
        "and the recapture go on; the report waits for it) or first (in the capture, before "
        "the proposals, which then read the counters too)",
        metavar="WHEN",
    ),
    _one_of(
        "ncu-sudo",
        ("auto", "true", "false"),
        "auto",
        "run ncu through sudo: auto reads /proc/driver/nvidia/params",
        metavar="MODE",
    ),
    _one_of(
        "ncu-clock-control",
        ("none", "base"),
        "none",
        "ncu --clock-control (none leaves the clocks alone)",
        metavar="MODE",
    ),
    _one_of(
        "ncu-replay",
        ("auto", "all", "unique"),
        "auto",
        "ncu replays every kernel launch (all), the first launch of each launch configuration "
        "(unique: repeated layers and time steps share its counters), or unique above 96 "
        "kernels (auto)",
        metavar="MODE",
    ),
    _one_of(
        "min-confidence",
        ("low", "medium", "high"),
        "low",
        "drop proposals below this confidence",
        metavar="LEVEL",
    ),
    _opt(
        "max-opts",
        parse_count("--opprof-max-opts", allow_none=True),
        None,
        "keep at most N proposals (by estimated impact)",
        metavar="N",
        accepted=f"{COUNT} or all",
        default_text="all",
    ),
    _opt(
        "warmup-iters",
        parse_count("--opprof-warmup-iters"),
        10,
        "warmup calls before timing",
        metavar="N",
        accepted=COUNT,
    ),
    _opt(
        "measure-iters",
        parse_count("--opprof-measure-iters"),
        30,
        "calls per timed round, at most: fewer for a call whose round would outlast 50 ms",
        metavar="N",
        accepted=COUNT,
    ),
    _opt(
        "rounds",
        parse_count("--opprof-rounds", minimum=3),
        15,
        "timed rounds (each gives one sample)",
        metavar="N",
        accepted="an integer ≥ 3",
    ),
    _opt(
        "timing-processes",
        parse_timing_processes,
        None,
        "processes the recapture's timing runs in, pooled, the interval resampling "
        "processes and reaching as far as their own ratios' spread allows (auto: 3 on a "
        "GPU, where a host-bound baseline's speed moves between processes; 1 on the CPU)",
        metavar="N",
        accepted="auto or an integer from 1 to 16",
        default_text="auto",
    ),
    _opt(
        "fresh-timing",
        lambda v: parse_bool(v, "--opprof-fresh-timing"),
        False,
        "start the recapture's timing processes past the first as new interpreters, not forks "
        "of the session's fork server, whose start a launch-bound call's speed moves with: "
        "the interval then covers that too (a torch import more per process)",
        flag=True,
    ),
    _opt(
        "timing-servers",
        parse_timing_servers,
        1,
        "fork servers the recapture's timing processes are spread over (process i from "
        "server i mod N), started in the background at a workload's first stage: the "
        "interval then covers what a server fixes at its start (a torch import more per "
        "server and pytest process; no effect with --opprof-fresh-timing)",
        metavar="N",
        accepted="an integer from 1 to 8",
    ),
    _opt(
        "timeout",
        parse_positive_float("--opprof-timeout"),
        900.0,
        "seconds a stage's child process may run before it is killed",
        metavar="S",
        accepted="a number > 0",
    ),
    _opt(
        "progress",
        parse_count("--opprof-progress", minimum=0),
        30,
        "every S seconds, a line in the terminal per stage process running longer than that: "
        "its workload, task, seconds so far and what it last did (0: none)",
        metavar="S",
        accepted="an integer ≥ 0",
    ),
    _opt(
        "strict-gate",
        lambda v: parse_bool(v, "--opprof-strict-gate"),
        False,
        "demand the speedup's CI wholly above the minimum",
        flag=True,
    ),
    _opt(
        "gate-on-cpu",
        lambda v: parse_bool(v, "--opprof-gate-on-cpu"),
        False,
        "enforce the speedup gate on the CPU fallback too",
        flag=True,
    ),
    _opt(
        "llm",
        lambda v: parse_bool(v, "--opprof-llm"),
        False,
        "ask the Anthropic API to review and extend the proposals",
        flag=True,
    ),
    _opt(
        "junit",
        parse_junit,
        "",
        "write a stage-level JUnit XML file here",
        metavar="PATH",
        accepted="a file path",
        default_text="none",
    ),
    _opt(
        "shard",
        parse_shard,
        "",
        "run shard K of N of the workloads",
        metavar="K/N",
        accepted="K/N with 1 ≤ K ≤ N",
        default_text="all workloads",
    ),
    _opt(
        "save",
        parse_save,
        None,
        "store this run (latencies with their rounds, speedups, plan, machine, commit) in "
        "--opprof-storage, numbered, as NAME (bare: auto, named after the git branch); write "
        "--opprof-save=NAME before paths",
        metavar="NAME",
        const="auto",
        accepted=f"auto or a NAME of up to 64 {RUN_NAME_CHARS}, not all digits",
        default_text="not stored",
    ),
    _opt(
        "compare",
        parse_compare,
        None,
        "compare each workload with the same workload in a stored run: last (bare), its "
        "NUMBER, its NAME or branch, or the PATH of its file",
        metavar="RUN",
        const="last",
        accepted="last, NUMBER, NAME or PATH",
        default_text="no comparison",
    ),
    _opt(
        "compare-fail",
        parse_compare_fail,
        (),
        "with --opprof-compare, fail a workload whose figure regressed past N% with "
        "certainty (its CI wholly past it)",
        metavar="EXPR",
        accepted="METRIC:N%[,…] with METRIC one of: " + ", ".join(COMPARE_METRICS),
        default_text="none",
    ),
    _opt(
        "storage",
        parse_storage,
        Path(".opprof-runs"),
        "folder of the stored runs",
        metavar="DIR",
        accepted="a folder",
    ),
)

BY_FIELD: dict[str, OptionSpec] = {spec.field: spec for spec in OPTIONS}


@dataclass(frozen=True)
class OpprofOptions:
    """Parsed options of one run. Field names are the option nouns in snake_case."""

    out: Path = Path("opprof-results")
    from_: str | None = None
    stage: str | None = None
    min_speedup: float = 1.0
    baseline: str = "best"
    stock: bool = False
    warm_rungs: bool = False
    compile_backend: str = "inductor"
    device: str = "auto"
    ncu: str = "auto"
    ncu_when: str = "beside"
    ncu_sudo: str = "auto"
    ncu_clock_control: str = "none"
    ncu_replay: str = "auto"
    min_confidence: str = "low"
    max_opts: int | None = None
    warmup_iters: int = 10
    measure_iters: int = 30
    rounds: int = 15
    timing_processes: int | None = None
    fresh_timing: bool = False
    timing_servers: int = 1
    timeout: float = 900.0
    progress: int = 30
    strict_gate: bool = False
    gate_on_cpu: bool = False
    llm: bool = False
    junit: Path | None = None
    shard: tuple[int, int] | None = None
    save: str | None = None
    compare: str | None = None
    compare_fail: tuple[CompareRule, ...] = ()
    storage: Path = Path(".opprof-runs")
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.compare_fail and self.compare is None:
            raise pytest.UsageError(
                "--opprof-compare-fail needs --opprof-compare: the stored run to compare with "
                "(e.g. --opprof-compare=last)"
            )

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> OpprofOptions:
        """Parse raw values (strings from the command line or ini) keyed by option field."""
        parsed: dict[str, Any] = {}
        for name, raw in values.items():
            spec = BY_FIELD[name]
            value = raw if raw is None or raw == spec.default else spec.parse(raw)
            if name in ("out",) and isinstance(value, str):
                value = Path(value)
            if name == "junit" and value == "":
                value = None
            if name == "shard" and value == "":
                value = None
            parsed["from_" if name == "from" else name] = value
        return cls(**parsed)

    def to_child(self) -> dict[str, Any]:
        """The options a child process needs, as JSON-able values."""
        data = dataclasses.asdict(self)
        data["out"] = str(self.out)
        data["junit"] = str(self.junit) if self.junit else None
        data["extra"] = dict(self.extra)
        for parent_only in PARENT_ONLY:  # history is read and written by the parent only
            data.pop(parent_only)
        return data

    @classmethod
    def from_child(cls, data: Mapping[str, Any]) -> OpprofOptions:
        values = dict(data)
        values["out"] = Path(values["out"])
        values["junit"] = Path(values["junit"]) if values.get("junit") else None
        values["shard"] = tuple(values["shard"]) if values.get("shard") else None
        return cls(**values)

    def stages_to_run(self) -> tuple[str, ...]:
        if self.stage:
            return (self.stage,)
        return STAGES


PARENT_ONLY: tuple[str, ...] = ("save", "compare", "compare_fail", "storage", "progress")
"""Options no stage process needs: ``to_child`` leaves them out."""


WORKLOAD_KEYS: dict[str, Callable[[Any], Any]] = {
    "min_speedup": lambda v: parse_positive_float("OPPROF['min_speedup']")(v),
    "rtol": lambda v: parse_positive_float("OPPROF['rtol']")(v),
    "atol": lambda v: parse_positive_float("OPPROF['atol']")(v),
    "baseline": choice("OPPROF['baseline']", ("eager", "compile", "best", "stock")),
    "warmup_iters": lambda v: parse_count("OPPROF['warmup_iters']")(v),
    "measure_iters": lambda v: parse_count("OPPROF['measure_iters']")(v),
    "rounds": lambda v: parse_count("OPPROF['rounds']", minimum=3)(v),
    "timing_processes": parse_timing_processes,
    "timeout": lambda v: parse_positive_float("OPPROF['timeout']")(v),
    "skip": lambda v: _parse_skip(v),
}


def _parse_skip(value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise pytest.UsageError(
            f"OPPROF['skip']: {value!r} is not a list of transformation types "
            f"({', '.join(TRANSFORMATION_TYPES)})"
        )
    for item in value:
        if item not in TRANSFORMATION_TYPES:
            raise pytest.UsageError(
                f"OPPROF['skip']: {item!r} is not a transformation type; accepted: "
                f"{', '.join(TRANSFORMATION_TYPES)}"
            )
    return list(value)


def parse_workload_overrides(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a workload's ``OPPROF`` dict; an unknown key is an error naming it."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in WORKLOAD_KEYS:
            raise pytest.UsageError(
                f"OPPROF: unknown key {key!r}; accepted keys: {', '.join(WORKLOAD_KEYS)}"
            )
        out[key] = WORKLOAD_KEYS[key](value)
    return out


_PYTEST_FLAG = re.compile(
    # a pytest command line (``pytest --opprof --opprof-save``, ``pytest: --opprof-ncu=off``):
    # a hint to run pytest, whose options keep pytest's spelling
    r"(?P<pytest>\bpytest:?(?: +--?[a-z][\w-]*(?:=[^\s,;)]*)?)+)"
    r"|--opprof-(?P<noun>[a-z][a-z-]*[a-z])"
)


def cli_spelling(text: str) -> str:
    """``text`` with each ``--opprof-<noun>`` of an option spelled ``--<noun>``, as the
    ``opprof`` command spells it: for the help and the messages that command prints. A
    pytest command line in ``text`` (``pytest`` and the options after it) keeps pytest's
    spelling: it tells the user what to run under pytest."""

    def respell(m: re.Match[str]) -> str:
        noun = m["noun"]
        return f"--{noun}" if noun is not None and noun in BY_NOUN else m[0]

    return _PYTEST_FLAG.sub(respell, text)


BY_NOUN: dict[str, OptionSpec] = {spec.noun: spec for spec in OPTIONS}


def add_cli_arguments(parser: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    """These options (by field) for a subcommand of ``opprof``, without the ``opprof-``
    prefix."""
    for name in fields:
        spec = BY_FIELD[name]
        help_text = cli_spelling(spec.argparse_help)
        if spec.flag:
            parser.add_argument(
                f"--{spec.noun}",
                dest=spec.field,
                action="store_true",
                default=spec.default,
                help=help_text,
            )
        else:
            parser.add_argument(
                f"--{spec.noun}",
                dest=spec.field,
                default=spec.default,
                metavar=spec.metavar,
                help=help_text,
                **spec.optional_value,
            )
