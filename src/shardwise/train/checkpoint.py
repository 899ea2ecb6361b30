"""Distributed checkpoints with torch.distributed.checkpoint (DCP), written atomically.

Layout of one checkpoint:  <dir>/step_00000100/
    DCP shards + .metadata     model and optimizer state, keyed by parameter FQN (reshardable)
    trainer_state.json         step, LR scheduler, loss scaler, data position
    rng/rank_<r>.pt            each rank's RNG state (tensors only; loaded with weights_only=True)
    tokenizer.json, config.toml
    COMPLETE                   written last; a directory without it is never loaded
Writes go to step_X.tmp and are renamed into place only when complete, so a crash mid-save never
replaces or corrupts a checkpoint that was already written; pruning only touches complete ones.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardwise.parallel.parallelize import canonical_fqn

MARKER = "COMPLETE"
# Optimizer state keyed by parameter name throughout ("param_groups.<fqn>.lr", not "param_groups.0"):
# pipeline stages hold different parameters in their param group 0, and positional keys would make
# the stages overwrite each other's groups in the checkpoint.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _dcp(fn, state: dict, path: Path) -> None:
    """dcp.save / dcp.load; on one process DCP warns it is 'assuming the intent is to save in a
    single process', which is exactly the reference path's intent, so that warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=str(path))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from shardwise.parallel.zero1 import ZeroOneOptimizer

    return isinstance(optimizer, ZeroOneOptimizer)


def _zero1_owned(model: nn.Module, optimizer) -> dict[str, nn.Parameter]:
    """FQN -> parameter for the parameters whose optimizer state this rank owns."""
    owned = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    return {canonical_fqn(n): p for n, p in model.named_parameters() if id(p) in owned}


def _zero1_state(model: nn.Module, optimizer, allocate: bool) -> dict:
    """ZeRO-1 optimizer state in the same {"state": {fqn: {...}}} shape as DCP's
    get_optimizer_state_dict, for the owned parameters only: each rank contributes distinct keys,
    so the checkpoint holds every parameter's full state once and loads into any layout."""
    state = {}
    for fqn, p in _zero1_owned(model, optimizer).items():
        if allocate:
            state[fqn] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}
        else:
            state[fqn] = optimizer.optim.state[p]
    return {"state": state}


def _load_zero1_state(model: nn.Module, optimizer, loaded: dict) -> None:
    for fqn, p in _zero1_owned(model, optimizer).items():
        optimizer.optim.state[p] = loaded["state"][fqn]


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer, for_load: bool) -> dict:
    if is_zero1(optimizer):
        return {"model": get_model_state_dict(model), "optim": _zero1_state(model, optimizer, allocate=for_load)}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIM)}


class CheckpointManager:
    def __init__(self, directory: Path, keep: int):
        self.directory = directory
        self.keep = keep

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.directory)
        return found[-1] if found else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             extra_files: dict[str, Path]) -> Path:
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f"step_{step:08d}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
            tmp.mkdir(parents=True)
        _barrier()
        _dcp(dcp.save, _app_state(model, optimizer, for_load=False), tmp)
        rng_dir = tmp / "rng"
        rng_dir.mkdir(exist_ok=True)
        torch.save(_rng_state(), rng_dir / f"rank_{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
            for name, src in extra_files.items():
                if src.is_file():
                    shutil.copyfile(src, tmp / name)
            (tmp / MARKER).write_text(f"step {step}\n")
            if final.exists():  # re-saving a step (e.g. a final save after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        found = complete_checkpoints(self.directory)
        for old in found[: max(0, len(found) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Load model + optimizer in place; return the trainer state (step, scheduler, ...)."""
        state = _app_state(model, optimizer, for_load=True)
        _dcp(dcp.load, state, path)
        set_model_state_dict(model, state["model"])
        if is_zero1(optimizer):
            _load_zero1_state(model, optimizer, state["optim"])
        else:
            set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT_OPTIM)
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        if rng_file.exists():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        return json.loads((path / "trainer_state.json").read_text())


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights on CPU (collective: every rank calls it; rank 0 gets the tensors)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_pipeline_state(model: nn.Module, shapes: dict[str, torch.Size], owner: dict[str, int],
                          pp_group: "dist.ProcessGroup", pp_rank: int, in_rank0_pipeline: bool) -> dict[str, torch.Tensor]:
    """full_model_state for pipeline layouts: each stage's unsharded weights, sent to the first pipeline
    rank of the pipeline that holds global rank 0 (collective over every rank; that rank gets them).

    Tensors go point-to-point in a fixed order (names sorted, pipeline rank by rank), receive buffers
    shaped from the whole model's names (`shapes`, `owner`: name -> pipeline rank), so nothing but
    tensors crosses processes (no pickled objects)."""
    local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if not in_rank0_pipeline:
        return {}
    device = next(iter(local.values())).device if local else torch.device("cpu")
    names = sorted(shapes)
    if pp_rank != 0:
        for name in names:
            if owner[name] == pp_rank:
                dist.send(local[name].to(device).contiguous(), group=pp_group, group_dst=0)
        return {}
    out = {name: t.cpu() for name, t in local.items()}
    for r in sorted(set(owner.values()) - {0}):
        for name in names:
            if owner[name] == r:
                buf = torch.empty(shapes[name], dtype=torch.float32, device=device)
                dist.recv(buf, group=pp_group, group_src=r)
                out[name] = buf.cpu()
    return out
