from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_opprof.options import (
    BY_FIELD,
    OPTIONS,
    CompareRule,
    OpprofOptions,
    cli_spelling,
    parse_shard,
    parse_workload_overrides,
)


def test_defaults_parse() -> None:
    opts = OpprofOptions.from_values({s.field: s.default for s in OPTIONS})
    assert opts.out == Path("opprof-results")
    assert opts.baseline == "best" and opts.min_speedup == 1.0 and opts.ncu == "auto"
    assert opts.warm_rungs is False  # experimental: off until measured on a GPU
    assert opts.stages_to_run()[-1] == "report"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("min_speedup", "1.5", 1.5),
        ("baseline", "Compile", "compile"),
        ("device", "cpu", "cpu"),
        ("ncu", "off", "off"),
        ("ncu_sudo", "true", "true"),
        ("ncu_clock_control", "base", "base"),
        ("ncu_replay", "unique", "unique"),
        ("ncu_when", "first", "first"),
        ("min_confidence", "high", "high"),
        ("max_opts", "3", 3),
        ("max_opts", "all", None),
        ("warmup_iters", "5", 5),
        ("rounds", "3", 3),
        ("from", "speedup", "report"),
        ("stage", "propose", "propose"),
        ("shard", "2/3", (2, 3)),
        ("strict_gate", "true", True),
        ("fresh_timing", "true", True),
        ("stock", "true", True),
        ("warm_rungs", "true", True),
        ("warm_rungs", "0", False),
        ("progress", "0", 0),
        ("baseline", "stock", "stock"),
        ("timing_servers", "3", 3),
        ("save", "auto", "auto"),
        ("save", "nightly-2026.12", "nightly-2026.12"),
        ("compare", "last", "last"),
        ("compare", "3", "3"),
        ("storage", "perf/runs", Path("perf/runs")),
    ],
)
def test_accepted_values(field: str, value: str, expected: object) -> None:
    opts = OpprofOptions.from_values({field: value})
    assert getattr(opts, "from_" if field == "from" else field) == expected


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("min_speedup", "fast", "not a number"),
        ("min_speedup", "0", "> 0"),
        ("min_speedup", "nan", "finite"),
        ("baseline", "fastest", "eager, compile, best"),
        ("device", "tpu", "auto, cuda, cpu"),
        ("ncu", "maybe", "auto, on, off"),
        ("ncu_sudo", "yes please", "auto, true, false"),
        ("ncu_clock_control", "max", "none, base"),
        ("ncu_replay", "some", "auto, all, unique"),
        ("ncu_when", "after", "beside, first"),
        ("min_confidence", "certain", "low, medium, high"),
        ("max_opts", "-1", "≥ 1"),
        ("max_opts", "many", "integer"),
        ("warmup_iters", "0", "≥ 1"),
        ("rounds", "2", "≥ 3"),
        ("from", "compile", "capture, propose"),
        ("stage", "x", "capture, propose"),
        ("compile_backend", "tvm", "inductor"),
        ("shard", "3/2", "K/N"),
        ("timeout", "-5", "> 0"),
        ("strict_gate", "perhaps", "boolean"),
        ("gate_on_cpu", "perhaps", "boolean"),
        ("llm", "perhaps", "boolean"),
        ("fresh_timing", "perhaps", "boolean"),
        ("stock", "perhaps", "boolean"),
        ("warm_rungs", "ahead", "boolean"),
        ("progress", "soon", "integer"),
        ("timing_servers", "0", "≥ 1"),
        ("timing_servers", "9", "≤ 8"),
        ("timing_servers", "many", "integer"),
        ("measure_iters", "0", "≥ 1"),
        ("timing_processes", "0", "≥ 1"),
        ("timing_processes", "17", "≤ 16"),
        ("timing_processes", "several", "integer"),
        ("save", "examples/", "is a path, not a run name"),
        ("save", "1234", "not all digits"),
        ("save", "a b", "not a run name"),
        ("compare", "  ", "empty; give last"),
        ("compare_fail", "latency:5", "METRIC:N%"),
        ("compare_fail", "memory:5%", "latency, eager, compile, optimized, speedup"),
        ("compare_fail", "speedup:100%", "between 0% and 100%"),
        ("compare_fail", "latency:-5%", "above 0%"),
        ("compare_fail", "latency:five%", "not a percentage"),
        ("storage", " ", "must not be empty"),
    ],
)
@pytest.mark.reliability
def test_rejected_values_name_the_accepted_form(field: str, value: str, accepted: str) -> None:
    with pytest.raises(pytest.UsageError, match=accepted):
        OpprofOptions.from_values({field: value})


