"""What a training run reports about its steps: console lines on rank 0 and a metrics.jsonl /
TensorBoard record per logging step (train/metrics.py MetricsLogger writes them).

The trainer runs the steps and hands each finished one over (StepLog.after_step) with the state its
record reports; the wording, the derived rates (tokens/s, MFU) and the pipeline timeline file live
here. Building a record is a collective under MoE (the router statistics are summed over every rank),
so every rank calls after_step for every step; only rank 0 prints or writes.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import Config
from shardwise.parallel.comm_counter import describe_comm
from shardwise.parallel.compile import compile_enabled, compiled_graphs, inductor_graphs
from shardwise.parallel.precision import DynamicLossScaler
from shardwise.spec.dims import ParallelDims, offload_tier
from shardwise.spec.layout import compute_precision
from shardwise.train import eviction, moe_stats
from shardwise.train.evaluate import eval_words
from shardwise.train.health import StepGuard
from shardwise.train.live_metrics import serve
from shardwise.train.metrics import MetricsLogger, mfu, tokens_per_s_per_device
from shardwise.train.peak_flops import device_peak_flops
from shardwise.train.pipeline_chart import CHART_FILE, describe, write_timeline
from shardwise.train.planned_memory import PlannedMemory, local_world_size, planned_memory
from shardwise.train.power import JOULES_PER_KWH, EnergyMeter, agreed, nvml_energy_reader


@dataclass
class StepResult:
    """One optimizer step, as Trainer.train_step returns it."""

    loss: float
    grad_norm: float
    lr: float
    seconds: float
    skipped: bool      # non-finite loss or gradient norm on some rank: no optimizer step anywhere
    stop_code: int = 0  # 130 / 143 when some rank was asked to stop (train/signals.py)
    comm_counted: bool = False  # this step counted every collective's bytes (the first step a Trainer runs)


class StepLog:
    """One run's step reports. Opening it creates the run directory and metrics files (rank 0) and
    prints the run's header line; close() ends the progress bar and writes loss_curve.png.

    `guard` and `scaler` are read when a step is reported (skipped-step counts, the fp16 loss scale);
    `moe_layers` / `moe_group` are what moe_stats.gather sums the router statistics over."""

    def __init__(self, cfg: Config, dims: ParallelDims, *, run_dir: Path, rank: int, quiet: bool, start_step: int,
                 accumulation: int, num_params: int, flops_per_token: float, device: torch.device,
                 guard: StepGuard, scaler: DynamicLossScaler, moe_layers: dict, moe_group: dist.ProcessGroup | None,
                 energy_group: dist.ProcessGroup | None = None, io_stats: Callable[[], dict] | None = None,
                 precision_defaulted: bool = False, source_tokens: Callable[[int], dict[str, int]] | None = None):
        """`io_stats`: the NVMe offload tier's disk figures so far (parallel/offload.py IOStats.as_dict),
        added to every record; None without it. `precision_defaulted`: train.precision was unset and
        the trainer chose it for the device (the start-up line says so). `source_tokens(step)`: a mixture's
        tokens read from each source by the end of that step (tokens_<name> in the records and the summary)."""
        t = cfg.train
        self.cfg, self.dims, self.run_dir, self.rank, self.quiet = cfg, dims, run_dir, rank, quiet
        self.io_stats = io_stats
        self.source_tokens = source_tokens
        self.last_step = start_step
        self.flops_per_token, self.guard, self.scaler = flops_per_token, guard, scaler
        self.moe_layers, self.moe_group = moe_layers, moe_group
        self.device_type = device.type
        # GPU energy (train/power.py): summed over ranks on logging steps, so every rank must have a reading.
        self.energy = EnergyMeter(agreed(nvml_energy_reader(device), energy_group, device), device)
        self.energy_group = energy_group
        self.tokens_since_log, self.seconds_since_log = 0, 0.0
        self.run_tokens, self.run_seconds, self.run_steps = 0, 0.0, 0  # for the end-of-run summary
        self.logged: list[dict] = []  # tokens/s, MFU, peak memory of each logged step (summary's medians)
        self.comm_counted_step: int | None = None
        # Graphs this run compiled: dynamo's counter is per process, and a process may train several runs.
        self.compiled = compile_enabled(cfg, device.type)
        self.graphs_before = compiled_graphs() if self.compiled else 0
        self.inductor_before = inductor_graphs() if self.compiled else (0, 0)
        self.last_timeline: dict | None = None  # the newest recorded pipeline step, written at the end
        self.last_eval: tuple[int, dict] | None = None  # the newest validation round (step, record)
        self.stragglers_named = 0  # straggler lines that named a rank this run (train/straggler.py)
        self.straggler_record: dict = {}  # the newest straggler window's keys, added to the next logged step's record
        writer = rank == 0
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLogger(run_dir, t.steps, start_step, is_writer=writer, progress=cfg.run.progress,
                                     tensorboard=cfg.run.tensorboard, loss_curve=cfg.run.loss_curve,
                                     live=serve(cfg.run) if writer else None)  # run.metrics_port: served from here
        cuda_name = torch.cuda.get_device_name() if device.type == "cuda" else None
        self.peak, peak_label = device_peak_flops(device.type, compute_precision(t.precision), cuda_name)
        # The planner's peak for this run on this GPU, beside the measured one (train/planned_memory.py).
        self.planned = planned_memory(cfg, dims.world_size, local_world_size(dims.world_size), cuda_name) \
            if cuda_name else None
        if not quiet:
            layout = "one process" if dims.world_size == 1 else f"{dims.describe()} x{dims.world_size}"
            self.metrics.print(f"model: {cfg.model.arch} {num_params / 1e6:.2f}M params, layout "
                               f"{layout}, zero={cfg.parallel.zero}, accumulation "
                               f"{accumulation}, {_precision_words(t.precision, precision_defaulted, device)}, "
                               f"{'compiled' if self.compiled else 'eager'}"
                               f"{' (train.compile unset)' if self.compiled and t.compile is None else ''}, "
                               f"peak {_flops(self.peak)} ({peak_label})"
                               + (f", offload {offload_tier(cfg.parallel)}" if offload_tier(cfg.parallel) != "none" else "")
                               + (f", MLP in {cfg.parallel.linear_tiles} tiles" if cfg.parallel.linear_tiles > 1 else "")
                               + (", q|k|v and w1|w3 joined" if t.fuse_projections else "")
                               + (f", weights from {cfg.model.init_from}" if cfg.model.init_from else "")
                               + (f", planned peak {self.planned.words()}" if self.planned else ""))
            if self.planned is not None and (warning := self.planned.warning()):
                self.metrics.print(warning)

    def after_step(self, r: StepResult, step: int, logging: bool, timeline: dict | None,
                   comm_bytes: dict[str, dict[str, int]], memory: dict[str, list[int]]) -> None:
        """Report step `step` (1-based, done): the progress bar, a line for a skipped step, and on
        logging or skipped steps the metrics record. `timeline` is the step's pipeline summary when it
        was recorded (rank 0), `memory` the newest bytes per category and rank."""
        t = self.cfg.train
        if r.comm_counted:
            self.comm_counted_step = step  # named in the records: with PowerSGD the first step after its warm-up
        if r.comm_counted and not self.quiet and comm_bytes:
            self.metrics.print(f"communication per step on rank 0 (payload bytes): {describe_comm(comm_bytes)}")
        self.metrics.progress(step, r.loss, t.global_batch * t.seq_len / r.seconds)
        self.tokens_since_log += t.global_batch * t.seq_len
        self.seconds_since_log += r.seconds
        self.run_tokens += t.global_batch * t.seq_len
        self.run_seconds += r.seconds
        self.run_steps += 1
        self.last_step = step
        if r.skipped and not self.quiet:
            self.metrics.print(f"step {step}: loss {r.loss:g}, grad norm {r.grad_norm:g}: not finite, step skipped "
                               f"on every rank ({self.guard.in_a_row} in a row; the run stops at "
                               f"train.max_skipped_steps={t.max_skipped_steps})")
        if logging or r.skipped:  # every rank: the MoE statistics are a collective
            self.metrics.log(step, self._record(r, step, timeline, comm_bytes, memory))

    def after_eval(self, step: int, record: dict) -> None:
        """Report a validation round after step `step`: a line, and its own metrics.jsonl / TensorBoard record."""
        self.last_eval = (step, record)
        if not self.quiet:
            self.metrics.print(f"step {step} validation: {eval_words(record)} ({record['eval_time_s']:.1f} s)")
        self.metrics.log(step, record)

    def after_straggler_window(self, step: int, record: dict, lines: list[str]) -> None:
        """Rank 0, at the end of a straggler window (train/straggler.py): its lines now; its keys go into the next
        logged step's record (no record of their own: a step's record keeps its loss, as readers expect)."""
        for line in lines:
            self.metrics.print(line)
        self.stragglers_named += sum(line.startswith("straggler: ") and "no longer slow" not in line for line in lines)
        self.straggler_record = {**record, "straggler/window_end_step": step}

    def _record(self, r: StepResult, step: int, timeline: dict | None, comm_bytes: dict[str, dict[str, int]],
                memory: dict[str, list[int]]) -> dict:
        """The metrics.jsonl record of a step (collective under MoE)."""
        t = self.cfg.train
        tokens_per_step = t.global_batch * t.seq_len
        per_device = tokens_per_s_per_device(tokens_per_step // self.dims.dp, r.seconds, self.dims.non_dp)
        record = {"loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tokens_per_step / r.seconds,
                  "tokens_per_s_per_device": per_device, "step_time_s": r.seconds,
                  "mfu": mfu(self.flops_per_token, per_device, self.peak), "skipped": int(r.skipped),
                  "skipped_steps": self.guard.skipped_total, "loss_scale": self.scaler.scale,
                  "time": time.time()}  # wall clock, Unix seconds: when the step ended (and was logged)
        record.update({f"mem_{k}_bytes": v[self.rank] for k, v in memory.items()})
        record.update(self.straggler_record)
        record.update({f"comm_{axis}_bytes": sum(kinds.values()) for axis, kinds in comm_bytes.items()})
        record["comm_bytes_per_step"] = comm_bytes
        if self.comm_counted_step is not None:
            record["comm_counted_step"] = self.comm_counted_step
        record["memory_per_rank_bytes"] = memory
        if self.io_stats is not None:
            record.update(self.io_stats())
        if self.source_tokens is not None:
            record.update({f"tokens_{name}": n for name, n in self.source_tokens(step).items()})
        if self.moe_layers or self.cfg.model.moe.num_experts:
            record.update(moe_stats.gather(self.moe_layers, self.cfg.model, self.moe_group))
            if not self.quiet:
                # The loss is on the progress line already: this line adds the router's state only.
                self.metrics.print(f"step {step} experts: aux loss {record['moe_aux_loss']:.4f} | "
                                   f"load max/min {record['moe_load_max']:.2f}/{record['moe_load_min']:.2f} | "
                                   f"dropped {record['moe_dropped_frac'] * 100:.2f}%")
        if self.energy.enabled:
            record.update(self.energy.interval(self.tokens_since_log, self.seconds_since_log, self.energy_group))
        self.tokens_since_log, self.seconds_since_log = 0, 0.0
        self.logged.append({k: record[k] for k in ("tokens_per_s", "mfu", "mem_max_memory_allocated_bytes") if k in record})
        if self.compiled:  # constant after the first steps: nothing recompiles
            record["compiled_graphs"] = compiled_graphs() - self.graphs_before
            made, cached = inductor_graphs()
            record["inductor_graphs"] = made - self.inductor_before[0]
            record["inductor_graphs_from_cache"] = cached - self.inductor_before[1]
        if timeline is not None:
            record["pp_bubble_measured"] = timeline["bubble_measured"]
            record["pp_bubble_theoretical"] = timeline["bubble_theoretical"]
            record["pp_bubble_order"] = timeline["bubble_order"]
            self.last_timeline = timeline
        return record

    def write_pipeline_timeline(self) -> None:
        """At the end of a run: the newest recorded pipeline step's timeline and chart (rank 0)."""
        if self.rank == 0 and self.last_timeline is not None:
            path = write_timeline(self.run_dir, self.last_timeline)
            if not self.quiet:
                self.metrics.print(f"pipeline schedule: {describe(self.last_timeline)}; chart {path.parent / CHART_FILE}")

    def summary(self) -> str:
        """The end-of-run line: steps, tokens and time of this run; the median tokens/s and MFU of its
        logged steps after the first (compilation, the communication count), when it logged several; the
        peak allocated memory; and the GPU energy of the whole job (NVML, all GPUs), where measured."""
        steady = self.logged[1:] or self.logged
        parts = [f"done: {self.run_steps} steps, {self.run_tokens:,} tokens in {self.run_seconds:.1f} s of steps"]
        rates = [r["tokens_per_s"] for r in steady if "tokens_per_s" in r]
        if rates:
            mfus = [r["mfu"] for r in steady if "mfu" in r]
            # MFU against a GPU's datasheet peak only: a CPU's probe varies from run to run (30-137 GFLOP/s
            # measured on the 2-core CI machine), so its MFU compares with nothing.
            mfu = f", MFU {statistics.median_high(mfus):.1%}" if mfus and self.device_type != "cpu" else ""
            parts.append(f"median {statistics.median_high(rates):,.0f} tokens/s{mfu}")
        peak = max((r.get("mem_max_memory_allocated_bytes") or 0) for r in self.logged) if self.logged else 0
        if peak:
            parts.append(peak_words(peak, self.planned))
        if self.source_tokens is not None:
            read = self.source_tokens(self.last_step)
            total = max(1, sum(read.values()))
            parts.append("tokens read by source: " + ", ".join(f"{name} {n:,} ({n / total:.1%})" for name, n in read.items()))
        if self.last_eval is not None:
            parts.append(f"validation at step {self.last_eval[0]}: {eval_words(self.last_eval[1])}")
        if self.stragglers_named:
            parts.append(f"{self.stragglers_named} straggler{'s' if self.stragglers_named != 1 else ''} named (lines above)")
        evicted = eviction.count(self.run_dir) if self.cfg.run.evict_stragglers else 0
        if evicted:  # recorded by the evicted nodes (train/eviction.py): the group that finishes named none of them
            parts.append(f"{evicted} node{'s' * (evicted != 1)} evicted as stragglers ({self.run_dir / 'evicted'})")
        if self.energy.enabled and self.energy.total_tokens:
            parts.append(f"GPU energy {self.energy.total_joules / JOULES_PER_KWH:.3g} kWh, "
                         f"{self.energy.total_joules / self.energy.total_tokens:.3g} J/token (all GPUs)")
        return "; ".join(parts)

    def close(self, finished: bool = False) -> None:
        """`finished`: the loop reached train.steps (not an error): print the summary first."""
        if finished and not self.quiet and self.run_steps:
            self.metrics.print(self.summary())
        self.metrics.close()


def _flops(per_s: float) -> str:
    """A GPU's 989.4 TFLOP/s read 989400.0 GFLOP/s; a CPU's probe stays in GFLOP/s."""
    return f"{per_s / 1e12:.1f} TFLOP/s" if per_s >= 1e12 else f"{per_s / 1e9:.1f} GFLOP/s"


def peak_words(peak_bytes: int, planned: PlannedMemory | None) -> str:
    """The summary's memory: rank 0's allocator peak and, on a GPU of the planner's table, its prediction."""
    return f"peak memory {peak_bytes / 2**30:.2f} GiB on rank 0" + (
        f" (planned {planned.total_bytes / 2**30:.2f} for the most loaded rank)" if planned else "")


def _precision_words(precision: str, defaulted: bool, device: torch.device) -> str:
    """"bf16 (train.precision unset: bf16 on this GPU)", "fp32 with TF32 matmuls", ... for the start-up line."""
    words = precision
    if precision == "fp32" and device.type == "cuda":
        words += " with TF32 matmuls" if torch.backends.cuda.matmul.allow_tf32 else " (TF32 off)"
    if defaulted:
        words += f" (train.precision unset: {precision} on this {'GPU' if device.type == 'cuda' else 'device'})"
    return words
