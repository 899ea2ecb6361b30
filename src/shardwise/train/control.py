"""The trainer's control channel: small agreements every rank must reach together.

Whether to skip a step, whether to stop, whether a checkpoint write failed somewhere, which files a
checkpoint holds and their checksums: each is one tiny collective on a process group of its own (gloo,
so the flags live on the CPU also on NCCL runs). A group of its own keeps this traffic out of the
per-axis communication counter (parallel/comm_counter.py names it "control" and skips it), so the counted
bytes stay the planner's training traffic. On one process every method is the identity.
"""
from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.parallel.comm_counter import CONTROL_AXIS


class Control:
    def __init__(self, distributed: bool, timeout_s: float):
        self.group = dist.new_group(backend="gloo", group_desc=CONTROL_AXIS, timeout=timedelta(seconds=timeout_s)) \
            if distributed else None
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

    @property
    def group_name(self) -> str | None:
        return self.group.group_name if self.group is not None else None

    def max(self, values: list[float]) -> list[float]:
        """Elementwise maximum over ranks (flags: any rank's 1 wins)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def first_failure(self, failed: bool) -> int | None:
        """The lowest rank that failed, or None when none did (every rank learns the same)."""
        t = torch.tensor([self.rank if failed else self.world_size], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        first = int(t.item())
        return None if first >= self.world_size else first

    def broadcast_json(self, value=None):
        """Rank 0's JSON-serialisable value on every rank (as bytes in tensors: nothing is unpickled)."""
        if self.group is None:
            return value
        data = json.dumps(value).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, group=self.group, group_src=0)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, group=self.group, group_src=0)
        return json.loads(buf.numpy().tobytes().decode()) if self.rank != 0 else value

    def all_gather_json(self, value) -> list:
        """Every rank's JSON-serialisable value, in rank order, on every rank (bytes in tensors, padded to the
        longest: nothing is unpickled)."""
        if self.group is None:
            return [value]
        data = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(n.item()) for n in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [json.loads(buf[:int(n.item())].numpy().tobytes().decode()) for buf, n in zip(every, sizes)]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over ranks (partitioned work: each entry filled by one rank)."""
        if self.group is not None:
            dist.all_reduce(values, group=self.group)
        return values

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
