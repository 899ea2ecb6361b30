"""`mpirun -np 2 python -m shardwise.train` for real: ranks from Open MPI's own variables
(train/distributed.py rank_env), and the same losses, bit for bit, as `shardwise train --nproc 2`.

Open MPI is installed with apt-get when mpirun is missing and we are root; otherwise the test is
skipped and says why (CI: install openmpi-bin in the image to keep the install out of the test time).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.debian import require_commands


@pytest.fixture(scope="module")
def mpirun() -> str:
    return require_commands(["openmpi-bin"], ["mpirun"])["mpirun"]


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_mpirun_trains_bitwise_like_torchrun(mpirun, base_overrides, tmp_path):
    skip = {"train.steps", "train.micro_batch"}
    common = [f"--{k}={v}" for k, v in base_overrides if k not in skip]
    # ZeRO-3 over 2 ranks: the layout's collectives (all_gather, reduce_scatter) depend on the ranks being right.
    layout = common + ["--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=4", "--train.steps=6",
                       "--train.log_every=1", "--checkpoint.every=0"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    torchrun = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--nproc", "2", *layout,
                               f"--run.dir={tmp_path / 'torchrun'}"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=180, env=env)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    mpi = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                          "shardwise.train", *layout, f"--run.dir={tmp_path / 'mpirun'}"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=180, env=env)
    assert mpi.returncode == 0, mpi.stdout[-3000:] + mpi.stderr[-3000:]
    for rank in (0, 1):  # each rank says where its launcher put it
        assert f"rank {rank}/2 local {rank}/2 from openmpi: cpu, rendezvous 127.0.0.1:" in mpi.stdout, mpi.stdout
    expected, got = _losses(tmp_path / "torchrun"), _losses(tmp_path / "mpirun")
    print("step  torchrun loss          mpirun loss")
    for (step, a), (_, b) in zip(expected, got):
        print(f"{step:>4}  {a!r:<20}  {b!r}")
    assert [s for s, _ in got] == list(range(1, 7))
    assert got == expected  # bitwise: same floats, not merely close
