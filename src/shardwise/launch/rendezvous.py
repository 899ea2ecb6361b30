"""A multi-node launch's rendezvous: the checks before anything is spawned (node counts, ranks, an endpoint
that every node can reach and node 0 can serve) and the wait of a node for node 0's store.

torchrun's c10d rendezvous: node 0's agent serves a TCPStore at the endpoint, every node's agent joins it
with the same id (docs/clusters.md).
"""
from __future__ import annotations

import errno
import math
import socket
import sys
import time
from dataclasses import dataclass

from shardwise.errors import ConfigError
from shardwise.train.network import is_loopback, source_address

# torchrun's c10d defaults: the rendezvous port when --rdzv-endpoint names none, and join_timeout.
RDZV_DEFAULT_PORT = 29400
RDZV_DEFAULT_JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class MultiNode:
    """One node's part of a multi-node launch (torch.distributed.run's c10d rendezvous arguments)."""

    nnodes: int
    node_rank: int
    endpoint: str  # HOST:PORT as the user wrote it
    rdzv_id: str
    local_addr: str | None = None  # this node's address towards the endpoint (see check_multinode)
    min_nodes: int | None = None  # elastic (--nnodes MIN:MAX): the fewest nodes the job goes on with
    join_timeout_s: float | None = None  # run.rendezvous_timeout_s (None: torch's default)
    last_call_s: float | None = None  # run.rendezvous_last_call_s (None: torch's default)
    data: str | None = None  # "DIGEST@WHAT": the prepared data this node read, compared before the rendezvous

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def timeout_s(self) -> float:
        """run.rendezvous_timeout_s as the agents use it (torch's join_timeout when unset)."""
        return self.join_timeout_s if self.join_timeout_s is not None else RDZV_DEFAULT_JOIN_TIMEOUT_S

    @property
    def spec(self) -> str:
        """--nnodes as the agents read it: "N", or "MIN:MAX" for an elastic job."""
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    def torchrun_args(self) -> list[str]:
        # torchrun ignores --node-rank under c10d (the rendezvous orders the nodes itself); it is passed
        # so the agent's view matches the command line, and shardwise uses it for run-directory ownership.
        out = [f"--nnodes={self.spec}", f"--node-rank={self.node_rank}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.rdzv_id}",
               # Node 0 serves the rendezvous store at the endpoint, the others connect to it. torch would
               # guess by matching the endpoint against the host name's addresses, which fails where the
               # host name resolves to 127.0.x.1 (every agent then waits for a server nobody started).
               f"--rdzv-conf=is_host={'true' if self.node_rank == 0 else 'false'}"
               # Whole seconds: torch reads both as integers (a fraction would be refused).
               + (f",join_timeout={math.ceil(self.join_timeout_s)}" if self.join_timeout_s is not None else "")
               + (f",last_call_timeout={math.ceil(self.last_call_s)}" if self.last_call_s is not None else "")]
        if self.local_addr:
            out.append(f"--local-addr={self.local_addr}")
        return out


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """'host:29400' / '[fd00::1]:29400' / 'host' -> (host, port or None)."""
    field = "--rdzv-endpoint"
    text = endpoint.strip()
    if text.startswith("["):  # bracketed IPv6, torchrun's own notation
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else (None if not rest else "x")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:  # a bare host name or IPv4 address, or an unbracketed IPv6 address
        host, port_text = text, None
    if not host:
        raise ConfigError(field, f"{endpoint!r} names no host", "write HOST:PORT, e.g. --rdzv-endpoint node0.cluster:29400")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(field, f"{endpoint!r}: the port must be a number from 1 to 65535",
                          "write HOST:PORT, e.g. --rdzv-endpoint node0.cluster:29400")
    return host, int(port_text)


def _loopback(host: str) -> str | None:
    """The loopback address `host` is or resolves to, else None; raises ConfigError when it does not resolve."""
    if host.lower() == "localhost":
        return "localhost"
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ConfigError("--rdzv-endpoint", f"cannot resolve {host!r}: {e.strerror}",
                          "use an address or host name of node 0 that every node resolves") from None
    for info in infos:
        addr = info[4][0].split("%")[0]
        if is_loopback(addr):
            return addr
    return None


def parse_nnodes(text: str) -> tuple[int, int]:
    """--nnodes "N" -> (N, N); "MIN:MAX" (elastic: the job goes on with any node count in the range) ->
    (MIN, MAX)."""
    low, _, high = text.strip().partition(":")
    if not (low.isdigit() and (high.isdigit() or not _)):
        raise ConfigError("--nnodes", f"{text!r} is not a node count N or a range MIN:MAX",
                          "pass e.g. --nnodes 2, or --nnodes 1:2 for a job that goes on when a node is lost")
    low_n, high_n = int(low), int(high or low)
    if low_n > high_n:
        raise ConfigError("--nnodes", f"{text!r}: MIN {low_n} is above MAX {high_n}", f"write --nnodes {high_n}:{low_n}")
    return low_n, high_n


