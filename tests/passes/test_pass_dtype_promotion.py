"""dtype_promotion: the aten graph pass and the non-graph model wrapper."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import AtenTrace, count

from pytest_opprof.passes import dtype_promotion

aten, prims = torch.ops.aten, torch.ops.prims
# bf16 keeps 8 mantissa bits: rtol 2**-6, and an atol for outputs of order one (the weights
# below are scaled like nn.Linear's, so sums of products stay of order one).
BF16: dict[str, Any] = {"rtol": 1.6e-2, "atol": 2e-2}


def _w(out_f: int, in_f: int) -> torch.Tensor:
    return torch.randn(out_f, in_f) / in_f**0.5


def _low_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the matmul/conv nodes that now compute in bf16."""
    return [
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "overloadpacket", None)
        in (aten.mm, aten.addmm, aten.bmm, aten.convolution)
        and n.meta["val"].dtype == torch.bfloat16
    ]


def mlp(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def test_mlp_in_bf16(aten_graph: AtenTrace) -> None:
    args = [torch.randn(4, 3, 16), _w(32, 16), torch.randn(32), _w(8, 32), torch.randn(8)]
    gm = aten_graph(mlp, *args)
    result = dtype_promotion.apply(gm, args)

    assert (result.status, result.matches) == ("APPLIED", 2)
    assert len(_low_ops(gm)) == 2
    out = gm(*args)
    assert out.dtype == torch.float32  # everything outside the GEMMs keeps fp32
    torch.testing.assert_close(out, mlp(*args), **BF16)


def test_chained_gemms_hand_bf16_over(aten_graph: AtenTrace) -> None:
    """linear -> linear: the cast up after the first and the cast down before the second
    cancel, through the views between them."""

    def two(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, w1), w2)

    args = [torch.randn(2, 5, 16), _w(16, 16), _w(8, 16)]
    gm = aten_graph(two, *args)
    result = dtype_promotion.apply(gm, args)
    assert result.matches == 2
    assert result.detail.endswith("1 cast pair(s) cancelled")
    # x, w1, w2 cast down; one cast up at the end
    assert count(gm, prims.convert_element_type) == 4
    torch.testing.assert_close(gm(*args), two(*args), **BF16)


def test_conv_and_bmm(aten_graph: AtenTrace) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w).sum() + torch.bmm(a, b).sum()

    args = [
        torch.randn(1, 3, 6, 6),
        torch.randn(4, 3, 3, 3) / 5,
        torch.randn(2, 3, 4),
        torch.randn(2, 4, 5),
    ]
    gm = aten_graph(fn, *args)
    result = dtype_promotion.apply(gm, args, dtype="float16")
    assert result.matches == 2
    assert "torch.float16" in result.detail
    torch.testing.assert_close(gm(*args), fn(*args), rtol=1e-2, atol=5e-2)  # sums of 144 / 40


@pytest.mark.parametrize("case", ["no matmul", "already bf16"])
def test_leaves_graph_alone_without_fp32_matmuls(aten_graph: AtenTrace, case: str) -> None:
    if case == "no matmul":
        gm = aten_graph(lambda x: torch.relu(x) * 2, torch.randn(3, 3))
    else:
        low = torch.randn(4, 4, dtype=torch.bfloat16)
        gm = aten_graph(lambda a, b: a @ b, low, low)
    code = gm.code
    result = dtype_promotion.apply(gm, [])
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_unknown_dtype_is_a_clear_error(aten_graph: AtenTrace) -> None:
    gm = aten_graph(lambda a, b: a @ b, torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        dtype_promotion.apply(gm, [], dtype="int8")


class TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.proj(self.embed(ids)))
        return h * scale, ids.sum()


def test_apply_model_keeps_the_original_interface() -> None:
    model = TokenModel().eval()
    ids, scale = torch.randint(0, 10, (2, 5)), torch.rand(1)
    with torch.no_grad():
        expected, _ = model(ids, scale)
        new_model, new_inputs, result = dtype_promotion.apply_model(model, (ids, scale))
        out, id_sum = new_model(*new_inputs)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert new_inputs == (ids, scale)
    assert model.proj.weight.dtype == torch.bfloat16
    assert out.dtype == torch.float32 and id_sum.dtype == torch.int64  # ids never cast
    assert int(id_sum) == int(ids.sum())
    torch.testing.assert_close(out, expected, **BF16)


def test_apply_model_on_a_model_already_low() -> None:
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    x = torch.randn(2, 4)
    same, inputs, result = dtype_promotion.apply_model(model, (x,), dtype="bf16")
    assert (same, inputs, result.status) == (model, (x,), "NOT_APPLIED")
    _, _, bad = dtype_promotion.apply_model(model, (x,), dtype="fp8")
    assert bad.status == "FAILED" and "unknown dtype 'fp8'" in bad.detail


def test_apply_model_under_autocast_keeps_the_weights_and_matches_eager_autocast() -> None:
    """``autocast=True``: the model keeps its fp32 weights, its matmuls run in bf16 and its
    norm in fp32 — exactly eager under autocast, whose error the validator calibrates by."""
    model = TokenModel().eval()
    ids, scale = torch.randint(0, 10, (2, 5)), torch.rand(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = model(ids, scale)
    with torch.no_grad():
        new_model, new_inputs, result = dtype_promotion.apply_model(
            model, (ids, scale), autocast=True
        )
        out, id_sum = new_model(*new_inputs)
    assert result.status == "APPLIED" and "autocast" in result.detail
    assert isinstance(new_model, dtype_promotion.AutocastPrecision)
    assert model.proj.weight.dtype == torch.float32  # nothing cast
    assert out.dtype == torch.float32 and id_sum.dtype == torch.int64
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)
