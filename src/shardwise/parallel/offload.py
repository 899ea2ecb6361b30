"""The NVMe tier of offload (parallel.offload = "nvme"): AdamW whose state lives in a file on a local disk.

The "cpu" tier is FSDP2's CPUOffloadPolicy (data_parallel.py apply_fsdp): parameters, gradients and
the AdamW state sit in host memory and the step runs there with torch's fused CPU AdamW (one
vectorised, multi-threaded kernel per parameter group, not a Python loop over tensors). The NVMe tier
keeps that and moves the largest part of it, the two fp32 moments (8 bytes per parameter, twice the
parameters themselves), into a file, as ZeRO-Infinity does (Rajbhandari et al. 2021, arXiv
2104.07857, §5). PyTorch has no such tier (FSDP2 offloads to host memory only), hence this module.

How a step runs (NvmeAdamW.step): the parameters are cut, in a fixed order, into chunks of about
`chunk_bytes` of state; the file holds each parameter's exp_avg then exp_avg_sq, in that order, so a
chunk is one contiguous region and one read or write. One background I/O thread works through a FIFO
of "read chunk i into buffer i % 2" and "write chunk i back"; two buffers alternate (double buffering):
while chunk i is updated in one, the thread writes chunk i - 1 and then reads chunk i + 1 into the
other, so disk time hides behind the update when the disk keeps up. The update itself is torch's
fused AdamW (torch.optim.adamw.adamw, fused=True) on the chunk's local tensors: element-wise, so
cutting into chunks changes nothing and the result is bitwise that of the "cpu" tier.

Checkpoints (train/checkpoint.py, DCP) see ordinary optimizer state: `self.state[p]["exp_avg"]` is a
view of the same file mapped with mmap (shared), so a save reads it through the page cache and a load
writes into it; no second copy of the state is made in anonymous memory.

The file lives in a fresh directory under parallel.offload_dir per rank and is removed by close();
directories left by killed processes of this host are removed when the next run starts. Its space is
reserved with posix_fallocate before the first step, so a full disk stops the run at start-up (an
OSError that train/__main__.py reports as a storage failure, exit code 4).
"""
from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardwise.scratch import owned_directory
from shardwise.spec.dims import NVME_CHUNK_BYTES, NVME_STATE_BYTES_PER_PARAM

# exp_avg + exp_avg_sq, fp32 (AdamW's state for fp32 master parameters), and the chunk of it read and
# written at a time: spec/dims.py, shared with the planner and `doctor --disk`.
STATE_BYTES_PER_ELEMENT = NVME_STATE_BYTES_PER_PARAM
DEFAULT_CHUNK_BYTES = NVME_CHUNK_BYTES


