"""BERT-base encoder (110M), randomly initialised from its configuration; nothing is downloaded.

Written after Hugging Face's ``BertModel`` with its SDPA attention: word + position + token-type
embeddings, 12 post-LN layers of self-attention and an erf-GELU MLP; the output is the last
hidden state.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02


class Embeddings(nn.Module):
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # Buffers, so that forward creates no tensor and they follow the model to its device.
        positions = torch.arange(cfg.max_position_embeddings).unsqueeze(0)
        self.register_buffer("position_ids", positions, persistent=False)
        self.register_buffer("token_type_ids", torch.zeros_like(positions), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.word_embeddings(ids) + self.position_embeddings(self.position_ids[:, :t])
        return self.LayerNorm(h + self.token_type_embeddings(self.token_type_ids[:, :t]))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attention_output = nn.Linear(d, d)
        self.attention_norm = nn.LayerNorm(d, eps=eps)
        self.intermediate = nn.Linear(d, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, d)
        self.output_norm = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = self.attention_norm(x + self.attention_output(ctx))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or BertConfig()
        self.embeddings = Embeddings(cfg)
        self.layers = nn.Sequential(*(Layer(cfg) for _ in range(cfg.num_hidden_layers)))
        # Hugging Face's _init_weights: N(0, 0.02) weights, zero biases, the padding row zero.
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(std=cfg.initializer_range)
                if isinstance(m, nn.Linear):
                    m.bias.zero_()
                elif isinstance(m, nn.Embedding) and m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embeddings(ids))


def get_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    model = BertEncoder().to("cuda").eval()
    ids = torch.randint(0, 30522, (16, 128), device="cuda")
    return model, ids


def tiny() -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """The same architecture at test size on the CPU: model, input, expected output shape."""
    cfg = BertConfig(100, 32, 2, 2, 64, max_position_embeddings=64)
    return BertEncoder(cfg).eval(), torch.randint(0, 100, (2, 16)), (2, 16, 32)
