"""Compute time of one micro-batch on one rank, kernel class by kernel class (plan/cost.py assembles
the step from it; docs/architecture.md §6).

Compute: every GEMM of a micro-batch at a shape-dependent efficiency (the device's maximum achievable
matmul fraction x tile and wave quantization, capped by the memory roofline; constants.py), attention
at FlashAttention's achieved fraction with the causal half skipped, and the memory-bound pointwise
kernels from the bytes they move (activations.pointwise_forward_bytes, at the HBM fraction).
Backward = 2 x forward (input and weight gradients for GEMMs; ~2x the bytes for pointwise kernels).
Eager runs (train.compile = false) add a launch cost per kernel and stream their op-by-op pointwise
bytes at constants.EAGER_POINTWISE_HBM_FRACTION (or `plan calibrate`'s fitted fraction); a measured
device (cluster.calibration, plan/calibration.py) replaces every datasheet rate and fraction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardwise.plan import activations as A
from shardwise.plan import compiled as K
from shardwise.plan import constants as C
from shardwise.plan.inventory import RankModel
from shardwise.plan.layout import Problem
from shardwise.spec.layout import PER_OP_POLICIES, Layout
from shardwise.spec.loss import loss_is_chunked


def _device_constant(table: dict[str, float], name: str, default: float) -> float:
    return table.get(name, table.get(C.family(name), default))


@lru_cache(maxsize=65536)
def gemm_time(device_name: str, peak: float, hbm_gbps: float, m: int, n: int, k: int, elem: int,
              shapes: tuple[tuple[int, int, int, float], ...] = ()) -> float:
    """Seconds for one (m x k) @ (k x n) GEMM: 2mnk FLOPs at peak x MAMF x tile x wave efficiency,
    but no faster than moving its operands through HBM (roofline). `shapes`: a measured CPU's GEMMs
    (calibration.MeasuredDevice.gemm_shapes), whose efficiency near this shape replaces tiles and waves."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    mamf = measured_gemm_efficiency(shapes, m, n, k) if shapes else _mamf(device_name)
    tile_eff = wave_eff = 1.0
    if device_name != "measured-cpu":  # a CPU GEMM has no thread-block tiles or SM waves
        units = int(_device_constant(C.COMPUTE_UNITS, device_name.removeprefix("measured-"), C.COMPUTE_UNITS_DEFAULT))
        tm, tn = math.ceil(m / C.GEMM_TILE_M), math.ceil(n / C.GEMM_TILE_N)
        tile_eff = (m / (tm * C.GEMM_TILE_M)) * (n / (tn * C.GEMM_TILE_N))
        tiles = tm * tn
        wave_eff = tiles / (math.ceil(tiles / units) * units)
    compute = 2.0 * m * n * k / (peak * mamf * tile_eff * wave_eff)
    traffic = elem * (m * k + k * n + m * n) / (hbm_gbps * 1e9 * _hbm_fraction(device_name))
    return max(compute, traffic)


def measured_gemm_efficiency(shapes: tuple[tuple[int, int, int, float], ...], m: int, n: int, k: int) -> float:
    """FLOP/s over the best square matmul of an (m, n, k) GEMM on a measured CPU: the measured shapes' own,
    inverse-distance weighted over the three nearest in log2(M, N, K). A CPU GEMM's efficiency falls with its
    size and shape (fp32, 2 threads: the small preset's forward and input-gradient GEMMs reach 91-99% at 1024
    tokens and 81-89% at 256, its weight gradients 78-96%); priced at the best square's rate, the
    planner put small micro-batches 8% too fast (benchmarks/plan_accuracy.py, the accumulation row)."""
    point = (math.log2(m), math.log2(n), math.log2(k))
    nearest = sorted((math.dist(point, (math.log2(a), math.log2(b), math.log2(c))), f) for a, b, c, f in shapes)[:3]
    if nearest[0][0] < 1e-9:
        return nearest[0][1]
    weights = [1.0 / d ** 2 for d, _ in nearest]
    return sum(w * f for w, (_, f) in zip(weights, nearest)) / sum(weights)


def _measured(name: str) -> bool:
    """A device whose rates benchmarks/kernels.py measured (plan/calibration.py MeasuredDevice): its
    peak and bandwidth are what is achieved, so no datasheet fraction applies."""
    return name.startswith("measured-")


