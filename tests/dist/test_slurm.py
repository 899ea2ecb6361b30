"""SLURM for real: a one-node cluster on localhost (tests/slurm_cluster.py: munged, slurmctld, slurmd from
Debian's packages), and two ways of training under it, each bitwise like `shardwise train --nproc 2`:

1. the script `shardwise launch slurm --procs-per-node 2 --submit --wait` writes and submits
   (sbatch -> srun -> one torchrun agent -> 2 workers, c10d rendezvous on the allocation's first node);
2. `srun -n 2 python -m shardwise.train` (ranks from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS,
   rendezvous on the first host of SLURM_JOB_NODELIST; train/distributed.py rank_env).

slurm-wlm and munge are installed with apt-get when missing and we are root; otherwise the tests skip
and print why. The daemons are stopped after the module, also when a test fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.debian import require_commands

# ZeRO-3 over 2 ranks: all_gather and reduce_scatter give wrong numbers if the ranks are mapped wrongly.
LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=4", "--train.steps=6",
          "--train.log_every=1", "--checkpoint.every=0"]
# A job on this 2-core machine trains 6 tiny steps in ~20 s; the rest is the scheduler (~1 s).
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        reason = "SLURM's daemons need root to start jobs (slurmd runs them as the submitting user); not root"
        print(reason)
        pytest.skip(reason)
    commands = require_commands(["slurm-wlm", "munge"], ["munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo"])
    try:
        running = slurm_cluster.start(tmp_path_factory.mktemp("slurm"), commands)
    except RuntimeError as e:
        reason = f"a localhost SLURM cluster did not start: {e}"
        print(reason)
        pytest.skip(reason)
    yield running
    running.stop()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture()
def reference(base_overrides, tmp_path) -> tuple[list[str], list[tuple[int, float]]]:
    """The run's arguments (no launcher variables in the environment) and the losses of `train --nproc 2`."""
    common = [f"--{k}={v}" for k, v in base_overrides if k not in ("train.steps", "train.micro_batch")] + LAYOUT
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--nproc", "2", *common,
                           f"--run.dir={tmp_path / 'local'}"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=JOB_TIMEOUT_S, env=_clean_env(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return common, _losses(tmp_path / "local")


def _clean_env(env) -> dict[str, str]:
    """Without the variables of a launcher this test itself might run under."""
    return {k: v for k, v in env.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_")) and
            k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _compare(name: str, expected, got) -> None:
    print(f"step  local loss            {name} loss")
    for (step, a), (_, b) in zip(expected, got):
        print(f"{step:>4}  {a!r:<20}  {b!r}")
    assert [s for s, _ in got] == list(range(1, 7))
    assert got == expected  # bitwise: same floats, not merely close


def test_generated_sbatch_script_trains_like_local(cluster, reference, tmp_path):
    common, expected = reference
    # The job's TMPDIR (sbatch exports the environment): torchrun's log directories must not outlive the job.
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    env = {**_clean_env(cluster.env), "SLURM_CONF": cluster.env["SLURM_CONF"], "TMPDIR": str(node_tmp)}
    (tmp_path / "run.toml").write_text("")  # every setting is an override: the script passes them through
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "launch", "slurm", "--config", "run.toml",
                           "--nodes", "1", "--procs-per-node", "2", "--python", sys.executable, "--out", "job.sbatch",
                           "--submit", "--wait", *common, f"--run.dir={tmp_path / 'sbatch'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=JOB_TIMEOUT_S, env=env)
    job_output = "\n".join(p.read_text() for p in tmp_path.glob("shardwise-*.out"))
    assert done.returncode == 0, done.stdout + done.stderr + job_output[-4000:] + cluster.log_tail()
    assert "Submitted batch job" in done.stdout
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=2" in script and "--gpus-per-node" not in script
    _compare("sbatch", expected, _losses(tmp_path / "sbatch"))
    assert not [p.name for p in node_tmp.iterdir() if "torchelastic" in p.name], list(node_tmp.iterdir())


def test_srun_starts_workers_directly(cluster, reference, tmp_path):
    common, expected = reference
    env = {**_clean_env(cluster.env), "SLURM_CONF": cluster.env["SLURM_CONF"]}
    done = subprocess.run(["srun", "--kill-on-bad-exit=1", "-N", "1", "-n", "2", sys.executable, "-m", "shardwise.train",
                           *common, f"--run.dir={tmp_path / 'srun'}"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=JOB_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + cluster.log_tail()
    for rank in (0, 1):  # each rank says where its launcher put it: a one-node job meets on loopback
        assert f"rank {rank}/2 local {rank}/2 from slurm: cpu, rendezvous 127.0.0.1:" in done.stdout, done.stdout
    _compare("srun", expected, _losses(tmp_path / "srun"))
