"""The test-host helper (tests/netns.py) keeps its promises: nodes reach each other and nothing else,
and every namespace, link and process it made is gone afterwards — when the block ends, when it raises,
when the test process is interrupted, and (swept by the next run) when it was killed outright."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import netns
from tests.harness import alive, interruptible

ROOT = Path(__file__).resolve().parents[2]
_SERVE = "import socket; s = socket.create_server(('{addr}', 29400)); c, _ = s.accept(); c.sendall(b'hello')"
_DIAL = "import socket; print(socket.create_connection(('{addr}', 29400), timeout=5).recv(5).decode())"


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def _gone(net: netns.Network, pids: list[int]) -> None:
    assert not set([*net.nodes, net.hub]) & set(netns.ours()), "a namespace outlived the network"
    assert not [p for p in pids if alive(p)], "a process outlived the network"


@pytest.fixture(autouse=True)
def _root_only():
    reason = netns.unavailable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)


def test_nodes_reach_each_other_and_not_the_host():
    before = _links()
    with netns.network(3) as net:
        server = net.popen(0, [sys.executable, "-c", _SERVE.format(addr=net.address(0))], stdout=subprocess.PIPE)
        for _ in range(50):  # until the server listens
            if "29400" in net.run(0, ["ss", "-ltn"]).stdout:
                break
            time.sleep(0.1)
        dialled = net.run(2, [sys.executable, "-c", _DIAL.format(addr=net.address(0))])
        assert dialled.stdout.strip() == "hello", dialled.stderr
        # A node has no default route: the machine's own addresses and every other host are unreachable from it.
        routes = net.run(1, ["ip", "-4", "route"]).stdout.splitlines()
        assert routes and all(r.startswith(f"{netns.SUBNET}.0/24 ") for r in routes), routes
        probe = net.run(1, [sys.executable, "-c", "import socket; socket.create_connection(('198.51.100.1', 22), timeout=2)"])
        assert "Network is unreachable" in probe.stderr, probe.stderr
        sleeper = net.popen(1, ["sleep", "300"])
    assert server.wait(timeout=10) == 0
    _gone(net, [sleeper.pid])
    assert _links() == before  # nothing was made, or left, in the machine's own namespace


def test_removed_when_the_block_raises():
    with pytest.raises(RuntimeError, match="test failed"):
        with netns.network(2) as net:
            # A process started in the namespace by other means than popen (a daemon, a grandchild).
            subprocess.run(["ip", "netns", "exec", net.nodes[0], "sh", "-c", "sleep 300 & echo $! > /dev/null"], check=True)
            stray = [int(p) for p in subprocess.run(["ip", "netns", "pids", net.nodes[0]], capture_output=True,
                                                    text=True).stdout.split()]
            assert stray
            raise RuntimeError("test failed")
    _gone(net, stray)


def test_removed_when_interrupted(tmp_path):
    """Ctrl-C in the middle of a test: the helper cleans up on the way out."""
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests import netns
        with netns.network(2) as net:
            net.popen(1, ["sleep", "300"])
            print(" ".join([*net.nodes, net.hub]), flush=True)
            time.sleep(300)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, preexec_fn=interruptible)
    names = proc.stdout.readline().split()
    assert len(names) == 3 and set(names) <= set(netns.ours())
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert not set(names) & set(netns.ours())


def test_a_killed_run_is_swept_by_the_next(tmp_path):
    """SIGKILL leaves no chance to clean up: the next network() removes namespaces whose creator is gone."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests import netns
        with netns.network(2) as net:
            sleeper = net.popen(0, ["sleep", "300"])
            print(" ".join([*net.nodes, net.hub]), sleeper.pid, flush=True)
            time.sleep(300)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    *names, pid = proc.stdout.readline().split()
    proc.kill()
    proc.wait(timeout=30)
    assert set(names) <= set(netns.ours())  # left behind
    swept = netns.sweep_stale()
    assert set(names) <= set(swept) and not set(names) & set(netns.ours())
    deadline = time.monotonic() + 10
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(int(pid))  # the namespace's process was killed with it
