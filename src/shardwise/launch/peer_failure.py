"""A node that fails before the rendezvous tells the nodes waiting there, which end at once.

Every node of a multi-node job checks its config, layout, disks and data before it joins (cli.py
`train`), each on its own. Measured on two nodes (network namespaces, 2026-11-27): node 1 started with
--nnodes 3 was refused in a second (exit 2, its layout does not fit 3 nodes), while node 0 waited at
the rendezvous for run.rendezvous_timeout_s (600 s by default) and then said that fewer than 2 nodes had
met (exit 6), with no word of node 1's error. The same follows from a corpus missing on one node, a full
disk there, or a typo in one node's command line.

Now the refused node leaves its error line in node 0's rendezvous store (the c10d TCPStore torch's
agent serves at --rdzv-endpoint), under a key of our own, and every waiting node's launcher polls that
key until its workers start: it then ends with the refused node's line and exit 2, as that node did.
A refused node 0 has no agent to serve that store, so it serves one itself at the endpoint, holding its
line, until every other node has read it (each adds 1 to a second key) or TELL_WAIT_S have passed: the
nodes waiting for its rendezvous to open see it open, read the line and end. An elastic job (--nnodes
MIN:MAX) goes on without the refused node, as it would after losing one, so it is not told.

Nodes that prepared different data (node-local caches of corpora that differ, a tokenizer changed on one
node) are told apart the same way, by the digest of what each read (train/agreement.py's), before any
worker starts: the line names both preparations.

Nodes started with different --nnodes pass every check of their own, then wait for each other at the
rendezvous until run.rendezvous_timeout_s, each for its own count (measured on two nodes, --nnodes 2 and 3,
2026-11-28: both waited, and would have ended with "fewer than N nodes met", exit 6, after 600 s). So each
waiting node leaves its --nnodes in the store too (the first one stays); a node that finds another count
there is refused like any other, and every node ends with its line and exit 2 at once.
"""
from __future__ import annotations

import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.launch.rendezvous import RDZV_DEFAULT_PORT, split_endpoint

# The keys in node 0's store: one job per store (its port is taken while the job runs), so no job id in them.
KEY = "shardwise/refused_before_rendezvous"
READ_BY = "shardwise/refusal_read_by"  # how many nodes have read KEY
NNODES = "shardwise/nnodes"  # "SPEC@NODE_RANK": the --nnodes of the first node that waited, and which node it was
DATA = "shardwise/data"  # "DIGEST@NODE_RANK@WHAT": the prepared data the first node that waited read (train/agreement.py's digest)
# How long a refused node waits for node 0's store to open (the nodes of a job start within seconds of
# each other; node 0 needs a few to check its own data before its agent opens the store).
TELL_WAIT_S = 30.0
POLL_S = 1.0


