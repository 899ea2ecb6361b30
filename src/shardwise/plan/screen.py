"""The search's screens (plan/search.py): cheap bounds and shortcuts of plan/memory.py's numbers, for the
hundreds of thousands of candidates it looks at; the layouts it shows are priced by memory.py itself."""
from __future__ import annotations

from shardwise.plan.inflight import head_bytes_held, inflight_microbatches
from shardwise.plan.inventory import pipeline_ranks
from shardwise.plan.layout import Problem
from shardwise.plan.memory import end_rank_states, grid2d, microbatch_activations, stages_with_layers, states_and_other, stored_activations
from shardwise.spec.layout import Layout


def peak_bytes(problem: Problem, core: Layout, schedule: str, v: int) -> float:
    """Total bytes of the most loaded pipeline rank of `core` run with `schedule` / `v` virtual stages: the
    number memory.py's `memory(...).total` gives, without building the breakdown. An even split that
    inventory.py priced_layout prices stage by stage is screened at the rank's average instead: walking every
    rank's order there took the 405B search with --allow-uneven-pp from 3 s to 153 s."""
    chunks = v if core.pp > 1 else 1
    first, last = pipeline_ranks(problem.shape, core.pp, chunks, schedule)
    m = core.accumulation(problem)
    best = 0.0
    for rank, is_first in ((first, True), (last, False)) if core.pp > 1 else ((first, True),):
        params, grads, opt, other = states_and_other(problem, core, rank)[:4]
        blocks, embedding, head, rope, working = microbatch_activations(problem, core, rank)
        inflight = inflight_microbatches(schedule, core.pp, m, chunks, is_first)
        head_held = head_bytes_held(problem, core, rank, head, schedule, core.pp, m, chunks, grid2d(core))
        stored = stored_activations(blocks, embedding * inflight, head_held, rope, inflight, stages_with_layers(rank, chunks))
        best = max(best, params + grads + opt + other + stored + working)
    return best


def states_lower_bound(problem: Problem, core: Layout) -> float:
    """Bytes that no micro-batch, schedule or recompute choice can remove (the micro-batch-1 core's
    model states and buffers on its most loaded rank): above the capacity, the whole structure is out."""
    return max(sum(states[:4]) for states in end_rank_states(problem, core))


def host_bytes(problem: Problem, core: Layout) -> float:
    """Host memory the most loaded rank's offloaded states take (0 without offload): what the search
    holds against Cluster.host_memory_bytes to choose between "cpu" and "nvme"."""
    if not core.offload:
        return 0.0
    return max(states[4] for states in end_rank_states(problem, core))
