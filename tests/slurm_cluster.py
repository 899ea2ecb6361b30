"""Real SLURM clusters for the tests, from Debian's packages (munged, slurmctld, slurmd), with every file
(key, config, state, spool, logs, sockets) in one temporary directory:

    start(commands)             one node on localhost
    start_on(net, commands)     one node per network namespace of a tests/netns.py Network

Nothing of the machine's own SLURM or munge setup is read or changed: the daemons get their paths on
the command line and in the slurm.conf written here, and the client commands find that file through
SLURM_CONF (SLURM's own variable) in the environment this returns. The daemons run as the current user
(root: SLURM's daemons need it to start jobs as other users; here every job is ours) and are stopped,
and waited for, by stop(), which removes the directory.

The directory is a short one of its own in /tmp, not the test's tmp_path: slurmstepd makes a Unix socket
per job step in the spool directory, and a socket path is at most 107 bytes. Under pytest-xdist
(.../popen-gw0/test_...) the batch step's was 110: slurmstepd died ("Unix socket path ... is too long") and
the job was requeued, again and again, until the test's timeout.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import free_port, stop_processes

# Seconds for the daemons to come up and the nodes to register as idle (about 3 s on the 2-core CI machine).
START_TIMEOUT_S = 60
# SLURM's default ports: free in namespaces made for the test (free_port() probes the machine's loopback).
NAMESPACE_PORTS = (6817, 6818)


def _slurm_conf(root: Path, controller: str, nodes: list[tuple[str, str]], cpus: int, munge_socket: Path,
                ports: tuple[int, int]) -> str:
    """`controller`: SlurmctldHost's value; `nodes`: (NodeName, NodeAddr). The slurmd files carry the node
    name (%n) so that several slurmd share the directory."""
    return "\n".join([
        "ClusterName=shardwise-test",
        f"SlurmctldHost={controller}",
        "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}",
        "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}", "CredType=cred/munge",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        # No cgroups (a container may not delegate them): processes tracked by parent pid, no binding.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "MailProg=/bin/true",
        # sbatch --wait polls every 2 s only while that stays under MinJobAge / 2 (then 8 s, 10 s...): a job
        # that ended was noticed up to 30 s late with the default (300 s).
        "MinJobAge=4",
        *[f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr in nodes],
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


@dataclass
class LocalSlurm:
    root: Path
    env: dict[str, str]  # os.environ plus SLURM_CONF: pass to sbatch / srun / sinfo
    munged: str
    client: list[str] = field(default_factory=list)  # the prefix that runs a client command where the controller is

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """A client command (sbatch, srun, scontrol...) where it reaches the controller, with SLURM_CONF set."""
        return subprocess.run([*self.client, *argv], env=kwargs.pop("env", self.env), **kwargs)

    def log_tail(self, lines: int = 20) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop the slurmds, slurmctld and munged, in that order, wait until their processes are gone, and
        remove the cluster's directory."""
        for group in (sorted(self.root.glob("slurmd-*.pid")), [self.root / "slurmctld.pid"], [self.root / "munged.pid"]):
            pids = [int(p.read_text().strip()) for p in group if p.is_file() and p.read_text().strip().isdigit()]
            stop_processes(stop_processes(pids, signal.SIGTERM, 30), signal.SIGKILL, 10)
        shutil.rmtree(self.root, ignore_errors=True)


def _start(commands: dict[str, str], controller: str, nodes: list[tuple[str, str]], ports: tuple[int, int],
           where: list[list[str]]) -> LocalSlurm:
    """Start munged and slurmctld (with where[0]'s prefix) and node k's slurmd (where[k]); return when
    every node is idle. Raises RuntimeError with the daemons' logs if they do not come up."""
    root = Path(tempfile.mkdtemp(prefix="swslurm-", dir="/tmp"))
    root.chmod(0o755)  # munged refuses a socket directory others cannot traverse
    for sub in ("state", *[f"spool-{name}" for name, _ in nodes]):  # slurmd does not make its spool directory
        (root / sub).mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "munge.socket"  # one munged: every namespace shares the file system
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, controller, nodes, os.cpu_count() or 1, munge_socket, ports))
    cluster = LocalSlurm(root, {**os.environ, "SLURM_CONF": str(conf)}, commands["munged"], where[0])
    steps = [(0, [commands["munged"], f"--socket={munge_socket}", f"--key-file={key}", f"--pid-file={root / 'munged.pid'}",
                  f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munge.seed'}", "--force"]),
             (0, [commands["slurmctld"], "-f", str(conf)]),
             *[(k, [commands["slurmd"], "-f", str(conf), "-N", name]) for k, (name, _) in enumerate(nodes)]]
    try:
        for k, cmd in steps:  # each daemonizes and returns once it is listening
            done = subprocess.run([*where[k], *cmd], capture_output=True, text=True, timeout=60, env=cluster.env)
            if done.returncode != 0:
                raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr.strip()}")
        deadline = time.monotonic() + START_TIMEOUT_S
        states: list[str] = []
        while time.monotonic() < deadline:
            states = cluster.run([commands["sinfo"], "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
            if states == ["idle"] * len(nodes):
                return cluster
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not become idle in {START_TIMEOUT_S} s (states {states})")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        logs = cluster.log_tail()
        cluster.stop()
        raise RuntimeError(f"{e}\n{logs}") from e


def start(commands: dict[str, str]) -> LocalSlurm:
    """One node on localhost, at free ports: jobs rendezvous on loopback (tests talk only to loopback)."""
    host = "localhost"
    return _start(commands, f"{host}(127.0.0.1)", [(host, "127.0.0.1")], (free_port(), free_port()), [[]])


def start_on(net, commands: dict[str, str]) -> LocalSlurm:
    """Node k (NodeName nodeK) in namespace net.nodes[k] at its address, the controller in node 0's.

    The daemons enter only the node's network namespace (nsenter --net): `ip netns exec` also mounts a
    /sys of its own, which hides /sys/fs/cgroup, and slurmd then refuses to start. No node name resolves:
    SLURM reaches every daemon by its NodeAddr, and slurmctld accepts "localhost" as its own name (it
    checks SlurmctldHost against the host name, which every namespace shares)."""
    where = [["nsenter", f"--net=/run/netns/{ns}"] for ns in net.nodes]
    nodes = [(f"node{k}", net.address(k)) for k in range(len(net.nodes))]
    return _start(commands, f"localhost({net.address(0)})", nodes, NAMESPACE_PORTS, where)
