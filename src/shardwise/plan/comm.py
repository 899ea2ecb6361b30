"""Communication per optimizer step: which collectives a rank issues, their bytes, and their time.

Bytes convention (shared with the trainer's counter): per rank, per optimizer step, per mesh axis
("dp_replicate", "dp_shard", "dp" = the flattened dp_replicate x dp_shard group, "tp", "cp", "pp",
"ep", "efsdp") and per collective kind, the *payload* = the size of the full logical buffer of each call:
all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the unsharded input;
broadcast / reduce: the tensor; all_to_all: the input; send / recv: the tensor. plan/collective_time.py
`wire_bytes` converts a payload into what a rank actually sends with the ring algorithms (Thakur et al.
2005, "Optimization of collective communication operations in MPICH"; Patarasuk & Yuan 2009 for the
bandwidth-optimal ring all-reduce 2(n-1)/n S), and `time_of` prices the calls.

What this codebase issues (parallel/data_parallel.py, train/trainer.py, train/optim.py):
  DDP (zero 0, and zero 1's gradient sync): one all_reduce of every fp32 gradient over the batch group
    per optimizer step (no_sync on the other micro-batches), in 25 MiB buckets — or, for TP / PP layouts,
    FSDP2's `replicate` (the same bytes, per block unit);
  ZeRO-1 (parallel/zero1.py, with or without tp): + each owner's broadcast of its updated parameters
    over dp_shard, one flat buffer per owner: every local (TP-shard) parameter byte once per step;
  FSDP2 (zero 2/3): per micro-batch an all_gather of every unit's parameters (param_dtype; padded to a
    multiple of dp_shard per parameter) in forward, and for ZeRO-3 again of every block in backward
    (the root unit is not resharded after forward); a reduce_scatter of fp32 gradients per micro-batch
    (ZeRO-3) or on the last one (ZeRO-2); HSDP adds an all_reduce of the gradient shards over
    dp_replicate; gradient clipping all-reduces one fp32 scalar per parameter tensor over dp_shard
    (each DTensor gradient's Partial norm is reduced on its own; the same over tp with TP);
  TP / SP (parallel/tensor.py): see `_tp_collectives`;
  PP (parallel/pipeline.py, torch.distributed.pipelining): send/recv of one micro-batch's boundary
    activation per cross-rank stage boundary and direction (`pp_collectives`), one fp32 all_reduce of
    the squared gradient norm over pp; FSDP under the schedule gathers and reduce-scatters less often
    (see `_fsdp_collectives`).
Validated against the trainer's counter, per axis and per pipeline rank, on data-parallel, TP, 2-D and
pipeline layouts (tests/dist/test_plan_validation.py).
Not counted (nor by the trainer's counter): the logged loss's all-reduce, checkpoint / logging-step
traffic on the world group (memory all_gather) and the trainer's control group (train/control.py: one
all-reduce of two flags per step, finite step and stop request, fp16's overflow check included).
CP (parallel/context.py): ring attention sends and receives K and V (compact KV heads, compute
dtype) cp-1 times per layer and micro-batch in forward, and in backward cp-1 times K/V plus cp-1
times the dK/dV accumulators; Ulysses 4 all_to_all (q, k, v, out) per layer and direction. CP ranks
join data parallelism: gradients over dp_cp, model states sharded over dp_shard_cp (`batch_axis`,
`shard_axis`; the counter's names for them: `counted_axis`). EP (parallel/expert.py): all_to_all
dispatch + combine per MoE layer and direction on "ep"; the stacked experts leave the dense FSDP
units, and with efsdp = dp_shard x cp / ep > 1 have their own per-block FSDP unit on the expert
mesh's "efsdp" axis; their gradient norms are reduced on ep (and efsdp): `_expert_fsdp_collectives`.
Validated per axis and rank on MoE layouts (tests/dist/test_comm_volume.py). Recomputation repeats the forward's CP / EP
collectives (they are not in selective "op"'s save list); for TP see `_tp_collectives`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from shardwise.plan.activations import regime
from shardwise.plan.collective_time import (  # noqa: F401  (re-exported: plan/cost.py, decode.py, tests)
    KINDS,
    Collective,
    collective_time,
    measured_time,
    placements,
    time_of,
    wire_bytes,
)
from shardwise.plan.compression import compress_collectives
from shardwise.plan.inventory import FsdpUnits, RankModel, fsdp_units, owned_chunks, param_tensors, pipeline_rank
from shardwise.plan.layout import Problem
from shardwise.plan.scale import megatron_bucket_params
from shardwise.plan.tp2d import comm_bytes_per_step, grid_q, recompute_bytes_per_step, summa_calls
from shardwise.spec.layout import PER_OP_POLICIES, Layout


def batch_axis(lay: Layout) -> str:
    """The group that reduces gradients of replicated weights and the loss: the batch view (dp, or its
    one non-trivial axis); with CP its ranks join it ("dp_cp", torchtitan), as they see other tokens."""
    if lay.cp > 1:
        return "dp_cp"
    if lay.dp_replicate > 1 and lay.dp_shard > 1:
        return "dp"
    return "dp_replicate" if lay.dp_replicate > 1 else "dp_shard"


def shard_axis(lay: Layout) -> str:
    """The group model states are sharded over (FSDP / ZeRO-1): dp_shard, or dp_shard x cp with CP."""
    return "dp_shard_cp" if lay.cp > 1 else "dp_shard"


def collectives(problem: Problem, lay: Layout, rank: RankModel | None = None, pp_rank: int = 0) -> list[Collective]:
    """Every collective one rank issues in one optimizer step (see the module docstring)."""
    if rank is None:
        rank = pipeline_rank(problem.shape, lay.pp, lay.chunks_per_rank, lay.schedule, pp_rank, lay.stage_layers)
    return data_and_model_collectives(problem, lay, rank) + pp_collectives(problem, lay, pp_rank)


def pp_boundary_bytes(problem: Problem, lay: Layout) -> float:
    """One micro-batch's activation (or its gradient) crossing a stage boundary from one rank: sequence-sharded
    under SP, a 1/tp part under DeepSpeed's pipeline engine (`pp_partitioned`), in the residual-stream dtype
    (16-bit when FSDP2 / replicate compute on 16-bit parameters: train/trainer.py boundary_dtype)."""
    split = lay.tp if lay.sp or pp_partitioned(problem, lay) else 1
    return pp_whole_boundary_bytes(problem, lay) / split


def pp_whole_boundary_bytes(problem: Problem, lay: Layout) -> float:
    """The whole boundary activation of one micro-batch on a TP rank, before any split over TP."""
    return lay.micro_batch * problem.seq_len / lay.cp * problem.shape.dim * _residual_bytes(problem, lay)


def pp_partitioned(problem: Problem, lay: Layout) -> bool:
    """DeepSpeed's pipeline engine splits each boundary over TP (its pipe_partitioned / grad_partitioned) and
    all-gathers it on arrival (constants.DEEPSPEED_PARTITIONED_GATHERS_PER_MICROBATCH); under SP the boundary
    is already a 1/tp sequence shard."""
    return problem.deepspeed_pipeline(lay) and lay.tp > 1 and not lay.sp


def pp_boundaries(lay: Layout, pp_rank: int) -> tuple[int, int]:
    """(forward sends, forward receptions) per micro-batch of pipeline rank `pp_rank`: one per owned
    stage that is not the last (first) whose next (previous) stage lives on another rank. The V
    shapes keep stages pp-1 and pp on rank pp-1: that hand-over is local, not communicated."""
    v, n_chunks = lay.chunks_per_rank, lay.pp * lay.chunks_per_rank
    owned = set(owned_chunks(lay.schedule, lay.pp, v, pp_rank))
    sends = sum(1 for c in owned if c != n_chunks - 1 and c + 1 not in owned)
    recvs = sum(1 for c in owned if c != 0 and c - 1 not in owned)
    return sends, recvs


def pp_collectives(problem: Problem, lay: Layout, pp_rank: int) -> list[Collective]:
    """Pipeline traffic of rank `pp_rank`: per micro-batch, a forward send for each stage boundary it
    hands to another rank and a forward recv for each it gets from one, and the same backward (the
    gradient goes the other way); plus the gradient clipping's one fp32 all_reduce of the squared norm
    over pp (train/optim.py clip_grad_norm). The schedules' first-step warm-up (4-byte handshakes
    between neighbours) is not per-step traffic and is not counted."""
    if lay.pp == 1:
        return []
    m = lay.accumulation(problem)
    boundary = pp_boundary_bytes(problem, lay)
    sends_fwd, recvs_fwd = pp_boundaries(lay, pp_rank)
    # Forward activations out + backward gradients out (to the previous stage), and the receptions.
    out = [Collective("pp", "send", boundary, m * (sends_fwd + recvs_fwd), "p2p", "act"),
           Collective("pp", "recv", boundary, m * (sends_fwd + recvs_fwd), "p2p", "act")]
    if pp_partitioned(problem, lay):  # DeepSpeed: the received input (fwd), the saved output and its gradient (bwd)
        whole = pp_whole_boundary_bytes(problem, lay)
        out += [Collective("tp", "all_gather", whole, m * recvs_fwd, "fwd", "pp_gather"),
                Collective("tp", "all_gather", whole, 2 * m * sends_fwd, "bwd", "pp_gather")]
    return out + [Collective("pp", "all_reduce", 4.0, 1, "step", "grad_norm")]


def _residual_bytes(problem: Problem, lay: Layout) -> int:
    """Bytes per element of the residual stream: 16-bit under 16-bit parameters (FSDP2 / replicate
    param_dtype, or "mixed" states: activations.py regime "lowp"), else fp32 (fp32, and autocast,
    which keeps the residual stream in fp32)."""
    return 2 if regime(problem.precision, lay.lowp_params, problem.model_states) == "lowp" else 4


def _state_dtypes(problem: Problem) -> tuple[bool, int, int]:
    """(mixed, parameter bytes, gradient bytes) of what data parallelism moves: the module doc of
    plan/memory.py — 16-bit parameters under low precision, fp32 gradients but with the textbook
    "mixed" model states (Rajbhandari et al. 2019, ZeRO, Fig. 1)."""
    low = problem.low_precision
    mixed = problem.model_states == "mixed" and low
    return mixed, (2 if low else 4), (2 if mixed else 4)


def data_and_model_collectives(problem: Problem, lay: Layout, rank: RankModel) -> list[Collective]:
    """The collectives of every axis but pp (independent of the pipeline schedule), in this order:
    data parallel (FSDP, or DDP / ZeRO-1), TP / SP, CP, EP."""
    m = lay.accumulation(problem)
    out: list[Collective] = []
    if lay.dp * lay.cp > 1:
        dp = _fsdp_collectives(problem, lay, rank, m) if lay.fsdp else _ddp_collectives(problem, lay, rank)
        out += compress_collectives(dp, problem, lay, rank)  # parallel.grad_compression: plan/compression.py
    # The activations of one micro-batch on this rank (TP, CP, EP payloads).
    tokens = lay.micro_batch * problem.seq_len / lay.cp
    act = problem.compute_bytes
    # Fraction of blocks whose forward is replayed in backward.
    core_only = problem.core_recompute(lay)  # cluster.selective_recompute = "attention_core": no block replayed
    rc_frac = (1.0 / lay.recompute_every if lay.recompute == "selective" and lay.recompute_policy == "layer" and not core_only
               else 1.0 if lay.recompute == "full" else 0.0)
    if lay.tp > 1 and lay.tp_mode == "2d":
        out += _tp2d_collectives(problem, lay, rank, _residual_bytes(problem, lay), rc_frac, m)
    elif lay.tp > 1:
        out += _tp_collectives(problem, lay, rank, tokens, act, _residual_bytes(problem, lay), rc_frac, m)
    # CP / EP collectives are not in selective "op"'s save list: replayed like a full recompute.
    rc_other = 1.0 if lay.recompute == "selective" and lay.recompute_policy in PER_OP_POLICIES else rc_frac
    if lay.cp > 1:  # a rerun attention core exchanges its K / V again
        out += _cp_collectives(problem, lay, rank, tokens, act, 1.0 if core_only else rc_other, m)
    if lay.ep > 1 and rank.moe_layers and problem.shape.moe is not None:
        out += _ep_collectives(problem, rank, tokens, act, 0.0 if core_only else rc_other, m)
    return out


def _ddp_collectives(problem: Problem, lay: Layout, rank: RankModel) -> list[Collective]:
    """DDP (zero 0, and zero 1's gradient sync): one all_reduce of every gradient over the batch group
    per optimizer step; ZeRO-1 adds each owner's broadcast of its updated parameters over the shard
    group (module doc)."""
    mixed, param_bytes, grad_bytes = _state_dtypes(problem)
    units = fsdp_units(problem.shape, lay.tp, lay.ep, lay.shard_group, rank, lay.tp_mode)
    local = units.blk + units.root + units.exp
    if lay.zero == 1 and lay.shard_group > 1 and lay.dp_replicate == 1 and \
            problem.stack_for(lay).grad_reduce == "distributed_optimizer":
        # Megatron-Core's distributed optimizer (plan/scale.py): a reduce-scatter of the gradients and an
        # all-gather of the updated 16-bit parameters, bucket by bucket (a call per bucket).
        buckets = max(1, math.ceil(local / megatron_bucket_params(lay.shard_group)))
        sax = shard_axis(lay)
        return [Collective(sax, "reduce_scatter", local * grad_bytes / buckets, buckets, "grad", "grads"),
                Collective(sax, "all_gather", local * param_bytes / buckets, buckets, "step", "params")]
    out = [Collective(batch_axis(lay), "all_reduce", local * grad_bytes, 1, "grad", "grads")]
    if lay.zero == 1 and lay.shard_group > 1:
        out.append(Collective(shard_axis(lay), "broadcast", local * param_bytes if mixed else local * 4, 1, "step", "params"))
    return out


def _fsdp_collectives(problem: Problem, lay: Layout, rank: RankModel, m: int) -> list[Collective]:
    """FSDP2 (zero 2/3): the all_gathers of the block and root units, their gradients'
    reduce_scatters, HSDP's all_reduce of the shards over dp_replicate, the gradient-norm reductions,
    and under EP the stacked experts' own units (`_expert_fsdp_collectives`)."""
    shape = problem.shape
    _, param_bytes, grad_bytes = _state_dtypes(problem)
    units = fsdp_units(shape, lay.tp, lay.ep, lay.shard_group, rank, lay.tp_mode)
    blk_pad, root_pad = units.blk_pad, units.root_pad
    sax = shard_axis(lay)
    out: list[Collective] = []
    n_blocks = max(1, rank.layers)
    if lay.pp > 1:
        # Under the pipeline schedule (torch.distributed.pipelining) resharding after backward
        # is off and the reduce-scatter waits for the end of the step. ZeRO-2 gathers every
        # unit once. ZeRO-3 reshards after each forward: a block gathers for every forward
        # that does not directly follow a backward of its stage (which left it unsharded) and
        # for the first backward after a forward — m + 1 per step for any schedule that runs
        # each stage as runs of forwards and backwards, first a forward, last a backward
        # (measured on every schedule: tests/dist/test_plan_validation.py). The root units
        # (not resharded after forward) gather once.
        block_gathers, syncs = (m, 1) if lay.zero == 3 else (1, 1)
        root_gathers = 1
    else:
        block_gathers, syncs, root_gathers = m, (m if lay.zero == 3 else 1), m
    block_bytes = blk_pad / n_blocks * param_bytes
    fp8_tensors = 0
    if problem.fp8_gathers(lay):
        # FP8 all-gather (parallel/float8.py, tensorwise): the converted weights travel as 1 byte per
        # element; each needs its amax all-reduced first (4 bytes per weight tensor and gather).
        # Per block, as blk_pad: the rank's dense and MoE blocks convert different linears.
        dense, moe = shape.fp8_linears(False), shape.fp8_linears(True) if rank.moe_layers else (0, 0)
        numel = (rank.dense_layers * dense[0] + rank.moe_layers * moe[0]) / n_blocks
        fp8_tensors = rank.dense_layers * dense[1] + rank.moe_layers * moe[1]
        block_bytes -= numel * (param_bytes - 1)
    out.append(Collective(sax, "all_gather", root_pad * param_bytes, root_gathers, "fwd", "root"))
    out.append(Collective(sax, "all_gather", block_bytes, block_gathers * n_blocks, "fwd", "block"))
    bwd_gathers = (1 if lay.pp > 1 else m) if lay.zero == 3 else 0
    if bwd_gathers:
        out.append(Collective(sax, "all_gather", block_bytes, bwd_gathers * n_blocks, "bwd", "block"))
    if fp8_tensors:
        out.append(Collective(sax, "all_reduce", 4.0, fp8_tensors * (block_gathers + bwd_gathers), "fwd", "fp8_amax"))
    out.append(Collective(sax, "reduce_scatter", blk_pad / n_blocks * grad_bytes, syncs * n_blocks, "grad", "block"))
    out.append(Collective(sax, "reduce_scatter", root_pad * grad_bytes, syncs, "grad", "root"))
    if lay.dp_replicate > 1:
        shard = (blk_pad + root_pad) / lay.shard_group * grad_bytes
        out.append(Collective("dp_replicate", "all_reduce", shard, syncs, "grad", "grads"))
    # Gradient clipping (train/optim.py): the norm of each sharded DTensor gradient is a Partial
    # scalar reduced over its mesh — 4 bytes per parameter tensor (torch coalesces a foreach
    # group's into one call: same bytes).
    ep_experts = lay.ep > 1 and rank.moe_layers and shape.moe is not None
    dense_tensors = param_tensors(shape, rank, False) if ep_experts else param_tensors(shape, rank)
    out.append(Collective(sax, "all_reduce", 4.0, dense_tensors, "step", "grad_norm"))
    if ep_experts:
        out += _expert_fsdp_collectives(lay, units, rank.moe_layers, param_tensors(shape, rank, True),
                                        param_bytes, grad_bytes, block_gathers, bwd_gathers, syncs)
    return out


def _cp_collectives(problem: Problem, lay: Layout, rank: RankModel, tokens: float, act: int, rc_other: float,
                    m: int) -> list[Collective]:
    """CP (parallel/context.py): ring attention's K/V (and backward dK/dV) sends and receives, or
    Ulysses' all_to_alls, per layer and micro-batch; the MoE router statistics summed over cp."""
    shape = problem.shape
    out: list[Collective] = []
    kv_local = max(shape.kv_dim / lay.tp, shape.head_dim)
    L = rank.layers
    if lay.cp_mode == "ulysses":
        # q, k, v to heads and the output back; local KV heads that cp does not divide are
        # repeated cp / gcd(kv heads, cp) times first (parallel/context.py UlyssesAttention).
        kv_heads = kv_local / shape.head_dim
        kv_sent = kv_local * lay.cp / math.gcd(int(kv_heads), lay.cp) if kv_heads % lay.cp else kv_local
        qkvo = tokens * (2 * shape.dim / lay.tp + 2 * kv_sent) * act
        out.append(Collective("cp", "all_to_all", qkvo / 4, 4 * L * m, "fwd", "act"))
        out.append(Collective("cp", "all_to_all", qkvo / 4, 4 * L * m, "bwd", "act"))
        if rc_other:
            out.append(Collective("cp", "all_to_all", qkvo / 4, 4 * L * m * rc_other, "recompute", "act"))
    else:
        kv = tokens * 2 * kv_local * act
        # Backward sends K/V again (compute dtype) and the dK/dV accumulators, which the ring
        # keeps in fp32 whatever the precision (parallel/context.py: autocast off, sums over cp hops).
        dkv = tokens * 2 * kv_local * 4
        for kind in ("send", "recv"):
            out.append(Collective("cp", kind, kv, (lay.cp - 1) * L * m, "fwd", "kv"))
            out.append(Collective("cp", kind, kv, (lay.cp - 1) * L * m, "bwd", "kv"))
            out.append(Collective("cp", kind, dkv, (lay.cp - 1) * L * m, "bwd", "dkv"))
            if rc_other:
                out.append(Collective("cp", kind, kv, (lay.cp - 1) * L * m * rc_other, "recompute", "kv"))
    if rank.moe_layers and shape.moe is not None:
        # models/moe.py under CP: per MoE layer and micro-batch the router statistics of the cp
        # ranks are summed, (counts, tokens) and the differentiable (P, z) sums, E + 1 fp32 values
        # each, the latter again in backward: 3 small all_reduces.
        stats = (shape.moe.num_experts + 1) * 4.0
        out.append(Collective("cp", "all_reduce", stats, 2 * rank.moe_layers * m, "fwd", "moe_stats"))
        out.append(Collective("cp", "all_reduce", stats, rank.moe_layers * m, "bwd", "moe_stats"))
    return out


def _ep_collectives(problem: Problem, rank: RankModel, tokens: float, act: int, rc_other: float,
                    m: int) -> list[Collective]:
    """EP (parallel/expert.py): the token dispatch / combine all_to_alls of the MoE layers."""
    shape = problem.shape
    # Per MoE layer and micro-batch, the token copies this rank routed (T*k, fewer when capacity
    # drops some) go out in one all_to_all (dispatch) and come back in another (combine); backward
    # runs both in reverse. A rank *receives* as many copies as its experts were chosen for, so a
    # single rank's combine payload follows the routing; over the ep group the mean is exactly this.
    # The per-expert counts (E int64) are exchanged first (forward only).
    dispatched = tokens * shape.moe.top_k * shape.moe.sent_fraction * shape.dim * act
    counts = shape.moe.num_experts * 8.0
    out = [Collective("ep", "all_to_all", dispatched, 2 * rank.moe_layers * m, "fwd", "tokens"),
           Collective("ep", "all_to_all", counts, rank.moe_layers * m, "fwd", "counts"),
           Collective("ep", "all_to_all", dispatched, 2 * rank.moe_layers * m, "bwd", "tokens")]
    if rc_other:
        out.append(Collective("ep", "all_to_all", dispatched, 2 * rank.moe_layers * m * rc_other, "recompute", "tokens"))
        out.append(Collective("ep", "all_to_all", counts, rank.moe_layers * m * rc_other, "recompute", "counts"))
    return out


def _expert_fsdp_collectives(lay: Layout, units: FsdpUnits, moe_layers: int, tensors: int, param_bytes: int,
                             grad_bytes: int, fwd_gathers: int, bwd_gathers: int, syncs: int) -> list[Collective]:
    """The stacked experts under EP (parallel/expert.py), one rank. With efsdp = dp_shard x cp / ep > 1
    each MoE block's experts module is an FSDP2 unit over the expert mesh's efsdp axis with the blocks'
    reshard policy (zero 3: resharded after forward), so per MoE block it gathers (param dtype) and
    reduce-scatters (fp32 gradients) exactly as often as its block does; with efsdp == 1 it moves
    nothing on the data-parallel axes (FSDP ignores the experts; a gradient hook divides locally).
    Gradient clipping (train/optim.py clip_grad_norm) takes the expert gradients' norm on the expert
    mesh: each tensor's Partial norm is all-reduced over every mesh axis it is sharded on — ep (E/ep
    experts per rank) and, with efsdp > 1, efsdp (FSDP's shard): 4 bytes per tensor on each."""
    out = [Collective("ep", "all_reduce", 4.0, tensors, "step", "grad_norm")]
    if lay.shard_group // lay.ep > 1:
        unit = units.exp_pad / moe_layers
        out += [Collective("efsdp", "all_gather", unit * param_bytes, fwd_gathers * moe_layers, "fwd", "experts"),
                Collective("efsdp", "reduce_scatter", unit * grad_bytes, syncs * moe_layers, "grad", "experts"),
                Collective("efsdp", "all_reduce", 4.0, tensors, "step", "grad_norm")]
        if bwd_gathers:
            out.append(Collective("efsdp", "all_gather", unit * param_bytes, bwd_gathers * moe_layers, "bwd", "experts"))
    return out


def _tp_collectives(problem: Problem, lay: Layout, rank: RankModel, tokens: float, act: int, res: int,
                    rc_frac: float, m: int) -> list[Collective]:
    """TP / SP traffic as parallel/tensor.py issues it (measured in tests/dist/test_comm_volume.py).

    Per block, forward: without SP 2 all_reduce of the row-wise outputs; with SP 2 all_gather at the
    region entries and 2 reduce_scatter of the row-wise outputs; backward mirrors each (all_reduce ->
    all_reduce, all_gather -> reduce_scatter and back). The vocab-parallel embedding adds a forward
    all_reduce (SP: reduce_scatter, + its backward all_gather); the head's input a backward
    all_reduce (SP: forward all_gather + backward reduce_scatter); loss parallel 3 all_reduce of one
    fp32 per token. Full recompute replays the all_gathers and one of the two reductions per block
    (torch.utils.checkpoint stops before the last one, which feeds only the residual add);
    selective "op" saves the reductions' outputs (parallel/activation_checkpoint.py) and replays the SP
    all_gathers only. Replicated weights used on sharded activations get Partial gradients that
    are all-reduced once per gradient sync: the SP norms, every KV projection when n_kv < tp, and
    the router of every MoE block (with or without SP). Under cluster.sp_saved_input = "sharded" the
    backward all-gathers each block's two norm outputs once more (plan/stack.py).
    """
    shape, L = problem.shape, rank.layers
    per_layer = tokens * shape.dim
    op_selective = (lay.recompute == "selective" and lay.recompute_policy in PER_OP_POLICIES
                    and not problem.core_recompute(lay))
    out: list[Collective] = []
    # cluster.sp_gather = "fp8" (torchao's float8 TP styles): the block inputs' all-gathers (and their replay)
    # move e4m3, the row-parallel outputs' gradients e5m2: 1 byte; the reduce-scatters stay in the compute dtype.
    fp8_gathers = problem.fp8_sp_gathers(lay)
    gather_fwd, gather_bwd = (1, 1) if fp8_gathers else (res, act)
    if lay.sp:
        out += [Collective("tp", "all_gather", per_layer * gather_fwd, 2 * L * m, "fwd", "act"),
                Collective("tp", "reduce_scatter", per_layer * act, 2 * L * m, "fwd", "act"),
                Collective("tp", "reduce_scatter", per_layer * res, 2 * L * m, "bwd", "act"),
                Collective("tp", "all_gather", per_layer * gather_bwd, 2 * L * m, "bwd", "act")]
        replay = [("all_gather", 2 * L if op_selective else 2 * L * rc_frac), ("reduce_scatter", L * rc_frac)]
        if problem.sp_sharded(lay) and not op_selective and rc_frac < 1:
            # cluster.sp_saved_input = "sharded": the blocks not recomputed gather their two norm outputs
            # again for the weight gradients, beside the input-gradient GEMMs (plan/cost.py: hidden)
            out.append(Collective("tp", "all_gather", per_layer * act, 2 * L * (1 - rc_frac) * m, "bwd", "sp_regather"))
    else:
        out += [Collective("tp", "all_reduce", per_layer * act, 2 * L * m, "fwd", "act"),
                Collective("tp", "all_reduce", per_layer * act, 2 * L * m, "bwd", "act")]
        replay = [("all_reduce", L * rc_frac)]
    for kind, calls in replay:
        if calls:
            elem = gather_bwd if kind == "all_gather" else act
            out.append(Collective("tp", kind, per_layer * elem, calls * m, "recompute", "act"))
    if rank.embedding:
        out.append(Collective("tp", "reduce_scatter" if lay.sp else "all_reduce", per_layer * res, m, "fwd", "embed"))
        if lay.sp:
            out.append(Collective("tp", "all_gather", per_layer * res, m, "bwd", "embed"))
            if shape.arch == "gpt":  # the learned position table's (s, h) output is cut along s
                out.append(Collective("tp", "all_gather", problem.seq_len * shape.dim * 4, m, "bwd", "positions"))
    if rank.head:
        if lay.sp:
            out.append(Collective("tp", "all_gather", per_layer * res, m, "fwd", "head"))
        out.append(Collective("tp", "reduce_scatter" if lay.sp else "all_reduce", per_layer * res, m, "bwd", "head"))
        out.append(Collective("tp", "all_reduce", tokens * 4, 3 * m, "fwd", "loss_parallel"))
    # Partial gradients of replicated weights: per micro-batch with TP alone (parallel/tensor.py
    # align_gradients_with_parameters, a hook per accumulation); once per step when FSDP2 or its
    # replicate own the gradients (every zero stage with dp > 1, measured) — except ZeRO-3 without PP,
    # whose reduce-scatter (and this all-reduce with it) runs after every micro-batch (measured on
    # tp2 x zero3 dp2 with 2 micro-batches: one sync per micro-batch).
    syncs = m if lay.fsdp and lay.zero == 3 and lay.pp == 1 else 1 if lay.dp > 1 else m
    norm_params = (2 if shape.arch == "gpt" else 1) * shape.dim
    partial = (2 * L + (1 if rank.head else 0)) * norm_params if lay.sp else 0
    if lay.tp > shape.n_kv_heads:
        partial += 2 * L * shape.kv_dim * (shape.dim + (1 if shape.arch == "gpt" else 0))
    if rank.moe_layers and shape.moe is not None:
        # MoE blocks (parallel/tensor.py MoERegion) are one TP region each, with the dense MLP's
        # entry / exit collectives (counted above); the replicated router's gradient is Partial over
        # tp (the combine weights multiply partial expert outputs), as is gpt's shared-expert output bias.
        shared_bias = shape.dim if shape.arch == "gpt" and shape.moe.num_shared_experts else 0
        partial += rank.moe_layers * (shape.moe.num_experts * shape.dim + shared_bias)
    if partial:
        # In the dtype the gradient has when it is reduced: fp32 once FSDP2 / replicate summed m > 1
        # micro-batches into its fp32 accumulator (one sync), else the micro-batch's own, 16-bit under
        # 16-bit parameters (`res`; measured: tp2 x zero3 dp2 bf16, and zero1 / zero2 with one micro-batch).
        grad = 4 if syncs == 1 and m > 1 else res
        out.append(Collective("tp", "all_reduce", partial * grad, syncs, "grad", "partial_grads"))
    # Gradient clipping: one 4-byte all_reduce of each gradient's Partial norm, per parameter tensor.
    out.append(Collective("tp", "all_reduce", 4.0, param_tensors(shape, rank), "step", "grad_norm"))
    return out


def _tp2d_collectives(problem: Problem, lay: Layout, rank: RankModel, grad_bytes: int, rc_frac: float,
                      m: int) -> list[Collective]:
    """2-D TP (parallel/tensor2d.py, SUMMA on the q x q grid): plan/tp2d.py comm_bytes_per_step's
    payload per grid axis ("tp_col": a grid row, activations; "tp_row": a grid column, weights) and
    kind, for this pipeline rank's blocks / embedding / head, as Collectives whose calls x payload are
    those bytes exactly (the calls, summa_calls, give the latency term; a call's payload is the mean).
    SUMMA moves X, W, dX and dW blocks in the compute dtype; the norms' and embedding's weight
    gradients in the parameters' (`grad_bytes`). Recomputed blocks (rc_frac) broadcast their forward
    again (tp2d.recompute_bytes_per_step)."""
    s, L, act = problem.shape, rank.layers, problem.compute_bytes
    total = comm_bytes_per_step(s, lay.tp, lay.micro_batch, problem.seq_len, m, act, act, grad_bytes,
                                L, rank.embedding, rank.head)
    calls = summa_calls(s, lay.tp, L, rank.head)
    norms, tensors = 2 * L + (1 if rank.head else 0), param_tensors(s, rank)
    out: list[Collective] = []
    for axis in ("tp_col", "tp_row"):
        for kind in ("broadcast", "reduce"):
            n = calls[axis][kind] * m
            if total[axis][kind] and kind == "broadcast":  # forward and backward, half each
                out += [Collective(axis, kind, total[axis][kind] / n, n / 2, phase, "summa") for phase in ("fwd", "bwd")]
            elif total[axis][kind]:
                out.append(Collective(axis, kind, total[axis][kind] / n, n, "bwd", "summa"))
        # Per micro-batch: the row's norm sums (forward and backward) and the loss's 3; the column's norm
        # and embedding weight gradients and the loss scalar. Once per step: the gradient norm, 4 B per tensor.
        grad_norm = 4.0 * tensors
        n_ar = m * ((2 * norms + (3 if rank.head else 0)) if axis == "tp_col" else
                    (norms + (1 if rank.embedding else 0) + (1 if rank.head else 0)))
        if n_ar:
            out.append(Collective(axis, "all_reduce", (total[axis]["all_reduce"] - grad_norm) / n_ar, n_ar, "fwd", "norms"))
        out.append(Collective(axis, "all_reduce", 4.0, tensors, "step", "grad_norm"))
    if rc_frac and L:
        rc = recompute_bytes_per_step(s, lay.tp, lay.micro_batch, problem.seq_len, m, L * rc_frac, act, act)
        for axis, kinds in rc.items():
            for kind, b in kinds.items():
                per_block = grid_q(lay.tp) * (4 if axis == "tp_col" else 7) if kind == "broadcast" else 2  # calls / block
                n = per_block * L * m * rc_frac
                out.append(Collective(axis, kind, b / n, n, "recompute", "summa"))
    return out


def counted_axis(axis: str, lay: Layout) -> str:
    """The name the trainer's counter gives the group of `axis`: a flattened CP view with one
    non-trivial member axis is that axis's own process group (parallel/mesh.py build_meshes), and with
    dp_replicate = 1 the gradient view dp_cp is the sharding view dp_shard_cp."""
    if axis == "dp_cp" and lay.dp_replicate == 1:
        axis = "dp_shard_cp"
    if axis == "dp_shard_cp" and lay.dp_shard == 1:
        axis = "cp"
    return axis


def predict_comm_bytes(cfg: Any, dims: Any = None, rank: int = 0) -> dict[str, dict[str, int]]:
    """Payload bytes per mesh axis and collective kind that `rank` moves in one optimizer step.

    `cfg` is a resolved Config; `dims` a ParallelDims (or None: the layout of `cfg.parallel` on
    `cfg.cluster.num_gpus`). The pipeline rank of `rank` follows the mesh order (pp outermost).
    Example: DDP over 2 ranks of the tiny preset in fp32 -> {"dp_replicate": {"all_reduce": 4 x
    params + 4}}. Axes / kinds with no traffic are absent.
    """
    from dataclasses import replace as _replace

    world = dims.world_size if dims is not None else cfg.cluster.num_gpus
    cluster_cfg = _replace(cfg.cluster, num_gpus=world, gpus_per_node=max(1, min(cfg.cluster.gpus_per_node, world)))
    problem = Problem.from_config(_replace(cfg, cluster=cluster_cfg))
    lay = Layout.from_config(cfg, world)
    if dims is not None:
        lay = lay.with_(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp, pp=dims.pp, ep=dims.ep)
    pp_rank = rank // (world // lay.pp)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in collectives(problem, lay, pp_rank=pp_rank):
        if c.total > 0:
            totals[counted_axis(c.axis, lay)][c.kind] += c.total
    return {axis: {kind: int(round(v)) for kind, v in kinds.items()} for axis, kinds in totals.items()}
