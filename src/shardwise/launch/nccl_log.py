"""Read an NCCL_DEBUG=INFO log and say which transport each path took, with advice (`shardwise doctor`).

Pure functions on text: no torch, no processes, so every case is tested on fixture logs
(tests/fixtures/nccl/). The lines NCCL prints that matter here (format stable since NCCL 2.4):

    host:pid:tid [dev] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB ib0:10.0.0.1<0>
    host:pid:tid [dev] NCCL INFO NET/IB : No device found.
    host:pid:tid [dev] NCCL INFO Using network IB | Socket
    host:pid:tid [dev] NCCL INFO comm 0x... rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
    host:pid:tid [dev] NCCL INFO Pattern 4, crossNic 0, nChannels 8, bw 40.0/40.0, type NVL/PIX, sameChannels 1
    host:pid:tid [dev] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC           (or P2P/CUMEM/read ...)
    host:pid:tid [dev] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA
    host:pid:tid [dev] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0
    host:pid:tid [dev] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct
    host:pid:tid [dev] NCCL WARN ...

The channel lines are the facts (what was connected); the rest explains why.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

_VERSION = re.compile(r"NCCL version (\S+)")
_IB_USING = re.compile(r"NET/IB\s*:\s*Using (.*?)(?:;|$)")
_IB_DEVICE = re.compile(r"\[\d+\]([\w.-]+):(\d+)/(IB|RoCE)")
_SOCKET_USING = re.compile(r"NET/Socket\s*:\s*Using (.*)$")
_NETWORK = re.compile(r"Using network (\S+)")
_NODES = re.compile(r"nRanks (\d+) nNodes (\d+)")
_GRAPH_TYPE = re.compile(r"Pattern \d+,.*type (\w+)/(\w+)")
_CHANNEL = re.compile(r"Channel \d+(?:/\d+)? : \d+\[\w+\] -> \d+\[\w+\](?: \[(?:send|receive)\])? via (\S+)")
_P2P_DISABLED = re.compile(r"P2P is disabled between")


@dataclass
class NcclLog:
    """What one log (all ranks' lines together) says."""

    version: str | None = None
    network: str | None = None                     # "IB" / "Socket" / a plugin's name, from "Using network"
    ib_devices: list[str] = field(default_factory=list)      # "mlx5_0:1/IB", "mlx5_1:1/RoCE"
    ib_missing: bool = False                        # "NET/IB : No device found."
    socket_interfaces: str | None = None            # "[0]eth0:10.0.0.1<0>"
    nodes: int | None = None
    intra_types: set[str] = field(default_factory=set)   # graph link types inside a node: NVL, PIX, PXB, PHB, SYS
    transports: dict[str, int] = field(default_factory=dict)  # "P2P", "SHM", "NET/IB", "NET/IB+GDR", "NET/Socket"
    p2p_disabled: bool = False
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"version": self.version, "network": self.network, "ib_devices": self.ib_devices, "ib_missing": self.ib_missing,
                "socket_interfaces": self.socket_interfaces, "nodes": self.nodes, "intra_types": sorted(self.intra_types),
                "transports": dict(sorted(self.transports.items())), "p2p_disabled": self.p2p_disabled, "warnings": self.warnings}


@dataclass(frozen=True)
class Verdict:
    """One path's verdict: status (ok / warn / fail / skip), what was seen, what to do."""

    path: str
    status: str
    detail: str
    advice: str = ""

    def to_json(self) -> dict:
        return {"path": self.path, "status": self.status, "detail": self.detail, "advice": self.advice}


def transport_of(via: str) -> str:
    """The transport family of a channel's `via` field: NET/IB/0/GDRDMA -> NET/IB+GDR, P2P/CUMEM/read -> P2P."""
    parts = via.split("/")
    if parts[0] == "NET" and len(parts) > 1:
        # Plugins name themselves NET/IBext_v8/...; they are still InfiniBand verbs underneath.
        kind = "IB" if parts[1].startswith("IB") else parts[1]
        return f"NET/{kind}" + ("+GDR" if "GDRDMA" in parts[2:] else "")
    return parts[0]


def parse(text: str) -> NcclLog:
    log = NcclLog()
    for line in text.splitlines():
        if "NCCL" not in line:
            continue
        if " NCCL WARN " in line:
            message = line.split(" NCCL WARN ", 1)[1].strip()
            if message not in log.warnings:
                log.warnings.append(message)
            continue
        if m := _CHANNEL.search(line):
            kind = transport_of(m.group(1))
            log.transports[kind] = log.transports.get(kind, 0) + 1
        elif m := _VERSION.search(line):
            log.version = log.version or m.group(1)
        elif "NET/IB" in line and "No device found" in line:
            log.ib_missing = True
        elif m := _IB_USING.search(line):
            for dev in _IB_DEVICE.finditer(m.group(1)):
                name = f"{dev.group(1)}:{dev.group(2)}/{dev.group(3)}"
                if name not in log.ib_devices:
                    log.ib_devices.append(name)
        elif m := _SOCKET_USING.search(line):
            log.socket_interfaces = m.group(1).strip()
        elif m := _NETWORK.search(line):
            log.network = m.group(1)
        elif m := _NODES.search(line):
            log.nodes = max(log.nodes or 0, int(m.group(2)))
        elif m := _GRAPH_TYPE.search(line):
            log.intra_types.add(m.group(1))
        elif _P2P_DISABLED.search(line):
            log.p2p_disabled = True
    return log


