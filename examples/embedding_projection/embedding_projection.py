"""Token embedding, LayerNorm, an MLP, and the projection back to a 32000-word vocabulary."""

import torch
from torch import nn


class EmbeddingProjection(nn.Module):
    def __init__(self, vocab: int = 32000, dim: int = 512, hidden: int = 2048) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, dim)
        self.logits = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = self.down(self.act(self.up(h)))
        return self.logits(h)


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = EmbeddingProjection().to("cuda").eval()
    ids = torch.randint(0, 32000, (64, 128), device="cuda")
    return model, ids
