"""What a run really costs: GPU-hours and money, energy, and the time failures and checkpoints add.

Read-only on top of plan/cost.py's Estimate (the step time and its breakdown are not changed here):
  GPU-hours = days x 24 x num_gpus;  cost = GPU-hours x cluster.price_per_gpu_hour (0: not priced).
  Power per GPU P = P_idle + (TDP - P_idle) x busy, P_idle = constants.IDLE_POWER_FRACTION x TDP
    (ASSUMED), TDP = spec/hardware.py Device.tdp_w, busy = (compute + recompute) / the predicted step
    (the breakdown's sum: with --assume-mfu the predicted step's busy share is applied to the assumed one).
  Energy = P x num_gpus x hours of the failure-free run; J/token = P x num_gpus / tokens per second:
    all GPUs of the job per trained token, train/power.py's measured `energy_j_per_token`. GPU boards only.
Failures and checkpoints (exponential failures, a job that restarts from its last checkpoint):
  job MTBF M = 1 / (failures_per_gpu_hour x num_gpus); default rate: Llama 3 (constants.FAILURES_PER_GPU_HOUR).
  delta = checkpoint save time (cluster.checkpoint_save_s, else the most loaded rank's parameters +
    optimizer state over constants.CHECKPOINT_WRITE_GBPS_PER_GPU — an upper bound: DCP writes a tensor
    replicated over data-parallel ranks once, so those ranks share it); R = restart time.
  Interval between checkpoints (compute time), Daly's higher-order optimum (Daly 2006, "A higher order
    estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3):303-312, eq. for delta <
    2M; it refines Young 1974, "A first order approximation to the optimum checkpoint interval", CACM
    17(9):530-531, tau = sqrt(2 delta M)):
      tau = sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta   for delta < 2M
      tau = M                                                                           otherwise.
    It reproduces Daly's simulated examples (R = 10 min, delta = 5 min: M = 24 h -> 117 min, 6 h -> 57
    min, 15 min -> 9.1 min); tests/unit/test_plan_goodput.py checks them.
  Expected overhead per unit of failure-free training time (first order, Young's cost model): a
    checkpoint every tau costs delta / tau; a failure (rate 1/M) loses half an interval plus the save in
    progress on average, (tau + delta) / 2, and the restart R:
      overhead = delta / tau + (tau + delta) / (2M) + R / M
  days including failures = days x (1 + overhead); goodput = 1 / (1 + overhead), the useful share of the
  wall time; expected failures = days including failures x 24 / M. The overhead is first order: it does
  not count failures during a restart or a re-run, so it is optimistic once (tau + delta) / 2 + R nears
  M — there a note says the job barely progresses.
  An elastic job (`train --nnodes MIN:MAX`) goes on on the nodes left: the same overhead with R = the
  elastic restart (cluster.elastic_restart_s, else constants.ELASTIC_RESTART_S, measured) instead of a
  re-scheduled job's; the work since the last checkpoint is lost either way. First order again: the
  slower steps on fewer nodes until one joins are not counted.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from shardwise.plan import constants as C
from shardwise.plan.cost import Estimate
from shardwise.plan.inventory import sized_ranks
from shardwise.plan.layout import Problem
from shardwise.plan.memory import model_state_bytes
from shardwise.spec.layout import Layout

JOULES_PER_KWH = 3.6e6  # as train/power.py


def mtbf_hours(failures_per_gpu_hour: float, num_gpus: int) -> float:
    """Mean time between failures of a job on `num_gpus` (any one GPU's failure stops it); inf at rate 0."""
    rate = failures_per_gpu_hour * num_gpus
    return 1.0 / rate if rate > 0 else math.inf


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (any unit, the same for both)."""
    if math.isinf(mtbf):
        return math.inf
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def overhead_fraction(delta: float, tau: float, mtbf: float, restart: float) -> float:
    """delta / tau + (tau + delta) / 2M + R / M; 0 without failures, and no checkpoint cost when delta = 0."""
    if math.isinf(mtbf):
        return 0.0
    return (delta / tau if tau > 0 else 0.0) + (tau + delta) / (2 * mtbf) + restart / mtbf


def board_power_w(tdp_w: float, busy: float, idle_fraction: float = C.IDLE_POWER_FRACTION) -> float:
    """P = P_idle + (TDP - P_idle) x busy, P_idle = idle_fraction x TDP."""
    idle = idle_fraction * tdp_w
    return idle + (tdp_w - idle) * min(1.0, max(0.0, busy))


def checkpoint_bytes(problem: Problem, lay: Layout) -> float:
    """Parameters + optimizer state of the pipeline rank that holds the most (before offload: a
    checkpoint saves offloaded state too); the arguments are plan/memory.py's."""
    shard = lay.shard_group
    out = 0.0
    for _, rank in sized_ranks(problem.shape, lay):
        st = model_state_bytes(problem, rank, lay.tp, lay.ep, lay.zero, shard if lay.zero else 1, max(1, shard // lay.ep),
                               lay.tp_mode)
        out = max(out, st.params + st.optimizer)
    return out


@dataclass(frozen=True)
class RunCost:
    gpu_hours: float
    price_per_gpu_hour: float
    cost: float | None                  # None: not priced
    busy_fraction: float
    tdp_w: float                        # 0: the device has no TDP in spec/hardware.py -> no energy (None)
    idle_power_fraction: float
    power_w_per_gpu: float | None
    energy_kwh: float | None            # failure-free run, all GPUs
    energy_j_per_token: float | None
    failures_per_gpu_hour: float
    failures_source: str                # "config" or "Llama 3 default"
    mtbf_hours: float                   # inf without failures
    checkpoint_bytes_per_gpu: float
    checkpoint_save_s: float
    checkpoint_source: str              # "config" or "estimated"
    restart_s: float
    restart_source: str                 # "config" or "assumed"
    elastic_restart_s: float            # an elastic job's R (cluster.elastic_restart_s, else measured)
    elastic_overhead: float             # the overhead with R = elastic_restart_s
    elastic_goodput: float
    elastic_days_with_failures: float
    checkpoint_interval_s: float        # inf without failures
    checkpoint_every_steps: int | None  # None without failures
    overhead: float
    goodput: float
    days: float
    days_with_failures: float
    expected_failures: float
    gpu_hours_with_failures: float
    cost_with_failures: float | None
    note: str = ""

    def to_json(self) -> dict:
        """The same numbers; inf (no failures) as null."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def run_cost(problem: Problem, est: Estimate) -> RunCost:
    cl, dev = problem.cluster, problem.cluster.device
    n = cl.num_gpus
    gpu_hours = est.days * 24 * n
    price = cl.price_per_gpu_hour
    predicted_step = sum(est.breakdown_s.values())
    busy = (est.breakdown_s.get("compute", 0.0) + est.breakdown_s.get("recompute", 0.0)) / predicted_step if predicted_step > 0 else 1.0
    power = board_power_w(dev.tdp_w, busy) if dev.tdp_w > 0 else None
    joules_per_s = power * n if power is not None else None
    energy_kwh = joules_per_s * est.days * C.SECONDS_PER_DAY / JOULES_PER_KWH if joules_per_s is not None else None
    rate = C.FAILURES_PER_GPU_HOUR if cl.failures_per_gpu_hour is None else cl.failures_per_gpu_hour
    mtbf_h = mtbf_hours(rate, n)
    ckpt_bytes = checkpoint_bytes(problem, est.layout)
    delta = ckpt_bytes / (C.CHECKPOINT_WRITE_GBPS_PER_GPU * 1e9) if cl.checkpoint_save_s is None else cl.checkpoint_save_s
    restart = C.RESTART_S if cl.restart_s is None else cl.restart_s
    mtbf_s = mtbf_h * 3600
    tau = daly_interval(delta, mtbf_s)
    overhead = overhead_fraction(delta, tau, mtbf_s, restart)
    elastic_restart = C.ELASTIC_RESTART_S if cl.elastic_restart_s is None else cl.elastic_restart_s
    elastic = overhead_fraction(delta, tau, mtbf_s, elastic_restart)  # tau does not depend on R (Daly)
    days_f = est.days * (1 + overhead)
    every = None if math.isinf(tau) else max(1, round(tau / est.step_time_s))
    note = ""
    if not math.isinf(mtbf_s) and (tau + delta) / 2 + restart >= mtbf_s:
        note = (f"a failure every {mtbf_h * 60:.3g} min comes sooner than a restart plus half a checkpoint interval: the job "
                f"barely progresses, and this first-order overhead is optimistic")
    jpt = joules_per_s / est.tokens_per_s if joules_per_s is not None else None
    return RunCost(
        gpu_hours=gpu_hours, price_per_gpu_hour=price, cost=gpu_hours * price if price > 0 else None, busy_fraction=busy,
        tdp_w=dev.tdp_w, idle_power_fraction=C.IDLE_POWER_FRACTION, power_w_per_gpu=power, energy_kwh=energy_kwh, energy_j_per_token=jpt,
        failures_per_gpu_hour=rate, failures_source="Llama 3 default" if cl.failures_per_gpu_hour is None else "config",
        mtbf_hours=mtbf_h, checkpoint_bytes_per_gpu=ckpt_bytes, checkpoint_save_s=delta,
        checkpoint_source="estimated" if cl.checkpoint_save_s is None else "config",
        restart_s=restart, restart_source="assumed" if cl.restart_s is None else "config",
        elastic_restart_s=elastic_restart, elastic_overhead=elastic, elastic_goodput=1 / (1 + elastic),
        elastic_days_with_failures=est.days * (1 + elastic),
        checkpoint_interval_s=tau, checkpoint_every_steps=every, overhead=overhead, goodput=1 / (1 + overhead),
        days=est.days, days_with_failures=days_f, expected_failures=0.0 if math.isinf(mtbf_h) else days_f * 24 / mtbf_h,
        gpu_hours_with_failures=days_f * 24 * n, cost_with_failures=days_f * 24 * n * price if price > 0 else None, note=note)
