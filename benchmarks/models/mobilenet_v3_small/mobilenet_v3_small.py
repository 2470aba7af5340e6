"""MobileNetV3-small as torchvision builds it: inverted residuals, squeeze-excitation, hardswish."""

import torch
from torch import nn

# torchvision's bneck table: in, kernel, expanded, out, squeeze-excitation, hardswish, stride.
SMALL = (
    (16, 3, 16, 16, True, False, 2),
    (16, 3, 72, 24, False, False, 2),
    (24, 3, 88, 24, False, False, 1),
    (24, 5, 96, 40, True, True, 2),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 120, 48, True, True, 1),
    (48, 5, 144, 48, True, True, 1),
    (48, 5, 288, 96, True, True, 2),
    (96, 5, 576, 96, True, True, 1),
    (96, 5, 576, 96, True, True, 1),
)


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round to a multiple of ``divisor`` without going below 90% of ``v`` (torchvision's)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def conv_bn(
    cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: nn.Module | None = None
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout, eps=0.001, momentum=0.01),
    ]
    return nn.Sequential(*layers, *([act] if act is not None else []))


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        squeeze = make_divisible(channels // 4)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(torch.relu(self.fc1(nn.functional.adaptive_avg_pool2d(x, 1))))
        return x * nn.functional.hardsigmoid(scale)


class InvertedResidual(nn.Module):
    def __init__(
        self, cin: int, k: int, exp: int, cout: int, se: bool, hs: bool, stride: int
    ) -> None:
        super().__init__()
        act = nn.Hardswish if hs else nn.ReLU
        layers: list[nn.Module] = []
        if exp != cin:  # the first block has no expansion, as torchvision's
            layers.append(conv_bn(cin, exp, 1, act=act()))
        layers.append(conv_bn(exp, exp, k, stride, groups=exp, act=act()))
        if se:
            layers.append(SqueezeExcitation(exp))
        layers.append(conv_bn(exp, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.residual else out


class MobileNetV3Small(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 16, 3, 2, act=nn.Hardswish()),
            *(InvertedResidual(*row) for row in SMALL),
            conv_bn(96, 576, 1, act=nn.Hardswish()),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, num_classes)
        )
        # Not torchvision's initialisation (He-normal over fan-out, N(0, 0.01) linear layers):
        # fan-out counts every channel of a depthwise kernel, so at random weights, with
        # eval-mode BatchNorm that does not renormalise, activations shrink block after block
        # and the output ends near zero, where the equivalence check's absolute tolerance
        # accepts anything. He-normal over fan-in keeps the features of order one, and
        # PyTorch's default linear layers shrink them less than N(0, 0.01) does.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = MobileNetV3Small().to("cuda").eval()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    return model, x


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    return MobileNetV3Small(num_classes=10).eval(), torch.randn(2, 3, 64, 64), (2, 10)
