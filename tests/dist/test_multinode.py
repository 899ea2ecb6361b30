"""A two-node launch, for real: two `shardwise train --nnodes 2` agents, each on a test host of its own
(a network namespace with its own address: tests/netns.py), meet at a c10d rendezvous on node 0's
address, two workers each, and train the same 4-rank layout bitwise like one `shardwise train --nproc 4`
agent; the nodes started in either order, or one missing; one node killed mid-run and the job resumed as
the survivor's line advises. Nothing is sent to this machine's own interfaces: the nodes see only their
private switch."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns

LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.tp=2", "--train.micro_batch=4",
          "--train.steps=4", "--train.log_every=1", "--checkpoint.every=0"]
RDZV_PORT = 29400  # torchrun's default: a fresh namespace has every port free


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "run.progress", "train.micro_batch"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip]


def test_two_agents_train_like_one(common, tmp_path):
    cli = [sys.executable, "-m", "shardwise.cli", "train", *common, *LAYOUT]
    with netns.network(2) as net:
        # Both nodes use one run directory, as on a shared file system: node 0 locks it and writes config.toml,
        # node 1 only checks it (a second lock would refuse the job's own node 0).
        run = tmp_path / "two"
        endpoint = f"{net.address(0)}:{RDZV_PORT}"

        def agent(k: int, *extra: str) -> subprocess.Popen:
            return net.popen(k, [*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint",
                                 endpoint, f"--run.dir={run}", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path)

        # Port taken on node 0 (another job's rendezvous): refused before anything starts, exit 2. The rest of
        # the test follows the advice, the port it names, while the first one stays taken.
        hog = net.popen(0, [sys.executable, "-c", "import socket, sys; s = socket.create_server((sys.argv[1], "
                            f"{RDZV_PORT})); print('up', flush=True); sys.stdin.read()", net.address(0)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert hog.stdout.readline().strip() == "up"
        taken = net.run(0, [*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                            f"--run.dir={run}"], timeout=120)
        assert taken.returncode == 2 and taken.stderr.startswith(
            f"error: --rdzv-endpoint: port {RDZV_PORT} of {net.address(0)} is in use"), taken.stderr
        endpoint = taken.stderr.split("e.g. --rdzv-endpoint ", 1)[1].split()[0]  # agent() dials it from here on
        assert endpoint == f"{net.address(0)}:{RDZV_PORT + 1}", taken.stderr
        # Node 0 alone: it says what it waits for, and after run.rendezvous_timeout_s that a node is missing
        # (exit 6); torch's own error is empty, and shardwise once asked node 0 whether node 0 was running.
        alone = net.run(0, [*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                            f"--run.dir={run}", "--run.rendezvous_timeout_s=8", "--run.rendezvous_last_call_s=4"],
                        timeout=120)
        assert alone.returncode == 6 and "Traceback" not in alone.stderr, alone.stdout[-2000:] + alone.stderr[-2000:]
        assert f"node 0: waiting for all 2 nodes at the rendezvous {endpoint} (up to run.rendezvous_timeout_s = 8 s)" \
            in alone.stdout, alone.stdout
        assert [line for line in alone.stderr.splitlines() if line.startswith("error:")] == [
            f"error: fewer than 2 nodes (--nnodes 2) met at the rendezvous at {endpoint} within run.rendezvous_timeout_s "
            "(8 s): start every node, --node-rank 0 to 1, with the same config and --rdzv-endpoint; no checkpoint was "
            "written yet"], alone.stderr
        # Node 1 started with a stale override: unchecked, it trained its ZeRO-3 shards at its own learning rate
        # (exit 0). Every node now says which setting differs, and neither trains (train/agreement.py).
        stale = [agent(0), agent(1, "--train.lr=1e-2")]
        for k, (out, err) in enumerate(a.communicate(timeout=180) for a in stale):
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert stale[k].returncode == 2 and "Traceback" not in err, f"node {k}:\n{out[-2000:]}\n{err[-3000:]}"
            assert len(errors) == 1 and errors[0].startswith("error: train.lr: the ranks of this job were started with "
                                                             "different settings: 0.003 on ranks 0-1"), err
            assert "0.01 on ranks 2-3" in errors[0] and "fix: start every node with the same config file" in err, err
        assert not (run / "metrics.jsonl").exists()
        # Node 1 started with --nnodes 3 and a layout that absorbs the world size (dp_shard=-1): its own checks pass
        # (6 ranks), and both nodes waited at the rendezvous, each for its own count, until run.rendezvous_timeout_s
        # (then exit 6, "fewer than N nodes met"). Whichever node waited first keeps its count in the store; the other
        # is refused, and both end at once with its line.
        absorbing = ["--parallel.dp_shard=-1", "--train.micro_batch=2", "--train.global_batch=12"]
        started = time.monotonic()
        mixed = [agent(0, *absorbing), agent(1, *absorbing, "--nnodes", "3")]
        lines = []
        for k, (out, err) in enumerate(a.communicate(timeout=180) for a in mixed):
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert mixed[k].returncode == 2 and "Traceback" not in err, f"node {k}:\n{out[-2000:]}\n{err[-3000:]}"
            assert len(errors) == 1, err
            lines.append(errors[0])
        assert lines[0] == lines[1] and time.monotonic() - started < 150, lines  # run.rendezvous_timeout_s: 600 s
        refused = "error: node {0} was refused before the rendezvous, so the job cannot start: --nnodes: node {0} was " \
                  "started with --nnodes {1}, node {2} of this job with --nnodes {3}"
        assert lines[0] in (refused.format(1, 3, 0, 2), refused.format(0, 2, 1, 3)), lines
        assert "fix: start every node with the job's own --nnodes (the same on each); then rerun every node" in err, err
        assert not (run / "metrics.jsonl").exists()
        # Node 1 refused before the rendezvous (its --nnodes 3 does not fit the layout): node 0, waiting there, ended
        # after run.rendezvous_timeout_s with "fewer than 2 nodes met" (exit 6). It now ends at once with node 1's
        # error (launch/peer_failure.py), node 0 started first as the waiting one.
        waiting = agent(0)
        while "waiting for all 2 nodes" not in (line := waiting.stdout.readline()):
            assert line, f"node 0 ended before waiting at the rendezvous: {waiting.stderr.read()[-3000:]}"
        refused = net.run(1, [*cli, "--nproc", "2", "--nnodes", "3", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                              f"--run.dir={run}"], timeout=120)
        started = time.monotonic()
        out, err = waiting.communicate(timeout=60)
        assert refused.returncode == 2 and refused.stderr.startswith("error: parallel: "), refused.stderr
        assert waiting.returncode == 2 and "Traceback" not in err, out[-2000:] + err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: node 1 was refused before the rendezvous, so the job cannot start: "
            + refused.stderr.splitlines()[0].removeprefix("error: ")], err
        assert err.rstrip().endswith("; then rerun every node") and time.monotonic() - started < 30, err
        # Node 0 refused (a micro-batch that does not divide the global batch) while node 1 waits for its rendezvous
        # to open: it serves its error there itself until node 1 has read it; node 1 ended after
        # run.rendezvous_timeout_s with "nothing answered" (exit 1) before.
        waiting = agent(1)
        while "waiting for node 0's rendezvous" not in (line := waiting.stdout.readline()):
            assert line, f"node 1 ended before waiting for node 0: {waiting.stderr.read()[-3000:]}"
        time.sleep(3)  # node 1's watch finds nothing at the endpoint a few times
        started = time.monotonic()
        refused = net.run(0, [*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint,
                              f"--run.dir={run}", "--train.micro_batch=3"], timeout=120)
        out, err = waiting.communicate(timeout=60)
        assert refused.returncode == 2 and "node 0: telling the other nodes at the rendezvous" in refused.stdout, \
            refused.stdout + refused.stderr
        assert waiting.returncode == 2 and "Traceback" not in err, out[-2000:] + err[-3000:]
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: node 0 was refused before the rendezvous, so the job cannot start: "
            + refused.stderr.splitlines()[0].removeprefix("error: ")], err
        assert time.monotonic() - started < 30  # node 0 left once node 1 had read its error, not after 30 s
        # While nothing answered, the watch printed no TCPStore client's C++ error and stack for each try.
        assert "Exception raised from" not in err and "TCPStore.cpp" not in err, err[-3000:]
        # What it advises, with node 1 first, as when machines are started by hand: it waits for node 0's store (and says so)
        # for run.rendezvous_timeout_s, not for torch's store timeout (launch/rendezvous.py wait_for_rendezvous).
        agents = [None, agent(1)]
        early = []
        while not any("waiting for node 0's rendezvous" in line for line in early):
            line = agents[1].stdout.readline()
            assert line, f"node 1 ended before waiting for node 0:\n{''.join(early)}\n{agents[1].stderr.read()[-3000:]}"
            early.append(line)
        agents[0] = agent(0)
        outputs = [a.communicate(timeout=180) for a in agents]
    outputs[1] = ("".join(early) + outputs[1][0], outputs[1][1])
    for k, (a, (out, err)) in enumerate(zip(agents, outputs)):
        assert a.returncode == 0, f"node {k}:\n{out[-2000:]}\n{err[-3000:]}"
    assert "owned by node 0" in outputs[1][0] and (run / "config.toml").is_file()
    assert json.loads((run / ".shardwise" / "lock").read_text() or "{}") == {}  # released at the end

    one = subprocess.run([*cli, "--nproc", "4", f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    single, multi = _losses(tmp_path / "one"), _losses(run)
    print("step  one agent (--nproc 4)  two agents (--nnodes 2 --nproc 2)")
    for step, (a, b) in enumerate(zip(single, multi), 1):
        print(f"{step:4d}  {a!r:22}  {b!r}")
    assert len(single) == 4 and multi == single  # bitwise: same layout, same ranks, same reductions


_PIN = ("import os; from shardwise.train.network import pin_gloo_interface; env = {{'MASTER_ADDR': '{addr}'{extra}}}; "
        "print(pin_gloo_interface(env), env.get('GLOO_SOCKET_IFNAME'))")


def test_gloo_binds_the_interface_towards_the_rendezvous():
    """Where the host name resolves to loopback (here, and on Debian / Ubuntu by default), gloo's own choice
    makes every rank publish a loopback address, and the nodes' workers time out dialling themselves
    ("Gloo connectFullMesh failed ... remote=[127.0.0.1]": the two-node run above, before
    train/network.py). Each worker binds gloo to the interface that reaches MASTER_ADDR instead."""
    with netns.network(2) as net:
        def pinned(k: int, addr: str, extra: str = "") -> list[str]:
            done = net.run(k, [sys.executable, "-c", _PIN.format(addr=addr, extra=extra)])
            assert done.returncode == 0, done.stderr
            return done.stdout.split()

        assert pinned(1, net.address(0)) == [netns.NODE_IFNAME] * 2  # another node's address: the link to it
        assert pinned(0, net.address(0)) == [netns.NODE_IFNAME] * 2  # node 0 itself: its own address's interface
        assert pinned(1, "127.0.0.1") == ["lo", "lo"]  # one node: loopback
        assert pinned(1, net.address(0), ", 'GLOO_SOCKET_IFNAME': 'lo'") == ["None", "lo"]  # the user's choice wins


def test_a_node_dies_the_other_says_where_and_both_rerun_to_resume(common, tmp_path):
    """Node 0 (agent and workers) SIGKILLed mid-run of a static two-node job. Node 1's ranks only lose their
    peer: it ends at once (exit 1) with one line that points at node 0's address, not gloo's message
    ("... pair.cc:553] Connection closed by peer ... GLHF!"), and names the checkpoint. What the line
    advises (the same command on every node; checkpoint.resume is on by default, off in these tests'
    base config) resumes from that checkpoint and finishes the job."""
    steps = 60
    cli = [sys.executable, "-m", "shardwise.cli", "train", *common, "--parallel.dp_shard=2", "--parallel.zero=1",
           f"--train.steps={steps}", "--train.micro_batch=4", "--train.log_every=1", "--checkpoint.every=5"]
    run = tmp_path / "run"
    with netns.network(2) as net:
        def agent(k: int, *extra: str) -> subprocess.Popen:
            return net.popen(k, [*cli, "--nproc", "1", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint",
                                 f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

        agents = [agent(0), agent(1)]
        deadline = time.monotonic() + 180
        while len(_records(run)) < 12:
            assert time.monotonic() < deadline and agents[1].poll() is None, "no step 12 within 180 s"
            time.sleep(0.1)
        net.kill_node(0)
        killed = time.monotonic()
        out, err = agents[1].communicate(timeout=120)
        took = time.monotonic() - killed
        agents[0].wait(timeout=30)
        assert agents[1].returncode == 1 and took < 30, (agents[1].returncode, took, err[-2000:])
        last = [line for line in err.splitlines() if line.startswith("error:")]
        # Which sees node 0 go first is a race: node 1's workers (their gloo peer) or its agent (node 0's store).
        lost = (f"lost its connection to a rank at {net.address(0)}",
                f"node 0 was lost during the run (its rendezvous at {net.address(0)}:{RDZV_PORT} closed)")
        assert len(last) == 1 and any(words in last[0] for words in lost), err[-3000:]
        assert "rerun the same command on every node" in last[0] and "GLHF" not in last[0], last[0]
        newest = last[0].split("newest checkpoint ", 1)[1].split(":", 1)[0]

        again = [agent(k, "--checkpoint.resume=true") for k in (0, 1)]
        outputs = [a.communicate(timeout=300) for a in again]
    assert [a.returncode for a in again] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert f"resumed from {newest}" in outputs[0][0], outputs[0][0][-2000:]
    assert max(r["step"] for r in _records(run)) == steps


def _records(run: Path) -> list[dict]:
    try:
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or a line being written
        return []


def test_nodes_that_prepared_other_data_end_before_the_rendezvous_naming_both(common, tmp_path):
    """Node-local caches, and on node 1 a corpus one byte different (a copy edited there): each node prepares its
    own, both pass their own checks, and both end before any worker starts, the line naming both preparations
    (launch/peer_failure.py data_refusal), instead of meeting and failing the ranks' agreement afterwards."""
    corpus = Path(next(c for c in common if c.startswith("--data.path=")).split("=", 1)[1]).read_text()
    texts = [corpus, corpus[:-10] + ("x" if corpus[-10] != "x" else "y") + corpus[-9:]]
    base = [c for c in common if not c.startswith(("--data.path=", "--data.cache_dir="))]
    cli = [sys.executable, "-m", "shardwise.cli", "train", *base, *LAYOUT]
    with netns.network(2) as net:
        endpoint = f"{net.address(0)}:{RDZV_PORT}"
        agents = []
        for k in range(2):
            (tmp_path / f"node{k}").mkdir()
            (tmp_path / f"node{k}" / "corpus.txt").write_text(texts[k])
            agents.append(net.popen(k, [*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint",
                                        endpoint, f"--run.dir={tmp_path / f'node{k}' / 'run'}",
                                        f"--data.path={tmp_path / f'node{k}' / 'corpus.txt'}",
                                        f"--data.cache_dir={tmp_path / f'node{k}' / 'cache'}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path))
        started = time.monotonic()
        outputs = [a.communicate(timeout=180) for a in agents]
    lines = []
    for k, (a, (out, err)) in enumerate(zip(agents, outputs)):
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert a.returncode == 2 and "Traceback" not in err and len(errors) == 1, f"node {k}:\n{out[-2000:]}\n{err[-3000:]}"
        lines.append(errors[0])
    assert lines[0] == lines[1] and time.monotonic() - started < 150, lines
    assert "so the job cannot start: data.path: node" in lines[0] and "prepared other data than node" in lines[0], lines
    for k in range(2):
        assert f"{tmp_path / f'node{k}' / 'cache' / 'prepared'}" in lines[0], lines  # both preparations named
        assert not (tmp_path / f"node{k}" / "run" / "metrics.jsonl").exists()
