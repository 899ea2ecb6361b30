"""A real one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd from Debian's
packages, with every file (key, config, state, spool, logs, sockets) in one temporary directory.

Nothing of the machine's own SLURM or munge setup is read or changed: the daemons get their paths on
the command line and in the slurm.conf written here, and the client commands find that file through
SLURM_CONF (SLURM's own variable) in the environment this returns. Ports are picked free at start.
The daemons run as the current user (root: SLURM's daemons need it to start jobs as other users;
here every job is ours) and are stopped, and waited for, by stop().
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.harness import free_port, stop_processes

# Seconds for the daemons to come up and the node to register as idle (about 3 s on the 2-core CI machine).
START_TIMEOUT_S = 60


def _slurm_conf(root: Path, host: str, cpus: int, munge_socket: Path) -> str:
    ctld, slurmd = free_port(), free_port()
    return "\n".join([
        "ClusterName=shardwise-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
        "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        # No cgroups (a container may not delegate them): processes tracked by parent pid, no binding.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


@dataclass
class LocalSlurm:
    root: Path
    env: dict[str, str]  # os.environ plus SLURM_CONF: pass to sbatch / srun / sinfo
    munged: str

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.is_file():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged, and wait until their processes are gone."""
        pids = []
        for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            path = self.root / name
            if path.is_file() and path.read_text().strip().isdigit():
                pids.append(int(path.read_text().strip()))
        stop_processes(stop_processes(pids, signal.SIGTERM, 30), signal.SIGKILL, 10)


def start(root: Path, commands: dict[str, str]) -> LocalSlurm:
    """Start munged, slurmctld and slurmd under `root`; return when the node is idle. Raises
    RuntimeError with the daemons' logs if they do not come up (after stopping what started)."""
    root.chmod(0o755)  # munged refuses a socket directory others cannot traverse
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "munge.socket"
    host = "localhost"  # the node and its controller are named for loopback: jobs rendezvous there (tests talk only to loopback)
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, os.cpu_count() or 1, munge_socket))
    cluster = LocalSlurm(root, {**os.environ, "SLURM_CONF": str(conf)}, commands["munged"])
    steps = [[commands["munged"], f"--socket={munge_socket}", f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
              f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munge.seed'}", "--force"],
             [commands["slurmctld"], "-f", str(conf)],
             [commands["slurmd"], "-f", str(conf), "-N", host]]
    try:
        for cmd in steps:  # each daemonizes and returns once it is listening
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=cluster.env)
            if done.returncode != 0:
                raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr.strip()}")
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            state = subprocess.run([commands["sinfo"], "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                   env=cluster.env, timeout=30).stdout.strip()
            if state == "idle":
                return cluster
            time.sleep(0.5)
        raise RuntimeError(f"the node did not become idle in {START_TIMEOUT_S} s (state {state!r})")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        logs = cluster.log_tail()
        cluster.stop()
        raise RuntimeError(f"{e}\n{logs}") from e
