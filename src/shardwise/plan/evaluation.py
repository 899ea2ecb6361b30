"""The price of validation ([eval], train/evaluate.py): a round's seconds, and what the rounds add to a run.

A round runs each set's global batches forward only, on the layout the run trains with. One global batch
is priced from the training step's own terms (plan/cost.py):

    compute    m x t_f                      (m micro-batches of forward, t_f per micro-batch on this rank)
    comm       (tp + cp + ep) / 3           (a micro-batch's collectives are a third forward, two thirds
                                             backward: the split cost._pipeline_times uses)
               + pp / 2                     (the forward crossings of the pipeline, not the backward's)
               + dp / 3 under ZeRO-3        (FSDP's forward all-gather of the three passes; ZeRO 0-2 and
                                             DDP only reduce gradients, which a forward does not make)
    fill       (pp - 1) x t_f / v           (a forward-only schedule's fill: one stage's forward per
                                             pipeline rank before the last starts; v stages per rank)

The optimizer step, recomputation and the backward's bubble are not part of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EvalPrice:
    sets: int
    batches_per_set: int
    batch_s: float
    rounds: int

    @property
    def round_s(self) -> float:
        return self.sets * self.batches_per_set * self.batch_s

    @property
    def total_s(self) -> float:
        return self.rounds * self.round_s

    def to_json(self) -> dict:
        return {"sets": self.sets, "batches_per_set": self.batches_per_set, "batch_s": self.batch_s, "rounds": self.rounds,
                "round_s": self.round_s, "total_s": self.total_s}


def validation_sets(cfg) -> int:
    """How many sets a round evaluates: each source's held-out part and the named sets."""
    sources = max(1, len(cfg.data.sources)) if cfg.data.valid_fraction > 0 else 0
    return sources + len(cfg.data.valid)


def eval_rounds(cfg) -> int:
    e, steps = cfg.eval, cfg.train.steps
    every = steps // e.every if e.every > 0 else 0
    return every + int(e.at_end and (e.every <= 0 or steps % e.every != 0))


def forward_batch_seconds(breakdown: dict[str, float], detail: dict[str, float], pp: int, chunks_per_rank: int,
                          zero: int) -> float:
    """One global batch forward only, from a training step's breakdown and detail (module docstring)."""
    t_f, m = detail["t_fwd_microbatch_s"], detail["microbatches"]
    comm = sum(breakdown.get(k, 0.0) for k in ("tp_comm", "cp_comm", "ep_comm")) / 3 + breakdown.get("pp_comm", 0.0) / 2
    if zero == 3:
        comm += breakdown.get("dp_comm", 0.0) / 3
    return m * t_f + comm + (pp - 1) * t_f / max(1, chunks_per_rank)


def eval_price(cfg, breakdown: dict[str, float], detail: dict[str, float], pp: int, chunks_per_rank: int) -> EvalPrice | None:
    """The rounds a run's [eval] keys ask for, priced; None without a validation set or rounds. A whole-set
    round (eval.tokens = 0) depends on the sets' sizes, which the planner does not read: priced per batch."""
    sets, rounds = validation_sets(cfg), eval_rounds(cfg)
    if not sets or not rounds:
        return None
    t = cfg.train
    batches = math.ceil(cfg.eval.tokens / (t.global_batch * t.seq_len)) if cfg.eval.tokens > 0 else 0
    return EvalPrice(sets, batches, forward_batch_seconds(breakdown, detail, pp, chunks_per_rank, cfg.parallel.zero), rounds)
