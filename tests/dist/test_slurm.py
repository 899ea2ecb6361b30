"""SLURM for real, from Debian's packages (tests/slurm_cluster.py: munged, slurmctld, slurmd): a one-node
cluster on localhost, and a two-node one whose nodes are test hosts of their own (tests/netns.py). Each
way of training under it is bitwise like `shardwise train --nproc 2`:

1. the script `shardwise launch slurm --procs-per-node P --submit --wait` writes and submits
   (sbatch -> srun -> one `shardwise train` per node -> its workers, c10d rendezvous on the allocation's
   first node), on one node and on two;
2. `srun -n 2 python -m shardwise.train` (ranks from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS,
   rendezvous on the first host of SLURM_JOB_NODELIST; train/distributed.py rank_env).

And what a user meets next: a failed job's one line and exit code, the time-limit signal's checkpoint and
the resubmitted script resuming from it. slurm-wlm and munge are installed with apt-get when missing and
we are root; otherwise the tests skip and print why. The daemons are stopped after the module (the
two-node cluster after its test), also when a test fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns, slurm_cluster
from tests.debian import require_commands

# ZeRO-3 over 2 ranks: all_gather and reduce_scatter give wrong numbers if the ranks are mapped wrongly.
LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=4", "--train.steps=6",
          "--train.log_every=1", "--checkpoint.every=0"]
# A job on this 2-core machine trains 6 tiny steps in ~20 s; the rest is the scheduler (~1 s).
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        reason = "SLURM's daemons need root to start jobs (slurmd runs them as the submitting user); not root"
        print(reason)
        pytest.skip(reason)
    commands = require_commands(["slurm-wlm", "munge"], ["munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo"])
    try:
        running = slurm_cluster.start(commands)
    except RuntimeError as e:
        reason = f"a localhost SLURM cluster did not start: {e}"
        print(reason)
        pytest.skip(reason)
    yield running
    running.stop()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def reference(base_overrides, tmp_path_factory) -> tuple[list[str], list[tuple[int, float]]]:
    """The run's arguments (no launcher variables in the environment) and the losses of `train --nproc 2`."""
    tmp_path = tmp_path_factory.mktemp("reference")
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


def _job_env(cluster, **extra: str) -> dict[str, str]:
    """The environment for SLURM's client commands and the jobs they submit (sbatch exports it)."""
    return {**_clean_env(cluster.env), "SLURM_CONF": cluster.env["SLURM_CONF"], **extra}


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
    env = _job_env(cluster, TMPDIR=str(node_tmp))
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


def test_generated_sbatch_script_on_two_nodes_trains_like_one_node(reference, tmp_path):
    """Two SLURM nodes, each a test host of its own (tests/netns.py; slurmd in each, slurmctld on node 0):
    the script's srun starts `shardwise train` on both, each passes its SLURM_NODEID as --node-rank, node 0
    serves the rendezvous at its NodeAddr, and the job trains bitwise like `train --nproc 2` on one node.
    Then a job whose ranks all diverge ends with their code, 3: with srun's --kill-on-bad-exit the node that
    ended second was stopped (143), and srun, which exits with its tasks' highest code, said 143."""
    common, expected = reference
    commands = require_commands(["slurm-wlm", "munge"], ["munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo"])
    with netns.network(2) as net:
        try:
            cluster = slurm_cluster.start_on(net, commands)
        except RuntimeError as e:
            pytest.skip(f"a two-node SLURM cluster did not start in network namespaces: {e}")
        try:
            code, output = _submit(cluster, tmp_path / "trained", [*common, f"--run.dir={tmp_path / 'trained' / 'run'}"],
                                   nodes=2, procs_per_node=1)
            assert code == 0, output
            assert f"rendezvous {net.address(0)}:" in output and "node 1 of 2" in output, output  # node 1 joined node 0's
            _compare("two nodes", expected, _losses(tmp_path / "trained" / "run"))
            code, output = _submit(cluster, tmp_path / "diverged", [*common, "--train.lr=1e6", "--train.steps=30",
                                                                    f"--run.dir={tmp_path / 'diverged' / 'run'}"],
                                   nodes=2, procs_per_node=1)
            assert code == 3, output
            assert [line[:24] for line in _shardwise_lines(output)] == ["error: training diverged"], output
        finally:
            cluster.stop()


