"""A two-layer GRU encoder, mean-pooled over time, and a linear classifier."""

import torch
from torch import nn


class GRUEncoder(nn.Module):
    def __init__(
        self, input_size: int = 256, hidden: int = 512, layers: int = 2, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.gru = nn.GRU(input_size, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out.mean(dim=1))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = GRUEncoder().to("cuda").eval()
    x = torch.randn(64, 100, 256, device="cuda")
    return model, x


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    return GRUEncoder(input_size=8, hidden=16).eval(), torch.randn(2, 5, 8), (2, 10)
