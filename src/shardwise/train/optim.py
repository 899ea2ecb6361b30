"""AdamW with decoupled weight decay, warm-up + cosine schedule, gradient clipping by global norm."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import TrainConfig


def _mesh_key(t: torch.Tensor):
    mesh = getattr(t, "device_mesh", None)
    return id(mesh) if mesh is not None and "ep" in (mesh.mesh_dim_names or ()) else None


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors split into those on the expert mesh (parallel/expert.py) and the rest, in first-seen
    order: foreach kernels on DTensors need one mesh per call, and expert parallelism puts the experts
    on a mesh of their own. Every other layout keeps one group (its numerics and ZeRO-1 partition
    unchanged)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(_mesh_key(t), []).append(t)
    return list(groups.values())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear weights, embeddings); no decay for norm gains and biases (1-D), as in
    GPT-3 / Megatron-LM. Grouping by dimensionality works on shards too: a DTensor keeps its ndim.

    MoE models put their stacked experts in groups of their own, in every layout: under expert
    parallelism they live on another mesh (foreach kernels need one mesh per call), and the same
    groups without EP keep optimizer and scheduler state interchangeable between layouts (an ep2
    checkpoint resumes on ep1). Dense models keep exactly the two groups."""
    named = list(model.named_parameters())
    experts = [p for n, p in named if "experts" in n.split(".") and p.ndim == 3]
    ids = {id(p) for p in experts}
    dense = [p for _, p in named if id(p) not in ids]
    out = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": weight_decay},
           {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0}]
    if experts:
        out.append({"params": experts, "weight_decay": weight_decay})
    return out


def build_optimizer(model: nn.Module, t: TrainConfig, zero1_group=None, fused: bool = False,
                    nvme_dir: str | None = None, rank: int = 0) -> torch.optim.Optimizer:
    """AdamW over param_groups. `fused` (the trainer sets it on CUDA, and for offload, whose step runs on
    the CPU): one kernel per parameter group instead of foreach's several per step (torch's fused
    AdamW, what torchtitan uses on GPUs; on the CPU vectorised and multi-threaded); otherwise the CPU
    keeps foreach, so its numerics, tests and goldens stay as they were. `nvme_dir`: the moments live
    in a file there (parallel/offload.py, parallel.offload = "nvme"), bitwise the same steps as fused."""
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, **({"fused": True} if fused else {"foreach": True}))
    groups = param_groups(model, t.weight_decay)
    if nvme_dir is not None:
        from shardwise.parallel.offload import NvmeAdamW

        return NvmeAdamW(groups, nvme_dir, rank=rank, **kwargs)
    if zero1_group is not None:
        from shardwise.parallel.zero1 import ZeroOneOptimizer

        return ZeroOneOptimizer(groups, torch.optim.AdamW, zero1_group, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_lambda(t: TrainConfig):
    """Linear warm-up to lr, then cosine decay to min_lr_ratio x lr at the last step
    (Loshchilov & Hutter 2017, arXiv 1608.03983, without restarts)."""
    warmup, total, floor = t.warmup_steps, t.steps, t.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm over all gradients, then clip. With FSDP2 the norm of DTensor shards is a
    partial sum over the shard axis; `full_tensor()` reduces it over exactly the ranks that hold
    different shards (and not over replicas), so every layout computes the same global norm.
    Pipeline stages hold disjoint parameters: their squared norms add up over `pp_group`."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = []
    for group in by_mesh(grads) or [[]]:
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    if pp_group is not None:
        squared = total.float() ** 2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    if max_norm > 0:
        for group in by_mesh([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                          t: TrainConfig) -> None:
    """After a resume: loading a checkpoint brings its optimizer's hyper-parameters (betas, weight decay)
    and its scheduler's base lr back; the config's values are what this run was asked to use (a lower
    lr after a divergence, above all). The schedule's shape (warm-up, steps, floor) is this run's
    already (lr_lambda(t)); its position (the step) stays the checkpoint's. Decaying groups are those
    param_groups built with weight decay: matrices (ndim >= 2)."""
    factor = lr_lambda(t)
    lrs = []
    for group in optimizer.param_groups:
        decays = bool(group["params"]) and group["params"][0].ndim >= 2
        group.update(betas=(t.beta1, t.beta2), weight_decay=t.weight_decay if decays else 0.0, initial_lr=t.lr)
        lrs.append(t.lr * factor(scheduler.last_epoch))
        group["lr"] = lrs[-1]
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next scheduler.step()
