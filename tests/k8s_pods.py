"""What Kubernetes and its controllers would run in each pod of a manifest, without a cluster.

For every pod a TrainJob, JobSet or PyTorchJob makes, from the values the manifest declares and what the
controllers add to them: its DNS name, its environment (the Trainer torch runtime's PET_* variables, the Job
controller's completion index, the training operator's replica-index label and elastic variables, each
`fieldRef` resolved), its command and args with the kubelet's `$(VAR)` expansion, and its volume mounts.
tests/dist/test_k8s.py starts those commands as nodes in network namespaces; tests/unit/test_launch_k8s.py
compares them with the torchrun path's command.

Sources: kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go (PET_*, the master's name
<trainjob>-node-0-0.<trainjob>, port 29500); kubernetes pkg/controller/job (the completion-index annotation
and JOB_COMPLETION_INDEX of an Indexed Job); JobSet's pod names <jobset>-<replicatedJob>-<job>-<pod> under
the subdomain <jobset>; kubeflow/training-operator v1.9 pkg/controller.v1/pytorch (envvar.go, elastic.go:
PYTHONUNBUFFERED, PET_NPROC_PER_NODE, PET_NNODES, PET_RDZV_*; a Service per pod named after it, the label
training.kubeflow.org/replica-index); kubernetes third_party/forked/golang/expansion (`$(VAR)`).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
REPLICA_INDEX = "training.kubeflow.org/replica-index"
TRAINER_PORT = 29500
PYTORCHJOB_DEFAULT_PORT = 23456  # the training operator's default "pytorchjob-port"


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a command or argument: `$(VAR)` becomes VAR's value when VAR is set (else it
    stays as written), `$$` is one `$` (so `$$(VAR)` stays `$(VAR)`), any other `$` stays."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close == -1:  # an incomplete reference: kept
                    out.append("$(")
                    i += 2
                    continue
                name = text[i + 2:close]
                out.append(env[name] if name in env else f"$({name})")
                i = close + 1
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


@dataclass
class Pod:
    """One pod as its node would run it."""

    name: str  # the pod's host name
    dns: str  # the name other pods reach it by
    env: dict[str, str]
    argv: list[str]  # command + args, expanded
    mounts: dict[str, dict] = field(default_factory=dict)  # mountPath -> the volume


def _resolve(env_list: list[dict], metadata: dict, injected: dict[str, str]) -> dict[str, str]:
    """The container's environment: what the controllers injected, then its own list in order (values may use
    $(VAR) of earlier ones, fieldRef reads the pod's labels and annotations)."""
    env = dict(injected)
    for entry in env_list or []:
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
            continue
        path = entry["valueFrom"]["fieldRef"]["fieldPath"]
        found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        assert found, f"a fieldRef this helper does not resolve: {path}"
        env[entry["name"]] = metadata[found.group(1)][found.group(2)]
    return env


