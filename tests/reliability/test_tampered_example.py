"""The case issue #37 names, end to end on the CPU fallback: sdpa_attention's generated bf16
backend with the attention replaced by a mean over time. Its own generated tests pass (their
blanket bf16 tolerance), and `opprof validate` blocks it at step 6, naming the check and the
figure; the same file untampered is ready for profiling."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_opprof.backend.codegen import render_optimized, render_test
from pytest_opprof.schema import BackendPlan, BackendSelection, write_artifact
from pytest_opprof.tolerances import tolerance_for

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sdpa_attention" / "sdpa_attention.py"

# The workload's module as the generated file imports it (`baseline`): its class patched so
# the backend skips the attention, which a residual and a LayerNorm hide in the output.
SKIP_ATTENTION = """

def _mean_over_time(self, x):
    b, t, d = x.shape
    h = self.norm_in(x)
    v = self.v_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    attn = v.mean(dim=2, keepdim=True).expand_as(v).transpose(1, 2).reshape(b, t, d)
    return self.norm_out(x + self.out_proj(attn))


_entry = get_model_and_input


def get_model_and_input():
    model, x = _entry()
    model.inner.forward = _mean_over_time.__get__(model.inner)
    return model, x
"""


@pytest.fixture
def generated(tmp_path: Path) -> Path:
    """A bf16 backend of the real example, written by the backend stage's codegen: the model
    cast to bf16 (dtype_promotion's model form), compiled by Inductor."""
    workload = tmp_path / "sdpa_attention.py"
    # a CPU-sized batch of the same model: the check is the point, not the speed
    text = EXAMPLE.read_text().replace("torch.randn(8, 512, 512", "torch.randn(2, 256, 512")
    assert "torch.randn(2, 256, 512" in text
    workload.write_text(text)
    out = tmp_path / "opprof-results" / "sdpa_attention"
    plan = BackendPlan(dtype="bfloat16", proposals=["dtype_promotion-1"])
    selection = BackendSelection(
        workload="sdpa_attention",
        reference="eager",
        reference_ms=1.0,
        variants=[],
        chosen="dtype_promotion-1",
        plan=plan,
    )
    write_artifact(out / "profiler_output" / "backend_selection.json", selection)
    rtol, atol = tolerance_for("bfloat16")
    file = out / "sdpa_attention_optimized.py"
    file.write_text(
        render_optimized(
            stem="sdpa_attention",
            workload=workload,
            out_file=file,
            selection=selection,
            proposals=[],
            rtol=rtol,
            atol=atol,
        )
    )
    (out / "test_sdpa_attention_optimized.py").write_text(render_test(stem="sdpa_attention"))
    return file


def _validate(file: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest_opprof.cli", "validate", str(file), "--device=cpu"],
        cwd=file.parents[2],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = json.loads((file.parent / "profiler_output" / "validation_report.json").read_text())
    return result, report


def test_skipping_attention_is_blocked_where_its_own_tests_pass(generated: Path) -> None:
    honest = generated.with_name("honest.py")
    shutil.copy(generated, honest)
    generated.write_text(generated.read_text() + SKIP_ATTENTION)
    result, report = _validate(generated)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert re.search(r"^tests +pass ", out, re.MULTILINE), out  # the file's own tests are fooled
    assert report["overall"] == "BLOCKED"
    numerics = report["numerics"]
    assert isinstance(numerics, dict)
    assert numerics["rel_err"] < 1.6e-2  # inside the blanket bf16 tolerance of before
    assert numerics["rel_err"] > 5 * numerics["rel_limit"]
    assert (
        "BLOCKED — fix step 6 (numerics): equivalent: relative error "
        f"{numerics['rel_err']:.2e} > limit {numerics['rel_limit']:.2e} (2x eager's own "
        "bfloat16 error" in out
    )

    shutil.copy(honest, generated)
    result, report = _validate(generated)
    assert result.returncode == 0, result.stdout + result.stderr
    assert report["overall"] == "READY_FOR_PROFILING"
