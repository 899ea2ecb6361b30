"""What the planner predicts this run holds on each GPU, so that every run on a GPU checks the planner
(the start-up line and the end-of-run summary put the two side by side) and an out-of-memory line says
whether the layout was expected to fit. The prediction is `shardwise plan evaluate`'s: the run's own
config with the cluster set to the GPU it runs on (spec/hardware.py match_cuda_name), its world size and
ranks per node (plan/memory.py memory: the most loaded rank). A GPU outside the table, or a config the
planner refuses, gives none; the run is never held up by it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardwise.spec.hardware import match_cuda_name

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PlannedMemory:
    total_bytes: float     # the most loaded rank's peak (plan/memory.py Memory.total)
    capacity_bytes: float  # what the planner lets a rank use of the GPU (constants.USABLE_MEMORY_FRACTION)
    gpu: str               # the table entry it priced

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    def words(self) -> str:
        return f"{self.total_bytes / GIB:.2f} GiB per GPU of {self.capacity_bytes / GIB:.1f} usable ({self.gpu})"

    def warning(self) -> str | None:
        """The start-up warning when the plan does not fit (the run goes on: the plan is an estimate)."""
        if self.fits:
            return None
        return (f"warning: the planner expects {self.words()}, more than fits: this run will likely run out of "
                "memory (exit 7); `shardwise plan search` with the same options finds a layout that fits")


def planned_memory(cfg: Any, world_size: int, gpus_per_node: int, cuda_name: str) -> PlannedMemory | None:
    """The planner's peak for `cfg` (the trainer's resolved config) on `world_size` GPUs named `cuda_name`."""
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import memory
    from shardwise.spec.layout import Layout

    gpu = match_cuda_name(cuda_name)
    if gpu is None:
        return None
    cluster = dataclasses.replace(cfg.cluster, gpu=gpu, num_gpus=world_size, gpus_per_node=min(gpus_per_node, world_size))
    planned = dataclasses.replace(cfg, cluster=cluster)
    try:
        m = memory(Problem.from_config(planned), Layout.from_config(planned, world_size))
    except Exception:  # noqa: BLE001 (advisory: a layout or option the planner cannot price must not stop a run)
        return None
    return PlannedMemory(m.total, m.capacity, gpu)


def local_world_size(world_size: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE (its own variable), else every rank (one process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
