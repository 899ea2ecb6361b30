"""`shardwise launch k8s` (launch/k8s.py, k8s_kinds.py, k8s_check.py, manifest_yaml.py), without a cluster:
each kind's pods run the torchrun path's command (the SLURM script's, node for node) with node 0's DNS name
as the rendezvous; the pinned API models refuse a field they do not know; the rules no schema carries are
enforced; bad input is exit 2 before anything is written. tests/dist/test_k8s.py starts the pods for real."""
from __future__ import annotations

import copy
import shlex
import subprocess

import pytest

from shardwise.cli import main
from shardwise.launch import k8s, k8s_check, k8s_job
from shardwise.launch.manifest_yaml import dump_documents, load_documents
from shardwise.launch.schedulers import sbatch_script
from tests import k8s_pods

RUN_TOML = ('# a 16-rank run\n[model]\npreset = "tiny"\n\n[train]\nglobal_batch = 64\nmicro_batch = 4\n\n'
            '[parallel]\ndp_shard = -1\nzero = 3\n\n[data]\nnum_workers = 2\n')
OVERRIDES = ["--train.steps=1000", "--train.lr=1e-3"]
# Each kind's node 0 as the other pods reach it, and the rendezvous port.
NODE_0 = {"trainjob": ("llama-node-0-0.llama", 29500), "jobset": ("llama-node-0-0.llama", 29400),
          "pytorchjob": ("llama-worker-0", 29400)}


@pytest.fixture()
def run_dir(tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text(RUN_TOML)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _generate(kind: str, *extra: str, nodes: str = "2", name: str = "llama") -> list[dict]:
    code = main(["launch", "k8s", "--config", "run.toml", "--nodes", nodes, "--gpus-per-node", "8", "--image",
                 "registry.example/shardwise:0.1", "--kind", kind, "--name", name, "--pvc", "shared", "--out", f"{kind}.yaml",
                 *OVERRIDES, *extra])
    assert code == 0
    return load_documents(open(f"{kind}.yaml").read())


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, dict]:
    """Each kind's job document for 2 x 8 GPUs, generated once for the tests that only alter a copy of it."""
    import os

    where, cwd = tmp_path_factory.mktemp("k8s"), os.getcwd()
    (where / "run.toml").write_text(RUN_TOML)
    os.chdir(where)
    try:
        return {kind: _generate(kind)[-1] for kind in k8s.KINDS}
    finally:
        os.chdir(cwd)


def _slurm_node_argv(tmp_path, node: int) -> list[str]:
    """What node `node` of the sbatch script of `launch slurm` runs, after `python -m shardwise.cli` (its srun line
    run with a python3 that prints its arguments)."""
    script = sbatch_script("run.toml", OVERRIDES, nodes=2, gpus_per_node=8, python="python3")
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text('#!/bin/bash\nprintf \'%s\\0\' "$@"\n')
    (fake / "python3").chmod(0o755)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    env = {"SLURM_NODEID": str(node), "MASTER_ADDR": "node0", "MASTER_PORT": "29400", "SLURM_JOB_ID": "7",
           "PATH": f"{fake}:/usr/bin:/bin"}
    done = subprocess.run(shlex.split(srun)[1:], env=env, capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1][2:]


def _normalized(argv: list[str]) -> list[str]:
    out = list(argv)
    out[argv.index("--config") + 1], out[argv.index("--rdzv-endpoint") + 1] = "CONFIG", "NODE_0:PORT"
    return out


