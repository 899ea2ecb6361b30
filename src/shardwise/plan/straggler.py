"""What a straggler costs a job, and what evicting its node saves (`plan evaluate --straggler S`).

A rank whose compute is S times slower (a throttled GPU, a busy host) sets the pace of every rank: each
collective waits for it. First order, every step's compute and recomputation on the critical path is S
times longer and the rest (exposed communication, the optimizer) is unchanged:
    a = step x (1 + busy x (S - 1)),  busy = (compute + recompute) / the predicted step's breakdown.
It is an upper bound: a slower compute also hides more of the communication it overlaps.

Evicting the node (run.evict_stragglers, train/eviction.py) trades it for a step at one node fewer, b =
plan/cost.py's step of the same config on num_gpus - gpus_per_node (dp_shard = -1 absorbs it; the global
batch stays, so each step trains the same tokens), after one checkpoint and one elastic restart, E = delta +
R (plan/goodput.py: the checkpoint save time and the measured elastic restart). Over a straggler lasting T
of wall time, the job trains T / a steps if kept and (T - E) / b if evicted, so eviction pays off once
    T > E x a / (a - b)   (never when b >= a: the fewer GPUs cost more than the straggler).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shardwise.plan.cost import Estimate
from shardwise.plan.goodput import RunCost


@dataclass(frozen=True)
class StragglerPrice:
    slowness: float
    step_s: float
    slow_step_s: float
    days: float
    slow_days: float                  # if the straggler lasts the whole run
    nodes: int
    evicted_gpus: int                 # 0: nothing to evict (one node)
    evicted_step_s: float | None      # None: the layout cannot run on one node fewer (why_not says why)
    evicted_fits: bool
    eviction_cost_s: float            # checkpoint save + elastic restart
    break_even_s: float               # inf: eviction never pays off
    evicted_days: float | None        # evicted at once, for the whole run
    why_not: str = ""

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    def line(self) -> str:
        slow = (f"a straggler at {self.slowness:g}x compute: step up to {self.slow_step_s:.3g} s against "
                f"{self.step_s:.3g} s (+{self.slow_step_s / self.step_s - 1:.0%}), {self.slow_days - self.days:.3g} "
                "more days if it lasts the run")
        if self.evicted_step_s is None:
            return f"{slow}; evicting its node: {self.why_not}"
        evict = (f"evicting its node (run.evict_stragglers): step {self.evicted_step_s:.3g} s on {self.evicted_gpus} GPUs "
                 f"after a checkpoint and restart of ~{self.eviction_cost_s:.0f} s")
        if not self.evicted_fits:
            return f"{slow}; {evict}, but it does not fit in memory there: the eviction would fail"
        if math.isinf(self.break_even_s):
            return f"{slow}; {evict}: never pays off (one node fewer is slower than the straggler)"
        return f"{slow}; {evict}: pays off once the straggler lasts over {_duration(self.break_even_s)}"


def price(est: Estimate, slowness: float, cost: RunCost, nodes: int, evicted: Estimate | None, evicted_gpus: int,
          why_not: str = "") -> StragglerPrice:
    """`est`: the job's estimate; `evicted`: the same config's at one node fewer (None: it cannot run there)."""
    total = sum(est.breakdown_s.values())
    busy = (est.breakdown_s.get("compute", 0.0) + est.breakdown_s.get("recompute", 0.0)) / total if total > 0 else 1.0
    step = est.step_time_s
    slow = step * (1 + busy * (slowness - 1))
    cost_s = cost.checkpoint_save_s + cost.elastic_restart_s
    b = evicted.step_time_s if evicted is not None else None
    break_even = cost_s * slow / (slow - b) if b is not None and slow > b else math.inf
    evicted_days = est.days * b / step + cost_s / 86400 if b is not None else None
    return StragglerPrice(slowness, step, slow, est.days, est.days * slow / step, nodes, evicted_gpus, b,
                          evicted.fits if evicted is not None else False, cost_s, break_even, evicted_days, why_not)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def straggler_price(cfg, problem, est: Estimate, slowness: float) -> StragglerPrice:
    """`plan evaluate --straggler S`: the config's job with a straggler, and at one node fewer (module doc)."""
    import copy

    from shardwise.errors import ConfigError
    from shardwise.plan.cost import evaluate
    from shardwise.plan.goodput import run_cost
    from shardwise.plan.layout import Problem, check_layout
    from shardwise.spec.layout import Layout

    if not slowness > 1:
        raise ConfigError("--straggler", f"must be above 1 (how many times slower one rank's compute is), got {slowness:g}",
                          "e.g. --straggler 1.3: one rank 30% slower")
    cost = run_cost(problem, est)
    per_node, gpus = problem.cluster.gpus_per_node, problem.cluster.num_gpus
    nodes = max(1, gpus // per_node)
    if nodes < 2:
        return price(est, slowness, cost, nodes, None, 0, "one node: there is no other node to go on with")
    fewer = copy.deepcopy(cfg)
    fewer.cluster.num_gpus = gpus - per_node
    try:
        small = Problem.from_config(fewer)
        layout = Layout.from_config(fewer, small.cluster.num_gpus)
        violation = check_layout(small, layout)
    except ConfigError as e:
        violation = e
    if violation is not None:
        absorb = "; let data parallelism absorb the change: --parallel.dp_shard=-1" if cfg.parallel.dp_shard != -1 else ""
        return price(est, slowness, cost, nodes, None, gpus - per_node, f"this layout cannot run on one node fewer, "
                     f"{gpus - per_node} GPUs ({violation.field}: {violation.problem}){absorb}")
    return price(est, slowness, cost, nodes, evaluate(small, layout), gpus - per_node)
