"""The job a `shardwise launch k8s` manifest describes really forms: each pod of a two-node TrainJob, as
Kubeflow Trainer's torch runtime and the kubelet would start it (tests/k8s_pods.py: the PET_* variables, the
`$(VAR)` expansion, the volumes), runs as a node on a test host of its own (a network namespace:
tests/netns.py), node 0's DNS name <job>-node-0-0.<job> mapped to node 0's address in every node's
/etc/hosts, the ConfigMap's run.toml and the shared volume as directories. The two pods of one rank each must
train like one `shardwise train --nproc 2`, loss for loss (the same 2-rank layout: bitwise, as the multi-node
test holds torchrun's two agents). The other kinds differ only in where the same variables come from, which
tests/unit/test_launch_k8s.py holds."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import k8s_pods, netns

# ZeRO-3 across the two pods, one rank each: the fewest processes (each costs seconds of start-up on 2 cores) that
# still make every step's collectives cross from one pod to the other.
LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=4", "--train.steps=4", "--train.log_every=1",
          "--checkpoint.every=0"]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_trainjobs_pods_train_like_one_node(base_overrides, tmp_path):
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "run.progress", "train.micro_batch"}
    common = [f"--{k}={v}" for k, v in base_overrides if k not in skip]
    documents = k8s_pods.generate(tmp_path, ["--nodes", "2", "--gpus-per-node", "1", "--image", "shardwise:test",
                                             "--pvc", "shared", "--name", "tiny", *common, *LAYOUT])
    pods = k8s_pods.pods(documents)
    assert [p.dns for p in pods] == ["tiny-node-0-0.tiny", "tiny-node-0-1.tiny"]
    # The volumes: the ConfigMap's files in a directory, the claim one directory both pods share.
    mounts = k8s_pods.mount_volumes(tmp_path, documents, "tiny-config")
    workspace = tmp_path / "workspace"
    with netns.network(2) as net:
        started = k8s_pods.start(net, pods, mounts, tmp_path,
                                 [{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}] * len(pods))
        outputs = [p.communicate(timeout=300) for p in started]
    for k, (p, (out, err)) in enumerate(zip(started, outputs)):
        assert p.returncode == 0, f"pod {k}:\n{out[-2000:]}\n{err[-3000:]}"
    assert "owned by node 0" in outputs[1][0] and f"rendezvous tiny-node-0-0.tiny:{k8s_pods.TRAINER_PORT}" in outputs[1][0]

    one = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--config", str(tmp_path / "run.toml"), "--nproc", "2",
                          *common, *LAYOUT, f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    single, multi = _losses(tmp_path / "one"), _losses(workspace / "run")
    print("step  one node (--nproc 2)  TrainJob (2 pods x 1)")
    for step, (a, b) in enumerate(zip(single, multi), 1):
        print(f"{step:4d}  {a!r:22}  {b!r}")
    assert len(single) == 4 and multi == single  # bitwise: the same layout, ranks and reductions