def _client(endpoint: str, timeout_s: float):
    """A TCPStore client of the rendezvous store at `endpoint`; raises OSError while nothing accepts there.
    A plain connect asks first (launch/rendezvous.py wait_for_rendezvous does the same): a TCPStore client
    that cannot connect prints torch's C++ error and stack to stderr at every try, which the user would
    read every second while node 0 is not up yet."""
    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    with socket.create_connection((host, port or RDZV_DEFAULT_PORT), timeout=min(timeout_s, 1.0)):
        pass
    return dist.TCPStore(host, port or RDZV_DEFAULT_PORT, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def tell_waiting_nodes(endpoint: str, node_rank: int, error: str, wait_s: float = TELL_WAIT_S) -> bool:
    """Leaves this node's error (a ConfigError's render) in the rendezvous store at `endpoint` for the nodes
    waiting there (the first refusal stays); waits up to wait_s for the store to open. Whether it was told."""
    deadline = time.monotonic() + wait_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            store = _client(endpoint, max(1.0, min(remaining, 5.0)))
            store.compare_set(KEY, "", refusal_line(node_rank, error))
            return True
        except (RuntimeError, ValueError, OSError):  # not open yet (DistStoreError is a RuntimeError), or unreachable
            if deadline - time.monotonic() <= 0:
                return False
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def serve_refusal(endpoint: str, error: str, readers: int, wait_s: float = TELL_WAIT_S) -> int:
    """Node 0 refused: serves a store at `endpoint` holding its refusal until `readers` nodes have read it or
    wait_s have passed; how many read it. Raises when the port cannot be served (taken by another program)."""
    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    store = dist.TCPStore(host, port or RDZV_DEFAULT_PORT, is_master=True, timeout=timedelta(seconds=wait_s),
                          wait_for_workers=False)
    store.set(KEY, refusal_line(0, error))
    deadline = time.monotonic() + wait_s
    while (read := store.add(READ_BY, 0)) < readers and time.monotonic() < deadline:
        time.sleep(0.2)
    return read


def refusal_line(node_rank: int, error: str) -> str:
    """What the waiting nodes print for node K's error (its field, problem and fix)."""
    return f"node {node_rank} was refused before the rendezvous, so the job cannot start: {error}; then rerun every node"


def nnodes_refusal(node_rank: int, spec: str, stored: str) -> str | None:
    """This node's refusal when the store's --nnodes (`stored`, "SPEC@NODE_RANK") is another than its own
    `spec`, else None."""
    other, _, other_rank = stored.partition("@")
    if other == spec:
        return None
    error = ConfigError("--nnodes", f"node {node_rank} was started with --nnodes {spec}, node {other_rank} of this job "
                        f"with --nnodes {other}", "start every node with the job's own --nnodes (the same on each)")
    return refusal_line(node_rank, error.render())


def data_refusal(node_rank: int, mine: str, stored: str) -> str | None:
    """This node's refusal when the first waiting node read other prepared data (`stored`, "DIGEST@NODE_RANK@WHAT")
    than this node's (`mine`, "DIGEST@WHAT"), else None: both manifests named, before any worker starts."""
    other_digest, _, rest = stored.partition("@")
    other_rank, _, other_what = rest.partition("@")
    digest, _, what = mine.partition("@")
    if other_digest == digest:
        return None
    error = ConfigError("data.path", f"node {node_rank} prepared other data than node {other_rank}: node {node_rank} read "
                        f"{what}, node {other_rank} {other_what}",
                        "give every node the same corpus and tokenizer (a shared data.cache_dir, or copies of one "
                        "prepared directory), then rerun every node")
    return refusal_line(node_rank, error.render())


class RefusalWatch:
    """Polls the rendezvous store for a refused node's line while this node waits there; on one, stops the
    waiting main thread with SIGTERM (launch/local.py's _StopBeforeWorkers turns it into torch's
    SignalException before any worker runs) and keeps the line in `refusal`. Stops by itself once this
    node's workers have started (`started()`), after which no node can have been refused. Compares this
    node's --nnodes (`spec`) with the first waiting node's, and refuses this node when they differ
    (`tell`: other nodes read its line; an elastic job goes on without a refused node, so its nodes do not
    read the others' refusals)."""

    def __init__(self, endpoint: str, started, node_rank: int = 0, spec: str | None = None, tell: bool = True,
                 data: str | None = None):
        """`data`: "DIGEST@WHAT", the prepared data this node read, compared like `spec` (data_refusal)."""
        self.endpoint, self.started = endpoint, started
        self.node_rank, self.spec, self.tell, self.data = node_rank, spec, tell, data
        self.refusal: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardwise-refusal-watch", daemon=True)

    def start(self) -> "RefusalWatch":
        self._main = threading.main_thread().ident
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        store = None
        while not self._done.wait(POLL_S):
            if self.started():
                return
            try:
                store = store or _client(self.endpoint, 2.0)
                mine = None
                if self.spec is not None:
                    stored = store.compare_set(NNODES, "", f"{self.spec}@{self.node_rank}").decode(errors="replace")
                    mine = nnodes_refusal(self.node_rank, self.spec, stored)
                    self.spec = None  # compared once: the first node's count stays in the store
                if mine is None and self.data is not None:
                    digest, _, what = self.data.partition("@")
                    stored = store.compare_set(DATA, "", f"{digest}@{self.node_rank}@{what}").decode(errors="replace")
                    mine = data_refusal(self.node_rank, self.data, stored)
                    self.data = None
                if mine is not None:
                    if self.tell:
                        store.compare_set(KEY, "", mine)  # the waiting nodes end with it (the first refusal stays)
                        if self.node_rank == 0:  # its agent serves the store: stopping closes it, so the node
                            self._wait_read(store)  # that waits there reads the line first
                    self._stop_main(mine)
                    return
                if self.tell and store.check([KEY]):
                    line = store.get(KEY).decode(errors="replace")  # read before counted: a refused node 0
                    store.add(READ_BY, 1)  # serves the line until every node has read it, then closes its store
                    self._stop_main(line)
                    return
            except (RuntimeError, ValueError, OSError):  # not open yet, or closed: try again
                store = None

    @staticmethod
    def _wait_read(store) -> None:
        """Until one other node has read the refusal (each polls every POLL_S), or a few polls' time."""
        deadline = time.monotonic() + 3 * POLL_S + 2.0
        while store.add(READ_BY, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)

    def _stop_main(self, line: str) -> None:
        self.refusal = line
        if not self._done.is_set():
            signal.pthread_kill(self._main, signal.SIGTERM)


def workers_started(log_dir: Path | str) -> bool:
    """Whether torch's agent has started workers: it makes <log_dir>/<run>/attempt_N for them (torch 2.13),
    none while the nodes wait at the rendezvous."""
    return any(Path(log_dir).glob("*/attempt_*"))
