"""Pipeline stages without torch: which blocks each stage runs and which rank runs it, and the
pre-flight checks of a pipeline layout (imported by preflight, which must not import torch).

Stages. The model's L blocks are cut into S = pp x v contiguous stages (v = virtual stages per rank),
the embedding on stage 0 and final norm + head on stage S-1. Three ways to cut:
  even      — L/S blocks per stage, the first L mod S stages one more;
  explicit  — parallel.pp_layers_per_stage = [n_0, ..., n_{S-1}];
  balanced  — contiguous chunks minimizing the slowest stage's time, where a stage's time is the cost
              of its blocks (+ embedding / head, from Transformer.pipeline_costs) divided by the speed
              of the rank it runs on (parallel.pp_stage_speeds, for heterogeneous clusters).
Placement: rank r holds stages r, r + pp, ... (looped, Narayanan et al. 2021 §2.2), or r and
2pp-1-r for the V-shaped schedules (ZBV, DualPipeV: Qi et al. 2024, arXiv 2401.10241; DeepSeek-V3,
arXiv 2412.19437 §3.2.1), which put the embedding and the head on the same rank.
"""
from __future__ import annotations

from shardwise.config import ModelConfig, ParallelConfig
from shardwise.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Schedules whose two stages per rank are placed in a V (r and 2pp-1-r); the others loop (r, r + pp, ...).
V_SHAPED = ("zbv", "dualpipev")
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules that split backward into an input-gradient and a later weight-gradient pass.
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")


def stage_ids(schedule: str, pp: int, v: int, pp_rank: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline axis runs, in execution order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]


def stage_rank(schedule: str, pp: int, v: int, stage: int) -> int:
    return next(r for r in range(pp) if stage in stage_ids(schedule, pp, v, r))


