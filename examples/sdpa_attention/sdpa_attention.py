"""Pre-LN multi-head self-attention with separate q/k/v projections and SDPA."""

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int = 512, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm_in = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm_in(x)

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        attn = F.scaled_dot_product_attention(q, k, v)
        attn = attn.transpose(1, 2).reshape(b, t, d)
        return self.norm_out(x + self.out_proj(attn))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = Attention().to("cuda").eval()
    x = torch.randn(8, 512, 512, device="cuda")
    return model, x
