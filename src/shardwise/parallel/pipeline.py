"""Pipeline parallelism on torch.distributed.pipelining: the schedules, and a stage that times every
action it runs (for the measured bubble and the schedule chart). Which blocks each stage holds is
decided in stages.py; building the stages is parallelize.build_pipeline.

A stage is the model itself with the parts it does not run removed (Transformer.keep_only): the kept
parameters keep their whole-model names, so initialization, checkpoints and parity compare by name
across every layout. Each stage is then parallelized (TP, recompute, FSDP) like a whole model.

Loss. The schedule calls the loss per micro-batch; ours returns the micro-batch's token-sum divided
by the tokens a data-parallel rank sees per step, and the schedule is told not to rescale gradients
(scale_grads=False), so the accumulated gradient is the token mean over the global batch exactly as
on one device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from shardwise.errors import ConfigError
from shardwise.parallel.precision import autocast
from shardwise.spec.stages import SINGLE_STAGE, stage_rank

# schedule name -> torch class
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


@dataclass
class Action:
    """One timed stage action: F forward, B full backward, I backward-input, W backward-weight."""
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


class TimedStage(PipelineStage):
    """A PipelineStage that records when each of its actions starts and ends (perf_counter seconds),
    for the measured bubble and the schedule chart; recording is on only while `actions` is a list."""

    actions: list[Action] | None = None

    def _timed(self, kind: str, chunk: int, fn, *args, **kwargs):
        if self.actions is None:
            return fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.actions.append(Action(kind, self.stage_index, chunk, start, time.perf_counter()))
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("F", fwd_chunk_id, super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return self._timed("B" if full else "I", bwd_chunk_id, super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("W", bwd_chunk_id, super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)


def check_stage_transport(pp: int, backend: str, device_type: str) -> None:
    """Pipeline stages hand activations over point to point, which gloo does not do for CUDA tensors
    ("Bad address", H100, torch 2.11); run.backend="gloo" on GPUs (ranks sharing a GPU) is refused
    with pp > 1 before any stage is built. Ring attention stages its transfers through host memory
    instead (parallel/context.py host_staged); torch's pipelining schedules own theirs."""
    if pp > 1 and backend == "gloo" and device_type == "cuda":
        raise ConfigError("run.backend", f"gloo cannot send CUDA tensors between pipeline stages (pp={pp})",
                          'use run.backend="auto" (NCCL, one GPU per rank), or parallel.pp=1 to share a GPU over gloo')