def even_split(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def balanced_split(costs: dict[str, float], n_layers: int, speeds: list[float]) -> list[int]:
    """Blocks per stage minimizing max over stages of (stage cost / its rank's speed), every stage at
    least one block: the linear-partition dynamic programme, O(S L^2), exact."""
    n_stages = len(speeds)

    def cost(stage: int, first: int, end: int) -> float:
        c = (end - first) * costs["block"]
        c += costs["embedding"] if stage == 0 else 0.0
        c += costs["head"] if stage == n_stages - 1 else 0.0
        return c / speeds[stage]

    inf = float("inf")
    # best[s][l]: the smallest max-time of stages 0..s-1 covering blocks 0..l-1
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for end in range(s, n_layers - (n_stages - s) + 1):
            for first in range(s - 1, end):
                value = max(best[s - 1][first], cost(s - 1, first, end))
                if value < best[s][end]:
                    best[s][end], cut[s][end] = value, first
    counts, end = [], n_layers
    for s in range(n_stages, 0, -1):
        first = cut[s][end]
        counts.append(end - first)
        end = first
    return counts[::-1]


def layers_per_stage(p: ParallelConfig, model: ModelConfig, seq_len: int, costs: dict[str, float]) -> list[int]:
    """Blocks per stage (stage order) for the configured split; preflight has validated the inputs."""
    v = p.pp_virtual_stages
    n_stages = p.pp * v
    if p.pp_layers_per_stage:
        return list(p.pp_layers_per_stage)
    if p.pp_split == "balanced":
        rank_speeds = p.pp_stage_speeds or [1.0] * p.pp
        speeds = [rank_speeds[stage_rank(p.pp_schedule, p.pp, v, s)] for s in range(n_stages)]
        return balanced_split(costs, model.n_layers, speeds)
    return even_split(model.n_layers, n_stages)


def stage_layers(counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_pipeline(p: ParallelConfig, model: ModelConfig, microbatches: int, recompute: str = "none",
                   recompute_policy: str = "op") -> None:
    """Refuse a pipeline layout that cannot run, would hang or would train wrongly, before anything is spawned."""
    if p.pp == 1:
        return
    v, s = p.pp_virtual_stages, p.pp_schedule
    for refusal in (split_backward_refusal(s, p.zero, recompute, recompute_policy), virtual_stage_refusal(s, v)):
        if refusal is not None:
            raise ConfigError(*refusal[1:])
    n_stages = p.pp * v
    if p.pp_layers_per_stage:
        counts = p.pp_layers_per_stage
        if p.pp_split == "balanced":
            raise ConfigError("parallel.pp_layers_per_stage", "an explicit split and pp_split=balanced were both given",
                              "drop one of them")
        if len(counts) != n_stages or sum(counts) != model.n_layers or min(counts) < 1:
            raise ConfigError("parallel.pp_layers_per_stage",
                              f"{list(counts)} must give each of pp x pp_virtual_stages = {n_stages} stages at least one "
                              f"block and sum to model.n_layers = {model.n_layers}",
                              f"e.g. {even_split(model.n_layers, n_stages)}" if model.n_layers >= n_stages else
                              "use fewer stages")
    if model.n_layers < n_stages:
        raise ConfigError("parallel.pp", f"pp({p.pp}) x pp_virtual_stages({v}) = {n_stages} stages, but the model has "
                          f"only {model.n_layers} blocks", "use fewer stages or a deeper model")
    if p.pp_stage_speeds:
        if p.pp_split != "balanced":
            raise ConfigError("parallel.pp_stage_speeds", "stage speeds are used by the cost-balanced split only",
                              'set parallel.pp_split="balanced" or drop pp_stage_speeds')
        if len(p.pp_stage_speeds) != p.pp or min(p.pp_stage_speeds) <= 0:
            raise ConfigError("parallel.pp_stage_speeds", f"{list(p.pp_stage_speeds)} must give one positive relative "
                              f"speed per pipeline rank ({p.pp})", f"e.g. {[1.0] * p.pp}")
    refusal = microbatch_refusal(s, p.pp, microbatches)
    if refusal is not None:
        raise ConfigError(*refusal[1:])


# The rules below return (reason, field, problem, fix) or None. Pre-flight raises them as a ConfigError;
# the planner (plan/layout.py) prunes with them and counts `reason`, so both refuse the same layouts.
Refusal = tuple[str, str, str, str]


def virtual_stage_refusal(schedule: str, v: int) -> Refusal | None:
    """`schedule` cannot run `v` stages per pipeline rank."""
    if schedule in SINGLE_STAGE and v != 1:
        return ("schedule", "parallel.pp_virtual_stages", f"{schedule} runs one stage per rank, got pp_virtual_stages={v}",
                "set parallel.pp_virtual_stages=1, or use interleaved_1f1b / zero_bubble")
    if schedule == "interleaved_1f1b" and v < 2:
        return ("schedule", "parallel.pp_virtual_stages", "interleaved_1f1b needs pp_virtual_stages >= 2",
                "set parallel.pp_virtual_stages=2 (or use 1f1b)")
    if schedule in V_SHAPED and v != 2:
        return ("schedule", "parallel.pp_virtual_stages", f"{schedule} runs two (V-shaped) stages per rank, got {v}",
                "set parallel.pp_virtual_stages=2")
    return None


def microbatch_refusal(schedule: str, pp: int, m: int) -> Refusal | None:
    """The schedules' own requirements on the micro-batches per step (torch.distributed.pipelining),
    checked before spawning rather than discovered as an exception (or a hang) on every rank."""
    if pp == 1:
        return None
    if schedule != "gpipe" and m < pp:
        return ("microbatches < pp", "train.micro_batch", f"{schedule} needs at least pp({pp}) micro-batches per step, "
                f"got {m}", "lower train.micro_batch or raise train.global_batch")
    if schedule == "dualpipev" and m < 2 * pp:
        return ("microbatches < 2pp", "train.micro_batch", f"dualpipev needs at least 2 x pp = {2 * pp} micro-batches, "
                f"got {m}", "lower train.micro_batch or raise train.global_batch")
    rounds = max(1, m // pp)
    if schedule in ("interleaved_1f1b", "zero_bubble") and m % rounds:
        return ("microbatches % rounds", "train.micro_batch", f"{schedule} runs micro-batches in rounds of pp({pp}); "
                f"{m} micro-batches is not a multiple of its {rounds} rounds",
                f"use a multiple of pp({pp}) micro-batches per step")
    return None


def stage_of_parameter(name: str, layers: list[list[int]]) -> int:
    """The stage holding whole-model parameter `name`: blocks by index, the head (norm, output) on
    the last stage, embeddings on the first."""
    parts = name.split(".")
    if parts[0] == "layers":
        block = int(parts[1])
        return next(s for s, ids in enumerate(layers) if block in ids)
    if parts[0] in ("norm", "output"):
        return len(layers) - 1
    return 0


def split_backward_refusal(schedule: str, zero: int, recompute: str, recompute_policy: str) -> Refusal | None:
    """A refusal when a split-backward schedule meets a feature that breaks it (torch 2.13,
    found by the parity tests): with ZeRO-3 the weight-gradient pass misses parameters FSDP2 resharded
    after forward (some blocks get no gradient at all); per-op selective recompute allows one backward
    through a checkpointed region and the split runs two."""
    if schedule not in SPLIT_BACKWARD:
        return None
    if zero == 3:
        return ("split backward", "parallel.zero", f"{schedule} computes weight gradients in a separate pass, which misses parameters "
                "ZeRO-3 reshards after forward (wrong gradients)", "use parallel.zero=2 (under a pipeline schedule it "
                "holds the same memory as ZeRO-3) or zero=1, or the 1f1b / interleaved_1f1b schedule")
    if recompute == "selective" and recompute_policy == "op":
        return ("split backward", "train.recompute_policy", f"{schedule} runs backward twice through each block (input, then weight "
                "gradients); per-op selective recompute allows only one", 'use train.recompute="full" or '
                'train.recompute_policy="layer", or the 1f1b / interleaved_1f1b schedule')
    return None
