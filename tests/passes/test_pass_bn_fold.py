"""bn_fold on aten graphs: Inductor-decomposed batch norm (what inner compile receives) and the
undecomposed op, after a convolution and after a linear."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, const, count

from pytest_opprof.passes import bn_fold
from pytest_opprof.tolerances import tolerance_for

aten = torch.ops.aten
RTOL, ATOL = 1e-5, 1e-5


def _bn_params(c: int) -> list[torch.Tensor]:
    """gamma, beta, running mean, running var: far from the identity so a wrong fold shows."""
    return [torch.randn(c), torch.randn(c), torch.randn(c), torch.rand(c) + 0.5]


def conv_bn_relu(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
) -> torch.Tensor:
    return torch.relu(F.batch_norm(F.conv2d(x, w, b, padding=1), mean, var, gamma, beta, eps=1e-3))


def linear_bn(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
) -> torch.Tensor:
    return F.batch_norm(F.linear(x, w, b), mean, var, gamma, beta)


CASES: dict[str, tuple[Callable[..., torch.Tensor], list[Any]]] = {
    "conv": (conv_bn_relu, [torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)]),
    "conv without bias": (conv_bn_relu, [torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), None]),
    "linear": (linear_bn, [torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)]),
}


@pytest.mark.parametrize("decompose", [True, False], ids=["decomposed", "native_batch_norm"])
@pytest.mark.parametrize("case", list(CASES))
def test_folds_batch_norm(aten_graph: AtenTrace, case: str, decompose: bool) -> None:
    fn, (x, w, b) = CASES[case]
    params = [w, b, *_bn_params(w.shape[0])]
    gm = aten_graph(fn, x, *params, decompose=decompose)
    expected = fn(x, *params)
    inputs = [x, *(const(p) if p is not None else None for p in params)]

    result = bn_fold.apply(gm, inputs)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert count(gm, aten.mul, aten.sub, aten.rsqrt, aten.native_batch_norm) == 0
    assert count(gm, aten._native_batch_norm_legit_no_training) == 0
    assert count(gm, aten.convolution, aten.addmm) == 1
    torch.testing.assert_close(gm(x, *params), expected, rtol=RTOL, atol=ATOL)


def test_two_convs(aten_graph: AtenTrace) -> None:
    def block(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *bn: torch.Tensor
    ) -> torch.Tensor:
        g1, b1, m1, v1, g2, b2, m2, v2 = bn
        y = torch.relu(F.batch_norm(F.conv2d(x, w1), m1, v1, g1, b1))
        return F.batch_norm(F.conv2d(y, w2), m2, v2, g2, b2)

    x, w1, w2 = torch.randn(1, 2, 8, 8), torch.randn(3, 2, 3, 3), torch.randn(4, 3, 3, 3)
    params = [w1, w2, *_bn_params(3), *_bn_params(4)]
    gm = aten_graph(block, x, *params)
    result = bn_fold.apply(gm, [x, *map(const, params)])
    assert result.matches == 2
    torch.testing.assert_close(gm(x, *params), block(x, *params), rtol=RTOL, atol=ATOL)


def test_runtime_statistics_are_not_folded(aten_graph: AtenTrace) -> None:
    """Running stats given as plain tensors are runtime inputs: folding them would bake in
    values the next call may not have."""
    fn, (x, w, b) = CASES["conv"]
    params = [w, b, *_bn_params(4)]
    gm = aten_graph(fn, x, *params)
    code = gm.code
    result = bn_fold.apply(gm, [x, const(w), const(b), *params[2:]])
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_conv_without_batch_norm(aten_graph: AtenTrace) -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    gm = aten_graph(lambda x, w: torch.relu(F.conv2d(x, w)) + 1.0, x, w)
    code = gm.code
    result = bn_fold.apply(gm, [x, const(w)])
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folds_a_low_precision_batch_norm_decomposed_in_fp32(
    aten_graph: AtenTrace, dtype: torch.dtype
) -> None:
    """Inductor decomposes a bf16 batch norm as cast-to-fp32, the affine, cast back: the casts
    do not stop the fold (they did, on depthwise_separable_conv in bf16 on the H200)."""
    x = torch.randn(2, 3, 6, 6).to(dtype)  # made here: the test's own seed, in any order
    params = [p.to(dtype) for p in [torch.randn(4, 3, 3, 3), *_bn_params(4)]]
    gm = aten_graph(conv_bn_relu, x, params[0], None, *params[1:])
    assert count(gm, torch.ops.prims.convert_element_type) >= 2
    expected = conv_bn_relu(x.float(), params[0].float(), None, *(p.float() for p in params[1:]))
    inputs = [x, const(params[0]), None, *map(const, params[1:])]

    result = bn_fold.apply(gm, inputs)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert count(gm, aten.mul, aten.sub, aten.rsqrt, aten.sqrt) == 0
    assert count(gm, torch.ops.prims.convert_element_type) == 0
    got = gm(x, params[0], None, *params[1:])
    assert got.dtype == dtype
    # the pipeline's measure: relative L2 error, within the dtype's tolerance
    rtol, _ = tolerance_for(str(dtype).removeprefix("torch."))
    assert float(torch.linalg.norm(got.float() - expected) / torch.linalg.norm(expected)) < rtol


def test_a_chain_that_ends_in_fp32_keeps_its_dtype(aten_graph: AtenTrace) -> None:
    def fn(
        x: torch.Tensor,
        w: torch.Tensor,
        gamma: torch.Tensor,
        beta: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
    ) -> torch.Tensor:
        y = F.conv2d(x, w, padding=1).float()
        return torch.relu(F.batch_norm(y, mean, var, gamma, beta, eps=1e-3))

    x, w = torch.randn(2, 3, 6, 6, dtype=torch.bfloat16), torch.randn(4, 3, 3, 3)
    params = [w.to(torch.bfloat16), *_bn_params(4)]
    gm = aten_graph(fn, x, *params)
    result = bn_fold.apply(gm, [x, *map(const, params)])
    assert result.matches == 1
    got, expected = gm(x, *params), fn(x, *params)
    assert got.dtype == torch.float32
    rtol, _ = tolerance_for("bfloat16")
    assert float(torch.linalg.norm(got - expected) / torch.linalg.norm(expected)) < rtol
