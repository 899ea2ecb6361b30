"""`shardwise launch k8s`: a Kubernetes manifest that forms the same job as `shardwise train` on N nodes.

    shardwise launch k8s --config run.toml --nodes N --gpus-per-node G --image IMAGE [--kind trainjob|jobset|pytorchjob]
                         [--pvc CLAIM] [--queue LOCAL_QUEUE] [--name NAME] [--out job.yaml] [--section.key=value ...]
    shardwise launch k8s --validate job.yaml

Each pod runs what a node of the torchrun path runs, one `shardwise train --nnodes N --node-rank K
--rdzv-endpoint HOST:PORT` per node (the sbatch script of `launch slurm` does the same), so a pod gets
the same checks before any worker starts, one-line failures and exit codes. What differs per kind is only
where the pod's rank and node 0's name come from (launch/k8s_kinds.py). `--nodes MIN:MAX` is an elastic
job, which only Kubeflow's v1 PyTorchJob has (its elasticPolicy); Trainer v2 dropped its own.

Every manifest written is read back and checked against the project's pinned copies of the published API
models, unknown fields refused, and against what the controllers' webhooks and CEL rules would refuse
(launch/k8s_check.py); `--validate` checks a file, e.g. one edited by hand. Bad input is exit 2 before
anything is written.
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path, PurePosixPath

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launch import k8s_check, k8s_kinds
from shardwise.launch.k8s_job import (
    CONFIG_MAP_MAX_BYTES,
    WORKDIR,
    Job,
    config_map_name,
    dns1035_problem,
    dns1123_subdomain_problem,
    longest_pod_name,
    shm_size,
)
from shardwise.launch.manifest_yaml import dump_documents, load_documents
from shardwise.paths import writable_file
from shardwise.preflight import check, check_elastic

KINDS = ("trainjob", "jobset", "pytorchjob")
USAGE = __doc__.split("\n\n")[1].rstrip()


def check_name(kind: str, name: str, nodes: int) -> None:
    """The job's name and the names its pods get from it (which the DNS must carry) are DNS-1035 labels."""
    problem = dns1035_problem(name)
    if problem is not None:
        raise ConfigError("--name", problem, "use lower-case letters, digits and '-', a letter first, e.g. --name llama-8b-run1")
    longest = longest_pod_name(kind, name, nodes)
    if len(longest) > 63:
        raise ConfigError("--name", f"the pods' names would be up to {len(longest)} characters ({longest}), more than the 63 "
                          "of a DNS label", f"use a name of at most {63 - (len(longest) - len(name))} characters")


def _nodes(text: str | None) -> tuple[int, int]:
    from shardwise.launch.rendezvous import parse_nnodes

    if text is None:
        raise ConfigError("--nodes", "not given", "pass the number of pods (one per node), e.g. --nodes 2")
    try:
        low, high = parse_nnodes(text)
    except ConfigError as e:
        raise ConfigError("--nodes", e.problem, e.fix.replace("--nnodes", "--nodes")) from None
    if low < 1:
        raise ConfigError("--nodes", f"must be >= 1, got {text}", "e.g. --nodes 2")
    return low, high


def _check_layout(cfg, min_nodes: int, nodes: int, gpus: int) -> int:
    """The layout fits the job at every node count it can have; returns the data-parallel size at the fewest."""
    p = cfg.parallel
    world = nodes * gpus
    if p.dp_shard != -1:
        fixed = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
        if fixed < world and min_nodes == nodes:
            fix = (f"pass --gpus-per-node {fixed // nodes}" if fixed % nodes == 0 else f"request {fixed} GPUs in all")
            raise ConfigError("--gpus-per-node", f"the config's layout uses {fixed} ranks (dp_replicate x dp_shard x cp x tp x "
                              f"pp), but --nodes {nodes} x --gpus-per-node {gpus} = {world} GPUs would be requested: "
                              f"{world - fixed} of them would sit idle, held by the job",
                              f"{fix}, or give the rest to an axis (--parallel.dp_shard=-1 takes every GPU)")
    try:
        if min_nodes < nodes:
            check_elastic(cfg, gpus, min_nodes, nodes)
        dims = check(cfg, gpus * min_nodes)
    except ConfigError as e:  # preflight's advice names --nproc, which this command does not take
        raise ConfigError("--nodes" if e.field == "--nnodes" else e.field, e.problem,
                          e.fix.replace("(--nproc)", f"(--nodes x --gpus-per-node: {world})").replace("--nnodes", "--nodes")) from None
    return dims.dp


