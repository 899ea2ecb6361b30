"""An elastic PyTorchJob of `shardwise launch k8s --kind pytorchjob --nodes 1:2` survives the loss of a pod.

Its two Worker pods are started as Kubeflow's training operator (v1.9, pkg/controller.v1/pytorch envvar.go and
elastic.go) and the kubelet would start them (tests/k8s_pods.py): the operator appends PYTHONUNBUFFERED=1,
PET_NPROC_PER_NODE from spec.nprocPerNode and, for an elasticPolicy, PET_RDZV_ENDPOINT
(<job>-worker-0:<the container port named pytorchjob-port>), PET_RDZV_BACKEND (c10d), PET_NNODES ("MIN:MAX")
and PET_MAX_RESTARTS to the container's own env; the pod's label training.kubeflow.org/replica-index gives
PET_NODE_RANK (the manifest's fieldRef); `$(VAR)` in the args is expanded; each pod reaches worker-0 by its
Service's name, here an /etc/hosts line in every pod's network namespace (tests/netns.py); the ConfigMap and
the claim are directories. The container's args must agree with what the operator injects (torchrun reads
PET_* only for the options a command line leaves out), and they do.

Both pods train as one job of 2 x 2 processes; then every process of pod worker-1 is SIGKILLed mid-run (a
node lost: its sh, agent and ranks, the ranks in sessions of their own as torch's agent starts them, so a
kill of the pod's process group alone would leave them running). Worker-0 re-forms the job alone on 2
processes, resumes from the newest checkpoint, resharded (dp_shard=-1 absorbs the change; train.global_batch
stays 8, accumulation doubles), and finishes with exit 0. As in tests/dist/test_elastic.py: every checkpoint
written is intact, and the loss of every step equals an uninterrupted one-node run of the job's 4 processes
within the parity tolerance (parity.py LOSS_RTOL, relative): the samples, their order and the global batch are
the same at any data-parallel size, only the order of fp32 sums changes.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardwise.parity import LOSS_RTOL
from tests import k8s_pods, netns
from tests.harness import losses_by_step, wait_for

STEPS = 30
KILL_AT = 8  # at least this many steps trained by both pods (a checkpoint every 5: step 5's is there to resume)
# dp_shard=-1 fits 4 and 2 processes (one rank per pod cannot: ZeRO needs 2 ranks to shard over, and zero=0
# refuses a dp_shard of 2), so 2 GPUs per pod. The last-call wait for more nodes is 5 s, not torch's 30 s.
LAYOUT = ["--parallel.dp_shard=-1", "--parallel.zero=3", "--train.micro_batch=2", f"--train.steps={STEPS}",
          "--train.log_every=1", "--checkpoint.every=5", "--checkpoint.keep=100", "--run.max_restarts=3",
          "--run.rendezvous_last_call_s=5"]
# Generous for a loaded 2-core machine (4 ranks there take ~0.1-1 s a step), still bounded.
START_S, RECOVER_S, FINISH_S = 300, 300, 420



def _checkpoints(run: Path) -> list[str]:
    """The published checkpoints' names, oldest first (not a step_N.tmp being written)."""
    return sorted(p.name for p in (run / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", p.name))


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_an_elastic_pytorchjob_goes_on_without_a_lost_pod(base_overrides, tmp_path):
    began = time.monotonic()
    skip = {"train.steps", "checkpoint.resume", "train.micro_batch"}
    common = [f"--{k}={v}" for k, v in base_overrides if k not in skip]
    documents = k8s_pods.generate(tmp_path, ["--kind", "pytorchjob", "--nodes", "1:2", "--gpus-per-node", "2",
                                             "--image", "shardwise:test", "--pvc", "shared", "--name", "tiny", *common, *LAYOUT])
    job = documents[-1]
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "c10d", "maxRestarts": 3}
    pods = k8s_pods.pods(documents)
    assert [p.dns for p in pods] == ["tiny-worker-0", "tiny-worker-1"]
    # The container declares only the node's rank and node 0's address; what the operator appends has other
    # names (a duplicate's later value, the operator's, would win in the kubelet) and agrees with the args.
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    operator = {"PYTHONUNBUFFERED", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_NNODES", "PET_MAX_RESTARTS"}
    assert {e["name"] for e in container["env"]} == {"PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    for k, pod in enumerate(pods):
        assert operator <= set(pod.env) and pod.env["PET_RDZV_BACKEND"] == "c10d" and pod.env["PET_MAX_RESTARTS"] == "3"
        assert _option(pod.argv, "--nnodes") == pod.env["PET_NNODES"] == "1:2"
        assert _option(pod.argv, "--rdzv-endpoint") == pod.env["PET_RDZV_ENDPOINT"] == "tiny-worker-0:29400"
        assert _option(pod.argv, "--nproc") == pod.env["PET_NPROC_PER_NODE"] == "2"
        assert _option(pod.argv, "--node-rank") == str(k)  # worker-0 serves the rendezvous (is_host)

    mounts = k8s_pods.mount_volumes(tmp_path, documents, "tiny-config")
    run = tmp_path / "workspace" / "run"
    logs = [tmp_path / f"{pod.name}.log" for pod in pods]
    with netns.network(2) as net:
        started = k8s_pods.start(net, pods, mounts, tmp_path,
                                 [{"stdout": open(log, "w"), "stderr": subprocess.STDOUT} for log in logs])
        # Both pods in the job (worker-0 may have started alone and re-formed for worker-1), as global rank 0
        # says, whichever pod it is on; then KILL_AT steps trained, 3 at least since both pods joined.
        wait_for(lambda: any("layout dp_shard=4 x4" in log.read_text() for log in logs), START_S,
                 "the job on both pods (4 processes)", logs)
        joined = max(losses_by_step(run), default=0)
        wait_for(lambda: max(losses_by_step(run), default=0) >= max(KILL_AT, joined + 3), START_S,
                 f"step {KILL_AT} on both pods", logs)
        newest = max(_checkpoints(run))
        killed_at, trained = time.monotonic(), max(losses_by_step(run))
        # worker-0 alone first (a late worker-1): its first steps ran on 2 processes, not bitwise the 4-process run's
        alone_first = any("layout dp_shard=2 x2" in log.read_text() for log in logs)
        net.kill_node(1)  # every process of pod worker-1
        recovered = wait_for(lambda: len(losses_by_step(run)) > trained, RECOVER_S,
                             "a step trained after worker-1 was lost", logs)
        code = started[0].wait(timeout=FINISH_S)
        lost = started[1].wait(timeout=60)
    out = logs[0].read_text()
    assert code == 0 and lost == -signal.SIGKILL, f"worker-0 exited {code}, worker-1 {lost}:\n{out[-3000:]}"
    after = out.split("now 2 processes", 1)
    assert len(after) == 2, out[-3000:]
    assert "layout dp_shard=2 x2, zero=3, accumulation 2" in after[1], after[1][-3000:]  # the same global batch of 8
    # The newest checkpoint before the loss, as the pod names it: run.dir is relative, under /workspace.
    assert f"resumed from run/checkpoints/{newest} at step" in after[1], after[1][-3000:]
    saved = [int(name.removeprefix("step_")) for name in _checkpoints(run)]
    assert saved == list(range(5, STEPS, 5)), saved  # none lost (checkpoint.final is off: no step 30)
    verify = subprocess.run([sys.executable, "-m", "shardwise.cli", "checkpoint", "verify", str(run / "checkpoints")],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # every checkpoint written is intact

    one = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--config", str(tmp_path / "run.toml"), "--nproc", "4",
                          *common, *LAYOUT, f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=FINISH_S)
    assert one.returncode == 0, one.stderr[-3000:]
    straight, elastic = losses_by_step(tmp_path / "one"), losses_by_step(run)
    assert sorted(elastic) == sorted(straight) == list(range(1, STEPS + 1))
    worst = max(abs(elastic[s] - straight[s]) / abs(straight[s]) for s in straight)
    print(f"killed worker-1 after step {trained} (newest checkpoint {newest}{'; worker-0 began alone' if alone_first else ''}); "
          "worker-0's next trained step "
          f"{recovered - killed_at:.1f} s later; exit codes worker-0 {code}, worker-1 {lost}")
    print("step  one node (--nproc 4)    elastic PyTorchJob")
    for step in sorted(straight):
        print(f"{step:4d}  {straight[step]!r:24}  {elastic[step]!r}")
    print(f"worst relative difference {worst:.1e} (LOSS_RTOL {LOSS_RTOL:g}); {time.monotonic() - began:.0f} s in all")
    assert worst <= LOSS_RTOL
    # Up to the newest checkpoint before the loss, the two pods trained as one node of 4 processes: bitwise.
    kept = range(1, int(newest.removeprefix("step_")) + 1)
    assert alone_first or [elastic[s] for s in kept] == [straight[s] for s in kept]
    assert not re.search(r"^Traceback", out, re.M), out[-3000:]
