"""Offline checks of a Kubernetes manifest: the published API models, unknown fields refused, and the rules
the API server's webhooks and CEL expressions apply that no schema carries.

Schema: each document goes through the project's pinned copy of its published models (pyproject.toml):
TrainJob and JobSet through kubeflow-trainer-api (pydantic models generated from Trainer's OpenAPI spec,
JobSet's included), PyTorchJob through kubeflow-training (the training operator's v1 SDK models), a ConfigMap
through the Kubernetes client's. Neither kind of model refuses a field it does not know (they drop it), so
each document is read into the models and written back, and any difference is a problem: a field the API
does not have (a typo in our generator), or a value of the wrong type.

Rules (invariants below): what a controller's webhook or a CEL rule of the CRD refuses, which a model
cannot: DNS-1035 names and the names the controllers derive from them, node counts that agree between the
job and the `shardwise train` command, container names the operators require, elastic MIN <= MAX, and that
every `$(VAR)` of the command is set in the pod. Cited per rule; what stays unchecked is in docs/clusters.md.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.launch.k8s_job import CONFIG_MAP_MAX_BYTES, dns1035_problem, dns1123_subdomain_problem, longest_pod_name

# (apiVersion, kind) -> the pinned package whose models check it
PACKAGES = {("trainer.kubeflow.org/v1alpha1", "TrainJob"): "kubeflow-trainer-api",
            ("jobset.x-k8s.io/v1alpha2", "JobSet"): "kubeflow-trainer-api",
            ("kubeflow.org/v1", "PyTorchJob"): "kubeflow-training",
            ("v1", "ConfigMap"): "kubernetes"}
# Variables the platform puts in a pod that the manifest does not declare (so a `$(VAR)` of the command may
# name them): the Trainer torch plugin's (constants.TorchRunReservedEnvNames), the Job controller's for an
# Indexed Job, the training operator's (pkg/controller.v1/pytorch envvar.go, elastic.go).
TRAINER_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
INDEXED_JOB_ENV = ("JOB_COMPLETION_INDEX",)
PYTORCHJOB_ENV = ("PYTHONUNBUFFERED", "PET_NNODES", "PET_NPROC_PER_NODE")
PYTORCHJOB_ELASTIC_ENV = ("PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_MAX_RESTARTS")
# JobSet's webhook: failure policy rule names and the job failure reasons it knows (pkg/webhooks/jobset_webhook.go).
_RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded", "PodFailurePolicy")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
# Kubernetes' $(VAR) naming a variable; $$(VAR) is an escaped one, and $((...)) (shell arithmetic) names none.
_REFERENCE = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([KMGTPE]i?|[mkMGTPE]|e[0-9]+)?")
# Apimachinery's IsDomainPrefixedPath, as Trainer's runtime patch manager must be.
_PATH = re.compile(r"[a-zA-Z0-9\-._~!$&'()*+,;=:@/]+")


@dataclass(frozen=True)
class _Response:
    """What the OpenAPI clients' public deserialize() reads: the body of an API answer."""

    data: str


