"""Router statistics of the MoE blocks for metrics.jsonl: per-expert load, dropped token-slots, the
auxiliary losses (models/moe.py keeps them detached on each module, summed over a step's forwards).

One all-reduce of a small float64 vector over the world on logging steps (not training traffic, like
the memory all-gather): every rank adds the statistics of the MoE blocks it runs over the tokens it
saw, so the sums cover the whole global batch and every pipeline stage.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import ModelConfig
from shardwise.models.moe import MoE
from shardwise.parallel.parallelize import canonical_fqn
from shardwise.spec.shapes import ModelShape


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{global block index: MoE module} of the blocks this rank holds (also on a pipeline stage)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            parts = canonical_fqn(name).split(".")
            out[int(parts[parts.index("layers") + 1])] = module
    return out


def set_aux_grad_scale(layers: dict[int, MoE], scale: float) -> None:
    """The constant gradient each aux loss gets in backward: loss scale / micro-batches per step."""
    for m in layers.values():
        m.aux_grad_scale = scale


def reset(layers: dict[int, MoE]) -> None:
    for m in layers.values():
        m.reset_stats()


def gather(layers: dict[int, MoE], model_cfg: ModelConfig, group: "dist.ProcessGroup | None") -> dict[str, object]:
    """Collective over `group` (None: this process only). Keys: moe_aux_loss and moe_z_loss (the
    weighted terms summed over MoE blocks, mean over micro-batches), moe_dropped_frac (dropped /
    routed token-slots), moe_load_max / moe_load_min (over blocks and experts, an expert's routed
    slots over the mean per expert: 1 = balanced), moe_expert_load (per expert, fraction of all
    routed slots, blocks summed)."""
    e = model_cfg.moe.num_experts
    shape = ModelShape.from_config(model_cfg)
    ids = [i for i in range(model_cfg.n_layers) if shape.is_moe_layer(i)]
    loads = torch.zeros(len(ids), e, dtype=torch.float64)
    extra = torch.zeros(4, dtype=torch.float64)  # dropped, aux sum, z sum, forwards
    for j, i in enumerate(ids):
        m = layers.get(i)
        if m is not None:
            loads[j] = m.stats_load
            extra += torch.tensor([m.stats_dropped, m.stats_aux, m.stats_z, m.stats_forwards], dtype=torch.float64)
    flat = torch.cat([loads.reshape(-1), extra])
    if group is not None:
        dist.all_reduce(flat, group=group)
    loads = flat[:loads.numel()].view(len(ids), e)
    dropped, aux, z, forwards = flat[loads.numel():].tolist()
    slots = loads.sum().item()
    per_block = loads.sum(1, keepdim=True).clamp_min(1)
    relative = loads * e / per_block
    micro_batches = forwards / max(1, len(ids))
    return {"moe_aux_loss": aux / max(1.0, micro_batches), "moe_z_loss": z / max(1.0, micro_batches),
            "moe_dropped_frac": dropped / max(1.0, slots), "moe_load_max": relative.max().item(),
            "moe_load_min": relative.min().item(),
            "moe_expert_load": (loads.sum(0) / max(1.0, slots)).tolist()}
