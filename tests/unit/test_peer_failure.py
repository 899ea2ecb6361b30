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
        watch.stop()
        assert served == [1] and time.monotonic() - began < 10  # read by the one other node: no 20 s wait
        assert signals == [signal.SIGTERM] and watch.refusal == refusal_line(0, "x: y")
        assert serve_refusal(f"127.0.0.1:{free_port()}", "x: y", readers=1, wait_s=1) == 0  # nobody came
    finally:
        signal.signal(signal.SIGTERM, previous)
        gc.collect()
