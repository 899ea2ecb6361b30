"""Model shapes for the planner, without torch: every parameter's shape, counts and FLOPs per token.

`ModelShape.params()` lists the parameters in the order `model.parameters()` yields them (the order
matters: ZeRO-1 (parallel/zero1.py) partitions greedily in that order, and FSDP2 pads per parameter), for
the two architectures in `shardwise.models` (llama: RMSNorm, RoPE, GQA, SwiGLU, no biases; gpt:
LayerNorm, learned positions, GELU 4h MLP, biases, untied head). tests/unit/test_plan_memory.py checks
them against the real modules built on the meta device. This is the one description of each
architecture: the models' closed-form counts (models/common.py), the planner's inventory and the
trainer's tensor-parallel plan (`tp_modules`, parallel/tensor.py) all derive from it.

Mixture of experts (models/moe.py, config `[model.moe]`: num_experts, top_k, every_k_layers,
capacity_factor, expert_ffn_dim, num_shared_experts) replaces the MLP of every k-th block by
`num_experts` experts of the architecture's MLP plus a linear router (Shazeer et al. 2017, arXiv
1701.06538; Mixtral: Jiang et al. 2024, arXiv 2401.04088) and optional shared experts merged into one
MLP of num_shared x expert ffn (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066). Expert weights are
stacked 3-D tensors (E, out, in), as torchtitan's GroupedExperts. tests/unit/test_moe.py checks the
inventory and counts against the built MoE model.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from shardwise.spec.hardware import lookup

# FLOPs a GPU can do in the time it moves one byte of HBM (its roofline ridge point), from the
# device table: H100 SXM dense bf16 over HBM bandwidth, ~295. Prices memory-bound work in FLOPs.
_RIDGE = lookup("h100-sxm-80gb")
MEMORY_BOUND_FLOPS_PER_BYTE = _RIDGE.peak_flops("bf16") / (_RIDGE.memory_bandwidth_gbps * 1e9)


# How tensor parallelism splits each module (parallel/tensor.py maps a kind to a DTensor ParallelStyle;
# Megatron-LM's 1-D TP, Shoeybi et al. 2019, arXiv 1909.08053): column-wise splits the output dim,
# row-wise the input dim; a region's input is all-gathered (SP) or replicated; norms run on the
# sequence shard (SP); vocab-parallel embedding and head split the vocabulary; an MoE region holds
# the router (replicated) and experts split on their ffn dim.
COLWISE, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD = "colwise", "rowwise", "vocab_embedding", "vocab_head"
COLWISE_REPLICATED_KV, NORM, REGION_INPUT, POSITION_EMBEDDING = (
    "colwise_replicated_kv", "norm", "region_input", "position_embedding")
MOE_REGION = "moe_region"
# The planner's coarser per-parameter kind of each module kind (ParamSpec.tp).
_PARAM_KIND = {COLWISE: "col", COLWISE_REPLICATED_KV: "col", ROWWISE: "row", VOCAB_EMBEDDING: "vocab",
               VOCAB_HEAD: "vocab"}


@dataclass(frozen=True)
class Architecture:
    """One architecture's module tree, in registration order (= `model.parameters()` order): the
    single description models/ must build, the planner sizes and parallel/tensor.py splits."""

    ffn: str                                   # the block's feed-forward module
    ffn_norm: str                              # the norm before it
    mlp: tuple[tuple[str, str], ...]           # (linear, TP kind) of the dense MLP, in order
    embeddings: tuple[tuple[str, str], ...]    # (module, TP kind) of the input embeddings
    bias: bool                                 # linears and norms carry biases
    residual: tuple[str, ...]                  # projections writing into the residual stream (init)


ARCHITECTURES = {
    # LLaMA (Touvron et al. 2023): RMSNorm, RoPE, GQA, SwiGLU w2(silu(w1 x) * w3 x), no biases.
    "llama": Architecture("feed_forward", "ffn_norm", (("w1", COLWISE), ("w3", COLWISE), ("w2", ROWWISE)),
                          (("tok_embeddings", VOCAB_EMBEDDING),), False, ("wo", "w2")),
    # GPT-3 / Megatron: LayerNorm, learned positions, GELU MLP, biases, untied head.
    "gpt": Architecture("mlp", "mlp_norm", (("fc", COLWISE), ("proj", ROWWISE)),
                        (("tok_embeddings", VOCAB_EMBEDDING), ("pos_embeddings", POSITION_EMBEDDING)), True,
                        ("wo", "proj")),
}
ARCH_NAMES = tuple(ARCHITECTURES)  # models/__init__.py ARCHS builds each


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, global shape, and how tensor parallelism splits it.

    tp: "col" (output dim 0 split, Megatron column-parallel), "row" (input dim 1 split), "vocab"
    (embedding / head rows split), "expert" (stacked experts, split by ep and the inner dims by tp),
    or "" (replicated: norms, biases of row-parallel layers, router, learned positions).
    """

    name: str
    shape: tuple[int, ...]
    tp: str = ""
    decay: bool = True  # AdamW weight decay group: ndim >= 2 (train/optim.py)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    every_k_layers: int = 1
    capacity_factor: float = 1.0  # 0 = dropless
    expert_ffn_dim: int = 0  # 0 = model.ffn_dim
    num_shared_experts: int = 0

    @property
    def load_factor(self) -> float:
        """Expert rows per routed slot the planner sizes compute and activations for: the capacity
        factor (buffers padded to capacity), or 1 when dropless (balanced routing on average)."""
        return self.capacity_factor if self.capacity_factor > 0 else 1.0

    @property
    def sent_fraction(self) -> float:
        """Fraction of the T*k routed slots the all-to-all sends: dropped slots are not sent, and at
        most cf*T*k slots fit (balanced routing); dropless sends all of them."""
        return min(1.0, self.capacity_factor) if self.capacity_factor > 0 else 1.0

    def is_moe_layer(self, index: int) -> bool:
        """Block `index` (0-based) is MoE when (index + 1) % every_k_layers == 0 (every layer for k = 1)."""
        return (index + 1) % self.every_k_layers == 0


