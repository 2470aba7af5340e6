"""The ``opprof`` command: validate (also on an edited backend), propose, preflight, usage."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_opprof import __version__, cli
from pytest_opprof.backend.codegen import render_optimized, render_test
from pytest_opprof.options import OPTIONS, cli_spelling
from pytest_opprof.schema import BackendPlan, BackendSelection, ValidationReport, read_artifact

ROOT = Path(__file__).parents[2]

WORKLOAD = """
import torch
from torch import nn

def get_model_and_input():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("cuda").eval()
    return model, torch.randn(3, 8, device="cuda")
"""

EDITS = {
    "scaled output": (
        "    return model, x\n",
        "    return _Scaled(model).eval(), x\n\n\nclass _Scaled(torch.nn.Module):\n"
        "    def __init__(self, inner):\n        super().__init__()\n        self.inner = inner\n\n"
        "    def forward(self, x):\n        return self.inner(x) * 1.05\n",
        "equivalent",
    ),
    "cached output": (
        "    return model, x\n",
        "    return _Cached(model).eval(), x\n\n\nclass _Cached(torch.nn.Module):\n"
        "    def __init__(self, inner):\n        super().__init__()\n        self.inner = inner\n"
        "        self.memo = None\n\n"
        "    @torch.compiler.disable\n"
        "    def forward(self, x):\n        if self.memo is None:\n"
        "            self.memo = self.inner(x)\n        return self.memo\n",
        "test_numerically_equivalent_to_baseline",
    ),
}


def _opprof(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_opprof.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _generated(tmp_path: Path) -> Path:
    (tmp_path / "work").mkdir()
    workload = tmp_path / "work" / "small.py"
    workload.write_text(textwrap.dedent(WORKLOAD))
    out = tmp_path / "opprof-results" / "small"
    out.mkdir(parents=True)
    selection = BackendSelection(
        workload="small",
        reference="eager",
        reference_ms=1.0,
        variants=[],
        chosen="eager",
        plan=BackendPlan(),
    )
    generated = out / "small_optimized.py"
    generated.write_text(
        render_optimized(
            stem="small",
            workload=workload,
            out_file=generated,
            selection=selection,
            proposals=[],
            rtol=1e-4,
            atol=1e-5,
        )
    )
    (out / "test_small_optimized.py").write_text(render_test(stem="small"))
    return generated


@pytest.mark.slow
def test_validate_a_generated_backend_and_its_edits(tmp_path: Path) -> None:
    generated = _generated(tmp_path)
    ok = _opprof("validate", str(generated), "--device=cpu", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "READY_FOR_PROFILING" in ok.stdout
    report = read_artifact(
        generated.parent / "profiler_output/validation_report.json", ValidationReport
    )
    assert [s.status for s in report.steps.values()] == ["pass"] * 6

    original = generated.read_text()
    for name, (old, new, check) in EDITS.items():
        generated.write_text(original.replace(old, new))
        bad = _opprof("validate", str(generated), "--device=cpu", cwd=tmp_path)
        assert bad.returncode == 1, name
        assert "BLOCKED — fix step" in bad.stdout, (name, bad.stdout)
        assert check in bad.stdout, (name, bad.stdout)

    generated.write_text(original.replace("import torch\n", "import torch\nimport (\n", 1))
    broken = _opprof("validate", str(generated), "--device=cpu", cwd=tmp_path)
    assert "BLOCKED — fix step 1 (syntax)" in broken.stdout


def _h200_conv_block(folder: Path) -> None:
    """conv_block's profile and Dynamo graph from the H200 (tests/data/h200/conv_block)."""
    for name in ("profile.json", "graph.json"):
        packed = ROOT / "tests" / "data" / "h200" / "conv_block" / f"{name}.gz"
        (folder / name).write_bytes(gzip.decompress(packed.read_bytes()))


