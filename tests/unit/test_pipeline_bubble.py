"""The planner's pipeline bubble (spec/stages.py bubble_seconds) against the action orders torch itself
runs: each schedule's `pipeline_order` (built from stand-in stages, no process group), replayed with
every action on its rank back to back once what it needs has arrived, gives a makespan; its excess over
a rank's m (t_f + t_b) of work is the bubble the order costs, whatever the paper a schedule follows says.
This is what caught the planner pricing ZB-V and DualPipeV at (nearly) no bubble where torch's orders
idle (p-1) t_b/4 and (p-1) t_f.

The replay's rules are torch's dependencies (torch/distributed/pipelining/schedules.py
_simulate_comms_compute, with times: spec/stages.py replay_span); an OVERLAP_F_B action runs its forward
and backward one after the other (on one device they share the compute; the overlap hides
communication, which the planner prices apart).
gpipe and 1f1b run torch's single-stage loop, not an order: their (p-1)(t_f + t_b) is textbook.
"""
from __future__ import annotations

import types

import pytest

from shardwise.spec.rules import microbatch_rule
from shardwise.spec.stages import bubble_seconds, replay_span, stage_ids

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
CT = schedules._ComputationType
CLASSES = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B, "zero_bubble": schedules.ScheduleInterleavedZeroBubble,
           "zbv": schedules.ScheduleZBVZeroBubble, "dualpipev": schedules.ScheduleDualPipeV}


def torch_order(schedule: str, p: int, v: int, m: int) -> dict[int, list]:
    """torch's per-rank action lists for `schedule` (the orders its runtime executes)."""
    num = p * v
    stages = [types.SimpleNamespace(group_size=p, group_rank=0, num_stages=num, stage_index=s, submod=None,
                                    is_first=s == 0, is_last=s == num - 1, has_backward=True)
              for s in stage_ids(schedule, p, v, 0)]
    return CLASSES[schedule](stages, m, loss_fn=lambda out, target: out).pipeline_order


def replayed_bubble(order: dict[int, list], num_stages: int, m: int, t_f: float, t_b: float) -> float:
    """The order's makespan (spec/stages.py replay_span) minus a rank's m (t_f + t_b), each rank running
    v = num_stages / p chunks of t_f / v forward and t_b / v backward (input and weight passes half of it
    each); an OVERLAP_F_B action as its forward, then its backward, as the trainer's timeline records it."""
    v = num_stages // len(order)
    seconds = {CT.FORWARD: ("F", t_f / v), CT.BACKWARD_INPUT: ("I", t_b / v / 2),
               CT.BACKWARD_WEIGHT: ("W", t_b / v / 2), CT.FULL_BACKWARD: ("B", t_b / v)}
    actions = {}
    for rank, listed in order.items():
        parts = [p for a in listed if a is not None
                 for p in (a.sub_actions if a.computation_type == CT.OVERLAP_F_B else [a])]
        actions[rank] = [(*seconds[a.computation_type][:1], a.stage_index, a.microbatch_index,
                          seconds[a.computation_type][1]) for a in parts if a.computation_type in seconds]
    return replay_span(actions, num_stages) - m * (t_f + t_b)


CASES = [(schedule, p, v, m) for schedule, vs in (("interleaved_1f1b", (2, 3, 4)), ("zero_bubble", (1, 2)),
                                                   ("zbv", (2,)), ("dualpipev", (2,)))
         for v in vs for p in (2, 3, 4, 8) for m in range(p, 3 * p + 1)
         if microbatch_rule(schedule, p, m) is None]
# Backward / forward: 2 is a block without recompute (two GEMMs per forward GEMM), ~3 with full
# recompute; below 2 only where a stage's forward carries extra work (the head, the loss).
RATIOS = (2.0, 2.5, 3.0, 4.0)


@pytest.mark.parametrize("schedule,p,v,m", CASES, ids=[f"{s}-p{p}-v{v}-m{m}" for s, p, v, m in CASES])
def test_the_planned_bubble_is_the_makespan_of_torchs_order(schedule, p, v, m):
    order = torch_order(schedule, p, v, m)
    for ratio in RATIOS:
        replayed = replayed_bubble(order, p * v, m, 1.0, ratio)
        assert bubble_seconds(schedule, p, v, m, 1.0, ratio) == pytest.approx(replayed, abs=1e-9), ratio
    for ratio in (0.5, 1.0, 1.5):  # ZB-V's form is exact from t_b = 2 t_f up; below, within a forward
        replayed = replayed_bubble(order, p * v, m, 1.0, ratio)
        tolerance = 1.0 if schedule == "zbv" else 1e-9
        assert abs(bubble_seconds(schedule, p, v, m, 1.0, ratio) - replayed) <= tolerance, ratio


def test_the_replay_reads_a_textbook_order_right():
    """Interleaved 1F1B's (p-1)(t_f + t_b)/v is the textbook's (Narayanan et al. 2021 §2.2.2), so a replay
    that gets it wrong, not the planner, would fail here."""
    assert replayed_bubble(torch_order("interleaved_1f1b", 4, 2, 8), 8, 8, 1.0, 2.0) == pytest.approx(3 * 3.0 / 2)
