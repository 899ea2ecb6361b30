"""Pieces shared by the llama and gpt architectures: attention, the block stack, counts and init.

Parameter counts and FLOPs are closed-form functions of the config (classmethods), so the planner can
use them for a 405B shape without building the model; tests check them against the built modules.
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config import ModelConfig
from shardwise.models.feed_forward import fuse_linears
from shardwise.models.kv_cache import KVCache, LayerCache
from shardwise.spec.shapes import ModelShape

INIT_STD = 0.02  # GPT-2 / Megatron default initializer range.


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The default attention core: causal SDPA, with grouped-query KV heads when k has fewer heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) positions that restart at 0 after every end-of-document token of a packed row (the token
    after an EOD starts a document; Megatron's reset_position_ids)."""
    b, s = tokens.shape
    index = torch.arange(s, device=tokens.device).expand(b, s)
    starts = torch.zeros_like(tokens)
    starts[:, 1:] = torch.where(tokens[:, :-1] == eod, index[:, 1:], 0)
    return index - starts.cummax(dim=1).values


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, s) boolean mask: query q sees key k when k <= q and k is in q's document, which starts
    at q - positions[q]."""
    s = positions.shape[1]
    q = torch.arange(s, device=positions.device)
    k = q
    start = (q[None, :] - positions)[:, :, None]  # (b, s, 1): where each query's document starts
    return ((k[None, None, :] <= q[None, :, None]) & (k[None, None, :] >= start))[:, None]


def document_attention_mask(documents: torch.Tensor, kernel: str):
    """The mask that keeps each query inside its document, built once per forward and shared by every layer
    (a (b, s) `documents`: each token's position in its document, document_positions). "flex": FlexAttention's
    block mask (Dong et al. 2024, arXiv 2412.05496: 128 x 128 blocks, the ones the mask empties are skipped) —
    building it evaluates the mask over every block, so once per forward, not per layer, as torchtitan does;
    "sdpa": the dense (b, 1, s, s) boolean mask CPU SDPA takes (one tensor that every layer's backward keeps,
    not one per layer)."""
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        start = torch.arange(documents.shape[1], device=documents.device)[None, :] - documents

        def same_document(b, _h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx >= start[b, q_idx])

        s = documents.shape[1]
        return create_block_mask(same_document, documents.shape[0], None, s, s, device=documents.device)
    return document_mask(documents)


def attend_within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention under a document_attention_mask: FlexAttention for a block mask, SDPA for a dense one; both
    compute the same softmax."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled_flex() if q.is_cuda else flex_attention  # on CPU FlexAttention's reference path (tests)
    return attend(q, k, v, block_mask=mask, enable_gqa=gqa)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                       kernel: str = "sdpa") -> torch.Tensor:
    """Attention inside each document of a packed row, mask and all (one layer's worth: tests, one-off calls)."""
    return attend_within_documents(q, k, v, document_attention_mask(documents, kernel))


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    """FlexAttention compiled into its fused kernel: uncompiled it materializes every score (eager reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_kernel(device_type: str) -> str:
    """Which kernel document masking uses on a device: FlexAttention on CUDA (block-sparse, compiled);
    elsewhere SDPA with a dense mask (FlexAttention's CPU path is a reference implementation)."""
    return "flex" if device_type == "cuda" else "sdpa"


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query KV heads.

    `core` (q, k, v) -> out computes the attention itself; it is causal SDPA unless a parallelism
    replaces it (context parallelism installs ring / Ulysses attention, parallel/context.py), so the
    model code stays free of communication.
    """

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=bias)
        self.core = causal_attention
        # fuse_projections (inference): q, k and v in one GEMM; None (no buffer) for training.
        self.register_buffer("wqkv", None, persistent=False)
        self.register_buffer("wqkv_bias", None, persistent=False)
        self.fused_projection = None  # training: q, k and v in one GEMM (feed_forward.py fuse_training_projections)

    def fuse_projections(self) -> None:
        fuse_linears(self, "wqkv", self.wq, self.wk, self.wv)

    def training_projections(self) -> tuple[nn.Linear, ...]:
        return self.wq, self.wk, self.wv

    def forward(self, x: torch.Tensor, rope: "RotaryEmbedding | None" = None,
                positions: torch.Tensor | None = None, cache: "LayerCache | None" = None, mask=None) -> torch.Tensor:
        """`mask`: a document_attention_mask (train.document_mask), or None for causal attention over the row."""
        b, s, _ = x.shape
        # -1 instead of the head count keeps the module correct when TP shards the heads.
        if self.wqkv is not None:
            q, k, v = F.linear(x, self.wqkv, self.wqkv_bias).split(
                [self.wq.out_features, self.wk.out_features, self.wv.out_features], dim=-1)
        elif self.fused_projection is not None:
            q, k, v = self.fused_projection(x, (self.wq, self.wk, self.wv))
            if rope is not None:
                # q and k are rotated into tensors of their own, so only v would keep the joined output alive
                # from forward to backward (attention saves it): its own copy frees the q and k columns.
                v = v.contiguous()
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = rope(q, positions), rope(k, positions)
        if cache is None and mask is not None:
            out = attend_within_documents(q, k, v, mask)
        elif cache is None:
            out = self.core(q, k, v)
        else:  # incremental decoding (models/kv_cache.py): attend over every cached key, masked
            k, v = cache.update(k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.owner.mask, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021, arXiv 2104.09864), rotate-half form; cos/sin tables are buffers."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        # In fp32, exactly as Hugging Face's LlamaRotaryEmbedding computes them (and as the Llama models
        # on the hub were trained): an imported model's logits then equal transformers' to the bit
        # (tests/unit/test_hf_interop.py), where float64 tables differed by 1e-6 relative.
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=self.cos.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        angles = torch.outer(torch.arange(self.max_seq_len, device=self.cos.device).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(angles.cos().to(self.cos.dtype))
        self.sin.copy_(angles.sin().to(self.sin.dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """`positions`: None (0..s-1), (s,) shared by the batch, or (b, s) per sequence (decoding)."""
        s = x.shape[-2]
        cos = self.cos[:s] if positions is None else self.cos[positions]
        sin = self.sin[:s] if positions is None else self.sin[positions]
        if cos.dim() == 3:  # (b, s, hd) against x's (b, heads, s, hd)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)


class Transformer(nn.Module):
    """Embedding -> blocks in `self.layers` -> final norm -> output head producing logits.

    Subclasses build `embed`, `layers`, `norm`, `output` and define the closed-form counts.
    """

    cfg: ModelConfig
    layers: nn.ModuleList
    # train.document_mask: the kernel ("flex" / "sdpa", document_kernel) of the mask that keeps attention inside
    # each document of a packed row; None: the model was not set up for documents (causal over the row).
    document_kernel: str | None = None

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def block_kwargs(self) -> dict:
        return {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: "KVCache | None" = None,
                last_only: bool = False, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`x` is token ids, or hidden states when this module is a pipeline stage that does not own
        the embedding; a stage without the output head returns hidden states (see `keep_only`).
        With `cache` (decoding, models/kv_cache.py) each block attends over its cached keys too;
        `last_only` computes the logits of the last position only (what generation samples from).
        `positions`: RoPE's / the learned positions' indices (None: 0..s-1). `documents` (train.document_mask):
        each token's position in its document of a packed row; attention then stays inside documents, through
        one mask that every block shares. Positions and documents are separate: a run may mask documents and
        keep positions running over the row (train.document_positions=false), as Megatron-LM's
        reset_attention_mask without reset_position_ids."""
        h = self.embed(x, positions) if self.tok_embeddings is not None else x
        extra = self.block_kwargs()
        if documents is not None:
            if self.document_kernel is None:
                raise RuntimeError("documents given to a model without a document_kernel (train.document_mask sets it)")
            extra["mask"] = document_attention_mask(documents, self.document_kernel)
        for name, layer in self.named_blocks():
            if cache is not None:
                extra["cache"] = cache.layer(name)
            h = layer(h, positions=positions, **extra)
        if self.output is None:
            return h
        return self.output(self.norm(h[:, -1:] if last_only else h))

    def blocks(self) -> list[nn.Module]:
        """The blocks this module runs, in order."""
        return [module for _, module in self.named_blocks()]

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        """(name under `layers`, block): the name is the block's global index, also on a stage."""
        return list(self.layers.named_children())

    def keep_only(self, layer_ids: list[int], embedding: bool, head: bool) -> None:
        """Drop every part this module will not run: what a pipeline stage keeps of the whole model.
        The kept blocks stay under `layers.<global index>` (a ModuleDict), so parameter names, init
        seeds and checkpoint keys are those of the whole model."""
        blocks = dict(self.layers.named_children())
        self.layers = nn.ModuleDict({str(i): blocks[str(i)] for i in layer_ids})
        if not embedding:
            for name in self.embedding_modules():
                setattr(self, name, None)
        if not head:
            self.norm, self.output = None, None

    @functools.cached_property
    def shape(self) -> ModelShape:
        """This model's spec (spec/shapes.py), built once: init asks it for every parameter."""
        return ModelShape.from_config(self.cfg)

    def embedding_modules(self) -> tuple[str, ...]:
        """Attribute names of the input embeddings (all live on the first pipeline stage)."""
        return tuple(name for name, _ in self.shape.architecture.embeddings)

    # ---- closed-form counts (no module needed): spec/shapes.py, which the planner reads too ----
    @classmethod
    def count_params(cls, cfg: ModelConfig) -> int:
        return ModelShape.from_config(cfg).num_params

    @classmethod
    def count_flops_per_token(cls, cfg: ModelConfig, seq_len: int) -> int:
        """Training FLOPs per token, 6N + 12 L s h (PaLM, Chowdhery et al. 2022, arXiv 2204.02311,
        App. B; the causal mask is not discounted, as in PaLM and Megatron)."""
        return ModelShape.from_config(cfg).flops_per_token(seq_len)

    @classmethod
    def pipeline_costs(cls, cfg: ModelConfig, seq_len: int) -> dict[str, float]:
        """Cost per token of the embedding, one block and the head (spec/shapes.py pipeline_costs)."""
        return ModelShape.from_config(cfg).pipeline_costs(seq_len)

    def num_params(self) -> int:
        return self.count_params(self.cfg)

    def flops_per_token(self, seq_len: int) -> int:
        return self.count_flops_per_token(self.cfg, seq_len)

    # ---- layout-independent initialization ----
    def residual_projections(self) -> tuple[str, ...]:
        """Leaf names of the projections that write into the residual stream."""
        return self.shape.architecture.residual

    def init_value(self, fqn: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The *global* initial value of parameter `fqn`, drawn from a generator seeded by (seed, fqn).

        Seeding by name (not by draw order) gives every layout the same values whatever it shards or
        skips (docs/architecture.md §3). Residual projections get std 0.02/sqrt(2L) (GPT-2, Radford et al. 2019 §2.3).
        """
        leaf = fqn.rsplit(".", 2)
        if len(leaf) >= 2 and leaf[-2] == "experts":  # stacked experts (E, out, in): named by the leaf
            leaf = [leaf[-1], "weight"]
        if fqn.endswith("bias") or (fqn.endswith("weight") and "norm" in fqn.split(".")[-2]):
            return torch.ones(shape) if fqn.endswith("weight") else torch.zeros(shape)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(fqn.encode())) % 2**63)
        std = INIT_STD
        if len(leaf) >= 2 and leaf[-2] in self.residual_projections():
            std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        return torch.randn(shape, generator=gen) * std

    def reset_buffers(self) -> None:
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.reset_buffers()

    def init_weights(self, seed: int) -> None:
        """Initialize an unsharded model in place (the single-device reference path)."""
        with torch.no_grad():
            for fqn, p in self.named_parameters():
                p.copy_(self.init_value(fqn, p.shape, seed))
        self.reset_buffers()
