"""Elastic training, for real: `shardwise train --nnodes 1:2` on two test hosts (network namespaces of our
own: tests/netns.py), two processes each. One node is SIGKILLed mid-run, agent and workers; the other
goes on alone, resumed from the newest checkpoint and resharded onto 2 processes (dp_shard=-1 absorbs
the change; train.global_batch stays 8, accumulation doubles); the node then joins again and the job
finishes on 4 processes. The loss of every step must equal an uninterrupted 4-process run's within the
parity tolerance (parity.py LOSS_RTOL = 1e-5, relative): the samples, their order and the global batch
are the same at any data-parallel size, so only the order of fp32 sums changes (~1e-7 relative per
step here). A node that joins late and a node drained with SIGTERM each get one line, and no step is lost.
And when fewer than MIN nodes remain, the job ends with exit code 6 and the checkpoint to resume from.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.parity import LOSS_RTOL
from tests import netns
from tests.harness import children, losses_by_step, wait_for

# 30 steps: the pause below keeps node 0 from finishing alone before node 1's new agent starts, so the count need
# not outlast an agent's start-up (test_k8s_elastic runs the same layout for 30). A node dies at step >= KILL_AT (step 5's checkpoint is there to resume from), node 0
# trains alone to ALONE_UNTIL (past the checkpoints of steps 10 and 15, written on 2 processes), and node 1 joins
# again with 14 steps to go: a margin of steps for the pause to land before node 0 would finish, and steps on 4
# processes after the rejoin for the loss comparison. The loss is still compared at every step, 1 to STEPS.
STEPS = 30
KILL_AT, ALONE_UNTIL = 8, 16
LAYOUT = ["--parallel.dp_shard=-1", "--parallel.zero=3", "--train.micro_batch=2", f"--train.steps={STEPS}",
          "--train.log_every=1", "--checkpoint.every=5", "--checkpoint.keep=100", "--run.max_restarts=3",
          "--run.rendezvous_last_call_s=5"]  # torch's 30 s wait for more nodes would be most of each test
RDZV_PORT = 29400


def _sigterm_pending(pid: int) -> bool:
    """A SIGTERM sent to `pid` and not yet delivered (it is stopped): bit 15 - 1 of /proc's ShdPnd mask."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except FileNotFoundError:
        return True  # gone: nothing left to wait for
    pending = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(pending & (1 << (signal.SIGTERM - 1)))


