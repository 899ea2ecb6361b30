"""`shardwise launch mpirun | slurm` (launch/schedulers.py): the printed mpirun command, the sbatch
script against its golden file, and bad input as ConfigError (exit 2) through the real CLI."""
from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from shardwise.cli import main as cli_main
from shardwise.errors import ConfigError
from shardwise.launch.schedulers import Host, main, mpirun_command, parse_hosts, sbatch_script

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "two_nodes.sbatch"
# A layout that fits 16 ranks: ZeRO-3 over every rank, one sequence per rank per step.
RUN_TOML = '[model]\npreset = "tiny"\n\n[train]\nglobal_batch = 64\nmicro_batch = 4\n\n[parallel]\ndp_shard = -1\nzero = 3\n'


@pytest.fixture()
def in_run_dir(tmp_path, monkeypatch) -> Path:
    (tmp_path / "run.toml").write_text(RUN_TOML)
    monkeypatch.chdir(tmp_path)
    for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "UCX_NET_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_printed_mpirun_command_for_two_hosts_of_eight(in_run_dir, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["mpirun", "--config", "run.toml", "--hosts", "a:8,b:8", "--python", "python",
                 "--export", "NCCL_SOCKET_IFNAME=eth0", "--train.steps=5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[-2] == "export MASTER_ADDR=a MASTER_PORT=29500"
    assert shlex.split(lines[-1]) == ["mpirun", "-np", "16", "-H", "a:8,b:8", "--map-by", "slot", "--bind-to", "none",
                                      "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "NCCL_SOCKET_IFNAME=eth0",
                                      "-x", "NCCL_DEBUG", "python", "-m", "shardwise.train", "--config", "run.toml",
                                      "--train.steps=5"]
    comments = [line for line in lines if line.startswith("#")]
    # A comment per export says why; only what is set or given is exported.
    assert any(c.startswith("# -x NCCL_SOCKET_IFNAME:") and "given: eth0" in c for c in comments)
    assert any(c.startswith("# -x NCCL_DEBUG:") and "set in this environment: INFO" in c for c in comments)
    assert "NCCL_IB_HCA" not in out and "UCX_NET_DEVICES" not in out


def test_mpirun_command_takes_master_addr_from_the_environment():
    text = mpirun_command("run.toml", [], [Host("a", 2)], {"MASTER_ADDR": "198.51.100.1", "MASTER_PORT": "12345",
                                                          "UCX_NET_DEVICES": "mlx5_0:1"}, {}, "python")
    assert "export MASTER_ADDR=198.51.100.1 MASTER_PORT=12345" in text and "-x UCX_NET_DEVICES " in text


@pytest.mark.parametrize("hosts", ["a:8,b", "a:0", ":8", "a:8,a:8", "a:x"])
def test_bad_hosts_are_refused(hosts):
    with pytest.raises(ConfigError) as e:
        parse_hosts(hosts)
    assert e.value.field == "--hosts" and e.value.fix


@pytest.mark.parametrize("args, field", [
    (["mpirun", "--config", "run.toml"], "--hosts"),
    (["mpirun", "--hosts", "a:8,b:8"], "--config"),
    (["mpirun", "--config", "missing.toml", "--hosts", "a:8"], "--config"),
    (["mpirun", "--config", "run.toml", "--hosts", "a:8,b:8", "--gpus-per-node", "4"], "--hosts"),
    (["mpirun", "--config", "run.toml", "--hosts", "a:8", "--export", "NCCL_DEBUG"], "--export"),
    (["mpirun", "--config", "run.toml", "--hosts", "a:3"], "train.global_batch"),  # 64 is not split over 3 ranks
    (["slurm", "--config", "run.toml", "--nodes", "0", "--gpus-per-node", "8"], "--nodes"),
    (["slurm", "--config", "run.toml", "--nodes", "2"], "--gpus-per-node"),
    (["slurm", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "8", "--procs-per-node", "2"],
     "--procs-per-node"),
    (["slurm", "--config", "run.toml", "--nodes", "2", "--procs-per-node", "0"], "--procs-per-node"),
    (["slurm", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "8", "--wait"], "--wait"),
    (["slurm", "--config", "run.toml", "--nodes", "1", "--procs-per-node", "3"], "train.global_batch"),
    (["slurm", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "8", "--time", "4 hours"], "--time"),
    (["qsub"], "launch"),
])
def test_bad_input_is_a_config_error(in_run_dir, args, field):
    with pytest.raises(ConfigError) as e:
        main(args)
    assert e.value.field == field and e.value.problem and e.value.fix


