"""A two-layer LSTM encoder, mean-pooled over time, and a linear classifier."""

import torch
from torch import nn


class SequenceEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True)
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out.mean(dim=1))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = SequenceEncoder().to("cuda").eval()
    x = torch.randn(32, 128, 256, device="cuda")
    return model, x
