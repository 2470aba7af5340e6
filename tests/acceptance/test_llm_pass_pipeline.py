"""An LLM proposal of a type the library lacks, carrying pass code, through the real stages:
selection never runs it, stage 3 runs it apart and the validation report says what it did."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FAST = [
    "--opprof-warmup-iters=1",
    "--opprof-measure-iters=2",
    "--opprof-rounds=3",
    "--opprof-device=cpu",
    "-p",
    "no:cacheprovider",
]

TINY = """
import torch
from torch import nn


def get_model_and_input():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("cuda").eval()
    return model, torch.randn(4, 8, device="cuda")
"""

PASS = """
import torch
import torch.nn.functional as F


def apply(gm, example_inputs):
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (torch.relu, F.relu):
            node.target, node.args, node.kwargs = torch.clamp_min, (node.args[0], 0.0), {}
            n += 1
        elif node.op == "call_module" and type(gm.get_submodule(node.target)).__name__ == "ReLU":
            node.op, node.target, node.kwargs = "call_function", torch.clamp_min, {}
            node.args = (node.args[0], 0.0)
            n += 1
    return n
"""


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--opprof", *FAST, "tiny.py", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_llm_pass_code_runs_only_in_stage_3(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY))
    for stage in ("capture", "propose"):
        first = run(tmp_path, f"--opprof-stage={stage}")
        assert first.returncode == 0, first.stdout + first.stderr
    out = tmp_path / "opprof-results" / "tiny"
    (out / "llm_passes").mkdir()
    (out / "llm_passes" / "llm-relu_as_clamp-1.py").write_text(PASS)
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

    done = run(tmp_path, "--opprof-from=backend", "--opprof-stage=validate")
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
    generated = (out / "tiny_optimized.py").read_text()
    # Never part of the backend: named only in the docstring's list of dropped proposals.
    assert "'relu_as_clamp'" not in generated and "import llm" not in generated
    assert "llm-relu_as_clamp-1: no pass implements this type" in generated
