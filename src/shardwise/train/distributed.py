"""A worker process's life in the default process group: join it, pick its device, leave it.

Shared by the two worker entry points, `python -m shardwise.train` (train/__main__.py) and
`python -m shardwise.parity --worker` (parity.py), so both start and end a process the same way.
torch is imported inside the functions: a worker installs its signal handling before it pays for
torch's import (train/__main__.py main()).

Who started the worker decides where its rank comes from (rank_env): torchrun's RANK / LOCAL_RANK /
WORLD_SIZE first, else the launcher's own variables — Open MPI's mpirun, MPICH / Intel MPI (PMI),
SLURM's srun. A worker not started by torchrun gets torchrun's names set from them, so everything
downstream (env:// rendezvous, the stall watchdog's store client) runs unchanged.
"""
from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from shardwise.errors import ConfigError
from shardwise.spec.layout import PROCESS_GROUP_BACKENDS
from shardwise.train.network import pin_gloo_interface

if TYPE_CHECKING:
    import torch

# torchrun's own variables: this job's id and how many times its agent restarted the workers.
RUN_ID = "TORCHELASTIC_RUN_ID"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

# Per launcher, first match wins: (source, rank, local rank, world size, ranks on this node). torchrun
# comes first: `srun torchrun ...` and `mpirun torchrun ...` set both, and torchrun's are the workers'.
_RANK_VARIABLES = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (Hydra)
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_TASKS_PER_NODE"),
)
# A launcher's job id, for a rendezvous port every rank derives alike (Open MPI 4, Open MPI 5 / PMIx, SLURM).
_JOB_ID_VARIABLES = ("SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
# torch's own default port, when neither MASTER_PORT nor a job id is known.
DEFAULT_PORT = 29500
# Ports derived from a job id lie in [10000, 30000): below Linux's ephemeral range (32768+), so an
# outgoing connection of another process cannot be holding the port rank 0 must listen on.
_PORT_BASE, _PORT_SPAN = 10000, 20000


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, and where rank 0 listens for the rendezvous."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "openmpi" | "pmi" | "slurm" | "single"
    local_world_size: int = 1

    def torchrun_variables(self) -> dict[str, str]:
        """torchrun's names for these values (what init_process_group's env:// and the watchdog read)."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[003-005,9],cpu1" -> "gpu003"), in pure Python: the
    fallback where `scontrol show hostnames` is not installed (it expands the same way)."""
    host, i = "", 0
    while i < len(nodelist) and nodelist[i] != ",":  # a top-level comma ends the first host
        if nodelist[i] == "[":
            end = nodelist.index("]", i)
            host += nodelist[i + 1:end].split(",")[0].split("-")[0]  # a range's first value, zero padding kept
            i = end + 1
        else:
            host += nodelist[i]
            i += 1
    return host.strip()


def scontrol_first_host(nodelist: str) -> str:
    """The first host of a node list as SLURM itself expands it, when scontrol is on PATH."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return first_slurm_host(nodelist)


def _tasks_on_node(per_node: str, node_id: int) -> int | None:
    """SLURM's tasks-per-node list ("4(x2),3" = 4, 4, 3) at this node's index; None if unreadable."""
    counts: list[int] = []
    try:
        for part in per_node.split(","):
            value, _, repeat = part.partition("(x")
            counts += [int(value)] * (int(repeat.rstrip(")")) if repeat else 1)
        return counts[node_id]
    except (ValueError, IndexError):
        return None


def _rank_variables(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The first launcher's variable names (a _RANK_VARIABLES row) that `env` carries, or None."""
    return next((names for names in _RANK_VARIABLES if names[1] in env and names[3] in env), None)


def launcher(env: Mapping[str, str]) -> str:
    """Who started this process: "torchrun", "openmpi", "pmi", "slurm", or "single" (nobody we know)."""
    found = _rank_variables(env)
    return found[0] if found else "single"


def rank_env(env: Mapping[str, str], first_host: Callable[[str], str] = first_slurm_host) -> RankEnv:
    """This process's rank, local rank, world size and rendezvous address from its environment (pure:
    `first_host` expands a SLURM node list). Raises ConfigError when a multi-node job does not say
    where rank 0 is."""
    found = _rank_variables(env)
    if found is None:
        return RankEnv(0, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", DEFAULT_PORT)), "single")
    source, rank_var, local_var, size_var, local_size_var = found
    try:
        rank, world = int(env[rank_var]), int(env[size_var])
        local_rank = int(env.get(local_var, rank))  # absent: one node (tests/harness.py sets no LOCAL_RANK)
        if source == "slurm":
            local_world = _tasks_on_node(env.get(local_size_var) or env.get("SLURM_TASKS_PER_NODE", ""),
                                         int(env.get("SLURM_NODEID", "0")))
        else:
            local_world = int(env[local_size_var]) if local_size_var in env else None
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
    except ValueError as e:
        raise ConfigError(rank_var, f"the {source} launcher's variables are not integers ({e})",
                          "start workers with torchrun, mpirun or srun, which set them") from None
    local_world = local_world or (world if local_rank == rank else local_rank + 1)
    nodes = env.get("GROUP_WORLD_SIZE", "") if source == "torchrun" else ""  # torchrun's agents in the job
    if nodes.isdigit() and int(nodes) * local_world != world:
        # torchrun lets nodes start different numbers of workers; the layout rules (a TP group within a node,
        # HSDP's replicas across nodes, the planner's nodes) assume the same count on every node.
        raise ConfigError("--nproc", f"the job's {world} ranks are not the same number on each of its {nodes} nodes "
                          f"({local_world} on this one): its nodes were started with different --nproc",
                          "start every node with the same --nproc")
    job_id = next((env[v] for v in _JOB_ID_VARIABLES if env.get(v)), None)
    if port is None:
        # A numeric id as the sbatch script of `shardwise launch slurm` derives it; a text id by its CRC-32.
        number = int(job_id) if job_id and job_id.isdigit() else zlib.crc32(job_id.encode()) if job_id else None
        port = _PORT_BASE + number % _PORT_SPAN if number is not None else DEFAULT_PORT
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if local_world >= world:  # every rank on this node: rank 0 is here
            addr = "127.0.0.1"
        elif nodelist:  # srun places rank 0 on the first node (block distribution, the default)
            addr = first_host(nodelist)
        else:
            raise ConfigError("MASTER_ADDR", f"rank {rank} of {world} ({source}) runs on a multi-node job that does "
                              "not say which host rank 0 runs on",
                              "export MASTER_ADDR=<rank 0's host> (and MASTER_PORT) and pass them to every rank "
                              "(mpirun -x MASTER_ADDR -x MASTER_PORT; `shardwise launch mpirun` prints the command)")
    return RankEnv(rank, local_rank, world, addr, port, source, local_world)


def cuda_index(local_rank: int, local_world_size: int, device_count: int, visible: str | None,
               shared: bool = False) -> int:
    """The GPU a local rank uses: LOCAL_RANK % device_count, among the devices CUDA_VISIBLE_DEVICES
    leaves visible. More local ranks than visible devices would put two ranks on one GPU (NCCL refuses
    or hangs): refused, unless the launcher gave each rank one device of its own (one visible device
    and CUDA_VISIBLE_DEVICES set per rank, as `srun --gpus-per-task=1` does) or the ranks talk over
    gloo (`shared`: run.backend="gloo", which carries CUDA tensors between processes on one GPU)."""
    if device_count < 1:
        raise ConfigError("CUDA_VISIBLE_DEVICES", f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={visible!r})",
                          "unset CUDA_VISIBLE_DEVICES or list this node's GPUs in it")
    bound_per_rank = device_count == 1 and visible is not None
    if local_world_size > device_count and not bound_per_rank and not shared:
        raise ConfigError("--nproc", f"{local_world_size} ranks on this node but {device_count} visible CUDA "
                          f"device(s) (CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'})",
                          f"start at most {device_count} ranks per node (--nproc / mpirun -H host:{device_count} / "
                          "srun --ntasks-per-node), or make more GPUs visible (--run.backend=gloo lets ranks share "
                          "a GPU to check a layout's placement, not for speed)")
    return local_rank % device_count


def process_group_backend(backend: str, cuda: bool) -> str:
    """run.backend resolved: "auto" is NCCL with CUDA and gloo without; "nccl" needs CUDA."""
    if backend not in PROCESS_GROUP_BACKENDS:
        raise ConfigError("run.backend", f"{backend!r} is not one of {', '.join(PROCESS_GROUP_BACKENDS)}", 'use "auto"')
    if backend == "nccl" and not cuda:
        raise ConfigError("run.backend", '"nccl" needs CUDA, and no CUDA device is available',
                          'use "auto" (gloo on CPU)')
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    return backend


def _gpus_shared() -> bool:
    """A gloo default group on CUDA is run.backend="gloo": its ranks may share a GPU (cuda_index)."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def init_distributed(timeout_s: float = 600, backend: str = "auto") -> bool:
    """Join the default process group when launched by torchrun, mpirun or srun; return whether we did.
    `backend`: run.backend (process_group_backend)."""
    import torch
    import torch.distributed as dist

    # A process that dies in native code (SIGABRT from std::terminate or a backend's check, SIGSEGV) prints
    # where each of its threads was; without this a launcher can only say which signal ended a rank.
    try:
        faulthandler.enable(all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (captured in tests)
        pass
    where = rank_env(os.environ, scontrol_first_host)
    if where.world_size <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = process_group_backend(backend, torch.cuda.is_available())
    if torch.cuda.is_available():  # refused here, on every rank alike, before any rank waits for a peer
        cuda_index(where.local_rank, where.local_world_size, torch.cuda.device_count(),
                   os.environ.get("CUDA_VISIBLE_DEVICES"), shared=backend == "gloo")
    if where.source != "torchrun":
        # env:// below, the stall watchdog's store client (train/watchdog.py) and default_device read
        # torchrun's names; an MPI / SLURM worker gets them from its launcher's values.
        os.environ.update(where.torchrun_variables())
        if "OMP_NUM_THREADS" not in os.environ:  # what launch/local.py gives torchrun's workers: the cores split
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // where.local_world_size))
    # torch's flight recorder (also on gloo): the stall report names each rank's last collectives.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    pin_gloo_interface(os.environ)  # gloo on the network that reaches the rendezvous (train/network.py)
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
    if where.source != "torchrun" or torch.cuda.is_available():  # torchrun on CPU: as before, no line per rank
        print(startup_line(where), flush=True)
    return True


def agreed_attempt(attempt: int) -> int:
    """The largest restart count of any rank's agent, the same on every rank. The agents of an elastic job
    (`shardwise train --nnodes MIN:MAX`) each count their own restarts, and a node that joins later
    counts from 0 while its peers have restarted: the ranks must still agree whether this worker group is
    a restart (which resumes from the newest checkpoint: a collective load) and name its store keys alike."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([attempt], device=default_device() if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def startup_line(where: RankEnv) -> str:
    """One line per rank: which launcher placed it where, and the device it takes."""
    import torch

    device = "cpu"
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device = f"cuda:{cuda_index(where.local_rank, where.local_world_size, torch.cuda.device_count(), visible, _gpus_shared())} " \
                 f"(CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'})"
    return (f"rank {where.rank}/{where.world_size} local {where.local_rank}/{where.local_world_size} from {where.source}: "
            f"{device}, rendezvous {where.master_addr}:{where.master_port}")


def default_device() -> "torch.device":
    """This process's device: GPU LOCAL_RANK % device_count (of those CUDA_VISIBLE_DEVICES leaves
    visible) when CUDA is present, else the CPU."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        where = rank_env(os.environ) if dist.is_initialized() else None
        local = cuda_index(where.local_rank, where.local_world_size, torch.cuda.device_count(),
                           os.environ.get("CUDA_VISIBLE_DEVICES"), shared=_gpus_shared()) if where else 0
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
