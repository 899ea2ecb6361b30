"""Model shapes for the planner, without torch: every parameter's shape, counts and FLOPs per token.

`ModelShape.params()` lists the parameters in the order `model.parameters()` yields them (the order
matters: ZeRO-1 (parallel/zero1.py) partitions greedily in that order, and FSDP2 pads per parameter), for
the two architectures in `shardwise.models` (llama: RMSNorm, RoPE, GQA, SwiGLU, no biases; gpt:
LayerNorm, learned positions, GELU 4h MLP, biases, untied head). tests/unit/test_plan_memory.py checks
them against the real modules built on the meta device and against `Transformer.param_counts`.

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


ARCH_NAMES = ("llama", "gpt")  # models/__init__.py ARCHS builds each


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

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in one MLP: SwiGLU w1, w3, w2 (llama) or fc, proj (gpt)."""
        return 3 if self.arch == "llama" else 2

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(index)

    @cached_property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # ---- parameter inventory (model.parameters() order) ----
    def embedding_params(self) -> list[ParamSpec]:
        out = [ParamSpec("tok_embeddings.weight", (self.vocab_size, self.dim), "vocab")]
        if self.arch == "gpt":
            out.append(ParamSpec("pos_embeddings.weight", (self.max_seq_len, self.dim), ""))
        return out

    def head_params(self) -> list[ParamSpec]:
        """Final norm and output head (the root FSDP unit's tail)."""
        h = self.dim
        norm = [ParamSpec("norm.weight", (h,), "", False)]
        if self.arch == "gpt":
            norm.append(ParamSpec("norm.bias", (h,), "", False))
        return norm + [ParamSpec("output.weight", (self.vocab_size, h), "vocab")]

    def layer_params(self, index: int) -> list[ParamSpec]:
        return self.block_params(self.is_moe_layer(index), f"layers.{index}.")

    def block_params(self, moe: bool, p: str = "layers.N.") -> tuple[ParamSpec, ...]:
        """The parameters of one dense (or MoE) transformer block, named with prefix `p` (cached: the
        planner asks for the same block many times)."""
        return _block_specs(self, moe, p)

    def _build_block(self, moe: bool, p: str) -> list[ParamSpec]:
        h, kv, f = self.dim, self.kv_dim, self.ffn_dim
        if self.arch == "llama":
            out = [ParamSpec(p + "attention_norm.weight", (h,), "", False),
                   ParamSpec(p + "attention.wq.weight", (h, h), "col"),
                   ParamSpec(p + "attention.wk.weight", (kv, h), "col"),
                   ParamSpec(p + "attention.wv.weight", (kv, h), "col"),
                   ParamSpec(p + "attention.wo.weight", (h, h), "row"),
                   ParamSpec(p + "ffn_norm.weight", (h,), "", False)]
            if moe:
                return out + self._moe_params(p + "feed_forward.")
            return out + [ParamSpec(p + "feed_forward.w1.weight", (f, h), "col"),
                          ParamSpec(p + "feed_forward.w3.weight", (f, h), "col"),
                          ParamSpec(p + "feed_forward.w2.weight", (h, f), "row")]
        out = [ParamSpec(p + "attention_norm.weight", (h,), "", False), ParamSpec(p + "attention_norm.bias", (h,), "", False)]
        for name, rows, tp in (("wq", h, "col"), ("wk", kv, "col"), ("wv", kv, "col"), ("wo", h, "row")):
            out += [ParamSpec(p + f"attention.{name}.weight", (rows, h), tp),
                    ParamSpec(p + f"attention.{name}.bias", (rows,), "col" if tp == "col" else "", False)]
        out += [ParamSpec(p + "mlp_norm.weight", (h,), "", False), ParamSpec(p + "mlp_norm.bias", (h,), "", False)]
        if moe:
            return out + self._moe_params(p + "mlp.")
        return out + [ParamSpec(p + "mlp.fc.weight", (f, h), "col"), ParamSpec(p + "mlp.fc.bias", (f,), "col", False),
                      ParamSpec(p + "mlp.proj.weight", (h, f), "row"), ParamSpec(p + "mlp.proj.bias", (h,), "", False)]

    def _moe_params(self, prefix: str) -> list[ParamSpec]:
        """Router + stacked experts (E, out, in); no expert biases (torchtitan GroupedExperts)."""
        assert self.moe is not None
        e, h, f = self.moe.num_experts, self.dim, self.expert_ffn
        names = ("w1", "w3", "w2") if self.arch == "llama" else ("fc", "proj")
        out = [ParamSpec(prefix + "router.weight", (e, h), "")]
        for n in names:
            shape = (e, h, f) if n in ("w2", "proj") else (e, f, h)
            out.append(ParamSpec(prefix + f"experts.{n}", shape, "expert"))
        fs = self.moe.num_shared_experts * f
        if fs:  # one always-on MLP (models/moe.py), split by tp like a dense MLP
            p = prefix + "shared_experts."
            if self.arch == "llama":
                out += [ParamSpec(p + "w1.weight", (fs, h), "col"), ParamSpec(p + "w3.weight", (fs, h), "col"),
                        ParamSpec(p + "w2.weight", (h, fs), "row")]
            else:
                out += [ParamSpec(p + "fc.weight", (fs, h), "col"), ParamSpec(p + "fc.bias", (fs,), "col", False),
                        ParamSpec(p + "proj.weight", (h, fs), "row"), ParamSpec(p + "proj.bias", (h,), "", False)]
        return out

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
    def embedding_numel(self) -> int:
        return self.count(self.embedding_params())

    @cached_property
    def head_numel(self) -> int:
        return self.count(self.head_params())

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
        dense model this equals `Transformer.param_counts()["matmul"]`."""
        n_moe = self.n_moe_layers
        dense = (self.n_layers - n_moe) * self.block_matmul_numel(False, True)
        moe = n_moe * self.block_matmul_numel(True, True) if n_moe else 0
        return dense + moe + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs per trained token, forward + backward: 6 N_active + 12 L s h (PaLM, Chowdhery et al.
        2022, arXiv 2204.02311, App. B) — the same definition as `Transformer.count_flops_per_token`,
        so the planner's MFU and the trainer's agree. The causal mask is not discounted."""
        return 6 * self.active_matmul_params + 12 * self.n_layers * seq_len * self.dim


@lru_cache(maxsize=4096)
def _block_specs(shape: ModelShape, moe: bool, prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(shape._build_block(moe, prefix))


@lru_cache(maxsize=4096)
def _block_matmul(shape: ModelShape, moe: bool, active: bool) -> int:
    return shape._count_block_matmul(moe, active)
