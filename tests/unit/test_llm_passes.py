"""LLM-written pass code for a type the library lacks: stage 3 runs it apart from the backend,
on the baseline's Dynamo graph, and checks it against eager (issue #12) — as a task, and
through the real stages, where selection never runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_opprof.options import OpprofOptions
from pytest_opprof.schema import ChildSpec
from pytest_opprof.stages.validate import task_validate_llm_passes

WORKLOAD = """
import torch

def get_model_and_input():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return model.to("cuda").eval(), torch.randn(3, 8, device="cuda")
"""

HEADER = "import torch\nimport torch.nn.functional as F\n\n"

PASSES = {
    # relu(x) -> clamp_min(x, 0): the same function, so it is applied and checked.
    "good": HEADER
    + textwrap.dedent(
        """
        def apply(gm, example_inputs):
            n = 0
            for node in list(gm.graph.nodes):
                if node.op == "call_function" and node.target in (torch.relu, F.relu):
                    node.target, node.args, node.kwargs = torch.clamp_min, (node.args[0], 0.0), {}
                    n += 1
            return n
        """
    ),
    # Zeroes the output: the checks must refuse it.
    "cheat": HEADER
    + textwrap.dedent(
        """
        def apply(gm, example_inputs):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
            with gm.graph.inserting_before(out):
                zero = gm.graph.call_function(torch.zeros_like, (first,))
            out.args = ((zero,),) if isinstance(out.args[0], (tuple, list)) else (zero,)
            return 1
        """
    ),
    "raises": HEADER + "def apply(gm, example_inputs):\n    raise RuntimeError('boom')\n",
    "nothing": HEADER + "def apply(gm, example_inputs):\n    return 0\n",
    "no_apply": HEADER + "def rewrite(gm):\n    return 0\n",
    "syntax": "def apply(gm, example_inputs)\n    return 0\n",
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("llm")
    workload = tmp / "w.py"
    workload.write_text(WORKLOAD, encoding="utf-8")
    files = []
    for name, code in PASSES.items():
        path = tmp / "llm_passes" / f"llm-{name}-1.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(code, encoding="utf-8")
        files.append({"id": f"llm-{name}-1", "file": str(path)})
    result = tmp / "result.json"
    spec = ChildSpec(
        task="validate_llm_passes",
        workload=str(workload),
        options=OpprofOptions(device="cpu").to_child(),
        passes=files,
        result=result,
    )
    task_validate_llm_passes(spec)
    data = json.loads(result.read_text(encoding="utf-8"))
    return {p["name"].split("-")[1]: p for p in data["llm_passes"]}


def test_a_correct_pass_is_applied_and_checked(checked: dict[str, dict[str, object]]) -> None:
    good = checked["good"]
    assert (good["status"], good["matches"]) == ("APPLIED", 1)
    assert "passed every check" in str(good["detail"])
    assert "not part of the backend" in str(good["detail"])


@pytest.mark.parametrize(
    ("name", "status", "says"),
    [
        ("cheat", "FAILED", "equivalent"),
        ("raises", "FAILED", "RuntimeError: boom"),
        ("nothing", "NOT_APPLIED", "changed no site"),
        ("no_apply", "FAILED", "defines no apply"),
        ("syntax", "FAILED", "SyntaxError"),
    ],
)
def test_bad_passes_are_refused_with_a_reason(
    checked: dict[str, dict[str, object]], name: str, status: str, says: str
) -> None:
    assert checked[name]["status"] == status
    assert says in str(checked[name]["detail"])


def test_the_report_says_it_ran_apart(tmp_path: Path) -> None:
    from pytest_opprof.report.markdown import proposal_status
    from pytest_opprof.schema import PassStatus, Proposal, StepResult, ValidationReport

    proposal = Proposal.model_validate(
        {
            "id": "llm-good-1",
            "type": "good",
            "ir_level": "functional",
            "source": "llm",
            "targets": ["relu"],
            "evidence": [],
            "fx_steps": [],
            "confidence": "low",
            "impact": {"estimated_saving_us": 1.0, "estimated_speedup": 1.01, "basis": "x"},
            "params": {"implemented": False, "pass_file": "llm_passes/llm-good-1.py"},
        }
    )
    report = ValidationReport(
        file="w_optimized.py",
        backend="opprof_w",
        steps={"syntax": StepResult(status="pass", detail="")},
        overall="READY_FOR_PROFILING",
        llm_passes=[PassStatus(name="llm-good-1", status="APPLIED", detail="fine", matches=1)],
    )
    from types import SimpleNamespace

    artifacts = SimpleNamespace(selection=None, validation=report)
    status = proposal_status(artifacts, proposal)  # type: ignore[arg-type]
    assert status.startswith("LLM-written code, not in the backend; stage 3 ran it apart: APPLIED")


@pytest.mark.slow
def test_llm_pass_code_runs_only_in_stage_3(tmp_path: Path, fast_opprof_args: list[str]) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pytest", "--opprof", *fast_opprof_args, "w.py", *args]
        return subprocess.run(
            command, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
        )

    (tmp_path / "w.py").write_text(WORKLOAD)
    for stage in ("capture", "propose"):
        first = run(f"--opprof-stage={stage}")
        assert first.returncode == 0, first.stdout + first.stderr
    out = tmp_path / "opprof-results" / "w"
    (out / "llm_passes").mkdir()
    (out / "llm_passes" / "llm-relu_as_clamp-1.py").write_text(PASSES["good"])
    opt = json.loads((out / "optimizations.json").read_text())
    opt["proposals"].append(
        {
            "id": "llm-relu_as_clamp-1",
            "type": "relu_as_clamp",
            "ir_level": "functional",
            "source": "llm",
            "targets": ["relu"],
            "evidence": [],
            "fx_steps": ["relu(x) -> clamp_min(x, 0)"],
            "confidence": "low",
            "impact": {"estimated_saving_us": 0.0, "estimated_speedup": 1.0, "basis": "none"},
            "params": {"implemented": False, "pass_file": "llm_passes/llm-relu_as_clamp-1.py"},
        }
    )
    (out / "optimizations.json").write_text(json.dumps(opt))

    done = run("--opprof-from=backend", "--opprof-stage=validate")
    assert done.returncode == 0, done.stdout + done.stderr
    selection = json.loads((out / "profiler_output" / "backend_selection.json").read_text())
    reason = next(d["reason"] for d in selection["dropped"] if d["id"] == "llm-relu_as_clamp-1")
    assert "selection does not run LLM-written code" in reason and "stage 3 checks" in reason
    report = json.loads((out / "profiler_output" / "validation_report.json").read_text())
    (checked,) = report["llm_passes"]
    assert (checked["name"], checked["status"], checked["matches"]) == (
        "llm-relu_as_clamp-1",
        "APPLIED",
        1,
    )
    generated = (out / "w_optimized.py").read_text()
    # Never part of the backend: named only in the docstring's list of dropped proposals.
    assert "'relu_as_clamp'" not in generated and "import llm" not in generated
    assert "llm-relu_as_clamp-1: no pass implements this type" in generated