@pytest.mark.parametrize("kind", k8s.KINDS)
def test_every_pod_runs_the_torchrun_paths_command_with_node_0s_name(kind, run_dir):
    documents = _generate(kind)
    pods = k8s_pods.pods(documents)
    host, port = NODE_0[kind]
    assert [p.dns for p in pods][0] == host and len(pods) == 2
    for k, pod in enumerate(pods):
        shell, train = pod.argv[:4], pod.argv[4:]
        assert train == ["shardwise", "train", "--config", "/etc/shardwise/run.toml", "--nproc", "8", "--nnodes", "2",
                         "--node-rank", str(k), "--rdzv-endpoint", f"{host}:{port}", *OVERRIDES]
        # The SLURM script's node runs the same options in the same order; only where the config is and how node 0
        # is named differ (and SLURM names its rendezvous after its job).
        slurm = _slurm_node_argv(run_dir, k)
        assert slurm[slurm.index("--rdzv-id"):slurm.index("--rdzv-id") + 2] == ["--rdzv-id", "slurm-7"]
        del slurm[slurm.index("--rdzv-id"):slurm.index("--rdzv-id") + 2]
        assert _normalized(slurm) == _normalized(train[1:]) and slurm[0] == "train", (slurm, train)
        # The wait for node 0's name is a shell script the kubelet leaves alone ($((...)) is no reference) and sh parses.
        assert shell[:2] == ["/bin/sh", "-c"] and 'getent hosts "$PET_MASTER_ADDR"' in shell[2] and shell[2].endswith('exec "$@"\n')
        assert subprocess.run(["sh", "-n", "-c", shell[2]], capture_output=True).returncode == 0
        assert pod.env["PET_MASTER_ADDR"] == host and pod.env["PET_NODE_RANK"] == str(k)
        assert pod.mounts["/etc/shardwise"]["configMap"]["name"] == "llama-config"
        assert pod.mounts["/workspace"]["persistentVolumeClaim"]["claimName"] == "shared"
        assert pod.mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert k8s_pods.config_maps(documents) == {"llama-config": {"run.toml": RUN_TOML}}


def test_overrides_reach_the_pod_as_written(run_dir):
    """The kubelet expands $(VAR) in args and turns $$ into $: an override with either must come through unchanged."""
    tricky = "--run.dir=runs/$(whoami) $$ $HOME"
    [pod] = k8s_pods.pods(_generate("trainjob", tricky, nodes="1"))
    assert pod.argv[-1] == tricky


