"""cluster.pp_engine = "deepspeed": DeepSpeed's PipelineEngine, as the MT-NLG rows of the published set ran it
(issue 60). Two things differ from torch.distributed.pipelining, which the trainer runs:

- its send / recv are blocking (dist.send / dist.recv on the compute stream, deepspeed/runtime/pipe/p2p.py), in a
  1F1B schedule of lock-step slots whose sends wait for the next slot: each transfer holds both of its ends, so a
  stage waits on four transfers per micro-batch where isend / irecv make it wait on two. The discrete-event
  simulation below is the evidence for constants.PP_P2P_CROSSINGS_PER_MICROBATCH;
- under TP each rank sends 1/tp of a boundary and the receiver all-gathers the whole over TP (its pipe_partitioned
  and grad_partitioned)."""
from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.config import build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.plan import constants as C
from shardwise.plan.collective_time import time_of
from shardwise.plan.comm import Collective, collectives, placements
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.plan.search import search
from shardwise.spec.layout import Layout

# A 2021-Megatron-like job: TP 4 x PP 4 on 16 GPUs over 2 nodes, no SP, 8 micro-batches of 1
BASE = ["--model.preset=llama3-8b", "--train.seq_len=2048", "--cluster.gpu=a100-sxm-80gb", "--cluster.num_gpus=16",
        "--parallel.tp=4", "--parallel.pp=4", "--parallel.sequence_parallel=false", "--parallel.pp_schedule=1f1b",
        "--train.micro_batch=1", "--train.global_batch=8", "--train.recompute=full", "--train.precision=bf16",
        "--train.compile=false"]
DEEPSPEED = "--cluster.pp_engine=deepspeed"


def _plan(*extra: str):
    cfg = build_config(None, parse_overrides([*BASE, *extra]))
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, problem.cluster.num_gpus)
    return problem, lay, evaluate(problem, lay)


# ---- the schedule, simulated ------------------------------------------------------------------------------

def lockstep_1f1b(m: int, p: int) -> list[list[tuple[str, int]]]:
    """Each stage's ops in DeepSpeed's TrainSchedule order: stage s runs the forward of micro-batch i in slot
    2i + s and its backward in slot 2i + 2p - 1 - s, and sends a slot's result at the start of its next slot,
    a forward slot first sending the gradient (to s - 1), then receiving its input; a backward slot first
    receiving its gradient (from s + 1), then sending the activation."""
    programs = []
    for s in range(p):
        ops: list[tuple[str, int]] = []
        previous: tuple[str, int] | None = None
        for slot in range(2 * (m + p - 1)):
            forward = (slot - s) % 2 == 0
            i = (slot - s) // 2 if forward else (slot - 2 * p + 1 + s) // 2
            valid = 0 <= i < m
            if forward:
                if previous and previous[0] == "B" and s > 0:
                    ops.append(("send_grad", previous[1]))
                if valid and s > 0:
                    ops.append(("recv_act", i))
            else:
                if valid and s < p - 1:
                    ops.append(("recv_grad", i))
                if previous and previous[0] == "F" and s < p - 1:
                    ops.append(("send_act", previous[1]))
            if valid:
                ops.append(("F" if forward else "B", i))
            previous = ("F" if forward else "B", i) if valid else None
        programs.append(ops)
    return programs


