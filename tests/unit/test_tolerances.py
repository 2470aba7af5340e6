"""Which tolerance a result is held to: its dtype's, or TF32's for fp32 on TF32 tensor cores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from pytest_opprof.backend.plan import BackendPlan
from pytest_opprof.passes.base import ALLOW_TF32
from pytest_opprof.stages.backend import runs_tf32
from pytest_opprof.tolerances import TF32, TOLERANCES, numerics_dtype, tolerance_for


def test_numerics_dtype() -> None:
    assert numerics_dtype(None, tf32=False) == "float32"
    assert numerics_dtype("float32", tf32=True) == TF32
    assert numerics_dtype(None, tf32=True) == TF32
    assert numerics_dtype("bfloat16", tf32=True) == "bfloat16"  # bf16 is looser already
    # TF32 keeps fp16's mantissa: its tolerance lies between fp32's and bf16's
    fp32, tf32, bf16 = (tolerance_for(d)[0] for d in ("float32", TF32, "bfloat16"))
    assert fp32 < tf32 < bf16 and TOLERANCES[TF32] == TOLERANCES["float16"]
    assert tolerance_for(TF32, {"rtol": 0.5}) == (0.5, TOLERANCES[TF32][1])


@pytest.fixture
def flags() -> Iterator[None]:
    """PyTorch's defaults (cuBLAS fp32, cuDNN TF32), restored after the test (the cuBLAS flag
    is a property of a module object, out of monkeypatch's reach)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.usefixtures("flags")
def test_fp32_convolutions_on_cuda_run_tf32_by_default() -> None:
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    plan = BackendPlan()
    assert runs_tf32(conv, plan, "cuda") is True
    assert runs_tf32(conv, plan, "cpu") is False
    assert runs_tf32(mlp, plan, "cuda") is False  # matmuls stay fp32 unless allowed
    tf32_plan = plan.model_copy(update={"config_patches": {ALLOW_TF32: True}})
    assert runs_tf32(mlp, tf32_plan, "cuda") is True
    torch.backends.cudnn.allow_tf32 = False
    assert runs_tf32(conv, plan, "cuda") is False
    torch.backends.cuda.matmul.allow_tf32 = True
    assert runs_tf32(mlp, plan, "cuda") is True
