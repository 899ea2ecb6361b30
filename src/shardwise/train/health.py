"""Divergence guard: every step, all ranks agree whether it was finite, and whether to stop.

A step is healthy when its loss and its global gradient norm are finite on every rank (under fp16
this includes the loss scaler's overflow check; the gradient norm is global, so an inf in any shard
shows on every rank). An unhealthy step is skipped everywhere: no optimizer step, so parameters and
optimizer state stay bitwise what they were; the data position and the learning-rate schedule move on,
as after an fp16 overflow. After `train.max_skipped_steps` unhealthy steps in a row the run has
diverged and stops with exit code 3 (Megatron-LM and DeepSpeed likewise skip overflowing steps; a
streak means the run will not recover by itself).

A divergence often starts before the loss is non-finite: one update at a far too high learning rate
leaves finite but ruined weights (the loss jumps to a plateau), and the NaN comes steps later. A finite
loss above `train.spike_ratio` x the median of the `train.spike_window` healthy steps before it is a
spike: while one lasts, checkpoints are marked not good (pruning keeps the good one before it), and a
divergence that follows is dated from the spike, so the checkpoints from the weights that made it on
are set aside and the advised rerun resumes from before it (issue 57: it resumed from a checkpoint
written after the fatal update and diverged again, in a loop). The losses compared are the global
batch's mean, the same number on every rank, so the ranks agree without a collective.

The same collective carries the stop request (a signal on any rank), so one small all-reduce per step
decides both. The host needs its result before it launches the optimizer step: on CUDA that is one
host sync per step besides the one that reads the logged values (Megatron-LM's overflow check waits
the same way; a fused optimizer taking a device-side skip flag would avoid it).
"""
from __future__ import annotations

import statistics
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


# Healthy steps in the window before a loss can be called a spike: the first steps of a run have no history.
MIN_SPIKE_HISTORY = 5


class StepGuard:
    def __init__(self, control: Control, max_skipped_steps: int, stop: StopRequest | None, spike_ratio: float = 0.0,
                 spike_window: int = 10):
        self.control = control
        self.max_skipped_steps = max_skipped_steps
        self.stop = stop
        self.spike_ratio, self.spike_window = spike_ratio, spike_window
        self.skipped_total = 0
        self.in_a_row = 0
        self.streak_start = 0  # where the divergence being counted started: a spike, else its first non-finite step
        self.nonfinite_start = 0
        self.history: list[float] = []  # the losses of the last spike_window healthy steps
        self.spike: tuple[int, float, float] | None = None  # (step, loss, median before it) while a spike lasts
        self.spiked: list[float] = []  # the losses of the spike so far

    @property
    def healthy(self) -> bool:
        """No streak of skipped steps and no spike running: what a checkpoint's manifest calls good."""
        return self.in_a_row == 0 and self.spike is None

    def verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor, local_overflow: bool) -> Verdict:
        finite = bool(torch.isfinite(torch.stack([loss.detach().float().reshape(()),
                                                  grad_norm.detach().float().reshape(()).to(loss.device)])).all())
        stop = self.stop.exit_code if self.stop is not None else 0
        nonfinite, stop_code = self.control.max([float(local_overflow or not finite), float(stop)])
        return Verdict(skip=bool(nonfinite), stop_code=int(stop_code))

    def record(self, step: int, skipped: bool, loss: float = float("nan")) -> bool:
        """Count a finished step (its global mean loss); True when it ends a streak of max_skipped_steps
        skipped steps."""
        if not skipped:
            self.in_a_row = 0
            self._watch_spike(step, loss)
            return False
        self.skipped_total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.nonfinite_start = step
            self.streak_start = self.spike[0] if self.spike is not None else step
        return self.in_a_row >= self.max_skipped_steps

    def _watch_spike(self, step: int, loss: float) -> None:
        if self.spike_ratio > 0 and len(self.history) >= MIN_SPIKE_HISTORY:
            median = statistics.median(self.history)
            if loss > self.spike_ratio * median:
                if self.spike is None:
                    self.spike, self.spiked = (step, loss, median), []
                self.spiked.append(loss)  # a spike's losses stay out of the history it is judged against...
                if len(self.spiked) < self.spike_window:
                    return
                # ...until it has lasted a whole window without a divergence: a new level (other data after a
                # resume, say), not a spike; otherwise every later checkpoint would stay "not good".
                self.history, self.spike = self.spiked[-self.spike_window:], None
                return
        self.spike = None
        self.history = (self.history + [loss])[-self.spike_window:]

    def spike_words(self) -> str:
        """"the loss spiked at step 32 (7.62, 2.4x the median 3.17 of the 20 steps before; train.spike_ratio=2)" or ""."""
        if self.spike is None or self.spike[0] >= self.nonfinite_start:
            return ""
        step, loss, median = self.spike
        return (f"the loss spiked at step {step} ({loss:.4g}, {loss / median:.2g}x the median {median:.4g} of the "
                f"{len(self.history)} steps before; train.spike_ratio={self.spike_ratio:g})")

    def weights_finite(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether every rank's parameter shards are finite (an update can overflow them even from a
        finite gradient, e.g. weight decay with a huge learning rate)."""
        flags = [torch.isfinite(local_shard(p.detach())).all() for p in params]
        local_ok = bool(torch.stack(flags).all()) if flags else True
        return self.control.max([float(not local_ok)])[0] == 0

    def state_dict(self) -> dict:
        return {"skipped_total": self.skipped_total, "in_a_row": self.in_a_row, "streak_start": self.streak_start,
                "nonfinite_start": self.nonfinite_start, "history": list(self.history),
                "spike": list(self.spike) if self.spike is not None else None, "spiked": list(self.spiked)}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's guard (its loss history too: a spike right after a resume is judged against the
        steps before it)."""
        self.skipped_total = int(state.get("skipped_total", 0))
        self.in_a_row = int(state.get("in_a_row", 0))
        self.streak_start = int(state.get("streak_start", 0))
        self.nonfinite_start = int(state.get("nonfinite_start", self.streak_start))
        self.history = [float(x) for x in state.get("history", [])][-self.spike_window:]
        spike = state.get("spike")
        self.spike = (int(spike[0]), float(spike[1]), float(spike[2])) if spike else None
        self.spiked = [float(x) for x in state.get("spiked", [])]
