"""sdpa_replacement on the Dynamo graphs of hand-written attention blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pass_helpers import DynamoCapture, count

from pytest_opprof.passes import sdpa_replacement

RTOL = ATOL = 1e-5
B, H, T, D = 2, 2, 6, 8


class Attention(torch.nn.Module):
    """Multi-head attention written out by hand, with a selectable mask style."""

    additive: torch.Tensor  # buffers
    tril: torch.Tensor

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        causal = torch.full((T, T), float("-inf")).triu(1)
        self.register_buffer("additive", causal)
        self.register_buffer("tril", torch.ones(T, T).tril().view(1, 1, T, T))

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        if self.mask == "unscaled":
            scores = q @ k.transpose(2, 3)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        if self.mask == "additive causal":
            scores = scores + self.additive
        elif self.mask == "masked_fill causal":  # nanoGPT's form
            scores = scores.masked_fill(self.tril[:, :, :T, :T] == 0, float("-inf"))
        elif self.mask == "runtime additive":
            scores = scores + extra
        elif self.mask.startswith("where"):  # HF GPT-2's form: keep where the mask is True
            keep = self.tril[:, :, :T, :T].bool() if "causal" in self.mask else extra > 0
            fill = float("-inf") if "-inf" in self.mask else torch.finfo(scores.dtype).min
            scores = torch.where(keep, scores, fill)
        probs = F.dropout(F.softmax(scores, dim=-1), p=0.1, training=False)
        return (probs @ v).transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize(
    ("mask", "how"),
    [
        ("none", "unmasked, scale=0.353553"),
        ("unscaled", "unmasked, scale=1"),
        ("additive causal", "causal, scale=0.353553"),
        ("masked_fill causal", "causal, scale=0.353553"),
        ("runtime additive", "masked, scale=0.353553"),
        ("where finfo.min causal", "causal, scale=0.353553"),
        ("where -inf runtime", "masked, scale=0.353553"),
    ],
)
def test_replaces_attention(dynamo_graph: DynamoCapture, mask: str, how: str) -> None:
    model = Attention(mask).eval()
    x, extra = torch.randn(B, T, H * D), torch.randn(B, H, T, T)
    gm, inputs = dynamo_graph(model, x, extra)
    with torch.no_grad():
        result = sdpa_replacement.apply(gm, inputs)
        out = gm(*inputs)[0]

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert result.detail.endswith(f": {how})")
    assert count(gm, F.scaled_dot_product_attention) == 1
    assert count(gm, torch.softmax, F.softmax, "softmax") == 0
    (sdpa,) = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    assert sdpa.kwargs["is_causal"] is how.startswith("causal")
    torch.testing.assert_close(out, model(x, extra), rtol=RTOL, atol=ATOL)


def test_two_blocks(dynamo_graph: DynamoCapture) -> None:
    first, second = Attention("none").eval(), Attention("additive causal").eval()
    x, extra = torch.randn(B, T, H * D), torch.randn(B, H, T, T)

    def stacked(x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return second(first(x, extra), extra)

    gm, inputs = dynamo_graph(stacked, x, extra)
    with torch.no_grad():
        result = sdpa_replacement.apply(gm, inputs)
        torch.testing.assert_close(gm(*inputs)[0], stacked(x, extra), rtol=RTOL, atol=ATOL)
    assert result.matches == 2


def _softmax_over_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v


def _scores_read_twice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1)
    return torch.softmax(scores, dim=-1) @ v + scores.sum()


def _scaled_after_additive_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax((q @ k.transpose(-2, -1) + q.sum()) * 0.5, dim=-1) @ v


def _no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.relu(q @ k.transpose(-2, -1)) @ v


@pytest.mark.parametrize(
    "fn",
    [_softmax_over_queries, _scores_read_twice, _scaled_after_additive_mask, _no_attention],
)
def test_leaves_graph_alone_without_the_pattern(dynamo_graph: DynamoCapture, fn: object) -> None:
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    gm, inputs = dynamo_graph(fn, q, k, v)
    code = gm.code
    result = sdpa_replacement.apply(gm, inputs)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert gm.code == code


def test_finite_fill_with_a_runtime_mask_is_left_alone(dynamo_graph: DynamoCapture) -> None:
    """A row the mask drops entirely is uniform with a finite fill but NaN in SDPA."""
    model = Attention("where finfo.min runtime").eval()
    x, extra = torch.randn(B, T, H * D), torch.randn(B, H, T, T)
    gm, inputs = dynamo_graph(model, x, extra)
    result = sdpa_replacement.apply(gm, inputs)
    assert (result.status, result.matches) == ("NOT_APPLIED", 0)
    assert "finite fill" in result.detail
    assert count(gm, F.scaled_dot_product_attention) == 0
