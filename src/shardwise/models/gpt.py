"""GPT-style decoder (the GPT-3 / Megatron shape): LayerNorm, learned positions, GELU 4h MLP, biases.

The output head is untied from the token embedding (Megatron's `untie_embeddings_and_output_weights`),
so sharding the head and the embedding never aliases one parameter across two layouts.
"""
from __future__ import annotations

import torch
from torch import nn

from shardwise.config import ModelConfig
from shardwise.models.common import Attention, Transformer
from shardwise.models.feed_forward import GELUMLP
from shardwise.models.kv_cache import LayerCache
from shardwise.models.moe import MoE


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if moe else GELUMLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: LayerCache | None = None,
                mask=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions=positions, cache=cache, mask=mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(GPTBlock(cfg, self.shape.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)
