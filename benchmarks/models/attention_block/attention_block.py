"""A post-LN transformer block whose attention is hand-written: softmax(QKᵀ/√d)·V, no SDPA."""

import math

import torch
from torch import nn


class AttentionBlock(nn.Module):
    def __init__(self, dim: int = 512, heads: int = 8, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm_attn = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )
        self.norm_mlp = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        # Spelled out on purpose: the chain the sdpa_replacement pass rewrites into one fused call.
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)
        attn = attn.transpose(1, 2).reshape(b, t, d)
        x = self.norm_attn(x + self.out_proj(attn))
        return self.norm_mlp(x + self.mlp(x))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = AttentionBlock().to("cuda").eval()
    x = torch.randn(16, 256, 512, device="cuda")
    return model, x


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    return AttentionBlock(dim=16, heads=2).eval(), torch.randn(2, 8, 16), (2, 8, 16)
