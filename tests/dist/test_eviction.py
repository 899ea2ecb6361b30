"""A straggler's node evicted from an elastic job, for real (run.evict_stragglers, train/eviction.py): two test
hosts (network namespaces: tests/netns.py) of two processes each train `--nnodes 1:2`; once the group is formed,
node 1 is throttled to a tenth of a CPU (a CFS quota: tests/throttle.py), as a throttled GPU or a host with a noisy
neighbour slows a node. Its ranks are named, every rank checkpoints the step of the verdict, node 1 leaves with
exit 8 and one line, and node 0 goes on alone from that checkpoint with the same global batch: every step's loss
equals an uninterrupted run's within the parity tolerance (LOSS_RTOL, as tests/dist/test_elastic.py argues), no
step is lost or repeated, and node 1 started again is refused for its cool-down before it joins anything."""
from __future__ import annotations

import json
import subprocess
import sys

from shardwise.parity import LOSS_RTOL
from tests import netns
from tests.dist.test_elastic import RDZV_PORT
from tests.harness import losses_by_step, wait_for
from tests.throttle import throttled

STEPS, EVERY, SLOW_STEPS = 12, 2, 4
# A window's medians against 3x (margin 2.0, as tests/dist/test_straggler.py: two clean ranks on this shared
# 2-core machine differ by up to 2x); node 1 at a tenth of a CPU is ~5-10x slower.
LAYOUT = ["--parallel.dp_shard=-1", "--parallel.zero=3", "--train.micro_batch=2", f"--train.steps={STEPS}",
          "--train.log_every=1", "--checkpoint.every=4", "--checkpoint.keep=100", "--run.max_restarts=3",
          "--run.rendezvous_last_call_s=5", f"--run.straggler_every={EVERY}", f"--run.straggler_steps={SLOW_STEPS}",
          "--run.straggler_margin=2.0", "--run.evict_cooldown_s=600"]


def test_a_throttled_node_is_evicted_and_the_job_goes_on_as_if_nothing_happened(base_overrides, tmp_path):
    skip = {"train.steps", "checkpoint.resume", "train.micro_batch"}
    cli = [sys.executable, "-m", "shardwise.cli", "train", *[f"--{k}={v}" for k, v in base_overrides if k not in skip],
           *LAYOUT]
    run = tmp_path / "evict"
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    with netns.network(2) as net, throttled(0.1) as slow:
        def agent(k: int, log) -> subprocess.Popen:
            return net.popen(k, [*cli, "--run.evict_stragglers=true", "--nproc", "2", "--nnodes", "1:2", "--node-rank",
                                 str(k), "--rdzv-endpoint", f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}"],
                             stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path)

        node0, node1 = agent(0, logs[0]), agent(1, logs[1])
        wait_for(lambda: max(losses_by_step(run), default=0) >= 2, 300, "step 2 on 4 processes")
        throttled_at = max(losses_by_step(run))
        slow.add(net.pids(1))  # node 1's agent and ranks
        codes = [node0.wait(timeout=400), node1.wait(timeout=120)]
        outputs = [log.read_text() for log in logs]
        assert codes == [0, 8], outputs[0][-3000:] + outputs[1][-3000:]
        again = net.run(1, [*cli, "--run.evict_stragglers=true", "--nproc", "2", "--nnodes", "1:2", "--node-rank", "1",
                            "--rdzv-endpoint", f"{net.address(0)}:{RDZV_PORT}", f"--run.dir={run}"], timeout=120)
    named = [line for line in outputs[0].splitlines() if line.startswith("straggler: rank")]
    assert named and all(line.split()[2] in ("2", "3") for line in named), outputs[0][-3000:]  # node 1's ranks only
    decided = [line for line in outputs[0].splitlines() if line.startswith("straggler eviction: node 1")]
    assert len(decided) == 1, outputs[0][-3000:]
    step = int(decided[0].split("after step ")[1].split("'")[0])
    assert throttled_at + SLOW_STEPS <= step <= throttled_at + SLOW_STEPS + 3 * EVERY, (throttled_at, step)
    left = [line for line in outputs[1].splitlines() if line.startswith("evicted:")]
    assert len(left) == 1 and f"left the job after step {step}'s checkpoint as a straggler" in left[0], outputs[1][-3000:]
    assert "Traceback" not in outputs[1] and "Traceback" not in outputs[0]
    assert "now 2 processes" in outputs[0].split(decided[0], 1)[1]  # node 0 alone, resumed from that checkpoint
    assert f"resumed from {run / 'checkpoints' / f'step_{step:08d}'} at step {step}" in outputs[0]
    assert "1 node evicted as stragglers" in outputs[0], outputs[0][-2000:]
    assert again.returncode == 8 and "was evicted from this run as a straggler" in again.stderr, again.stderr
    records = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line)]
    assert records == list(range(1, STEPS + 1))  # none lost, none repeated

    # The reference: one process in the CLI itself (no launcher: the cheapest), the same global batch by accumulation.
    one = subprocess.run([*cli, "--nproc", "1", "--parallel.dp_shard=1", "--parallel.zero=0", "--run.max_restarts=0",
                          f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    straight, elastic = losses_by_step(tmp_path / "one"), losses_by_step(run)
    worst = max(abs(elastic[s] - straight[s]) / abs(straight[s]) for s in straight)
    print(f"evicted after step {step} (throttled at step {throttled_at}); worst relative loss difference {worst:.1e}")
    assert sorted(elastic) == sorted(straight) and worst <= LOSS_RTOL
