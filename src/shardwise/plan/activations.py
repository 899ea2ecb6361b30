"""Activation bytes saved for backward, per token, per block — an inventory of what this codebase's
modules actually save, not a generic textbook constant.

Korthikanti et al. 2022 (arXiv 2205.05198, §4, Table 2) count a GPT block in 16-bit with dropout as
sbh(34 + 5as/h) bytes: 34 sbh for the layer's tensors and 5as²b for the attention score matrix and its
softmax / dropout. With TP: sbh(10 + 24/t + 5as/(ht)); with TP + SP: sbh(34 + 5as/h)/t; with selective
recomputation of the attention core: 34 sbh/t; with full recomputation: 2 sbh (the block input).
`korthikanti_bytes_per_layer` implements exactly those (tests check Table 2), for comparison.

Our modules differ from that GPT in ways that change the constant, so the planner uses an inventory
(each entry was observed with autograd's saved-tensor hooks on the tiny presets, see
tests/dist/test_plan_validation.py): FlashAttention (SDPA) saves q, k, v, out and the log-sum-exp,
never the s x s scores (no 5as/h term); there is no dropout; RMSNorm is written in Python and saves
its input, rsqrt, the normalized tensor and its output; RoPE saves new q/k; SwiGLU saves 4 f-wide
tensors; the loss saves fp32 log-softmax of the logits (or, chunked, the logits and a log-sum-exp per
token: spec/loss.py). The dtypes depend on the precision regime:
  fp32     every tensor 4 bytes;
  autocast bf16/fp16 compute with fp32 parameters (single process, DDP, ZeRO-1): the residual stream
           and norms stay fp32; every linear saves its own low-precision copy of its input and of its
           weight (autocast casts are new storages, held until backward);
  lowp     16-bit parameters (FSDP2 MixedPrecisionPolicy param_dtype, or "mixed" model states): the
           residual stream is 16-bit, norms upcast to fp32 inside, no weight copies.
Tensor / sequence parallelism (torch DTensor TP, as parallel/tensor.py will apply it): head- and
ffn-sharded tensors are divided by tp; residual-stream / norm tensors by tp only under SP; the input of
a column-parallel linear is saved after its all-gather (full size, unlike Korthikanti's SP which keeps
it sharded); a row-parallel linear's output is a full-size partial sum. CP divides the tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardwise.spec.shapes import ModelShape

REGIMES = ("fp32", "autocast", "autocast_fp8", "lowp")


@dataclass(frozen=True)
class BlockActivations:
    """Bytes one block saves for one micro-batch: `per_token` x tokens + `fixed` (weight copies)."""

    per_token: float
    fixed: float


def regime(precision: str, fsdp: bool, model_states: str) -> str:
    """fp32, autocast (fp32 parameters, 16-bit compute), autocast_fp8 (the same with torchao's float8
    linears in the blocks: parallel/float8.py) or lowp (16-bit parameters; FP8's linears then save the
    same 16-bit inputs a plain linear does, so lowp covers both)."""
    if precision == "fp32":
        return "fp32"
    if fsdp or model_states == "mixed":
        return "lowp"
    return "autocast_fp8" if precision == "fp8" else "autocast"


def _norm(shape: ModelShape, reg: str, res_div: float, consumers: int) -> float:
    """Bytes per token one pre-norm saves, plus the saved input of the `consumers` linears after it.

    llama RMSNorm (models/llama.py): fp32: x, rsqrt, x*rsqrt, output y (saved by the linears: one
    storage); autocast: x, rsqrt, x*rsqrt in fp32, then one 16-bit cast of y per consuming linear;
    lowp: x.float() copy, rsqrt, the 16-bit normalized tensor, y (16-bit, one storage).
    gpt nn.LayerNorm: saves input, mean, rstd; autocast runs it in fp32 and each linear casts y.
    The norm's own tensors are sequence-sharded under SP (res_div); the linear input y is all-gathered.
    """
    h = shape.dim
    if shape.arch == "llama":
        internals = 4 * h + 4 + (2 if reg == "lowp" else 4) * h
    else:
        internals = 4 * h + 8
    return internals / res_div + norm_output_bytes(shape, reg, consumers)


def norm_output_bytes(shape: ModelShape, reg: str, consumers: int) -> float:
    """Bytes per token the linears after a norm keep of its output y (`_norm`): one storage, or under autocast
    a 16-bit cast per consuming linear; an fp32 y where the linears save the fp32 tensor (fp32, torchao's
    Float8Linear); LayerNorm runs in fp32 under lowp, so each linear casts its output again."""
    h = shape.dim
    if reg in ("fp32", "autocast_fp8"):
        return 4 * h
    if shape.arch == "llama" and reg == "lowp":
        return 2 * h
    return consumers * 2 * h


def gathered_input_bytes(shape: ModelShape, reg: str, moe_layer: bool, compiled: bool) -> float:
    """Per token, the norm outputs a block keeps as its column-parallel linears' input, all-gathered under SP
    and counted full size by `block_bytes` and compiled.block_bytes: both norms' of a dense block, the
    attention norm's of a MoE block (its feed-forward keeps what moe_feed_forward counts). Under
    cluster.sp_saved_input = "sharded" (plan/stack.py) a block keeps 1/tp of this instead."""
    if compiled:
        return (1 if moe_layer else 2) * (4 if reg == "fp32" else 2) * shape.dim
    return norm_output_bytes(shape, reg, 3) + (0.0 if moe_layer else norm_output_bytes(shape, reg, up_projections(shape)))


@lru_cache(maxsize=1 << 14)
def block_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, moe_layer: bool = False,
                capacity_factor: float | None = None, attention: str = "flash", seq_len: int = 0) -> BlockActivations:
    """Saved bytes of one block with no recomputation (see the module docstring for each term);
    `attention` is the SDPA backend (spec/layout.py attention_backend), `seq_len` the keys per query."""
    h = shape.dim
    res_div = tp if sp else 1
    a = 4 if reg == "fp32" else 2          # activation element bytes
    ups = up_projections(shape)
    per_token = _norm(shape, reg, res_div, 3) + attention_bytes(shape, a, tp, attention, seq_len)
    fixed = 0.0
    if reg == "autocast":
        # One 16-bit copy of every (local) linear weight per micro-batch (models.common.Attention /
        # SwiGLU / GELUMLP under torch.autocast; a MoE block's experts and router too). Float8Linears
        # (autocast_fp8) keep none: they save the fp32 parameter itself and cast again in backward (all of a
        # block's linears, whose dims are multiples of 16 in every preset).
        fixed = 2 * _local_block_matmul(shape, tp, moe_layer)
    elif reg == "lowp" and shape.arch == "gpt":
        fixed = 2 * 2 * 4 * h  # two LayerNorms' fp32 casts of their 16-bit weight and bias
    if moe_layer and shape.moe is not None:
        cf = capacity_factor if capacity_factor is not None else shape.moe.load_factor
        moe_per_token, moe_fixed = moe_feed_forward(shape, reg, tp, res_div, cf)
        return BlockActivations(per_token + moe_per_token, fixed + moe_fixed)
    # SwiGLU: w1 out, silu out, w3 out, product; GELU: fc out, gelu out
    per_token += _norm(shape, reg, res_div, ups) + mlp_intermediates(shape) * a * shape.ffn_dim / tp
    return BlockActivations(per_token, fixed)


def moe_norm_internals(shape: ModelShape, reg: str) -> float:
    """What a MoE block's MLP norm keeps of its own per token before SP's division (moe_feed_forward): llama's
    RMSNorm x.float() (4h), rsqrt, x * rsqrt (4h; 16-bit parameters: the 16-bit normalized tensor, 2h); gpt's
    LayerNorm its input, mean and rstd."""
    h = shape.dim
    return (4 * h + 8) if shape.arch == "gpt" else (4 * h + 4 + (2 if reg == "lowp" else 4) * h)


def moe_feed_forward(shape: ModelShape, reg: str, tp: int, res_div: float, cf: float) -> tuple[float, float]:
    """(bytes per token, fixed bytes) a MoE block's MLP norm and feed-forward save (models/moe.py), by regime
    (a: the compute dtype's bytes; ups: the up-projections, SwiGLU's 2, GELU's 1; every regime but fp32 runs
    under torch.autocast, 16-bit parameters too):
      the norm's output y: the router reads y.float() (fp32: y itself, one storage with what the norm keeps;
      otherwise autocast's 16-bit cast of it, 2h); the shared experts' linears read y (autocast: a 16-bit
      cast per up-projection; FP8's Float8Linears y itself, fp32; lowp y itself, 16-bit); the routed copies
      are gathered from it, which keeps nothing of it;
      per routed copy (top_k per token x the capacity / load factor): its input (a h; under fp32 parameters
      cast per up-projection, FP8's included: the experts are not Float8Linears), the expert's
      intermediates, its output as y.float() (4h, for the routing-weight product); three int64 index
      vectors (top-k ids, sort order, token of each copy) and the top-k probability and gathered weight in
      the router's dtype (16-bit under autocast), as are the per-token router probabilities (E) and top-k
      sum; the shared experts' intermediates as a dense MLP's;
      fixed: under autocast every weight's 16-bit copy (block_bytes' own); under FP8 the experts' and the
      router's (the attention and shared linears are Float8Linears); under lowp the router's (of its
      y.float()-style fp32 copy).
    Measured with saved-tensor hooks, llama and gpt, with and without a shared expert, fp32 / autocast /
    lowp / FP8: equal to the byte but the aux-loss statistics' 18-36 (tests/unit/test_plan_moe_memory.py);
    the z-loss, when on, adds the fp32 logits (4 E + 8)."""
    moe, h, f = shape.moe, shape.dim, shape.expert_ffn
    a = 4 if reg == "fp32" else 2
    ups = up_projections(shape)
    fp32_params = reg in ("autocast", "autocast_fp8")
    internals = moe_norm_internals(shape, reg)
    shared = moe.num_shared_experts > 0
    y = 4 * h if reg == "fp32" else 2 * h + ({"lowp": 2 * h, "autocast": ups * 2 * h, "autocast_fp8": 4 * h}[reg] if shared else 0.0)
    p = 4 if reg == "fp32" else 2  # the router's dtype
    routed = (ups if fp32_params else 1) * a * h + mlp_intermediates(shape) * a * f / tp + 4 * h
    per_token = internals / res_div + y + moe.top_k * cf * routed + moe.top_k * (3 * 8 + 2 * p) + (moe.num_experts + 1) * p
    per_token += mlp_intermediates(shape) * a * moe.num_shared_experts * f / tp
    fixed = 0.0
    if reg == "autocast_fp8":
        fixed = 2 * ((ups + 1) * moe.num_experts * f * h / tp + moe.num_experts * h)
    elif reg == "lowp":
        fixed = 2 * moe.num_experts * h
    return per_token, fixed


def up_projections(shape: ModelShape) -> int:
    """Linears reading an MLP's input: SwiGLU's w1 and w3, GELU's fc."""
    return 2 if shape.arch == "llama" else 1


def mlp_intermediates(shape: ModelShape) -> int:
    """ffn-wide tensors a dense MLP saves for backward (`block_bytes`): SwiGLU's w1 output, silu output,
    w3 output and their product (w2's input); GELU's fc output and gelu output (proj's input)."""
    return 4 if shape.arch == "llama" else 2


@lru_cache(maxsize=1 << 12)
def tiled_mlp_delta(shape: ModelShape, reg: str) -> BlockActivations:
    """What parallel.linear_tiles > 1 changes in a dense block's saved bytes without recomputation (add it
    to `block_bytes`; tp = 1: tiles do not combine with TP, FP8 or MoE, spec/rules.py linear_tiles_rules).

    The tiled MLP (parallel/tiling.py) is one autograd Function that saves only its input, cast to the
    compute dtype (`xc`), and the weights, and recomputes each tile's up-projections and pointwise ops
    in backward. Against the untiled block:
      - the MLP's ffn-wide intermediates are no longer saved: - mlp_intermediates x a x f per token
        (measured: tests/unit/test_linear_tiles.py test_measured_peak_activations_drop);
      - the linears' saved inputs (`_norm`'s consumer term of the MLP's norm) become the one xc: the
        same storage where x already is in the compute dtype (fp32; lowp), one 16-bit cast where each
        linear saved its own under autocast — llama's w1 and w3 two casts of 2h: - 2h; gpt's fc one: 0;
      - under autocast the MLP's 16-bit weight copies are made per tile inside the Function's forward
        (no graph) and not kept: - 2 bytes x the MLP's weight elements per micro-batch (`fixed`).
    The weights themselves are parameters (no new storage)."""
    h, f = shape.dim, shape.ffn_dim
    a = 4 if reg == "fp32" else 2
    per_token = -mlp_intermediates(shape) * a * f
    if shape.arch == "llama" and reg == "autocast":
        per_token -= 2 * h
    fixed = -2.0 * (3 if shape.arch == "llama" else 2) * h * f if reg == "autocast" else 0.0
    return BlockActivations(per_token, fixed)


def tiled_mlp_transient(shape: ModelShape, reg: str, tiles: int) -> float:
    """Bytes per token live at once while the tiled MLP's backward works on one tile (tiling.py backward,
    counted statement by statement): SwiGLU holds a = w1 x, b = w3 x, s = silu(a), dh = dy w2, da and
    db (6 tile-wide tensors, ffn/tiles each, before `del`), GELU a = fc x, dy proj and da (3); plus dx,
    accumulated over the tiles in fp32 (4h), and one tile's dx contribution (a h) before it is added.
    The forward's tile transient is smaller (4 / 2 tile-wide tensors) and at a point of the step where
    less is stored."""
    a = 4 if reg == "fp32" else 2
    wide = 6 if shape.arch == "llama" else 3
    return wide * a * shape.ffn_dim / tiles + (4 + a) * shape.dim


def tiled_selective_delta(shape: ModelShape, reg: str) -> float:
    """Selective "op" checkpointing with tiles: its policy caches matmul outputs but not the tiled MLP's
    (activation_checkpoint.py asks the block's tiling.UncachedRegion), so the MLP's share of
    `selective_op_block_bytes` — its up-projection outputs and its down-projection output, a x
    (ups x f + h) per token — is not kept; the block's replay in backward reruns the tiled forward
    instead (plan/cost.py)."""
    a = 4 if reg == "fp32" else 2
    ups = up_projections(shape)
    return -a * (ups * shape.ffn_dim + shape.dim)


def attention_bytes(shape: ModelShape, a: int, tp: int, attention: str = "flash", seq_len: int = 0) -> float:
    """Per token, what the attention core keeps for backward, by SDPA backend.
    flash / efficient: q (new after RoPE for llama; a view of wq's output for gpt), k, v, the output
      (whose (b, s, h) view wo saves too: one storage) and the fp32 log-sum-exp per head.
    math (aten _scaled_dot_product_attention_math): the scaled q, the scaled k repeated to every query
      head (GQA) and the repeated v (saved by the two matmuls), the softmax output — the s x s
      probabilities, seq_len per head per query token — and wo's input, a copy (the math output is
      (b, heads, s, d)-contiguous, so transpose + reshape copies it)."""
    h, nh = shape.dim / tp, shape.n_heads / tp
    if attention == "math":
        return a * (4 * h + nh * seq_len)
    kv_local = max(shape.kv_dim / tp, shape.head_dim)  # KV heads replicate when tp > n_kv_heads
    return a * (2 * h + 2 * kv_local) + 4 * nh


def core_internal_bytes(shape: ModelShape, a: int, tp: int, attention: str = "flash", seq_len: int = 0) -> float:
    """Per token, what the attention core keeps beyond its inputs q, k, v and its output (which the output
    projection keeps as its input): a fused kernel's log-sum-exp, the math kernel's probabilities and copies.
    Selective recomputation of the attention core alone (cluster.selective_recompute = "attention_core",
    Megatron-LM's) does not keep these; everything else of `attention_bytes` stays."""
    kv_local = max(shape.kv_dim / tp, shape.head_dim)
    return attention_bytes(shape, a, tp, attention, seq_len) - a * (2 * shape.dim / tp + 2 * kv_local)


def _local_block_matmul(shape: ModelShape, tp: int, moe_layer: bool) -> float:
    n = shape.block_matmul_numel(moe_layer, active=False)
    return n / tp


@lru_cache(maxsize=1 << 14)
def selective_op_block_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, moe_layer: bool = False) -> BlockActivations:
    """recompute="selective", policy "op" (parallel/activation_checkpoint.py): the block input is kept by the
    checkpoint and the outputs of matmuls and SDPA are saved; everything else is recomputed.
    llama: wq, wk, wv, wo, w1, w3, w2 outputs + SDPA (out, LSE); gpt: wq, wk, wv, wo, fc, proj + SDPA.
    Row-parallel outputs (wo, w2/proj) are full-size partial sums under TP, and their reductions
    outputs are saved too (all-reduce: s·h; SP reduce-scatter: s·h/tp), so recomputation does not
    communicate them again."""
    h, kv = shape.dim, shape.kv_dim
    a = 4 if reg == "fp32" else 2
    res = 2 if reg == "lowp" else 4
    kv_local = max(kv / tp, shape.head_dim)
    res_div = tp if sp else 1
    f = shape.expert_ffn if moe_layer else shape.ffn_dim
    n_up = up_projections(shape)
    mlp = a * (n_up * f / tp + h)
    if moe_layer and shape.moe is not None:
        shared = shape.moe.num_shared_experts * f
        mlp = shape.moe.top_k * shape.moe.load_factor * mlp + (a * (n_up * shared / tp + h) if shared else 0.0)
    reductions = 2 * a * h / res_div if tp > 1 else 0.0
    per_token = (res * h / res_div + a * (h / tp + 2 * kv_local + h / tp + h) + 4 * shape.n_heads / tp + mlp
                 + reductions)
    return BlockActivations(per_token, 0.0)


