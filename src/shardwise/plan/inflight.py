"""Micro-batches whose activations a pipeline rank holds at its peak, per schedule (plan/memory.py
multiplies one micro-batch's stored activations by these counts)."""
from __future__ import annotations

from shardwise.plan import activations as A
from shardwise.plan.inventory import RankModel
from shardwise.plan.layout import Problem
from shardwise.spec.layout import Layout
from shardwise.spec.loss import loss_is_chunked
from shardwise.spec.stages import looped_order


def inflight_microbatches(schedule: str, pp: int, m: int, v: int, first: bool, rank: int | None = None) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of one micro-batch
    of its whole share of layers: the first or the last rank, or pipeline rank `rank` where given (a
    split the planner sizes rank by rank, plan/inventory.py sized_ranks).
    gpipe: all m (every forward before any backward; Huang et al. 2019, arXiv 1811.06965).
    1f1b: rank r holds p - r (PipeDream-Flush / Megatron warm-up, Narayanan et al. 2021 §2.2).
    interleaved_1f1b: rank r holds 2(p-r-1) + (v-1)k + 1 chunk-micro-batches of 1/v of its layers, k the
      micro-batches of one of torch's rounds (m // (m // p): p when p divides m), i.e. p + (p-1)/v on
      rank 0 = Korthikanti et al. §4.2.3's p(1 + (p-1)/(pv)) when it does; more when not (p=4, m=6:
      measured -8% / -25% on the first / last rank with p in place of k).
    zero_bubble: ((v-1)k + p)/v on every rank, k as above: torch's ScheduleInterleavedZeroBubble defers
      the weight passes (each keeps its micro-batch's saved tensors: the input pass retains the graph),
      so the last rank holds p micro-batches, not 1F1B's 1 (Qi et al. 2024's ZB-H1 keeps 1F1B's peak,
      arXiv 2401.10241 §2.1: torch's order is not ZB-H1's; measured -44% / -64% on the last rank at p=2 /
      p=4 when priced as 1F1B).
    zbv (ZB-V, ibid. §6): two V-placed chunks per rank with the same peak as 1F1B's first rank, p
      micro-batches (2p half-size chunk-micro-batches), on every rank. Counted on the order torch's
      ScheduleZBVZeroBubble runs (warm-up 2(p-r)-1 chunk-0 forwards, r pairs of chunk-1 / chunk-0
      forwards, then F-I-W triples; a chunk's activations live until its W): rank r peaks at
      min(2p, m + r + 1) chunk-micro-batches, i.e. p once m >= 2p - 1.
    dualpipev: p + 1/2, i.e. 2p + 1 chunk-micro-batches, on every rank. Counted on the order torch's
      ScheduleDualPipeV runs (DeepSeek's dualpipev steps): rank r runs 2(p-r-1) chunk-0 forwards, then
      r+1 chunk-0 / chunk-1 forward pairs (2p-r-1 chunk-0 and r+1 chunk-1 in flight), p-r-1 B-W-F
      triples of chunk 1 (no change), then the main step's pairs (F chunk 0, B chunk 1), (F chunk 1,
      B chunk 0), each forward before its backward: 2p-r + r+1 = 2p+1 at their peak. It runs at least
      once since m >= 2p (stages.py). DeepSeek-V3's Table 2 "PP + 1" (arXiv 2412.19437) is DualPipe's,
      with two copies of the model per rank; the measured peak (tests/dist/test_plan_validation.py,
      PeakActivationMeter) is 2p + 1 half-rank chunks.
    The stage holding the head (the loss's fp32 log-softmax, large with a big vocabulary) is a
    different count, see `head_inflight_microbatches`. Every count is the peak of torch's own action
    order (tests/unit/test_pipeline_orders.py replays them for p = 2-8 and every legal m).
    """
    if pp == 1:
        return 1.0
    r = rank if rank is not None else 0 if first else pp - 1
    if schedule == "gpipe":
        return float(m)
    per_round = m // max(1, m // pp)  # torch's microbatches_per_round
    if schedule == "interleaved_1f1b" and v > 1:
        return min(float(m), (2 * (pp - r - 1) + (v - 1) * per_round + 1) / v)
    if schedule == "zero_bubble":
        return min(float(m), ((v - 1) * per_round + pp) / v)
    if schedule == "zbv":
        return min(float(m), min(2 * pp, m + r + 1) / 2)
    if schedule == "dualpipev":
        return min(float(m), pp + 0.5)
    return float(min(m, pp - r))


def looped_held(schedule: str, pp: int, m: int, v: int, r: int, weights: list[float]) -> list[int]:
    """Micro-batches in flight on each of rank r's v stages (execution order) under interleaved 1F1B, zero
    bubble, ZB-V or DualPipeV when their sum weighted by `weights` (a stage's bytes per micro-batch: an uneven split,
    Layout.stage_layers) peaks, along torch's order (spec/stages.py looped_order; a micro-batch is held from
    its forward to its backward, or to its weight pass, the input pass retaining the graph). With equal
    weights the peak is `inflight_microbatches`'s; with unequal ones the heavier stage's micro-batches need
    not peak with the others' (tests/unit/test_pipeline_orders.py replays torch's orders)."""
    live, best, most = [0] * v, [0] * v, -1.0
    for kind, stage, _ in looped_order(schedule, pp, v, m, r):
        if kind == "I":
            continue
        live[stage // pp] += 1 if kind == "F" else -1
        level = sum(w * n for w, n in zip(weights, live))
        if level > most:
            most, best = level, list(live)
    return best


def head_inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches in flight on the last stage (the one with the output head and the loss), whose
    backward can start as soon as its own forward ends: 1 in every schedule that runs it so —
    1F1B's last rank alternates F and B; interleaved 1F1B's last rank starts its steady state with
    the last chunk (its warm-up, (v-1)p forwards, covers only the other chunks: F and B of the last
    chunk then alternate); ZB-V and DualPipeV put the last stage on rank 0 as chunk 1 and run its
    F then I (and W for ZB-V) back to back, or keep r+1 = 1 chunk-1 micro-batch on rank 0 (see
    `inflight_microbatches`). GPipe holds all m. torch's zero-bubble order defers the last stage's
    weight passes (its saved tensors stay until then): p micro-batches."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "zero_bubble":
        return float(min(m, pp))
    return 1.0


def loss_inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches whose loss tensors (plan/activations.py loss_bytes: the log-softmax, the targets) the
    last stage holds at its peak: the head's count, except where weight passes wait, since the input pass
    frees the loss (torch detaches it, pipelining/_backward.py stage_backward_input): under the zero-bubble
    order 1, not p (measured on the last rank: within 0.1% at p = 2 and 4, tests/dist/test_plan_validation.py)."""
    return 1.0 if schedule == "zero_bubble" and pp > 1 else head_inflight_microbatches(schedule, pp, m, v)


