"""`shardwise doctor`: the NCCL log parser on fixture logs of each transport, and the machine checks
on fake inputs (no process is spawned here; tests/dist/test_doctor_cli.py runs the real thing)."""
from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.errors import ConfigError
from shardwise.launch import doctor, nccl_log
from shardwise.launch.nccl_log import FAIL, OK, SKIP, WARN

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def _log(name: str) -> str:
    return (FIXTURES / f"{name}.log").read_text()


def _by_path(verdicts: list[nccl_log.Verdict]) -> dict[str, list[nccl_log.Verdict]]:
    out: dict[str, list[nccl_log.Verdict]] = {}
    for v in verdicts:
        out.setdefault(v.path, []).append(v)
    return out


@pytest.mark.parametrize("via, kind", [("P2P/IPC", "P2P"), ("P2P/CUMEM/read", "P2P"), ("SHM/direct/direct", "SHM"),
                                       ("NET/IB/0/GDRDMA", "NET/IB+GDR"), ("NET/IB/3", "NET/IB"),
                                       ("NET/IB/1(5)/GDRDMA", "NET/IB+GDR"), ("COLLNET/0", "COLLNET"),
                                       ("NET/IBext_v8/2", "NET/IB"), ("NET/Socket/0", "NET/Socket")])
def test_transport_of_each_channel_form(via, kind):
    assert nccl_log.transport_of(via) == kind


def test_ib_with_gpudirect_rdma():
    log = nccl_log.parse(_log("ib_gdrdma"))
    assert log.version == "2.21.5+cuda12.4" and log.network == "IB" and log.nodes == 2
    assert log.ib_devices == ["mlx5_0:1/IB", "mlx5_1:1/IB"]
    assert log.transports == {"P2P": 2, "NET/IB+GDR": 4} and log.intra_types == {"NVL"}
    paths = _by_path(nccl_log.verdicts(log, ib_in_sysfs=True))
    assert [v.status for v in paths["intra-node"]] == [OK] and "NVLink" in paths["intra-node"][0].detail
    [net] = paths["inter-node"]
    assert net.status == OK and "IB with GPUDirect RDMA" in net.detail and "mlx5_0:1/IB" in net.detail


def test_ib_without_gdr_warns_and_names_the_variable():
    log = nccl_log.parse(_log("ib_no_gdr"))
    assert log.transports == {"P2P": 2, "NET/IB": 4}
    paths = _by_path(nccl_log.verdicts(log, ib_in_sysfs=True))
    assert "PCIe" in paths["intra-node"][0].detail       # graph type PIX: no NVLink between these GPUs
    [net] = paths["inter-node"]
    assert net.status == WARN and "without GPUDirect RDMA" in net.detail
    assert "NCCL_NET_GDR_LEVEL" in net.advice and "nvidia-peermem" in net.advice and "GID" not in net.advice


def test_roce_with_and_without_gdr():
    log = nccl_log.parse(_log("roce"))
    assert log.ib_devices == ["mlx5_2:1/RoCE", "mlx5_3:1/RoCE"]
    [net] = _by_path(nccl_log.verdicts(log))["inter-node"]
    assert net.status == OK and net.detail.startswith("RoCE with GPUDirect RDMA")
    without = nccl_log.parse(_log("roce").replace("/GDRDMA", ""))
    [net] = _by_path(nccl_log.verdicts(without))["inter-node"]
    assert net.status == WARN and "RoCE without" in net.detail and "NCCL_IB_GID_INDEX" in net.advice


def test_single_node_nvlink_p2p():
    log = nccl_log.parse(_log("nvlink_p2p"))
    assert log.nodes == 1 and log.transports == {"P2P": 6} and log.network == "Socket"
    paths = _by_path(nccl_log.verdicts(log))
    assert paths["intra-node"][0].status == OK and "NVLink" in paths["intra-node"][0].detail
    [net] = paths["inter-node"]
    assert net.status == SKIP and "one node" in net.detail
    # The same log on a machine whose sysfs lists HCAs: NCCL chose sockets, so the HCAs are unusable to it.
    [net] = _by_path(nccl_log.verdicts(log, ib_in_sysfs=True))["inter-node"]
    assert net.status == FAIL and "NCCL_IB_HCA" in net.advice