def ring_uncached_bytes(shape: ModelShape, reg: str, tp: int) -> float:
    """Per token, what selective recomputation does not keep of `selective_op_block_bytes` under ring context
    parallelism: the attention core's output and log-sum-exp (SDPA's, which "op" caches), because ring
    attention is a region the policy caches nothing of (parallel/context.py: its per-block scores would
    be a matrix per pair of chunks); the replay reruns it (plan/compute_time.py)."""
    a = 4 if reg == "fp32" else 2
    return a * shape.dim / tp + 4 * shape.n_heads / tp


def alternate_unkept_bytes(shape: ModelShape, reg: str, tp: int, fused: bool) -> float:
    """Per token, what recompute_policy "op_alternate" does not keep of `selective_op_block_bytes` (dense
    blocks, spec/rules.py): the outputs of the 2nd, 4th, ... matmul of the block's forward
    (parallel/activation_checkpoint.py). Separate linears, llama: wq, wk, wv, wo, w1, w3, w2, so wk, wo and
    w3; gpt: wq, wk, wv, wo, fc, proj, so wk, wo and proj. Joined (train.fuse_projections): wqkv, wo, the
    up-projection(s), the down-projection, so wo and the down-projection. wo's and the down-projection's
    outputs are full-size partial sums under TP (as `selective_op_block_bytes` counts them)."""
    a = 4 if reg == "fp32" else 2
    h = shape.dim
    if fused:
        return a * 2 * h
    kv_local = max(shape.kv_dim / tp, shape.head_dim)
    third = shape.ffn_dim / tp if shape.arch == "llama" else h  # w3's output, or proj's
    return a * (kv_local + h + third)