@dataclass(frozen=True)
class ModelShape:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    moe: MoESpec | None = None

    # ---- construction ----
    @classmethod
    def from_config(cls, model: Any) -> "ModelShape":
        """From a resolved `ModelConfig`. MoE keys are read with getattr defaults (`model.moe` may be
        a section object or dict with num_experts/top_k/...; absent or num_experts = 0: dense; capacity_factor 0 = dropless)."""
        moe_cfg = getattr(model, "moe", None)
        get = (moe_cfg.get if isinstance(moe_cfg, dict) else (lambda k, d=None: getattr(moe_cfg, k, d)))
        moe = None
        if moe_cfg is not None and (get("num_experts", 0) or 0) > 0:
            cf = get("capacity_factor", 0.0)
            moe = MoESpec(int(get("num_experts")), int(get("top_k", 2) or 2), int(get("every_k_layers", 1) or 1),
                          float(cf or 0.0), int(get("expert_ffn_dim", 0) or 0), int(get("num_shared_experts", 0) or 0))
        shape = cls(model.arch, model.dim, model.n_layers, model.n_heads, model.n_kv_heads or model.n_heads,
                    model.ffn_dim, model.vocab_size, model.max_seq_len, moe)
        return shape

    # ---- derived sizes ----
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def expert_ffn(self) -> int:
        return (self.moe.expert_ffn_dim or self.ffn_dim) if self.moe else self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    @cached_property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # ---- parameter inventory (model.parameters() order) ----
    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.arch]

    def embedding_params(self) -> list[ParamSpec]:
        rows = {"tok_embeddings": self.vocab_size, "pos_embeddings": self.max_seq_len}
        return [ParamSpec(f"{name}.weight", (rows[name], self.dim), _PARAM_KIND.get(kind, ""))
                for name, kind in self.architecture.embeddings]

    def head_params(self) -> list[ParamSpec]:
        """Final norm and output head (the root FSDP unit's tail)."""
        return self._norm("norm.") + [ParamSpec("output.weight", (self.vocab_size, self.dim), _PARAM_KIND[VOCAB_HEAD])]

    def layer_params(self, index: int) -> list[ParamSpec]:
        return self.block_params(self.is_moe_layer(index), f"layers.{index}.")

    def block_params(self, moe: bool, p: str = "layers.N.") -> tuple[ParamSpec, ...]:
        """The parameters of one dense (or MoE) transformer block, named with prefix `p` (cached: the
        planner asks for the same block many times)."""
        return _block_specs(self, moe, p)

    def _norm(self, p: str) -> list[ParamSpec]:
        h = self.dim
        return [ParamSpec(p + "weight", (h,), "", False)] + ([ParamSpec(p + "bias", (h,), "", False)] if self.architecture.bias else [])

    def _linear(self, p: str, out: int, inp: int, kind: str) -> list[ParamSpec]:
        """A linear's weight (out, in) and bias: a column-parallel bias is split with the output, a
        row-parallel one is replicated (added once, after the reduction)."""
        tp = _PARAM_KIND.get(kind, "")
        out_specs = [ParamSpec(p + "weight", (out, inp), tp)]
        if self.architecture.bias:
            out_specs.append(ParamSpec(p + "bias", (out,), tp if tp == "col" else "", False))
        return out_specs

    def _mlp(self, p: str, hidden: int) -> list[ParamSpec]:
        out = []
        for name, kind in self.architecture.mlp:
            rows, cols = (self.dim, hidden) if kind == ROWWISE else (hidden, self.dim)
            out += self._linear(f"{p}{name}.", rows, cols, kind)
        return out

    def _build_block(self, moe: bool, p: str) -> list[ParamSpec]:
        h, kv, arch = self.dim, self.kv_dim, self.architecture
        out = self._norm(p + "attention_norm.")
        for name, rows, kind in (("wq", h, COLWISE), ("wk", kv, COLWISE), ("wv", kv, COLWISE), ("wo", h, ROWWISE)):
            out += self._linear(p + f"attention.{name}.", rows, h, kind)
        out += self._norm(p + arch.ffn_norm + ".")
        ffn = p + arch.ffn + "."
        return out + (self._moe_params(ffn) if moe else self._mlp(ffn, self.ffn_dim))

    def _moe_params(self, prefix: str) -> list[ParamSpec]:
        """Router + stacked experts (E, out, in); no expert biases (torchtitan GroupedExperts)."""
        assert self.moe is not None
        e, h, f = self.moe.num_experts, self.dim, self.expert_ffn
        out = [ParamSpec(prefix + "router.weight", (e, h), "")]
        for name, kind in self.architecture.mlp:
            out.append(ParamSpec(prefix + f"experts.{name}", (e, h, f) if kind == ROWWISE else (e, f, h), "expert"))
        fs = self.moe.num_shared_experts * f
        if fs:  # one always-on MLP (models/moe.py), split by tp like a dense MLP
            out += self._mlp(prefix + "shared_experts.", fs)
        return out

    # ---- the tensor-parallel plan (parallel/tensor.py applies it) ----
    def tp_modules(self, tp: int) -> dict[str, str]:
        """{module fqn pattern: TP kind}; `*` stands for every block index. KV projections are
        replicated across the ranks that share a KV head when there are fewer KV heads than ranks."""
        arch = self.architecture
        kv = COLWISE_REPLICATED_KV if self.n_kv_heads < tp else COLWISE
        attention = {"attention_norm": NORM, "attention": REGION_INPUT, "attention.wq": COLWISE, "attention.wk": kv,
                     "attention.wv": kv, "attention.wo": ROWWISE, arch.ffn_norm: NORM}
        dense = {arch.ffn: REGION_INPUT, **{f"{arch.ffn}.{name}": kind for name, kind in arch.mlp}}
        plan = dict(arch.embeddings)
        plan.update({f"layers.*.{name}": kind for name, kind in attention.items()})
        if self.moe is None:
            plan.update({f"layers.*.{name}": kind for name, kind in dense.items()})
        else:
            # MoE blocks (every k-th) differ from dense ones: one entry per block index. A pipeline
            # stage drops the entries of blocks it does not hold (parallel/tensor.py).
            for i in range(self.n_layers):
                block = {arch.ffn: MOE_REGION} if self.is_moe_layer(i) else dense
                plan.update({f"layers.{i}.{name}": kind for name, kind in block.items()})
        plan.update({"norm": NORM, "output": VOCAB_HEAD})
        return plan

    def params(self) -> list[ParamSpec]:
        out = list(self.embedding_params())
        for i in range(self.n_layers):
            out += self.layer_params(i)
        return out + self.head_params()

    # ---- counts ----
    @staticmethod
    def count(specs: list[ParamSpec]) -> int:
        return sum(s.numel for s in specs)

    @cached_property
    def num_params(self) -> int:
        return self.count(self.params())

    @cached_property
    def head_numel(self) -> int:
        return self.count(self.head_params())

    def fp8_linears(self, moe: bool) -> tuple[int, int]:
        """(weight elements, tensors) of one block's linears that FP8 converts (parallel/float8.py): every
        2-D weight but the router and the stacked experts (which are not nn.Linear)."""
        specs = [sp for sp in self.block_params(moe) if len(sp.shape) == 2 and sp.tp != "expert"
                 and not sp.name.endswith("router.weight")]
        return sum(sp.numel for sp in specs), len(specs)

    def block_matmul_numel(self, moe: bool, active: bool) -> int:
        """GEMM weights of one block; `active`: only the top_k experts a token visits (+ the router)."""
        return _block_matmul(self, moe, active)

    def _count_block_matmul(self, moe: bool, active: bool) -> int:
        total = 0
        for spec in self.block_params(moe):
            if len(spec.shape) < 2:
                continue
            n = spec.numel
            if spec.tp == "expert" and active and self.moe is not None:
                n = n * self.moe.top_k // self.moe.num_experts
            total += n
        return total

    @cached_property
    def active_matmul_params(self) -> int:
        """Weights every token multiplies with: blocks (top_k experts for MoE) + output head. For a
        dense model these are the weights of every GEMM."""
        n_moe = self.n_moe_layers
        dense = (self.n_layers - n_moe) * self.block_matmul_numel(False, True)
        moe = n_moe * self.block_matmul_numel(True, True) if n_moe else 0
        return dense + moe + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs per trained token, forward + backward: 6 N_active + 12 L s h (PaLM, Chowdhery et al.
        2022, arXiv 2204.02311, App. B) — the definition `Transformer.count_flops_per_token` returns,
        so the planner's MFU and the trainer's agree. The causal mask is not discounted."""
        return 6 * self.active_matmul_params + 12 * self.n_layers * seq_len * self.dim


    def pipeline_costs(self, seq_len: int) -> dict[str, float]:
        """Training cost per token of the parts a pipeline split places, in FLOP-equivalents:
        {'embedding', 'block', 'head'} (spec/stages.py balanced_split). GEMMs and attention count their
        FLOPs (as flops_per_token); the memory-bound parts — the embedding gather and its scatter-add
        gradient, the cross-entropy over V logits — count the bytes they move times the ridge point of
        a GPU (MEMORY_BOUND_FLOPS_PER_BYTE), so the first and last stage are not treated as free."""
        head_numel = self.vocab_size * self.dim
        block = 6 * (self.active_matmul_params - head_numel) / self.n_layers + 12 * seq_len * self.dim
        # Embedding: read + write an h-vector forward, read the gradient + read-modify-write the
        # table row backward (fp32): ~5 x 4h bytes per token.
        embedding = 5 * 4 * self.dim * MEMORY_BOUND_FLOPS_PER_BYTE
        # Head: the GEMM (6Vh) plus softmax/cross-entropy forward and backward, ~4 passes over V fp32 logits.
        head = 6 * head_numel + 4 * 4 * self.vocab_size * MEMORY_BOUND_FLOPS_PER_BYTE
        return {"embedding": float(embedding), "block": float(block), "head": float(head)}


@lru_cache(maxsize=4096)
def _block_specs(shape: ModelShape, moe: bool, prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(shape._build_block(moe, prefix))


@lru_cache(maxsize=4096)
def _block_matmul(shape: ModelShape, moe: bool, active: bool) -> int:
    return shape._count_block_matmul(moe, active)
