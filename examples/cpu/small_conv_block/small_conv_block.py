"""The quick start's workload: a convolution block sized for a machine without a GPU (two conv →
BatchNorm → ReLU stages, pooling, a classifier, on a small batch), so that the whole pipeline runs
on two CPU cores in about a minute. ``examples/conv_block`` is its GPU-sized sibling."""

import torch
from torch import nn


class SmallConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = SmallConvBlock().to("cuda").eval()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    return model, x
