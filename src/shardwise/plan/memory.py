"""Bytes per rank by category: parameters, gradients, optimizer state, activations, other.

Model states (Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054 §3, Fig. 1): with mixed-precision Adam
a model of Ψ parameters holds 2Ψ (16-bit params) + 2Ψ (16-bit grads) + 12Ψ (fp32 master params,
momentum, variance); ZeRO-1 partitions the 12Ψ over the N_d data-parallel ranks, ZeRO-2 also the
grads, ZeRO-3 also the params. That is `model_states="mixed"`.

This trainer keeps fp32 master parameters *as the parameters* in every precision (parallel/precision.py:
autocast / FSDP2 MixedPrecisionPolicy cast them for compute), fp32 gradients (DDP buckets are fp32;
FSDP2 reduce_dtype fp32) and AdamW's exp_avg / exp_avg_sq in fp32 plus a 4-byte `step` per parameter
tensor (train/optim.py): 4Ψ + 4Ψ + 8Ψ (+4 B per tensor) — `model_states="shardwise"`, the same
16 bytes/param, split differently. Its ZeRO levels (parallel/data_parallel.py):
  0  DDP: everything replicated; gradients are views of the DDP buckets (gradient_as_bucket_view).
  1  gradients all-reduced as with zero 0 (DDP; FSDP2 `replicate` for TP / PP layouts) + ZeroOneOptimizer
     (parallel/zero1.py) over dp_shard: whole tensors are assigned to ranks greedily by their LOCAL
     element count (the TP shard when tp > 1), largest first, to the least-loaded rank, per param
     group in order (decay group, then norms/biases; ZeroRedundancyOptimizer._partition_parameters'
     rule) — so the most loaded rank is computed exactly, and the partition is per tensor: it cannot
     split one tensor (e.g. the embedding) across ranks.
  2  FSDP2 reshard_after_forward=False, 3 FSDP2 reshard_after_forward=True: each parameter's dim 0 is
     padded to a multiple of the shard group and split (FSDP2 FSDPParam); the persistent local shards
     of params, grads (reduce-scatter output) and optimizer state are 1/N each. Transient on top: the
     gathered working copies and the gradients before their reduce-scatter (plan/fsdp_memory.py). CPU
     offload moves the persistent shards to host memory.
Offload (parallel.offload = "cpu" | "nvme"; FSDP2 CPUOffloadPolicy, also over a shard group of ONE rank:
ZeRO-Offload on one device). Device: the FSDP transients (plan/fsdp_memory.py: over a one-rank group
torch's world-size-1 path, measured on an H100 within 5%) and the staging of each gather. Host
(`Memory.cpu_bytes`): the persistent shards of parameters, gradients and AdamW state. "nvme"
(parallel/offload.py NvmeAdamW) moves the two moments, 8 bytes per parameter of the shard, to a file
(`Memory.disk_bytes`); host memory keeps the step counters (4 B per tensor) and two chunk buffers, each
holding the largest chunk of state: at most max(64 MiB, 8 B x the largest tensor)
(constants.NVME_CHUNK_BYTES; the whole state when smaller). When the planned device is the CPU itself
(cluster.gpu = "cpu") host memory IS device memory: offload moves nothing off it (the states stay in
their categories, cpu_bytes = 0) and only "nvme" takes the moments out of memory.
The fp16 loss scaler (parallel/precision.py DynamicLossScaler) keeps Python floats: no device bytes.
Which layers and parameters (with their local and FSDP-shard sizes) a rank holds: plan/inventory.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from shardwise.plan import activations as A
from shardwise.plan import compiled as K
from shardwise.plan import constants as C
from shardwise.plan import fsdp_memory as F
from shardwise.plan.inflight import head_bytes_held, inflight_microbatches, looped_held
from shardwise.plan.inventory import (
    RankModel,
    fsdp_shard_numel,
    local_shape,
    numel,
    pipeline_ranks,
    priced_layout,
    rank_params,
    sized_ranks,
)
from shardwise.plan.layout import Problem
from shardwise.plan.tp2d import activation_fraction
from shardwise.spec.layout import Layout
from shardwise.spec.loss import loss_chunk_tokens, loss_is_chunked
from shardwise.spec.sharding import zero1_owners
from shardwise.spec.stages import WRITTEN_OUT, stage_ids

GIB = 2**30


@dataclass
class Memory:
    """Bytes on the most loaded rank (device memory), by category; `detail` explains each term."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    capacity: float
    rank: str  # which pipeline rank is the most loaded: "first", "last", "only", or "rank R" (an uneven split)
    detail: dict[str, float] = field(default_factory=dict)
    cpu_bytes: float = 0.0        # host memory: offloaded parameters, gradients, optimizer state (and NVMe buffers)
    disk_bytes: float = 0.0       # local disk: the AdamW moments of offload = "nvme"
    host_capacity: float = float("inf")  # usable host memory per rank (Cluster.host_memory_bytes)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    @property
    def host_fits(self) -> bool:
        return self.cpu_bytes <= self.host_capacity

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity and self.host_fits

    def gib(self) -> dict[str, float]:
        return {k: round(v / GIB, 3) for k, v in (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer),
                                                  ("activations", self.activations), ("other", self.other), ("total", self.total),
                                                  ("capacity", self.capacity))}


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float
    tensors: int
    local_numel: float
    unsharded_param_numel: float   # this rank's TP-local parameters, unsharded (FSDP working copies)
    block_numel: float             # one block's TP-local parameters (FSDP ZeRO-3 working set)
    root_numel: float              # embedding + head on this rank (FSDP root unit)
    largest_numel: float = 0.0     # the largest local tensor's shard (NVMe chunk buffers)
    head_numel: float = 0.0        # final norm + output head on this rank (their gradients wait for the root's reduce)
    block_largest_numel: float = 0.0  # the largest tensor of a block, TP-local, unsharded (offload's staging copy)


