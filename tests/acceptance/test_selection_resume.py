"""Selection survives a rung that kills its process: a user pass that exits its process as it
is applied (as a CUDA error leaves a process unusable, or a segfault ends it) is dropped as
having crashed it, and a fresh process climbs on from the next rung, end to end on the CPU."""

from __future__ import annotations

import textwrap

import pytest

from pytest_opprof.schema import BackendSelection, read_artifact

CONFTEST = """
from pytest_opprof.schema import Evidence, Impact, Proposal


def pytest_opprof_register_passes(registry):
    registry.add("abort_process", "opprof_abort:abort", level="functional",
                 description="ends its process as it is applied")
    registry.add("noop_after", "opprof_abort:noop", level="functional",
                 description="matches nothing: its rung is dropped as applied nowhere")


def proposal(kind):
    return Proposal(
        id=f"{kind}-1",
        type=kind,
        ir_level="functional",
        targets=["linear"],
        evidence=[Evidence(metric="a test", value=1, source="conftest.py")],
        fx_steps=["a test"],
        impact=Impact(estimated_saving_us=1.0, estimated_speedup=1.01, basis="a test"),
        confidence="high",
        rationale="a test",
    )


def pytest_opprof_propose(profile, graph, optimizations):
    return [proposal("abort_process"), proposal("noop_after")]
"""

PASSES = """
import os

from pytest_opprof.passes.base import run_graph_pass


def abort(gm, example_inputs):
    os._exit(3)


def noop(gm, example_inputs):
    return run_graph_pass("noop_after", gm, example_inputs, lambda g, _: (0, "nothing to do"))
"""

TINY = """
import torch
from torch import nn

OPPROF = {"skip": ["dtype_promotion", "pretranspose_weights"]}


def get_model_and_input():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("cuda").eval()
    return model, torch.randn(3, 8, device="cuda")
"""

FAST = [
    "--opprof-warmup-iters=1",
    "--opprof-measure-iters=2",
    "--opprof-rounds=3",
    "--opprof-device=cpu",
]


@pytest.mark.slow
def test_a_rung_that_kills_selection_is_dropped_and_the_ladder_climbs_on(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        conftest=textwrap.dedent(CONFTEST),
        opprof_abort=textwrap.dedent(PASSES),
        **{"work/tiny": textwrap.dedent(TINY)},
    )
    result = pytester.runpytest_subprocess("--opprof", "work", *FAST, "-k", "backend", "-v")
    result.stdout.fnmatch_lines(["*tiny.py::backend PASSED*"])
    out = pytester.path / "opprof-results" / "tiny" / "profiler_output"
    selection = read_artifact(out / "backend_selection.json", BackendSelection)
    reasons = {d.id: d.reason for d in selection.dropped}
    assert reasons["abort_process-1"].startswith("crashed the selection process (")
    assert "exit 3" in reasons["abort_process-1"]
    # the rung after it was climbed by the fresh process
    assert reasons["noop_after-1"].startswith("applied nowhere")
    log = (out / "select_resumed1.log").read_text()
    assert "abort_process: crashed the selection process before this one" in log
    assert not (out / "select_resumed2.log").exists()
