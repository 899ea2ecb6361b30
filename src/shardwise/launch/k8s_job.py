"""What every pod of a `shardwise launch k8s` manifest is made of, whatever its kind: the `shardwise train`
command, the shell that waits for node 0's name, the volumes (the config, the shared directory, /dev/shm and
how it is sized), and the names Kubernetes accepts. launch/k8s.py checks the user's input into a Job,
launch/k8s_kinds.py writes it as a TrainJob, JobSet or PyTorchJob, launch/k8s_check.py checks the result.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Where the pod finds what the manifest mounts: the config (a ConfigMap, so the job needs nothing of the
# machine that wrote it), the shared volume the job runs in (relative paths of the config, run.dir first,
# land there) and the memory-backed /dev/shm.
CONFIG_DIR = "/etc/shardwise"
CONFIG_FILE = "run.toml"
WORKDIR = "/workspace"
SHM_DIR = "/dev/shm"
# A ConfigMap holds at most 1 MiB (Kubernetes' etcd object limit).
CONFIG_MAP_MAX_BYTES = 1 << 20
# /dev/shm: what NCCL needs (its SHM transport between the GPUs of a pod and the network proxy's buffers;
# the doctor warns below the same figure, launch/doctor.py SHM_MIN_BYTES) plus the batches of data.num_workers
# in flight: each worker keeps this many ready (train/loader.py PREFETCH_PER_WORKER; a unit test holds them
# equal) and hands them to its rank through shared memory, and the rank holds one more, the step's own.
NCCL_SHM_BYTES = 1 << 30
LOADER_BATCHES_PER_WORKER = 2
TOKEN_BYTES = 8  # a batch's token ids are int64 (train/data.py TokenBatches)
SHM_STEP = 256 << 20


@dataclass(frozen=True)
class Shm:
    bytes: int
    why: str

    @property
    def quantity(self) -> str:
        return f"{self.bytes >> 30}Gi" if self.bytes % (1 << 30) == 0 else f"{self.bytes >> 20}Mi"


@dataclass(frozen=True)
class Job:
    """Everything a manifest of any kind is made of, checked."""

    kind: str
    name: str
    image: str
    nodes: int  # the most nodes (MAX of an elastic MIN:MAX)
    min_nodes: int | None  # elastic: the fewest the job goes on with; None: a fixed node count
    gpus_per_node: int
    config_text: str
    overrides: tuple[str, ...]
    pvc: str | None
    queue: str | None
    max_restarts: int
    rendezvous_timeout_s: float
    shm: Shm

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def multinode(self) -> bool:
        return self.nodes > 1

    def train_command(self) -> list[str]:
        """The `shardwise train` a node of the torchrun path runs; the node's rank and node 0's address are
        Kubernetes `$(VAR)` references to the pod's environment, which the kubelet expands."""
        command = ["shardwise", "train", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--nproc", str(self.gpus_per_node)]
        if self.multinode:
            spec = f"{self.min_nodes}:{self.nodes}" if self.elastic else str(self.nodes)
            command += ["--nnodes", spec, "--node-rank", "$(PET_NODE_RANK)", "--rdzv-endpoint",
                        "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
        # The user's overrides reach the command as written: the kubelet turns each `$$` into `$`, so a `$(...)` of
        # theirs is no reference to the pod's environment.
        return command + [o.replace("$", "$$") for o in self.overrides]

    def entrypoint(self) -> list[str]:
        """The container's command; its args are train_command(). A shell only to wait for node 0's name:
        the pod's DNS record appears once node 0's pod has an address, which may be after this pod starts,
        and `shardwise train` refuses a rendezvous name that does not resolve (exit 2, a typo's answer)."""
        lines = [f"cd {WORKDIR}"]
        if self.multinode:
            wait = math.ceil(self.rendezvous_timeout_s)
            lines += [f"# Node 0's name resolves once its pod has an address: wait up to run.rendezvous_timeout_s ({wait} s),",
                      "# then `shardwise train` itself says what is wrong.",
                      "i=0",
                      f'while ! getent hosts "$PET_MASTER_ADDR" >/dev/null && [ "$i" -lt {wait} ]; do',
                      "  sleep 1",
                      "  i=$((i + 1))",
                      "done"]
        lines.append('exec "$@"')
        return ["/bin/sh", "-c", "\n".join(lines) + "\n", "shardwise-pod"]

    def volumes(self) -> list[dict]:
        workspace = {"persistentVolumeClaim": {"claimName": self.pvc}} if self.pvc else {"emptyDir": {}}
        return [{"name": "config", "configMap": {"name": config_map_name(self.name)}},
                {"name": "workspace", **workspace},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm.quantity}}]

    def volume_mounts(self) -> list[dict]:
        return [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "workspace", "mountPath": WORKDIR},
                {"name": "dshm", "mountPath": SHM_DIR}]

    def labels(self) -> dict:
        return {"kueue.x-k8s.io/queue-name": self.queue} if self.queue else {}


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def shm_size(cfg, dp: int, gpus_per_node: int) -> Shm:
    """The /dev/shm a pod needs: NCCL's share plus the loader batches in flight on its ranks (`dp`: the
    data-parallel size at the fewest nodes, where a rank's share of the batch is largest), rounded up to
    SHM_STEP. A limit, not a reservation: the pod's memory is charged with what is written there."""
    batch = cfg.train.global_batch // dp * (cfg.train.seq_len + 1) * TOKEN_BYTES
    workers = cfg.data.num_workers
    in_flight = gpus_per_node * (workers * LOADER_BATCHES_PER_WORKER + 1) * batch if workers else 0
    size = math.ceil((NCCL_SHM_BYTES + in_flight) / SHM_STEP) * SHM_STEP
    data = (f"{gpus_per_node} ranks x ({workers} data.num_workers x {LOADER_BATCHES_PER_WORKER} batches + 1) x "
            f"{_size(batch)} a batch (global_batch {cfg.train.global_batch} / dp {dp} x (seq_len {cfg.train.seq_len} + 1) x "
            f"{TOKEN_BYTES} B) = {_size(in_flight)}" if workers else "no loader batches (data.num_workers = 0)")
    return Shm(size, f"1 GiB for NCCL (its SHM transport and proxy buffers) + {data}, rounded up to {SHM_STEP >> 20} MiB")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def dns1035_problem(name: str) -> str | None:
    """Kubernetes' IsDNS1035Label: what a Service, and so every name a pod is reached by, must be."""
    if len(name) > 63:
        return f"{name!r} is {len(name)} characters, more than 63"
    if not _DNS1035.fullmatch(name):
        return f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', a letter first, no '-' last)"
    return None


def dns1123_subdomain_problem(name: str) -> str | None:
    """Kubernetes' IsDNS1123Subdomain: object names such as a PersistentVolumeClaim's or a LocalQueue's."""
    if len(name) > 253:
        return f"{name!r} is {len(name)} characters, more than 253"
    if not all(_DNS1123_LABEL.fullmatch(part) for part in name.split(".")):
        return f"{name!r} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.')"
    return None


def longest_pod_name(kind: str, name: str, nodes: int) -> str:
    """The longest name a pod of the job gets (also its host name and, for PyTorchJob, its Service's): a
    JobSet's pods are <jobset>-<replicatedJob>-<job index>-<pod index>-<5 random characters> (the JobSet
    webhook checks that form), a TrainJob's JobSet is named after it, a PyTorchJob's pods <job>-worker-<i>."""
    if kind == "pytorchjob":
        return f"{name}-worker-{nodes - 1}"
    return f"{name}-node-0-{nodes - 1}-abcde"