def alternate_recomputed_gemms(shape: ModelShape, fused: bool, eager: bool) -> tuple[int, ...]:
    """Which forward GEMMs "op_alternate" runs again in backward, as indices into one rank's dense
    `_block_gemms` entries (plan/compute_time.py) expanded one GEMM per linear: separate linears
    [wq, wk, wv, wo, up..., down], joined [wqkv, wo, up, down]. Eager, the checkpoint replays the ops it did
    not keep up to the last one backward reads (torch's early stop: the down-projection, whose output only
    a residual add reads, is never replayed), so llama reruns wk, wo and w3, gpt wk and wo, joined blocks
    wo; compiled, the backward graph holds only what backward reads, so wo goes too: llama wk and w3, gpt
    wk, joined blocks nothing (counted in backward GEMMs: tests/unit/test_recompute_alternate.py)."""
    if fused:
        return (1,) if eager else ()
    if shape.arch == "llama":
        return (1, 3, 5) if eager else (1, 5)
    return (1, 3) if eager else (1,)


def fused_projection_groups(shape: ModelShape, moe_layer: bool = False, tiles: int = 1) -> tuple[tuple[int, int], ...]:
    """(linears, weight elements) of each group train.fuse_projections joins in a block (tp = 1;
    models/feed_forward.py fuse_training_projections): attention's q|k|v; a llama MLP's w1|w3, a dense
    block's or a MoE block's shared experts' (one SwiGLU of n_shared x expert ffn), unless linear_tiles
    replaces the MLP (parallel/tiling.py). GPT's MLP has one up-projection: nothing to join."""
    h = shape.dim
    groups = [(3, h * h + 2 * shape.kv_dim * h)]
    if shape.arch == "llama":
        if moe_layer and shape.moe is not None:
            f = shape.moe.num_shared_experts * shape.expert_ffn
        else:
            f = shape.ffn_dim if tiles == 1 else 0
        if f:
            groups.append((2, 2 * f * h))
    return tuple(groups)


