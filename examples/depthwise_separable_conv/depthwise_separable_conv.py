"""Three MobileNet-style depthwise-separable blocks (32 → 64 → 128 → 256 channels)."""

import torch
from torch import nn


def separable(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_in, kernel_size=3, padding=1, groups=c_in, bias=False),
        nn.BatchNorm2d(c_in),
        nn.ReLU6(),
        nn.Conv2d(c_in, c_out, kernel_size=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(),
    )


class DepthwiseSeparable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(separable(32, 64), separable(64, 128), separable(128, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = DepthwiseSeparable().to("cuda").eval()
    x = torch.randn(16, 32, 56, 56, device="cuda")
    return model, x