def test_shm_when_p2p_is_disabled():
    log = nccl_log.parse(_log("shm"))
    assert log.transports == {"SHM": 4} and log.p2p_disabled and log.ib_missing
    paths = _by_path(nccl_log.verdicts(log))
    [intra] = paths["intra-node"]
    assert intra.status == WARN and "SHM" in intra.detail and "P2P disabled" in intra.detail
    assert "NCCL_P2P_DISABLE" in intra.advice
    assert paths["inter-node"][0].status == SKIP


def test_socket_fallback_warns_without_ib_and_fails_with_it():
    log = nccl_log.parse(_log("socket_fallback"))
    assert log.transports == {"P2P": 2, "NET/Socket": 4} and log.socket_interfaces.startswith("[0]eth0")
    [net] = _by_path(nccl_log.verdicts(log))["inter-node"]
    assert net.status == WARN and "NCCL_SOCKET_IFNAME" in net.advice
    [net] = _by_path(nccl_log.verdicts(log, ib_in_sysfs=True))["inter-node"]
    assert net.status == FAIL and "although InfiniBand" in net.detail and "NCCL_IB_HCA" in net.advice


def test_a_log_without_channels_is_a_failure_and_warnings_are_kept():
    text = ("h:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n"
            "h:1:2 [0] NCCL WARN Cuda failure 'peer access is not supported between these two devices'\n")
    log = nccl_log.parse(text)
    assert log.warnings == ["Cuda failure 'peer access is not supported between these two devices'"]
    [v] = nccl_log.verdicts(log)
    assert v.status == FAIL
    assert nccl_log.verdicts(nccl_log.parse(_log("shm") + text))[-1].status == WARN


def test_gpu_paths_exercise_the_nic_by_loopback_when_one_node_never_used_it(monkeypatch):
    """On one node with HCAs, the first run connects P2P only; the doctor reruns with P2P and SHM
    disabled and judges the NIC path from that log (fed here from fixtures: no GPU needed)."""
    runs = []

    def fake_run(backend, nproc, extra_env=None):
        runs.append(dict(extra_env or {}))
        text = _log("nvlink_p2p").replace("Using network Socket", "Using network IB") if len(runs) == 1 else _log("ib_no_gdr")
        return {"ok": True, "error": None, "log": text, "backend": backend, "nproc": nproc, "wall_s": 1.0,
                "ms_per_op": 1.0, "bytes": 64 << 20, "busbw_GBps": 100.0}

    monkeypatch.setattr(doctor, "run_allreduce", fake_run)
    checks, facts = doctor.gpu_paths(2, [{"device": "mlx5_0", "port": "1", "state": "ACTIVE", "rate": None, "link_layer": "InfiniBand"}])
    assert runs[0]["NCCL_DEBUG"] == "INFO" and runs[0]["NCCL_DEBUG_FILE"] is None
    assert runs[1]["NCCL_P2P_DISABLE"] == "1" and runs[1]["NCCL_SHM_DISABLE"] == "1"
    by_name = {c.name: c for c in checks}
    assert by_name["path intra-node"].status == OK
    loopback = by_name["path inter-node (NIC loopback)"]
    assert loopback.status == WARN and "NCCL_NET_GDR_LEVEL" in loopback.advice
    assert "path inter-node" not in by_name and facts["loopback_nccl_log"]["transports"] == {"P2P": 2, "NET/IB": 4}


def test_infiniband_ports_from_sysfs(tmp_path):
    for dev, state, rate, layer in [("mlx5_0", "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
                                    ("mlx5_1", "1: DOWN", "10 Gb/sec", "Ethernet")]:
        port = tmp_path / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "rate").write_text(rate + "\n")
        (port / "link_layer").write_text(layer + "\n")
    (tmp_path / "mlx5_2" / "ports" / "1").mkdir(parents=True)   # unreadable attributes: reported as unknown
    ports = doctor.infiniband(tmp_path)
    assert [(p["device"], p["state"]) for p in ports] == [("mlx5_0", "ACTIVE"), ("mlx5_1", "DOWN"), ("mlx5_2", None)]
    check = doctor.infiniband_check(ports)
    assert check.status == WARN and "mlx5_1:1" in check.advice and "200 Gb/sec" in check.detail
    assert doctor.infiniband(tmp_path / "absent") == [] and doctor.infiniband_check([]).status == SKIP