@lru_cache(maxsize=1 << 12)
def fused_projection_delta(shape: ModelShape, reg: str, compiled: bool, moe_layer: bool = False,
                           tiles: int = 1) -> BlockActivations:
    """What train.fuse_projections changes in a block's saved bytes (add it to `block_bytes`, or to
    plan/compiled.py's): the joined GEMM (feed_forward.py _JoinedLinear) saves the fp32 weights themselves
    and joins them again in backward, and its input once. So under autocast the separate linears' 16-bit
    weight copies are not kept (`fixed`: -2 bytes per joined element; compiled too, where the partitioner
    keeps those copies), and, eager, one 16-bit cast of the norm's output per group instead of one per
    linear (-(k - 1) 2h per token; compiled blocks save the norm output once either way). Nothing changes
    in fp32, under 16-bit parameters (no copies) or FP8 (each Float8Linear saves its fp32 weight and the
    input it is given): measured with saved-tensor hooks (tests/unit/test_fused_projections.py,
    tests/dist/test_plan_validation.py *_fused)."""
    if reg != "autocast":
        return BlockActivations(0.0, 0.0)
    groups = fused_projection_groups(shape, moe_layer, tiles)
    per_token = 0.0 if compiled else -sum((k - 1) * 2 * shape.dim for k, _ in groups)
    return BlockActivations(per_token, -2.0 * sum(n for _, n in groups))