def head_bytes_held(problem: Problem, core: Layout, rank: RankModel, head: float, schedule: str, pp: int, m: int,
                    v: int, grid2d: bool, head_inflight: float | None = None) -> float:
    """The head's saved bytes `rank` holds at its peak, from `head`, one micro-batch's (plan/memory.py
    microbatch_activations): times the head stage's in-flight micro-batches (`head_inflight`: those of the
    rank's peak where its order was followed stage by stage, `looped_held`), less the loss's own bytes
    (activations.py loss_bytes, loss_bytes_2d under 2-D TP) of those whose input pass has freed them while
    their weight pass waits (`loss_inflight_microbatches`)."""
    if head_inflight is None:
        head_inflight = head_inflight_microbatches(schedule, pp, m, v)
    held = head * head_inflight
    released = head_inflight - min(head_inflight, loss_inflight_microbatches(schedule, pp, m, v))
    if not rank.head or released <= 0:
        return held
    s, tokens = problem.shape, core.micro_batch * problem.seq_len / core.cp
    reg = A.regime(problem.precision, core.lowp_params, problem.model_states)
    loss = A.loss_bytes_2d(s, reg, core.tp) if grid2d else \
        A.loss_bytes(s, reg, core.tp, loss_is_chunked(tokens, s.vocab_size, core.tp))
    return held - released * (loss.per_token * tokens + loss.fixed)