def _check_paths(cfg, pvc: str | None) -> None:
    """With a shared volume, the run directory must be on it: every pod writes its ranks' checkpoint shards."""
    if not pvc:
        return
    for field, value in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if value and PurePosixPath(value).is_absolute() and not PurePosixPath(value).is_relative_to(WORKDIR):
            raise ConfigError(field, f"{value} is outside the volume the pods share ({WORKDIR}, --pvc {pvc}): each pod "
                              "would keep its ranks' checkpoint shards on its own disk, and no restart could resume",
                              f"use a relative path (it lands in {WORKDIR}) or one under {WORKDIR}")


def build_job(args, overrides: list[str]) -> Job:
    """Every argument checked, in the order a user would fix them (ConfigError, exit 2); nothing written."""
    if args.kind not in KINDS:
        raise ConfigError("--kind", f"{args.kind!r} is not one of {', '.join(KINDS)}",
                          "--kind trainjob (Kubeflow Trainer v2), jobset, or pytorchjob (Kubeflow v1, elastic)")
    if not args.image or re.search(r"\s", args.image):
        raise ConfigError("--image", "no container image given" if not args.image else f"{args.image!r} is not an image name",
                          "pass the image every pod runs, with shardwise installed, e.g. --image registry.example/shardwise:0.1")
    if args.gpus_per_node is None or args.gpus_per_node < 1:
        problem = "not given" if args.gpus_per_node is None else f"must be >= 1, got {args.gpus_per_node}"
        raise ConfigError("--gpus-per-node", problem, "e.g. --gpus-per-node 8 (one rank per GPU)")
    min_nodes, nodes = _nodes(args.nodes)
    if min_nodes < nodes and args.kind != "pytorchjob":
        what = "a TrainJob" if args.kind == "trainjob" else "a JobSet"
        raise ConfigError("--nodes", f"{args.nodes} asks for an elastic job, but {what} has no elastic policy (Kubeflow "
                          "Trainer v2 removed it; a JobSet restarts all its pods together)",
                          f"use --kind pytorchjob (Kubeflow v1's elasticPolicy), or a fixed --nodes {nodes}")
    check_name(args.kind, args.name, nodes)
    for field, value in (("--pvc", args.pvc), ("--queue", args.queue)):
        problem = dns1123_subdomain_problem(value) if value is not None else None
        if problem is not None:
            raise ConfigError(field, problem, f"give the name of the {'PersistentVolumeClaim' if field == '--pvc' else 'Kueue LocalQueue'} "
                              "as `kubectl get` lists it")
    if args.queue is not None and len(args.queue) > 63:  # it travels as a label value
        raise ConfigError("--queue", f"{args.queue!r} is longer than a label value's 63 characters", "use a shorter LocalQueue name")
    if not args.config:
        raise ConfigError("--config", "no config file given", "pass --config run.toml (it travels in the manifest, as a ConfigMap)")
    path = Path(args.config)
    if not path.is_file():
        raise ConfigError("--config", f"{args.config} does not exist", "give the path of the run's TOML file")
    raw = path.read_bytes()
    try:
        text = raw.decode()
    except UnicodeDecodeError as e:
        raise ConfigError("--config", f"{args.config} is not UTF-8 text ({e.reason} at byte {e.start})",
                          "save the config as UTF-8 (TOML files are)") from None
    if len(raw) > CONFIG_MAP_MAX_BYTES - 4096:  # the ConfigMap's other fields need a little room
        raise ConfigError("--config", f"{args.config} is {len(raw)} bytes; a ConfigMap holds at most 1 MiB",
                          "move long lists (e.g. [[data.sources]]) to files on the shared volume")
    cfg = load_config(args.config, overrides)
    dp = _check_layout(cfg, min_nodes, nodes, args.gpus_per_node)
    _check_paths(cfg, args.pvc)
    return Job(args.kind, args.name, args.image, nodes, min_nodes if min_nodes < nodes else None, args.gpus_per_node, text,
               tuple(overrides), args.pvc, args.queue, cfg.run.max_restarts, cfg.run.rendezvous_timeout_s,
               shm_size(cfg, dp, args.gpus_per_node))


