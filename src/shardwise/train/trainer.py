"""The training loop: data -> forward/backward (accumulated) -> clip -> optimizer -> metrics -> checkpoint.

One Trainer serves every layout. On one process it runs without any process group (the reference
of the parity contract); under torchrun (or a test harness that initialized the default group) it
uses the mesh ParallelDims builds. Loss is the token mean over the whole global batch (docs/architecture.md §3).

This module runs the steps and owns the training state (model, optimizer, checkpoints). It does not
know which data-parallel wrapper is in use: parallel/data_parallel.py GradientSync says how each
micro-batch's gradients are reduced. What a step reports (console lines, metrics.jsonl) is
train/step_log.py; the timing of pipeline schedules is train/pipeline_chart.py TimelineRecorder.
"""
from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from shardwise.config import Config
from shardwise.data.chat import chat_files
from shardwise.errors import EXIT_SIGTERM, Diverged, Interrupted, OutOfMemory, out_of_memory, rerun_to_resume
from shardwise.models import build_model
from shardwise.models.common import Transformer, document_kernel, document_positions
from shardwise.parallel.comm_counter import CONTROL_AXIS, CommCounter, axis_names
from shardwise.parallel.compile import compile_enabled
from shardwise.parallel.context import zigzag_index
from shardwise.parallel.data_parallel import gradient_group, gradient_sync, unwrap, zero1_group
from shardwise.parallel.grad_compression import add_hook_bytes, checkpoint_state, restore_state, steady_state_step
from shardwise.parallel.mesh import build_meshes
from shardwise.parallel.parallelize import build_parallel_model, build_pipeline
from shardwise.parallel.pipeline import PipelineRun, boundary_dtype, check_stage_transport
from shardwise.parallel.precision import DynamicLossScaler, autocast, resolve_precision, set_matmul_precision
from shardwise.parallel.tensor2d import Grid, cross_entropy_sum, vocab_offset
from shardwise.preflight import check, check_batch
from shardwise.spec.dims import lowp_params, offload_tier
from shardwise.spec.layout import PER_OP_POLICIES, fp8_gemm_fits
from shardwise.tensors import local_shard
from shardwise.train import eviction, moe_stats
from shardwise.train import manifest as mf
from shardwise.train.agreement import check_same_setup, setup_facts
from shardwise.train.checkpoint import CheckpointManager, read_rank_state
from shardwise.train.collective_wait import mesh_axis_groups
from shardwise.train.control import Control
from shardwise.train.data import (
    PreparedData,
    TokenBatches,
    batch_sources,
    loss_token_count,
    prepare_data,
    split_inputs_targets,
    split_micro_batches,
)
from shardwise.train.distributed import default_device
from shardwise.train.evaluate import describe_sets, eval_sets, evaluate
from shardwise.train.eviction import Eviction, NodeSeat
from shardwise.train.full_model import full_model_state, gather_pipeline_state, pipeline_owners
from shardwise.train.health import StepGuard, Verdict
from shardwise.train.loader import BatchPrefetcher
from shardwise.train.loss import EAGER as EAGER_LOSS
from shardwise.train.loss import LossKernels, token_cross_entropy_sum
from shardwise.train.memory_meter import ActivationMeter, PeakActivationMeter, cuda_memory, memory_by_category
from shardwise.train.optim import apply_hyperparameters, build_optimizer, build_scheduler, clip_grad_norm
from shardwise.train.out_of_memory import VIEWER, MemorySnapshot, first_to_report, out_of_memory_line, saving_checkpoint, saving_final_model
from shardwise.train.pipeline_chart import TimelineRecorder
from shardwise.train.rundir import resume_changes
from shardwise.train.signals import StopRequest
from shardwise.train.step_log import StepLog, StepResult
from shardwise.train.straggler import StragglerWatch


