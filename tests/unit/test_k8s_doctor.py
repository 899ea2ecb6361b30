"""`shardwise doctor` in a Kubernetes pod (launch/k8s_doctor.py): the pod's environment faked, name resolution
and the own-address test injected (no lookup leaves this process), and once through the doctor's own report
with its all-reduce replaced (no process is spawned)."""
from __future__ import annotations

import socket

import pytest

from shardwise.launch import doctor
from shardwise.launch.k8s_doctor import pod_checks
from shardwise.launch.nccl_log import FAIL, OK, SKIP, WARN

GIB = 1 << 30
POD = {"KUBERNETES_SERVICE_HOST": "198.51.100.1", "PET_MASTER_ADDR": "llama-node-0-0.llama", "PET_MASTER_PORT": "29500",
       "PET_NODE_RANK": "1", "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}


def _resolver(table: dict[str, list[str]]):
    def resolve(host, port, proto=0):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, proto, "", (a, 0)) for a in table[host]]
    return resolve


def _checks(env: dict, addresses: list[str] | None, own: tuple[str, ...] = (), shm: int | None = 16 * GIB) -> dict:
    table = {} if addresses is None else {env.get("PET_MASTER_ADDR") or env["PET_RDZV_ENDPOINT"].rsplit(":", 1)[0]: addresses}
    found = pod_checks(env, 2, GIB, shm_bytes=shm, hostname="llama-node-0-1", resolve=_resolver(table), binds=lambda a: a in own)
    return {name: (status, detail, advice) for name, status, detail, advice in found}


def test_outside_a_pod_nothing_is_said():
    assert pod_checks({"PET_MASTER_ADDR": "x"}, 0, GIB) == []


def test_a_pod_says_what_it_was_given_and_where_node_0_is():
    checks = _checks(POD, ["198.51.100.7"])
    status, detail, _ = checks["kubernetes"]
    assert status == OK and detail == ("in a pod (llama-node-0-1; API server 198.51.100.1); /dev/shm 16.0 GiB; 2 GPU(s) visible "
                                       "(NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b)")
    assert checks["rendezvous"] == (OK, "llama-node-0-0.llama:29500 (PET_MASTER_ADDR; this pod is node 1) resolves to 198.51.100.7", "")


@pytest.mark.parametrize("env, addresses, own, status, words", [
    ({**POD, "PET_NODE_RANK": "0"}, ["198.51.100.7"], ("198.51.100.7",), OK, "this pod's own address"),
    ({**POD, "PET_NODE_RANK": "0"}, ["198.51.100.9"], (), FAIL, "not an address of this pod"),
    (POD, None, (), WARN, "does not resolve (yet)"),
    (POD, ["127.0.1.1"], (), FAIL, "resolves to 127.0.1.1"),
    ({"KUBERNETES_SERVICE_HOST": "198.51.100.1", "PET_RDZV_ENDPOINT": "llama-worker-0:29400"}, ["198.51.100.3"], (), OK,
     "llama-worker-0:29400 (PET_RDZV_ENDPOINT) resolves to 198.51.100.3"),
])
def test_the_rendezvous_name_as_this_pod_resolves_it(env, addresses, own, status, words):
    got, detail, advice = _checks(env, addresses, own)["rendezvous"]
    assert got == status and words in detail + advice, (detail, advice)


def test_a_small_shm_and_a_one_node_pod():
    checks = _checks({"KUBERNETES_SERVICE_HOST": "198.51.100.1"}, None, shm=64 << 20)
    status, detail, advice = checks["kubernetes"]
    assert status == WARN and "/dev/shm 0.1 GiB" in detail and "medium: Memory" in advice and "shardwise launch k8s" in advice
    assert checks["rendezvous"][0] == SKIP and "one-node job" in checks["rendezvous"][1]


def test_the_doctors_report_carries_them(monkeypatch):
    """diagnose() as `shardwise doctor` runs it in a pod; its all-reduce faked. 198.51.100.7 (TEST-NET-2) resolves
    to itself, with no lookup, and is no address of this machine."""
    def fake_allreduce(backend, nproc, extra_env=None):
        return {"ok": True, "error": None, "log": "", "backend": backend, "nproc": nproc, "wall_s": 0.1, "ms_per_op": 1.0,
                "bytes": 4 << 20, "busbw_GBps": 1.0}

    monkeypatch.setattr(doctor, "run_allreduce", fake_allreduce)
    for name, value in {**POD, "PET_MASTER_ADDR": "198.51.100.7"}.items():
        monkeypatch.setenv(name, value)
    report = doctor.diagnose(2)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["kubernetes"]["detail"].startswith("in a pod (") and "GPU(s) visible" in by_name["kubernetes"]["detail"]
    assert by_name["rendezvous"]["status"] == OK and "198.51.100.7:29500 (PET_MASTER_ADDR; this pod is node 1)" in \
        by_name["rendezvous"]["detail"]
    assert "rendezvous" in doctor.render_text(report)
