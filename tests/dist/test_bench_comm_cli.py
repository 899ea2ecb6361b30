"""`shardwise bench-comm` end to end: 2 gloo processes under torchrun, a tiny size range, then the
planner reading the file it wrote (cluster.calibration)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardwise.plan.calibration import OPS, SCHEMA, bus_factor


def _shardwise(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_two_gloo_processes_measure_every_op_and_calibrate_the_planner(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    run = _shardwise(["bench-comm", "--nproc", "2", "--sizes", "1K,16K", "--iters", "3", "--warmup", "1",
                      "--json", "--out", str(out), "--plot", str(png)], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = json.loads(run.stdout)
    assert printed == json.loads(out.read_text()) and png.stat().st_size > 1000
    # No layout given: one axis over both processes.
    assert printed["schema"] == SCHEMA and printed["backend"] == "gloo" and printed["axes"] == {"dp_shard": 2}
    rows = printed["results"]
    assert {(r["op"], r["bytes"]) for r in rows} == {(op, s) for op in OPS for s in (1024, 16384)}
    for r in rows:
        assert r["algbw"] == r["bytes"] / r["time_s"] / 1e9
        assert abs(r["busbw"] - r["algbw"] * bus_factor(r["op"], 2)) < 1e-12
    # A GEMM loop alone and beside a queue of all-reduces of the largest size (plan/scale.py item 4).
    overlap = printed["overlap"]
    assert overlap["axis"] == "dp_shard" and overlap["bytes"] == 16384 and overlap["slowdown"] >= 0
    assert overlap["slowdown"] == max(0.0, overlap["compute_beside_s"] / overlap["compute_alone_s"] - 1)
    plan = _shardwise(["plan", "evaluate", "--parallel.dp_shard=2", "--parallel.zero=3",
                       f"--cluster.calibration={out}"], tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "comm     measured: dp_shard; datasheet: none" in plan.stdout
    assert f"which runs {overlap['slowdown']:.1%} slower there (measured)" in plan.stdout
    # A layout that does not fill the processes is refused before anything is spawned.
    bad = _shardwise(["bench-comm", "--nproc", "2", "--parallel.tp=3"], tmp_path)
    assert bad.returncode == 2 and "error: parallel" in bad.stderr
