"""batch_padding: a wrapper that pads the batch to a tile and slices the outputs back."""

from __future__ import annotations

import pytest
import torch

from pytest_opprof.passes import batch_padding


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 3)
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen.append(ids.shape[0])
        h = self.embed(ids).mean(1) + x
        return {"logits": self.proj(h), "norm": h.norm()}


def test_pads_and_slices_back() -> None:
    model = TwoHeads().eval()
    ids, x = torch.randint(0, 20, (5, 7)), torch.randn(5, 8)
    expected = model(ids, x)
    wrapped, inputs, result = batch_padding.apply(model, (ids, x), tile=8)

    assert (result.status, result.matches) == ("APPLIED", 1)
    assert result.detail == "batch 5 padded to 8 (tile 8)"
    assert inputs == (ids, x)  # the wrapper takes the original inputs
    out = wrapped(ids, x)
    assert model.seen[-1] == 8  # the model itself ran on the padded batch
    assert out["logits"].shape == (5, 3)
    torch.testing.assert_close(out["logits"], expected["logits"], rtol=1e-6, atol=1e-6)
    # other batch sizes go through the same wrapper
    torch.testing.assert_close(wrapped(ids[:3], x[:3])["logits"], model(ids[:3], x[:3])["logits"])
    assert model.seen[-2] == 8


def test_batch_already_on_a_tile() -> None:
    model, x = torch.nn.Linear(4, 4), torch.randn(8, 4)
    same, inputs, result = batch_padding.apply(model, (x,), tile=4)
    assert (same, inputs, result.status) == (model, (x,), "NOT_APPLIED")


@pytest.mark.parametrize("tile", [0, -8, 2.5])
def test_bad_tile_fails_without_touching_the_model(tile: object) -> None:
    model, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    same, _, result = batch_padding.apply(model, (x,), tile=tile)  # type: ignore[arg-type]
    assert same is model
    assert result.status == "FAILED" and "tile must be a positive int" in result.detail
