"""The whole model's weights on one rank (run.save_final_model: <run.dir>/final_model.pt, which `shardwise
parity` compares), unsharded and in fp32: every rank takes part in the gathers. Out of memory there is
reported by train/out_of_memory.py saving_final_model; `shardwise export` (train/export.py) writes the same
weights from a checkpoint with one output shard in memory."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardwise.config import Config
from shardwise.models import build_model
from shardwise.spec.stages import stage_of_parameter, stage_rank


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights on CPU (collective: every rank calls it; rank 0 gets the tensors)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_tensors_on_host(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers unsharded, in host memory, on every rank (collective over each
    tensor's mesh: every rank of the stage calls it). One tensor is whole on the device at a time:
    get_model_state_dict(full_state_dict=True) keeps every gathered tensor on the device unless it offloads,
    and its offload keeps them on global rank 0 only, where a pipeline needs them on each stage's owner
    (a 70B model's stage of pp=8 is ~35 GB of fp32 on a GPU already full with training)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in sorted(get_model_state_dict(model).items()):  # sorted: every rank gathers in the same order
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = whole.detach().cpu()
        del whole  # before the next gather: one whole tensor on the device at a time
    return out


def gather_pipeline_state(model: nn.Module, shapes: dict[str, torch.Size], owner: dict[str, int],
                          pp_group, pp_rank: int, in_rank0_pipeline: bool) -> dict[str, torch.Tensor]:
    """full_model_state for pipeline layouts: each stage's unsharded weights, sent to the first pipeline
    rank of the pipeline that holds global rank 0 (collective over every rank; that rank gets them).

    Tensors go point-to-point in a fixed order (names sorted, pipeline rank by rank), receive buffers
    shaped from the whole model's names (`shapes`, `owner`: name -> pipeline rank), so nothing but
    tensors crosses processes (no pickled objects). They wait in host memory (`full_tensors_on_host`)
    and cross one at a time, through the device where the backend needs one (NCCL)."""
    import torch.distributed as dist

    local = full_tensors_on_host(model)
    if not in_rank0_pipeline:
        return {}
    device = next(model.parameters()).device if dist.get_backend(pp_group) == "nccl" else torch.device("cpu")
    names = sorted(shapes)
    if pp_rank != 0:
        for name in names:
            if owner[name] == pp_rank:
                dist.send(local[name].to(device).contiguous(), group=pp_group, group_dst=0)
        return {}
    out = dict(local)
    for r in sorted(set(owner.values()) - {0}):
        for name in names:
            if owner[name] == r:
                buf = torch.empty(shapes[name], dtype=torch.float32, device=device)
                dist.recv(buf, group=pp_group, group_src=r)
                out[name] = buf.cpu()
    return out


def pipeline_owners(cfg: Config, pipeline_layers: list[list[int]]) -> tuple[dict[str, torch.Size], dict[str, int]]:
    """(name -> shape, name -> pipeline rank) of every parameter of the whole model, for gather_pipeline_state's
    receive buffers: shapes from a model built on the meta device, ranks from the stage holding each."""
    p = cfg.parallel
    with torch.device("meta"):
        whole = build_model(cfg.model)
    shapes = {name: param.shape for name, param in whole.named_parameters()}
    return shapes, {name: stage_rank(p.pp_schedule, p.pp, p.pp_virtual_stages, stage_of_parameter(name, pipeline_layers))
                    for name in shapes}
