"""The three kinds of manifest `shardwise launch k8s` writes, each with the comments that say why.

All three run one pod per node, the same container (launch/k8s_job.py Job: command, volumes, GPUs), and the
same `shardwise train`; they differ in where a pod's node rank and node 0's name come from:

| kind | node rank (PET_NODE_RANK) | node 0 (PET_MASTER_ADDR:PET_MASTER_PORT) |
|---|---|---|
| TrainJob (trainer.kubeflow.org/v1alpha1) | the torch runtime's: the completion index | the runtime's: <name>-node-0-0.<name>:29500 |
| JobSet (jobset.x-k8s.io/v1alpha2) | declared here: the completion index (an Indexed Job) | declared here: <name>-node-0-0.<name>:29400 |
| PyTorchJob (kubeflow.org/v1) | declared here: the pod's replica-index label | declared here: <name>-worker-0:29400 (its Service) |

The Trainer's values are its torch plugin's (kubeflow/trainer v2.3.0, pkg/runtime/framework/plugins/torch);
the PyTorchJob's label and Services the training operator's (kubeflow/training-operator v1.9).
"""
from __future__ import annotations

from shardwise.errors import NOT_RESTARTABLE
from shardwise.launch.k8s_job import CONFIG_FILE, WORKDIR, Job, config_map_name
from shardwise.launch.rendezvous import RDZV_DEFAULT_PORT

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PYTORCHJOB_API = "kubeflow.org/v1"
# The ClusterTrainingRuntime a TrainJob runs on (Kubeflow Trainer's manifests install it), its replicated
# job and container: a runtime patch may only name what the runtime has (Trainer's JobSet plugin validation).
TRAINER_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"
TRAINER_PORT = 29500  # the torch plugin's PET_MASTER_PORT (constants.ContainerTrainerPort)
# Who owns the runtime patch: Trainer requires a domain-prefixed path and keeps one patch per manager.
PATCH_MANAGER = "shardwise/launch-k8s"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
REPLICA_INDEX = "metadata.labels['training.kubeflow.org/replica-index']"
PYTORCH_CONTAINER = "pytorch"  # the training operator's required container name
PYTORCH_PORT_NAME = "pytorchjob-port"  # the port it reads an elastic job's rendezvous port from
NODE_CONTAINER = "node"


def _comments(job: Job, container: tuple, pod: tuple) -> dict[tuple, str]:
    """What the shared parts of the pod mean, at their paths in this kind's document (the volumes in the
    order of Job.volumes(): config, workspace, dshm)."""
    work = "a PersistentVolumeClaim" if job.pvc else "an emptyDir (no --pvc): gone with the pod"
    return {
        (*container, "command"): (f"A shell only to start in {WORKDIR} and wait for node 0's DNS name, then to run exactly the "
                                  "command below." if job.multinode else f"A shell only to start in {WORKDIR}, then to run "
                                  "exactly the command below."),
        (*container, "args"): "The `shardwise train` one node of the torchrun path runs (launch/k8s_job.py Job.train_command); "
                              "$(VAR) is a variable of the pod, expanded by the kubelet.",
        (*container, "resources"): "One rank per GPU: --nproc in the args is this count.",
        (*pod, "volumes", 2): f"/dev/shm in memory (a container's default is 64 MiB): {job.shm.why}. What is written there "
                                "counts against the pod's memory.",
        (*pod, "volumes", 1): f"{WORKDIR}, where the job runs (the config's relative paths, run.dir first, land here): {work}.",
        (*pod, "volumes", 0): f"The run's config, as given to `shardwise launch k8s` ({CONFIG_FILE} of the ConfigMap).",
    }


def _restart_words(job: Job) -> str:
    return (f"Restarts (run.max_restarts = {job.max_restarts}{': none' if job.max_restarts == 0 else ''}): a failed worker is "
            "restarted inside its pod by `shardwise train` (torchrun's agent, with the other nodes' workers)")


def config_map(job: Job) -> tuple[dict, dict]:
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_map_name(job.name)},
           "data": {CONFIG_FILE: job.config_text}}
    return doc, {(): f"The run's config, mounted read-only in every pod of {job.name}."}


