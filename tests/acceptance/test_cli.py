"""The ``opprof`` command: validate (also on an edited backend), propose, preflight, usage."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_opprof.backend.codegen import render_optimized, render_test
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
    assert missing.returncode == 1 and "not a workload" in missing.stderr


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
