"""Tampered backends on the real example models (CPU fallback): each one is caught, with the
check and the figure named; the honest bf16 model, compiled by Inductor, passes."""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_opprof.numerics import anti_cheat_checks
from pytest_opprof.passes.dtype_promotion import apply_model
from pytest_opprof.tolerances import tolerance_for
from pytest_opprof.workload import load

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    w = load(EXAMPLES / name / f"{name}.py", "cpu")
    return w.model, tuple(t[:batch] for t in w.inputs)


def _bf16(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Any:
    """What ``dtype_promotion`` ships: the model in bf16 (fp32 in and out), compiled."""
    low, _, result = apply_model(copy.deepcopy(model), inputs, dtype="bfloat16")
    assert result.status == "APPLIED"
    torch._dynamo.reset()
    return torch.compile(low)


def _checks(model: torch.nn.Module, candidate: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
    rtol, atol = tolerance_for("bfloat16")
    return anti_cheat_checks(
        model, candidate, inputs, dtype="bfloat16", rtol=rtol, atol=atol, seeds=(0, 1)
    )


def _attention_as_mean_over_time(self: Any, x: torch.Tensor) -> torch.Tensor:
    """sdpa_attention's forward with the attention itself skipped: each position gets the mean
    of the values over time. The residual dominates the output, so the error stays small."""
    b, t, d = x.shape
    h = self.norm_in(x)
    v = self.v_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
    attn = v.mean(dim=2, keepdim=True).expand_as(v)
    attn = attn.transpose(1, 2).reshape(b, t, d)
    return self.norm_out(x + self.out_proj(attn))


@pytest.mark.slow
def test_skipping_attention_is_caught_where_the_residual_dominates() -> None:
    """Before: 7.5e-3 relative error passed bf16's blanket 1.6e-2 (on the H200); eager at bf16
    shows this model's real bf16 error, and the cheat is several times past it."""
    model, inputs = _example("sdpa_attention", batch=2)
    honest, checks = _checks(model, _bf16(model, inputs), inputs)
    assert honest.ok, checks["equivalent"].detail
    cheat_model = copy.deepcopy(model)
    cheat_model.forward = types.MethodType(_attention_as_mean_over_time, cheat_model)
    cheat, checks = _checks(model, _bf16(cheat_model, inputs), inputs)
    assert cheat.rel_err < 1.6e-2  # inside the blanket bf16 tolerance of before
    assert cheat.reference_rel_err is not None and cheat.rel_limit is not None
    assert cheat.rel_err > cheat.rel_limit
    detail = checks["equivalent"].detail
    assert checks["equivalent"].status == "fail"
    assert detail.startswith(f"relative error {cheat.rel_err:.2e} > limit {cheat.rel_limit:.2e}")


@pytest.mark.slow
def test_a_skipped_layer_of_mlp_activations_is_caught() -> None:
    """A backend that skips one of the MLP's square hidden layers (the shapes still match)."""
    model, inputs = _example("mlp_activations", batch=8)
    honest, checks = _checks(model, _bf16(model, inputs), inputs)
    assert honest.ok, checks["equivalent"].detail
    cheat_model = copy.deepcopy(model)
    layers = cheat_model.get_submodule("layers")
    assert isinstance(layers, torch.nn.Sequential)
    layers[4] = torch.nn.Identity()  # Linear(2048, 2048) before the SiLU
    cheat, checks = _checks(model, _bf16(cheat_model, inputs), inputs)
    assert checks["equivalent"].status == "fail"
    assert checks["equivalent"].detail.startswith(f"relative error {cheat.rel_err:.2e} > limit")