def _roce(log: NcclLog) -> bool:
    return bool(log.ib_devices) and all(d.endswith("/RoCE") for d in log.ib_devices)


def verdicts(log: NcclLog, ib_in_sysfs: bool = False) -> list[Verdict]:
    """Per path (inside a node, between nodes) what NCCL used and whether that is what this hardware can do.

    `ib_in_sysfs`: /sys/class/infiniband lists devices, so a socket fallback means NCCL could not use them."""
    out: list[Verdict] = []
    t = log.transports
    if not t:
        return [Verdict("nccl", FAIL, "no channel was connected (no 'Channel .. via' line in the log)",
                        "rerun with NCCL_DEBUG=INFO and read the NCCL WARN lines")]
    # Inside a node: P2P (NVLink or PCIe) is the fast path; SHM bounces through host memory.
    if "P2P" in t:
        over = "NVLink" if "NVL" in log.intra_types else "PCIe" if log.intra_types else "NVLink or PCIe"
        out.append(Verdict("intra-node", OK, f"P2P over {over} ({t['P2P']} connections)"))
    if "SHM" in t:
        why = " (NCCL reports P2P disabled between these GPUs)" if log.p2p_disabled else ""
        out.append(Verdict("intra-node", WARN, f"SHM: GPUs exchange data through host shared memory{why}",
                           "check NCCL_P2P_DISABLE / NCCL_P2P_LEVEL are unset, and that IOMMU/ACS allow PCIe peer "
                           "access; GPUs on different CPU sockets use SHM by design"))
    # Between nodes (or, with P2P/SHM disabled, a loopback through the NIC).
    rdma = "RoCE" if _roce(log) else "IB"
    hcas = ", ".join(log.ib_devices)
    if "NET/IB+GDR" in t:
        out.append(Verdict("inter-node", OK, f"{rdma} with GPUDirect RDMA ({hcas or 'NET/IB'}, {t['NET/IB+GDR']} connections)"))
    if "NET/IB" in t:
        advice = ("load the nvidia-peermem kernel module (GPUDirect RDMA) and check the GPU-NIC PCIe distance "
                  "(nvidia-smi topo -m); NCCL_NET_GDR_LEVEL=PHB or SYS allows GDR across a host bridge")
        if rdma == "RoCE":
            advice += "; for RoCEv2 set NCCL_IB_GID_INDEX (usually 3)"
        out.append(Verdict("inter-node", WARN, f"{rdma} without GPUDirect RDMA ({hcas or 'NET/IB'}): data is staged "
                           "through host memory", advice))
    if "NET/Socket" in t:
        where = f" over {log.socket_interfaces}" if log.socket_interfaces else ""
        if ib_in_sysfs or log.ib_devices:
            out.append(Verdict("inter-node", FAIL, f"fell back to TCP sockets{where} although InfiniBand/RoCE devices exist",
                               "unset NCCL_IB_DISABLE and NCCL_NET=Socket, name the HCAs with NCCL_IB_HCA=mlx5_0,mlx5_1 "
                               "(see ibv_devinfo), and check ulimit -l is unlimited"))
        else:
            out.append(Verdict("inter-node", WARN, f"TCP sockets{where} (no InfiniBand/RoCE device found)",
                               "set NCCL_SOCKET_IFNAME to the fastest interface (e.g. NCCL_SOCKET_IFNAME=eth0 or "
                               "=^lo,docker) so NCCL does not pick a slow or virtual one"))
    other = sorted(k for k in t if k not in ("P2P", "SHM", "NET/IB", "NET/IB+GDR", "NET/Socket"))
    if other:
        out.append(Verdict("other", OK, "also used: " + ", ".join(f"{k} ({t[k]})" for k in other)))
    if not any(k.startswith("NET/") for k in t):
        network = f"; NCCL would use network {log.network}" if log.network else ""
        devices = f" ({hcas})" if hcas else ""
        if ib_in_sysfs and log.network == "Socket":
            out.append(Verdict("inter-node", FAIL, f"not exercised (one node){network} although InfiniBand/RoCE devices exist",
                               "set NCCL_IB_HCA to the HCAs of ibv_devinfo and unset NCCL_IB_DISABLE / NCCL_NET=Socket"))
        else:
            out.append(Verdict("inter-node", SKIP, f"not exercised: every rank on one node{network}{devices}"))
    if log.warnings:
        out.append(Verdict("nccl", WARN, f"{len(log.warnings)} NCCL WARN line(s); first: {log.warnings[0][:200]}",
                           "read the full log (rerun with NCCL_DEBUG=INFO)"))
    return out
