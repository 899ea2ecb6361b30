"""A refused node's error reaches the nodes waiting at the rendezvous (launch/peer_failure.py), on a TCPStore
served on loopback in this process, as node 0's agent serves one (the two-node run: tests/dist/test_multinode.py)."""
from __future__ import annotations

import gc
import signal
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardwise.launch.peer_failure import KEY, RefusalWatch, refusal_line, serve_refusal, tell_waiting_nodes
from tests.harness import free_port


@pytest.fixture()
def served():
    """A TCPStore server on loopback and its endpoint; the server (a thread of this process) is destroyed after
    the test: tests that fork run in this process too (tests/harness.py)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield store, f"127.0.0.1:{port}"
    del store
    gc.collect()


def test_the_first_refusal_is_kept_and_nobody_listening_gives_up_in_time(served):
    store, endpoint = served
    assert tell_waiting_nodes(endpoint, 1, "data.path: not found\n  fix: pass a file", wait_s=5)
    assert tell_waiting_nodes(endpoint, 2, "train.lr: bad", wait_s=5)
    assert store.get(KEY).decode() == refusal_line(1, "data.path: not found\n  fix: pass a file")
    assert refusal_line(1, "x: y\n  fix: z") == ("node 1 was refused before the rendezvous, so the job cannot start: "
                                                 "x: y\n  fix: z; then rerun every node")
    with socket.socket() as held:  # a port bound and not listening: refused, and nobody else can take it
        held.bind(("127.0.0.1", 0))
        began = time.monotonic()
        assert not tell_waiting_nodes(f"127.0.0.1:{held.getsockname()[1]}", 1, "x: y", wait_s=2)
        assert time.monotonic() - began < 10


def test_the_watch_stops_the_waiting_main_thread_and_ends_once_workers_started(served):
    store, endpoint = served
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    try:
        started = RefusalWatch(endpoint, started=lambda: True).start()  # workers running: it leaves at once
        time.sleep(1.5)
        assert not started._thread.is_alive() and started.refusal is None
        watch = RefusalWatch(endpoint, started=lambda: False).start()
        time.sleep(1.5)
        assert signals == [] and watch.refusal is None  # nothing posted: it keeps waiting
        store.set(KEY, refusal_line(1, "x: y"))
        deadline = time.monotonic() + 10
        while not signals and time.monotonic() < deadline:
            time.sleep(0.1)
        watch.stop()
        assert signals == [signal.SIGTERM] and watch.refusal == refusal_line(1, "x: y")
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_refused_node_0_serves_its_error_until_every_node_has_read_it():
    """Node 0 has no agent when it is refused: it serves the line itself, and leaves once the others read it."""
    endpoint = f"127.0.0.1:{free_port()}"
    served = []
    server = threading.Thread(target=lambda: served.append(serve_refusal(endpoint, "x: y", readers=1, wait_s=20)))
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    try:
        began = time.monotonic()
        server.start()
        watch = RefusalWatch(endpoint, started=lambda: False).start()
        server.join(timeout=30)
        # The watch counts itself a reader before it signals: the server may return first. Stopping the watch
        # in that gap kept it from signalling at all (a full run's one failure, 2026-11-30), so wait for it.
        deadline = time.monotonic() + 10
        while not signals and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.stop()
        assert served == [1] and time.monotonic() - began < 10  # read by the one other node: no 20 s wait
        assert signals == [signal.SIGTERM] and watch.refusal == refusal_line(0, "x: y")
        assert serve_refusal(f"127.0.0.1:{free_port()}", "x: y", readers=1, wait_s=1) == 0  # nobody came
    finally:
        signal.signal(signal.SIGTERM, previous)
        gc.collect()


def test_a_node_with_another_nnodes_is_refused_and_the_first_node_ends_with_its_line(served, monkeypatch):
    """Nodes started with --nnodes 2 and 3 (a layout absorbing the world size passes both nodes' own checks)
    each waited for their own count until run.rendezvous_timeout_s. The first to wait keeps its count in the
    store; the other refuses itself there, and the first reads its line (tests/dist/test_multinode.py runs it).
    The three watches share this process: each stop is recorded where it is sent, since SIGTERMs sent to it
    at nearly the same time would arrive as one (the test below says why)."""
    from shardwise.launch import peer_failure
    from shardwise.launch.peer_failure import NNODES, nnodes_refusal

    store, endpoint = served
    signals = []
    monkeypatch.setattr(peer_failure.signal, "pthread_kill", lambda thread, signum: signals.append(signum))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        first = RefusalWatch(endpoint, started=lambda: False, node_rank=0, spec="2").start()
        deadline = time.monotonic() + 10
        while not store.check([NNODES]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.get(NNODES).decode() == "2@0" and signals == []  # alone, or with its own count: it waits
        same = RefusalWatch(endpoint, started=lambda: False, node_rank=2, spec="2").start()
        time.sleep(1.5)
        assert signals == [] and same.refusal is None
        other = RefusalWatch(endpoint, started=lambda: False, node_rank=1, spec="3").start()
        while len(signals) < 3 and time.monotonic() < deadline + 10:
            time.sleep(0.1)
        for watch in (first, same, other):
            watch.stop()
        line = nnodes_refusal(1, "3", "2@0")
        assert line == ("node 1 was refused before the rendezvous, so the job cannot start: --nnodes: node 1 was started "
                        "with --nnodes 3, node 0 of this job with --nnodes 2\n  fix: start every node with the job's own "
                        "--nnodes (the same on each); then rerun every node")
        assert signals == [signal.SIGTERM] * 3 and first.refusal == same.refusal == other.refusal == line
        assert nnodes_refusal(1, "2", "2@0") is None
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_node_that_prepared_other_data_is_refused_naming_both_preparations(served, monkeypatch):
    """Node-local caches that differ (a corpus edited on one node): the node whose prepared data differs from the
    first waiting node's refuses itself before any worker starts, naming both preparations, and the first node
    ends with its line; a node with the same data waits on."""
    from shardwise.launch import peer_failure
    from shardwise.launch.peer_failure import DATA, data_refusal

    store, endpoint = served
    signals = []
    monkeypatch.setattr(peer_failure.signal, "pthread_kill", lambda thread, signum: signals.append(signum))
    mine, theirs = "a" * 64 + "@/cache/prepared/x (sha256 aaaa, 10 tokens)", "b" * 64 + "@/cache/prepared/y (sha256 bbbb, 12 tokens)"
    first = RefusalWatch(endpoint, started=lambda: False, node_rank=0, spec="2", data=mine).start()
    deadline = time.monotonic() + 10
    while not store.check([DATA]) and time.monotonic() < deadline:
        time.sleep(0.1)
    same = RefusalWatch(endpoint, started=lambda: False, node_rank=2, spec="2", data=mine).start()
    time.sleep(1.5)
    assert signals == [] and same.refusal is None
    other = RefusalWatch(endpoint, started=lambda: False, node_rank=1, spec="2", data=theirs).start()
    while len(signals) < 3 and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    for watch in (first, same, other):
        watch.stop()
    line = data_refusal(1, theirs, store.get(DATA).decode())
    assert line is not None and "node 1 read /cache/prepared/y (sha256 bbbb, 12 tokens), node 0 /cache/prepared/x" in line
    assert signals == [signal.SIGTERM] * 3 and first.refusal == same.refusal == other.refusal == line
    assert data_refusal(1, mine, store.get(DATA).decode()) is None


def test_an_elastic_node_with_another_range_ends_alone(served):
    """An elastic job (--nnodes MIN:MAX) goes on without a refused node, so only the node with another range ends."""
    store, endpoint = served
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    try:
        first = RefusalWatch(endpoint, started=lambda: False, node_rank=0, spec="1:2", tell=False).start()
        time.sleep(1.5)
        other = RefusalWatch(endpoint, started=lambda: False, node_rank=1, spec="1:3", tell=False).start()
        deadline = time.monotonic() + 10
        while not signals and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
        first.stop()
        other.stop()
        assert signals == [signal.SIGTERM] and first.refusal is None and "--nnodes 1:3, node 0" in other.refusal
        assert not store.check([KEY])
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_refused_node_0_stops_its_agent_only_once_a_waiting_node_read_its_line(served, monkeypatch):
    """Node 0's agent serves the store, and stopping node 0 closes it: when node 0 is the node with another
    --nnodes, the node that waited first reads its line before node 0 stops (else it saw the store vanish).
    Both nodes' watches are in this one process here, and each stops it with SIGTERM about 0.1 s apart: two
    SIGTERMs pending at once are one signal (POSIX does not queue them), so on a loaded machine the handler
    ran once (CI, 2026-11-28: [1]). Each stop is recorded where it is sent instead, with what had been read."""
    from shardwise.launch import peer_failure
    from shardwise.launch.peer_failure import READ_BY

    store, endpoint = served
    read_when_stopped = []
    monkeypatch.setattr(peer_failure.signal, "pthread_kill",
                        lambda thread, signum: read_when_stopped.append((signum, store.add(READ_BY, 0))))
    first = RefusalWatch(endpoint, started=lambda: False, node_rank=1, spec="3").start()
    time.sleep(1.5)
    node0 = RefusalWatch(endpoint, started=lambda: False, node_rank=0, spec="2").start()
    deadline = time.monotonic() + 15
    while len(read_when_stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    first.stop()
    node0.stop()
    assert node0.refusal == first.refusal and "node 0 was started with --nnodes 2, node 1" in node0.refusal
    # node 1 read it first (and stopped), then node 0 stopped
    assert read_when_stopped == [(signal.SIGTERM, 1), (signal.SIGTERM, 1)], read_when_stopped
