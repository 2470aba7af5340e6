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
        out1 = graphed(first).clone()
        out2 = graphed(second)
        torch.testing.assert_close(out1, model(first), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out2, model(second), rtol=1e-4, atol=1e-5)
        assert graphed.captured and graphed.replays == 2 and graphed.fallbacks == 0
        with pytest.warns(ModelGraphWarning, match="differ in shape"):
            other = graphed(torch.randn(2, 8, 16, device="cuda"))
        assert other.shape == (2, 32) and graphed.fallbacks == 1


@pytest.mark.gpu
def test_an_output_kept_across_calls_is_released_not_silently_overwritten() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).cuda().eval()
    graphed = ModelGraph(torch.compile(model))
    a, b = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
    with torch.no_grad():
        out_a = graphed(a)
        row = out_a[1]  # a view shares the handed-out storage
        kept = out_a.clone()
        torch.testing.assert_close(kept, model(a), rtol=1e-4, atol=1e-5)
        out_b = graphed(b)  # replays into the same memory
        for stale in (out_a, row):
            with pytest.raises(RuntimeError, match="no longer valid"):
                stale.sum()
        torch.testing.assert_close(kept, model(a), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out_b, model(b), rtol=1e-4, atol=1e-5)
        # An output fed back as the next input is read before the replay releases it.
        out_c = graphed(out_b)
        torch.testing.assert_close(out_c, model(model(b)), rtol=1e-4, atol=1e-5)
        del graphed  # the recorded memory goes with the graph
        with pytest.raises(RuntimeError, match="no longer valid"):
            out_c.sum()


def test_a_handed_out_output_is_the_recorded_memory_under_its_own_storage() -> None:
    """The layout recorded once and the tensor built from it per call (CPU memory here: only
    the release on the next replay needs CUDA's bindings)."""
    from pytest_opprof.backend.model_graph import _layout

    graphed = ModelGraph(torch.nn.Identity())
    recorded = torch.arange(24.0).reshape(4, 6)[1:, ::2]  # offset, strided
    out = graphed._hand_out(_layout(recorded))
    assert out.data_ptr() == recorded.data_ptr() and out.stride() == recorded.stride()
    torch.testing.assert_close(out, recorded, rtol=0, atol=0)
    assert out.untyped_storage()._cdata != recorded.untyped_storage()._cdata
    recorded.add_(1)  # the next replay's values show through: it is the same memory
    torch.testing.assert_close(out, recorded, rtol=0, atol=0)
    assert [s._cdata for s in graphed._handed_out] == [out.untyped_storage()._cdata]
