"""LLM-written pass code for a type the library lacks: stage 3 runs it apart from the backend,
on the baseline's Dynamo graph, and checks it against eager (issue #12)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pytest_opprof.options import OpprofOptions
from pytest_opprof.runner import task_validate_llm_passes

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
    spec = {
        "workload": str(workload),
        "options": OpprofOptions(device="cpu").to_child(),
        "passes": files,
        "result": str(result),
    }
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
