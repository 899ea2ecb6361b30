"""Divergence guard: every step, all ranks agree whether it was finite, and whether to stop.

A step is healthy when its loss and its global gradient norm are finite on every rank (under fp16
this includes the loss scaler's overflow check; the gradient norm is global, so an inf in any shard
shows on every rank). An unhealthy step is skipped everywhere: no optimizer step, so parameters and
optimizer state stay bitwise what they were; the data position and the learning-rate schedule move on,
as after an fp16 overflow. After `train.max_skipped_steps` unhealthy steps in a row the run has
diverged and stops with exit code 3 (Megatron-LM and DeepSpeed likewise skip overflowing steps; a
streak means the run will not recover by itself).

The same collective carries the stop request (a signal on any rank), so one small all-reduce per step
decides both. The host needs its result before it launches the optimizer step: on CUDA that is one
host sync per step besides the one that reads the logged values (Megatron-LM's overflow check waits
the same way; a fused optimizer taking a device-side skip flag would avoid it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from shardwise.tensors import local_shard
from shardwise.train.control import Control
from shardwise.train.signals import StopRequest


@dataclass
class Verdict:
    skip: bool        # some rank saw a non-finite loss or gradient norm
    stop_code: int    # 0, or 130 / 143: a rank was asked to stop




class StepGuard:
    def __init__(self, control: Control, max_skipped_steps: int, stop: StopRequest | None):
        self.control = control
        self.max_skipped_steps = max_skipped_steps
        self.stop = stop
        self.skipped_total = 0
        self.in_a_row = 0
        self.streak_start = 0

    def verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor, local_overflow: bool) -> Verdict:
        finite = bool(torch.isfinite(torch.stack([loss.detach().float().reshape(()),
                                                  grad_norm.detach().float().reshape(()).to(loss.device)])).all())
        stop = self.stop.exit_code if self.stop is not None else 0
        nonfinite, stop_code = self.control.max([float(local_overflow or not finite), float(stop)])
        return Verdict(skip=bool(nonfinite), stop_code=int(stop_code))

    def record(self, step: int, skipped: bool) -> bool:
        """Count a finished step; True when it ends a streak of max_skipped_steps skipped steps."""
        if not skipped:
            self.in_a_row = 0
            return False
        self.skipped_total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.streak_start = step
        return self.in_a_row >= self.max_skipped_steps

    def weights_finite(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether every rank's parameter shards are finite (an update can overflow them even from a
        finite gradient, e.g. weight decay with a huge learning rate)."""
        flags = [torch.isfinite(local_shard(p.detach())).all() for p in params]
        local_ok = bool(torch.stack(flags).all()) if flags else True
        return self.control.max([float(not local_ok)])[0] == 0

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "in_a_row": self.in_a_row, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = int(state.get("skipped_total", 0))
        self.in_a_row = int(state.get("in_a_row", 0))
        self.streak_start = int(state.get("streak_start", 0))