def check_multinode(nnodes: int, node_rank: int, endpoint: str | None, rdzv_id: str,
                    min_nodes: int | None = None) -> MultiNode | None:
    """Validate a multi-node launch before anything is spawned; None for a single-node one. `min_nodes`
    (below `nnodes`): an elastic job, which goes on with any node count from min_nodes to nnodes.

    A rendezvous endpoint on a loopback address is refused: node 0's agent would listen there and the
    other nodes would dial their own loopback, so every node waits for the rendezvous timeout (a hang,
    not an error)."""
    if nnodes < 1 or (min_nodes is not None and min_nodes < 1):
        raise ConfigError("--nnodes", f"must be >= 1, got {min_nodes if min_nodes is not None and min_nodes < 1 else nnodes}",
                          "pass the number of machines, e.g. --nnodes 2")
    if not 0 <= node_rank < nnodes:
        raise ConfigError("--node-rank", f"must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}",
                          "give each machine its own rank: 0 on the first, 1 on the second, ...")
    if nnodes == 1:
        if endpoint or node_rank:
            raise ConfigError("--rdzv-endpoint", "given for a single-node launch (--nnodes 1)",
                              "pass --nnodes N (N > 1) with --node-rank and --rdzv-endpoint, or drop them")
        return None
    if not endpoint:
        raise ConfigError("--rdzv-endpoint", f"--nnodes {nnodes} needs a rendezvous endpoint",
                          "pass --rdzv-endpoint HOST:PORT with node 0's address as every node reaches it, e.g. 10.0.0.1:29400")
    host, port = split_endpoint(endpoint)
    loop = _loopback(host)
    if loop is not None:
        shown = host if loop == host else f"{host} ({loop})"
        raise ConfigError("--rdzv-endpoint", f"{shown} is a loopback address: the other nodes cannot reach it, and a "
                          "multi-node rendezvous on it waits until it times out (a known cause of hangs)",
                          "use node 0's reachable address, e.g. the first address of `hostname -I` on node 0")
    if node_rank == 0 and not _is_local(host):
        raise ConfigError("--rdzv-endpoint", f"{host} is not an address of this machine, but node 0 serves the "
                          "rendezvous (the other nodes would wait for a server at an address nobody listens on)",
                          "on node 0 pass one of its own reachable addresses (`hostname -I`), the same on every node")
    if node_rank == 0 and _in_use(host, port or RDZV_DEFAULT_PORT):
        port = port or RDZV_DEFAULT_PORT
        raise ConfigError("--rdzv-endpoint", f"port {port} of {host} is in use (another job's rendezvous, or another "
                          "program), but node 0 serves the rendezvous there", "pass a free port, the same on every node, "
                          f"e.g. --rdzv-endpoint {_with_port(host, port + 1)} (`ss -ltnp 'sport = :{port}'` names the "
                          "program that holds it)")
    # The address the rendezvous publishes as MASTER_ADDR when this node's agent serves it: the one this
    # machine reaches the endpoint from, not the host name's resolution (often 127.0.x.1: the other nodes
    # would then dial themselves; train/network.py).
    local = source_address(host, port)
    return MultiNode(nnodes, node_rank, endpoint, rdzv_id, None if local is None or is_loopback(local) else local,
                     min_nodes if min_nodes is not None and min_nodes < nnodes else None)


def _is_local(host: str) -> bool:
    """Whether `host` resolves to an address of this machine: binding to it succeeds only then."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0) if family == socket.AF_INET else (sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def wait_for_rendezvous(nodes: MultiNode, poll_s: float = 1.0) -> bool:
    """Whether node 0's rendezvous store accepts a TCP connection within run.rendezvous_timeout_s; says so
    in one line while it waits, and in one error line when it gives up.

    torch's c10d rendezvous dials node 0's store with the store's read timeout (60 s, then a retry after
    a random delay), not with the join timeout: an endpoint nobody serves was reported after 64 s on
    loopback and 108-159 s between two test hosts with run.rendezvous_timeout_s=20, and a node started
    150 s before node 0 failed though run.rendezvous_timeout_s allowed 600 s (75 s early still met it).
    Plain connects (closed at once; the store drops a client that sends nothing) wait for the user's
    timeout instead; torch's own connection then succeeds at once."""
    host, port = split_endpoint(nodes.endpoint)
    port = port or RDZV_DEFAULT_PORT
    timeout_s = nodes.timeout_s
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(remaining, 10.0))):
                return True
        except OSError as e:
            reason = e.strerror or str(e) or type(e).__name__  # "Connection refused", "No route to host", "timed out"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            print(f"error: nothing answered at the rendezvous {nodes.endpoint} within run.rendezvous_timeout_s "
                  f"({timeout_s:g} s; last: {reason}): start node 0 (--node-rank 0) with the same --rdzv-endpoint, "
                  "or pass node 0's address as this node reaches it", file=sys.stderr, flush=True)
            return False
        if not said:
            print(f"node {nodes.node_rank}: waiting for node 0's rendezvous at {nodes.endpoint} to open ({reason} so "
                  f"far; up to run.rendezvous_timeout_s = {timeout_s:g} s)", flush=True)
            said = True
        time.sleep(min(poll_s, remaining))


def _in_use(host: str, port: int) -> bool:
    """Whether something listens on (host, port) already: node 0's TCPStore would fail to bind it ("address
    already in use", a RendezvousConnectionError after the agent started). SO_REUSEADDR as the store's own
    socket: a port left in TIME_WAIT by an earlier job is free to serve."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _with_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