def test_bad_input_exits_2_through_the_cli(in_run_dir, capsys):
    assert cli_main(["launch", "mpirun", "--config", "run.toml", "--hosts", "a:8,b"]) == 2
    err = capsys.readouterr().err
    assert "--hosts" in err and "fix:" in err and "Traceback" not in err
    assert cli_main(["launch", "mpirun", "--config", "run.toml", "--hosts", "a:8,b:8"]) == 0


def test_sbatch_script_matches_the_golden_file(in_run_dir, capsys):
    """Regenerate after an intended change: the same arguments with --out tests/fixtures/slurm/two_nodes.sbatch."""
    assert main(["slurm", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                 "--time", "04:00:00", "--account", "proj", "--python", "python3", "--out", "job.sbatch",
                 "--train.steps=1000"]) == 0
    assert capsys.readouterr().out == "wrote job.sbatch\n"
    script = (in_run_dir / "job.sbatch").read_text()
    assert script == GOLDEN.read_text()
    assert "#SBATCH --signal=USR1@120" in script and "torch.distributed.run" not in script


def _task_argv(script: str, env: dict[str, str], tmp_path: Path) -> list[str]:
    """The argv one node's task runs: the script's srun line with bash, srun and python replaced by a
    stand-in that prints its arguments (srun runs its command as given; the task's shell expands it)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text('#!/bin/bash\nprintf \'%s\\0\' "$@"\n')
    (fake / "python3").chmod(0o755)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    argv = shlex.split(srun)[1:]  # after `srun`
    done = subprocess.run(argv, env={**env, "PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1]


def test_each_node_passes_its_own_rank_and_the_first_nodes_endpoint(in_run_dir, tmp_path):
    """The generated srun line, run as node 1's task would run it: shardwise train (not plain torchrun: its
    one-line failures and exit codes), SLURM_NODEID as --node-rank, and overrides that survive quoting."""
    overrides = ["--train.steps=1000", "--run.dir=runs/it's a \"run\" $HOME"]
    script = sbatch_script("run.toml", overrides, nodes=2, gpus_per_node=8, python="python3")
    env = {"SLURM_NODEID": "1", "MASTER_ADDR": "198.51.100.7", "MASTER_PORT": "12345", "SLURM_JOB_ID": "77"}
    assert _task_argv(script, env, tmp_path) == [
        "-m", "shardwise.cli", "train", "--config", "run.toml", "--nproc", "8", "--nnodes", "2", "--node-rank", "1",
        "--rdzv-endpoint", "198.51.100.7:12345", "--rdzv-id", "slurm-77", *overrides]
    assert "export MASTER_ADDR MASTER_PORT" in script  # srun's tasks inherit only what is exported
    one = sbatch_script("run.toml", overrides, nodes=1, gpus_per_node=0, python="python3", procs_per_node=2)
    assert _task_argv(one, {}, tmp_path) == ["-m", "shardwise.cli", "train", "--config", "run.toml", "--nproc", "2",
                                             *overrides]


def test_submit_without_sbatch_is_refused(in_run_dir, monkeypatch):
    monkeypatch.setenv("PATH", str(in_run_dir))  # no sbatch here
    with pytest.raises(ConfigError) as e:
        main(["slurm", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "8", "--python", "python3", "--submit"])
    assert e.value.field == "--submit" and (in_run_dir / "shardwise.sbatch").is_file()


def test_a_layout_that_does_not_fit_names_launchs_own_options(capsys):
    """launch takes no --nproc: the fix names what sets the process count there."""
    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")
    assert cli_main(["launch", "mpirun", "--config", demo, "--hosts", "a:8,b:8"]) == 2
    err = capsys.readouterr().err
    assert "(the slots of --hosts: 16)" in err and "--nproc" not in err, err
    assert cli_main(["launch", "slurm", "--config", demo, "--nodes", "2", "--gpus-per-node", "8", "--out", "x.sbatch"]) == 2
    err = capsys.readouterr().err
    assert "(--nodes x --gpus-per-node: 16)" in err and "--nproc" not in err, err
