"""A worker process's life in the default process group: join it, pick its device, leave it.

Shared by the two worker entry points, `python -m shardwise.train` (train/__main__.py) and
`python -m shardwise.parity --worker` (parity.py), so both start and end a process the same way.
torch is imported inside the functions: a worker installs its signal handling before it pays for
torch's import (train/__main__.py main()).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch

# torchrun's own variables: this job's id and how many times its agent restarted the workers.
RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def init_distributed(timeout_s: float = 600) -> bool:
    """Join the default process group when launched by torchrun; return whether we did."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    # torch's flight recorder (also on gloo): the stall report names each rank's last collectives.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store for every restart of the worker group (torch 2.13), so the
        # default group's keys of a failed attempt are still there: a restarted rank can read a dead
        # peer's address and fail to connect ("Connection refused"). Scope the keys by attempt.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timeout)
        store = dist.PrefixStore(f"shardwise/attempt_{os.environ.get(RESTART_COUNT, '0')}", agent_store)
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return True


def default_device() -> "torch.device":
    """This process's device: one GPU per local rank when CUDA is present, else the CPU."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        local = dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def finish_distributed() -> None:
    """The end of a successful distributed run: every rank is done before any tears down (a barrier:
    no rank closes its gloo sockets while a peer still runs collectives or rank-0-only work such as
    the loss-curve plot), then the default group is destroyed."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a worker process without interpreter teardown. destroy_process_group() does not destroy
    gloo backends that DeviceMesh and FSDP2 still reference, so their C++ threads are alive at exit;
    tearing them down during interpreter finalization is where a joinable std::thread would call
    std::terminate ("terminate called without an active exception", SIGABRT, exit code -6 for a run
    that finished). Everything the run writes is closed by now; flush the console and leave."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