def _container(job: Job, name: str, env: list[dict], port: dict | None) -> dict:
    container = {"name": name, "image": job.image, "command": job.entrypoint(), "args": job.train_command()}
    if env:
        container["env"] = env
    if port:
        container["ports"] = [port]
    return {**container, "resources": {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}},
            "volumeMounts": job.volume_mounts()}


def _env(rank_from: str, master: str, port: int) -> list[dict]:
    """What the Trainer's torch runtime injects into a TrainJob's pods, declared by the other kinds themselves."""
    return [{"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": rank_from}}},
            {"name": "PET_MASTER_ADDR", "value": master},
            {"name": "PET_MASTER_PORT", "value": str(port)}]


def trainjob(job: Job) -> tuple[dict, dict]:
    container = {k: v for k, v in _container(job, TRAINER_NODE, [], None).items() if k in ("image", "command", "args")}
    patch_pod = {"volumes": job.volumes(), "containers": [{"name": TRAINER_NODE, "volumeMounts": job.volume_mounts()}]}
    spec = {"runtimeRef": {"name": TRAINER_RUNTIME, "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
            "trainer": {**container, "numNodes": job.nodes, "numProcPerNode": job.gpus_per_node,
                        "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(job.gpus_per_node)}}},
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                {"name": TRAINER_NODE, "template": {"spec": {"template": {"spec": patch_pod}}}}]}}}}]}
    doc = {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": _metadata(job), "spec": spec}
    pod = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template", "spec",
           "template", "spec")
    comments = _comments(job, ("spec", "trainer"), pod)
    comments.update({
        (): f"Generated by `shardwise launch k8s`: {job.nodes} node(s) x {job.gpus_per_node} GPU(s), a TrainJob on Kubeflow "
            f"Trainer's {TRAINER_RUNTIME} runtime.\nThe runtime gives each pod PET_NODE_RANK (its Job's completion index), "
            f"PET_MASTER_ADDR ({job.name}-node-0-0.{job.name}, node 0's pod) and PET_MASTER_PORT ({TRAINER_PORT}); node 0 "
            "serves the rendezvous there.",
        ("spec", "trainer", "resourcesPerNode"): "One rank per GPU: --nproc in the args, and numProcPerNode, are this count.",
        ("spec", "runtimePatches"): f"The volumes, added to the runtime's pod template (the trainer API has no field for them).\n"
                                    f"{_restart_words(job)}. Restarting the pods themselves is the runtime's JobSet "
                                    f"failurePolicy ({TRAINER_RUNTIME}: none); --kind jobset writes one from run.max_restarts.",
    })
    return doc, comments


def jobset(job: Job) -> tuple[dict, dict]:
    env = _env(COMPLETION_INDEX, f"{job.name}-node-0-0.{job.name}", RDZV_DEFAULT_PORT) if job.multinode else []
    port = {"name": "rendezvous", "containerPort": RDZV_DEFAULT_PORT} if job.multinode else None
    pod_spec = {"restartPolicy": "Never", "containers": [_container(job, NODE_CONTAINER, env, port)], "volumes": job.volumes()}
    job_spec = {"parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed", "backoffLimit": 0,
                "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                    "containerName": NODE_CONTAINER, "operator": "In", "values": sorted(NOT_RESTARTABLE)}}]},
                "template": {"spec": pod_spec}}
    spec = {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": job.max_restarts, "rules": [
                {"name": "notRestartable", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": NODE_CONTAINER, "replicas": 1, "template": {"spec": job_spec}}]}
    doc = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job), "spec": spec}
    rjob = ("spec", "replicatedJobs", 0, "template", "spec")
    comments = _comments(job, (*rjob, "template", "spec", "containers", 0), (*rjob, "template", "spec"))
    comments.update({
        (): f"Generated by `shardwise launch k8s`: {job.nodes} node(s) x {job.gpus_per_node} GPU(s), a JobSet: one Indexed Job of "
            f"{job.nodes} pod(s), pod K reached as {job.name}-node-0-K.{job.name} (the JobSet's headless Service); node 0 serves "
            "the rendezvous.",
        ("spec", "network"): "Every pod reachable by name, before it is ready (node 0's name must resolve for the others to start).",
        ("spec", "failurePolicy"): f"{_restart_words(job)}; a pod that fails ends its Job (backoffLimit 0) and the JobSet "
                                   f"restarts all pods, at most {job.max_restarts} time(s), each resuming from the newest "
                                   "checkpoint. Not after an exit code no restart helps: podFailurePolicy below.",
        (*rjob, "podFailurePolicy"): f"Exit codes {', '.join(map(str, sorted(NOT_RESTARTABLE)))}: bad input, diverged, I/O error, out "
                                     "of memory (errors.py NOT_RESTARTABLE): the same run fails the same way again, so the Job "
                                     "fails with reason PodFailurePolicy, and the rule above fails the JobSet.",
        (*rjob, "template", "spec", "restartPolicy"): "Never: the Job replaces a failed pod (podFailurePolicy requires it).",
    })
    if env:
        comments[(*rjob, "template", "spec", "containers", 0, "env")] = \
            "The node's rank is its pod's completion index; node 0 is pod 0 (the same variables a TrainJob's runtime sets)."
    return doc, comments


