"""`shardwise doctor --json` end to end on CPU: real gloo all-reduce across 2 fresh processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_doctor_json_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "doctor", "--json", "--nproc", "2"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)   # one JSON object and nothing else on stdout
    assert report["ok"] and report["failed"] == [] and report["backend"] == "gloo" and report["nproc"] == 2
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["all-reduce"]["status"] == "ok" and "correct" in checks["all-reduce"]["detail"]
    assert {"python", "torch", "gloo", "cpu", "/dev/shm", "ulimit -l", "infiniband", "NCCL_*/UCX_*"} <= checks.keys()
    assert report["collective"]["ok"] and report["collective"]["bytes"] == 4 << 20
    assert any("GPUDirect" in line for line in report["not_checked"])
    assert any(line.startswith("GPU health") for line in report["not_checked"])  # launch/gpu_health.py: GPUs only
    assert _left_in(tmp_path) == []


def _left_in(directory: Path) -> list[str]:
    """Processes whose working directory is `directory`: ranks inherit it, so none may remain."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(proc.name) != os.getpid() and Path(os.readlink(proc / "cwd")) == directory:
                left.append(proc.name)
        except OSError:   # gone meanwhile, or not ours to read
            pass
    return left


def test_a_failing_or_hung_all_reduce_is_reported_and_reaped(tmp_path, monkeypatch):
    from shardwise.launch import doctor

    monkeypatch.chdir(tmp_path)
    broken = doctor.run_allreduce("no-such-backend", 2)
    assert not broken["ok"] and "exited with code" in broken["error"]
    # A deadline shorter than process start: the ranks are killed, not waited for.
    monkeypatch.setattr(doctor, "COLLECTIVE_TIMEOUT_S", 0.5)
    hung = doctor.run_allreduce("gloo", 2)
    assert not hung["ok"] and "timed out" in hung["error"]
    assert _left_in(tmp_path) == []
