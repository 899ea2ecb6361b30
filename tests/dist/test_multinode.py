"""A two-node launch, for real: two `shardwise train --nnodes 2` agents on this machine meet at a c10d
rendezvous on its non-loopback address (a loopback one is refused: tests/unit/test_cli_polish.py), two
workers each, and train the same 4-rank layout bitwise like one `shardwise train --nproc 4` agent."""
from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.tp=2", "--train.micro_batch=4",
          "--train.steps=4", "--train.log_every=1", "--checkpoint.every=0"]


def _non_loopback_address() -> str | None:
    """This machine's address as another node would dial it: the host name's, else the first of
    `hostname -I` (containers often map the host name to 127.0.x.1 in /etc/hosts)."""
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        candidates += subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pass
    for addr in candidates:
        try:
            ip = ipaddress.ip_address(addr)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_loopback and not ip.is_link_local:
            return addr
    return None


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "run.progress", "train.micro_batch"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip]


def test_two_agents_train_like_one(common, tmp_path):
    addr = _non_loopback_address()
    if addr is None:
        print("skipped: this machine has no non-loopback IPv4 address for a two-node rendezvous")
        pytest.skip("no non-loopback address (a multi-node rendezvous on loopback is refused by design)")
    cli = [sys.executable, "-m", "shardwise.cli", "train", *common, *LAYOUT]
    one = subprocess.run([*cli, "--nproc", "4", f"--run.dir={tmp_path / 'one'}"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]

    # Both nodes use one run directory, as on a shared file system: node 0 locks it and writes config.toml,
    # node 1 only checks it (a second lock would refuse the job's own node 0).
    run = tmp_path / "two"
    endpoint = f"{addr}:{_free_port(addr)}"
    agents = [subprocess.Popen([*cli, "--nproc", "2", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", endpoint,
                                f"--run.dir={run}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
              for k in (0, 1)]
    try:
        outputs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    for k, (a, (out, err)) in enumerate(zip(agents, outputs)):
        assert a.returncode == 0, f"node {k}:\n{out[-2000:]}\n{err[-3000:]}"
    assert "owned by node 0" in outputs[1][0] and (run / "config.toml").is_file()
    assert json.loads((run / ".shardwise" / "lock").read_text() or "{}") == {}  # released at the end

    single, multi = _losses(tmp_path / "one"), _losses(run)
    print("step  one agent (--nproc 4)  two agents (--nnodes 2 --nproc 2)")
    for step, (a, b) in enumerate(zip(single, multi), 1):
        print(f"{step:4d}  {a!r:22}  {b!r}")
    assert len(single) == 4 and multi == single  # bitwise: same layout, same ranks, same reductions
