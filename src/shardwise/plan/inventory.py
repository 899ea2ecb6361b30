"""What one rank holds: which layers (pipeline), which parameters with which local shapes (tensor /
expert parallel), and how FSDP2 pads and groups them into units — the per-rank inventory that
plan/memory.py prices in bytes and plan/comm.py in collectives.

Pipeline: the layers are cut into pp x v contiguous stages (uneven counts: the first get one more)
and rank r runs stages r, r + pp, ... (looped / interleaved, Narayanan et al. 2021, arXiv 2104.04473
§2.2) or r and 2pp-1-r for the V-shaped schedules — spec/stages.py even_split / stage_ids.
Tensor / expert parallel: the local shard of each parameter as parallel/tensor.py and
parallel/expert.py cut it (`local_shape`). FSDP2 (FSDPParam): each parameter's dim 0 padded to a
multiple of its shard group and split (`fsdp_shard_numel`); one unit per block, one root unit
(embedding, final norm, head), and under EP one per MoE block's stacked experts (`fsdp_units`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from shardwise.plan.tp2d import grid_q
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape, ParamSpec
from shardwise.spec.stages import V_SHAPED, even_split


@dataclass(frozen=True)
class RankModel:
    """The share of the model one pipeline rank holds: its dense and MoE blocks, and whether it has
    the embedding (first stage) and the output head (last stage)."""

    dense_layers: int
    moe_layers: int
    embedding: bool
    head: bool

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers


def owned_chunks(schedule: str, pp: int, chunks: int, r: int) -> list[int]:
    """The stages (chunks) pipeline rank r runs: r, r + pp, ... (looped / interleaved, Narayanan et al.
    2021 §2.2), or r and 2pp-1-r for the V-shaped schedules (zbv, dualpipev), which put the embedding
    and the head both on rank 0 — spec/stages.py stage_ids."""
    if schedule in V_SHAPED and chunks == 2:
        return [r, 2 * pp - 1 - r]
    return list(range(r, pp * chunks, pp))


@lru_cache(maxsize=4096)
def pipeline_rank(shape: ModelShape, pp: int, chunks: int, schedule: str, r: int, split: tuple[int, ...] = ()
                  ) -> RankModel:
    """What pipeline rank r holds. Layers are cut into pp x chunks contiguous chunks of `split` blocks each
    (the trainer's own split, Layout.stage_layers), or evenly (uneven counts: the first chunks get one
    more, spec/stages.py even_split)."""
    stages = [stage_model(shape, pp * chunks, c, split) for c in owned_chunks(schedule, pp, chunks, r)]
    return RankModel(sum(s.dense_layers for s in stages), sum(s.moe_layers for s in stages),
                     any(s.embedding for s in stages), any(s.head for s in stages))


@lru_cache(maxsize=4096)
def pipeline_ranks(shape: ModelShape, pp: int, chunks: int, schedule: str) -> tuple[RankModel, RankModel]:
    """(first rank, last rank) of the pipeline under the even split, the two the planner sizes there (see
    `pipeline_rank`; every rank under the trainer's own split: `sized_ranks`)."""
    return pipeline_rank(shape, pp, chunks, schedule, 0), pipeline_rank(shape, pp, chunks, schedule, pp - 1)


def stage_model(shape: ModelShape, n_stages: int, s: int, split: tuple[int, ...] = ()) -> RankModel:
    """What stage s of n_stages holds on its own: the planner's per-stage times where a split makes the
    stages of one rank unequal (plan/cost.py step)."""
    sizes = split or even_split(shape.n_layers, n_stages)
    start = sum(sizes[:s])
    moe = sum(shape.is_moe_layer(i) for i in range(start, start + sizes[s]))
    return RankModel(sizes[s] - moe, moe, s == 0, s == n_stages - 1)


def priced_layout(shape: ModelShape, lay: Layout) -> Layout:
    """`lay` as the planner prices it rank by rank (every rank sized; the bubble from every rank's times,
    plan/cost.py _split_bubbles; the orders of the schedules with several stages a rank walked stage by stage,
    plan/memory.py rank_memory): with the trainer's own split, and also with an even split that is uneven.
    Its first stages hold one block more, which the closed forms of the first and the last rank misprice:
    - interleaved 1F1B, zero bubble, ZB-V and DualPipeV over several stages a rank: the rank's stages differ,
      and at their average in flight a CPU run (pp2 x 2 stages, 6 blocks as [2, 2, 1, 1],
      tests/dist/test_plan_validation.py) had 16.0% / 12.7% more activations than planned (now exact); Llama 3
      8B pp8 x 3 stages: peak -8.2%; Llama 3 405B over pp32 x 2 ([2]*62 + [1]*2): DualPipeV's bubble 0 s against
      its order's 0.756 s;
    - GPipe and 1F1B: every heavier rank waits on the others, not the first alone (rank_bubble): Llama 3 405B,
      126 blocks over pp32 as [4]*30 + [3]*2, 1F1B: bubble 1.550 s against the replayed order's 1.929 s, the
      step 5.9% fast (now the replay's, looped_bubbles); 8B pp6: bubble +11%.
    - zero bubble with one stage a rank: its order's bubble, which rank_bubble put 0.6% (405B pp16) to 2.3%
      (pp64) fast.
    The explicit split gives the same RankModels as the even one (pipeline_rank); an even split of
    whole stages keeps the closed forms, exact there."""
    n = lay.pp * lay.chunks_per_rank
    uneven = lay.pp > 1 and n <= shape.n_layers and shape.n_layers % n != 0
    if lay.stage_layers or not uneven:
        return lay
    return lay.with_(stage_layers=tuple(even_split(shape.n_layers, n)))


def sized_ranks(shape: ModelShape, lay: Layout) -> list[tuple[int, RankModel]]:
    """(pipeline rank, what it holds) of every rank the planner prices: with the even split the first and
    the last (a middle rank holds the first's blocks or one fewer, without the embedding: never more); with
    the trainer's own split (Layout.stage_layers) every rank, since any of them can be the heaviest."""
    if lay.pp == 1:
        return [(0, pipeline_rank(shape, 1, 1, lay.schedule, 0))]
    ranks = range(lay.pp) if lay.stage_layers else (0, lay.pp - 1)
    return [(r, pipeline_rank(shape, lay.pp, lay.chunks_per_rank, lay.schedule, r, lay.stage_layers)) for r in ranks]


@lru_cache(maxsize=1 << 14)
def rank_params(shape: ModelShape, rank: RankModel) -> tuple[tuple[ParamSpec, int, bool], ...]:
    """(parameter, copies on this rank, in a block) for every parameter `rank` holds, in the model's
    order: embedding, dense blocks, MoE blocks, final norm and head. The order is the trainer's
    parameter order, which ZeRO-1's greedy partition depends on (spec/sharding.py zero1_owners)."""
    out: list[tuple[ParamSpec, int, bool]] = []
    if rank.embedding:
        out += [(p, 1, False) for p in shape.embedding_params()]
    if rank.dense_layers:
        out += [(p, rank.dense_layers, True) for p in shape.block_params(False)]
    if rank.moe_layers:
        out += [(p, rank.moe_layers, True) for p in shape.block_params(True)]
    if rank.head:
        out += [(p, 1, False) for p in shape.head_params()]
    return tuple(out)


def local_shape(spec: ParamSpec, shape: ModelShape, tp: int, ep: int, tp_mode: str = "1d") -> tuple[int, ...]:
    """The tensor-/expert-parallel local shape of one parameter (before data-parallel sharding)."""
    s = spec.shape
    if tp_mode == "2d" and tp > 1 and spec.tp != "expert":
        return local_shape_2d(spec, tp)
    if spec.tp == "col":
        if spec.name.endswith(("wk.weight", "wv.weight", "wk.bias", "wv.bias")) and tp > shape.n_kv_heads:
            return s  # all KV heads, replicated (parallel/tensor.py ReplicatedKVColwise keeps the whole weight)
        return (math.ceil(s[0] / tp),) + s[1:]
    if spec.tp == "row":
        return (s[0], math.ceil(s[1] / tp))
    if spec.tp == "vocab":
        return (math.ceil(s[0] / tp), s[1])
    if spec.tp == "expert":  # (E, out, in): experts over ep, the ffn dimension over tp
        e, d1, d2 = s
        return (e // ep, math.ceil(d1 / tp), d2) if d1 != shape.dim else (e // ep, d1, math.ceil(d2 / tp))
    return s


def local_shape_2d(spec: ParamSpec, tp: int) -> tuple[int, ...]:
    """parallel/tensor2d.py's local block on the q x q grid (DTensor splits: the first ranks get
    ceil(dim / q)): a linear or the head (out, in) split q ways on both dims (q^2 blocks), the token
    embedding (V, h) by hidden columns only (replicated over the grid rows: V·h/q per rank), a norm's
    (h,) weight by columns (plan/tp2d.py param_elements_2d)."""
    q, s = grid_q(tp), spec.shape
    if len(s) == 1:
        return (math.ceil(s[0] / q),)
    if spec.tp == "vocab" and spec.name.startswith("tok_embeddings"):
        return (s[0], math.ceil(s[1] / q))
    return (math.ceil(s[0] / q), math.ceil(s[1] / q)) + s[2:]


def numel(s: tuple[int, ...]) -> int:
    """Elements of a tensor of shape `s`."""
    n = 1
    for d in s:
        n *= d
    return n


def fsdp_shard_numel(s: tuple[int, ...], n: int, expert: bool) -> int:
    """Elements of one rank's FSDP2 shard of a (local) tensor of shape `s` over n ranks: FSDP2 pads
    dim 0 to a multiple of n; stacked experts (`expert`) with fewer local experts than shards are cut on
    dim 1 instead where it divides (parallel/expert.py expert_placement, torchtitan's rule)."""
    if expert and len(s) == 3 and s[0] < n and s[1] % n == 0:
        return s[0] * math.ceil(s[1] / n) * s[2]
    return math.ceil(s[0] / n) * numel(s[1:]) if s else 1


@lru_cache(maxsize=1 << 14)
def param_tensors(shape: ModelShape, rank: RankModel, experts: bool | None = None) -> int:
    """Parameter tensors on this rank (each gets its own gradient-norm reduction, plan/comm.py); only
    the stacked expert weights (experts=True) or all but them (False)."""
    return sum(copies for p, copies, _ in rank_params(shape, rank) if experts is None or (p.tp == "expert") == experts)


class FsdpUnits(NamedTuple):
    """Numel of one rank's FSDP units, TP-local: `blk` (all its blocks) / `root` unsharded and `*_pad`
    padded to FSDP's shard multiple; `exp` / `exp_pad` the stacked experts of its MoE blocks under
    expert parallelism (E/ep local experts each), which are not in the dense block units (see
    `fsdp_units`)."""

    blk: float
    root: float
    blk_pad: float
    root_pad: float
    exp: float = 0.0
    exp_pad: float = 0.0


@lru_cache(maxsize=1 << 14)
def fsdp_units(shape: ModelShape, tp: int, ep: int, n: int, rank: RankModel, tp_mode: str = "1d") -> FsdpUnits:
    """The FSDP units of `rank` sharded over n = dp_shard x cp ranks. Without EP the stacked experts
    are ordinary block parameters (padded over the n shard ranks like any other). With ep > 1
    parallel/expert.py takes them out of the dense units: with efsdp = n / ep == 1 FSDP ignores them
    (each ep rank owns its E/ep experts, nothing to gather or reduce-scatter), with efsdp > 1 each MoE
    block's experts module is an FSDP2 unit of its own over the expert mesh's efsdp axis
    (shard_experts). FSDP2 shards dim 0, padded to ceil(d0 / group) x group rows, except stacked
    experts with fewer local experts than efsdp ranks, which it shards on dim 1 (parallel/expert.py
    expert_placement)."""
    efsdp = max(1, n // ep)
    blk = blk_pad = root = root_pad = exp = exp_pad = 0.0
    for spec, repeat, in_block in rank_params(shape, rank):
        ls = local_shape(spec, shape, tp, ep, tp_mode)
        expert_unit = spec.tp == "expert" and ep > 1
        group = efsdp if expert_unit else n
        full, pad = numel(ls) * repeat, fsdp_shard_numel(ls, group, expert_unit) * group * repeat
        if expert_unit:
            exp, exp_pad = exp + full, exp_pad + (pad if efsdp > 1 else 0.0)
        elif in_block:
            blk, blk_pad = blk + full, blk_pad + pad
        else:
            root, root_pad = root + full, root_pad + pad
    return FsdpUnits(blk, root, blk_pad, root_pad, exp, exp_pad)