@lru_cache(maxsize=1 << 14)
def full_recompute_block_bytes(shape: ModelShape, reg: str, tp: int, sp: bool) -> BlockActivations:
    """recompute="full": only the block input survives the forward (Korthikanti §4: 2sbh in 16-bit)."""
    res = 2 if reg == "lowp" else 4
    return BlockActivations(res * shape.dim / (tp if sp else 1), 0.0)


def embedding_bytes_per_token(shape: ModelShape) -> float:
    """The embedding saves its int64 indices (gpt's position lookup saves s int64 positions once)."""
    return 8.0


@lru_cache(maxsize=1 << 14)
def head_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, chunked_loss: bool = False,
               fp8_head: bool = False) -> BlockActivations:
    """Final norm + output head + loss, per token: the norm's tensors, the head's input (and its weight
    copy under autocast; none when train.fp8_head makes it a Float8Linear, which casts the fp32 weight
    itself), and the loss's own (`loss_bytes`)."""
    loss = loss_bytes(shape, reg, tp, chunked_loss)
    # Under FP8 the head is a plain linear unless fp8_head: it saves autocast's 16-bit cast of the norm's output,
    # not the fp32 output a Float8Linear keeps.
    norm_reg = "autocast" if reg == "autocast_fp8" and not fp8_head else reg
    per_token = _norm(shape, norm_reg, 1, 1) if chunked_loss else _norm(shape, norm_reg, tp if sp else 1, 1)
    fixed = loss.fixed
    if reg == "autocast" or (reg == "autocast_fp8" and not fp8_head):  # a plain linear under FP8 unless fp8_head
        fixed += 2 * shape.vocab_size * shape.dim / tp
    return BlockActivations(per_token + loss.per_token, fixed)


