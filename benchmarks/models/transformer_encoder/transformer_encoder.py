"""PyTorch's own ``nn.TransformerEncoder``: six pre-LN layers, d_model 512, 8 heads, FFN 2048."""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(
        self, d_model: int = 512, nhead: int = 8, dim_feedforward: int = 2048, layers: int = 6
    ) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, batch_first=True, norm_first=True
        )
        # Pre-LN leaves the residual stream unnormalised: a final LayerNorm, as pre-LN models
        # end. No padding mask is passed, so the nested-tensor path (off with norm_first, which
        # torch would warn about) has nothing to gain.
        self.encoder = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = Encoder().to("cuda").eval()
    x = torch.randn(32, 128, 512, device="cuda")
    return model, x


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    model = Encoder(d_model=32, nhead=4, dim_feedforward=64, layers=2)
    return model.eval(), torch.randn(2, 8, 32), (2, 8, 32)
