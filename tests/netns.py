"""Test hosts of our own: N "nodes" on one machine, each in a network namespace with an address of its
own on a private switch, so a multi-node test never sends a packet to the machine's own interfaces or
to any other host (docs/architecture.md §4: tests talk to loopback or to namespaces they create).

    with netns.network(2) as net:            # skips, saying why, where namespaces cannot be made
        agent = net.popen(0, ["shardwise", "train", ..., "--rdzv-endpoint", f"{net.address(0)}:29400"])

Topology: one namespace per node with an interface `NODE_IFNAME` (198.18.0.{k+1}/24) and loopback up,
and a hub namespace holding a bridge that every node's veth peer is a port of. Everything lives in
namespaces, so deleting them removes every link; nothing is configured in the machine's own namespace.
198.18.0.0/15 is reserved for network benchmarks between test devices (RFC 2544) and is nobody's real
address. Each namespace's name carries the pid of the test process that made it: `network()` removes
what it made when the test ends, fails or is interrupted (Ctrl-C), and sweeps what a killed earlier
run left behind (its pid is gone) before making anything.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from tests.harness import alive, stop_processes

PREFIX = "swtest"  # namespace names: swtest-<pid>-<token>-<node index | hub>
SUBNET = "198.18.0"  # node k is SUBNET.(k+1)/24
NODE_IFNAME = "eth0"  # the node's interface, as on a real machine; each namespace has its own name space
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")
ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc (ip-netns(8))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def _remove(namespace: str) -> None:
    """SIGKILL every process left in `namespace`, wait for them, delete it (which deletes its links).
    A namespace outlives `ip netns del` while a process still runs in it, hence the kill first."""
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split() if p.isdigit()]
    stop_processes(pids, signal.SIGKILL, 10)
    _ip("netns", "del", namespace, check=False)
    shutil.rmtree(ETC / namespace, ignore_errors=True)


def _name_the_nodes(net: "Network") -> None:
    """Every node's address has a name in every node's /etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts
    over /etc/hosts), as on a cluster. Without one, the namespaces, which reach no DNS server, failed torch's
    reverse lookup of each peer (getnameinfo: EAI_AGAIN) and every multi-node log carried torch's warning "The
    hostname of the client socket cannot be retrieved. err=-3" (issue 57 item 5; docs/clusters.md)."""
    try:
        hosts = Path("/etc/hosts").read_text()
    except OSError:
        hosts = "127.0.0.1 localhost\n"
    # Also as IPv4-mapped IPv6 addresses: torch's store listens on both families and sees its clients so.
    names = "".join(f"{net.address(k)} {PREFIX}-node{k}\n::ffff:{net.address(k)} {PREFIX}-node{k}\n"
                    for k in range(len(net.nodes)))
    for ns in net.nodes:
        (ETC / ns).mkdir(parents=True, exist_ok=True)
        (ETC / ns / "hosts").write_text(hosts.rstrip("\n") + "\n" + names)


def sweep_stale() -> list[str]:
    """Remove the namespaces of test runs that were killed before they could clean up; returns their names."""
    stale = [ns for ns in _namespaces() if (m := _NAME.match(ns)) and not alive(int(m.group(1)))]
    for ns in stale:
        _remove(ns)
    return stale


def ours() -> list[str]:
    """Every namespace this helper's naming scheme covers that exists now (any test run's)."""
    return [ns for ns in _namespaces() if _NAME.match(ns)]


@dataclass
class Network:
    nodes: list[str]  # namespace of node k
    hub: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def popen(self, k: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on node k (`ip netns exec`); the process and its children see only that node's
        network. Killed, if still running, when the network is removed."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[k], *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, k: int, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.nodes[k], *argv], capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, k: int) -> list[int]:
        """Every process on node k now."""
        return [int(p) for p in _ip("netns", "pids", self.nodes[k], check=False).stdout.split() if p.isdigit()]

    def kill_node(self, k: int) -> None:
        """SIGKILL everything on node k, as a machine dying would: its agent and its workers (not waited for)."""
        for pid in _ip("netns", "pids", self.nodes[k], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for ns in [*self.nodes, self.hub]:
            _remove(ns)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the tests as root, as CI does"
    if not shutil.which("ip"):
        return "the `ip` command (Debian package iproute2) is not installed"
    return None


def _build(n: int) -> Network:
    token = uuid.uuid4().hex[:6]
    base = f"{PREFIX}-{os.getpid()}-{token}"
    net = Network([f"{base}-{k}" for k in range(n)], f"{base}-hub")
    try:
        for ns in [net.hub, *net.nodes]:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", net.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(net.nodes):
            port = f"port{k}"  # the node's cable into the hub's bridge
            _ip("-n", ns, "link", "add", NODE_IFNAME, "type", "veth", "peer", "name", port, "netns", net.hub)
            _ip("-n", net.hub, "link", "set", port, "master", "br0")
            _ip("-n", net.hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{net.address(k)}/24", "dev", NODE_IFNAME)
            _ip("-n", ns, "link", "set", NODE_IFNAME, "up")
        _name_the_nodes(net)
    except BaseException:
        net.remove()
        raise
    return net


@contextmanager
def network(n: int) -> Iterator[Network]:
    """N nodes on one switch, removed (processes, links, namespaces) however the block ends.
    Skips the test, printing why, where namespaces cannot be made: never falls back to a host address."""
    reason = unavailable()
    if reason is None:
        sweep_stale()
        try:
            net = _build(n)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            reason = f"making {n} network namespaces failed: {e}"
    if reason is not None:
        print(f"skipped: {reason}")  # shown in the captured output and, with -ra, in the summary
        pytest.skip(reason)
    try:
        yield net
    finally:
        net.remove()