def loss_bytes(shape: ModelShape, reg: str, tp: int, chunked_loss: bool = False) -> BlockActivations:
    """What the loss alone saves, per token: the fp32 log-softmax of the (vocab-sharded, loss-parallel)
    logits and int64 targets (the logits themselves are not saved: log_softmax keeps only its output);
    the chunked loss (spec/loss.py loss_is_chunked: a large micro-batch, no TP) the logits in their own
    dtype, an fp32 log-sum-exp and the targets instead. A split backward's input pass frees it (torch
    detaches the loss: pipelining/_backward.py stage_backward_input) while the head's input waits for the
    weight pass (plan/inflight.py loss_inflight_microbatches)."""
    if chunked_loss:
        return BlockActivations((4 if reg == "fp32" else 2) * shape.vocab_size + 4 + 8, 0.0)
    return BlockActivations(4 * shape.vocab_size / tp + 8, 4.0)  # fixed: the loss's total_weight scalar


def loss_bytes_2d(shape: ModelShape, reg: str, tp: int) -> BlockActivations:
    """`loss_bytes` under 2-D TP (parallel/tensor2d.py _VocabCrossEntropy), per local token: the logits
    block [b/q, s, V/q] in its dtype and, per own token (T/q), int64 local targets, a bool mask and fp32
    max and log-sum-exp (21 B)."""
    return BlockActivations((4 if reg == "fp32" else 2) * shape.vocab_size / tp + 21 / tp ** 0.5, 0.0)


