"""A four-layer MLP with a different activation after each layer."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(512, 2048),
            nn.ReLU(),
            nn.Linear(2048, 2048),
            nn.GELU(),
            nn.Linear(2048, 2048),
            nn.SiLU(),
            nn.Linear(2048, 512),
            nn.Tanh(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = MLP().to("cuda").eval()
    x = torch.randn(256, 512, device="cuda")
    return model, x
