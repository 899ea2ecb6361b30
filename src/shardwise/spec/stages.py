"""Pipeline stages without torch: which blocks each stage runs and which rank runs it, and the
schedule names (the rules a pipeline layout must obey are in spec/rules.py).

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

from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Schedules whose two stages per rank are placed in a V (r and 2pp-1-r); the others loop (r, r + pp, ...).
V_SHAPED = ("zbv", "dualpipev")
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules whose action orders `looped_order` writes out as torch's: the planner replays them under a split.
WRITTEN_OUT = ("interleaved_1f1b", "zero_bubble", *V_SHAPED)
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


def layers_per_stage(p: Any, model: Any, seq_len: int, costs: dict[str, float]) -> list[int]:
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


def trainer_split(p: Any, model: Any, seq_len: int) -> tuple[int, ...]:
    """The blocks per stage the trainer cuts (`layers_per_stage`) where they are not the even split, for
    the planner to price (spec/layout.py Layout.stage_layers); () for an even split, and where the split
    asked for is malformed (pipeline_split_rules refuses it before anything is priced)."""
    n_stages = p.pp * p.pp_virtual_stages
    if p.pp == 1 or not (p.pp_layers_per_stage or p.pp_split == "balanced"):
        return ()
    if p.pp_layers_per_stage:
        counts = list(p.pp_layers_per_stage)
        if len(counts) != n_stages or sum(counts) != model.n_layers or min(counts) < 1:
            return ()
    else:
        if (p.pp_stage_speeds and len(p.pp_stage_speeds) != p.pp) or model.n_layers < n_stages:
            return ()
        from shardwise.spec.shapes import ModelShape

        counts = layers_per_stage(p, model, seq_len, ModelShape.from_config(model).pipeline_costs(seq_len))
    return () if counts == even_split(model.n_layers, n_stages) else tuple(counts)


def stage_layers(counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


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


def bubble_seconds(schedule: str, p: int, v: int, m: int, t_f: float, t_b: float) -> float:
    """Idle seconds a pipeline rank adds to a step of m micro-batches beyond its m (t_f + t_b) of work
    (t_f, t_b: its forward and backward of one micro-batch, all its stages; the split backward's input
    and weight passes t_b/2 each): the makespan of the action order torch.distributed.pipelining runs for
    `schedule`, with every action on a rank back to back once what it needs has arrived (no
    communication time: plan/cost.py prices the sends). Each form is that order's makespan, checked
    against a replay of torch's own orders (tests/unit/test_pipeline_orders.py: p = 2-8 with every legal m,
    p = 16 and 32 with a few; t_b/t_f = 0.5-4):
      gpipe, 1f1b        (p-1)(t_f + t_b)                                   (Narayanan et al. 2021 §2.2)
      interleaved_1f1b   (p-1)(t_f + t_b)/v                                (ibid. §2.2.2)
      zero_bubble        (p-1) max(t_f, t_b/2)/v: ZB-H1's (p-1)(T_F + T_B - T_W) (Qi et al. 2024, arXiv
                         2401.10241 §2.1) while the input pass is no longer than the forward; beyond that
                         (recompute puts a forward into it) the input passes set the pace
      zbv                max((p-1) max(t_b/4, t_f - t_b/4), (2p-1-m) t_b/2): torch's ZB-V order idles a
                         chunk's input pass per rank, (p-1) t_b/4, not the paper's (p-1)(T_F + T_B - 2T_W)
                         (0 when T_F = T_B = T_W, §6); below 2p micro-batches the V is not full. Exact for
                         t_b >= 2 t_f (a block's backward runs two GEMMs per forward one); below that
                         within (p-1) t_f/4 of the order's makespan
      dualpipev          max((p-1) max(t_f/2, t_f - t_b/2), (p-1) t_b/4 - t_f/2), m >= 2p (spec/rules.py):
                         torch's DualPipeV order, its overlapped forward-backward pairs run one after the
                         other as torch's runtime does (each waits for its own input); not DeepSeek-V3's
                         bidirectional DualPipe ((p/2-1)(F&B + B - 3W), arXiv 2412.19437 Table 2), whose
                         two pipelines start from both ends at once"""
    if p == 1:
        return 0.0
    if schedule == "interleaved_1f1b":
        return (p - 1) * (t_f + t_b) / v
    if schedule == "zero_bubble":
        return (p - 1) * max(t_f, t_b / 2) / v
    if schedule == "zbv":
        return max((p - 1) * max(t_b / 4, t_f - t_b / 4), (2 * p - 1 - m) * t_b / 2)
    if schedule == "dualpipev":
        return max((p - 1) * max(t_f / 2, t_f - t_b / 2), (p - 1) * t_b / 4 - t_f / 2)
    return (p - 1) * (t_f + t_b)


def rank_bubble(schedule: str, p: int, v: int, m: int, light: tuple[float, float], own: tuple[float, float],
                first: bool = False) -> float:
    """The idle of a rank whose micro-batch takes `own` (t_f, t_b) in a pipeline whose lighter ranks take
    `light`: its step is m (t_f + t_b) of its own + this. The warm-up and cool-down cross the other
    stages, so a heavier rank (the head and the loss on a looped schedule's last, both ends on a V's
    first) idles `bubble_seconds` at the lighter ranks' times, less what its own extra work
    e = m x (its t_f + t_b - the lighter's) fills:
      GPipe, interleaved nothing: exactly the lighter ranks' bubble
      1F1B               a heavier last rank nothing; a heavier first rank (`first`; an uneven split,
                         pp_layers_per_stage) waits only where a round trip through the lighter stages
                         outlasts its own passes: (p-1) [max(0, t_f + t_b - F) + max(0, t_f + t_b - B)] with
                         (F, B) its own times, once for its first backward (after its p forwards) and once
                         for its last (after its p-1 cool-down backwards); after the first, the heavier rank
                         sets the pace and nothing waits
      zero_bubble        down to (p-1) t_f/v: the input passes' pacing beyond the forward's is filled
      dualpipev          all of it, max(0, bubble - e)
      zbv                its head chunk's input pass (own t_b/2 - light t_b/4) at most, with the V full
                         (m >= 2p); below, down to the full V's (p-1) max(t_b/4, t_f - t_b/4)
    Checked against the replay of torch's orders with the head's stage 1.05-2x the others
    (tests/unit/test_pipeline_orders.py): exact for 1F1B, GPipe and interleaved, within 1.1% for the others,
    ZB-V below 2p micro-batches -2% to +8%; a heavier first rank 1-3x exact for 1F1B and GPipe. Not
    modelled: interleaved 1F1B's heavier first rank also fills part of its idle (piecewise in m, v and the
    weight: no one form fitted the replay); priced here at the lighter ranks' bubble, up to 15% slow."""
    base = bubble_seconds(schedule, p, v, m, *light)
    extra = m * (sum(own) - sum(light))
    if schedule == "1f1b" and first and extra > 0:
        round_trip = sum(light)
        return (p - 1) * (max(0.0, round_trip - own[0]) + max(0.0, round_trip - own[1]))
    if extra <= 0 or schedule not in ("zero_bubble", *V_SHAPED):
        return base
    if schedule == "zero_bubble":
        return max((p - 1) * light[0] / v, base - extra)
    if schedule == "dualpipev":
        return max(0.0, base - extra)
    if m >= 2 * p:
        return base - min(own[1] / 2 - light[1] / 4, extra)
    return max((p - 1) * max(light[1] / 4, light[0] - light[1] / 4), base - extra)


def looped_bubbles(schedule: str, m: int, times: list[tuple[float, float]]) -> list[float] | None:
    """Each pipeline rank's idle for ranks of any times (t_f, t_b) per micro-batch, rank order (an uneven
    split: every rank sized), as that rank's step would see it if it were the slowest: GPipe's makespan is
    sum(t_f) + (m-1) max(t_f) + sum(t_b) + (m-1) max(t_b); 1F1B's rank k waits for the forwards before it
    and the backwards after them, sum over i < k of (t_f + t_b), and where the round trip through the
    stages after it (R = sum over i > k of (t_f + t_b)) outlasts its own n = p-1-k passes: max(0, R - n F)
    + max(0, R - n B), its (F, B) (the `rank_bubble` of a heavier first rank, generalised). Checked
    against the replay of both orders (tests/unit/test_pipeline_orders.py): GPipe exact for any times,
    1F1B exact with one rank heavier than the others and within -0.8% for splits of whole blocks.
    None for the other schedules (their orders are replayed: `looped_bubbles_by_stage`)."""
    p = len(times)
    if schedule == "gpipe":
        span = sum(f + b for f, b in times) + (m - 1) * (max(f for f, _ in times) + max(b for _, b in times))
        return [span - m * (f + b) for f, b in times]
    if schedule != "1f1b":
        return None
    out = []
    for k, (own_f, own_b) in enumerate(times):
        before, after, n = sum(map(sum, times[:k])), sum(map(sum, times[k + 1:])), p - 1 - k
        out.append(before + max(0.0, after - n * own_f) + max(0.0, after - n * own_b))
    return out


def looped_order(schedule: str, p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """The compute actions (F, B, or the split backward's I and W; stage; micro-batch) pipeline rank r runs
    under interleaved 1F1B or zero bubble (ZB-V and DualPipeV: `v_order`), in torch's order (ScheduleInterleaved1F1B and
    ScheduleInterleavedZeroBubble, their `_get_1f1b_rank_ops`): W0 = min((v-1)k + c(p-1-r), mv) warm-up
    forwards (c = 2, zero bubble 1), the i-th on the rank's local stage (i // k) mod v (k = m // (m // p)
    micro-batches a round), then a forward and a backward per step, the backward's local stage
    v-1-((i-W0) // k) mod v, then the last W0 backwards; zero bubble's backward is the input pass, and from
    its (r+1)-th on each is followed by the weight pass of the oldest one waiting, the rest at the end. Each
    stage takes its micro-batches in order. Equal to torch's own orders (tests/unit/test_pipeline_orders.py);
    the planner replays them where a split makes the stages unequal."""
    if schedule in V_SHAPED:
        return v_order(schedule, p, m, r)
    zero_bubble = schedule == "zero_bubble"
    k, total = m // max(1, m // p), m * v
    warm = min((v - 1) * k + (1 if zero_bubble else 2) * (p - 1 - r), total)
    taken: dict[tuple[str, int], int] = {}
    out: list[tuple[str, int, int]] = []
    waiting: list[int] = []  # stages of the input passes whose weight pass has not run

    def act(kind: str, stage: int) -> None:
        mb = taken[(kind, stage)] = taken.get((kind, stage), -1) + 1
        out.append((kind, stage, mb))

    for op in range(total + warm):
        if op < total:
            act("F", (op // k) % v * p + r)
        if op >= warm:
            stage = (v - 1 - ((op - warm) // k) % v) * p + r
            act("I" if zero_bubble else "B", stage)
            waiting.append(stage)
            if zero_bubble and op - warm >= r:
                act("W", waiting.pop(0))
    for stage in waiting if zero_bubble else []:
        act("W", stage)
    return out


def v_order(schedule: str, p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """`looped_order` for the V schedules: rank r runs stage a = r down the V and stage b = 2p-1-r back up, in
    the phases of torch's ScheduleZBVZeroBubble and ScheduleDualPipeV (Qi et al. 2024, arXiv 2401.10241 §6;
    DeepSeek-V3's DualPipe, arXiv 2412.19437 §3.2.1, as torch cuts it to one V). Each stage takes each kind
    of action in micro-batch order; a DualPipeV full backward (B) counts as its stage's input and weight
    pass, a lone input pass (I) queues its weight pass (W), which runs oldest first where the phase has a
    slot; an overlapped forward and backward is written as the forward then the backward (as torch's
    runtime runs it). ZB-V fills its phases for max(m, 2p-1) micro-batches and drops those past m."""
    a, b = r, 2 * p - 1 - r
    taken: dict[tuple[str, int], int] = {}
    out: list[tuple[str, int, int]] = []
    waiting: list[tuple[int, int]] = []  # (stage, micro-batch) input passes whose weight pass has not run

    def count(kind: str, stage: int) -> int:
        taken[(kind, stage)] = taken.get((kind, stage), 0) + 1
        return taken[(kind, stage)] - 1

    def act(kind: str, stage: int) -> None:
        if kind == "B":  # a full backward is its stage's next input pass, and a weight pass too
            mb = count("I", stage)
            count("W", stage)
        else:
            mb = count(kind, stage)
            if kind == "I" and schedule == "dualpipev":
                waiting.append((stage, mb))
        out.append((kind, stage, mb))

    def weight_if_waiting() -> None:  # DualPipeV: the oldest input pass's weight pass, if one waits
        if waiting:
            stage, mb = waiting.pop(0)
            count("W", stage)
            out.append(("W", stage, mb))

    if schedule == "zbv":
        n = max(2 * p - 1, m)
        steps = [("F", a)] * (2 * (p - r) - 1) + [("F", b), ("F", a)] * r + [("F", b), ("I", b), ("W", b)] * (p - r)
        for kind, stage in steps:
            act(kind, stage)
        while taken.get(("F", b), 0) < taken.get(("F", a), 0) or taken.get(("F", a), 0) < n:
            if taken.get(("F", a), 0) < n:
                act("F", a)
            for kind, stage in (("I", a), ("W", a), ("F", b), ("I", b), ("W", b)):
                act(kind, stage)
        for kind, stage in [("I", a), ("I", b)] * r + [("I", a), ("W", a)] * (p - r):
            act(kind, stage)
        for stage in (b, a):
            while taken.get(("W", stage), 0) < taken.get(("I", stage), 0):
                act("W", stage)
        return [action for action in out if action[2] < m]
    for kind, stage in [("F", a)] * (2 * (p - r - 1)) + [("F", a), ("F", b)] * (r + 1):
        act(kind, stage)
    for _ in range(p - r - 1):
        act("I", b)
        weight_if_waiting()
        act("F", b)
    for _ in range(m - 2 * p + r + 1):  # overlapped F0 B1 and F1 B0
        for kind, stage in (("F", a), ("B", b), ("F", b), ("B", a)):
            act(kind, stage)
    for _ in range(p - r - 1):
        for kind, stage in (("B", b), ("F", b), ("B", a)):
            act(kind, stage)
    split = False  # the second half of the last backwards split into input and weight passes
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        act("I" if split else "B", b)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        act("I" if split else "B", a)
    for _ in range(p - r - 1):
        weight_if_waiting()
        act("I" if split else "B", a)
    for _ in range(r + 1):
        weight_if_waiting()
    return out


def looped_bubbles_by_stage(schedule: str, p: int, v: int, m: int, stage_times: list[tuple[float, float]]) -> list[float]:
    """Each pipeline rank's idle under interleaved 1F1B, zero bubble, ZB-V or DualPipeV with stages of any times (t_f, t_b) per
    micro-batch (an uneven split; a split backward's input and weight passes t_b/2 each): the makespan of
    torch's order (`looped_order`, `replay_span`) less the rank's own m x (its stages' t_f + t_b)."""
    share = {"F": (0, 1.0), "B": (1, 1.0), "I": (1, 0.5), "W": (1, 0.5)}
    orders = {r: [(kind, stage, mb, stage_times[stage][share[kind][0]] * share[kind][1])
                  for kind, stage, mb in looped_order(schedule, p, v, m, r)] for r in range(p)}
    span = replay_span(orders, p * v)
    return [span - m * sum(sum(stage_times[s]) for s in stage_ids(schedule, p, v, r)) for r in range(p)]


def bubble_fraction(schedule: str, p: int, v: int, m: int) -> float:
    """The idle share of a step's span by `bubble_seconds` with a backward twice the forward (a split
    backward's input, weight and forward passes equal): (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1)
    interleaved, (p-1)/(3 v m+p-1) for ZB-H1."""
    idle = bubble_seconds(schedule, p, v, m, 1.0, 2.0)
    return idle / (3.0 * m + idle)


def replay_span(orders: dict[int, list[tuple[str, int, int, float]]], num_stages: int) -> float:
    """The makespan of per-rank action orders (kind F / B / I / W, stage, micro-batch, seconds) when every
    action starts as soon as its rank is free and what it needs has arrived, with no time for the sends:
    a forward needs the previous stage's forward of its micro-batch, a backward (B, or an input pass I)
    the next stage's (the last stage: its own forward), a weight pass W its input pass. Of torch's orders
    it gives `bubble_seconds` (tests/unit/test_pipeline_orders.py); of a measured step's actions
    (train/pipeline_chart.py), the idle the schedule itself costs at those action times, so the rest of
    the measured idle is waiting on sends and slower ranks."""
    def needs(kind: str, stage: int, mb: int) -> tuple | None:
        if kind == "F":
            return None if stage == 0 else ("F", stage - 1, mb)
        if kind == "W":
            return ("B", stage, mb)
        return ("F", stage, mb) if stage == num_stages - 1 else ("B", stage + 1, mb)

    done: dict[tuple, float] = {}
    free = dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)
    moved = True
    while moved:
        moved = False
        for rank, actions in orders.items():
            while position[rank] < len(actions):
                kind, stage, mb, seconds = actions[position[rank]]
                need = needs(kind, stage, mb)
                if need is not None and need not in done:
                    break
                free[rank] = max(free[rank], done[need] if need else 0.0) + seconds
                done[("W" if kind == "W" else "F" if kind == "F" else "B", stage, mb)] = free[rank]
                position[rank] += 1
                moved = True
    stuck = [r for r, actions in orders.items() if position[r] < len(actions)]
    if stuck:
        raise ValueError(f"the orders of ranks {stuck} wait on actions no rank runs")
    return max(free.values(), default=0.0)
