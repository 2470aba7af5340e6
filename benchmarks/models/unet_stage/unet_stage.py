"""One UNet encoder/decoder stage pair: double convs, max-pool down, transposed-conv up, a skip."""

import torch
from torch import nn


class DoubleConv(nn.Sequential):
    """(3×3 convolution → BatchNorm → ReLU) twice, at constant resolution, as in UNet."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class UNetStage(nn.Module):
    def __init__(self, channels: int = 64, width: int = 64, num_classes: int = 2) -> None:
        super().__init__()
        self.encode = DoubleConv(channels, width)
        self.down = nn.MaxPool2d(2)
        self.bottleneck = DoubleConv(width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.decode = DoubleConv(2 * width, width)  # the upsampled map and the skip, concatenated
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.encode(x)
        up = self.up(self.bottleneck(self.down(skip)))
        return self.head(self.decode(torch.cat([up, skip], dim=1)))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = UNetStage().to("cuda").eval()
    x = torch.randn(16, 64, 128, 128, device="cuda")
    return model, x


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    model = UNetStage(channels=4, width=8)
    return model.eval(), torch.randn(2, 4, 16, 16), (2, 2, 16, 16)
