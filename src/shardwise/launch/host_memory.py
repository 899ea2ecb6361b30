"""Before any worker starts: can this node hold the model states its ranks offload to host memory?

With parallel.offload = "cpu" or "nvme" each rank keeps its shard of the parameters, gradients and AdamW
state (less the moments "nvme" writes to disk) in host memory: 16 bytes per parameter of the shard, e.g.
98 GB for the 6.1B LLaMA that benchmarks/gpu_check.py offload-big trains on one 80 GB GPU. On a node that
cannot hold them the kernel's out-of-memory killer ends a rank minutes into initialisation, and the
launcher can only say that it was killed by SIGKILL. The planner's bytes for the most loaded rank
(plan/memory.py offloaded_state_bytes, the same closed form as the states it prices) times this node's
ranks (pipeline stages are the outermost mesh axis, spec/dims.py, so a node's ranks share a stage: this is
the most loaded node's need) against the node's physical memory and swap (/proc/meminfo MemTotal +
SwapTotal: room that no other process's use can add to) refuse the run with the numbers and the ways out.
Elsewhere (no /proc/meminfo) nothing is checked.
"""
from __future__ import annotations

from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.spec.dims import offload_tier

GIB = 2**30


def node_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemTotal + SwapTotal in bytes, None where the file is missing or unreadable."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return sum(int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal") if key in fields) or None
    except (OSError, ValueError):
        return None


def check_offload_fits_host(cfg, world_size: int, local_ranks: int, node_bytes: int | None = None) -> None:
    """ConfigError (exit 2) when `local_ranks` ranks' offloaded states exceed this node's memory + swap."""
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import offloaded_state_bytes
    from shardwise.spec.layout import Layout

    tier = offload_tier(cfg.parallel)
    if tier == "none":
        return
    node_bytes = node_memory_bytes() if node_bytes is None else node_bytes
    if node_bytes is None:
        return
    try:
        per_rank = offloaded_state_bytes(Problem.from_config(cfg), Layout.from_config(cfg, world_size))
    except ConfigError:
        return  # a [cluster] section the planner refuses (the trainer never reads it): no check, as before
    need = per_rank * local_ranks
    if need <= node_bytes:
        return
    ranks = f"{local_ranks} ranks x {per_rank / GIB:.1f} GiB" if local_ranks > 1 else f"{per_rank / GIB:.1f} GiB for its rank"
    ways = ('parallel.offload="nvme" (the AdamW moments, about half of the states, go to parallel.offload_dir), '
            if tier == "cpu" else "")
    raise ConfigError("parallel.offload", f'the model states offloaded to host memory ({tier}) need {need / GIB:.1f} GiB on '
                      f"this node ({ranks}), but it has {node_bytes / GIB:.1f} GiB of memory and swap",
                      f"use {ways}more nodes (ZeRO-3 shards the states over every rank), or a smaller model")