def _mamf(name: str) -> float:
    return 1.0 if _measured(name) else _device_constant(C.MAMF_FRACTION, name, C.MAMF_FRACTION_DEFAULT)


def streaming_fraction(name: str) -> float:
    return _device_constant(C.HBM_FRACTION_BY_FAMILY, name.removeprefix("measured-"), C.HBM_FRACTION)


def _hbm_fraction(name: str) -> float:
    return 1.0 if _measured(name) else streaming_fraction(name)


@dataclass(frozen=True)
class MicroBatchTimes:
    """Seconds for one micro-batch on one rank."""

    fwd: float            # forward (GEMMs + attention + memory-bound share)
    bwd: float            # backward
    recompute: float      # extra forward work of recomputation
    block_fwd: float      # one block's forward (FSDP overlap window)
    block_bwd: float
    attn_fwd_layer: float  # one layer's attention forward (CP overlap window)
    outside: float = 0.0   # of fwd + bwd: the blocks' time outside their kernels (cluster.block_overhead_us)


def _block_gemms(problem: Problem, lay: Layout, tokens: int, moe: bool) -> list[tuple[int, int, int, int]]:
    """(m, n, k, count) of a block's forward GEMMs on one rank after TP/EP sharding, attention's first (q, k
    and v, then wo: _attention_gemms of them); train.fuse_projections (Problem.fused_for) joins q|k|v and w1|w3
    into one GEMM each (activations.fused_projection_groups)."""
    s, tp = problem.shape, lay.tp
    h, kv = s.dim, max(s.kv_dim // tp, s.head_dim)
    fused = problem.fused_for(lay)
    qkv = [(tokens, h + 2 * kv, h, 1)] if fused else [(tokens, h // tp, h, 1), (tokens, kv, h, 2)]
    out = qkv + [(tokens, h, h // tp, 1)]
    ups = A.up_projections(s)
    up = (lambda m, f: (m, ups * f, h, 1)) if fused else (lambda m, f: (m, f, h, ups))
    if moe and s.moe is not None:
        local_experts = max(1, s.moe.num_experts // lay.ep)
        per_expert = max(1, round(tokens * s.moe.top_k * s.moe.load_factor * lay.ep / s.moe.num_experts))
        f = math.ceil(s.expert_ffn / tp)
        out += [(per_expert, f, h, ups * local_experts), (per_expert, h, f, local_experts), (tokens, s.moe.num_experts, h, 1)]
        if s.moe.num_shared_experts:  # the shared MLP sees every token, split by tp like a dense MLP
            fs = math.ceil(s.moe.num_shared_experts * s.expert_ffn / tp)
            out += [up(tokens, fs), (tokens, h, fs, 1)]
        return out
    f = math.ceil(s.ffn_dim / tp)
    if lay.linear_tiles > 1:  # parallel/tiling.py: torch.tensor_split's tiles, the first ffn % tiles one wider
        return out + [g for f_t, n in _tile_widths(s.ffn_dim, lay.linear_tiles)
                      for g in ((tokens, f_t, h, ups * n), (tokens, h, f_t, n))]
    return out + [up(tokens, f), (tokens, h, f, 1)]


def _attention_gemms(problem: Problem, lay: Layout) -> int:
    """How many entries of `_block_gemms` are attention's (q, k and v, or their join; then wo)."""
    return 2 if problem.fused_for(lay) else 3


def te_cast_bytes(gemms: list[tuple[int, int, int, int]], attention_gemms: int, block_input: int,
                  accumulation: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one block's FP8 casts per micro-batch as Transformer Engine makes them
    under Megatron-Core (cluster.fp8_kernel = "transformer_engine"); `gemms`: the converted entries of
    _block_gemms, attention's first; `block_input`: elements of the block's (and the MLP's) normed input.

    Delayed scaling takes each scale from the amax history of earlier steps, so no amax pass reads an operand
    first (torchao's dynamic scaling: C.FP8_CAST_BYTES). Hopper's FP8 GEMMs take both operands K-major, so
    the weight gradient needs the input and the output gradient transposed: TE's cast_transpose kernel reads
    the 16-bit tensor once and writes the FP8 copy and its transpose (2 + 1 + 1 B per element).
    - inputs produced by a norm (q|k|v; the MLP's up-projections, when converted): LayerNormLinear's norm
      writes its output in FP8 itself; the transpose comes on top (read 1 B, write 1 B), once per shared input.
    - the other inputs (wo, the down-projection): cast_transpose, 4 B per element.
    - weights: cast_transpose once per optimizer step: Megatron-Core's schedules call set_is_first_microbatch
      on a step's first micro-batch and TE keeps the FP8 weights for the rest (its weight caching).
    - backward: each GEMM's output gradient through cast_transpose, 4 B per element.
    Not priced: the amax-history update (a few small kernels a step) and the 1 B the norm writes instead of 2."""
    # q|k|v, and after wo the MLP's (up, down) pairs: a tiled MLP's tiles in turn (_block_gemms)
    mlp = len(gemms) > attention_gemms
    norm_fed = set(range(attention_gemms - 1)) | set(range(attention_gemms, len(gemms), 2))
    transposed_inputs = (2 if mlp else 1) * 2 * block_input
    other_inputs = sum(4 * m * k * c for i, (m, _, k, c) in enumerate(gemms) if i not in norm_fed)
    weights = sum(4 * k * n * c for _, n, k, c in gemms) / max(1, accumulation)
    grads = sum(4 * m * n * c for m, n, _, c in gemms)
    return transposed_inputs + other_inputs + weights, grads


def _tile_widths(ffn: int, tiles: int) -> list[tuple[int, int]]:
    """(hidden units of a tile, how many tiles that wide) of torch.tensor_split(ffn, tiles)."""
    size, extra = divmod(ffn, tiles)
    return [(w, n) for w, n in ((size + 1, extra), (size, tiles - extra)) if n and w]


def _kernel_key(s, reg: str) -> tuple[str, str]:
    return s.arch, "autocast" if reg == "autocast_fp8" else reg


def eager_block_kernels(s, reg: str, moe: bool, ep: int, fused: bool = False) -> tuple[int, int]:
    """(forward, backward) kernels one block launches in eager mode (constants.EAGER_BLOCK_KERNELS; a MoE
    block's count grows with its local experts; `fused`: train.fuse_projections, EAGER_FUSED_*)."""
    key = _kernel_key(s, reg)
    if moe and s.moe is not None:
        fwd, fwd_e, bwd, bwd_e = C.EAGER_MOE_BLOCK_KERNELS[key]
        local = max(1, s.moe.num_experts // ep)
        df, db = C.EAGER_FUSED_MOE_DELTA[key] if fused else (0, 0)
        return fwd + fwd_e * local + df, bwd + bwd_e * local + db
    return C.EAGER_FUSED_BLOCK_KERNELS[key] if fused else C.EAGER_BLOCK_KERNELS[key]


@lru_cache(maxsize=1 << 17)
def microbatch_times(problem: Problem, lay: Layout, rank: RankModel) -> MicroBatchTimes:
    dev = problem.cluster.device
    peak = dev.peak_flops(problem.compute_precision)  # attention, head, and every GEMM but FP8's
    elem = problem.compute_bytes
    fp8 = problem.precision == "fp8"
    peak8 = dev.peak_flops("fp8") if fp8 else peak
    tokens = max(1, lay.micro_batch * problem.seq_len // lay.cp)
    hbm = dev.memory_bandwidth_gbps * 1e9 * _hbm_fraction(dev.name)
    measured = problem.cluster.measured_device
    shapes = measured.gemm_shapes if measured and measured.device_type == "cpu" else ()

    def gemm_s(m: int, n: int, k: int, pk: float = peak, e: int = elem) -> float:
        return gemm_time(dev.name, pk, dev.memory_bandwidth_gbps, m, n, k, e, shapes)
    # Eager pointwise kernels, op by op, stream worse than a copy (constants.EAGER_POINTWISE_HBM_FRACTION of
    # the datasheet; a measured device: its measured copy rate), unless `plan calibrate` fitted a fraction.
    # A GPU's measured bandwidth is its copy rate: eager kernels keep their ratio to the streaming fraction.
    if problem.cluster.pointwise_hbm_fraction:
        eager_fraction = problem.cluster.pointwise_hbm_fraction
    elif measured is None:
        eager_fraction = C.EAGER_POINTWISE_HBM_FRACTION
    elif measured.device_type == "cuda":
        eager_fraction = C.EAGER_POINTWISE_HBM_FRACTION / streaming_fraction(dev.name)
    else:
        eager_fraction = 1.0
    eager = problem.eager_for(lay)
    eager_bw = dev.memory_bandwidth_gbps * 1e9 * eager_fraction
    # Compiled (fused) kernels stream at the device's streaming fraction, or what `plan calibrate` fitted.
    fused_bw = dev.memory_bandwidth_gbps * 1e9 * (problem.cluster.compiled_hbm_fraction or _hbm_fraction(dev.name))
    pointwise_bw = eager_bw if eager else hbm
    s = problem.shape
    stack = problem.stack_for(lay)
    attn_frac = measured.attention_fraction if measured else _device_constant(C.ATTENTION_FRACTION, dev.name,
                                                                              C.ATTENTION_FRACTION_DEFAULT)
    # train.document_mask: FlexAttention's block mask on a GPU (models/common.py document_kernel), whatever the
    # stack's SDPA kernel; CPU SDPA with the dense mask.
    documents = problem.document_share is not None
    attention_kernel = "flex" if documents and problem.device_type == "cuda" else stack.attention
    if attention_kernel in C.ATTENTION_KERNEL_SPEED:  # a kernel other than the default fused one, relative to it
        attn_frac *= _device_constant(C.ATTENTION_KERNEL_SPEED[attention_kernel], dev.name.removeprefix("measured-"),
                                      C.ATTENTION_KERNEL_SPEED_DEFAULT[attention_kernel])
    # The GPU-side gap per kernel; a CPU's measured per-op cost (its host is the device) replaces it. A GPU
    # file's eager per-op figure is the host's dispatch cost (constants.EAGER_HOST_OP_S), not this gap.
    launch_s = measured.eager_op_s if measured and measured.device_type == "cpu" else C.EAGER_KERNEL_LAUNCH_S
    # A CPU whose file measured a real block's host cost (calibration.MeasuredDevice.block_kernel_s): per kernel
    # of the block counts, views and autograd folded in; a chain of `x + 1` costs a third of that per op.
    host = measured if measured and measured.device_type == "cpu" and measured.block_kernel_s else None
    if host:
        launch_s = host.block_kernel_s
    reg = A.regime(problem.precision, lay.lowp_params, problem.model_states)
    # cluster.rope_kernel = "complex" (plan/stack.py): seconds per token of one block's complex RoPE over what
    # its kernels above price for it (eager: ~10 passes over q and k; compiled: one read and write, fused),
    # and what a compiled recomputation adds (the eager fallback cannot join the backward's fused kernels).
    complex_rope = complex_rope_rc = 0.0
    if stack.rope == "complex" and s.arch == "llama":
        casts, multiply = K.complex_rope_bytes(s, reg, lay.tp)
        complex_rope_rc = casts / fused_bw + multiply / eager_bw
        if eager:
            complex_rope = (casts + multiply - A.eager_rope_bytes(s, reg, lay.tp)) / pointwise_bw
        else:
            complex_rope = complex_rope_rc - K.fused_rope_bytes(s, reg, lay.tp) / fused_bw

    def block_fwd(moe: bool) -> tuple[float, float, float, float, float, tuple[float, float]]:
        gemms = _block_gemms(problem, lay, tokens, moe)
        # FP8 (parallel/float8.py): the block's nn.Linears run at the FP8 peak with 1-byte operands; a MoE
        # block's stacked experts and router stay bf16 (only its attention GEMMs here are FP8).
        attention_gemms = _attention_gemms(problem, lay)
        converted = (attention_gemms if moe else len(gemms)) if fp8 else 0
        times = [c * (gemm_s(m, n, k, peak8, 1) if i < converted else gemm_s(m, n, k)) for i, (m, n, k, c) in enumerate(gemms)]
        # Backward's input and weight gradients: twice the forward, or on a measured CPU their own shapes
        # (dgrad m x k over n, wgrad n x k over m), whose efficiencies differ from the forward's.
        backward = 2 * sum(times) if not shapes else sum(
            c * (gemm_s(m, k, n, peak8, 1) + gemm_s(n, k, m, peak8, 1) if i < converted else gemm_s(m, k, n) + gemm_s(n, k, m))
            for i, (m, n, k, c) in enumerate(gemms))
        # The GEMMs closing each residual branch (wo; a dense MLP's down-projection, gemms[-1] unless
        # tiled): only a residual add reads their outputs, so a compiled recomputation skips them.
        branch_ends = times[attention_gemms - 1] + (times[-1] if not moe and lay.linear_tiles == 1 else 0.0)
        # QK^T and AV: 4 s h FLOPs per token forward (model count), causal half executed; each CP rank
        # holds tokens/cp queries against the whole sequence's keys.
        attn = 4.0 * tokens * problem.seq_len * s.dim / lay.tp * C.CAUSAL_EXECUTED_FRACTION / (peak * attn_frac)
        if dev.name != "measured-cpu":  # a GPU kernel's head-dim tiles (a CPU's SDPA has none)
            attn *= math.ceil(s.head_dim / C.ATTENTION_HEAD_DIM_TILE) * C.ATTENTION_HEAD_DIM_TILE / s.head_dim
        if documents:
            # FlexAttention computes the tiles the documents leave of causal's (spec/documents.py, measured on
            # the data); SDPA given a dense mask skips nothing: every tile, twice the causal half.
            attn *= problem.document_share if attention_kernel == "flex" else 1.0 / C.CAUSAL_EXECUTED_FRACTION
        if stack.attention == "math" and lay.cp == 1 and not documents:
            # The math backend (spec/layout.py attention_backend): two batched GEMMs over the whole s x s
            # (the mask is applied after, nothing skipped) at GEMM speed, and the probabilities stream
            # through memory C.MATH_ATTENTION_PASSES times (scores written, mask added in place, softmax
            # read and written, read by the second GEMM).
            mamf = _mamf(dev.name)
            attn = 4.0 * tokens * problem.seq_len * s.dim / lay.tp / (peak * mamf)
            attn += C.MATH_ATTENTION_PASSES * elem * tokens * problem.seq_len * s.n_heads / lay.tp / hbm
        # Pointwise kernels: the forward's bytes; backward ~2x. Eager: op by op (activations.
        # pointwise_forward_bytes); compiled: the fused kernels' (plan/compiled.py), a MoE feed-forward's
        # eager share aside. 2-D TP splits every activation tp ways, as SP does the norms' and residual's.
        sp = lay.sp or lay.tp_mode == "2d"
        if eager:
            pointwise = A.pointwise_forward_bytes(s, reg, lay.tp, sp, moe) * tokens / pointwise_bw
            if stack.norms == "fused":  # one kernel per norm (read the stream, write the output) at the streaming rate
                norms = A.norm_forward_bytes(s, reg, lay.tp, sp)
                pointwise += (K.fused_norm_forward_bytes(s, reg, lay.tp, sp) / hbm - norms / pointwise_bw) * tokens
        else:
            pointwise = K.pointwise_forward_bytes(s, reg, lay.tp, sp, moe) * tokens / fused_bw
            if moe:
                pointwise += K.eager_moe_pointwise_bytes(s, reg, lay.tp) * tokens / eager_bw
        pointwise += complex_rope * tokens
        # FP8's dynamic scaling: per converted GEMM, an amax pass over the input and the weight and a cast
        # of each (read 2 B twice, write 1 B: C.FP8_CAST_BYTES per element); backward (2x, below) casts
        # the output gradient and the transposed input alike. Bytes over HBM, not measured (no GPU here).
        # Joined projections scale their shared input once per group (tests/unit/test_fused_projections.py).
        # Transformer Engine's casts (te_cast_bytes) are not in `pointwise`, which backward doubles: its forward
        # and backward casts are each their own, (forward, backward) seconds apart.
        te_casts = (0.0, 0.0)
        if converted and stack.fp8 == "transformer_engine":
            te_casts = tuple(b / hbm for b in te_cast_bytes(gemms[:converted], attention_gemms, s.dim * tokens,
                                                             lay.accumulation(problem)))
        else:
            pointwise += sum(c * C.FP8_CAST_BYTES * (m * k + k * n) for m, n, k, c in gemms[:converted]) / hbm
        return sum(times), backward, attn, pointwise, branch_ends, te_casts

    def joins(moe: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one block's weight joins under train.fuse_projections
        (models/feed_forward.py _JoinedLinear, parallel/float8.py _JoinedFloat8): eager forward joins them
        (read and write the join's dtype: FP8 joins the fp32 weights, the others the compute-dtype casts
        the separate linears make too; compiled, the join runs inside those casts), and backward joins them
        again from the parameters (read the parameter, write the join) instead of keeping them."""
        if not fused:
            return 0.0, 0.0
        joined = sum(n for _, n in A.fused_projection_groups(s, moe, lay.linear_tiles))
        join, param = (4 if fp8 else elem), (2 if lay.lowp_params else 4)
        # Compiled FP8: the joined outputs' split and their gradients' concatenation and scaling, which
        # separate linears fuse into their neighbours' kernels (C.FP8_JOINED_OUTPUT_BYTES, measured).
        outputs = C.FP8_JOINED_OUTPUT_BYTES * tokens * joined / s.dim / fused_bw if fp8 and not eager else 0.0
        return (2 * join * joined / pointwise_bw if eager else 0.0), (param + join) * joined / pointwise_bw + outputs

    g_d, gb_d, a_d, e_d, ends_d, x_d = block_fwd(False)
    # parallel.linear_tiles: the tiled MLP's backward recomputes every tile's up-projections (SwiGLU: w1 x
    # and w3 x, 2 GEMMs of 2 x tokens x dim x ffn FLOPs in all; GELU: fc x, 1) and pointwise ops (SwiGLU's
    # silu and product, GELU's gelu: their share of pointwise_forward_bytes, 5 a f / 2 a f per token), and
    # sums the tiles' partial outputs (forward) and dx (backward) over the hidden dim: (tiles - 1) adds of a
    # tokens x dim tensor, read twice and written once (in the block's pointwise bytes, so backward's 2x
    # holds dx's). Under selective "op" the checkpoint's replay also reruns the tiled forward (tiling.py:
    # its GEMMs are not cached), on top.
    tile_rc = 0.0
    if lay.linear_tiles > 1 and rank.dense_layers:
        ups = A.up_projections(s)
        a = elem
        tile_rc = sum(n * ups * gemm_s(tokens, w, s.dim)
                      for w, n in _tile_widths(s.ffn_dim, lay.linear_tiles))
        tile_rc += (5 if s.arch == "llama" else 2) * a * s.ffn_dim * tokens / pointwise_bw
        e_d += (lay.linear_tiles - 1) * 3 * a * s.dim * tokens / pointwise_bw
        if eager:  # each tile past the first launches its forward and backward kernels once more
            fwd_k, bwd_k = C.EAGER_TILE_KERNELS[s.arch]
            tile_rc += (lay.linear_tiles - 1) * (fwd_k + bwd_k) * launch_s
    g_m, gb_m, a_m, e_m, ends_m, x_m = block_fwd(True) if rank.moe_layers else (0.0, 0.0, 0.0, 0.0, 0.0, (0.0, 0.0))
    fused = problem.fused_for(lay)
    (join_fd, join_bd), (join_fm, join_bm) = joins(False), (joins(True) if rank.moe_layers else (0.0, 0.0))

    def block_bwd(g: float, gb: float, a: float, e: float) -> float:
        # Without measured shapes gb is 2 x g: the old sum, kept as written so that GPU prices stay bit-identical.
        return gb + 2 * (a + e) if shapes else 2 * (g + a + e)

    # x_d / x_m: Transformer Engine's (forward, backward) casts (torchao's are in e_d / e_m, doubled backward)
    fwd_one = g_d + a_d + e_d + join_fd + x_d[0]
    bwd_one = block_bwd(g_d, gb_d, a_d, e_d) + join_bd + x_d[1]
    fwd = rank.dense_layers * fwd_one + rank.moe_layers * (g_m + a_m + e_m + join_fm + x_m[0])
    bwd = rank.dense_layers * bwd_one + rank.moe_layers * (block_bwd(g_m, gb_m, a_m, e_m) + join_bm + x_m[1])
    if rank.head:
        vocab = math.ceil(s.vocab_size / lay.tp)
        head = gemm_s(tokens, vocab, s.dim)
        # Backward's two GEMMs: twice the forward, or on a measured CPU their own shapes (as a block's).
        head_bwd = gemm_s(tokens, s.dim, vocab) + gemm_s(vocab, s.dim, tokens) if shapes else 2 * head
        if problem.head_in_fp8:
            # train.fp8_head: the head's GEMMs at the FP8 peak with 1-byte operands, plus the scaling casts of
            # its input and weight (forward; backward, 2x below, the logits' gradient and the transposes).
            head = gemm_s(tokens, vocab, s.dim, peak8, 1) + C.FP8_CAST_BYTES * (tokens * s.dim + s.dim * vocab) / hbm
            # The head is eager (not in a compiled block): its logits' gradient is scaled op by op.
            head_bwd = 2 * head + C.FP8_EAGER_HEAD_GRAD_BYTES * tokens * vocab / eager_bw
        logits = tokens * s.vocab_size / lay.tp
        if not loss_is_chunked(tokens, s.vocab_size, lay.tp):
            loss_f = loss_b = 3 * 4.0 * logits / hbm  # logits -> fp32 -> log-softmax, and back
        elif stack.loss == "compiled":
            # train/loss.py LossKernels compiled: forward reads the 16-bit logits once (the log-sum-exp
            # fused); backward reads them and writes their gradient.
            loss_f, loss_b = elem * logits / fused_bw, 2 * elem * logits / fused_bw
        else:
            # eager chunks, op by op over an fp32 copy: forward cast (read a, write 4), max (read 4),
            # subtract, exp (read 4, write 4 each), sum (read 4): a + 24 B per logit; backward the cast
            # again, subtract and exp, the one-hot subtraction and the gradient scale (read 4, write 4
            # each), the cast back (read 4, write a): 2 a + 36 B; at the eager pointwise rate.
            loss_f, loss_b = (elem + 24) * logits / eager_bw, (2 * elem + 36) * logits / eager_bw
        fwd += head + loss_f
        bwd += head_bwd + loss_b
    if not eager:
        # Compiled: the weights' autocast casts run inside the graph, per micro-batch (plan/compiled.py
        # weight_cast_bytes), forward and (the gradients' casts) backward alike.
        casts = (rank.dense_layers * K.weight_cast_bytes(s, reg, lay.tp, False)
                 + (rank.moe_layers * K.weight_cast_bytes(s, reg, lay.tp, True) if rank.moe_layers else 0.0)) / fused_bw
        fwd, bwd = fwd + casts, bwd + casts
        if measured is None or measured.device_type == "cuda":  # the GPU's gap between kernels, per kernel
            kf, kb = C.COMPILED_BLOCK_KERNELS[s.arch]
            for n, moe_layer in ((rank.dense_layers, False), (rank.moe_layers, True)):
                # Joined projections: k - 1 fewer GEMMs per group forward, twice that backward, and the
                # backward's join of each group (a kernel of its own: no cast to fuse it into in fp32).
                groups = A.fused_projection_groups(s, moe_layer, lay.linear_tiles) if fused else ()
                fewer = sum(k - 1 for k, _ in groups)
                fwd, bwd = fwd + n * (kf - fewer) * launch_s, bwd + n * (kb - 2 * fewer + len(groups)) * launch_s
    # (forward, backward) kernels of one dense / MoE block in eager mode
    dense, moe = eager_block_kernels(s, reg, False, lay.ep, fused), eager_block_kernels(s, reg, True, lay.ep, fused)
    if eager:  # launch_s per kernel the rank's eager forward / backward launches
        rest = C.EAGER_REST_KERNELS[_kernel_key(s, reg)] if (rank.head or rank.embedding) else (0, 0)
        for i in (0, 1):
            launches = (rank.dense_layers * dense[i] + rank.moe_layers * moe[i] + rest[i]) * launch_s
            fwd, bwd = (fwd + launches, bwd) if i == 0 else (fwd, bwd + launches)
    # cluster.block_overhead_us: another stack's time per block and micro-batch outside the kernels priced here
    # (gaps between its kernels, host waits, its collectives' synchronisation: docs/planner.md), split as a
    # block's kernels are, a third forward and two thirds backward; a checkpoint's replay pays the third again.
    gap_fwd = problem.block_overhead_s / 3
    fwd, bwd = fwd + rank.layers * gap_fwd, bwd + rank.layers * 2 * gap_fwd
    # Recomputation: full re-runs the forward of checkpointed blocks; "op" re-runs only the cheap ops.
    n_blocks = rank.layers
    per_block_fwd = (fwd_one if rank.dense_layers else g_m + a_m + e_m)
    # Eager checkpoints replay the block's forward; a compiled one's recomputation is part of the backward
    # graph, which drops what the backward does not read (the branch-closing GEMMs, plan/compiled.py).
    replay_d, replay_m = (fwd_one, g_m + a_m + e_m) if eager else (fwd_one - ends_d, g_m + a_m + e_m - ends_m)
    # On a measured CPU the checkpoint's own host cost per forward kernel of a checkpointed block comes on top:
    # the replay's dispatch with autograd recording and the saved-tensor hooks (full); the policy's dispatch
    # mode in the forward and the recompute (selective "op").
    fwd_kernels = rank.dense_layers * dense[0] + rank.moe_layers * moe[0]  # the rank's blocks' forward
    full_host = host.full_checkpoint_kernel_s if host and eager else 0.0
    core_only = problem.core_recompute(lay)
    if core_only:  # cluster.selective_recompute = "attention_core": the attention forward again, nothing else
        recompute = rank.dense_layers * a_d + rank.moe_layers * a_m
    elif lay.recompute == "full":
        recompute = rank.dense_layers * replay_d + rank.moe_layers * replay_m + fwd_kernels * full_host
        recompute += rank.layers * gap_fwd
    elif lay.recompute == "selective" and lay.recompute_policy == "layer":
        recompute = math.ceil(n_blocks / lay.recompute_every) * (
            (replay_d + dense[0] * full_host if rank.dense_layers else replay_m + moe[0] * full_host) + gap_fwd)
    elif lay.recompute == "selective" and not eager:
        # "op", compiled: the partitioner recomputes pointwise chains in the backward's fused kernels with
        # or without the policy; what the policy adds is rerunning the two norms (plan/compiled.py).
        sp = lay.sp or lay.tp_mode == "2d"
        recompute = rank.layers * (K.selective_norm_bytes(s, reg, lay.tp, sp) / fused_bw + complex_rope_rc) * tokens
    elif lay.recompute == "selective":  # "op": the pointwise forward runs again
        recompute = rank.dense_layers * e_d + rank.moe_layers * e_m
        if lay.linear_tiles > 1:  # ... and the tiled MLP's forward GEMMs, which the policy does not cache
            ups = A.up_projections(s)
            recompute += rank.dense_layers * sum(
                n * ((ups * gemm_s(tokens, w, s.dim)) + gemm_s(tokens, s.dim, w))
                for w, n in _tile_widths(s.ffn_dim, lay.linear_tiles))
        if host:
            recompute += fwd_kernels * host.selective_checkpoint_kernel_s
        elif measured is not None and measured.device_type == "cpu":
            # A CPU runs the checkpoint policy's Python dispatch mode in line with the kernels (a GPU's host
            # runs ahead of them): every op of a block passes it in forward, recompute and backward.
            ops = rank.dense_layers * (2 * dense[0] + dense[1]) + rank.moe_layers * (2 * moe[0] + moe[1])
            recompute += ops * measured.selective_op_s
    else:
        recompute = 0.0
    per_op = lay.recompute == "selective" and lay.recompute_policy in PER_OP_POLICIES and not core_only
    if per_op and lay.cp > 1 and lay.cp_mode == "ring":
        # ... and ring attention's forward, a region the policy caches nothing of (parallel/context.py)
        recompute += rank.dense_layers * a_d + rank.moe_layers * a_m
    if per_op and lay.recompute_policy == "op_alternate" and rank.dense_layers:
        # ... and the forward GEMMs of the matmuls it does not keep (dense blocks only: spec/rules.py)
        gemms = _block_gemms(problem, lay, tokens, False)
        one_each = [gemm_s(m, n, k, peak8, 1) if fp8 else gemm_s(m, n, k) for m, n, k, c in gemms for _ in range(c)]
        recompute += rank.dense_layers * sum(one_each[i] for i in A.alternate_recomputed_gemms(s, fused, eager))
    recompute += rank.dense_layers * tile_rc
    return MicroBatchTimes(fwd, bwd, recompute, per_block_fwd + gap_fwd, 2 * (per_block_fwd + gap_fwd), a_d,
                           rank.layers * problem.block_overhead_s)