def test_propose_from_a_real_h200_profile(tmp_path: Path) -> None:
    _h200_conv_block(tmp_path)
    result = _opprof("propose", str(tmp_path / "profile.json"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    proposals = json.loads((tmp_path / "optimizations.json").read_text())["proposals"]
    assert {"memory_layout", "bn_fold"} <= {p["type"] for p in proposals}
    assert "memory_layout" in result.stdout


@pytest.mark.reliability
def test_usage_errors_name_the_accepted_values(tmp_path: Path) -> None:
    result = _opprof("optimize", "x.py", "--baseline=fastest", cwd=tmp_path)
    assert result.returncode == 2
    assert "eager, compile, best" in result.stderr
    missing = _opprof("optimize", "nope.py", cwd=tmp_path)
    assert missing.returncode == 1 and "nope.py: not found" in missing.stderr
    (tmp_path / "plain.py").write_text("x = 1\n")
    plain = _opprof("optimize", "plain.py", cwd=tmp_path)
    assert plain.returncode == 1 and "plain.py: not a workload" in plain.stderr


def test_preflight_reports_the_cpu_fallback(tmp_path: Path) -> None:
    result = _opprof("preflight", cwd=tmp_path)
    assert "torch installed" in result.stdout
    assert "CPU fallback" in result.stdout or "CUDA device" in result.stdout


def test_propose_llm_without_a_key_keeps_the_rules(tmp_path: Path) -> None:
    _h200_conv_block(tmp_path)
    plain = _opprof("propose", str(tmp_path / "profile.json"), cwd=tmp_path)
    rules = (tmp_path / "optimizations.json").read_text()
    env_free = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest_opprof.cli",
            "propose",
            str(tmp_path / "profile.json"),
            "--llm",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"},
    )
    assert plain.returncode == 0 and env_free.returncode == 0, env_free.stderr
    assert "ANTHROPIC_API_KEY is not set" in env_free.stdout
    assert (tmp_path / "optimizations.json").read_text() == rules


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``opprof COMMAND --help``, unwrapped (one line per option: COLUMNS is set wide)."""
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"opprof {__version__}"


# pytest's own: its JUnit file, its shards, its terminal's progress lines
PIPELINE = {spec.noun for spec in OPTIONS} - {"junit", "shard", "progress"}
TIMING = {"warmup-iters", "measure-iters", "rounds"}
OWN_OPTIONS = {
    "optimize": PIPELINE,
    "capture": {
        *("out", "device", "timeout", "compile-backend"),
        *TIMING,
        *("ncu", "ncu-when", "ncu-sudo", "ncu-clock-control", "ncu-replay"),
    },
    "recapture": {
        *("out", "device", "timeout", "compile-backend", "stock"),
        *TIMING,
        *("timing-processes", "fresh-timing", "timing-servers"),
    },
    # device and timeout: a backend edited since its validation is validated again first
    "report": {
        *("out", "device", "timeout", "min-speedup", "baseline", "strict-gate", "gate-on-cpu"),
        *("save", "compare", "compare-fail", "storage"),
    },
    "propose": {"min-confidence", "max-opts", "llm", "out"},
    # the selection's timing has a fixed warmup: no --warmup-iters
    "backend": {
        *("device", "timeout", "compile-backend", "stock", "measure-iters", "rounds"),
        "warm-rungs",
    },
    "validate": {"device", "timeout"},
    "merge": {"out"},
    "preflight": set(),
    "runs": {"storage"},
    "trend": {"storage", "out", "last", "no-plots"},
    "export": {"storage", "out"},
}


@pytest.mark.parametrize("command", sorted(OWN_OPTIONS))
def test_each_subcommand_offers_only_its_own_options(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    offered = set(re.findall(r"^  --([a-z-]+)", _help(command, capsys), re.MULTILINE))
    assert offered == OWN_OPTIONS[command]


@pytest.mark.parametrize(
    "argv",
    [
        ["propose", "profile.json", "--rounds=5"],
        # the recapture's options belong to recapture, not to capture
        ["capture", "w.py", "--timing-processes=3"],
        ["capture", "w.py", "--fresh-timing"],
        ["capture", "w.py", "--stock"],
        ["capture", "w.py", "--profile-name=optimized"],
        ["backend", "w.py", "optimizations.json", "--warmup-iters=5"],
    ],
)
def test_an_option_of_another_subcommand_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert f"unrecognized arguments: {argv[-1]}" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(OWN_OPTIONS))
def test_every_positional_argument_has_help(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    text = _help(command, capsys)
    usage = re.sub(r"\[[^]]*\]", "", text.split("\n\n")[0])  # the usage less its options
    names = set(re.findall(r"\b[A-Z][A-Z_]+\b", usage.split(command, 1)[1]))
    listed = text.split("positional arguments:\n")[1].split("\n\n")[0] if names else ""
    for name in names:
        assert re.search(rf"^  {name} +\S", listed, re.MULTILINE), (name, text)
    if command == "export":  # optional: only in brackets in the usage
        assert re.search(r"^  RUN +the stored run .*\(default: last; ", text, re.MULTILINE)


@pytest.mark.parametrize("command", sorted(OWN_OPTIONS))
def test_the_help_gives_every_default_and_the_accepted_values(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    # one line an option: argparse puts the help of a long flag on the next line
    text = re.sub(r"\n {4,}", " ", _help(command, capsys))
    lines = [line for line in text.splitlines() if line.startswith("  --")]
    assert len(lines) == len(OWN_OPTIONS[command])
    for line in lines:
        assert re.search(r"\(default: [^;()]+(; .+)?\)$", line), line
    for spec in OPTIONS:
        # propose's --out is its own: the file it writes
        if spec.noun in OWN_OPTIONS[command] and (command, spec.noun) != ("propose", "out"):
            [line] = [line for line in lines if line.startswith(f"  --{spec.noun} ")]
            assert line.endswith(cli_spelling(spec.values)), line


def test_the_help_names_the_choices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    text = _help("optimize", capsys)
    assert "(default: best; one of: eager, compile, best, stock)" in text
    assert "(default: auto; one of: auto, cuda, cpu)" in text
    assert "(default: 15; an integer ≥ 3)" in text
    assert "--opprof-" not in text


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("--min-speedup=0", "--min-speedup: '0' must be a finite number > 0"),
        ("--baseline=fastest", "--baseline: 'fastest' is not one of eager, compile, best"),
        ("--rounds=2", "--rounds: '2' must be ≥ 3"),
        ("--timing-processes=17", "--timing-processes: '17' must be ≤ 16 (or auto)"),
        ("--save=12", "--save: '12' is not a run name"),
        ("--compare-fail=latency:5%", "--compare-fail needs --compare"),
    ],
)
def test_usage_errors_name_the_commands_own_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argument: str, message: str
) -> None:
    (tmp_path / "w.py").write_text(textwrap.dedent(WORKLOAD))
    assert cli.main(["optimize", str(tmp_path / "w.py"), argument]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--opprof-" not in err


def test_a_hint_to_run_pytest_keeps_the_pytest_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hint names pytest's option (``--opprof-save``) beside the command's own
    (``--save``): the respelling for the command leaves a pytest command line alone."""
    assert cli.main(["trend", "--storage", str(tmp_path / "nonexistent_dir")]) == 1
    err = capsys.readouterr().err
    assert "opprof optimize --save, or pytest --opprof --opprof-save" in err, err
    assert "pytest --opprof --save" not in err


def test_propose_writes_where_out_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    _h200_conv_block(tmp_path / "run")
    profile = str(tmp_path / "run" / "profile.json")
    target = tmp_path / "elsewhere" / "conv_block.optimizations.json"
    assert cli.main(["propose", profile, "--out", str(target)]) == 0
    assert f"wrote {target}" in capsys.readouterr().out
    assert {"memory_layout", "bn_fold"} <= {
        p["type"] for p in json.loads(target.read_text())["proposals"]
    }
    assert not (tmp_path / "run" / "optimizations.json").exists()

    folder = tmp_path / "folder"
    folder.mkdir()
    assert cli.main(["propose", profile, "--out", str(folder)]) == 0
    assert (folder / "optimizations.json").read_text() == target.read_text()

    assert cli.main(["propose", profile, "--out", f"{tmp_path / 'new'}/"]) == 0
    assert (tmp_path / "new" / "optimizations.json").read_text() == target.read_text()

    assert cli.main(["propose", profile]) == 0  # the default: beside the profile
    assert (tmp_path / "run" / "optimizations.json").read_text() == target.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["optimize", "nope.py"],
        ["capture", "nope.py"],
        ["recapture", "nope.py"],
        ["report", "nope.py"],
        ["propose", "nope/profile.json"],
        ["backend", "nope.py", "optimizations.json"],
        ["backend", "w.py", "nope/optimizations.json"],
        ["validate", "nope_optimized.py"],
        ["merge", "shard-1", "nope"],
        ["export", "nope/0001.json"],
    ],
)
def test_a_missing_input_says_not_found(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.py").write_text(textwrap.dedent(WORKLOAD))
    (tmp_path / "optimizations.json").write_text("{}")
    (tmp_path / "shard-1").mkdir()
    missing = next(a for a in argv[1:] if a.startswith("nope"))
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == f"opprof: {missing}: not found\n"


def test_a_stage_reused_but_never_run_names_what_to_run_in_the_cli_s_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``opprof report`` on a workload whose stages never ran: the message says which command
    runs the missing stage, and names no option that ``report`` does not offer."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.py").write_text(textwrap.dedent(WORKLOAD))
    assert cli.main(["report", "w.py", "--out", str(tmp_path / "out")]) == 1
    said = capsys.readouterr().out
    hint = "run it first (opprof capture WORKLOAD, or pytest --opprof --opprof-from=capture)"
    assert hint in said
    assert " --from" not in said and "--stage" not in said
