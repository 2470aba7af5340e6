"""Measured selection holds each rung to the validate stage's own numerical check
(``numerics.GateCheck``): the gate's inputs and bounds, so a plan selection keeps is one the
gate passes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pytest_opprof.numerics import SEEDS, GateCheck, check_numerics, judge, run_candidate
from pytest_opprof.workload import fresh_inputs

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
TEMPLATE = (torch.randn(64, 8),)


def off_on(seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model, but one output element off on ``seed``'s fresh inputs alone."""
    marked = fresh_inputs(TEMPLATE, seed)[0]

    def run(x: torch.Tensor) -> torch.Tensor:
        out = MODEL(x)
        if torch.equal(x, marked):
            out = out.clone()
            out[3, 1] += 1.0
        return out

    return run


def bf16(x: torch.Tensor) -> torch.Tensor:
    """The model computed in bf16, its output back in fp32: an honest low-precision plan."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return MODEL(x).float()


def test_a_candidate_off_on_one_of_the_gate_s_inputs_fails_selection_s_check() -> None:
    check = GateCheck(MODEL, TEMPLATE)
    bad = off_on(SEEDS[-1])
    got = check(check.outputs(bad), dtype=None, rtol=1e-4, atol=1e-5, calibrate=True)
    assert not got.ok and got.elements_over == 1
    # checked on an input the gate never uses, the same candidate looked exact
    other = fresh_inputs(TEMPLATE, 7)
    with torch.no_grad():
        alone = check_numerics(MODEL(*other), bad(*other), dtype=None, rtol=1e-4, atol=1e-5)
    assert alone.ok


def test_selection_s_check_gives_the_gate_s_verdict_and_figures() -> None:
    check = GateCheck(MODEL, TEMPLATE)
    for candidate, dtype in ((bf16, "bfloat16"), (off_on(SEEDS[0]), None), (MODEL, None)):
        mine = check(check.outputs(candidate), dtype=dtype, rtol=1.6e-2, atol=1e-3, calibrate=True)
        gate, _ = judge(
            MODEL,
            TEMPLATE,
            run_candidate(candidate, TEMPLATE, SEEDS),
            dtype=dtype,
            rtol=1.6e-2,
            atol=1e-3,
        )
        assert (mine.ok, mine.failed) == (gate.ok, gate.failed)
        assert mine.rel_err == gate.rel_err and mine.rel_limit == gate.rel_limit
    # calibrated by eager at bf16: the limit is twice its error, not the bf16 rtol as written
    honest = check(check.outputs(bf16), dtype="bfloat16", rtol=1.6e-2, atol=1e-3, calibrate=True)
    assert honest.ok and honest.reference_rel_err is not None
    assert honest.rel_limit is not None and honest.rel_limit < 1.6e-2
