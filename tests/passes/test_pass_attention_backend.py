"""attention_backend: cuDNN's fused attention moved to FlashAttention where flash computes the
same call.

Neither kernel runs on the CPU, so these tests trace aten graphs over fake CUDA tensors (the
ops' meta functions give shapes and strides) and check the rewrite's structure; the gpu test
runs both kernels and compares them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pass_helpers import count
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from pytest_opprof.passes import REGISTRY, attention_backend

aten = torch.ops.aten
HEADS = 4


def trace(fn: Callable[..., Any], head: int = 64, dtype: torch.dtype = torch.bfloat16) -> Any:
    with FakeTensorMode():
        x = torch.empty(2, 16, 3 * HEADS * head, device="cuda", dtype=dtype)
    return make_fx(fn, tracing_mode="fake")(x)


def cudnn(**kw: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fused-QKV attention block as AOT leaves it at bf16 on sm90: split, cuDNN, merge."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = x.view(b, s, 3, HEADS, d // (3 * HEADS)).permute(2, 0, 3, 1, 4)
        args = {"attn_bias": None, "compute_log_sumexp": False, "is_causal": True, **kw}
        y = aten._scaled_dot_product_cudnn_attention(q, k, v, **args)[0]
        return y.transpose(1, 2).reshape(b, s, d // 3)

    return fn


def test_registered_at_the_aten_level() -> None:
    assert REGISTRY["attention_backend"].level == "aten"


def test_cudnn_attention_moves_to_flash() -> None:
    gm = trace(cudnn(scale=0.125))
    before = gm.graph.output_node().args[0].meta["val"]
    result = attention_backend.apply(gm, [])
    assert (result.status, result.matches) == ("APPLIED", 1), result.detail
    assert count(gm, aten._scaled_dot_product_cudnn_attention) == 0
    (flash,) = [
        n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_flash_attention.default
    ]
    assert flash.args[3:] == (0.0, True, False) and flash.kwargs == {"scale": 0.125}
    after = gm.graph.output_node().args[0].meta["val"]
    assert (after.shape, after.stride()) == (before.shape, before.stride())


@pytest.mark.parametrize(
    ("fn", "head", "dtype"),
    [
        (cudnn(dropout_p=0.1), 64, torch.bfloat16),  # dropout: training
        (cudnn(), 76, torch.bfloat16),  # head size not a multiple of 8
        (cudnn(), 512, torch.bfloat16),  # head size over flash's 256
        (cudnn(return_debug_mask=True), 64, torch.bfloat16),
    ],
    ids=["dropout", "head_76", "head_512", "debug_mask"],
)
def test_calls_flash_cannot_take_stay_on_cudnn(fn: Any, head: int, dtype: torch.dtype) -> None:
    gm = trace(fn, head=head, dtype=dtype)
    code = gm.code
    result = attention_backend.apply(gm, [])
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert "flash cannot compute" in result.detail
    assert gm.code == code


def test_log_sum_exp_read_stays_on_cudnn() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = x.view(b, s, 3, HEADS, d // (3 * HEADS)).permute(2, 0, 3, 1, 4)
        out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
        return out[0].sum() + out[1].sum()

    gm = trace(fn)
    assert attention_backend.apply(gm, []).matches == 0


def test_nothing_to_move_without_cudnn_attention() -> None:
    gm = trace(lambda x: x * 2)
    result = attention_backend.apply(gm, [])
    assert (result.status, result.detail) == ("NOT_APPLIED", "no cuDNN attention")


@pytest.mark.gpu
def test_flash_computes_what_cudnn_did() -> None:
    """On the GPU, through the pass-routing backend: the SDPA of a bf16 block runs on flash and
    agrees with cuDNN's result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pytest_opprof.backend.compiler import make_backend
    from pytest_opprof.passes.base import PassResult

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(4, 12, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    results: list[PassResult] = []
    with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        want = block(q, k, v)
        got = torch.compile(
            block, backend=make_backend(aten=["attention_backend"], results=results)
        )(q, k, v)
    assert [(r.status, r.matches) for r in results] == [("APPLIED", 1)]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