class Trainer:
    def __init__(self, cfg: Config, log: Callable[[str], None] | None = print, single_process: bool = False,
                 data: PreparedData | None = None, stop: StopRequest | None = None, run_id: str = "",
                 restarted: bool = False, seat: NodeSeat | None = None):
        """`log=None` silences the trainer's messages (parity, tests); `single_process=True` ignores an
        initialized process group (the in-process reference); `data` is the corpus a caller already
        prepared for this config (else it is prepared, or loaded from the cache, here). `stop` is a
        stop request the caller installed (else train() installs one); `run_id` names the job in the
        checkpoints it writes, and `restarted` (an automatic restart of that job) resumes from them
        even with checkpoint.resume=false. `seat`: this rank's node in an elastic job that evicts stragglers
        (train/eviction.py)."""
        distributed = dist.is_initialized() and not single_process
        self.rank = dist.get_rank() if distributed else 0
        world_size = dist.get_world_size() if distributed else 1
        self.device = default_device()
        # train.precision unset: bf16 on a GPU with it, fp32 elsewhere; the start-up line says which.
        self.precision_defaulted = cfg.train.precision is None
        cfg = self.cfg = resolve_precision(cfg, self.device)
        set_matmul_precision(cfg.train.tf32, self.device)
        self.run_dir = Path(cfg.run.dir)
        self.quiet = log is None or self.rank != 0
        self.log = (lambda _msg: None) if self.quiet else log
        self.data = data or prepare_data(cfg.data, cfg.model.vocab_size, log=self.log)
        tokenizer_sha256 = mf.file_digest(self.data.tokenizer_path)[1]
        self.fingerprint = mf.fingerprint(cfg, self.data.num_tokens, tokenizer_sha256)
        self.control = Control(distributed, cfg.run.collective_timeout_s)
        if distributed:  # before any collective that depends on the layout (train/agreement.py)
            check_same_setup(setup_facts(cfg, self.data.num_tokens, self.data.tokens_sha256, tokenizer_sha256,
                                         self.data.valid_sha256),
                             self.control)
        self.dims = check(cfg, world_size)
        check_stage_transport(self.dims.pp, dist.get_backend() if distributed else "none", self.device.type)
        self.accumulation = check_batch(cfg, self.dims)
        self.mesh = build_meshes(self.dims, self.device.type)
        # The logged loss is averaged over every rank with its own tokens: dp, and cp's sequence shards.
        self.loss_group = gradient_group(self.mesh)
        # Context parallel: this rank's tokens of every sequence (the load-balanced zigzag split).
        self.cp_index = zigzag_index(cfg.train.seq_len, self.dims.cp, self.dims.coordinates(self.rank)["cp"]) \
            if self.dims.cp > 1 else None
        self.batch_rank = self.dims.batch_rank(self.rank)
        self.run_id, self.restarted = run_id, restarted
        # Before the model exists: the snapshot then shows the parameters' allocations too.
        self.snapshot = MemorySnapshot(cfg.run.memory_snapshot, self.device, self.run_dir, self.rank)
        if self.snapshot.note:
            self.log(self.snapshot.note)
        t = cfg.train
        self.batches = TokenBatches(batch_sources(self.data, t.seq_len, cfg.data.loss_on), t.seq_len, t.global_batch, t.seed)
        if self.data.finetune and self.rank == 0:  # fine-tuning records: how they fill the rows
            for s in self.batches.sources:
                self.log(f"data: {s.name}: {s.tokens.facts().line(cfg.data.loss_on)}"
                         + ("" if t.document_mask else "; the records of a row see each other (train.document_mask = "
                            "true keeps each to itself)"))
        self.loader = BatchPrefetcher(self.batches, self.batch_rank, self.dims.dp, t.micro_batch, cfg.data.num_workers,
                                      t.steps, pin_memory=self.device.type == "cuda")
        self.eval_sets = eval_sets(self.data.valid_sets(), cfg)  # validation (train/evaluate.py)
        if self.eval_sets:
            self.log(describe_sets(self.eval_sets, cfg))

        with torch.device("meta"):
            model = build_model(cfg.model)
        self.num_params = model.num_params()
        self.flops_per_token = model.flops_per_token(t.seq_len)
        self.pipeline: PipelineRun | None = None
        if self.dims.pp > 1:
            self.model = self._build_pipeline()
        else:
            self.model = build_parallel_model(model, self.dims, self.mesh, cfg, self.device)
        self.inner = unwrap(self.model)
        # Packed rows of several documents (train.document_mask / document_positions, models/common.py): the
        # mask and the positions are separate keys (a run may mask documents with positions over the row).
        self.document_positions = t.document_mask if t.document_positions is None else t.document_positions
        self.document_mask = t.document_mask
        if t.document_mask:
            for module in self.inner.modules():
                if isinstance(module, Transformer):  # the model, or each pipeline stage's part of it
                    module.document_kernel = document_kernel(self.device.type)
        self.grid = Grid(self.mesh.tp_grid) if self.mesh is not None and self.mesh.tp_grid is not None else None
        self.vocab_offset = vocab_offset(self.inner) if self.grid is not None else 0
        self.compiled = compile_enabled(cfg, self.device.type)
        # The chunked cross-entropy's two per-chunk computations, fused when the blocks are compiled (train/loss.py).
        self.loss_kernels = LossKernels.compiled(t.compile_backend) if self.compiled else EAGER_LOSS
        if t.precision == "fp8":
            fp8 = sum(type(m).__name__ == "Float8Linear" for m in self.inner.modules())
            # the head's dims decide too (spec/layout.py fp8_gemm_fits): the line says what was converted
            head = t.fp8_head and fp8_gemm_fits(cfg.model.dim, cfg.model.vocab_size)
            self.log(f"fp8: {fp8} linears in FP8 ({t.fp8_recipe} scaling{', the output head included' if head else ''}), "
                     f"{'routers' if head else 'the output head and routers'} in bf16"
                     + ("; emulated on CPU (torchao): for correctness, not speed" if self.device.type == "cpu" else ""))
        # How each micro-batch's gradients are reduced (DDP no_sync, FSDP2's flag, ...): data_parallel.py.
        self.gradient_sync = gradient_sync(self.model, self.dims, cfg.parallel)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        zero1 = zero1_group(self.mesh, self.dims) if cfg.parallel.zero == 1 else None
        tier = offload_tier(cfg.parallel)
        self.optimizer = build_optimizer(self.inner, t, zero1, fused=self.device.type == "cuda" or tier != "none",
                                         nvme_dir=cfg.parallel.offload_dir if tier == "nvme" else None, rank=self.rank)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.scaler = DynamicLossScaler(enabled=t.precision == "fp16")
        self.world_group = dist.group.WORLD if distributed else None
        self.stop = stop
        self.guard = StepGuard(self.control, t.max_skipped_steps, stop, t.spike_ratio, t.spike_window)
        self.tokens_per_rank_step = t.micro_batch * self.accumulation * t.seq_len // self.dims.cp
        # What a micro-batch's loss sum is divided by (_token_loss): this rank's share of the step's tokens,
        # or of a fine-tuning step's tokens that carry loss (_count_loss_tokens, set each step).
        self.loss_denominator: torch.Tensor | int = self.tokens_per_rank_step
        self.step = 0
        # Times the pipeline schedule on the steps the loop asks for (pipeline_chart.py).
        self.timeline = TimelineRecorder(cfg.parallel, self.dims, self.accumulation, self.rank, self.device)
        self.activation_bytes = 0
        self.group_axes = axis_names(self.mesh) if distributed else {}
        if self.control.group_name is not None:
            self.group_axes[self.control.group_name] = CONTROL_AXIS
        self.moe_layers = moe_stats.moe_layers(self.inner)
        self.comm_bytes: dict[str, dict[str, int]] | None = None
        # Which step counts the collectives: the first in steady state (after PowerSGD's warm-up of
        # plain all-reduces: parallel/grad_compression.py), and its checkpointed state.
        self.comm_count_step = steady_state_step(cfg.parallel, self.dims)
        self.grad_compression = getattr(self.model, "grad_compression_state", None)
        self.last_memory: dict[str, list[int]] = {}
        self.checkpoints = CheckpointManager(Path(cfg.checkpoint.dir or self.run_dir / "checkpoints"), cfg.checkpoint.keep,
                                             self.control, self.log, resumes=cfg.checkpoint.resume)
        if cfg.checkpoint.resume or restarted:
            self._maybe_resume()
        self.batches.check_epochs(t.steps)  # a mixture's max_epochs, over the steps left (cli.py asked already)
        # Per-rank timing and the slow rank's name (run.straggler_every, train/straggler.py).
        self.data_wait_s = 0.0
        self.straggler = StragglerWatch.start(
            cfg.run, [b for m in self.inner.modules() if isinstance(m, Transformer) for b in m.blocks()], self.rank,
            self.world_group, self.device, seat if cfg.run.evict_stragglers else None, last_step=t.steps,
            axis_groups=mesh_axis_groups(self.mesh) if distributed else ())

    def _build_pipeline(self) -> torch.nn.Module:
        cfg, dims = self.cfg, self.dims
        parts = build_pipeline(dims, self.mesh, cfg, self.device, dims.coordinates(self.rank)["pp"])
        self.pipeline_layers = parts.layers
        self._start_pipeline(parts)
        return parts.model

    def _start_pipeline(self, parts) -> None:
        """self.pipeline: the schedule over this rank's stages of `parts` (build_pipeline's), with the shapes and
        dtypes its stages exchange (also launch/dryrun_step.py's, on meta stages)."""
        cfg, dims, t = self.cfg, self.dims, self.cfg.train
        local = t.seq_len // dims.cp  # a cp rank's share of each sequence
        seq = local // dims.tp if dims.tp > 1 and cfg.parallel.sequence_parallel else local
        low = lowp_params(dims.wrapper(cfg.parallel.zero))
        vocab = -(-cfg.model.vocab_size // dims.tp)  # the loss reads the real (DTensor) logits; shape only
        io = {"tokens": ((t.micro_batch, local), torch.int64),
              "hidden": ((t.micro_batch, seq, cfg.model.dim), boundary_dtype(t.precision, low)),
              "logits": ((t.micro_batch, local, vocab), torch.float32)}
        self.pipeline = PipelineRun(parts.stages, len(parts.layers), cfg.parallel.pp_schedule, self.accumulation,
                                    self._pipeline_loss, self.mesh["pp"].get_group(), self.device, io, t.precision)

    def _cp_split(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's tokens of (b, seq) inputs and targets; the targets of a token stay with it."""
        if self.cp_index is None:
            return inputs, targets
        return inputs[:, self.cp_index].contiguous(), targets[:, self.cp_index].contiguous()

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(self._token_loss(logits, targets))

    # ---- one optimizer step ----
    def _loss_context(self):
        """With TP the logits stay vocab-sharded: cross-entropy and its backward run under
        loss_parallel, which reduces the max / sum-exp / target logit over tp instead of gathering
        the (b, s, V) logits."""
        return loss_parallel() if self.dims.tp > 1 and self.dims.tp_mode == "1d" else contextlib.nullcontext()

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._token_loss(self._forward(inputs), targets)

    def _document_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keywords for packed documents: `positions` (train.document_positions: each document's
        own, restarting after every end token) and `documents` (train.document_mask: the same, for the mask)."""
        if not (self.document_positions or self.document_mask):
            return {}
        within = document_positions(inputs, self.data.eod_id)
        return {**({"positions": within} if self.document_positions else {}),
                **({"documents": within} if self.document_mask else {})}

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits of a micro-batch; with packed documents, their positions and mask (_document_kwargs)."""
        with autocast(self.cfg.train.precision, self.device.type):
            return self.model(inputs, **self._document_kwargs(inputs))

    def _token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over tokens / tokens this rank sees per step; the data-parallel gradient average then
        makes it the token mean over the global batch, identical to the reference. 2-D TP: this rank's
        logits block, the micro-batch's sum on every tp rank (parallel/tensor2d.py)."""
        return self._token_sum(logits, targets) / self.loss_denominator

    def _token_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.grid is not None:
            return cross_entropy_sum(self.grid, logits, targets, self.vocab_offset)
        return token_cross_entropy_sum(logits, targets, self.dims.tp, kernels=self.loss_kernels)

    # ---- validation (train/evaluate.py runs the rounds) ----
    def eval_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """The sum of per-token losses over this rank's rows of a validation batch, forward only (float64)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        micro = split_micro_batches(rows, self.cfg.train.micro_batch)
        with torch.no_grad(), self._loss_context():
            if self.pipeline is not None:
                inputs, targets = self._pipeline_inputs(micro)
                losses = self.pipeline.evaluate(inputs, targets, self._token_sum, self._document_kwargs(inputs))
                for loss in losses:
                    total += local_shard(loss).double()
                return total
            for batch in micro:
                inputs, targets = (x.to(self.device, non_blocking=True) for x in self._cp_split(*split_inputs_targets(batch)))
                total += local_shard(self._token_sum(self._forward(inputs), targets)).double()
        return total

    def reduce_eval_sum(self, total: torch.Tensor) -> torch.Tensor:
        """A validation sum over the ranks that hold other tokens (as the logged training loss is)."""
        if self.pipeline is not None:  # only the last stage has the loss
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
        return total

    def train_step(self, measure_memory: bool = False) -> StepResult:
        """One optimizer step; `measure_memory` records bytes by category while gradients exist.
        The first step a Trainer runs also counts the bytes of every collective (per axis, per kind):
        they are the same every step, and counting slows the step it watches."""
        start = time.perf_counter()
        counting = self.comm_bytes is None and self.step >= self.comm_count_step
        # The counting step runs the compiled blocks eagerly: dynamo declines a frame first called under a
        # TorchDispatchMode (the counter) and then never compiles that code (measured, torch 2.13); the
        # collectives, and so the bytes counted, are the same compiled or not.
        eager = torch.compiler.set_stance("force_eager") if counting and self.compiled else contextlib.nullcontext()
        with eager, CommCounter(self.group_axes) if counting else contextlib.nullcontext() as counter:
            loss_sum, grad_norm, lr, verdict = self._forward_backward_update()
        if counting:
            self.comm_bytes = add_hook_bytes(counter.totals(), self.grad_compression, self.group_axes)
        if measure_memory:
            self.last_memory = self.memory_per_rank()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:  # only the last stage has the loss
            dist.all_reduce(loss_sum, group=self.mesh["pp"].get_group())
        if self.loss_group is not None:  # the logged loss only; not part of training traffic
            dist.all_reduce(loss_sum, group=self.loss_group)
            loss_sum /= self.dims.dp * self.dims.cp
        self.step += 1
        loss_value, norm_value = torch.stack([loss_sum, grad_norm.float().to(loss_sum.device)]).tolist()  # one host sync
        return StepResult(loss_value, norm_value, lr, time.perf_counter() - start, verdict.skip, verdict.stop_code,
                          comm_counted=counting)

    def _forward_backward_update(self) -> tuple[torch.Tensor, torch.Tensor, float, Verdict]:
        t = self.cfg.train
        waited = time.perf_counter()
        micro = self.loader.micro_batches(self.step)
        self.data_wait_s = time.perf_counter() - waited
        if self.data.finetune:
            self.loss_denominator = self._count_loss_tokens(micro)
        moe_stats.reset(self.moe_layers)
        moe_stats.set_aux_grad_scale(self.moe_layers, self.scaler.scale / self.accumulation)
        loss_sum = self._pipeline_forward_backward(micro) if self.pipeline is not None else self._accumulate(micro)
        overflow = self.scaler.unscale_(p.grad for p in self.params if p.grad is not None)
        grad_norm = clip_grad_norm(self.params, t.grad_clip, self.mesh["pp"].get_group() if self.pipeline else None)
        lr = self.scheduler.get_last_lr()[0]
        # Every rank agrees whether this step is finite (and whether to stop): train/health.py.
        verdict = self.guard.verdict(loss_sum, grad_norm, overflow)
        if not verdict.skip:
            self.optimizer.step()
        self.scaler.update(verdict.skip)
        self.scheduler.step()
        return loss_sum, grad_norm, lr, verdict

    @contextlib.contextmanager
    def _memory_failure(self, report: StepLog, step: int, evaluating: bool = False):
        """A failed allocation in `step` (or in the validation round after it) becomes OutOfMemory (exit 7)
        with its one line (train/out_of_memory.py); any other error passes."""
        try:
            yield
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            what = out_of_memory(e)
            if what is None:
                raise
            line = out_of_memory_line(self.cfg, self.rank, step, self.device.type, what, self.snapshot.out_of_memory(),
                                      report.planned, evaluating=evaluating)
            raise OutOfMemory(line, report=first_to_report(self.run_dir, self.run_id, line)) from None

    def _count_loss_tokens(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """A fine-tuning step's loss is the mean over the global batch's tokens that carry loss (as one
        device computes it): this rank's share of their count, the count summed over the ranks that hold
        other tokens (data and context parallel; one small all-reduce a step) over their number, which
        the gradients' average over those ranks divides by again."""
        count = sum(loss_token_count(self._cp_split(*split_inputs_targets(batch))[1]) for batch in micro)
        count = count.to(self.device, torch.float32)
        if self.loss_group is not None:
            dist.all_reduce(count, group=self.loss_group)
        return count.clamp(min=1) / (self.dims.dp * self.dims.cp)

    def _cached_by_checkpoint(self) -> dict:
        """What selective "op" recomputation keeps outside autograd's saved tensors: the outputs of the
        policy's ops in every block (ActivationMeter counts them; docs/architecture.md §5)."""
        t = self.cfg.train
        if t.recompute != "selective" or t.recompute_policy not in PER_OP_POLICIES:
            return {}
        return {"cached_regions": self.inner.blocks(), "alternate_matmuls": t.recompute_policy == "op_alternate"}

    def _accumulate(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch in turn (gradient accumulation); the loss sum."""
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            inputs, targets = (x.to(self.device, non_blocking=True) for x in self._cp_split(*split_inputs_targets(batch)))
            with self.gradient_sync.micro_batch(i, len(micro)), self._loss_context():
                if self.activation_bytes == 0 and i == 0:
                    with ActivationMeter(exclude=self.inner, **self._cached_by_checkpoint()) as meter:
                        loss = self._loss(inputs, targets)
                    self.activation_bytes = meter.bytes
                else:
                    loss = self._loss(inputs, targets)
                self.scaler.scale_loss(loss).backward()
            # With loss parallel the loss is a replicated DTensor: every tp rank holds the value.
            loss_sum += local_shard(loss.detach())
        return loss_sum

    def _pipeline_inputs(self, micro: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """All micro-batches' inputs and targets (this cp rank's tokens) as one batch on the device, as the
        pipeline schedules take them."""
        pairs = [self._cp_split(*split_inputs_targets(batch)) for batch in micro]
        return torch.cat([i for i, _ in pairs]).to(self.device), torch.cat([t for _, t in pairs]).to(self.device)

    def _pipeline_forward_backward(self, micro: list[torch.Tensor]) -> torch.Tensor:
        """All micro-batches through the pipeline schedule; returns this rank's loss sum (non-zero
        only where the last stage runs). On recorded steps every stage's actions are timed."""
        inputs, targets = self._pipeline_inputs(micro)
        start = self.timeline.start()
        # The first step meters activations (as the non-PP path does): the peak, over the whole
        # schedule, of the saved activations alive at once on this rank (see memory()).
        metering = self.activation_bytes == 0
        meter = PeakActivationMeter(exclude=torch.nn.ModuleList(s.submod for s in self.pipeline.stages)) \
            if metering else contextlib.nullcontext()
        with self._loss_context(), meter:
            losses, actions = self.pipeline.step(inputs, targets, self.timeline.recording, self._document_kwargs(inputs))
        if metering:
            self.activation_bytes = meter.peak
        self.timeline.stop(start, actions)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += local_shard(loss.detach()) / self.scaler.scale
        return total

    # ---- the loop ----
    def train(self) -> list[float]:
        """Run the remaining steps; returns their losses. Raises Diverged (a streak of non-finite steps,
        or non-finite weights at a checkpoint) or Interrupted (a stop signal: after the step and a
        checkpoint); every rank raises the same, and `report` is set on the one that should print it."""
        own = StopRequest() if self.stop is None else None
        if own is not None:  # a caller's request (the worker's, installed at start-up) wins
            self.guard.stop = own.install()
        try:
            return self._loop()
        finally:
            if own is not None:
                own.restore()
                self.guard.stop = None

    def _loop(self) -> list[float]:
        t = self.cfg.train
        report = StepLog(self.cfg, self.dims, run_dir=self.run_dir, rank=self.rank, quiet=self.quiet,
                         start_step=self.step, accumulation=self.accumulation, num_params=self.num_params,
                         flops_per_token=self.flops_per_token, device=self.device, guard=self.guard,
                         scaler=self.scaler, moe_layers=self.moe_layers, moe_group=self.world_group,
                         energy_group=self.world_group, precision_defaulted=self.precision_defaulted,
                         io_stats=self.optimizer.stats.as_dict if hasattr(self.optimizer, "stats") else None,
                         source_tokens=self._source_tokens if self.batches.mixture else None)
        losses: list[float] = []
        ckpt_every = self.cfg.checkpoint.every
        finished = False
        try:
            while self.step < t.steps:
                logging_step = (self.step + 1) % t.log_every == 0 or self.step + 1 == t.steps
                self.timeline.recording = self.pipeline is not None and logging_step
                with self._memory_failure(report, self.step + 1):
                    r = self.train_step(measure_memory=logging_step)
                timeline = self.timeline.collect(self.step) if self.timeline.recording else None
                losses.append(r.loss)
                diverged = self.guard.record(self.step, r.skipped, r.loss)
                if self.straggler is not None and (found := self.straggler.after_step(self.step, r.seconds, self.data_wait_s)):
                    report.after_straggler_window(self.step, *found)  # before the step's record, which carries it
                report.after_step(r, self.step, logging_step, timeline, self.comm_bytes or {}, self.last_memory)
                if snapshot := self.snapshot.after_step(self.step, last=self.step == t.steps):
                    self.log(f"memory snapshot: {snapshot} (open it at {VIEWER})")
                if diverged:
                    self._set_aside_diverged(self.guard.streak_start - 1)
                    raise Diverged(self._divergence_message(r), report=self.rank == 0)
                if r.stop_code:
                    self._stop(r.stop_code)
                if self.straggler is not None and self.straggler.eviction is not None:
                    self._evict(self.straggler.eviction)
                if self._eval_due():
                    with self._memory_failure(report, self.step, evaluating=True):
                        validation = evaluate(self, self.eval_sets)
                    report.after_eval(self.step, validation)
                if ckpt_every and self.step % ckpt_every == 0 and self.step < t.steps:
                    self.save_checkpoint()
            report.write_pipeline_timeline()
            if hasattr(self.optimizer, "stats"):  # the NVMe tier: what the disk achieved (parallel/offload.py)
                self.log(self.optimizer.stats.line())
            if self.cfg.checkpoint.final and self.checkpoints_enabled():
                self.save_checkpoint()
            if self.cfg.run.save_final_model:
                self._save_final_model(self.run_dir / "final_model.pt")
            finished = True
        finally:
            self.loader.close()
            if self.straggler is not None:
                self.straggler.close()
            report.close(finished)
            if hasattr(self.optimizer, "close"):  # the NVMe tier's files (checkpoints hold the state)
                self.optimizer.close()
        return losses

    def _eval_due(self) -> bool:
        e = self.cfg.eval
        return bool(self.eval_sets) and ((e.every > 0 and self.step % e.every == 0)
                                         or (e.at_end and self.step == self.cfg.train.steps))

    def _source_tokens(self, step: int) -> dict[str, int]:
        """A mixture's input tokens read from each source in steps 1..step (seq_len per sample)."""
        return {name: n * self.cfg.train.seq_len for name, n in self.batches.consumed(step).items()}

    def given_config(self) -> Config:
        """The config as the run was given it: train.precision unset again where the device decided it (a
        resume compares it with the checkpoint's config.toml, which keeps it unset)."""
        if not self.precision_defaulted:
            return self.cfg
        given = copy.deepcopy(self.cfg)
        given.train.precision = None
        return given

    def _newest_good_checkpoint(self) -> Path | None:
        good = [p for p in mf.complete_checkpoints(self.checkpoints.directory) if mf.is_good(p)]
        return good[-1] if good else None

    def _set_aside_diverged(self, last_finite: int) -> None:
        """After a divergence: the checkpoints of step `last_finite` (whose weights gave the first
        non-finite step) and later are renamed step_N.diverged, kept but never resumed. Data order is
        fixed, so resuming from them replays the same non-finite step whatever the lr; the newest good
        checkpoint before them is where a lower lr can take another path."""
        self.checkpoints.set_aside_from(last_finite, "diverged")

    def _divergence_message(self, r: StepResult) -> str:
        g, t = self.guard, self.cfg.train
        scale = f", fp16 loss scale {self.scaler.scale:g}" if self.scaler.enabled else ""
        spike = g.spike_words()
        return (f"training diverged: {g.in_a_row} steps in a row had a non-finite loss or gradient norm (steps "
                f"{g.nonfinite_start}-{self.step}, last loss {r.loss:g}, grad norm {r.grad_norm:g}{scale}; "
                f"train.max_skipped_steps={g.max_skipped_steps}){'; it started when ' + spike if spike else ''}; "
                f"checkpoints from step {g.streak_start - 1} on set aside "
                f"as step_N.diverged (they replay the same steps); newest good checkpoint: "
                f"{self._newest_good_checkpoint() or 'none'}. Lower train.lr ({t.lr:g}) or raise train.warmup_steps, then "
                f"{self._rerun_with_the_new_value()}")

    def _rerun_with_the_new_value(self) -> str:
        """A divergence's advice: the rerun with a lower lr resumes from the newest good checkpoint."""
        return rerun_to_resume(self.cfg.checkpoint.resume, what=" from it", changing="the new value")

    def _stop(self, code: int) -> None:
        """A stop signal reached some rank: checkpoint this step (when checkpoints are on) and raise."""
        path = self.save_checkpoint() if self.checkpoints_enabled() else None
        stop = self.guard.stop
        name = stop.name if stop is not None and stop.signum is not None else "a stop signal on another rank"
        saved = f"checkpoint {path} written" if path else "checkpoints are off (checkpoint.every=0, final=false)"
        raise Interrupted(f"interrupted by {name} after step {self.step}: {saved}; "
                          f"{rerun_to_resume(self.cfg.checkpoint.resume)}",
                          code, report=self.rank == 0)

    def _evict(self, decided: Eviction) -> None:
        """Every rank reached the same eviction (train/eviction.py): the evicted node's local rank 0 records it and
        stops its agent first (which then waits for its workers instead of restarting them), then every rank
        checkpoints this step and stops as a drained job's ranks do (exit 143: the other agents restart theirs)."""
        seat = self.straggler.seat
        if seat.node_rank == decided.node and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            eviction.record(self.run_dir, decided, seat.cooldown_s)
            eviction.stop_my_agent()
        path = self.save_checkpoint()
        raise Interrupted(f"node {decided.node} evicted as a straggler after step {self.step}: checkpoint {path} written; "
                          "the job goes on with the other nodes", EXIT_SIGTERM, report=self.rank == 0)

    def memory(self) -> dict[str, int]:
        """This rank's bytes by category: local shards of params, grads, optimizer state; buffers;
        activations saved for backward by one micro-batch (measured once, on the first); on CUDA
        also the allocator's peak allocated and reserved bytes (docs/architecture.md §5).

        With pipeline parallelism "activations" is instead the peak, over the first step, of the
        bytes autograd holds saved for backward at once on this rank: every micro-batch in flight
        (forwarded, its backward not yet run; under split backward schedules until its weight pass),
        summed over all the stages this rank runs (interleaved / V schedules hold two or more), the
        loss's saved tensors included (train/memory_meter.py PeakActivationMeter). It is what the
        planner's `activations_stored` predicts for a pipeline rank (plan/memory.py)."""
        mem = memory_by_category(self.inner, self.optimizer)
        mem["activations"] = self.activation_bytes
        if self.device.type == "cuda":
            mem.update(cuda_memory(self.device))
        return mem

    def memory_per_rank(self) -> dict[str, list[int]]:
        """{category: [bytes on rank 0, 1, ...]} — one small all-gather on logging steps."""
        mem = self.memory()
        if self.world_group is None:
            return {k: [v] for k, v in sorted(mem.items())}
        keys = sorted(mem)
        local = torch.tensor([mem[k] for k in keys], dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.dims.world_size)]
        dist.all_gather(gathered, local, group=self.world_group)
        return {k: [int(t[i]) for t in gathered] for i, k in enumerate(keys)}

    # ---- checkpoints ----
    def checkpoints_enabled(self) -> bool:
        return self.cfg.checkpoint.every > 0 or self.cfg.checkpoint.final

    def trainer_state(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "data": self.batches.state_dict(), "guard": self.guard.state_dict(), "layout": self.dims.describe(),
                "world_size": self.dims.world_size}

    def save_checkpoint(self) -> Path:
        """Checkpoint this step (collective). Refuses non-finite weights: that run has diverged."""
        if not self.guard.weights_finite(self.params):
            raise Diverged(f"training diverged: the weights after step {self.step} are not finite (train.lr "
                           f"{self.cfg.train.lr:g}), so no checkpoint was written; newest good checkpoint: "
                           f"{self._newest_good_checkpoint() or 'none'}. Lower train.lr, then "
                           f"{self._rerun_with_the_new_value()}", report=self.rank == 0)
        manifest = {"good": self.guard.healthy, "run_id": self.run_id, "config": self.fingerprint,
                    "layout": self.dims.describe(), "world_size": self.dims.world_size}
        with saving_checkpoint(self.cfg, self.rank, self.device.type, self.step, self.checkpoints.latest, self.run_dir, self.run_id):
            path, written = self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(),
                                         {"tokenizer.json": self.data.tokenizer_path, "config.toml": self.run_dir / "config.toml",
                                          **chat_files(self.data.tokenizer_path)},
                                         manifest, checkpoint_state(self.grad_compression, self.cfg.parallel, self.dims.describe()))
        # "saved" only when written now: a run resumed at its last step wrote nothing, and said so wrongly before.
        self.log(f"checkpoint: saved step {self.step} to {path}" if written else
                 f"checkpoint: step {self.step} is already saved in {path}")
        return path

    def _accept_checkpoint(self, path: Path, manifest: dict) -> bool:
        """Whether to resume from this (intact) checkpoint. A job started with checkpoint.resume=false
        and restarted after a failure resumes only from checkpoints it wrote itself; one written for
        another model, data or batch is refused with the differences (ConfigError on every rank)."""
        if not self.cfg.checkpoint.resume and manifest.get("run_id") != self.run_id:
            return False
        if manifest.get("config") is not None:
            mf.refuse_changes(path, manifest["config"], self.fingerprint)
        return True

    def _maybe_resume(self) -> None:
        found = self.checkpoints.load_newest(self.model, self.optimizer, self._accept_checkpoint)
        if found is None:
            return
        path, state = found
        mixture_note = self.batches.load_state(state["data"], state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The checkpoint's base lr, betas and weight decay came back with it: this run's config decides.
        apply_hyperparameters(self.optimizer, self.scheduler, self.cfg.train)
        changed = resume_changes(path / "config.toml", self.given_config())
        if state.get("layout") not in (None, self.dims.describe()) or state.get("world_size", self.dims.world_size) != self.dims.world_size:
            changed.append(f"layout {state.get('layout')} x{state.get('world_size')} -> {self.dims.describe()} "
                           f"x{self.dims.world_size} (the checkpoint is resharded)")
        if changed:
            self.log(f"checkpoint: changed since {path.name} (this run's values apply): {'; '.join(changed)}")
        if mixture_note:
            self.log(mixture_note)
        self.scaler.load_state_dict(state["scaler"])
        self.guard.load_state_dict(state.get("guard", {}))
        self.step = state["step"]
        note = restore_state(self.grad_compression, self.cfg.parallel, self.dims.describe(), read_rank_state(path, self.rank))
        if note:
            self.log(f"checkpoint: {note}")
        self.log(f"checkpoint: {'restarted and ' if self.restarted else ''}resumed from {path} at step {self.step}")

    def _save_final_model(self, path: Path) -> None:
        """run.save_final_model; out of memory in its gather says how to get the weights from the last checkpoint."""
        newest = self.checkpoints.latest()
        final = newest if newest is not None and mf.step_of(newest) == self.step else None
        with saving_final_model(self.rank, self.device.type, path, self.step, self.run_dir, final, self.run_id, self.cfg.model):
            self.save_full_model(path)

    def save_full_model(self, path: Path) -> None:
        state = self._gather_pipeline_model() if self.pipeline is not None else full_model_state(self.model)
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)

    def _gather_pipeline_model(self) -> dict[str, torch.Tensor]:
        shapes, owner = pipeline_owners(self.cfg, self.pipeline_layers)
        coords = self.dims.coordinates(self.rank)
        in_rank0_pipeline = all(v == 0 for axis, v in coords.items() if axis != "pp")
        return gather_pipeline_state(self.model, shapes, owner, self.mesh["pp"].get_group(), coords["pp"], in_rank0_pipeline)