def _container_pod(name: str, dns: str, container: dict, volumes: list[dict], metadata: dict, injected: dict[str, str]) -> Pod:
    env = _resolve(container.get("env"), metadata, injected)
    argv = [expand(str(a), env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    by_name = {v["name"]: v for v in volumes}
    mounts = {m["mountPath"]: by_name[m["name"]] for m in container.get("volumeMounts") or []}
    return Pod(name, dns, env, argv, mounts)


def _trainjob(doc: dict) -> list[Pod]:
    name, trainer = doc["metadata"]["name"], doc["spec"]["trainer"]
    nodes = trainer.get("numNodes", 1)
    patch_pods = [r["template"]["spec"]["template"]["spec"] for p in doc["spec"].get("runtimePatches", [])
                  for r in p["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    volumes = [v for p in patch_pods for v in p.get("volumes", [])]
    mounts = [m for p in patch_pods for c in p.get("containers", []) for m in c.get("volumeMounts", [])]
    pods = []
    for k in range(nodes):
        metadata = {"labels": {}, "annotations": {COMPLETION_INDEX: str(k)}}
        injected = {"JOB_COMPLETION_INDEX": str(k), "PET_NNODES": str(nodes),
                    "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")), "PET_NODE_RANK": str(k),
                    "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": str(TRAINER_PORT)}
        container = {**trainer, "volumeMounts": mounts}
        pods.append(_container_pod(f"{name}-node-0-{k}", f"{name}-node-0-{k}.{name}", container, volumes, metadata, injected))
    return pods


def _jobset(doc: dict) -> list[Pod]:
    name = doc["metadata"]["name"]
    subdomain = (doc["spec"].get("network") or {}).get("subdomain") or name
    pods = []
    for rjob in doc["spec"]["replicatedJobs"]:
        spec = rjob["template"]["spec"]
        pod_spec = spec["template"]["spec"]
        for j in range(rjob.get("replicas", 1)):
            for k in range(spec.get("completions", 1)):
                host = f"{name}-{rjob['name']}-{j}-{k}"
                metadata = {"labels": {}, "annotations": {COMPLETION_INDEX: str(k)}}
                pods.append(_container_pod(host, f"{host}.{subdomain}", pod_spec["containers"][0], pod_spec.get("volumes", []),
                                           metadata, {"JOB_COMPLETION_INDEX": str(k)}))
    return pods


def _pytorchjob(doc: dict) -> list[Pod]:
    name, spec = doc["metadata"]["name"], doc["spec"]
    elastic = spec.get("elasticPolicy")
    total = sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values())
    assert "Master" not in spec["pytorchReplicaSpecs"], "a Master replica's MASTER_ADDR / RANK are not rendered here"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    pod_spec = worker["template"]["spec"]
    main = next(c for c in pod_spec["containers"] if c["name"] == "pytorch")
    port = next((p["containerPort"] for p in main.get("ports", []) if p.get("name") == "pytorchjob-port"), PYTORCHJOB_DEFAULT_PORT)
    pods = []
    for i in range(worker.get("replicas", 1)):
        injected = {"PYTHONUNBUFFERED": "1"}
        if spec.get("nprocPerNode") is not None:
            injected["PET_NPROC_PER_NODE"] = str(spec["nprocPerNode"])
        if elastic is not None:
            injected.update({"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}", "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
                             "PET_NNODES": f"{elastic.get('minReplicas', total)}:{elastic.get('maxReplicas', total)}"})
            if elastic.get("maxRestarts") is not None:
                injected["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
        else:
            injected["PET_NNODES"] = str(total)
        metadata = {"labels": {REPLICA_INDEX: str(i), "training.kubeflow.org/replica-type": "worker"}, "annotations": {}}
        host = f"{name}-worker-{i}"
        pods.append(_container_pod(host, host, main, pod_spec.get("volumes", []), metadata, injected))
    return pods


def pods(documents: list[dict]) -> list[Pod]:
    """The pods of the (one) job among `documents`, in node order."""
    kinds = {"TrainJob": _trainjob, "JobSet": _jobset, "PyTorchJob": _pytorchjob}
    jobs = [d for d in documents if d.get("kind") in kinds]
    assert len(jobs) == 1, [d.get("kind") for d in documents]
    return kinds[jobs[0]["kind"]](jobs[0])


def config_maps(documents: list[dict]) -> dict[str, dict[str, str]]:
    """Each ConfigMap's files by its name."""
    return {d["metadata"]["name"]: d.get("data", {}) for d in documents if d.get("kind") == "ConfigMap"}


def localized(argv: list[str], mounts: dict[str, str]) -> list[str]:
    """`argv` with each mount path (a container path, e.g. /etc/shardwise) replaced by the host directory that
    stands for that volume here: the test's way of mounting it."""
    out = []
    for arg in argv:
        for path in sorted(mounts, key=len, reverse=True):
            arg = re.sub(rf"(?<![\w/.]){re.escape(path)}(?=/|\b|$)", mounts[path], arg)
        out.append(arg)
    return out


def generate(directory: Path, argv: list[str]) -> list[dict]:
    """`shardwise launch k8s ARGV` run in `directory` with an empty run.toml (every setting an override, which
    the manifest passes on) and a relative run.dir, `run`, so that it lands in the pods' shared volume; the
    manifest's documents."""
    from shardwise.cli import main
    from shardwise.launch.manifest_yaml import load_documents

    (directory / "run.toml").write_text("# every setting is an override: the manifest passes them on\n")
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        assert main(["launch", "k8s", "--config", "run.toml", *argv, "--out", "job.yaml", "--run.dir=run"]) == 0
    finally:
        os.chdir(cwd)
    return load_documents((directory / "job.yaml").read_text())


def mount_volumes(directory: Path, documents: list[dict], config_map: str) -> dict[str, str]:
    """The pods' volumes as directories under `directory`: the ConfigMap's files in config/, the claim every pod
    shares as workspace/; {container path: host directory} for `localized`."""
    from shardwise.launch import k8s_job

    config, workspace = directory / "config", directory / "workspace"
    config.mkdir()
    workspace.mkdir()
    for name, text in config_maps(documents)[config_map].items():
        (config / name).write_text(text)
    return {k8s_job.CONFIG_DIR: str(config), k8s_job.WORKDIR: str(workspace)}


def start(net, pods_: list[Pod], mounts: dict[str, str], cwd: Path, outputs: list[dict]) -> list:
    """Each pod as a node of `net` (tests/netns.py): every pod's DNS name in every node's /etc/hosts (the
    Services, as each pod's resolver would answer them), its command with the volumes mounted, its environment
    over a minimal one; `outputs[k]`: pod k's Popen keywords for its output."""
    from tests import netns

    for ns in net.nodes:
        with open(netns.ETC / ns / "hosts", "a") as hosts:
            hosts.write("".join(f"{net.address(k)} {pod.dns}\n" for k, pod in enumerate(pods_)))
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            **{k: os.environ[k] for k in ("HOME", "TMPDIR", "LANG") if k in os.environ}}
    return [net.popen(k, localized(pod.argv, mounts), env={**base, **pod.env}, cwd=cwd, **outputs[k])
            for k, pod in enumerate(pods_)]