@lru_cache(maxsize=65536)
def nvme_moment_bytes(optimizer_bytes: float, tensors: int, mixed: bool) -> float:
    """The part of `optimizer_bytes` (one rank's AdamW state) that offload="nvme" keeps in its file: the
    fp32 exp_avg + exp_avg_sq, without the 4-byte step counter of each of `tensors` parameter tensors,
    which stays in memory; with "mixed" model states, without the master copy (4 of 12 B/param; in bf16, 2 of
    6 and the moments in bf16: the same two thirds, counted here at the fp32 moments' 8 B per 12)."""
    per_param = optimizer_bytes / 12 if mixed else (optimizer_bytes - 4 * tensors) / 8
    return C.NVME_STATE_BYTES_PER_PARAM * per_param


def model_state_bytes(problem: Problem, rank: RankModel, tp: int, ep: int, zero: int, shard: int,
                      ep_shard: int, tp_mode: str = "1d") -> StateBytes:
    """Parameters, gradients and optimizer state one rank holds (before offload), see module doc.
    tp_mode "2d": the local blocks of parallel/tensor2d.py (inventory.local_shape_2d)."""
    shape = problem.shape
    mixed = problem.model_states == "mixed" and problem.low_precision
    fsdp = zero >= 2 and shard > 1
    local = padded = 0.0
    tensors = 0
    block_numel = root_numel = block_largest = 0.0
    sizes_decay: list[int] = []
    sizes_other: list[int] = []
    largest = 0.0
    head = {p.name for p in shape.head_params()} if rank.head else set()
    head_numel = 0.0
    for spec, repeat, in_block in rank_params(shape, rank):
        ls = local_shape(spec, shape, tp, ep, tp_mode)
        n = numel(ls)
        expert = spec.tp == "expert"
        group = ep_shard if expert else shard
        local += n * repeat
        own = fsdp_shard_numel(ls, group, expert) if fsdp else n
        padded += own * repeat
        if repeat:
            largest = max(largest, own)
        tensors += repeat
        if in_block:
            block_numel += n if repeat else 0
            block_largest = max(block_largest, n)
        else:
            root_numel += n
            head_numel += n if spec.name in head else 0
        if zero == 1 and not mixed:
            (sizes_decay if spec.decay else sizes_other).extend([n] * repeat)
    if rank.layers:
        block_numel /= max(1, (rank.dense_layers > 0) + (rank.moe_layers > 0))
    if mixed:
        # Textbook 2 + 2 + 12 bytes/param with the ZeRO partitions (Rajbhandari et al. Fig. 1); 2 + 2 + 6 with
        # AdamW's master copy and moments in bf16 (cluster.optimizer_state_dtype).
        n = max(1, shard)
        p = 2 * (local / n if zero >= 3 else local)
        g = 2 * (local / n if zero >= 2 else local)
        o = problem.master_state_bytes * (local / n if zero >= 1 else local)
        return StateBytes(p, g, o, tensors, local, local, block_numel, root_numel, largest, head_numel, block_largest)
    if fsdp:
        # Persistent padded shards; AdamW state matches the (unpadded on the last rank, padded-size on
        # rank 0 = the most loaded) local shard; + a 4-byte step per tensor.
        return StateBytes(4 * padded, 4 * padded, 8 * padded + 4 * tensors, tensors, local, local, block_numel, root_numel,
                          largest, head_numel, block_largest)
    opt = 8 * local + 4 * tensors
    if zero == 1 and shard > 1:
        opt = _zero1_most_loaded(tuple(sizes_decay), tuple(sizes_other), shard)
    return StateBytes(4 * local, 4 * local, opt, tensors, local, local, block_numel, root_numel, largest, head_numel,
                      block_largest)


