"""`shardwise launch mpirun | slurm | k8s`: the command, batch script or manifest that starts a multi-node run.

Nothing here starts a worker (except `slurm --submit`, which hands the script to sbatch): it writes
what a user runs on a cluster, checked like `shardwise train` checks its input (a ConfigError, exit 2,
before anything is started). mpirun starts the workers, `python -m shardwise.train`, directly (they find their
rank in its variables: train/distributed.py rank_env); the sbatch script's srun starts one `shardwise train`
per node, the launcher a user runs by hand, with its checks, one-line failures and exit codes.

    shardwise launch mpirun --config run.toml --hosts a:8,b:8 [--gpus-per-node G] [--export NAME=VALUE ...]
                            [--python PATH] [--section.key=value ...]
    shardwise launch slurm  --config run.toml --nodes N (--gpus-per-node G | --procs-per-node P)
                            [--partition P --time T --account A] [--job-name NAME] [--python PATH]
                            [--out job.sbatch] [--submit [--wait]] [--section.key=value ...]
    shardwise launch k8s    --config run.toml --nodes N (or MIN:MAX) --gpus-per-node G --image IMAGE
                            [--kind trainjob|jobset|pytorchjob] [--pvc CLAIM] [--queue Q] [--name NAME] [--out job.yaml]
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.paths import writable_file
from shardwise.preflight import check

# The network variables a multi-node job commonly needs on every rank, and why (printed as comments).
# Exported only when set in this environment or given with --export: mpirun copies nothing by itself.
NETWORK_EXPORTS = (
    ("NCCL_IB_HCA", "the InfiniBand adapters NCCL uses (e.g. mlx5_0,mlx5_1); a wrong one falls back to sockets"),
    ("NCCL_SOCKET_IFNAME", "the interface NCCL's bootstrap and socket transport use (e.g. eth0, ib0); "
                           "a wrong guess hangs the first collective"),
    ("NCCL_DEBUG", "NCCL's log level (INFO names the transport each ring uses)"),
    ("UCX_NET_DEVICES", "the devices Open MPI's UCX layer uses (e.g. mlx5_0:1); the same fabric as NCCL"),
)
# What SLURM sends ahead of the time limit, and how long ahead: the workers checkpoint on SIGUSR1
# (train/signals.py) and a checkpoint of a large model needs time to write.
TIME_LIMIT_SIGNAL = "USR1@120"
DEFAULT_PORT = 29500
USAGE = __doc__.split("\n\n")[-1].rstrip()


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def parse_hosts(text: str) -> list[Host]:
    """`a:8,b:8` -> [Host("a", 8), Host("b", 8)]; raises ConfigError."""
    hosts: list[Host] = []
    for item in text.split(","):
        name, sep, slots = item.strip().rpartition(":")
        if not sep or not name or not slots.isdigit() or int(slots) < 1 or re.search(r"\s", name):
            raise ConfigError("--hosts", f"{item.strip()!r} is not HOST:SLOTS with SLOTS >= 1",
                              "list every host with its ranks, e.g. --hosts node1:8,node2:8")
        if any(h.name == name for h in hosts):
            raise ConfigError("--hosts", f"host {name!r} is listed twice", "list each host once with all its slots")
        hosts.append(Host(name, int(slots)))
    return hosts


def parse_exports(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError("--export", f"{item!r} is not NAME=VALUE", "e.g. --export NCCL_SOCKET_IFNAME=eth0")
        out[name] = value
    return out


def _checked_config(config: str | None, overrides: list[str], world_size: int, processes_from: str) -> None:
    """The run must load and its layout fit the world size, as `shardwise train` checks before spawning.
    `processes_from`: the options that set the process count here (launch takes no --nproc)."""
    if not config:
        raise ConfigError("--config", "no config file given", "pass --config run.toml (the file every rank reads)")
    if not Path(config).is_file():
        raise ConfigError("--config", f"{config} does not exist", "give the path of the run's TOML file")
    try:
        check(load_config(config, overrides), world_size)
    except ConfigError as e:
        raise ConfigError(e.field, e.problem, e.fix.replace("(--nproc)", f"({processes_from}: {world_size})")) from None


def mpirun_command(config: str, overrides: list[str], hosts: list[Host], env: Mapping[str, str],
                   exports: Mapping[str, str], python: str, gpus_per_node: int | None = None) -> str:
    """The commented shell lines that start the run with Open MPI's mpirun (rank 0 on the first slot of
    the first host, where it hosts the rendezvous)."""
    if gpus_per_node is not None:
        crowded = [h for h in hosts if h.slots > gpus_per_node]
        if crowded:  # two ranks on one GPU: refused here, before anything starts (train/distributed.py cuda_index)
            raise ConfigError("--hosts", f"{crowded[0].name} gets {crowded[0].slots} ranks but has {gpus_per_node} GPUs",
                              f"give each host at most {gpus_per_node} slots (--hosts {crowded[0].name}:{gpus_per_node},...)")
    world = sum(h.slots for h in hosts)
    spec = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    addr = env.get("MASTER_ADDR") or hosts[0].name
    port = env.get("MASTER_PORT") or str(DEFAULT_PORT)
    lines = [f"# {world} ranks on {len(hosts)} host(s) ({spec}): -np is the sum of the slots",
             "# --map-by slot: each host's slots in order, so rank 0 runs on the first host, the rendezvous host",
             "# --bind-to none: a rank runs several threads (intra-op, data loading); binding would pin them to one core",
             f"# -x MASTER_ADDR -x MASTER_PORT: rank 0 listens there for the rendezvous ({addr}:{port}"
             f"{', from this environment' if env.get('MASTER_ADDR') else ', the first host'})"]
    args = ["mpirun", "-np", str(world), "-H", spec, "--map-by", "slot", "--bind-to", "none",
            "-x", "MASTER_ADDR", "-x", "MASTER_PORT"]
    why = dict(NETWORK_EXPORTS)
    names = [n for n, _ in NETWORK_EXPORTS if n in exports or n in env] + sorted(set(exports) - set(why))
    for name in names:
        given = name in exports
        value = exports[name] if given else env[name]
        lines.append(f"# -x {name}: {why.get(name, 'given with --export')} "
                     f"({'given' if given else 'set in this environment'}: {value})")
        args += ["-x", f"{name}={value}" if given else name]
    args += [python, "-m", "shardwise.train", "--config", config, *overrides]
    export = f"export MASTER_ADDR={shlex.quote(addr)} MASTER_PORT={shlex.quote(port)}"
    return "\n".join([*lines, export, shlex.join(args)]) + "\n"


def sbatch_script(config: str, overrides: list[str], nodes: int, gpus_per_node: int, python: str,
                  partition: str | None = None, time: str | None = None, account: str | None = None,
                  job_name: str = "shardwise", procs_per_node: int | None = None) -> str:
    """A commented sbatch script: one `shardwise train` per node (srun), c10d rendezvous on the first node.

    `shardwise train`, not plain torchrun, is each node's agent: it checks the config, data and disks
    before any worker starts and ends a failure in one line with its own exit code (errors.py), where
    torchrun printed its traceback and ChildFailedError table and exited 1 whatever the cause.
    procs_per_node (instead of gpus_per_node, which is then 0): CPU-only nodes, that many gloo ranks on
    each and no GPU requested (a cluster without GPU GRES rejects any --gpus-per-node)."""
    per_node = procs_per_node or gpus_per_node
    world = nodes * per_node
    what = f"{procs_per_node} CPU rank(s)" if procs_per_node else f"{gpus_per_node} GPU(s)"
    optional = [("partition", partition, "the partition (queue) to run in"), ("time", time, "the time limit"),
                ("account", account, "the account charged")]
    head = ["#!/bin/bash",
            f"# Generated by `shardwise launch slurm`: {nodes} node(s) x {what} = {world} ranks.",
            f"#SBATCH --job-name={job_name}",
            f"#SBATCH --nodes={nodes}",
            "# One task per node: `shardwise train`, which starts that node's workers (one per GPU).",
            "#SBATCH --ntasks-per-node=1"]
    if procs_per_node:
        head += ["# CPU-only nodes: no GPU requested; the agent's task gets a CPU per worker.",
                 f"#SBATCH --cpus-per-task={procs_per_node}"]
    else:
        head += [f"#SBATCH --gpus-per-node={gpus_per_node}"]
    for key, value, why in optional:
        if value:
            head += [f"# {why}", f"#SBATCH --{key}={value}"]
    head += ["# SIGUSR1 120 s before the time limit: the workers finish the step, write a checkpoint and exit 143;",
             "# submit the script again to resume from it (checkpoint.resume = true).",
             f"#SBATCH --signal={TIME_LIMIT_SIGNAL}",
             "#SBATCH --output=%x-%j.out",
             "",
             "set -euo pipefail",
             *(["# srun does not inherit --cpus-per-task from sbatch (SLURM >= 22.05): give the agent's step every CPU.",
                'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"', ""] if procs_per_node else [])]
    train = [python, "-m", "shardwise.cli", "train", "--config", config, "--nproc", str(per_node)]
    why_srun = ["# srun runs the step (SLURM signals job steps, not this script). The job's exit code is shardwise's",
                "# (docs/run-safety.md: 2 bad input, 3 diverged, 4 I/O, 5 stalled, 6 too few nodes, 143 stopped)."]
    if nodes == 1:
        return "\n".join(head + why_srun + ["srun " + shlex.join([*train, *overrides]), ""])
    why_srun += ["# No --kill-on-bad-exit: srun exits with the highest code of its tasks, and the nodes it would stop",
                 "# after the first failure would exit 143 (stopped), hiding the failure's own code. Each node ends",
                 "# by itself: a lost peer within seconds, a stalled collective after run.collective_timeout_s, a",
                 "# node that never joins after run.rendezvous_timeout_s."]
    # The node's rank and the endpoint differ per node: expanded by each task's own shell, not by this script.
    per_task = shlex.join(["exec", *train, "--nnodes", str(nodes)]) + \
        ' --node-rank "$SLURM_NODEID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "slurm-$SLURM_JOB_ID"' + \
        ("" if not overrides else " " + shlex.join(overrides))
    body = ["# The rendezvous: node 0 of the allocation (SLURM_NODEID 0, the first host of the node list) serves it,",
            "# at the address slurmctld reaches that node by (NodeAddr: a host name that resolves to a loopback",
            "# address is refused, since the other nodes would dial themselves), on a port derived from the job id",
            "# (below Linux's ephemeral ports, so no outgoing connection holds it).",
            'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "MASTER_ADDR=$(scontrol -o show node \"$FIRST_NODE\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            "MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
            "export MASTER_ADDR MASTER_PORT",
            "",
            *why_srun,
            "# Each node's task passes its own rank in the allocation (SLURM_NODEID) as --node-rank.",
            "srun bash -c " + shlex.quote(per_task), ""]
    return "\n".join(head + body)


def _check_slurm_value(field: str, value: str | None, pattern: str, example: str) -> None:
    if value is not None and not re.fullmatch(pattern, value):
        raise ConfigError(field, f"{value!r} is not a valid value", f"e.g. {field} {example}")


def _mpirun(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise launch mpirun")
    parser.add_argument("--config", default=None)
    parser.add_argument("--hosts", default=None, help="HOST:SLOTS,HOST:SLOTS (ranks per host)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="refuse hosts with more slots than GPUs")
    parser.add_argument("--export", action="append", default=[], help="NAME=VALUE to pass to every rank (-x)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter on every host (a shared venv)")
    args, overrides = parser.parse_known_args(argv)
    if not args.hosts:
        raise ConfigError("--hosts", "no hosts given", "list the hosts and ranks per host, e.g. --hosts node1:8,node2:8")
    hosts = parse_hosts(args.hosts)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"must be >= 1, got {args.gpus_per_node}", "e.g. --gpus-per-node 8")
    exports = parse_exports(args.export)
    _checked_config(args.config, overrides, sum(h.slots for h in hosts), "the slots of --hosts")
    print(mpirun_command(args.config, overrides, hosts, os.environ, exports, args.python, args.gpus_per_node), end="")
    return 0


def _slurm(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise launch slurm")
    parser.add_argument("--config", default=None)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node: one rank per GPU")
    parser.add_argument("--procs-per-node", type=int, default=None,
                        help="CPU-only nodes: this many gloo ranks per node and no GPU requested")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default=None, help="SLURM time limit, e.g. 04:00:00 or 1-00:00:00")
    parser.add_argument("--account", default=None)
    parser.add_argument("--job-name", default="shardwise")
    parser.add_argument("--python", default=sys.executable, help="the interpreter on every node (a shared venv)")
    parser.add_argument("--out", default=None, help="write the script here (default: print it)")
    parser.add_argument("--submit", action="store_true", help="submit it with sbatch (written to --out or shardwise.sbatch)")
    parser.add_argument("--wait", action="store_true", help="with --submit: return when the job ends, with its exit code")
    args, overrides = parser.parse_known_args(argv)
    if args.gpus_per_node is not None and args.procs_per_node is not None:
        raise ConfigError("--procs-per-node", "given together with --gpus-per-node",
                          "use --gpus-per-node G on GPU nodes, or --procs-per-node P on CPU-only nodes")
    per_node = ("--procs-per-node", args.procs_per_node) if args.procs_per_node is not None else \
        ("--gpus-per-node", args.gpus_per_node)
    for field, value, example in (("--nodes", args.nodes, "2"), (*per_node, "8")):
        if value is None or value < 1:
            raise ConfigError(field, f"must be >= 1, got {value}", f"e.g. {field} {example}")
    if args.wait and not args.submit:
        raise ConfigError("--wait", "given without --submit", "add --submit to submit the script and wait for it")
    _check_slurm_value("--time", args.time, r"(\d+-)?\d+(:\d+){0,2}", "04:00:00")
    for field, value in (("--partition", args.partition), ("--account", args.account), ("--job-name", args.job_name)):
        _check_slurm_value(field, value, r"[A-Za-z0-9_.,-]+", "gpu")
    _checked_config(args.config, overrides, args.nodes * per_node[1], f"--nodes x {per_node[0]}")
    script = sbatch_script(args.config, overrides, args.nodes, args.gpus_per_node or 0, args.python, args.partition,
                           args.time, args.account, args.job_name, args.procs_per_node)
    out = args.out or ("shardwise.sbatch" if args.submit else None)
    if out is None:
        print(script, end="")
        return 0
    writable_file(Path(out), "--out")
    Path(out).write_text(script)
    print(f"wrote {out}")
    if not args.submit:
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit", "sbatch is not on PATH", f"run this on a SLURM login node, or submit {out} there")
    # --wait: sbatch returns when the job ends, with the job's exit code (what a CI pipeline needs).
    return subprocess.run(["sbatch", *(["--wait"] if args.wait else []), out]).returncode


def main(argv: list[str]) -> int:
    """`shardwise launch mpirun | slurm | k8s ...` (cli.py dispatches here); returns the exit code."""
    from shardwise.launch import k8s  # launch/k8s.py: its own module (manifests, their checks)

    commands = {"mpirun": _mpirun, "slurm": _slurm, "k8s": k8s.main}
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in commands:
        raise ConfigError("launch", f"expected 'mpirun', 'slurm' or 'k8s', got {argv[0]!r}",
                          "run `shardwise launch mpirun --config run.toml --hosts a:8,b:8` or `shardwise launch slurm ...`")
    return commands[argv[0]](argv[1:])
