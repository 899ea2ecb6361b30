"""Per mesh axis, how long this rank's collectives take on the GPU (run.straggler_every, train/straggler.py).

A slow rank is found by its compute (straggler.BlockTimer); the time the other ranks lose to it is spent in
collectives, waiting for it, on whichever mesh axis joins them: a slow rank of a tensor-parallel group
stretches its group's tp collectives, one of a data-parallel group the dp_shard reduce-scatters, a slow
pipeline stage its neighbours' pp receives. That wait, per axis, says which axis of the job a straggler
costs (MegaScale, Jiang et al., NSDI 2024, §5: per-collective timing is how the slow machines showed).

NCCL reports each collective's duration on the device after it completes: ProcessGroupNCCL's completion
hook (`_register_on_completion_hook`) receives a WorkInfo whose `active_duration` is the time between
the CUDA events around the collective's kernel (`_enable_collectives_timing` records the start event),
which includes the kernel's wait for its slowest peer. The hook runs on NCCL's watchdog thread, off the
step's path: nothing is synchronised or added to the stream. Gloo has neither (its Work reports no
duration, and a reduce-scatter's work only completes in wait(): timing it would block where FSDP
overlaps), so on CPUs the per-axis wait is absent from the metrics, and the docs say so.

Durations land when the watchdog sees the collective done, which can be just after the step that issued
it: a window's total over its steps is exact up to its edges, so the figure is a mean per step over the
window, not a per-step median.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterable

from shardwise.parallel.comm_counter import mesh_groups

TIMED_BACKENDS = ("nccl",)  # the backends with a completion hook and device-side durations


def timed(backend: str) -> bool:
    """Whether collectives on a process group of this backend can be timed per axis (module docstring)."""
    return backend.lower() in TIMED_BACKENDS


class CollectiveClock:
    """Seconds of device time of each axis's collectives on this rank since the last `take`.

    `axes` are the axes asked for, the same on every rank (a decision on the layout and backend alone), so the
    window's all-gather has the same length everywhere; an axis whose hook could not be placed on this rank
    (torch refused it) reads NaN here instead of ending the run: monitoring never stops a job."""

    def __init__(self):
        self._lock = threading.Lock()  # the watchdog thread adds, the training thread takes
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self.axes: list[str] = []
        self.refused: dict[str, str] = {}  # axis -> why torch refused its hook on this rank

    def watch(self, axis: str, group) -> None:
        """Time `group`'s collectives under `axis`: the process group's timing on and the hook placed."""
        self.axes.append(axis)
        try:
            group._enable_collectives_timing()
            with warnings.catch_warnings():  # newer torch warns the hook will give way to its Flight Recorder, once
                warnings.simplefilter("ignore")
                group._register_on_completion_hook(self.hook(axis))
        except (RuntimeError, ValueError) as e:  # torch's DistBackendError is a RuntimeError
            self.refused[axis] = str(e).splitlines()[0] if str(e) else type(e).__name__
            return
        self._seconds[axis], self._calls[axis] = 0.0, 0

    def hook(self, axis: str) -> Callable:
        def done(info) -> None:  # torch._C._distributed_c10d.WorkInfo, on NCCL's watchdog thread
            with self._lock:
                self._seconds[axis] += info.active_duration.total_seconds()
                self._calls[axis] += 1
        return done

    def take(self) -> dict[str, tuple[float, int]]:
        """{axis: (seconds, collectives)} since the last take, and zero again; (NaN, 0) for a refused axis."""
        with self._lock:
            out = {axis: (self._seconds.get(axis, math.nan), self._calls.get(axis, 0)) for axis in self.axes}
            for axis in self._seconds:
                self._seconds[axis], self._calls[axis] = 0.0, 0
        return out

    @classmethod
    def start(cls, groups: Iterable[tuple[str, object]], backend_of: Callable[[object], str]) -> "CollectiveClock | None":
        """A clock over every (axis, process group) of a timed backend (`backend_of(group)` names it), each
        group once (two axes over the same ranks may share a group: the first axis names it); None when
        no group can be timed (gloo, one process)."""
        clock, seen = cls(), set()
        for axis, group in groups:
            if group is None or id(group) in seen or not timed(backend_of(group)):
                continue
            seen.add(id(group))
            clock.watch(axis, group)
        return clock if clock.axes else None


def mesh_axis_groups(mesh) -> list[tuple[str, object]]:
    """(axis name, process group) of every group of the trainer's mesh of more than one rank, named as the
    byte counter names it (parallel/comm_counter.py mesh_groups): the flattened dp_shard_cp group FSDP
    reduces over under context parallelism, and 2-D tensor parallelism's grid axes, are timed too."""
    return [(axis, group) for axis, group in mesh_groups(mesh).values() if group.size() > 1]