@lru_cache(maxsize=4096)
def _zero1_most_loaded(decay: tuple[int, ...], other: tuple[int, ...], n: int) -> float:
    """The most loaded rank's AdamW bytes under zero1_owners: 8 per element + 4 per tensor (`step`)."""
    elems, tensors = [0] * n, [0] * n
    for size, r in zip(decay + other, zero1_owners((decay, other), n)):
        elems[r] += size
        tensors[r] += 1
    return max(8 * e + 4 * c for e, c in zip(elems, tensors))


# ---------------------------------------------------------------------------------------------------
# activations with the pipeline schedule
# ---------------------------------------------------------------------------------------------------
def core_layout(lay: Layout) -> Layout:
    """The layout with the pipeline schedule normalized away: everything per micro-batch (and the
    model states) is the same for every schedule, so it is computed once and cached under this key."""
    if lay.schedule == "1f1b" and lay.virtual_stages == 1 and not lay.stage_layers:
        return lay
    return lay.with_(schedule="1f1b", virtual_stages=1, stage_layers=())  # a rank's blocks come with its RankModel


def microbatch_activations(problem: Problem, core: Layout, rank: RankModel) -> tuple[float, float, float, float, float]:
    """(blocks, embedding, head, RoPE tables of one stage, recompute working set) in bytes for one
    micro-batch.

    Every term is affine in the micro-batch's tokens, so the coefficients are cached per layout
    without its micro-batch size (the search asks for many micro-batch sizes of one layout)."""
    key = (core.tp, core.sp, core.cp, core.cp_mode if core.cp > 1 else "", core.recompute, core.recompute_policy,
           core.recompute_every, core.lowp_params)
    tokens = core.micro_batch * problem.seq_len / core.cp
    # The loss switches to its chunked form above a micro-batch size (spec/loss.py): affine on each side.
    key += (loss_is_chunked(tokens, problem.shape.vocab_size, core.tp), problem.fp8_gathers(core))
    if core.linear_tiles > 1:  # keys (and so every cached number) of untiled layouts stay as they were
        key += (core.linear_tiles,)
    if grid2d(core):  # 2-D TP (a str: never read as the tile count)
        key += ("2d",)
    if not problem.eager_for(core):  # compiled blocks save what inductor's partitioner keeps (plan/compiled.py)
        key += ("compiled",)
    if problem.fused_for(core):  # train.fuse_projections (activations.fused_projection_delta)
        key += ("fused",)
    if problem.sp_sharded(core):  # cluster.sp_saved_input = "sharded" (activations.gathered_input_bytes)
        key += ("sp_sharded",)
    if problem.core_recompute(core):  # cluster.selective_recompute = "attention_core" (activations.core_internal_bytes)
        key += ("attention_core",)
    (b1, e1, h1, rope, w1), (b0, e0, h0, _, w0) = _activation_terms(problem, key, rank)
    return b0 + (b1 - b0) * tokens, e0 + (e1 - e0) * tokens, h0 + (h1 - h0) * tokens, rope, w0 + (w1 - w0) * tokens


