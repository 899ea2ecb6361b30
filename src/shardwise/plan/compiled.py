"""A compiled block (train.compile, parallel/compile.py: torch.compile with inductor, one graph per block):
what its kernels move through memory and what it saves for backward, derived from the block's ops.

Inductor turns a block's graph into extern kernels — the GEMMs (cuBLAS) and SDPA, which stay as they
are eager — and fused Triton kernels: every chain of pointwise ops between two extern kernels, and a
row reduction with the pointwise ops on either side of it (an RMSNorm with its casts, a residual add
with the next norm), becomes one kernel that reads its inputs from memory once and writes its outputs
once (Ansel et al. 2024, "PyTorch 2", ASPLOS, §5: inductor's loop-level IR fuses pointwise and
reduction nodes that share an iteration space). So a compiled block's memory-bound time is the bytes
crossing the boundaries of those groups, not the sum over every op of plan/activations.py
pointwise_forward_bytes (the eager count, 3-4x more on a llama block).

Backward is one graph too: AOTAutograd's min-cut partitioner (torch._functorch.partitioners
min_cut_rematerialization_partition) saves for it what the backward needs at the cheapest cut and
recomputes the pointwise chains in between, fused into the backward's kernels. It never recomputes
GEMMs, SDPA or reductions (they are banned from recomputation unless `aggressive_recomputation`), so
what survives the forward is: the block input, each norm's rsqrt (a reduction's output), every GEMM's
input (for its weight gradient: the two norm outputs in the compute dtype, SDPA's output laid out for
wo, SwiGLU's product for w2), SDPA's own inputs and outputs (q, k after RoPE, v, out, log-sum-exp),
and the up-projections' outputs that the activation function's backward needs. Intermediate pointwise
results (fp32 norm internals, the autocast casts, silu's output, RoPE's rotated halves) are
recomputed. Held to a count on CPU (tests/unit/test_plan_compiled.py compiles a llama and a gpt block
and lists their saved storages: equal to the byte) and to the H100 runs
(tests/fixtures/h100_runs_compiled.json: the compiled mb8 / mb4 peaks, less what the planner counts
besides, give 77.6 kB per token and block on the 886M model; this inventory says 66.6 kB, and 8 of the
10 compiled rows' peaks come out within -4% .. +8%; tests/unit/test_plan_h100.py lists the two that do
not, and why their measurements are in doubt).

The MoE feed-forward runs eagerly inside a compiled block (parallel/compile.py apply_compile): its
bytes and saved tensors are the eager ones.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.plan import activations as A
from shardwise.spec.shapes import ModelShape


def _sizes(shape: ModelShape, reg: str, tp: int) -> tuple[int, int, float, float]:
    """(a, r, local kv width, ffn width per rank): compute-dtype bytes, residual-stream bytes."""
    a = 4 if reg == "fp32" else 2
    r = 2 if reg == "lowp" else 4
    return a, r, max(shape.kv_dim / tp, shape.head_dim), shape.ffn_dim / tp


@lru_cache(maxsize=1 << 12)
def block_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, moe_layer: bool = False) -> A.BlockActivations:
    """Saved bytes per token of one compiled block without recomputation (module docstring):
      norms        (r h + 2 x 4) / res_div        the block input and each norm's rsqrt (the second norm's
                                                  backward works from its output: the stream there is not kept)
      norm outputs 2 x a h                        the GEMMs' input (all-gathered under SP: full size)
      attention    activations.attention_bytes    q, k (after RoPE), v, out, log-sum-exp (flash/cuDNN)
      wo input     a h / tp                       SDPA's (b, heads, s, d) output transposed for wo: a copy
      MLP          llama 3 a f / tp               w1 and w3 outputs (SwiGLU's backward) and their product
                   gpt   2 a f / tp               fc output (GELU's backward) and the GELU output (proj's input)
    Under autocast, the 16-bit casts of the block's weights (`fixed`), as eager autocast keeps them. FP8
    (torchao Float8Linear): the same 16-bit inputs, and no weight copies (the FP8 weight is recast from
    the fp32 parameter, a graph input)."""
    h = shape.dim
    a, r, kv, f = _sizes(shape, reg, tp)
    res_div = tp if sp else 1
    rsqrt = 4 if shape.arch == "llama" else 8  # RMSNorm's rsqrt; LayerNorm's mean and rstd
    # A GEMM input is saved in the compute dtype, under FP8 too: torchao's Float8Linear saves its
    # high-precision input and recasts it in backward (the 886M H100 rows: FP8's peak is bf16's less
    # exactly the weight copies, 1.41 GiB).
    per_token = (r * h + 2 * rsqrt) / res_div + 2 * a * h + A.attention_bytes(shape, a, tp) + a * h / tp
    # Under autocast the 16-bit copies of the block's weights, one per micro-batch (counted on CPU); FP8
    # casts its fp32 parameters itself and keeps none; fp32 and 16-bit parameters have no copies.
    fixed = 2.0 * shape.block_matmul_numel(moe_layer, active=False) / tp if reg == "autocast" else 0.0
    if moe_layer and shape.moe is not None:
        # The MoE feed-forward runs eagerly between two graphs (parallel/compile.py apply_compile): the graph
        # hands it the MLP norm's output, of which it keeps a 16-bit copy under autocast, as a dense block keeps
        # its GEMM input, and nothing otherwise (the router or the shared experts keep what they read); then
        # the eager feed-forward's own bytes (activations.moe_feed_forward) but the norm's, which the graph
        # holds; and the weight copies it makes (FP8: the experts' and the router's; 16-bit parameters: the
        # router's), which the compiled part does not (under autocast `fixed` has every weight's already).
        # Held to a compiled MoE block on CPU for llama and gpt, with and without a shared expert
        # (tests/unit/test_plan_moe_memory.py).
        ffn, ffn_fixed = A.moe_feed_forward(shape, reg, tp, res_div, shape.moe.load_factor)
        norm_input = 0.0 if reg == "autocast" else a * h
        return A.BlockActivations(per_token - norm_input + ffn - A.moe_norm_internals(shape, reg) / res_div,
                                  fixed + (ffn_fixed if reg != "autocast" else 0.0))
    per_token += (3 if shape.arch == "llama" else 2) * a * f
    return A.BlockActivations(per_token, fixed)


@lru_cache(maxsize=1 << 12)
def pointwise_forward_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, moe_layer: bool = False) -> float:
    """Bytes per token the fused (Triton) kernels of one compiled block move in forward:
      norm 1              read r h, write a h                         (RMSNorm / LayerNorm + cast, one kernel)
      RoPE (llama)        read and write q, k: 2 a (h/tp + kv)
      add + norm 2        read r h + a h, write r h + a h             (residual add fused into the norm)
      activation          SwiGLU read 2 a f, write a f; GELU read a f, write a f
      residual add        read r h + a h, write r h
    with the residual stream's share divided by tp under SP. Backward moves about twice this (each
    group's gradient reads its saved inputs and the incoming gradient, and writes the input gradients),
    as for eager kernels. A MoE block's feed-forward runs eagerly: its share is
    `eager_moe_pointwise_bytes`, at the eager rate."""
    h = shape.dim
    a, r, kv, f = _sizes(shape, reg, tp)
    res_div = tp if sp else 1
    stream = ((r + a) * h + (2 * r + 2 * a) * h + (2 * r + a) * h) / res_div
    rope = fused_rope_bytes(shape, reg, tp)
    if moe_layer and shape.moe is not None:
        return stream + rope
    act = 3 * a * f if shape.arch == "llama" else 2 * a * f
    return stream + rope + act


def eager_moe_pointwise_bytes(shape: ModelShape, reg: str, tp: int) -> float:
    """The eager MoE feed-forward's share of activations.pointwise_forward_bytes (its expert MLPs' pointwise
    ops)."""
    return A.mlp_pointwise_forward_bytes(shape, reg, tp, moe_layer=True) if shape.moe is not None else 0.0


def selective_norm_bytes(shape: ModelShape, reg: str, tp: int, sp: bool) -> float:
    """Per token and block, what a compiled selective ("op") recomputation adds: the policy makes the two
    norms (reductions the partitioner would have saved) run again, each reading the residual stream and
    writing the normalized tensor."""
    a, r, _, _ = _sizes(shape, reg, tp)
    return 2 * (r / (tp if sp else 1) + a) * shape.dim


def weight_cast_bytes(shape: ModelShape, reg: str, tp: int, moe_layer: bool) -> float:
    """Per micro-batch and block, forward: under autocast (fp32 parameters, 16-bit compute) the graph
    casts each weight it multiplies by (read 4 B, write 2 B per element); backward casts each 16-bit
    weight gradient back to fp32 for .grad (read 2, write 4): the same bytes again, not twice. 16-bit
    parameters (lowp) and fp32 compute have no casts."""
    if reg not in ("autocast", "autocast_fp8"):
        return 0.0
    return 6.0 * shape.block_matmul_numel(moe_layer, active=False) / tp


def fused_norm_forward_bytes(shape: ModelShape, reg: str, tp: int, sp: bool) -> float:
    """An eager stack with fused norm kernels (cluster.norm_kernel = "fused": Apex / Transformer Engine
    class RMSNorm): each of the two norms reads the residual stream and writes its output in the same
    dtype, one kernel. gpt's nn.LayerNorm is one kernel already (activations.norm_forward_bytes)."""
    if shape.arch != "llama":
        return A.norm_forward_bytes(shape, reg, tp, sp)
    _, r, _, _ = _sizes(shape, reg, tp)
    return 2 * 2 * r * shape.dim / (tp if sp else 1)


def fused_rope_bytes(shape: ModelShape, reg: str, tp: int) -> float:
    """Bytes per token of a llama block's RoPE inside the fused kernels: read and write q and k once."""
    if shape.arch != "llama":
        return 0.0
    a, _, kv, _ = _sizes(shape, reg, tp)
    return 2 * a * (shape.dim / tp + kv)


def complex_rope_bytes(shape: ModelShape, reg: str, tp: int) -> tuple[float, float]:
    """Bytes per token of one llama block's forward RoPE on q and k written as complex multiplication
    (cluster.rope_kernel = "complex", plan/stack.py), as (cast kernels, the multiply): q and k cast to fp32
    (read a, write 4), viewed as complex and multiplied by the fp32 table in inductor's eager fallback kernel
    (read 4, write 4; the table is cached), viewed back and cast (read 4, write a). Eager runs the same three
    kernels. The fused kernels' RoPE (`pointwise_forward_bytes`: read and write a) is what this replaces."""
    if shape.arch != "llama":
        return 0.0, 0.0
    a, _, kv, _ = _sizes(shape, reg, tp)
    width = shape.dim / tp + kv
    return 2 * (a + 4) * width, 8 * width