def render(job: Job) -> tuple[str, dict]:
    """The manifest file's text and its job document, read back from that text (what kubectl would send)."""
    text = dump_documents(k8s_kinds.documents(job))
    documents = load_documents(text)
    problems = [p for doc in documents for p in k8s_check.problems(doc)]
    if problems:  # our generator's fault, not the user's: said as such, with what is wrong
        raise RuntimeError("the generated manifest does not pass its own checks (a bug in shardwise):\n  " + "\n  ".join(problems))
    return text, documents[-1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise launch k8s", usage=textwrap.dedent(USAGE).strip())
    parser.add_argument("--config", default=None, help="the run's TOML file (copied into the manifest as a ConfigMap)")
    parser.add_argument("--nodes", default=None, help="pods, one per node: N, or MIN:MAX for an elastic PyTorchJob")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs each pod requests (nvidia.com/gpu): one rank per GPU")
    parser.add_argument("--image", default=None, help="the container image, with shardwise installed")
    parser.add_argument("--kind", default="trainjob", help="trainjob (Kubeflow Trainer v2, default), jobset, pytorchjob")
    parser.add_argument("--pvc", default=None, help=f"a ReadWriteMany PersistentVolumeClaim mounted at {WORKDIR} on every pod "
                        "(run.dir and checkpoints); without it each pod gets an emptyDir")
    parser.add_argument("--queue", default=None, help="a Kueue LocalQueue (label kueue.x-k8s.io/queue-name)")
    parser.add_argument("--name", default="shardwise", help="the job's name (a DNS-1035 label)")
    parser.add_argument("--out", default=None, help="write the manifest here (default: print it)")
    parser.add_argument("--validate", default=None, metavar="FILE", help="only check a manifest file (exit 2 if it fails)")
    return parser


def main(argv: list[str]) -> int:
    """`shardwise launch k8s ...` (launch/schedulers.py dispatches here); returns the exit code."""
    args, overrides = _parser().parse_known_args(argv)
    if args.validate is not None:
        print(k8s_check.validate_file(Path(args.validate)))
        return 0
    job = build_job(args, overrides)
    if args.out:
        writable_file(Path(args.out), "--out")
    try:
        text, doc = render(job)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    notes = []
    if not job.pvc:
        notes.append(f"note: no --pvc: {WORKDIR} (run.dir, checkpoints) is an emptyDir, gone with its pod"
                     + (", and each pod holds only its ranks' checkpoint shards: a restart starts over; pass --pvc CLAIM "
                        "(ReadWriteMany)" if job.multinode else ""))
    if args.out is None:
        print(text, end="")
        for note in notes:
            print(note, file=sys.stderr)
        return 0
    Path(args.out).write_text(text)
    pods = f"{job.min_nodes} to {job.nodes}" if job.elastic else str(job.nodes)
    print(f"wrote {args.out}: {doc['kind']} {job.name} ({pods} pod(s) x {job.gpus_per_node} GPU(s), /dev/shm {job.shm.quantity} "
          f"each) and ConfigMap {config_map_name(job.name)}, checked offline (shardwise launch k8s --validate {args.out}); "
          f"start it with kubectl apply -f {args.out}")
    for note in notes:
        print(note)
    return 0