def pytorchjob(job: Job) -> tuple[dict, dict]:
    env = _env(REPLICA_INDEX, f"{job.name}-worker-0", RDZV_DEFAULT_PORT) if job.multinode else []
    port = {"name": PYTORCH_PORT_NAME, "containerPort": RDZV_DEFAULT_PORT}
    pod_spec = {"containers": [_container(job, PYTORCH_CONTAINER, env, port)], "volumes": job.volumes()}
    spec = {"nprocPerNode": str(job.gpus_per_node), "runPolicy": {"backoffLimit": job.max_restarts},
            "pytorchReplicaSpecs": {"Worker": {"replicas": job.nodes, "restartPolicy": "OnFailure", "template": {"spec": pod_spec}}}}
    if job.elastic:
        spec["elasticPolicy"] = {"minReplicas": job.min_nodes, "maxReplicas": job.nodes, "rdzvBackend": "c10d",
                                 "maxRestarts": job.max_restarts}
    doc = {"apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob", "metadata": _metadata(job), "spec": spec}
    worker = ("spec", "pytorchReplicaSpecs", "Worker")
    comments = _comments(job, (*worker, "template", "spec", "containers", 0), (*worker, "template", "spec"))
    size = f"{job.min_nodes} to {job.nodes}" if job.elastic else str(job.nodes)
    comments.update({
        (): f"Generated by `shardwise launch k8s`: {size} node(s) x {job.gpus_per_node} GPU(s), a Kubeflow v1 PyTorchJob of "
            f"Worker pods {job.name}-worker-K, each reached by its own Service of that name; node 0 ({job.name}-worker-0) "
            "serves the rendezvous.",
        ("spec", "runPolicy"): f"{_restart_words(job)}; a failed container restarts in place (restartPolicy OnFailure) and "
                               f"the job fails after {job.max_restarts} such restart(s). PyTorchJob has no rule by exit code but "
                               "ExitCode, which would also end a job whose node lost its peer (exit 1).",
    })
    if job.elastic:
        comments[("spec", "elasticPolicy")] = (
            f"Elastic: the job goes on with {job.min_nodes} to {job.nodes} pods (--nnodes {job.min_nodes}:{job.nodes} in the args). "
            "A lost pod is recreated and joins again; the others re-form without it meanwhile, resharded, from the newest "
            "checkpoint. Node 0 serves the rendezvous: the job survives the loss of any pod but worker-0.")
    if env:
        comments[(*worker, "template", "spec", "containers", 0, "env")] = \
            "The node's rank is its pod's replica index (the operator's label); node 0 is worker-0."
    return doc, comments


def _metadata(job: Job) -> dict:
    """The job's name, and Kueue's queue label (--queue): Kueue admits the job from that LocalQueue when its
    quota allows, all pods at once, and holds it suspended until then."""
    metadata = {"name": job.name}
    if job.queue:
        metadata["labels"] = job.labels()
    return metadata


def documents(job: Job) -> list[tuple[dict, dict]]:
    """The ConfigMap, then the job of `job.kind`."""
    kinds = {"trainjob": trainjob, "jobset": jobset, "pytorchjob": pytorchjob}
    doc, comments = kinds[job.kind](job)
    if job.queue:
        comments[("metadata", "labels")] = (f"Kueue admits the job from LocalQueue {job.queue} once its quota has room for every "
                                            "pod (it stays suspended until then).")
    return [config_map(job), (doc, comments)]

