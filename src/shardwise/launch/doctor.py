"""`shardwise doctor [--json] [--nproc N]`: is this machine ready for a distributed run, and which path
would NCCL take? `shardwise doctor --disk DIR [--disk-mib N]`: how fast is the disk under DIR for
parallel.offload = "nvme" (and the `--cluster.disk_gbps` to plan with)?

It reports versions, devices, each GPU's health (launch/gpu_health.py: power limit, what holds its
clocks, memory errors, MIG, PCIe width), cores, /dev/shm, locked memory, InfiniBand ports and the NCCL_* /
UCX_* variables in effect (in a Kubernetes pod also the pod and its rendezvous name: launch/k8s_doctor.py),
then runs a short all-reduce in fresh processes: NCCL on GPUs (with NCCL_DEBUG=INFO for those children only;
the log is read by nccl_log.py into a verdict per path), gloo on CPU. Exit 0 when nothing is wrong, 1 when
a check failed (each failed check is named), 2 for bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import EXIT_FAILED, EXIT_OK, ConfigError
from shardwise.launch import nccl_log
from shardwise.launch.gpu_health import health_checks, nvml_gpus, skipped
from shardwise.launch.k8s_doctor import pod_checks
from shardwise.launch.local import check_nproc
from shardwise.launch.nccl_log import FAIL, OK, SKIP, WARN
from shardwise.plan.calibration import bandwidths
from shardwise.spec.dims import NVME_CHUNK_BYTES

RESULT_TAG = "SHARDWISE_DOCTOR_RESULT "
# Docker's default /dev/shm is 64 MiB: NCCL's SHM transport and DataLoader workers need far more.
SHM_MIN_BYTES = 1 << 30
# Long enough for process start (~3-5 s per rank on 2 cores, docs/architecture.md §4) and NCCL's
# init on a large node; short enough that a hung transport is reported rather than waited on.
COLLECTIVE_TIMEOUT_S = 120
IB_ROOT = Path("/sys/class/infiniband")
# Variables whose mere presence changes which transport NCCL may pick; worth a word when set.
_STEERING = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str   # ok / warn / fail / skip (nccl_log.py)
    detail: str
    advice: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "advice": self.advice}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def versions() -> tuple[list[Check], dict]:
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda
    nccl = None
    if cuda and dist.is_available() and dist.is_nccl_available():
        found = torch.cuda.nccl.version()  # a tuple (2, 21, 5); older torch builds return one int, 22105
        nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": cuda, "nccl": nccl,
             "gloo": dist.is_available() and dist.is_gloo_available()}
    checks = [Check("python", OK, facts["python"]), Check("torch", OK, facts["torch"]),
              Check("cuda", OK if cuda else SKIP, cuda or "torch built without CUDA"),
              Check("nccl", OK if nccl else SKIP, nccl or "not in this torch build"),
              Check("gloo", OK if facts["gloo"] else FAIL, "available" if facts["gloo"] else "not available",
                    "" if facts["gloo"] else "install a torch build with distributed support")]
    return checks, facts


def devices() -> tuple[list[Check], list[dict]]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    note = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    if not torch.cuda.is_available():
        return [Check("devices", SKIP, f"no GPU visible{note}; CPU only")], []
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": p.name, "memory_bytes": p.total_memory})
    detail = "; ".join(f"cuda:{d['index']} {d['name']} {_gib(d['memory_bytes'])}" for d in found)
    return [Check("devices", OK, f"{len(found)} GPU(s){note}: {detail}")], found


def cpu_cores() -> int:
    """Cores this process may run on (a container's or taskset's limit), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_check(nproc: int, cores: int) -> Check:
    # Each rank is one busy process; data-loader workers share what is left, so all of them together
    # should come to about the number of cores.
    workers = max(0, cores // nproc - 1)
    detail = (f"{cores} core(s) for {nproc} process(es); data-loader workers: data.num_workers={workers} or less "
              f"({nproc} ranks + {nproc * workers} workers ~ {cores} cores)")
    if nproc > cores:
        return Check("cpu", WARN, detail, f"{nproc} processes on {cores} cores oversubscribe the CPU: expect slow steps "
                     "and timeouts; use fewer processes or more cores")
    return Check("cpu", OK, detail)


def shm_check(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check("/dev/shm", WARN, f"cannot read {path}: {e.strerror}", "NCCL's SHM transport and data-loader workers need /dev/shm")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{_gib(size)} ({_gib(free)} free)"
    if size < SHM_MIN_BYTES:
        return Check("/dev/shm", WARN, detail, "too small for NCCL's SHM transport and data-loader workers: run the "
                     "container with --shm-size=16g or --ipc=host")
    return Check("/dev/shm", OK, detail)


def memlock_check(rdma: bool) -> Check:
    """RDMA pins its buffers: a small `ulimit -l` makes NCCL's IB transport fail or fall back."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("ulimit -l", OK, "unlimited")
    detail = f"{soft // 1024} KiB"
    if rdma:
        return Check("ulimit -l", WARN, detail, "RDMA needs locked memory: set `ulimit -l unlimited` (memlock in "
                     "/etc/security/limits.conf, or --ulimit memlock=-1 for containers)")
    return Check("ulimit -l", OK, f"{detail} (matters only for RDMA; no InfiniBand device here)")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def infiniband(root: Path = IB_ROOT) -> list[dict]:
    """Every port of every device under /sys/class/infiniband, with what sysfs lets us read."""
    ports = []
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            state = _read(port / "state")   # "4: ACTIVE"
            ports.append({"device": dev.name, "port": port.name, "state": state.split(":")[-1].strip() if state else None,
                          "rate": _read(port / "rate"), "link_layer": _read(port / "link_layer")})
    return ports


def infiniband_check(ports: list[dict]) -> Check:
    if not ports:
        return Check("infiniband", SKIP, "no device in /sys/class/infiniband")
    text = ", ".join(f"{p['device']}:{p['port']} {p['link_layer'] or '?'} {p['state'] or '?'} {p['rate'] or ''}".strip()
                     for p in ports)
    down = [f"{p['device']}:{p['port']}" for p in ports if p["state"] not in (None, "ACTIVE")]
    if down:
        return Check("infiniband", WARN, text, f"port(s) not ACTIVE: {', '.join(down)}; check cabling / subnet manager "
                     "(ibstat), or leave them out with NCCL_IB_HCA")
    return Check("infiniband", OK, text)


def env_check(environ: dict[str, str]) -> tuple[Check, dict]:
    found = {k: v for k, v in sorted(environ.items()) if k.startswith(("NCCL_", "UCX_"))}
    if not found:
        return Check("NCCL_*/UCX_*", OK, "none set (NCCL's defaults)"), found
    text = " ".join(f"{k}={v}" for k, v in found.items())
    steering = [k for k, v in _STEERING.items() if found.get(k) == v]
    if steering:
        return Check("NCCL_*/UCX_*", WARN, text, f"{', '.join(steering)} keep NCCL off a faster path; unset unless "
                     "that is intended"), found
    return Check("NCCL_*/UCX_*", OK, text), found


def worker() -> None:
    """One rank of the all-reduce (a child process: argv = rank, world, store port, backend)."""
    rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if backend not in ("gloo", "nccl"):  # refused before the seconds torch takes to import
        raise SystemExit(f"doctor worker: unknown backend {backend!r}")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardwise.train.network import pin_gloo_interface

    pin_gloo_interface(os.environ, "127.0.0.1")  # the ranks of this check share the machine: gloo on loopback
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        gpu = backend == "nccl"
        if gpu:
            torch.cuda.set_device(rank)
        # 64 MiB on GPUs measures a bandwidth worth quoting; 4 MiB keeps the CPU check short.
        x = torch.full(((16 if gpu else 1) << 20,), float(rank + 1), device="cuda" if gpu else "cpu")
        dist.all_reduce(x)
        correct = bool((x == world * (world + 1) / 2).all())
        iters = 10 if gpu else 5
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        print(RESULT_TAG + json.dumps({"rank": rank, "correct": correct, "seconds": seconds,
                                       "bytes": x.numel() * x.element_size()}), flush=True)
    finally:
        dist.destroy_process_group()


def run_allreduce(backend: str, nproc: int, extra_env: dict[str, str | None] | None = None) -> dict:
    """All-reduce across `nproc` fresh local processes; returns what happened and every rank's output.

    Plain subprocesses rather than launch/local.py's torchrun: the NCCL log must be captured per rank
    and NCCL_DEBUG set for these children only, not in this process's environment. The parent hosts
    the rendezvous store on a port the OS picks, so concurrent doctors never collide. Output goes to
    files, not pipes: a rank blocked on a full pipe would stall the collective of the others."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # A None value removes the variable for the children (e.g. a user's NCCL_DEBUG_FILE would take the log away).
    env = {k: v for k, v in {**os.environ, **(extra_env or {})}.items() if v is not None}
    env.setdefault("OMP_NUM_THREADS", "1")  # one busy thread per rank: the check, not the cores, is the point
    code = "from shardwise.launch.doctor import worker; worker()"
    procs, logs = [], []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardwise-doctor-") as tmp:
        try:
            for rank in range(nproc):
                log = open(Path(tmp) / f"rank{rank}.log", "w+")  # closed in the finally below
                logs.append(log)
                procs.append(subprocess.Popen([sys.executable, "-c", code, str(rank), str(nproc), str(store.port), backend],
                                              stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL))
            # Poll all ranks: once one has failed the others would only wait for it until their own timeout.
            deadline = start + COLLECTIVE_TIMEOUT_S
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            exited = [p.poll() for p in procs]  # before the kill below: who stopped on its own, and how
        finally:
            for p in procs:  # never leave a rank behind, whatever happened above
                if p.poll() is None:
                    p.kill()
                p.wait()
            texts = []
            for log in logs:
                log.seek(0)
                texts.append(log.read())
                log.close()
    results = [json.loads(line[len(RESULT_TAG):]) for text in texts for line in text.splitlines() if line.startswith(RESULT_TAG)]
    out = {"backend": backend, "nproc": nproc, "wall_s": round(time.monotonic() - start, 2), "log": "\n".join(texts)}
    if len(results) < nproc or any(exited):
        bad = next((r for r, code in enumerate(exited) if code), 0)
        tail = [line for line in texts[bad].splitlines() if line.strip() and not line.startswith(RESULT_TAG)][-3:]
        why = (f"rank {bad} exited with code {exited[bad]}" if exited[bad] else f"timed out after {COLLECTIVE_TIMEOUT_S} s"
               if None in exited else "a rank ended without a result")
        return {**out, "ok": False, "error": why + (": " + " | ".join(tail)[-400:] if tail else "")}
    seconds = max(r["seconds"] for r in results)
    nbytes = results[0]["bytes"]
    # Bus bandwidth as nccl-tests defines it (the formula bench-comm and the planner's calibration use).
    _, busbw = bandwidths("all_reduce", nproc, nbytes, seconds)
    return {**out, "ok": all(r["correct"] for r in results), "error": None if all(r["correct"] for r in results)
            else "all-reduce returned a wrong sum", "ms_per_op": round(seconds * 1e3, 3), "bytes": nbytes,
            "busbw_GBps": round(busbw, 2)}


def _collective_check(result: dict, label: str) -> Check:
    if not result["ok"]:
        return Check("all-reduce", FAIL, f"{label}: {result['error']}",
                     "run again with NCCL_DEBUG=INFO (GPU) and read the first error; check the firewall allows localhost ports")
    return Check("all-reduce", OK, f"{label}: correct; {result['bytes'] >> 20} MiB in {result['ms_per_op']} ms "
                 f"(bus bandwidth {result['busbw_GBps']} GB/s); {result['wall_s']} s with process start")


def gpu_paths(nproc: int, ib_ports: list[dict]) -> tuple[list[Check], dict]:
    """NCCL all-reduce with its INFO log parsed; then, where a NIC is there and the first run never
    used it, again with P2P and SHM disabled so the ranks talk through the NIC (loopback), which shows
    whether GPUDirect RDMA works without a second node."""
    # INIT and NET carry the channel and network lines, GRAPH the NVLink/PCIe link types.
    debug = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,GRAPH,ENV", "NCCL_DEBUG_FILE": None}
    first = run_allreduce("nccl", nproc, debug)
    checks = [_collective_check(first, f"NCCL on {nproc} GPU(s)")]
    facts = {"collective": {k: v for k, v in first.items() if k != "log"}}
    if nproc < 2 or not first["ok"]:
        if nproc < 2:
            checks.append(Check("transports", SKIP, "one GPU: no path between GPUs to check"))
        return checks, facts
    log = nccl_log.parse(first["log"])
    facts["nccl_log"] = log.to_json()
    found = log.transports
    verdicts = nccl_log.verdicts(log, ib_in_sysfs=bool(ib_ports))
    if (ib_ports or log.ib_devices) and not any(k.startswith("NET/") for k in found):
        loop = run_allreduce("nccl", nproc, {**debug, "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
        facts["loopback"] = {k: v for k, v in loop.items() if k != "log"}
        if loop["ok"]:
            loop_log = nccl_log.parse(loop["log"])
            facts["loopback_nccl_log"] = loop_log.to_json()
            verdicts = [v for v in verdicts if v.path != "inter-node"] + [
                nccl_log.Verdict("inter-node (NIC loopback)", v.status, v.detail, v.advice)
                for v in nccl_log.verdicts(loop_log, ib_in_sysfs=True) if v.path == "inter-node"]
        else:
            checks.append(Check("NIC loopback", WARN, loop["error"], "the NIC path could not be exercised on one node"))
    checks += [Check(f"path {v.path}", v.status, v.detail, v.advice) for v in verdicts]
    return checks, facts


def diagnose(nproc: int | None) -> dict:
    checks, facts = versions()
    more, gpus = devices()
    checks += more
    backend = "nccl" if gpus else "gloo"
    if nproc is None:
        nproc = len(gpus) if gpus else 2
    check_nproc(nproc)
    if gpus and nproc > len(gpus):
        raise ConfigError("--nproc", f"{nproc} processes but {len(gpus)} GPU(s) visible",
                          f"pass --nproc {len(gpus)} or fewer, or widen CUDA_VISIBLE_DEVICES")
    if gpus:  # before the collective test: an idle GPU's clocks say what holds them down
        found = nvml_gpus(len(gpus))
        checks += [Check(*c) for c in (health_checks(*found) if isinstance(found, tuple) else [skipped(found)])]
    ib_ports = infiniband()
    env, nccl_env = env_check(dict(os.environ))
    checks += [cpu_check(nproc, cpu_cores()), shm_check(), memlock_check(rdma=bool(ib_ports)), infiniband_check(ib_ports), env]
    checks += [Check(*c) for c in pod_checks(os.environ, len(gpus), SHM_MIN_BYTES)]  # in a Kubernetes pod only
    not_checked = []
    if gpus:
        more, run = gpu_paths(nproc, ib_ports)
        checks += more
        if not ib_ports:
            not_checked.append("GPUDirect RDMA and InfiniBand/RoCE: no device in /sys/class/infiniband")
        if run.get("nccl_log", {}).get("nodes") in (None, 1):
            not_checked.append("the network between nodes: every doctor process runs on this node")
    else:
        result = run_allreduce("gloo", nproc)
        checks.append(_collective_check(result, f"gloo on {nproc} CPU process(es)"))
        run = {"collective": {k: v for k, v in result.items() if k != "log"}}
        not_checked += ["NCCL transports (IB/RoCE, P2P/NVLink, SHM, socket fallback): no GPU visible",
                        "GPUDirect RDMA: no GPU visible", "GPU memory: no GPU visible",
                        "GPU health (power limit, clocks, memory errors, MIG, PCIe; NVML): no GPU visible"]
    failed = [c.name for c in checks if c.status == FAIL]
    return {"ok": not failed, "exit_code": EXIT_FAILED if failed else EXIT_OK, "backend": backend, "nproc": nproc,
            "failed": failed, "checks": [c.to_json() for c in checks], "not_checked": not_checked,
            "versions": facts, "devices": gpus, "cpu_cores": cpu_cores(), "infiniband": ib_ports, "environment": nccl_env, **run}


DISK_CHUNK_BYTES = NVME_CHUNK_BYTES  # what parallel/offload.py reads and writes at a time (spec/dims.py)


def disk_bandwidth(directory: str | Path, mib: int = 256) -> dict:
    """Write `mib` MiB into a fresh file under `directory` in 64 MiB pwrite calls and fsync it (the write
    rate, to the device), drop the file's pages from the page cache (posix_fadvise DONTNEED: clean pages
    go, no root needed) and read it back in 64 MiB preadv calls (the read rate); the file is removed.
    `effective_gbps` is the one rate that moves equal bytes in and out in the same time, 2 / (1/r + 1/w):
    the NVMe tier reads and writes 8 bytes per parameter each step, so it is cluster.disk_gbps."""
    where = Path(directory).expanduser()
    if not where.is_dir():
        raise ConfigError("--disk", f"{where} is not a directory", "pass a directory on the disk to measure")
    size = max(1, mib) << 20
    chunk = min(DISK_CHUNK_BYTES, size)
    buffer = bytearray(os.urandom(1 << 20) * (chunk >> 20)) if chunk >= 1 << 20 else bytearray(os.urandom(chunk))
    view = memoryview(buffer)
    fd, path = tempfile.mkstemp(prefix="shardwise-doctor-disk-", dir=where)
    try:
        begin = time.perf_counter()
        for offset in range(0, size, chunk):
            n = min(chunk, size - offset)
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:n], offset + done)
        os.fsync(fd)
        write_s = time.perf_counter() - begin
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        begin = time.perf_counter()
        for offset in range(0, size, chunk):
            n = min(chunk, size - offset)
            done = 0
            while done < n:
                got = os.preadv(fd, [view[done:n]], offset + done)
                if got == 0:
                    raise OSError(f"{path}: unexpected end of file")
                done += got
        read_s = time.perf_counter() - begin
    finally:
        os.close(fd)
        os.unlink(path)
    read, write = size / read_s / 1e9, size / write_s / 1e9
    effective = 2.0 / (1.0 / read + 1.0 / write)
    return {"directory": str(where), "bytes": size, "write_gbps": write, "read_gbps": read, "effective_gbps": effective,
            "planner_flag": f"--cluster.disk_gbps={effective:.3g}"}


def render_disk(result: dict) -> str:
    return (f"disk {result['directory']}: wrote {result['bytes'] / 2**20:.0f} MiB at {result['write_gbps']:.3g} GB/s (fsync), "
            f"read it back at {result['read_gbps']:.3g} GB/s (page cache dropped)\n"
            f"plan offload=\"nvme\" with {result['planner_flag']} (reads and writes equal bytes per step: "
            "2 / (1/read + 1/write))")


def render_text(report: dict) -> str:
    width = max(len(c["name"]) for c in report["checks"])
    lines = [f"shardwise doctor: {report['nproc']} process(es), {report['backend']} "
             f"{'on GPUs' if report['backend'] == 'nccl' else 'on CPU'}", ""]
    lines += [f"  {c['name']:<{width}}  {c['status'].upper():<4}  {c['detail']}" for c in report["checks"]]
    advice = [(c["name"], c["advice"]) for c in report["checks"] if c["advice"] and c["status"] in (WARN, FAIL)]
    if advice:
        lines += ["", "advice:"] + [f"  {name}: {text}" for name, text in advice]
    if report["not_checked"]:
        lines += ["", "not checked:"] + [f"  {text}" for text in report["not_checked"]]
    warns = sum(c["status"] == WARN for c in report["checks"])
    verdict = "OK" if report["ok"] else "FAILED: " + ", ".join(report["failed"])
    lines += ["", f"{verdict} ({len(report['failed'])} failed, {warns} warning(s))"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise doctor", description="check this machine for a distributed run")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--nproc", type=int, default=None, help="processes for the all-reduce (default: visible GPUs, or 2 on CPU)")
    parser.add_argument("--disk", default=None, metavar="DIR",
                        help='only measure the disk under DIR for parallel.offload="nvme" (write + fsync, read back)')
    parser.add_argument("--disk-mib", type=int, default=256, help="MiB to write and read for --disk (default 256)")
    args = parser.parse_args(argv)
    if args.disk is not None:
        if args.disk_mib < 1:
            raise ConfigError("--disk-mib", f"must be >= 1, got {args.disk_mib}", "e.g. --disk-mib 256")
        result = disk_bandwidth(args.disk, args.disk_mib)
        print(json.dumps(result, indent=2) if args.json else render_disk(result), flush=True)
        return EXIT_OK
    if args.nproc is not None:
        check_nproc(args.nproc)  # bad input fails here, before torch is imported or anything is spawned
    report = diagnose(args.nproc)
    print(json.dumps(report, indent=2) if args.json else render_text(report), flush=True)
    return report["exit_code"]
