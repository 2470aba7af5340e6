"""gemm_epilogue: a biased GEMM's ReLU / GELU applied in cuBLASLt's epilogue.

On the CPU ``aten._addmm_activation`` exists too, but its GELU is the exact one: the pass
rewrites a GELU only where the epilogue's is the tanh form (CUDA). The GELU tests here take the
CPU for CUDA (``tanh_gelu_epilogue`` patched) to check the rewrite, then check the function on
what the CPU kernel computes; on the GPU the real cuBLASLt epilogue runs (the gpu test)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, count

from pytest_opprof.passes import REGISTRY, dtype_promotion, gemm_epilogue

aten = torch.ops.aten
CPU = ("cpu",)


def hand_gelu(h: torch.Tensor) -> torch.Tensor:
    """gpt2's "gelu_new", spelled out."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h.pow(3))))


def _args(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        torch.randn(2, 5, 16, dtype=dtype),
        (torch.randn(24, 16) / 4).to(dtype),
        torch.randn(24).to(dtype),
    ]


@pytest.fixture
def cpu_as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm_epilogue, "tanh_gelu_epilogue", lambda device: True)


def test_registered_at_the_aten_level() -> None:
    assert REGISTRY["gemm_epilogue"].level == "aten"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_folds_into_the_gemm(aten_graph: AtenTrace, dtype: torch.dtype) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(x, w, b)) * 2

    args = _args(dtype)
    gm = aten_graph(fn, *args)
    before = gm(*args)
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("APPLIED", 1)
    assert "1 relu" in result.detail
    assert count(gm, aten._addmm_activation) == 1
    assert count(gm, aten.addmm, aten.relu) == 0
    torch.testing.assert_close(gm(*args), before)


@pytest.mark.parametrize("activation", ["relu", "exact_gelu", "tanh_gelu"])
def test_after_dtype_promotions_cast_back_up(
    aten_graph: AtenTrace, cpu_as_cuda: None, activation: str
) -> None:
    """The graph form of dtype_promotion (which runs first) leaves each GEMM in bf16 with its
    result cast back up to fp32, where the activation then reads it: the epilogue still
    applies, and its result is cast up the same way."""

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, w, b)
        if activation == "relu":
            return F.relu(h) * 2
        return F.gelu(h) if activation == "exact_gelu" else hand_gelu(h)

    args = _args()
    gm = aten_graph(fn, *args)
    before = gm(*args)
    assert dtype_promotion.apply(gm, args).status == "APPLIED"
    promoted = gm(*args)
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("APPLIED", 1), result.detail
    assert count(gm, aten._addmm_activation) == 1
    assert count(gm, aten.addmm, aten.relu, aten.erf, aten.tanh) == 0
    out = gm(*args)
    assert out.dtype == torch.float32 and out.shape == before.shape
    if activation == "relu":  # exact: rounding keeps the sign
        torch.testing.assert_close(out, promoted, rtol=0, atol=0)
    else:  # the CPU kernel's exact GELU, its result rounded to bf16 once more
        torch.testing.assert_close(out, promoted, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, before, rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("spelled", ["by_hand", "decomposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tanh_gelu_folds_into_the_gemm(
    aten_graph: AtenTrace, cpu_as_cuda: None, spelled: str, dtype: torch.dtype
) -> None:
    """Both forms: gpt2's formula on the GEMM's result (in its dtype), and Inductor's
    decomposition of gelu(approximate='tanh') (in fp32 between two casts for bf16)."""

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, w, b)
        return hand_gelu(h) if spelled == "by_hand" else F.gelu(h, approximate="tanh")

    args = _args(dtype)
    gm = aten_graph(fn, *args)
    before = gm(*args)
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("APPLIED", 1), result.detail
    assert count(gm, aten._addmm_activation) == 1
    assert count(gm, aten.addmm, aten.tanh, aten.mul, aten.pow) == 0
    out = gm(*args)
    assert out.dtype == dtype and out.shape == before.shape
    # what the CPU kernel computes: the exact GELU of the biased GEMM
    exact = F.gelu(F.linear(*(a.float() for a in args))).to(dtype)
    torch.testing.assert_close(out, exact, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), before.float(), rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("spelled", ["decomposed", "by_hand_swapped", "by_hand_regrouped"])
def test_exact_gelu_in_bf16_becomes_the_epilogues_tanh_form(
    aten_graph: AtenTrace, cpu_as_cuda: None, spelled: str
) -> None:
    """In bf16 the exact GELU (Inductor's erf decomposition, or the same formula with its
    operands the other way round or its products grouped otherwise) folds in too; what the
    epilogue computes differs from it by less than bf16's own rounding."""

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, w, b)
        if spelled == "decomposed":
            return F.gelu(h)
        if spelled == "by_hand_swapped":
            return (1.0 + torch.erf(0.7071067811865476 * h)) * (0.5 * h)
        return h * (torch.erf(h * 0.7071067811865476) + 1.0) * 0.5

    args = _args(torch.bfloat16)
    gm = aten_graph(fn, *args)
    before = gm(*args)
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("APPLIED", 1), result.detail
    assert "1 exact gelu as tanh" in result.detail
    assert count(gm, aten._addmm_activation) == 1
    assert count(gm, aten.addmm, aten.erf) == 0
    out = gm(*args)
    assert out.dtype == torch.bfloat16 and out.shape == before.shape
    torch.testing.assert_close(out.float(), before.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "fn",
    [
        # 1/sqrt(2) off: some other function
        lambda h: 0.5 * h * (1.0 + torch.erf(0.75 * h)),
        # the half taken of something else
        lambda h: 0.5 * h.flip(-1) * (1.0 + torch.erf(0.7071067811865476 * h)),
        # erf + 2
        lambda h: 0.5 * h * (2.0 + torch.erf(0.7071067811865476 * h)),
    ],
    ids=["scale", "other_half", "plus_two"],
)
def test_near_miss_erf_formulas_are_left(aten_graph: AtenTrace, cpu_as_cuda: None, fn: Any) -> None:
    args = _args(torch.bfloat16)
    gm = aten_graph(lambda x, w, b: fn(F.linear(x, w, b)), *args)
    code = gm.code
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0), result.detail
    assert gm.code == code