def build_schedule(stages: list[TimedStage], schedule: str, microbatches: int, loss_fn):
    cls = SCHEDULES[schedule]
    target = stages[0] if schedule in SINGLE_STAGE else stages
    return cls(target, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def boundary_dtype(precision: str, low_precision_params: bool) -> torch.dtype:
    """dtype of the hidden states sent between stages. The residual stream stays fp32 under autocast
    (fp32 embedding output + low-precision block outputs add up in fp32); when FSDP2 / replicate
    computes with low-precision parameters (MixedPrecisionPolicy.param_dtype) it is that dtype."""
    from shardwise.parallel.precision import DTYPES

    return DTYPES[precision] if low_precision_params else torch.float32


def autocast_forward(module: nn.Module, precision: str, device_type: str) -> None:
    """Run `module`'s forward (only) under autocast: the schedule calls forward and backward itself,
    and autocast should not cover backward (PyTorch AMP docs)."""
    if precision == "fp32":
        return
    contexts: list = []

    def enter(_mod, _args):
        contexts.append(autocast(precision, device_type))
        contexts[-1].__enter__()

    def leave(_mod, _args, _out):
        contexts.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


class PipelineRun:
    """This rank's stages wrapped as TimedStages and the schedule that drives them."""

    def __init__(self, modules: dict[int, nn.Module], num_stages: int, schedule: str, microbatches: int,
                 loss_fn, group, device: torch.device, io: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 precision: str):
        self.stages: list[TimedStage] = []
        for index in sorted(modules):  # schedules want their local stages in stage order
            module = modules[index]
            autocast_forward(module, precision, device.type)
            inputs = io["tokens"] if index == 0 else io["hidden"]
            outputs = io["logits"] if index == num_stages - 1 else io["hidden"]
            # Static shapes: the stage would otherwise infer them by running a forward and backward
            # of its own before the first step (extra collectives, FSDP hooks). requires_grad marks
            # what carries a gradient back.
            meta = lambda spec: torch.empty(spec[0], dtype=spec[1], device="meta",  # noqa: E731
                                            requires_grad=spec[1].is_floating_point)
            self.stages.append(TimedStage(module, index, num_stages, device, input_args=(meta(inputs),),
                                          output_args=(meta(outputs),), group=group))
        self.schedule = build_schedule(self.stages, schedule, microbatches, loss_fn)
        self.schedule_name, self.pp, self.group, self.device, self.io = schedule, dist.get_world_size(group), group, device, io
        self.virtual_stages = num_stages // self.pp
        self.micro_batch = io["tokens"][0][0]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, record: bool,
             extra: dict[str, torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[Action]]:
        """One optimizer step's forward and backward over all micro-batches; returns the per
        micro-batch losses (on the rank holding the last stage, else []) and, when `record`, the
        timed actions of this rank's stages. `extra` (packed documents' `positions` and `documents`,
        trainer._document_kwargs) reach every stage's forward as keywords: torch's schedules split a step's
        keyword tensors into micro-batches like its inputs and hand them to every stage, not only the
        first, so they need not travel with the activations; each stage builds its document mask once."""
        actions: list[Action] = []
        for stage in self.stages:
            stage.actions = actions if record else None
        losses: list[torch.Tensor] = []
        self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False, **(extra or {}))
        for stage in self.stages:
            stage.actions = None
        return losses, actions

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn,
                 extra: dict[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Every micro-batch forward only (run under torch.no_grad): loss_fn(logits, targets) of each on the
        rank holding the last stage, else []; `extra` as in step().

        Not the schedule's eval(): torch 2.13's multi-stage schedules still run their local backward
        hand-over in eval mode ("can't steal_bwd_input if this stage doesn't have backward", V schedules),
        and switching a schedule between eval and training sets its stages up again each time. Here each
        rank runs its stages in ascending order, every micro-batch of one stage before the next stage
        (looped breadth-first, as in Lamy-Poirier 2022, arXiv 2211.05953, forwards only). Activations flow
        only to higher stages, so a blocking receive always waits on work that needs nothing from this rank
        later: no deadlock, and the stages overlap as in GPipe's forward."""
        num_stages = self.stages[0].num_stages
        m = len(inputs) // self.micro_batch
        me = dist.get_rank(self.group)
        owner = [stage_rank(self.schedule_name, self.pp, self.virtual_stages, s) for s in range(num_stages)]
        xs, ts = inputs.split(self.micro_batch), targets.split(self.micro_batch)
        split = {key: value.split(self.micro_batch) for key, value in (extra or {}).items()}
        extras = [{key: parts[mb] for key, parts in split.items()} for mb in range(len(xs))]
        held: dict[tuple[int, int], torch.Tensor] = {}
        sends, losses = [], []
        shape, dtype = self.io["hidden"]
        for stage in self.stages:
            s = stage.stage_index
            for mb in range(m):
                if s == 0:
                    x = xs[mb]
                elif owner[s - 1] == me:
                    x = held.pop((s - 1, mb))
                else:
                    x = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(x, src=dist.get_global_rank(self.group, owner[s - 1]), group=self.group, tag=s * m + mb)
                y = stage.submod(x, **extras[mb])
                if s == num_stages - 1:
                    losses.append(loss_fn(y, ts[mb]))
                elif owner[s + 1] == me:
                    held[(s, mb)] = y
                else:
                    sends.append(dist.isend(y.to(dtype).contiguous(), dst=dist.get_global_rank(self.group, owner[s + 1]),
                                            group=self.group, tag=(s + 1) * m + mb))
        for work in sends:
            work.wait()
        return losses