@pytest.fixture()
def cli(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.resume", "train.micro_batch"}
    return [sys.executable, "-m", "shardwise.cli", "train", *[f"--{k}={v}" for k, v in base_overrides if k not in skip],
            *LAYOUT]


def test_a_node_dies_and_joins_again_and_the_loss_goes_on_as_if_nothing_happened(cli, tmp_path):
    run = tmp_path / "elastic"
    scratch = [tmp_path / f"tmp{k}" for k in (0, 1)]  # each node's temp directory (TMPDIR), to see what is left
    with netns.network(2) as net:
        def agent(k: int, log: str) -> subprocess.Popen:
            scratch[k].mkdir(exist_ok=True)
            return net.popen(k, [*cli, "--nproc", "2", "--nnodes", "1:2", "--node-rank", str(k), "--rdzv-endpoint",
                                 f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}"],
                             stdout=open(tmp_path / log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
                             env={**os.environ, "TMPDIR": str(scratch[k])})

        node0, node1 = agent(0, "node0.log"), agent(1, "node1.log")
        wait_for(lambda: max(losses_by_step(run), default=0) >= KILL_AT, 180, f"step {KILL_AT} on 4 processes")
        newest = max(p.name for p in (run / "checkpoints").glob("step_*"))
        killed_at = time.monotonic()
        net.kill_node(1)
        trained = len(losses_by_step(run))
        recovered = wait_for(lambda: len(losses_by_step(run)) > trained, 300, "a step trained after node 1 died")
        wait_for(lambda: max(losses_by_step(run), default=0) >= ALONE_UNTIL, 300, f"step {ALONE_UNTIL} on node 0 alone")
        # Node 0 must not finish alone before the new node's agent has started (tens of seconds on a loaded
        # machine, against ~0.1 s per step: rejoining with 30 and then 40 steps to go both lost that race).
        # So node 0's ranks pause until its agent, having seen the new node, asks them to stop (SIGTERM,
        # pending while they are stopped); then they go on, checkpoint and exit as any restart has them do.
        ranks = children(node0.pid)
        assert len(ranks) == 2, f"node 0's agent should have 2 ranks, has children {ranks}"
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        rejoined = agent(1, "node1-again.log")
        try:
            wait_for(lambda: all(_sigterm_pending(pid) for pid in ranks), 300, "node 0's agent to restart its ranks for node 1")
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        assert node0.wait(timeout=300) == 0 and rejoined.wait(timeout=60) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert node1.poll() == -signal.SIGKILL
    # The killed agent's torchelastic log directory and config copy were removed by the agent that replaced
    # it (shardwise/scratch.py); each live agent removed its own at the end.
    assert not [p.name for d in scratch for p in d.glob("shardwise-*")]
    out = (tmp_path / "node0.log").read_text()
    print(f"from node 1's death to node 0's next trained step: {recovered - killed_at:.1f} s")
    assert "now 2 processes" in out and "layout dp_shard=2 x2, zero=3, accumulation 2" in out
    assert f"resumed from {run / 'checkpoints' / newest}" in out  # the newest checkpoint before the failure
    assert "now 4 processes" in out.split("now 2 processes", 1)[1]  # the joined node: back to 4
    verify = subprocess.run([sys.executable, "-m", "shardwise.cli", "checkpoint", "verify", str(run / "checkpoints")],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # every checkpoint written is intact

    one = subprocess.run([*cli, "--nproc", "4", f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    straight, elastic = losses_by_step(tmp_path / "one"), losses_by_step(run)
    assert sorted(elastic) == sorted(straight) == list(range(1, STEPS + 1))
    worst = max(abs(elastic[s] - straight[s]) / abs(straight[s]) for s in straight)
    print(f"final loss: uninterrupted {straight[STEPS]!r}, elastic {elastic[STEPS]!r}; worst relative difference {worst:.1e}")
    assert worst <= LOSS_RTOL


def test_a_late_node_joins_and_a_drained_node_leaves_each_said_once_and_no_step_lost(cli, tmp_path):
    """--nnodes 1:2, node 0 starts alone. Node 1 joins late: the group re-forms on 4 processes and node 0 says so
    (torch's agent re-forms it without counting a restart: no line said it). Then node 1 is drained with SIGTERM
    (a spot instance's notice): every rank finishes its step and checkpoints it, node 1 ends with 143 and a line
    of its own, and node 0 goes on alone from that checkpoint. Node 0 never says "interrupted ... rerun": its job
    did not stop (it did, twice, before the launcher took over that line). No step is trained twice."""
    run = tmp_path / "drain"
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    with netns.network(2) as net:
        def agent(k: int) -> subprocess.Popen:
            return net.popen(k, [*cli, "--nproc", "2", "--nnodes", "1:2", "--node-rank", str(k), "--rdzv-endpoint",
                                 f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}"], stdout=open(logs[k], "w"),
                             stderr=subprocess.STDOUT, cwd=tmp_path)

        node0 = agent(0)
        wait_for(lambda: max(losses_by_step(run), default=0) >= 8, 180, "step 8 on node 0 alone")
        ranks = children(node0.pid)  # paused until node 0's agent has seen node 1 (see the test above)
        assert len(ranks) == 2, f"node 0's agent should have 2 ranks, has children {ranks}"
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        node1 = agent(1)
        try:
            wait_for(lambda: all(_sigterm_pending(pid) for pid in ranks), 300, "node 0's agent to re-form the group for node 1")
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: "now 4 processes" in logs[0].read_text(), 300, "the group on 4 processes")
        joined = max(losses_by_step(run), default=0)
        wait_for(lambda: max(losses_by_step(run), default=0) > joined, 300, "a step on 4 processes")
        node1.send_signal(signal.SIGTERM)  # `ip netns exec` execs the agent: this is its pid
        codes = [node0.wait(timeout=300), node1.wait(timeout=60)]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 143], outputs[0][-3000:]
    records = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records == list(range(1, STEPS + 1))  # none lost, none repeated
    after_join = outputs[0].split("now 4 processes", 1)[1]
    assert "now 2 processes" in after_join, outputs[0][-3000:]  # node 0 alone again after the drain
    assert "interrupted" not in outputs[0] and "rerun" not in outputs[0], outputs[0][-3000:]
    assert "stopped with the others after a step" in after_join and "exited with code 143" not in outputs[0]
    left = [line for line in outputs[1].splitlines() if line.startswith("interrupted")]
    assert len(left) == 1 and "node 1 left the job" in left[0] and "goes on with the other nodes" in left[0], outputs[1]
    assert "newest checkpoint" in left[0] and "Traceback" not in outputs[1], outputs[1]
    assert not [out for out in outputs if "hostname of the client socket" in out]  # named nodes (tests/netns.py)


def test_fewer_than_min_nodes_end_the_job_with_exit_6_and_the_checkpoint_to_resume(cli, tmp_path):
    """--nnodes 2:3 cannot go on with one node: after node 1 dies, node 0's rendezvous waits
    run.rendezvous_timeout_s for a second node, then ends with exit code 6 naming the newest checkpoint; the
    command it advises (the same again, on both nodes; checkpoint.resume is on by default, off in these
    tests' base config) resumes from there. global_batch 12: 2 and 3 processes both divide it."""
    run = tmp_path / "short"
    with netns.network(2) as net:
        def agent(k: int, *extra: str) -> subprocess.Popen:
            return net.popen(k, [*cli, "--nproc", "1", "--nnodes", "2:3", "--train.global_batch=12", "--node-rank", str(k),
                                 "--rdzv-endpoint",
                                 f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}", "--run.rendezvous_timeout_s=20",
                                 *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

        node0, _ = agent(0), agent(1)
        wait_for(lambda: max(losses_by_step(run), default=0) >= 8, 180, "step 8")
        net.kill_node(1)
        out, err = node0.communicate(timeout=240)
        assert node0.returncode == 6, out[-2000:] + err[-2000:]
        last = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(last) == 1 and "fewer than 2 node(s)" in last[0] and "newest checkpoint" in last[0], err[-2000:]
        assert "rerun the same command on every node" in last[0], last[0]
        newest = last[0].split("newest checkpoint ", 1)[1].split(":", 1)[0]
        again = [agent(k, "--checkpoint.resume=true") for k in (0, 1)]
        outputs = [a.communicate(timeout=300) for a in again]
    assert [a.returncode for a in again] == [0, 0], outputs[0][1][-2000:]
    assert f"resumed from {newest}" in outputs[0][0] and max(losses_by_step(run)) == STEPS