def makespan(m: int, p: int, t_f: float, t_b: float, x: float, blocking: bool) -> float:
    """The step's end in a discrete-event run of `lockstep_1f1b`, each transfer taking x. Blocking: a transfer
    starts once both ends reach it and holds both until it ends; otherwise the sender posts it and goes on,
    and the receiver waits for it to arrive."""
    programs = lockstep_1f1b(m, p)
    clock, at = [0.0] * p, [0] * p
    posted: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, micro-batch) -> when sent / ready
    done: dict[tuple[str, int, int], float] = {}
    peer = {"send_act": ("act", 1), "send_grad": ("grad", -1)}
    while any(at[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(programs[s]):
                op, i = programs[s][at[s]]
                if op in ("F", "B"):
                    clock[s] += t_f if op == "F" else t_b
                elif op in peer:
                    kind, step = peer[op]
                    key = (kind, s + step, i)
                    if blocking:
                        if key not in posted:  # the receiver has not reached its recv
                            break
                        clock[s] = done[key] = max(clock[s], posted[key]) + x
                    else:
                        done[key] = clock[s] + x
                else:
                    key = (op[5:], s, i)
                    if blocking:
                        posted.setdefault(key, clock[s])
                    if key not in done:
                        break
                    clock[s] = max(clock[s], done[key])
                at[s] += 1
                moved = True
        assert moved, "the schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize("blocking", [False, True])
def test_the_lockstep_schedule_is_1f1b_and_waits_on_each_transfer_as_the_constant_says(blocking):
    """Without transfer time the slots make exactly 1F1B's makespan, (m + p - 1)(t_f + t_b); each extra
    micro-batch then costs t_f + t_b plus the constant's count of transfers: 4 blocking, 2 isend / irecv."""
    p, t_f, t_b, x = 5, 1.0, 3.0, 0.0625  # binary fractions: the sums are exact
    for m in (8, 12):
        assert makespan(m, p, t_f, t_b, 0.0, blocking) == (m + p - 1) * (t_f + t_b)
    per_microbatch = (makespan(12, p, t_f, t_b, x, blocking) - makespan(8, p, t_f, t_b, x, blocking)) / 4
    engine = "deepspeed" if blocking else "torch"
    assert per_microbatch == t_f + t_b + C.PP_P2P_CROSSINGS_PER_MICROBATCH[engine] * x
    # the fill and drain: one transfer per boundary each way, less the few the per-micro-batch count already
    # holds (2 isend / irecv, 6 blocking); plan/cost.py pp_p2p_seconds prices 2 (p - 1): a constant few x high
    fill = makespan(8, p, t_f, t_b, x, blocking) - (8 + p - 1) * (t_f + t_b) - 8 * (per_microbatch - t_f - t_b)
    assert fill == (2 * (p - 1) - (6 if blocking else 2)) * x


# ---- the planner ------------------------------------------------------------------------------------------

def test_deepspeed_prices_a_split_boundary_four_times_a_microbatch_and_its_tp_gathers():
    """pp_comm = one transfer of 1/tp of the boundary x (4 m + 2 (pp - 1)) + 3 m all-gathers of the whole over
    TP; compute, TP and DP are priced as before."""
    problem, lay, torch = _plan()
    problem_ds, lay_ds, ds = _plan(DEEPSPEED)
    whole = lay.micro_batch * problem.seq_len * problem.shape.dim * 4  # autocast keeps the residual stream fp32
    place, cl = placements(lay_ds, problem_ds.cluster), problem_ds.cluster
    send = time_of(Collective("pp", "send", whole / lay.tp, 1, "p2p"), place, cl)
    gather = time_of(Collective("tp", "all_gather", whole, 1, "fwd"), place, cl)
    m = lay.accumulation(problem)
    expected = send * (4 * m + 2 * (lay.pp - 1)) + gather * 3 * m
    assert ds.breakdown_s["pp_comm"] == pytest.approx(expected, rel=1e-12)
    assert send * 4 < time_of(Collective("pp", "send", whole, 1, "p2p"), place, cl) * 2  # cheaper than torch's here
    for key in ("compute", "recompute", "tp_comm", "dp_comm", "optimizer"):
        assert ds.breakdown_s[key] == torch.breakdown_s[key], key
    assert "DeepSpeed's pipeline engine (blocking send / recv, sends split over TP)" in problem_ds.stack_description(lay_ds)
    assert "DeepSpeed" not in problem.stack_description(lay)
    sent = {(c.axis, c.kind, c.unit): c.payload for c in collectives(problem_ds, lay_ds, pp_rank=1)}
    assert sent["pp", "send", "act"] == whole / lay.tp and sent["tp", "all_gather", "pp_gather"] == whole


def test_deepspeed_under_sequence_parallelism_splits_nothing_more_and_doubles_the_transfers():
    """Under SP the boundary is already a 1/tp sequence shard: the engine sends it as is, gathers nothing."""
    problem, lay, torch = _plan("--parallel.sequence_parallel=true")
    _, _, ds = _plan("--parallel.sequence_parallel=true", DEEPSPEED)
    m, pp = lay.accumulation(problem), lay.pp
    ratio = (4 * m + 2 * (pp - 1)) / (2 * m + 2 * (pp - 1))
    assert ds.breakdown_s["pp_comm"] == pytest.approx(torch.breakdown_s["pp_comm"] * ratio, rel=1e-12)


def test_without_pipeline_parallelism_the_engine_changes_nothing():
    problem, lay, torch = _plan("--parallel.pp=1", "--parallel.dp_replicate=4")
    problem_ds, lay_ds, ds = _plan("--parallel.pp=1", "--parallel.dp_replicate=4", DEEPSPEED)
    assert ds.step_time_s == torch.step_time_s
    assert "DeepSpeed" not in problem_ds.stack_description(lay_ds)


def test_deepspeed_runs_only_1f1b(capsys):
    """DeepSpeed's engine has one training schedule: another one is refused on the key, and a search prices 1F1B."""
    with pytest.raises(ConfigError) as e:
        _plan(DEEPSPEED, "--parallel.pp_schedule=interleaved_1f1b")
    assert e.value.field == "cluster.pp_engine" and "1F1B" in e.value.problem
    assert main(["plan", "evaluate", *BASE, DEEPSPEED, "--parallel.pp_schedule=gpipe"]) == 2
    assert "cluster.pp_engine" in capsys.readouterr().err
    cfg = build_config(None, parse_overrides([*BASE, DEEPSPEED, "--parallel.pp=1", "--parallel.tp=1"]))
    found = search(Problem.from_config(cfg), top=50).ranked
    assert {(e.layout.schedule, e.layout.virtual_stages) for e in found if e.layout.pp > 1} == {("1f1b", 1)}
    assert any(e.layout.pp > 1 for e in found)


def test_an_unknown_engine_is_refused_on_its_field(capsys):
    with pytest.raises(ConfigError) as e:
        _plan("--cluster.pp_engine=megatron")
    assert e.value.field == "cluster.pp_engine"
    assert main(["plan", "evaluate", *BASE, "--cluster.pp_engine=megatron"]) == 2
    err = capsys.readouterr().err
    assert "cluster.pp_engine" in err and "Traceback" not in err
