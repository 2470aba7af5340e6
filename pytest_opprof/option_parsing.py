"""The parsers of the options' values, and ``OptionSpec``: what ties an option to its parser.

Each parser takes a raw value (from the command line, an ini file or a workload's ``OPPROF``) and
returns the parsed value, or raises a ``pytest.UsageError`` naming the flag and the accepted
values. ``pytest_opprof.options`` holds the table of options built from them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_opprof import STAGES


def choice(name: str, accepted: tuple[str, ...]) -> Callable[[str], str]:
    """A parser of one of ``accepted`` (any case), named ``parse_<name>``; ``name`` is the flag
    (or the ``OPPROF`` key) its errors name."""

    def parse(value: str) -> str:
        text = str(value).strip().lower()
        if text not in accepted:
            raise pytest.UsageError(f"{name}: {value!r} is not one of {', '.join(accepted)}")
        return text

    parse.__name__ = f"parse_{name.strip('-').replace('-', '_')}"
    return parse


def parse_bool(value: str | bool, name: str = "value") -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise pytest.UsageError(f"{name}: {value!r} is not a boolean (true/false)")


def parse_positive_float(name: str, *, minimum: float = 0.0) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise pytest.UsageError(f"{name}: {value!r} is not a number") from None
        if not number > minimum or number != number or number == float("inf"):
            raise pytest.UsageError(f"{name}: {value!r} must be a finite number > {minimum:g}")
        return number

    return parse


def parse_count(name: str, *, minimum: int = 1, allow_none: bool = False) -> Callable[[str], Any]:
    def parse(value: str) -> int | None:
        if allow_none and str(value).strip().lower() in ("none", "all", ""):
            return None
        try:
            number = int(str(value).strip())
        except (TypeError, ValueError):
            accepted = f"an integer ≥ {minimum}" + (" or 'all'" if allow_none else "")
            raise pytest.UsageError(f"{name}: {value!r} is not {accepted}") from None
        if number < minimum:
            raise pytest.UsageError(f"{name}: {value!r} must be ≥ {minimum}")
        return number

    return parse


def parse_timing_processes(value: str | int | None) -> int | None:
    """``auto`` (None: 3 on a GPU, 1 on the CPU) or a count of processes, at most 16."""
    if value is None or str(value).strip().lower() == "auto":
        return None
    number = parse_count("--opprof-timing-processes")(str(value))
    if number is not None and number > 16:
        raise pytest.UsageError(f"--opprof-timing-processes: {value!r} must be ≤ 16 (or auto)")
    return number


def parse_timing_servers(value: str | int) -> int:
    """A count of fork servers, at most 8."""
    number = int(parse_count("--opprof-timing-servers")(str(value)))
    if number > 8:
        raise pytest.UsageError(f"--opprof-timing-servers: {value!r} must be ≤ 8")
    return number


def parse_stage(name: str) -> Callable[[str], str]:
    accepted = (*STAGES, "speedup")  # speedup: the report's old name

    def parse(value: str) -> str:
        text = str(value).strip().lower()
        if text not in accepted:
            raise pytest.UsageError(f"{name}: {value!r} is not one of {', '.join(STAGES)}")
        return "report" if text == "speedup" else text

    return parse


def parse_path(value: str) -> Path:
    if not str(value).strip():
        raise pytest.UsageError("--opprof-out: the output folder must not be empty")
    return Path(value)


def parse_junit(value: str) -> Path | None:
    return Path(value) if str(value).strip() else None


RUN_NAME_CHARS = "letters, digits, '.', '_' and '-'"


def parse_save(value: str) -> str:
    """``auto`` (named after the git branch) or a run's NAME: letters, digits, ``.``, ``_``,
    ``-``, not all digits (a number names a run by its number)."""
    text = str(value).strip()
    if text == "auto":
        return text
    if Path(text).exists() or "/" in text or os.sep in text:
        raise pytest.UsageError(
            f"--opprof-save: {value!r} is a path, not a run name: a bare --opprof-save takes "
            "the next word as its NAME, so write --opprof-save=NAME (or =auto) before paths"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text) or text.isdigit():
        raise pytest.UsageError(
            f"--opprof-save: {value!r} is not a run name: up to 64 {RUN_NAME_CHARS}, starting "
            "with a letter or digit, not all digits; or auto"
        )
    return text


def parse_compare(value: str) -> str:
    """The stored run to compare with: ``last``, a run's number, a run's name (or the branch
    it was saved on), or the path of a stored run's file (or of a storage folder: its last
    run). Checked when the run is loaded (``history.find_run``)."""
    text = str(value).strip()
    if not text:
        raise pytest.UsageError(
            "--opprof-compare: empty; give last, a run's NUMBER, NAME or branch, or a PATH"
        )
    return text


@dataclass(frozen=True)
class CompareRule:
    """One term of ``--opprof-compare-fail``: ``metric:N%``."""

    metric: str
    threshold: float
    """A fraction: 0.05 for 5%."""

    def __str__(self) -> str:
        return f"{self.metric}:{self.threshold * 100:g}%"


COMPARE_METRICS: tuple[str, ...] = ("latency", "eager", "compile", "optimized", "speedup")
"""latency: every variant timed in both runs; eager, compile, optimized: that variant's
latency; speedup: the optimized backend's speedup against the gate's baseline."""


def parse_compare_fail(value: str) -> tuple[CompareRule, ...]:
    """``METRIC:N%[,METRIC:N%…]``, e.g. ``latency:5%,speedup:10%``: fail where a figure
    regressed past N% with certainty (its CI wholly past it)."""
    form = (
        f"METRIC:N% with METRIC one of {', '.join(COMPARE_METRICS)} (comma-separated, e.g. "
        "latency:5%,speedup:10%)"
    )
    rules: list[CompareRule] = []
    for term in str(value).split(","):
        metric, sep, amount = term.strip().partition(":")
        metric, amount = metric.strip().lower(), amount.strip()
        if not sep or metric not in COMPARE_METRICS or not amount.endswith("%"):
            raise pytest.UsageError(f"--opprof-compare-fail: {term.strip()!r} is not {form}")
        try:
            percent = float(amount[:-1])
        except ValueError:
            raise pytest.UsageError(
                f"--opprof-compare-fail: {amount!r} is not a percentage (N%)"
            ) from None
        top = 100.0 if metric == "speedup" else float("inf")
        if not 0 < percent < top:
            bound = "between 0% and 100%" if metric == "speedup" else "above 0%"
            raise pytest.UsageError(
                f"--opprof-compare-fail: {term.strip()!r}: the threshold must be {bound}"
            )
        rules.append(CompareRule(metric, percent / 100))
    return tuple(rules)


def parse_storage(value: str) -> Path:
    if not str(value).strip():
        raise pytest.UsageError("--opprof-storage: the folder of stored runs must not be empty")
    return Path(value)


def parse_shard(value: str) -> tuple[int, int] | None:
    """``K/N`` (1 ≤ K ≤ N): run the K-th of N deterministic shards of the workloads."""
    text = str(value).strip()
    if not text:
        return None
    k, sep, n = text.partition("/")
    if sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n):
        return int(k), int(n)
    raise pytest.UsageError(f"--opprof-shard: {value!r} is not K/N with 1 ≤ K ≤ N (e.g. 1/2)")


@dataclass(frozen=True)
class OptionSpec:
    noun: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str | None = None
    flag: bool = False
    const: str | None = None
    """The value of the bare flag, for an option whose value is optional (``--opprof-save``,
    ``--opprof-save=NAME``): it takes the next word unless that starts with ``-``."""
    accepted: str = ""
    """The accepted values in words, as ``--help`` shows them (``one of: eager, compile``)."""
    default_text: str = ""
    """The default in words, where ``str(default)`` says nothing (None, an empty tuple)."""

    @property
    def dest(self) -> str:
        return "opprof_" + self.noun.replace("-", "_")

    @property
    def field(self) -> str:
        return self.noun.replace("-", "_")

    @property
    def values(self) -> str:
        """``(default: X; one of: a, b)``: what ``--help`` shows after the help text."""
        default = self.default_text or ("off" if self.flag else str(self.default))
        return f"(default: {default}" + (f"; {self.accepted}" if self.accepted else "") + ")"

    @property
    def argparse_help(self) -> str:
        """The help text with its default and accepted values, as argparse reads it (``%``
        escaped: it formats help strings)."""
        return f"{self.help} {self.values}".replace("%", "%%")

    @property
    def optional_value(self) -> dict[str, Any]:
        """argparse's keywords for a value that may be left out (``nargs="?"``)."""
        return {} if self.const is None else {"nargs": "?", "const": self.const}