@pytest.mark.parametrize(
    ("gelu", "left", "as_cuda"),
    [(hand_gelu, aten.tanh, False), (F.gelu, aten.erf, True)],
    ids=["tanh_on_cpu", "exact_at_fp32"],
)
def test_a_gelu_the_epilogue_would_change_is_left(
    aten_graph: AtenTrace, monkeypatch: pytest.MonkeyPatch, gelu: Any, left: Any, as_cuda: bool
) -> None:
    """On the CPU the epilogue's GELU is the exact one: a tanh-GELU stays. At fp32 the tanh
    form's 2e-4 would be the largest error in the call: an exact GELU stays on CUDA too. A ReLU
    beside either still folds."""
    if as_cuda:
        monkeypatch.setattr(gemm_epilogue, "tanh_gelu_epilogue", lambda device: True)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gelu(F.linear(x, w, b)) + F.relu(F.linear(x, w, b))

    args = _args()
    gm = aten_graph(fn, *args)
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert result.matches == 1 and "1 relu" in result.detail
    assert count(gm, left) == 1 and count(gm, aten.addmm) == 1


@pytest.mark.parametrize(
    "fn",
    [
        # no bias: no addmm
        lambda x, w, b: F.relu(F.linear(x, w)),
        # the pre-activation values are used too
        lambda x, w, b: (lambda h: F.relu(h) + h)(F.linear(x, w, b)),
        # an activation the epilogue does not have
        lambda x, w, b: F.silu(F.linear(x, w, b)),
        # the exact GELU at fp32
        lambda x, w, b: F.gelu(F.linear(x, w, b)),
        # a scaled GEMM (beta / alpha)
        lambda x, w, b: F.relu(torch.addmm(b, x[0], w.t(), beta=0.5)),
    ],
    ids=["no_bias", "second_use", "silu", "exact_gelu", "beta"],
)
def test_no_match_leaves_the_graph(aten_graph: AtenTrace, cpu_as_cuda: None, fn: Any) -> None:
    args = _args()
    gm = aten_graph(fn, *args)
    code = gm.code
    result = gemm_epilogue.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0), result.detail
    assert gm.code == code


def test_cuda_only_by_default(aten_graph: AtenTrace) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.relu(F.linear(x, w, b))

    args = _args()
    gm = aten_graph(fn, *args)
    assert gemm_epilogue.apply(gm, args).matches == 0


@pytest.mark.gpu
def test_through_the_backend_on_cuda() -> None:
    """The real cuBLASLt epilogue through Inductor's lowering, on gpt2's MLP in bf16 with an
    exact GELU beside its tanh one."""
    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.gate = torch.nn.Linear(256, 1024), torch.nn.Linear(256, 1024)
            self.exact = torch.nn.Linear(256, 1024)
            self.down = torch.nn.Linear(1024, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = hand_gelu(self.up(x)) * F.relu(self.gate(x)) + F.gelu(self.exact(x))
            return self.down(h)

    torch.manual_seed(0)
    model = Mlp().cuda().bfloat16().eval()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    results: list[PassResult] = []
    backend = make_backend(aten=["gemm_epilogue"], results=results)
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        reference = model.float()(x.float())
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 3)]
    assert "1 exact gelu as tanh" in results[0].detail
    error = (got.float() - reference).norm() / reference.norm()
    assert error < 1.6e-2