@dataclass
class IOStats:
    """What the disk did for the optimizer: bytes and the I/O thread's busy seconds, and the seconds
    the step waited for a read (I/O not hidden behind compute)."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0
    steps: int = 0

    def line(self) -> str:
        def gbps(n: int, s: float) -> str:
            return f"{n / s / 1e9:.2f} GB/s" if s > 0 else "n/a"

        per_step = (self.read_bytes + self.write_bytes) / max(1, self.steps) / 2**20
        return (f"nvme offload: {per_step:.1f} MiB of optimizer state moved per step; read {gbps(self.read_bytes, self.read_s)}, "
                f"write {gbps(self.write_bytes, self.write_s)}; the step waited {self.wait_s / max(1, self.steps) * 1e3:.1f} ms "
                "per step for the disk")

    def as_dict(self) -> dict[str, float]:
        return {"nvme_read_gbps": self.read_bytes / self.read_s / 1e9 if self.read_s else 0.0,
                "nvme_write_gbps": self.write_bytes / self.write_s / 1e9 if self.write_s else 0.0,
                "nvme_wait_s_per_step": self.wait_s / max(1, self.steps),
                "nvme_bytes_per_step": (self.read_bytes + self.write_bytes) / max(1, self.steps)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's values) as a tensor shaped like `param`: a DTensor with its placements when
    the parameter is one (what checkpoints and DCP resharding expect of optimizer state)."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return local


class NvmeAdamW(torch.optim.AdamW):
    """torch's AdamW (fused) with exp_avg / exp_avg_sq in a file under `directory` (module doc).

    It is an AdamW in everything but where the moments live: param_groups, the LR schedule, state_dict
    and load_state_dict are AdamW's, so a checkpoint of this tier resumes on any other and back."""

    def __init__(self, params, directory: str | Path, rank: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs):
        kwargs = {**kwargs, "fused": True}
        kwargs.pop("foreach", None)
        super().__init__(params, **kwargs)
        # Named after this process and removed by the next run once it is gone (a killed run cannot).
        self.directory = owned_directory("nvme", Path(directory).expanduser(), tag=f"rank{rank}")
        self.stats = IOStats()
        params_in_order = [p for g in self.param_groups for p in g["params"]]
        self.offsets: dict[int, int] = {}
        position = 0
        for p in params_in_order:
            self.offsets[id(p)] = position
            position += _local(p).numel() * STATE_BYTES_PER_ELEMENT
        self.total_bytes = position
        self.path = self.directory / "adamw_state.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if position:
            try:  # ENOSPC here, before training, not in the middle of a step
                os.posix_fallocate(self.fd, 0, position)
            except OSError as e:
                os.close(self.fd)
                shutil.rmtree(self.directory, ignore_errors=True)
                raise OSError(e.errno, f"{e.strerror} (reserving {position / 2**20:.1f} MiB of optimizer state for "
                              'parallel.offload="nvme")', str(self.path)) from None
        # The whole file as one flat fp32 tensor, mapped shared: checkpoints read and write the state
        # through views of it (module doc); the step itself reads and writes with pread / pwrite.
        self.mapped = torch.from_file(str(self.path), shared=True, size=position // 4, dtype=torch.float32) \
            if position else torch.empty(0)
        self.chunks = self._cut(params_in_order, chunk_bytes)
        largest = max((sum(_local(p).numel() for p in chunk) for chunk in self.chunks), default=0)
        self.buffers = [torch.empty(2 * largest, dtype=torch.float32) for _ in range(2)]
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-nvme")

    @staticmethod  # also launch/dryrun.py's, which sizes this tier's buffers without making its file
    def _cut(params: list[nn.Parameter], chunk_bytes: int) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            bytes_ = _local(p).numel() * STATE_BYTES_PER_ELEMENT
            if chunks[-1] and size + bytes_ > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += bytes_
        return [c for c in chunks if c]

    # ---- the state as AdamW (and checkpoints) see it: views of the mapped file ----
    def _views(self, p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        local = _local(p)
        start = self.offsets[id(p)] // 4
        n = local.numel()
        avg = self.mapped[start:start + n].view(local.shape)
        sq = self.mapped[start + n:start + 2 * n].view(local.shape)
        return _like(p, avg), _like(p, sq)

    def _ensure_state(self, p: nn.Parameter) -> None:
        state = self.state[p]
        if "exp_avg" in state and state["exp_avg"] is not None:
            return
        # A new parameter's moments are zero: posix_fallocate reserved them as zeros in the file.
        state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
        state["exp_avg"], state["exp_avg_sq"] = self._views(p)

    def load_state_dict(self, state_dict: dict) -> None:
        """AdamW's load, then every moment that did not arrive in the file (DCP may hand back new
        tensors, or a checkpoint of another tier) is written into it and replaced by its file view."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "exp_avg" not in state:
                    continue
                loaded = (state["exp_avg"], state["exp_avg_sq"])
                views = self._views(p)
                for new, view in zip(loaded, views):
                    if _local(new).data_ptr() != _local(view).data_ptr():
                        _local(view).copy_(_local(new))
                state["exp_avg"], state["exp_avg_sq"] = views

    # ---- the step ----
    def _region(self, index: int, buffer: torch.Tensor) -> tuple[int, int, memoryview]:
        """Chunk `index`'s byte offset in the file, its size, and the bytes of `buffer` it fills."""
        chunk = self.chunks[index]
        size = sum(_local(p).numel() for p in chunk) * STATE_BYTES_PER_ELEMENT
        return self.offsets[id(chunk[0])], size, memoryview(buffer.numpy()).cast("B")[:size]

    def _read(self, index: int, buffer: torch.Tensor) -> None:
        start, size, view = self._region(index, buffer)
        begin = time.perf_counter()
        done = 0
        while done < size:  # pread may return less than asked (large reads, signals)
            got = os.preadv(self.fd, [view[done:]], start + done)
            if got == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {start + done}")
            done += got
        self.stats.read_s += time.perf_counter() - begin
        self.stats.read_bytes += size

    def _write(self, index: int, buffer: torch.Tensor) -> None:
        start, size, view = self._region(index, buffer)
        begin = time.perf_counter()
        done = 0
        while done < size:
            done += os.pwritev(self.fd, [view[done:]], start + done)
        self.stats.write_s += time.perf_counter() - begin
        self.stats.write_bytes += size

    def _update(self, chunk: list[nn.Parameter], buffer: torch.Tensor, group_index: dict[int, int]) -> None:
        """Fused AdamW on one chunk, its moments being views of `buffer` (the file's layout).
        `group_index`: parameter id -> index in param_groups, taken at this step (load_state_dict
        replaces the group dicts, and the LR scheduler writes into the current ones)."""
        from torch.optim.adamw import adamw

        by_group: dict[int, list[tuple]] = {}
        position = 0
        for p in chunk:
            n = _local(p).numel()
            avg, sq = buffer[position:position + n], buffer[position + n:position + 2 * n]
            position += 2 * n
            if p.grad is None:
                continue
            local = _local(p)
            by_group.setdefault(group_index[id(p)], []).append(
                (local, _local(p.grad), avg.view(local.shape), sq.view(local.shape), self.state[p]["step"]))
        for index, group in enumerate(self.param_groups):
            items = by_group.get(index)
            if not items:
                continue
            params, grads, avgs, sqs, steps = (list(x) for x in zip(*items))
            beta1, beta2 = group["betas"]
            adamw(params, grads, avgs, sqs, [], steps, fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                self._ensure_state(p)
        group_index = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        reads: dict[int, Future] = {}
        pending: list[Future] = []
        count = len(self.chunks)
        for i in range(min(2, count)):
            reads[i] = self.io.submit(self._read, i, self.buffers[i % 2])
        try:
            for i in range(count):
                begin = time.perf_counter()
                reads.pop(i).result()
                self.stats.wait_s += time.perf_counter() - begin
                self._update(self.chunks[i], self.buffers[i % 2], group_index)
                pending.append(self.io.submit(self._write, i, self.buffers[i % 2]))
                if i + 2 < count:  # FIFO: chunk i is written before chunk i + 2 reuses its buffer
                    reads[i + 2] = self.io.submit(self._read, i + 2, self.buffers[i % 2])
        finally:
            for f in [*pending, *reads.values()]:
                f.result()  # every write has landed before the step returns (and a failed one raises here)
        self.stats.steps += 1
        return loss

    def resident_bytes(self) -> int:
        """Bytes of optimizer state in memory: the two chunk buffers and the step counters."""
        steps = sum(s["step"].numel() * s["step"].element_size() for s in self.state.values() if "step" in s)
        return sum(b.numel() * b.element_size() for b in self.buffers) + steps

    def close(self) -> None:
        """Stop the I/O thread and remove this rank's state directory (the run is over; checkpoints hold
        the state)."""
        self.io.shutdown(wait=True)
        self.mapped = torch.empty(0)
        self.state.clear()
        try:
            os.close(self.fd)
        except OSError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