def test_compare_fail_takes_rules_and_needs_a_run_to_compare_with() -> None:
    opts = OpprofOptions.from_values(
        {"compare": "last", "compare_fail": "latency:5%, Speedup:12.5%"}
    )
    assert opts.compare_fail == (CompareRule("latency", 0.05), CompareRule("speedup", 0.125))
    assert [str(r) for r in opts.compare_fail] == ["latency:5%", "speedup:12.5%"]
    with pytest.raises(pytest.UsageError, match="needs --opprof-compare"):
        OpprofOptions.from_values({"compare_fail": "latency:5%"})


def test_history_options_stay_with_the_parent() -> None:
    opts = OpprofOptions.from_values({"save": "auto", "compare": "2", "compare_fail": "eager:5%"})
    child = opts.to_child()
    assert not {"save", "compare", "compare_fail", "storage"} & set(child)
    assert OpprofOptions.from_child(child).compare is None


def test_timing_processes_auto_or_a_count() -> None:
    assert OpprofOptions.from_values({"timing_processes": "auto"}).timing_processes is None
    assert OpprofOptions.from_values({"timing_processes": "4"}).timing_processes == 4
    assert parse_workload_overrides({"timing_processes": 2}) == {"timing_processes": 2}


def test_shard_empty_is_none() -> None:
    assert parse_shard("") is None


def test_workload_overrides() -> None:
    assert parse_workload_overrides({"min_speedup": 1.2, "skip": ["bn_fold"]}) == {
        "min_speedup": 1.2,
        "skip": ["bn_fold"],
    }
    with pytest.raises(pytest.UsageError, match=r"unknown key 'speed'.*min_speedup"):
        parse_workload_overrides({"speed": 2})
    with pytest.raises(pytest.UsageError, match="not a transformation type"):
        parse_workload_overrides({"skip": ["magic"]})


def test_child_round_trip() -> None:
    opts = OpprofOptions.from_values({"out": "x", "junit": "j.xml", "shard": "1/2"})
    assert OpprofOptions.from_child(opts.to_child()) == opts


FREE_FORM = {"out", "junit"}  # any path is accepted


def test_every_option_has_a_rejected_value_above() -> None:
    """Issue #13: every option that can be given a wrong value has a case in the table."""
    import inspect

    source = inspect.getsource(test_rejected_values_name_the_accepted_form)
    table = inspect.getsource(sys.modules[__name__])
    cases = table[table.index("def test_accepted_values") :]
    missing = [
        o.field for o in OPTIONS if o.field not in FREE_FORM and f'("{o.field}", ' not in cases
    ]
    assert missing == [], missing
    assert "pytest.UsageError" in source


def test_every_option_says_its_default_and_accepted_values() -> None:
    """The help of pytest and of ``opprof`` ends with them (issue #41)."""
    for spec in OPTIONS:
        assert spec.values.startswith("(default: "), spec.noun
        assert spec.flag or spec.accepted, spec.noun
        assert spec.argparse_help.endswith(spec.values.replace("%", "%%")), spec.noun
    assert BY_FIELD["baseline"].values == "(default: best; one of: eager, compile, best, stock)"
    assert BY_FIELD["max_opts"].values == "(default: all; an integer ≥ 1 or all)"
    assert BY_FIELD["strict_gate"].values == "(default: off)"


def test_cli_spelling_names_the_commands_own_options() -> None:
    assert (
        cli_spelling("run with --opprof-ncu-sudo=true, or raise --opprof-timeout.")
        == "run with --ncu-sudo=true, or raise --timeout."
    )
    assert cli_spelling("--opprof-compare-fail needs --opprof-compare") == (
        "--compare-fail needs --compare"
    )
    assert cli_spelling("pytest --opprof --opprof-nonsense") == "pytest --opprof --opprof-nonsense"


def test_cli_spelling_leaves_a_pytest_command_line_alone() -> None:
    """A hint to run pytest names pytest's options; the command's own are respelled."""
    assert cli_spelling(
        "save one with opprof optimize --opprof-save, or pytest --opprof --opprof-save"
    ) == ("save one with opprof optimize --save, or pytest --opprof --opprof-save")
    assert cli_spelling("pytest --opprof --opprof-save=main, then --opprof-compare") == (
        "pytest --opprof --opprof-save=main, then --compare"
    )
    assert cli_spelling("run with --opprof-ncu-sudo=true (pytest: --opprof-ncu-sudo=true)") == (
        "run with --ncu-sudo=true (pytest: --opprof-ncu-sudo=true)"
    )
    assert cli_spelling("pytest_opprof_select_baseline: --opprof-stock") == (
        "pytest_opprof_select_baseline: --stock"
    )
