"""`shardwise doctor` inside a Kubernetes pod: that it is one, what the pod was given (its /dev/shm, its
GPUs) and whether node 0's rendezvous name resolves from here.

Read from the variables the platform sets, which describe the pod and are no configuration of ours:
KUBERNETES_SERVICE_HOST (the kubelet sets it in every container), the rendezvous that Kubeflow's torch
runtime, the training operator or `shardwise launch k8s` declares (PET_MASTER_ADDR / PET_MASTER_PORT,
PET_RDZV_ENDPOINT, MASTER_ADDR), PET_NODE_RANK, and NVIDIA_VISIBLE_DEVICES (the device plugin's choice).
Each check is a (name, status, detail, advice) tuple, as launch/doctor.py's Check takes it.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

from shardwise.launch.nccl_log import FAIL, OK, SKIP, WARN

FIX_SHM = ("mount a memory-backed emptyDir at /dev/shm (medium: Memory, sizeLimit); `shardwise launch k8s` writes one "
           "sized for the run")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _binds(address: str) -> bool:
    """Whether `address` is one of this pod's own (binding to it succeeds only then)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def rendezvous_name(environ: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(host, port, the variable it came from) of node 0's rendezvous, as this pod's launcher reads it."""
    if environ.get("PET_MASTER_ADDR"):
        return environ["PET_MASTER_ADDR"], environ.get("PET_MASTER_PORT", "?"), "PET_MASTER_ADDR"
    if environ.get("PET_RDZV_ENDPOINT"):
        host, _, port = environ["PET_RDZV_ENDPOINT"].rpartition(":")
        return (host, port, "PET_RDZV_ENDPOINT") if host else (port, "?", "PET_RDZV_ENDPOINT")
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"], environ.get("MASTER_PORT", "?"), "MASTER_ADDR"
    return None


def pod_checks(environ: Mapping[str, str], gpus: int, shm_min: int, shm_bytes: int | None = -1, hostname: str | None = None,
               resolve: Callable = socket.getaddrinfo, binds: Callable[[str], bool] = _binds) -> list[tuple[str, str, str, str]]:
    """The pod's checks, none outside Kubernetes. `gpus`: the CUDA devices the doctor sees; `shm_min`: the least
    /dev/shm it accepts (launch/doctor.py SHM_MIN_BYTES); `shm_bytes`: the size of /dev/shm (-1: read it);
    `resolve` / `binds`: name resolution and the own-address test (injected by tests)."""
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return []
    shm = _shm_bytes() if shm_bytes == -1 else shm_bytes
    visible = environ.get("NVIDIA_VISIBLE_DEVICES")
    given = f"{gpus} GPU(s) visible" + (f" (NVIDIA_VISIBLE_DEVICES={visible})" if visible else "")
    detail = (f"in a pod ({hostname or socket.gethostname()}; API server {environ['KUBERNETES_SERVICE_HOST']}); "
              f"/dev/shm {_gib(shm) if shm is not None else 'unreadable'}; {given}")
    checks = [("kubernetes", OK, detail, "")]
    if shm is not None and shm < shm_min:
        checks[0] = ("kubernetes", WARN, detail, f"/dev/shm is {_gib(shm)}, too small for NCCL and data-loader workers: {FIX_SHM}")
    found = rendezvous_name(environ)
    if found is None:
        return checks + [("rendezvous", SKIP, "no rendezvous in this pod's environment (PET_MASTER_ADDR, PET_RDZV_ENDPOINT, "
                          "MASTER_ADDR unset): a one-node job", "")]
    host, port, source = found
    rank = environ.get("PET_NODE_RANK")
    where = f"{host}:{port} ({source}{f'; this pod is node {rank}' if rank is not None else ''})"
    try:
        addresses = sorted({info[4][0] for info in resolve(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError) as e:
        return checks + [("rendezvous", WARN, f"{where} does not resolve (yet): {getattr(e, 'strerror', None) or e}",
                          "node 0's pod has no address yet, or no headless Service names it (a JobSet's network."
                          "enableDNSHostnames, a TrainJob's runtime, a PyTorchJob's per-pod Service); `shardwise launch k8s` "
                          "pods wait for it up to run.rendezvous_timeout_s")]
    own = [a for a in addresses if binds(a)]
    text = f"{where} resolves to {', '.join(addresses)}"
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return checks + [("rendezvous", FAIL, text, "a loopback address: the other pods would dial themselves; node 0's "
                          "name must resolve to its pod's address (the headless Service's record)")]
    if rank == "0" and not own:
        return checks + [("rendezvous", FAIL, text + ", not an address of this pod, but node 0 serves the rendezvous",
                          "node 0's name must be this pod's: check the job's name and subdomain in PET_MASTER_ADDR")]
    return checks + [("rendezvous", OK, text + (": this pod's own address (node 0 serves the rendezvous here)" if own else ""), "")]