def test_environment_report_and_steering_variables():
    check, found = doctor.env_check({"PATH": "/bin", "NCCL_IB_HCA": "mlx5_0", "UCX_TLS": "rc", "CUDA_VISIBLE_DEVICES": "0"})
    assert found == {"NCCL_IB_HCA": "mlx5_0", "UCX_TLS": "rc"} and check.status == OK
    check, _ = doctor.env_check({"NCCL_IB_DISABLE": "1"})
    assert check.status == WARN and "NCCL_IB_DISABLE" in check.advice
    assert doctor.env_check({})[0].detail.startswith("none set")


def test_cpu_shm_and_memlock_checks(monkeypatch):
    assert doctor.cpu_check(2, 16).status == OK and "data.num_workers=7 or less (2 ranks + 14 workers" in doctor.cpu_check(2, 16).detail
    assert doctor.cpu_check(8, 2).status == WARN
    assert doctor.shm_check("/nonexistent/shm").status == WARN
    monkeypatch.setattr(doctor, "SHM_MIN_BYTES", 1 << 62)
    assert "--shm-size" in doctor.shm_check("/").advice
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda _: (64 * 1024, 64 * 1024))
    assert doctor.memlock_check(rdma=True).status == WARN and doctor.memlock_check(rdma=False).status == OK
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda _: (doctor.resource.RLIM_INFINITY,) * 2)
    assert doctor.memlock_check(rdma=True).detail == "unlimited"


def test_text_report_names_failed_checks_and_what_was_not_checked():
    checks = [doctor.Check("python", OK, "3.11"), doctor.Check("all-reduce", FAIL, "rank 1 exited with code 1", "read the log")]
    report = {"nproc": 2, "backend": "gloo", "checks": [c.to_json() for c in checks], "not_checked": ["GPUDirect RDMA: no GPU"],
              "ok": False, "failed": ["all-reduce"]}
    text = doctor.render_text(report)
    assert "FAIL  rank 1 exited" in text and "all-reduce: read the log" in text and "GPUDirect RDMA: no GPU" in text
    assert text.splitlines()[-1].startswith("FAILED: all-reduce")


def test_bad_nproc_is_bad_input():
    with pytest.raises(ConfigError, match="--nproc"):
        doctor.main(["--nproc", "0"])
    from shardwise.cli import main

    assert main(["doctor", "--nproc", "-1"]) == 2


def _fake_run(text: str, ok: bool = True):
    def run(backend, nproc, extra_env=None):
        return {"ok": ok, "error": None if ok else "rank 1 exited with code 1: RuntimeError: boom", "log": text,
                "backend": backend, "nproc": nproc, "wall_s": 1.0, "ms_per_op": 1.0, "bytes": 64 << 20, "busbw_GBps": 100.0}
    return run


def test_gpu_machine_flow_and_exit_codes(monkeypatch, capsys):
    """The whole GPU branch on fake devices and a fixture log: verdicts, exit 1 naming the failed path, --nproc bounds."""
    import json

    gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 << 30} for i in range(2)]
    monkeypatch.setattr(doctor, "devices", lambda: ([doctor.Check("devices", OK, "2 GPU(s)")], gpus))
    monkeypatch.setattr(doctor, "infiniband", lambda root=doctor.IB_ROOT: [])
    monkeypatch.setattr(doctor, "run_allreduce", _fake_run(_log("nvlink_p2p")))
    report = doctor.diagnose(None)
    assert report["backend"] == "nccl" and report["nproc"] == 2 and report["ok"] and report["exit_code"] == 0
    assert report["nccl_log"]["transports"] == {"P2P": 6}
    assert any("between nodes" in line for line in report["not_checked"])
    with pytest.raises(ConfigError, match="2 GPU"):
        doctor.diagnose(3)
    monkeypatch.setattr(doctor, "run_allreduce", _fake_run(_log("socket_fallback")))
    monkeypatch.setattr(doctor, "infiniband", lambda root=doctor.IB_ROOT: [{"device": "mlx5_0", "port": "1", "state": "ACTIVE",
                                                                             "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}])
    assert doctor.main(["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == ["path inter-node"] and not out["ok"]
    monkeypatch.setattr(doctor, "run_allreduce", _fake_run("", ok=False))
    assert doctor.main([]) == 1
    assert "FAILED: all-reduce" in capsys.readouterr().out
