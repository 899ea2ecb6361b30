"""Run N local worker processes through torch's own elastic launcher, exactly as `torchrun` would.

What the user sees is shardwise's, not torchrun's: the agent's log lines and tracebacks are silenced;
a failure ends in one line and an exit code (errors.py). Workers that failed with a code of their own
(bad input, divergence, I/O, stall, interruption) have printed their line already; otherwise the
launcher names the root cause among the failed ranks: a rank killed by a signal, else the earliest
error that is not just the consequence of a lost peer (its traceback is in <run.dir>/errors/).
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_IO,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_STALLED,
    EXIT_TOO_FEW_NODES,
    ConfigError,
    interrupt_exit_code,
)
from shardwise.scratch import owned_directory
from shardwise.train.network import is_loopback, source_address

# When several workers failed with their own codes, the most specific wins.
_PRIORITY = (EXIT_BAD_INPUT, EXIT_IO, EXIT_DIVERGED, EXIT_STALLED, EXIT_SIGTERM, EXIT_SIGINT)
# torchrun's c10d defaults: the rendezvous port when --rdzv-endpoint names none, and join_timeout.
RDZV_DEFAULT_PORT = 29400
RDZV_DEFAULT_JOIN_TIMEOUT_S = 600.0
# Seconds the agent waits for workers to checkpoint and exit after forwarding a stop signal.
SHUTDOWN_GRACE_S = 60
# What workers report when another worker died under them: consequences, not causes.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "socket closed", "connection refused")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")  # gloo's "[198.18.0.1]:30119", "[fd00::1]:30119"


def lost_peer(message: str) -> bool:
    return any(s in message.lower() for s in _LOST_PEER)


def lost_peer_line(message: str) -> str:
    """What a rank whose peer went away did, for the launcher's line: when no rank on this node failed of
    its own accord the cause is on another node (one killed with its node, or a network failure), which
    gloo's message ("Connection closed by peer [ADDRESS]:PORT. This is typically caused by a remote
    worker crashing ... GLHF!") names only by its address."""
    phrase = next(s for s in _LOST_PEER if s in message.lower())
    peer = _PEER_ADDRESS.search(message)
    at = f" at {peer.group(1)}" if peer else ""
    return (f"lost its connection to a rank{at} ({phrase}): a process there died or the network to it failed, "
            "and that node's own output names the cause")


# The logger of torchelastic's process context: its one record per failed worker group names the first
# failed worker ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", torch 2.13).
_WORKER_FAILURES = "torch.distributed.elastic.multiprocessing.api"


class _RestartCause(logging.Handler):
    """Turns torchelastic's record of a failed worker into shardwise's line, when a restart follows it
    (the last failure is the launcher's error line: report_failure): which local rank, and the signal
    or exit code, which the restarted workers cannot know."""

    def __init__(self, max_restarts: int):
        super().__init__(logging.ERROR)
        self.max_restarts, self.seen = max_restarts, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        self.seen += 1
        if self.seen > self.max_restarts:
            return
        code, local_rank, pid = record.args[:3]
        what = f"was killed by {_signal_name(-int(code))}" if int(code) < 0 else f"exited with code {code}"
        print(f"restart {self.seen} of {self.max_restarts}: local rank {local_rank} (pid {pid}) {what}; the worker "
              "group restarts from the newest intact checkpoint", flush=True)