@lru_cache(maxsize=1 << 15)
def _activation_terms(problem: Problem, key: tuple, rank: RankModel) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The activation bytes at 1 token and at 0 tokens (slope and intercept of each term)."""
    return _activations_at(problem, key, rank, 1.0), _activations_at(problem, key, rank, 0.0)


def _activations_at(problem: Problem, key: tuple, rank: RankModel, tokens: float) -> tuple[float, float, float, float, float]:
    shape = problem.shape
    tp, sp, cp, cp_mode, recompute, policy, every, lowp_params, chunked_loss, fp8_gathers = key[:10]
    tiles = next((k for k in key[10:] if isinstance(k, int)), 1)
    reg = A.regime(problem.precision, lowp_params, problem.model_states)
    if "2d" in key[10:]:
        return _activations_2d(problem, reg, tp, recompute, policy, every, rank, tokens)
    # Context parallelism changes what a plain block saves (activations.py cp_block_bytes_per_token,
    # cp_rope_bytes_per_block): the core's output copy, ring's fp32 output, Ulysses' repeated KV
    # heads, and RoPE's gathered cos/sin rows instead of slices of the whole tables.
    cp_per_token = A.cp_block_bytes_per_token(shape, reg, tp, cp, cp_mode)
    cp_fixed = A.cp_rope_bytes_per_block(shape, problem.seq_len, cp) if cp > 1 else 0.0

    # The math SDPA backend (fp32 + GQA on CUDA) saves the s x s probabilities; CP runs its own attention.
    attention = problem.attention if cp == 1 else "flash"

    compiled = "compiled" in key[10:] and attention != "math" and tiles == 1

    def none_block(moe: bool) -> float:
        if compiled:
            b = K.block_bytes(shape, reg, tp, sp, moe)
        else:
            b = A.block_bytes(shape, reg, tp, sp, moe, attention=attention, seq_len=problem.seq_len)
        # FP8 weights all-gathered by FSDP2 (tensorwise): a Float8Linear keeps the gathered FP8 weight and
        # its transposed copy for backward, 2 bytes per converted element (measured with saved-tensor hooks;
        # not modelled under recomputation, which no FP8 validation row covers yet).
        fp8_weights = 2.0 * shape.fp8_linears(moe)[0] if fp8_gathers else 0.0
        # parallel.linear_tiles (dense MLPs only): the tiled MLP saves its input, not its intermediates.
        t = A.tiled_mlp_delta(shape, reg) if tiles > 1 and not moe else A.BlockActivations(0.0, 0.0)
        # train.fuse_projections: under autocast no 16-bit copies of the joined weights (nor, eager, of their input)
        f = A.fused_projection_delta(shape, reg, compiled, moe, tiles) if "fused" in key[10:] \
            else A.BlockActivations(0.0, 0.0)
        # cluster.sp_saved_input = "sharded": the linears keep their all-gathered input as its sequence shard
        sharded = A.gathered_input_bytes(shape, reg, moe, compiled) * (1 - 1 / tp) if "sp_sharded" in key[10:] else 0.0
        return ((b.per_token + cp_per_token + t.per_token + f.per_token - sharded) * tokens + b.fixed + t.fixed + f.fixed + cp_fixed
                + fp8_weights)

    core_only = "attention_core" in key[10:]
    # the attention core's own internals, which a core-only selective recomputation does not keep
    core_internals = A.core_internal_bytes(shape, 4 if reg == "fp32" else 2, tp, attention, problem.seq_len) * tokens

    def stored(mode: str, moe: bool) -> float:
        if mode == "selective" and core_only:
            return none_block(moe) - core_internals
        if mode == "full":  # the block input only: tiles change nothing stored, only the working set below
            return A.full_recompute_block_bytes(shape, reg, tp, sp).per_token * tokens
        if mode == "selective":
            extra = A.tiled_selective_delta(shape, reg) if tiles > 1 and not moe else 0.0
            if policy == "op_alternate" and not moe:  # every other matmul output not kept (spec/rules.py: dense only)
                extra -= A.alternate_unkept_bytes(shape, reg, tp, "fused" in key[10:])
            if cp > 1 and cp_mode == "ring":  # the ring attention core is not cached
                extra -= A.ring_uncached_bytes(shape, reg, tp)
            return (A.selective_op_block_bytes(shape, reg, tp, sp, moe).per_token + extra) * tokens
        return none_block(moe)

    mode = recompute
    if mode == "selective" and policy == "layer" and not core_only:
        # Blocks 0, k, 2k, ... of the rank are checkpointed; the dense blocks come first.
        ckpt = [i % every == 0 for i in range(rank.layers)]
        blocks = sum(stored("full" if c else "none", i >= rank.dense_layers) for i, c in enumerate(ckpt))
    else:
        blocks = rank.dense_layers * stored(mode, False) + (rank.moe_layers * stored(mode, True) if rank.moe_layers else 0.0)
    embedding = head = 0.0
    if rank.embedding:
        embedding = A.embedding_bytes_per_token(shape) * tokens + A.gpt_positions_bytes(shape, problem.seq_len / cp)
    if rank.head:
        hb = A.head_bytes(shape, reg, tp, sp, chunked_loss, problem.head_in_fp8)
        head = hb.per_token * tokens + hb.fixed
    # RoPE slices are saved only by blocks that are not checkpointed (inside a checkpoint nothing but
    # the block input, and under "op" the matmul/SDPA outputs, is kept).
    plain_blocks = mode == "none" or core_only or (mode == "selective" and policy == "layer" and every > 1
                                                   and rank.layers > 1)
    rope = A.rope_table_bytes(shape) if rank.layers and plain_blocks else 0.0
    if cp > 1:  # the tables are gathered per block instead (above); Ulysses' index permutations
        rope = A.cp_stage_bytes(shape, problem.seq_len, cp_mode) if rank.layers and plain_blocks else 0.0
    # Recomputing a checkpointed block in backward rematerializes its full activations (one at a time).
    working = none_block(rank.moe_layers > 0) if mode != "none" and rank.layers else 0.0
    if core_only:  # only one block's attention core is rerun at a time
        working = core_internals if rank.layers else 0.0
    if tiles > 1 and rank.dense_layers:
        # The tiled MLP's backward recomputes one tile at a time: its intermediates are live on top of
        # whatever is stored (and of the rematerialized block, whose MLP then holds only x).
        working += A.tiled_mlp_transient(shape, reg, tiles) * tokens
    return blocks, embedding, head, rope, working


def grid2d(lay: Layout) -> bool:
    """2-D tensor parallelism (parallel/tensor2d.py) on this layout."""
    return lay.tp > 1 and lay.tp_mode == "2d"


def _activations_2d(problem: Problem, reg: str, tp: int, recompute: str, policy: str, every: int, rank: RankModel,
                    tokens: float) -> tuple[float, float, float, float, float]:
    """`_activations_at` under 2-D TP: every tensor a block saves is this rank's b/q sequences x h/q
    hidden columns (the heads H/q and KV heads KV/q for attention, local per sequence and head; the
    SUMMA calls save only their local X and W blocks), so a block keeps plan/tp2d.py
    activation_fraction("2d", tp) = 1/tp of what it keeps on one device, recomputed or not. The head:
    the final norm and the head's input likewise 1/tp; the loss (tensor2d.py _VocabCrossEntropy) saves
    the logits block [b/q, s, V/q] in its dtype and, per own token (T/q), int64 local targets, a bool
    mask and fp32 max and log-sum-exp (21 B). Embedding indices and the RoPE tables as in 1-D. Dense
    llama only (spec/rules.py), the compute ("flash" or "math") as problem.attention."""
    shape, frac = problem.shape, activation_fraction("2d", tp)

    def block(mode: str) -> float:
        if mode == "full":
            return A.full_recompute_block_bytes(shape, reg, 1, False).per_token * tokens * frac
        if mode == "selective":
            return A.selective_op_block_bytes(shape, reg, 1, False).per_token * tokens * frac
        b = A.block_bytes(shape, reg, 1, False, attention=problem.attention, seq_len=problem.seq_len)
        return (b.per_token * tokens + b.fixed) * frac

    if recompute == "selective" and policy == "layer":
        blocks = sum(block("full" if i % every == 0 else "none") for i in range(rank.layers))
    else:
        blocks = rank.layers * block(recompute)
    embedding = A.embedding_bytes_per_token(shape) * tokens if rank.embedding else 0.0
    head = 0.0
    if rank.head:
        head = (A._norm(shape, reg, 1, 1) * frac + A.loss_bytes_2d(shape, reg, tp).per_token) * tokens
        head += 2.0 * shape.vocab_size * shape.dim / tp if reg in ("autocast", "autocast_fp8") else 0.0
    plain_blocks = recompute == "none" or (recompute == "selective" and policy == "layer" and every > 1 and rank.layers > 1)
    rope = A.rope_table_bytes(shape) if rank.layers and plain_blocks else 0.0
    working = block("none") if recompute != "none" and rank.layers else 0.0
    return blocks, embedding, head, rope, working


def stored_activations(blocks: float, embedding_held: float, head_held: float, rope: float, inflight: float,
                       stages: int) -> float:
    """Saved bytes at the rank's peak: blocks times the in-flight micro-batches, the embedding's (8 B/token
    per micro-batch in flight) and the head's (plan/inflight.py head_bytes_held) held bytes, and one set
    of RoPE tables per stage with something in flight: every stage is a model of its own with its own
    cos/sin buffers (parallel/parallelize.py build_pipeline), each kept alive by its blocks' saved slices."""
    return blocks * inflight + embedding_held + head_held + rope * stages


