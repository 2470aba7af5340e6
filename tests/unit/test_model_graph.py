"""The whole-model CUDA graph: its fallback on the CPU, and on a GPU the recording itself."""

from __future__ import annotations

import pytest
import torch

from pytest_opprof.backend.model_graph import ModelGraph, ModelGraphWarning, uncaptured


def test_a_call_no_graph_can_serve_runs_uncaptured_with_one_warning() -> None:
    model = torch.nn.Linear(4, 3).eval()
    graphed = ModelGraph(model)
    x = torch.randn(2, 4)
    with torch.no_grad(), pytest.warns(ModelGraphWarning, match="not a CUDA tensor"):
        out = graphed(x)
    torch.testing.assert_close(out, model(x))
    assert graphed.fallbacks == 1 and not graphed.captured and graphed.replays == 0
    assert uncaptured(graphed) is model and uncaptured(model) is model


class _Breaking(torch.nn.Module):
    """A linear, an LSTM (Dynamo leaves it to cuDNN outside any graph), a reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.lstm = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(torch.relu(self.proj(x)))
        return y.mean(dim=1)


@pytest.mark.gpu
def test_records_the_whole_compiled_call_and_replays_fresh_inputs() -> None:
    torch.manual_seed(0)
    model = _Breaking().cuda().eval()
    graphed = ModelGraph(torch.compile(model))
    first, second = torch.randn(4, 8, 16, device="cuda"), torch.randn(4, 8, 16, device="cuda")
    with torch.no_grad():
        out1 = graphed(first)
        out2 = graphed(second)
        torch.testing.assert_close(out1, model(first), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out2, model(second), rtol=1e-4, atol=1e-5)
        assert graphed.captured and graphed.replays == 2 and graphed.fallbacks == 0
        assert out1.data_ptr() != out2.data_ptr()  # callers get their own tensors
        with pytest.warns(ModelGraphWarning, match="differ in shape"):
            other = graphed(torch.randn(2, 8, 16, device="cuda"))
        assert other.shape == (2, 32) and graphed.fallbacks == 1