def test_srun_starts_workers_directly(cluster, reference, tmp_path):
    common, expected = reference
    env = _job_env(cluster)
    done = subprocess.run(["srun", "--kill-on-bad-exit=1", "-N", "1", "-n", "2", sys.executable, "-m", "shardwise.train",
                           *common, f"--run.dir={tmp_path / 'srun'}"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=JOB_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + cluster.log_tail()
    for rank in (0, 1):  # each rank says where its launcher put it: a one-node job meets on loopback
        assert f"rank {rank}/2 local {rank}/2 from slurm: cpu, rendezvous 127.0.0.1:" in done.stdout, done.stdout
    _compare("srun", expected, _losses(tmp_path / "srun"))


def _submit(cluster, tmp_path: Path, args: list[str], *, nodes: int = 1, procs_per_node: int = 2, wait: bool = True):
    """`shardwise launch slurm --nodes N --procs-per-node P --out job.sbatch` with `args`, submitted with sbatch
    --wait where the controller is; with wait, returns (exit code, the job's output) and fails the test, saying
    why, when the job does not end; without, the sbatch --wait process (its code: the job's)."""
    env = _job_env(cluster)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "run.toml").write_text("")  # every setting is an override: the script passes them through
    cmd = [sys.executable, "-m", "shardwise.cli", "launch", "slurm", "--config", "run.toml", "--nodes", str(nodes),
           "--procs-per-node", str(procs_per_node), "--python", sys.executable, "--out", "job.sbatch", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    job = subprocess.Popen([*cluster.client, "sbatch", "--wait", "job.sbatch"], cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not wait:
        return job
    try:
        job.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        jobs = cluster.run(["scontrol", "show", "job"], env=env, capture_output=True, text=True, timeout=30)
        pytest.fail(f"the job did not end in {JOB_TIMEOUT_S} s:\n{jobs.stdout}\n{_job_output(tmp_path)}\n{cluster.log_tail(40)}")
    return job.returncode, _job_output(tmp_path)


def _job_output(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("shardwise-*.out")))


def _shardwise_lines(output: str) -> list[str]:
    """The job's error and stop lines, without srun's own ("srun: ...")."""
    return [line for line in output.splitlines() if line.startswith(("error:", "interrupted"))]


def test_a_failed_job_ends_in_one_line_with_its_own_exit_code(cluster, base_overrides, tmp_path):
    """Before, the script ran plain torchrun: a missing data file was printed by rank 0, rank 1 waited 30 s
    for rank 0's data until torchrun killed it, and the job ended with exit code 1 after 50 lines (torchrun's
    traceback and ChildFailedError table); a divergence ended with exit 1 after 57 lines. Now each is
    shardwise's one line and exit code (2 before any worker started; 3), the job's exit code for sbatch --wait."""
    common = [f"--{k}={v}" for k, v in base_overrides if k not in ("train.steps", "train.micro_batch")] + LAYOUT
    code, output = _submit(cluster, tmp_path / "missing", [*common, f"--data.path={tmp_path / 'nope.txt'}",
                                                           f"--run.dir={tmp_path / 'missing' / 'run'}"])
    assert code == 2, output
    assert _shardwise_lines(output) == [f"error: data.path: '{tmp_path / 'nope.txt'}' does not exist"], output
    assert "Traceback" not in output and "ChildFailedError" not in output and "model:" not in output, output
    code, output = _submit(cluster, tmp_path / "diverged", [*common, "--train.lr=1e6", "--train.steps=30",
                                                            f"--run.dir={tmp_path / 'diverged' / 'run'}"])
    assert code == 3, output
    lines = _shardwise_lines(output)
    assert len(lines) == 1 and lines[0].startswith("error: training diverged"), output
    assert "Traceback" not in output and "ChildFailedError" not in output, output


def test_the_time_limit_signal_checkpoints_and_the_resubmitted_script_resumes(cluster, base_overrides, tmp_path):
    """What `#SBATCH --signal=USR1@120` sends before the time limit, sent now (scancel --signal=USR1): the job
    checkpoints the step it is on and exits 143 with one line; submitting the same script again (as its
    comment says) resumes from that step and trains to the end, every step once."""
    steps = 150
    common = [f"--{k}={v}" for k, v in base_overrides if k not in ("train.steps", "train.micro_batch", "checkpoint.resume")]
    args = [*common, *LAYOUT[:3], f"--train.steps={steps}", "--train.log_every=1", "--checkpoint.every=1000",
            f"--run.dir={tmp_path / 'run'}"]
    job = _submit(cluster, tmp_path, args, wait=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
        assert job.poll() is None and time.monotonic() < deadline, _job_output(tmp_path)
        time.sleep(0.2)
    job_id = cluster.run(["squeue", "-h", "-o", "%i"], env=_job_env(cluster), capture_output=True, text=True, timeout=30).stdout.split()
    assert len(job_id) == 1, job_id
    cluster.run(["scancel", "--signal=USR1", job_id[0]], env=_job_env(cluster), check=True, timeout=30)
    job.communicate(timeout=JOB_TIMEOUT_S)
    output = _job_output(tmp_path)
    assert job.returncode == 143, output
    lines = _shardwise_lines(output)
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGUSR1 after step "), output
    stopped_at = int(lines[0].split("after step ")[1].split(":")[0])
    assert 5 <= stopped_at < steps, lines
    assert (tmp_path / "run" / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").is_file()
    for out in tmp_path.glob("shardwise-*.out"):
        out.rename(out.with_suffix(".first"))
    resubmitted = cluster.run(["sbatch", "--wait", "job.sbatch"], env=_job_env(cluster), cwd=tmp_path, capture_output=True,
                              text=True, timeout=JOB_TIMEOUT_S)
    output = _job_output(tmp_path)
    assert resubmitted.returncode == 0, output
    assert f"at step {stopped_at}" in output and not _shardwise_lines(output), output
    logged = [r["step"] for r in map(json.loads, metrics.read_text().splitlines())]
    assert sorted(set(logged)) == list(range(1, steps + 1)) and logged[-1] == steps