def stages_with_layers(rank: RankModel, chunks: int) -> int:
    return max(1, min(chunks, rank.layers))


# ---------------------------------------------------------------------------------------------------
# the whole rank
# ---------------------------------------------------------------------------------------------------
def states_and_other(problem: Problem, core: Layout, rank: RankModel) -> tuple[float, float, float, float, float, tuple, float]:
    """(params, grads, optimizer, other, cpu bytes, detail items, disk bytes) of one rank: everything but
    the stored activations, which scale with the schedule's in-flight micro-batches."""
    key = (core.tp, core.ep, core.zero, core.dp_shard, core.cp, core.fsdp, core.offload, core.accumulation(problem) > 1,
           # 2-D TP communicates on the grid's two axes (tp_row, tp_col) instead of tp
           sum(1 for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if getattr(core, a) > 1) + grid2d(core), core.pp > 1,
           core.offload and core.nvme) + (("2d",) if grid2d(core) else ())
    params, grads, opt, other, cpu, items, disk = _states(problem, key, rank)
    if rank.head:
        # Transient at the loss: 16-bit logits + their fp32 copy (or the fp32 logits), vocab-sharded.
        # The chunked loss (spec/loss.py): the logits' gradient in their dtype, and one chunk's fp32
        # softmax and its gradient.
        tok = core.micro_batch * problem.seq_len / core.cp
        vocab = problem.shape.vocab_size
        if grid2d(core):  # the logits block [b/q, s, V/q] and its fp32 copy (tensor2d.py _VocabCrossEntropy)
            logits = tok * vocab / core.tp * (6 if problem.low_precision else 4)
        elif loss_is_chunked(tok, vocab, core.tp):
            logits = tok * vocab * (2 if problem.low_precision else 4) + 2 * 4 * loss_chunk_tokens(vocab) * vocab
        else:
            logits = tok * vocab / core.tp * (6 if problem.low_precision else 4)
        return params, grads, opt, other + logits, cpu, items + (("logits_transient", logits),), disk
    return params, grads, opt, other, cpu, items, disk


