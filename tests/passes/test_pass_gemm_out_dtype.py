"""gemm_out_dtype: a bf16 GEMM whose result is only cast to fp32 writes fp32 itself.

``aten.mm.dtype`` has kernels on CUDA only. On the CPU these tests give it one for their own
duration (``mm_dtype_on_cpu``: fp32 accumulation and output, the op's documented contract) so
that the rewritten graph runs; ``devices=("cpu",)`` lets the pass match CPU tensors. On the GPU
the real cuBLAS kernel runs (tests/gpu)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, count

from pytest_opprof.passes import REGISTRY, dtype_promotion, gemm_out_dtype

aten, prims = torch.ops.aten, torch.ops.prims
CPU = ("cpu",)


@pytest.fixture
def mm_dtype_on_cpu() -> Iterator[None]:
    lib = torch.library.Library("aten", "IMPL")

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.mm(a.float(), b.float()).to(out_dtype)

    def bmm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.bmm(a.float(), b.float()).to(out_dtype)

    lib.impl("mm.dtype", mm_dtype, "CPU")
    lib.impl("bmm.dtype", bmm_dtype, "CPU")
    yield
    lib._destroy()


def logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bf16 projection whose output the caller wants in fp32 (dtype_promotion's wrapper)."""
    return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()


def _args() -> list[torch.Tensor]:
    return [torch.randn(4, 6, 32), torch.randn(48, 32) / 32**0.5]


def test_registered_at_the_aten_level() -> None:
    assert REGISTRY["gemm_out_dtype"].level == "aten"
    assert gemm_out_dtype.inductor_lowers_out_dtype()  # this torch's Inductor takes out_dtype


def test_logits_cast_folds_into_the_gemm(aten_graph: AtenTrace, mm_dtype_on_cpu: None) -> None:
    args = _args()
    gm = aten_graph(logits, *args)
    before = gm(*args)
    result = gemm_out_dtype.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("APPLIED", 1)
    assert count(gm, aten.mm.dtype) == 1 and count(gm, aten.mm.default) == 0
    out = gm(*args)
    assert out.dtype == torch.float32 and out.shape == before.shape
    # fp32 accumulation either way; the old path rounded the result to bf16 first
    exact = torch.nn.functional.linear(args[0].bfloat16().float(), args[1].bfloat16().float())
    assert (out - exact).abs().max() <= (before - exact).abs().max()
    torch.testing.assert_close(out, before, rtol=8e-3, atol=8e-3)


def test_bmm(aten_graph: AtenTrace, mm_dtype_on_cpu: None) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a.half(), b.half()).float()

    args = [torch.randn(2, 3, 8), torch.randn(2, 8, 5)]
    gm = aten_graph(fn, *args)
    result = gemm_out_dtype.apply(gm, args, devices=CPU)
    assert result.matches == 1 and count(gm, aten.bmm.dtype) == 1
    torch.testing.assert_close(gm(*args), fn(*args), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "fn",
    [
        # fp32 GEMM: nothing to fold
        lambda x, w: F.linear(x, w),
        # the bf16 result is also used as it is: the narrow tensor must still be written
        lambda x, w: (lambda y: (y.float(), y * 2))(F.linear(x.bfloat16(), w.bfloat16())),
        # a cast to fp16, not up to fp32
        lambda x, w: F.linear(x.bfloat16(), w.bfloat16()).half(),
        # an elementwise op between the GEMM and the cast (Inductor fuses that one already)
        lambda x, w: F.relu(F.linear(x.bfloat16(), w.bfloat16())).float(),
    ],
    ids=["fp32", "second_use", "to_fp16", "op_between"],
)
def test_no_match_leaves_the_graph(aten_graph: AtenTrace, fn: Any) -> None:
    args = _args()
    gm = aten_graph(fn, *args)
    code = gm.code
    result = gemm_out_dtype.apply(gm, args, devices=CPU)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_cuda_only_by_default(aten_graph: AtenTrace) -> None:
    """On CPU tensors (no out_dtype kernel) the default precondition declines."""
    args = _args()
    gm = aten_graph(logits, *args)
    result = gemm_out_dtype.apply(gm, args)
    assert result.matches == 0 and count(gm, aten.mm.dtype) == 0


def test_after_dtype_promotion_on_a_whole_fp32_graph(
    aten_graph: AtenTrace, mm_dtype_on_cpu: None
) -> None:
    """dtype_promotion's graph form casts the last GEMM's result back up; this pass then
    writes it in fp32 directly, while the chained GEMM before it stays bf16."""

    def two(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, w1), w2)

    args = [torch.randn(2, 5, 16), torch.randn(16, 16) / 4, torch.randn(8, 16) / 4]
    gm = aten_graph(two, *args)
    assert dtype_promotion.apply(gm, args).matches == 2
    result = gemm_out_dtype.apply(gm, args, devices=CPU)
    assert result.matches == 1
    assert count(gm, aten.mm.dtype) == 1 and count(gm, aten.mm.default) == 1
    torch.testing.assert_close(gm(*args), two(*args), rtol=1.6e-2, atol=2e-2)


@pytest.mark.gpu
def test_through_the_backend_on_cuda() -> None:
    """The real cuBLAS kernel via Inductor's lowering: a bf16 model whose logits come back in
    fp32, compiled by the pass-routing backend with the pass at the aten level."""
    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(256, 4096, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x.bfloat16()).float()

    torch.manual_seed(0)
    model = Head().cuda().bfloat16().eval()
    x = torch.randn(8, 64, 256, device="cuda")
    results: list[PassResult] = []
    backend = make_backend(aten=["gemm_out_dtype"], results=results)
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        want = model(x)
        exact = x.bfloat16().float() @ model.proj.weight.float().t()
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    assert got.dtype == torch.float32
    assert (got - exact).abs().max() <= (want - exact).abs().max()
