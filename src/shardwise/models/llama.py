"""LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP (Touvron et al. 2023)."""
from __future__ import annotations

import torch
from torch import nn

from shardwise.config import ModelConfig
from shardwise.models.common import Attention, RotaryEmbedding, Transformer
from shardwise.models.feed_forward import SwiGLU
from shardwise.models.kv_cache import LayerCache
from shardwise.models.moe import MoE


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 for stability under bf16."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, bias=False)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if moe else SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor | None = None,
                cache: LayerCache | None = None, mask=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, positions, cache, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(cfg, self.shape.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def block_kwargs(self) -> dict:
        return {"rope": self.rope}