@lru_cache(maxsize=1 << 15)
def _states(problem: Problem, key: tuple, rank: RankModel) -> tuple[float, float, float, float, float, tuple, float]:
    tp, ep, zero, dp_shard, cp, fsdp, offload, accumulating, comm_axes, pipelined, nvme = key[:11]
    shard = dp_shard * cp
    st = model_state_bytes(problem, rank, tp, ep, zero, shard if zero else 1, max(1, shard // ep), *key[11:])
    detail: dict[str, float] = {}
    params, grads, opt = st.params, st.grads, st.optimizer
    other = 0.0
    mixed = problem.model_states == "mixed" and problem.low_precision
    param_dtype = 2 if problem.low_precision else 4
    # FSDP2 over a one-rank group (offload on one device): torch's world-size-1 path (plan/fsdp_memory.py).
    one_rank = fsdp and offload and shard == 1 and not pipelined and not mixed
    if fsdp and not mixed:
        unsharded, grad_work = F.working_bytes(st, zero, param_dtype, accumulating, pipelined, one_rank)
        detail["fsdp_unsharded_params"] = unsharded
        detail["fsdp_unsharded_grads"] = grad_work
        other += unsharded + grad_work
    elif fsdp and mixed and zero == 3:
        detail["fsdp_unsharded_params"] = (2 * st.block_numel + st.root_numel) * 2
        other += detail["fsdp_unsharded_params"]
    cpu = disk = 0.0
    if offload and nvme:
        # The moments go to the file; the step counters and two chunk buffers stay in memory (module doc).
        moments = nvme_moment_bytes(opt, st.tensors, mixed)
        buffers = C.NVME_BUFFERS * min(moments, max(C.NVME_CHUNK_BYTES, C.NVME_STATE_BYTES_PER_PARAM * st.largest_numel))
        disk = moments
        opt = opt - moments + buffers
        detail["nvme_optimizer_state"] = moments
        detail["nvme_buffers"] = buffers
    device_is_host = problem.cluster.device_is_host
    if offload and not device_is_host:
        cpu = params + grads + opt
        detail["offloaded_to_cpu"] = cpu
        params = grads = opt = 0.0
        if fsdp and not mixed:
            if one_rank:
                staging, root_reduce = F.one_rank_excess(st, param_dtype, other)
                if root_reduce:
                    detail["fsdp_root_reduce"] = root_reduce
                    other += root_reduce
            else:
                staging = F.offload_staging_bytes(st, shard, param_dtype)
            detail["offload_staging"] = staging
            other += staging
    comm = C.COMM_BUFFER_BYTES_PER_AXIS * comm_axes
    detail["comm_buffers"] = comm
    other += comm
    return params, grads, opt, other, cpu, tuple(detail.items()), disk


def rank_memory(problem: Problem, lay: Layout, rank: RankModel, which: str, first: bool, pp_rank: int | None = None
                ) -> Memory:
    """The bytes of pipeline rank `rank` (`which`: its label; `first`: the pipeline's first, or `pp_rank`)."""
    lay = priced_layout(problem.shape, lay)
    core = core_layout(lay)
    params, grads, opt, other, cpu, items, disk = states_and_other(problem, core, rank)
    blocks, embedding, head, rope, working = microbatch_activations(problem, core, rank)
    m, v = lay.accumulation(problem), lay.chunks_per_rank
    if lay.schedule in WRITTEN_OUT and lay.stage_layers and pp_rank is not None:
        # The trainer's own split can give the rank stages of unequal sizes: torch's order followed stage by
        # stage (the embedding's and the head's bytes with their stages), as the peak need not be the count's;
        # a stage with nothing in flight then keeps no RoPE tables alive (measured: one set fewer).
        own, last = stage_ids(lay.schedule, lay.pp, v, pp_rank), lay.pp * v - 1
        weights = [blocks * lay.stage_layers[s] / rank.layers + embedding * (s == 0) + head * (s == last) for s in own]
        held = dict(zip(own, looped_held(lay.schedule, lay.pp, m, v, pp_rank, weights)))
        inflight = sum(lay.stage_layers[s] * n for s, n in held.items()) / rank.layers
        embedding_held, head_inflight = embedding * held.get(0, 0), held.get(last, 0)
        stages = sum(n > 0 for n in held.values())
    else:
        inflight = inflight_microbatches(lay.schedule, lay.pp, m, v, first, pp_rank)
        embedding_held, head_inflight = embedding * inflight, None
        stages = stages_with_layers(rank, v)
    head_held = head_bytes_held(problem, core, rank, head, lay.schedule, lay.pp, m, v, grid2d(core), head_inflight)
    stored = stored_activations(blocks, embedding_held, head_held, rope, inflight, stages)
    detail = dict(items)
    detail.update({"activations_blocks": blocks * inflight,
                   "activations_embedding_head": embedding_held + head_held,
                   "activations_rope_tables": rope * stages, "inflight_microbatches": inflight,
                   "recompute_working_set": working, "activations_stored": stored})
    capacity = problem.cluster.device.memory_gib * GIB * C.USABLE_MEMORY_FRACTION
    return Memory(params, grads, opt, stored + working, other, capacity, which, detail, cpu, disk,
                  problem.cluster.host_memory_bytes() if lay.offload else float("inf"))


def memory(problem: Problem, lay: Layout) -> Memory:
    """The most loaded rank: the first pipeline rank (embedding, most in-flight micro-batches) or the
    last (output head, logits) — whichever needs more; under the trainer's own split any rank
    (plan/inventory.py sized_ranks; and the even split that priced_layout prices so)."""
    lay = priced_layout(problem.shape, lay)
    ranks = sized_ranks(problem.shape, lay)
    if lay.pp == 1:
        return rank_memory(problem, lay, ranks[0][1], "only", True)
    labels = {0: "first", lay.pp - 1: "last"}
    return max((rank_memory(problem, lay, rank, labels.get(r, f"rank {r}"), r == 0, r) for r, rank in ranks),
               key=lambda mem: mem.total)  # the first of equals, as before


def end_rank_states(problem: Problem, core: Layout, lay: Layout | None = None) -> list[tuple]:
    """states_and_other of the ranks that can be the most loaded: the first and last pipeline rank (the
    embedding, the head), the one rank without a pipeline; every rank of `lay`'s own split where given."""
    if lay is not None and lay.stage_layers:
        return [states_and_other(problem, core, rank) for _, rank in sized_ranks(problem.shape, lay)]
    first, last = pipeline_ranks(problem.shape, core.pp, 1, "1f1b")
    return [states_and_other(problem, core, r) for r in ((first, last) if core.pp > 1 else (first,))]


def offloaded_state_bytes(problem: Problem, lay: Layout) -> float:
    """Model states the most loaded rank keeps in host memory with offload (parameters, gradients, AdamW
    state, less the moments "nvme" puts on disk), whether the planned device is a GPU (they were moved
    there: `cpu`) or the CPU itself (they never left); 0 without offload. launch/host_memory.py holds it
    against a node's memory before any worker starts."""
    if not lay.offload:
        return 0.0
    return max(sum(states[i] for i in (0, 1, 2, 4)) for states in end_rank_states(problem, core_layout(lay), lay))


def capacity_bytes(problem: Problem) -> float:
    return problem.cluster.device.memory_gib * GIB * C.USABLE_MEMORY_FRACTION