def eager_rope_bytes(shape: ModelShape, reg: str, tp: int) -> float:
    """Bytes per token of a llama block's eager RoPE on q and k (models/common.py RotaryEmbedding): mul cos,
    chunk / neg, cat, mul sin, add — ~10 passes over (h + kv), promoted to fp32 by the fp32 tables."""
    return 10 * 4 * (shape.dim / tp + max(shape.kv_dim / tp, shape.head_dim)) if shape.arch == "llama" else 0.0


def rope_table_bytes(shape: ModelShape) -> float:
    """llama's RoPE cos/sin buffers (max_seq_len x head_dim fp32 each): RoPE saves slices of them,
    which keep the whole buffer alive — counted once, like the activation meter does."""
    return 2 * 4 * shape.max_seq_len * shape.head_dim if shape.arch == "llama" else 0.0


def cp_block_bytes_per_token(shape: ModelShape, reg: str, tp: int, cp: int, cp_mode: str) -> float:
    """What a block saves under context parallelism (parallel/context.py) on top of `block_bytes`, per
    local token. Measured with saved-tensor hooks on the tiny preset (tests/dist/test_plan_validation.py
    cp2_* rows; listing every saved storage with the source line that saved it):
    - both modes: the core returns a contiguous (b, heads, s, d) tensor, so Attention.forward's
      `out.transpose(1, 2).reshape(b, s, -1)` is a copy, which wo saves (a·h/tp). Causal SDPA on CPU
      returns its output already laid out as (b, s, heads, d), so without CP that reshape is a view
      and no copy exists (the single-process rows show none).
    - ring: _RingAttention saves q, k, v, its output `o` (input dtype, the tensor it returns) and an
      fp32 LSE (autocast is off inside it, so the block maths stay fp32): SDPA's inventory in every
      precision.
    - ulysses: SDPA saves k and v after the all-to-all; when cp does not divide the local KV heads
      they were repeated r = cp / gcd(kv heads, cp) times first (UlyssesAttention.__call__), and
      the repeated heads are what is saved: (r - 1) more copies of k and v (plan/comm.py sends them)."""
    if cp == 1:
        return 0.0
    a = 4 if reg == "fp32" else 2
    extra = a * shape.dim / tp
    if cp_mode == "ring":
        return extra
    kv_local = max(shape.kv_dim / tp, shape.head_dim)
    heads = int(kv_local // shape.head_dim)
    if heads % cp:
        extra += 2 * a * kv_local * (cp // math.gcd(heads, cp) - 1)
    return extra


def cp_rope_bytes_per_block(shape: ModelShape, seq_len: int, cp: int) -> float:
    """llama under CP: RoPE indexes its cos/sin tables with this rank's zigzag positions
    (models/common.py RotaryEmbedding: `self.cos[positions]`), an advanced-indexing gather that makes
    new (s/cp, head_dim) fp32 tensors, which the products with q and with k each save: 2 calls x
    (cos, sin) per block and micro-batch (measured: 4 x (16, 16) fp32 per block at seq 32, cp 2).
    The whole tables are then no longer kept alive (`cp_stage_bytes` replaces `rope_table_bytes`)."""
    return 2 * 2 * 4 * (seq_len / cp) * shape.head_dim if shape.arch == "llama" else 0.0


def cp_stage_bytes(shape: ModelShape, seq_len: int, cp_mode: str) -> float:
    """Per-model (pipeline stage) storages under CP, counted once like `rope_table_bytes`: Ulysses'
    two int64 permutations of the gathered sequence (UlyssesAttention.natural / .order), which every
    layer's index_select saves (measured: 2 x (32,) int64 at seq 32); nothing for ring."""
    return 2 * 8.0 * seq_len if cp_mode == "ulysses" else 0.0


def gpt_positions_bytes(shape: ModelShape, seq_len: int) -> float:
    return 8.0 * seq_len if shape.arch == "gpt" else 0.0


@lru_cache(maxsize=1 << 14)
def pointwise_forward_bytes(shape: ModelShape, reg: str, tp: int, sp: bool, moe_layer: bool = False) -> float:
    """HBM bytes the non-GEMM, non-attention kernels of one block move per token in forward, op by op
    (unfused eager kernels each read their inputs and write their output; backward moves about twice
    this). Norm internals are fp32 (4 B); r = residual-stream bytes, a = compute-dtype bytes.
    llama RMSNorm (models/llama.py): x.float() [lowp: r 2h w 4h], pow (r 4h w 4h), mean (r 4h), mul by
      rsqrt (r 4h w 4h), type_as [lowp: r 4h w 2h], * gain (r rh w rh); autocast adds one cast of the
      fp32 output per consuming linear (r 4h w 2h); gpt LayerNorm is one fused kernel (r rh w 4h + its
      casts).
    RoPE on q and k: mul cos, chunk/neg, cat, mul sin, add — ~10 passes over (h + kv), promoted to fp32
      by the fp32 cos/sin tables.
    residual adds: 2 x (r rh + r ah w rh); SwiGLU: silu (r af w af) + mul (r 2af w af); GELU: r af w af.
    """
    h = shape.dim
    a = 4 if reg == "fp32" else 2
    r = 2 if reg == "lowp" else 4
    res_div = tp if sp else 1
    norms = norm_forward_bytes(shape, reg, tp, sp)
    if shape.arch == "llama":
        casts = 5 * 6 * h if reg in ("autocast", "autocast_fp8") else 0.0  # q, k, v inputs; w1, w3 inputs
        rope = eager_rope_bytes(shape, reg, tp)
    else:
        casts = 4 * 6 * h if reg != "fp32" else 0.0   # q, k, v inputs; fc input
        rope = 0.0
    residual = 2 * (2 * r * h + a * h) / res_div
    return norms + casts + rope + residual + mlp_pointwise_forward_bytes(shape, reg, tp, moe_layer)


def mlp_pointwise_forward_bytes(shape: ModelShape, reg: str, tp: int, moe_layer: bool = False) -> float:
    """The MLP's share of `pointwise_forward_bytes` (its docstring): SwiGLU 5 a f, GELU 2 a f per token, f
    the routed copies' width for a MoE layer."""
    a = 4 if reg == "fp32" else 2
    f = (shape.expert_ffn * (shape.moe.top_k * shape.moe.load_factor if shape.moe else 1)) if moe_layer else shape.ffn_dim
    return (5 if shape.arch == "llama" else 2) * a * f / tp


def norm_forward_bytes(shape: ModelShape, reg: str, tp: int, sp: bool) -> float:
    """The two norms' share of `pointwise_forward_bytes` (its docstring): llama's RMSNorm op by op, gpt's
    LayerNorm one kernel."""
    h, r = shape.dim, 2 if reg == "lowp" else 4
    res_div = tp if sp else 1
    if shape.arch == "llama":
        return 2 * (20 * h + 2 * r * h + (12 * h if reg == "lowp" else 0)) / res_div
    return 2 * (r * h + 4 * h) / res_div


def korthikanti_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                                recompute: str = "none") -> float:
    """Activation bytes per transformer layer of Korthikanti et al. 2022 (arXiv 2205.05198), Table 2:
    none, no TP       sbh(34 + 5as/h)
    TP                sbh(10 + 24/t + 5as/(ht))
    TP + SP           sbh(34/t + 5as/(ht))
    TP + selective    sbh(10 + 24/t)            (attention core recomputed)
    TP + SP + sel.    sbh(34/t)
    full              sbh(2)                    (layer input only, 16-bit)
    """
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    if sp:
        return sbh * (34.0 / t + attn)
    return sbh * (10.0 + 24.0 / t + attn)
