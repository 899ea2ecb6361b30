"""Mixed precision: autocast for compute, FSDP2 policies for communication, dynamic loss scaling.

Master weights stay fp32 in every precision: parameters are fp32, autocast (and FSDP2's
param_dtype) casts them for the matmuls, and gradients are reduced in fp32 (reduce_dtype).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable

import torch

from shardwise.config import Config
from shardwise.spec.layout import default_precision

# The compute dtype of each train.precision; "fp8" computes in bf16 outside the GEMMs torchao converts
# (parallel/float8.py), so autocast, FSDP2's param_dtype and pipeline boundaries use bf16 for it.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def resolve_precision(cfg: Config, device: torch.device) -> Config:
    """`cfg` with train.precision decided for `device` when it is unset (spec/layout.py default_precision):
    bf16 on a GPU whose tensor cores compute it (compute capability 8.0+; emulated bf16 does not count),
    fp32 elsewhere. The planner decides the same from its device table (plan/layout.py Problem)."""
    if cfg.train.precision is not None:
        return cfg
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    train = dataclasses.replace(cfg.train, precision=default_precision(device.type, native_bf16))
    return dataclasses.replace(cfg, train=train)


def set_matmul_precision(tf32: bool, device: torch.device) -> None:
    """train.tf32 on CUDA: fp32 matmuls (and cuDNN convolutions) on TF32 tensor cores, or full fp32.
    The process-wide switch PyTorch has for it; a CPU device leaves it alone (CPU tests stay bitwise)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def fsdp_mp_policy(precision: str, grad_compression: str = "none"):
    """Gather parameters in the low dtype (half the all-gather bytes), reduce gradients in fp32 — or
    in bf16 with parallel.grad_compression="bf16", the one compression FSDP2's reduce-scatter, HSDP's
    all-reduce and `replicate` offer (spec/rules.py grad_compression_rules refuses the others)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if grad_compression == "bf16" else torch.float32
    if precision == "fp32":
        return MixedPrecisionPolicy(reduce_dtype=reduce if grad_compression == "bf16" else None)
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=reduce)


class DynamicLossScaler:
    """fp16 dynamic loss scaling (Micikevicius et al. 2018, arXiv 1710.03740 §3.2).

    Our own rather than torch.amp.GradScaler because the same object must serve DDP gradients,
    ZeRO-1 and FSDP2 DTensor shards, with the overflow flag agreed over all ranks (each rank only
    sees its own shard, so one rank's inf must skip the step everywhere; train/health.py agrees on it).
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide local gradient shards by the scale; return True when this rank's shards hold an
        inf/nan. The trainer agrees on it over all ranks together with its other step checks
        (train/health.py): each rank only sees its own shard, so one rank's inf skips the step everywhere."""
        if not self.enabled:
            return False
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if not local:
            return False
        torch._foreach_mul_(local, 1.0 / self.scale)
        return bool(torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in local]).any())

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]