def test_an_elastic_pytorchjob_and_a_one_node_job(run_dir):
    documents = _generate("pytorchjob", "--run.max_restarts=3", nodes="1:2")
    job = documents[-1]
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "c10d", "maxRestarts": 3}
    pods = k8s_pods.pods(documents)
    # The operator's own elastic variables agree with the command: node 0's endpoint, the range.
    assert len(pods) == 2 and pods[1].env["PET_NNODES"] == "1:2" and pods[1].env["PET_RDZV_ENDPOINT"] == "llama-worker-0:29400"
    at = pods[1].argv.index("--nnodes")
    assert pods[1].argv[at:at + 6] == ["--nnodes", "1:2", "--node-rank", "1", "--rdzv-endpoint", "llama-worker-0:29400"]
    single = _generate("jobset", nodes="1")
    [pod] = k8s_pods.pods(single)
    assert "--nnodes" not in pod.argv and "getent" not in pod.argv[2] and "env" not in single[-1]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("kind, path, value", [
    ("trainjob", ("spec", "trainer", "numNode"), 2),  # a typo of numNodes
    ("trainjob", ("spec", "trainer", "numNodes"), "2"),
    ("jobset", ("spec", "replicatedJobs", 0, "template", "spec", "template", "spec", "containers", 0, "volumeMount"), []),
    ("jobset", ("spec", "failurePolicy", "maxRestart"), 3),
    ("pytorchjob", ("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "imagePullPolicyy"), "Always"),
    ("pytorchjob", ("spec", "nprocPerNode"), 8),
    ("pytorchjob", ("spec", "runPolicy", "backoffLimits"), 3),
])
def test_the_pinned_models_refuse_a_field_they_do_not_know(kind, path, value, generated):
    assert k8s_check.problems(generated[kind]) == []
    doc = copy.deepcopy(generated[kind])
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    found = k8s_check.schema_problems(doc)
    assert len(found) == 1 and str(path[-1]) in found[0], found


def _set(doc: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


TRAINER_POD = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template", "spec",
               "template", "spec")
JOBSET_JOB = ("spec", "replicatedJobs", 0, "template", "spec")
WORKER = ("spec", "pytorchReplicaSpecs", "Worker")


@pytest.mark.parametrize("kind, path, value, words", [
    ("trainjob", ("metadata", "name"), "Llama", "not a DNS-1035 label"),
    ("trainjob", ("metadata", "name"), "l" * 50, "more than 63"),  # its pods: <name>-node-0-1-abcde
    ("trainjob", ("spec", "trainer", "numProcPerNode"), 0, "must be >= 1"),
    ("trainjob", ("spec", "trainer", "numNodes"), 3, "the job has 3 pod(s)"),
    ("trainjob", ("spec", "trainer", "env"), [{"name": "PET_NODE_RANK", "value": "0"}], "reserved"),
    ("trainjob", ("spec", "runtimePatches", 0, "manager"), "shardwise", "domain-prefixed"),
    ("trainjob", (*TRAINER_POD, "containers", 0, "name"), "trainer", "not in the runtime"),
    ("jobset", (*JOBSET_JOB, "completions"), 3, "parallelism = completions"),
    ("jobset", (*JOBSET_JOB, "template", "spec", "restartPolicy"), "OnFailure", "restartPolicy Never"),
    ("jobset", (*JOBSET_JOB, "podFailurePolicy", "rules", 0, "onExitCodes", "values"), [3, 2], "sorted"),
    ("jobset", ("spec", "failurePolicy", "rules", 0, "onJobFailureReasons"), ["PodFailed"], "no job failure reason"),
    ("jobset", (*JOBSET_JOB, "template", "spec", "containers", 0, "env"), None, "$(PET_NODE_RANK) is set nowhere"),
    ("jobset", (*JOBSET_JOB, "template", "spec", "containers", 0, "volumeMounts", 0, "name"), "cfg", "no volume"),
    ("pytorchjob", (*WORKER, "template", "spec", "containers", 0, "name"), "main", "named 'pytorch'"),
    ("pytorchjob", (*WORKER, "replicas"), 0, "must be >= 1"),
    ("pytorchjob", ("spec", "elasticPolicy"), {"minReplicas": 3, "maxReplicas": 2}, "min <= max"),
    ("pytorchjob", ("spec", "nprocPerNode"), "4", "nprocPerNode 4 but 8 GPU(s)"),
    ("pytorchjob", ("metadata", "labels"), {"kueue.x-k8s.io/queue-name": "-team"}, "not a label value"),
])
def test_what_only_a_webhook_or_cel_rule_would_refuse_is_refused(kind, path, value, words, generated):
    doc = _set(generated[kind], path, value)
    assert k8s_check.schema_problems(doc) == []  # the models accept each of these
    found = k8s_check.invariant_problems(doc)
    assert any(words in p for p in found), found


@pytest.mark.parametrize("args, field, words", [
    (["--gpus-per-node", "8", "--parallel.dp_shard=4"], "--gpus-per-node", "12 of them would sit idle"),
    (["--gpus-per-node", "3"], "train.global_batch", "data-parallel size(6)"),  # dp_shard=-1 takes the 2 x 3 ranks
    (["--gpus-per-node", "8", "--image", ""], "--image", "no container image"),
    (["--gpus-per-node", "8", "--name", "Llama_8B"], "--name", "DNS-1035"),
    (["--gpus-per-node", "8", "--name", "a" * 49], "--name", "at most 48 characters"),
    (["--gpus-per-node", "8", "--nodes", "1:2"], "--nodes", "no elastic policy"),
    (["--gpus-per-node", "8", "--nodes", "1:2", "--kind", "jobset"], "--nodes", "no elastic policy"),
    (["--gpus-per-node", "8", "--nodes", "1:2", "--kind", "pytorchjob"], "run.max_restarts", "elastic"),
    (["--gpus-per-node", "8", "--pvc", "shared", "--run.dir=/scratch/run"], "run.dir", "outside the volume"),
    (["--gpus-per-node", "8", "--queue", "Team A"], "--queue", "DNS-1123"),
    (["--gpus-per-node", "0"], "--gpus-per-node", "must be >= 1"),
    (["--gpus-per-node", "8", "--kind", "mpijob"], "--kind", "not one of"),
    (["--gpus-per-node", "8", "--config", "missing.toml"], "--config", "does not exist"),
    (["--gpus-per-node", "8", "--config", "latin1.toml"], "--config", "not UTF-8"),
    (["--gpu-per-node", "8"], "--gpus-per-node", "not given"),  # a typo of the option
])
def test_bad_input_is_exit_2_with_a_fix_before_anything_is_written(args, field, words, run_dir, capsys):
    (run_dir / "latin1.toml").write_bytes("# für\n".encode("latin-1"))
    argv = ["launch", "k8s", "--config", "run.toml", "--nodes", "2", "--image", "img", "--out", "job.yaml", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}: ") and words in err and "\n  fix: " in err and "Traceback" not in err, err
    assert not (run_dir / "job.yaml").exists()


def test_a_layout_of_fixed_size_that_does_not_fit_nodes_times_gpus(run_dir, capsys):
    """More ranks than N x G (the preflight of every multi-node launch, its advice in this command's words)."""
    assert main(["launch", "k8s", "--config", "run.toml", "--nodes", "2", "--gpus-per-node", "2", "--image", "img",
                 "--parallel.dp_shard=8", "--out", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: parallel: ") and "= 8 != world_size 4" in err and "(--nodes x --gpus-per-node: 4)" in err, err


def test_validate_a_file(run_dir, capsys):
    _generate("jobset")
    capsys.readouterr()
    assert main(["launch", "k8s", "--validate", "jobset.yaml"]) == 0
    out = capsys.readouterr().out
    assert "ConfigMap llama-config, JobSet llama: valid (models: kubeflow-trainer-api 2.3.0, kubernetes " in out, out
    (run_dir / "edited.yaml").write_text((run_dir / "jobset.yaml").read_text().replace("completionMode:", "completionMod:"))
    assert main(["launch", "k8s", "--validate", "edited.yaml"]) == 2
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "completionMod: unknown field" in err and "Traceback" not in err, err
    (run_dir / "broken.yaml").write_text("a: [1\n")
    assert main(["launch", "k8s", "--validate", "broken.yaml"]) == 2
    assert "is not YAML" in capsys.readouterr().err


def test_shm_is_nccls_share_and_the_loader_batches_in_flight():
    from shardwise.config import load_config
    from shardwise.launch import doctor
    from shardwise.train.loader import PREFETCH_PER_WORKER

    cfg = load_config(None, ["--data.num_workers=4", "--train.global_batch=64", "--train.seq_len=4096"])
    shm = k8s_job.shm_size(cfg, dp=2, gpus_per_node=8)
    batch = 32 * 4097 * 8  # a rank's 64 / 2 rows of seq_len + 1 int64 tokens
    assert shm.bytes == 1280 << 20 and 8 * (4 * 2 + 1) * batch < 256 << 20 and shm.quantity == "1280Mi"
    assert "8 ranks x (4 data.num_workers x 2 batches + 1) x 1.0 MiB a batch" in shm.why
    assert k8s_job.shm_size(load_config(None, []), dp=1, gpus_per_node=8).quantity == "1Gi"  # no workers: NCCL's share
    # The figures this sizing repeats stay those of the code they describe.
    assert k8s_job.LOADER_BATCHES_PER_WORKER == PREFETCH_PER_WORKER and k8s_job.NCCL_SHM_BYTES == doctor.SHM_MIN_BYTES


def test_commented_yaml_reads_back_as_the_data():
    data = {"plain": "nvidia.com/gpu", "bools": ["yes", "no", "on", "off", "y", "n", "true", "null", "~"],
            "numbers": ["8", "1e3", ".5", "0x1F", "12:30", "0755"], "ref": "$(PET_NODE_RANK)", "flags": ["--x", "--a.b=c", "-"],
            "script": "cd /x\n  indented\n\nexec \"$@\"\n", "lead": "  starts with spaces\nx", "keep": "a\n\n\n", "tab": "a\tb\nc",
            "empty": [{}, []], "nested": [{"name": "a", "list": [1, True, 0]}, [["deep"]]], "unicode": "é – ü", "": "empty key"}
    comments = {(): "head", ("script",): "why " * 60, ("nested", 0): "first", ("nested", 0, "list"): "inner"}
    text = dump_documents([(data, comments), ({"second": 1}, {})])
    assert load_documents(text) == [data, {"second": 1}]
    assert all(len(line) <= 120 for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "script: |\n  cd /x\n    indented\n" in text and "# first\n- name: a" in text


@pytest.mark.parametrize("text, want", [
    ("$(A)", "a"), ("x$(A)y$(B)", "xaybb"), ("$$(A)", "$(A)"), ("$(UNSET)", "$(UNSET)"), ("$(A", "$(A"),
    ("$$", "$"), ("$((i + 1))", "$((i + 1))"), ("$i \"$@\"", "$i \"$@\""), ("$", "$"), ("$()", "$()"), ("$$$(A)", "$a"),
])
def test_the_kubelets_expansion(text, want):
    """Cases of Kubernetes' own expansion tests (third_party/forked/golang/expansion/expand_test.go)."""
    assert k8s_pods.expand(text, {"A": "a", "B": "bb"}) == want