def _quiet_torchrun(max_restarts: int = 0) -> None:
    """torchrun's agent logs every failure, restart and shutdown at WARNING/ERROR with its own
    traceback tables; shardwise says what happened in one line instead (a restart's cause included)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
             "torch.distributed.run", "torch.distributed.launcher"))]
    for name in ["torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if max_restarts:
        failures = logging.getLogger(_WORKER_FAILURES)
        failures.setLevel(logging.ERROR)
        failures.propagate = False
        failures.handlers = [_RestartCause(max_restarts)]


def torchrun(nproc: int, module: str, module_args: list[str], log_dir: Path | None = None, max_restarts: int = 0,
             run_dir: Path | None = None, checkpoints: Path | None = None, nodes: MultiNode | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS...` in this process; returns an exit code.

    --standalone picks a free rendezvous port on localhost, so concurrent launches never collide.
    `nodes` (a MultiNode from check_multinode) launches this node's share of a multi-node job instead:
    c10d rendezvous at its endpoint, every node's agent started with the same id.
    `max_restarts` restarts the whole worker group after a failure (the elastic agent's own restarts).
    `run_dir` / `checkpoints` let a failure report point at tracebacks and the checkpoint to resume.
    SIGUSR1 is forwarded to the workers like SIGTERM (SLURM sends it ahead of a time limit).
    """
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )

    # Split the cores between the workers (torchrun would pick 1 and warn); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # One node: the workers find the agent's store on loopback (torch would publish the host name's
    # fully qualified name, which resolves to a network address on many machines: traffic that never
    # needs to leave this machine would go out through its interface's address).
    if nodes is not None and nodes.elastic:
        # torch 2.13's rendezvous shares node 0's TCPStore between rounds and publishes its address in the
        # first round only: a node that joins later waits for that key in its own round and times out
        # after 60 s (pytorch/pytorch#147064's family). torch's own switch makes every round publish it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = nodes.torchrun_args() if nodes is not None else ["--standalone", "--local-addr=127.0.0.1"]
    argv += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", f"--shutdown-timeout={SHUTDOWN_GRACE_S}"]
    # torchrun's default log directory is a fresh /tmp/torchelastic_* that it never removes (one per
    # launch); the workers' error files in it are read before run() returns, so ours is removed after,
    # and, if this agent is killed first, by the next launch on this host (shardwise/scratch.py).
    own_log_dir = owned_directory("torchelastic") if log_dir is None else None
    argv += [f"--log-dir={log_dir or own_log_dir}"]
    argv += ["-m", module, *module_args]
    _quiet_torchrun(max_restarts)
    before_workers = _StopBeforeWorkers(SignalException)
    try:
        before_workers.install()
        if nodes is not None and nodes.node_rank != 0 and not wait_for_rendezvous(nodes):
            return EXIT_FAILED
        if nodes is not None:  # the agents wait for each other without a word until the job starts or times out
            wanted = f"{nodes.min_nodes} to {nodes.nnodes}" if nodes.elastic else f"all {nodes.nnodes}"
            print(f"node {nodes.node_rank}: waiting for {wanted} nodes at the rendezvous {nodes.endpoint} (up to "
                  f"run.rendezvous_timeout_s = {_seconds(nodes)})", flush=True)
        torch_run.run(torch_run.get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        return report_failure(e.failures, run_dir, checkpoints, every_node=nodes is not None)
    except SignalException as e:
        if before_workers.raised(e):  # no worker ran to say it stopped
            where = f" while waiting at the rendezvous {nodes.endpoint}" if nodes is not None else ""
            print(f"interrupted ({e.sigval.name}){where}, before any worker started", file=sys.stderr, flush=True)
        return interrupt_exit_code(e.sigval)
    except RendezvousError as e:  # multi-node: the nodes never met (a node missing, the store lost, timeout)
        where = f" at {nodes.endpoint}" if nodes is not None else ""
        if isinstance(e, RendezvousConnectionError):
            # Not a timeout of run.rendezvous_timeout_s: node 0's store is gone or unreachable. A node that joins
            # a job just as it ends meets this (the store closes with node 0's agent), as does one whose node 0
            # stopped between wait_for_rendezvous and torch's own connection.
            print(f"error: the rendezvous{where} cannot be reached, or closed while this node waited: node 0's agent "
                  "is not running there (a job that ends, finished or failed, closes it) or its address is not "
                  f"reachable from this node{_resume_hint(checkpoints, every_node=True)}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if nodes is not None and nodes.elastic:
            print(f"error: fewer than {nodes.min_nodes} node(s) (--nnodes {nodes.min_nodes}:{nodes.nnodes}) met at the "
                  f"rendezvous{where} within run.rendezvous_timeout_s ({_seconds(nodes)}): "
                  f"{type(e).__name__}{_resume_hint(checkpoints, every_node=True)}", file=sys.stderr, flush=True)
            return EXIT_TOO_FEW_NODES
        if nodes is not None and isinstance(e, RendezvousTimeoutError):
            # A node never started, or started with another config (the rendezvous id derives from run.dir)
            # or endpoint: torch's error says nothing more (its message is empty).
            print(f"error: fewer than {nodes.nnodes} nodes (--nnodes {nodes.nnodes}) met at the rendezvous{where} "
                  f"within run.rendezvous_timeout_s ({_seconds(nodes)}): start every node, --node-rank 0 to "
                  f"{nodes.nnodes - 1}, with the same config and --rdzv-endpoint"
                  f"{_resume_hint(checkpoints, every_node=True)}", file=sys.stderr, flush=True)
            return EXIT_TOO_FEW_NODES
        others = "are the other nodes running" if nodes is not None and nodes.node_rank == 0 else "is node 0 running"
        print(f"error: rendezvous{where} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"({others}, and its address reachable from this node?)", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        before_workers.restore()
        if own_log_dir is not None:
            shutil.rmtree(own_log_dir, ignore_errors=True)
    return 0


class _StopBeforeWorkers:
    """Stop requests before torch's agent has started the workers (and its own handlers, which turn them
    into SignalException): waiting for node 0 or at the rendezvous, a SIGTERM from `scancel` or SLURM's
    SIGUSR1 ahead of a time limit ended the launcher silently (exit -15 / -10, no line). They raise
    torch's SignalException here too, which its agent handles as its own (it shuts down and re-raises).
    SIGINT keeps Python's KeyboardInterrupt (cli.py says what was interrupted)."""

    SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")

    def __init__(self, signal_exception: type):
        self.signal_exception, self.previous, self.ours = signal_exception, {}, None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread
        ours = self.ours = type("StoppedBeforeWorkers", (self.signal_exception,), {})

        def handler(signum: int, frame) -> None:
            raise ours(f"signal {signum} before the workers started", signal.Signals(signum))

        for name in self.SIGNALS:
            self.previous[name] = signal.signal(getattr(signal, name), handler)

    def raised(self, e: BaseException) -> bool:
        return self.ours is not None and isinstance(e, self.ours)

    def restore(self) -> None:
        for name, previous in self.previous.items():
            signal.signal(getattr(signal, name), previous)
        self.previous = {}


def _seconds(nodes: MultiNode) -> str:
    """run.rendezvous_timeout_s as the agents use it (torch's join_timeout when unset)."""
    return f"{nodes.join_timeout_s if nodes.join_timeout_s is not None else RDZV_DEFAULT_JOIN_TIMEOUT_S:g} s"


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
    timeout_s = nodes.join_timeout_s if nodes.join_timeout_s is not None else RDZV_DEFAULT_JOIN_TIMEOUT_S
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


def report_failure(failures: dict, run_dir: Path | None = None, checkpoints: Path | None = None,
                   every_node: bool = False) -> int:
    """The job's exit code from torchelastic's per-rank ProcessFailure records; prints the root cause
    unless a worker already printed its own line. `every_node`: a multi-node job, resumed by rerunning on
    every node."""
    codes = sorted((f.exitcode for f in failures.values() if f.exitcode in _PRIORITY), key=_PRIORITY.index)
    if codes:
        return codes[0]
    rank, failure = _root_cause(failures)
    if failure.exitcode < 0:
        what = f"was killed by {_signal_name(-failure.exitcode)}"
    else:
        message = failure_message(failure).splitlines()
        if message and lost_peer(message[0]):  # every rank here only lost a peer: the cause is on another node
            what = lost_peer_line(message[0])
        else:
            what = f"failed: {message[0][:300] if message else f'exit code {failure.exitcode}'}"
        if run_dir is not None and (run_dir / "errors" / f"rank_{rank}.txt").is_file():
            what += f" (traceback: {run_dir / 'errors' / f'rank_{rank}.txt'})"
    others = len(failures) - 1
    tail = f"; {others} other rank(s) stopped with it" if others else ""
    print(f"error: rank {rank} (pid {failure.pid}) {what}{tail}{_resume_hint(checkpoints, every_node)}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def failure_message(failure) -> str:
    """The exception's own "Type: message" of a failed worker. torchelastic's record of a Python
    exception is a dict {"message": ..., "extraInfo": {"py_callstack": <traceback>, ...}}: printed as
    it is, the user's one line was that dict with a traceback cut mid-word (the traceback is in
    <run.dir>/errors/rank_N.txt)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "").strip()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _root_cause(failures: dict):
    """A rank killed by a signal other than the agent's own SIGTERM; else the earliest failure whose
    message is not a lost peer; else the earliest."""
    items = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for rank, f in items:
        if f.exitcode < 0 and -f.exitcode != signal.SIGTERM:
            return rank, f
    for rank, f in items:
        if not lost_peer(failure_message(f)):
            return rank, f
    return items[0]


def _resume_hint(checkpoints: Path | None, every_node: bool = False) -> str:
    """Where to resume from. A multi-node job resumes only when every node reruns (`every_node`): one node
    rerun alone waits for the others at the rendezvous."""
    if checkpoints is None:
        return ""
    from shardwise.train.manifest import complete_checkpoints

    found = complete_checkpoints(checkpoints)
    newest = found[-1] if found else None
    where = " on every node" if every_node else ""
    return (f"; newest checkpoint {newest}: rerun the same command{where} to resume from it (run.max_restarts "
            "restarts automatically)" if newest else "; no checkpoint was written yet")


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}", "pass --nproc 1 or more")


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

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    def torchrun_args(self) -> list[str]:
        # torchrun ignores --node-rank under c10d (the rendezvous orders the nodes itself); it is passed
        # so the agent's view matches the command line, and shardwise uses it for run-directory ownership.
        nodes = f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)
        out = [f"--nnodes={nodes}", f"--node-rank={self.node_rank}", "--rdzv-backend=c10d",
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