def schema_problems(doc: dict) -> list[str]:
    """`doc` read into its published models and written back: every field they do not know or type differently."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in PACKAGES:
        return [f"{key[1]} of {key[0]}: not a kind shardwise writes or checks ({', '.join(k for _, k in PACKAGES)})"]
    if PACKAGES[key] == "kubeflow-trainer-api":
        from kubeflow_trainer_api.models import JobsetV1alpha2JobSet, TrainerV1alpha1TrainJob
        from pydantic import ValidationError

        model = TrainerV1alpha1TrainJob if key[1] == "TrainJob" else JobsetV1alpha2JobSet
        try:
            back = model.from_dict(doc).to_dict()
        except ValidationError as e:
            return [f"{e.title}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()]
    else:
        if key[1] == "PyTorchJob":
            from kubeflow.training.api_client import ApiClient
        else:
            from kubernetes.client import ApiClient
        client = ApiClient()
        try:
            model = client.deserialize(_Response(json.dumps(doc)), "KubeflowOrgV1PyTorchJob" if key[1] == "PyTorchJob" else "V1ConfigMap")
        except (ValueError, TypeError) as e:
            return [f"{key[1]}: {e}"]
        back = client.sanitize_for_serialization(model)
    return _differences(doc, back, key[1])


def _differences(mine: object, back: object, path: str) -> list[str]:
    if isinstance(mine, dict) and isinstance(back, dict):
        # A key only the model's side has is a default it fills in (a port's protocol: TCP), not ours.
        out = [f"{path}.{k}: unknown field (the API has no such field here)" for k in mine if k not in back]
        return out + [p for k in mine if k in back for p in _differences(mine[k], back[k], f"{path}.{k}")]
    if isinstance(mine, list) and isinstance(back, list) and len(mine) == len(back):
        return [p for i, (a, b) in enumerate(zip(mine, back)) for p in _differences(a, b, f"{path}[{i}]")]
    if mine != back or type(mine) is not type(back):
        return [f"{path}: {mine!r} does not have the API's type (read back as {back!r})"]
    return []


def _get(doc: object, *path) -> object:
    for key in path:
        if isinstance(doc, dict):
            doc = doc.get(key)
        elif isinstance(doc, list) and isinstance(key, int) and key < len(doc):
            doc = doc[key]
        else:
            return None
    return doc


def _option(args: list, flag: str) -> str | None:
    return str(args[args.index(flag) + 1]) if flag in args and args.index(flag) + 1 < len(args) else None


def _pod_problems(where: str, pod: dict, containers: list[dict], injected: tuple[str, ...]) -> list[str]:
    """A pod template's rules, from Kubernetes' own API validation (a schema does not carry them): names,
    mounts of declared volumes, env names, and (ours) every $(VAR) of the command set in the pod."""
    out = []
    volumes = {v.get("name") for v in pod.get("volumes") or []}
    for c in containers:
        name = c.get("name", "")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            out.append(f"{where}.containers: {name!r} is not a DNS-1123 label")
        out += [f"{where}.containers[{name}].volumeMounts: {m.get('name')!r} is no volume of the pod"
                for m in c.get("volumeMounts") or [] if m.get("name") not in volumes]
        env = [e.get("name", "") for e in c.get("env") or []]
        out += [f"{where}.containers[{name}].env: {e!r} is not a valid variable name" for e in env if not _ENV_NAME.fullmatch(e)]
        for text in [*(c.get("command") or []), *(c.get("args") or [])]:
            for ref in _REFERENCE.findall(str(text)):
                if ref not in env and ref not in injected:
                    out.append(f"{where}.containers[{name}]: $({ref}) is set nowhere in the pod, so it reaches the "
                               "command as written")
        for resource, value in (_get(c, "resources", "limits") or {}).items():
            if not _QUANTITY.fullmatch(str(value)):
                out.append(f"{where}.containers[{name}].resources.limits.{resource}: {value!r} is not a quantity")
    return out


def _counts(where: str, args: list, nodes: str, nproc: str | int | None) -> list[str]:
    """The job's own node and GPU counts agree with what `shardwise train` is told (ours: a mismatch hangs the
    rendezvous or leaves GPUs idle)."""
    out = []
    if str(nproc) != str(_option(args, "--nproc")):
        out.append(f"{where}: the command runs --nproc {_option(args, '--nproc')} rank(s) per pod, the pod is given {nproc}")
    if str(_option(args, "--nnodes") or "1") != nodes:
        out.append(f"{where}: the command says --nnodes {_option(args, '--nnodes') or 1}, the job has {nodes} pod(s)")
    return out


def _name(doc: dict, kind_key: str, nodes: int) -> list[str]:
    name = str(_get(doc, "metadata", "name") or "")
    problem = dns1035_problem(name)  # TrainJob's CEL rule, PyTorchJob's webhook, JobSet's generated names
    if problem:
        return [f"metadata.name: {problem}"]
    longest = longest_pod_name(kind_key, name, max(nodes, 1))
    if len(longest) > 63:
        return [f"metadata.name: the pods' names reach {len(longest)} characters ({longest}), more than 63 (a DNS label)"]
    return []


def _labels(doc: dict) -> list[str]:
    return [f"metadata.labels.{k}: {v!r} is not a label value" for k, v in (_get(doc, "metadata", "labels") or {}).items()
            if not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.fullmatch(v)]


def _trainjob(doc: dict) -> list[str]:
    trainer = _get(doc, "spec", "trainer") or {}
    nodes, nproc = trainer.get("numNodes", 1), trainer.get("numProcPerNode")
    out = _name(doc, "trainjob", nodes) + _labels(doc)
    if not isinstance(nodes, int) or nodes < 1:
        out.append(f"spec.trainer.numNodes: must be >= 1, got {nodes!r}")
    if nproc is not None and (not isinstance(nproc, int) or nproc < 1):  # CRD CEL: numProcPerNode must be >= 1
        out.append(f"spec.trainer.numProcPerNode: must be >= 1, got {nproc!r}")
    reserved = [e.get("name") for e in trainer.get("env") or [] if e.get("name") in TRAINER_ENV]
    if reserved:  # the torch plugin's validation: the runtime sets these
        out.append(f"spec.trainer.env: {reserved} are the torch runtime's own (reserved)")
    gpus = _get(trainer, "resourcesPerNode", "limits", "nvidia.com/gpu")
    if nproc is not None and gpus is not None and str(gpus) != str(nproc):
        out.append(f"spec.trainer: numProcPerNode {nproc} but {gpus} GPU(s) per node")
    volumes = []
    for i, patch in enumerate(_get(doc, "spec", "runtimePatches") or []):
        manager = str(patch.get("manager", ""))
        host, _, rest = manager.partition("/")
        if not rest or dns1123_subdomain_problem(host) or not _PATH.fullmatch(rest):  # Trainer: IsDomainPrefixedPath
            out.append(f"spec.runtimePatches[{i}].manager: {manager!r} is not a domain-prefixed path (such as acme.io/foo)")
        for rjob in _get(patch, "trainingRuntimeSpec", "template", "spec", "replicatedJobs") or []:
            if rjob.get("name") != "node":  # the torch-distributed runtime has the one replicated job, "node"
                out.append(f"spec.runtimePatches[{i}]: replicated job {rjob.get('name')!r} is not in the torch-distributed runtime")
            pod = _get(rjob, "template", "spec", "template", "spec") or {}
            volumes += pod.get("volumes") or []
            for c in pod.get("containers") or []:
                if c.get("name") != "node":
                    out.append(f"spec.runtimePatches[{i}]: container {c.get('name')!r} is not in the runtime (only 'node')")
                elif c.get("env"):  # Trainer's JobSet plugin: a node's env goes through spec.trainer.env
                    out.append(f"spec.runtimePatches[{i}]: env of container 'node' must be set in spec.trainer.env")
    patched = [c for p in _get(doc, "spec", "runtimePatches") or []
               for r in _get(p, "trainingRuntimeSpec", "template", "spec", "replicatedJobs") or []
               for c in _get(r, "template", "spec", "template", "spec", "containers") or []]
    container = {"name": "node", **{k: trainer[k] for k in ("command", "args", "env") if k in trainer},
                 "volumeMounts": [m for c in patched for m in c.get("volumeMounts") or []]}
    out += _pod_problems("spec.trainer", {"volumes": volumes}, [container], TRAINER_ENV)
    return out + _counts("spec.trainer", trainer.get("args") or [], str(nodes), nproc)


def _jobset(doc: dict) -> list[str]:
    out, name = _labels(doc), str(_get(doc, "metadata", "name") or "")
    out += [f"metadata.name: {p}" for p in [dns1035_problem(name)] if p]
    policy = _get(doc, "spec", "failurePolicy") or {}
    rules = policy.get("rules") or []
    names = [r.get("name", "") for r in rules]
    for r in rules:
        if not _RULE_NAME.fullmatch(r.get("name", "")) or len(r.get("name", "")) > 128:
            out.append(f"spec.failurePolicy.rules: {r.get('name')!r} is not a rule name JobSet accepts")
        out += [f"spec.failurePolicy.rules[{r.get('name')}]: {x!r} is no job failure reason"
                for x in r.get("onJobFailureReasons") or [] if x not in JOB_FAILURE_REASONS]
    if len(set(names)) != len(names):
        out.append(f"spec.failurePolicy.rules: names are not unique: {names}")
    for rjob in _get(doc, "spec", "replicatedJobs") or []:
        where = f"spec.replicatedJobs[{rjob.get('name')}]"
        replicas, spec = rjob.get("replicas", 1), _get(rjob, "template", "spec") or {}
        completions = spec.get("completions", 1)
        out += [f"{where}.name: {p}" for p in [dns1035_problem(str(rjob.get("name", "")))] if p]
        pods = int(replicas) * int(completions)
        pod_name = f"{name}-{rjob.get('name')}-{int(replicas) - 1}-{int(completions) - 1}-abcde"
        if not dns1035_problem(name) and len(pod_name) > 63:  # JobSet's webhook: generated pod names
            out.append(f"{where}: pod names reach {len(pod_name)} characters ({pod_name}), more than 63")
        if spec.get("completionMode") != "Indexed" or spec.get("parallelism") != completions:
            out.append(f"{where}: an Indexed Job with parallelism = completions is what gives each pod a stable name and rank")
        pod = _get(spec, "template", "spec") or {}
        containers = pod.get("containers") or []
        failure = spec.get("podFailurePolicy")
        if failure is not None:  # batch/v1 Job validation
            if pod.get("restartPolicy") != "Never":
                out.append(f"{where}: a podFailurePolicy needs the pod's restartPolicy Never")
            for rule in failure.get("rules") or []:
                codes = _get(rule, "onExitCodes") or {}
                values = codes.get("values") or []
                if codes and (values != sorted(set(values)) or (codes.get("operator") == "In" and 0 in values)):
                    out.append(f"{where}.podFailurePolicy: exit codes {values} must be sorted, unique, and not 0 with In")
                if codes.get("containerName") not in (None, *(c.get("name") for c in containers)):
                    out.append(f"{where}.podFailurePolicy: container {codes.get('containerName')!r} is not in the pod")
        out += _pod_problems(where, pod, containers, INDEXED_JOB_ENV)
        for c in containers:
            gpus = _get(c, "resources", "limits", "nvidia.com/gpu")
            out += _counts(f"{where}.containers[{c.get('name')}]", c.get("args") or [], str(pods), gpus)
    return out


def _pytorchjob(doc: dict) -> list[str]:
    specs, spec = _get(doc, "spec", "pytorchReplicaSpecs") or {}, doc.get("spec") or {}
    out = _labels(doc)
    elastic = spec.get("elasticPolicy")
    for rtype in specs:  # the training operator's webhook (pkg/webhooks/pytorch)
        if rtype not in ("Master", "Worker"):
            out.append(f"spec.pytorchReplicaSpecs.{rtype}: not Master or Worker")
    if "Master" in specs and specs["Master"].get("replicas", 1) != 1:
        out.append("spec.pytorchReplicaSpecs.Master.replicas: must be 1")
    worker = specs.get("Worker") or {}
    replicas = worker.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 1:
        out.append(f"spec.pytorchReplicaSpecs.Worker.replicas: must be >= 1, got {replicas!r}")
        replicas = 1
    out += _name(doc, "pytorchjob", replicas)
    nodes = str(replicas)
    injected = PYTORCHJOB_ENV
    if elastic is not None:
        low, high = elastic.get("minReplicas", replicas), elastic.get("maxReplicas", replicas)
        if not specs.get("Worker"):
            out.append("spec.elasticPolicy: needs a Worker replica spec")
        if not 1 <= low <= high:
            out.append(f"spec.elasticPolicy: minReplicas {low} and maxReplicas {high}: must be 1 <= min <= max")
        elif not low <= replicas <= high:
            out.append(f"spec.pytorchReplicaSpecs.Worker.replicas: {replicas} is outside {low}..{high}")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            out.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
        nodes = f"{low}:{high}" if low < high else str(high)
        injected += PYTORCHJOB_ELASTIC_ENV
    for rtype, rspec in specs.items():
        where = f"spec.pytorchReplicaSpecs.{rtype}"
        pod = _get(rspec, "template", "spec") or {}
        containers = pod.get("containers") or []
        main = [c for c in containers if c.get("name") == "pytorch"]
        if not main or not main[0].get("image"):
            out.append(f"{where}: needs a container named 'pytorch' with an image (the operator's webhook)")
        if rspec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
            out.append(f"{where}.restartPolicy: {rspec.get('restartPolicy')!r} is not a policy")
        out += _pod_problems(where, pod, containers, injected)
        for c in main:
            args, env = c.get("args") or [], {e.get("name"): e.get("value") for e in c.get("env") or []}
            ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
            if elastic is not None and env.get("PET_MASTER_PORT") not in (None, str(ports.get("pytorchjob-port"))):
                out.append(f"{where}: the rendezvous port {env.get('PET_MASTER_PORT')} is not the port named pytorchjob-port "
                           f"({ports.get('pytorchjob-port')}), which the operator gives torchrun")
            gpus = _get(c, "resources", "limits", "nvidia.com/gpu")
            nproc = spec.get("nprocPerNode")
            if gpus is not None and nproc is not None and str(gpus) != str(nproc):
                out.append(f"{where}: nprocPerNode {nproc} but {gpus} GPU(s) per pod")
            out += _counts(where, args, nodes, gpus if gpus is not None else nproc)
    return out


def _config_map(doc: dict) -> list[str]:
    name = str(_get(doc, "metadata", "name") or "")
    out = [f"metadata.name: {p}" for p in [dns1123_subdomain_problem(name)] if p]
    data = doc.get("data") or {}
    out += [f"data: key {k!r} is not a file name Kubernetes accepts" for k in data if not re.fullmatch(r"[-._a-zA-Z0-9]+", str(k))]
    if len(json.dumps(data).encode()) > CONFIG_MAP_MAX_BYTES:
        out.append("data: more than a ConfigMap's 1 MiB")
    return out


def invariant_problems(doc: dict) -> list[str]:
    rules = {"TrainJob": _trainjob, "JobSet": _jobset, "PyTorchJob": _pytorchjob, "ConfigMap": _config_map}
    return rules[doc["kind"]](doc) if doc.get("kind") in rules else []


def problems(doc: object) -> list[str]:
    """Everything wrong with one document, each as 'Kind name: where: what'."""
    if not isinstance(doc, dict) or not doc.get("kind"):
        return [f"not a Kubernetes object (no kind): {str(doc)[:80]!r}"]
    head = f"{doc['kind']} {_get(doc, 'metadata', 'name') or '(no name)'}"
    schema = schema_problems(doc)
    # The rules read the structure the schema vouches for: on a broken schema, its problems alone.
    return [f"{head}: {p}" for p in (schema or invariant_problems(doc))]


def validate_file(path: Path) -> str:
    """`--validate FILE`: every document of the file checked; a one-line summary, or ConfigError (exit 2)."""
    from importlib.metadata import version

    from shardwise.launch.manifest_yaml import load_documents

    try:
        documents = load_documents(path.read_text())
    except OSError as e:
        raise ConfigError("--validate", f"cannot read {path}: {e.strerror or e}", "give a manifest file") from None
    except Exception as e:  # yaml.YAMLError, imported with PyYAML only here
        raise ConfigError("--validate", f"{path} is not YAML: {str(e).splitlines()[0]}", "fix the line it names") from None
    found = [p for doc in documents for p in problems(doc)]
    if not documents:
        found = ["no document in the file"]
    if found:
        raise ConfigError("--validate", f"{path}: {len(found)} problem(s):\n    " + "\n    ".join(found),
                          "correct the fields named (or generate the manifest again with shardwise launch k8s)")
    used = sorted({PACKAGES[(d['apiVersion'], d['kind'])] for d in documents})
    kinds = ", ".join(f"{d['kind']} {_get(d, 'metadata', 'name')}" for d in documents)
    return (f"{path}: {kinds}: valid (models: {', '.join(f'{p} {version(p)}' for p in used)}; and the webhook and CEL "
            "rules shardwise checks)")
