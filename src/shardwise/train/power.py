"""GPU energy per step: watts, joules per token and kWh, from NVML's energy counter (nvidia-ml-py).

NVML's nvmlDeviceGetTotalEnergyConsumption is the board's energy in millijoules since the driver loaded
(Volta and newer): the difference between two readings is what the GPU drew in between, with no
sampling of instantaneous power and so no aliasing on short steps. Each rank reads its own GPU (found by
UUID, so CUDA_VISIBLE_DEVICES and LOCAL_RANK mapping need no guessing); on logging steps the ranks sum
their joules (one all-reduce of one number), so `energy_j_per_token` is the whole job's GPU energy per
trained token and `energy_kwh` its running total; `power_w` is rank 0's own board, averaged over the
interval. GPU boards only: CPU, memory, network and cooling
are not in it. Without a GPU or without NVML the fields are simply absent (metrics.jsonl says nothing
it did not measure).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

JOULES_PER_KWH = 3.6e6


def nvml_handle(device: torch.device) -> tuple[Any, Any] | None:
    """nvidia-ml-py and this CUDA device's NVML handle (found by the device's UUID), or None where NVML cannot
    read it: a CPU, no driver, nvidia-ml-py missing (also used by benchmarks/kernel_sustained.py)."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001  (pynvml raises NVMLError subclasses; any of them means: no reading)
        return None


def nvml_energy_reader(device: torch.device) -> Callable[[], float] | None:
    """A function returning this GPU's energy counter in joules, or None where there is none to read."""
    found = nvml_handle(device)
    if found is None:
        return None
    pynvml, handle = found
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # not supported before Volta: NVMLError
    except Exception:  # noqa: BLE001  (any NVMLError subclass means: no reading)
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def agreed(reader: Callable[[], float] | None, group, device: torch.device) -> Callable[[], float] | None:
    """The reader where every rank of `group` has one, else None everywhere: the ranks then agree
    whether logging steps sum energy (a rank without a reading would leave the others waiting)."""
    if group is None:
        return reader
    import torch.distributed as dist

    have = torch.tensor([1 if reader is not None else 0], dtype=torch.int32, device=device)  # NCCL: on the GPU
    dist.all_reduce(have, op=dist.ReduceOp.MIN, group=group)
    return reader if int(have) == 1 else None


class EnergyMeter:
    """interval(tokens, seconds, group) on logging steps: the job's GPU energy since the previous call.

    NVML's counter moves in steps (measured on an H200: it stood still over most 26 ms training steps),
    so an interval over which no rank's counter moved says nothing about its power: its tokens and
    seconds are carried into the next interval, and J/token and watts are reported over the span from
    one move of the counter to the next (0 J over 26 ms would be a wrong figure, not a small one)."""

    def __init__(self, read_joules: Callable[[], float] | None, device: torch.device | None = None):
        self.read, self.device = read_joules, device if device is not None else torch.device("cpu")
        self.last = read_joules() if read_joules is not None else 0.0
        self.total_joules, self.total_tokens = 0.0, 0  # over every interval (the run's J/token)
        self.pending_tokens, self.pending_seconds = 0, 0.0  # since the counter last moved

    @property
    def enabled(self) -> bool:
        return self.read is not None

    def interval(self, tokens: int, seconds: float, group=None) -> dict[str, float]:
        """`tokens`: tokens the whole job trained since the previous call; `seconds`: the time it took.
        Returns energy_kwh always; power_w and energy_j_per_token once the counter has moved."""
        if self.read is None:
            return {}
        now = self.read()
        joules = torch.tensor([now - self.last], dtype=torch.float64, device=self.device)
        self.last = now
        mine = float(joules)
        if group is not None:  # every rank calls this on the same steps, moved or not
            import torch.distributed as dist

            dist.all_reduce(joules, group=group)
        self.total_joules += float(joules)
        self.total_tokens += tokens
        self.pending_tokens += tokens
        self.pending_seconds += seconds
        record = {"energy_kwh": self.total_joules / JOULES_PER_KWH}
        if float(joules) > 0:
            record |= {"power_w": mine / self.pending_seconds if self.pending_seconds > 0 else 0.0,
                       "energy_j_per_token": float(joules) / max(1, self.pending_tokens)}
            self.pending_tokens, self.pending_seconds = 0, 0.0
        return record
