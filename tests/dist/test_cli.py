"""The commands a user types, end to end, through real subprocesses and torch's elastic launcher."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _shardwise(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "run.progress"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip]


def test_train_two_processes_writes_a_run_and_resumes(common, tmp_path):
    run = tmp_path / "run"
    args = ["--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2",
            f"--run.dir={run}", "--checkpoint.every=3", "--checkpoint.keep=1", "--run.tensorboard=true",
            "--run.loss_curve=true"]
    first = _shardwise(["train"] + common + args + ["--train.steps=6"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run / "config.toml").is_file() and (run / "loss_curve.png").stat().st_size > 1000
    assert any((run / "tensorboard").iterdir())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 6 and {"loss", "tokens_per_s", "mfu", "mem_params_bytes"} <= records[-1].keys()
    # ZeRO-3 on 2 ranks: the local parameter shards add up to exactly the fp32 model, 4 bytes a parameter.
    from shardwise.config import load_config
    from shardwise.models import ARCHS

    per_rank = records[-1]["memory_per_rank_bytes"]
    model_cfg = load_config(run / "config.toml").model
    n_params = ARCHS[model_cfg.arch].count_params(model_cfg)
    assert len(per_rank["params"]) == 2 and sum(per_rank["params"]) == 4 * n_params
    assert sum(per_rank["optimizer"]) >= 2 * 4 * n_params  # exp_avg + exp_avg_sq, sharded
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step_00000006"], checkpoints          # keep=1 pruned step 3
    assert (run / "checkpoints" / "step_00000006" / "manifest.json").exists()
    assert (run / "checkpoints" / "step_00000006" / "tokenizer.json").exists()

    second = _shardwise(["train"] + common + args + ["--train.steps=8"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr and "at step 6" in second.stdout + second.stderr


def test_parity_command_passes_and_fails(common, tmp_path):
    ok = _shardwise(["parity", "--nproc", "2", "--steps", "6", "--out", str(tmp_path / "ok"), *common,
                     "--layout", "dp_replicate=2,train.micro_batch=4", "--layout", "dp_shard=2,zero=3,train.micro_batch=2"],
                    tmp_path)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    rows = json.loads((tmp_path / "ok" / "parity.json").read_text())
    assert [r["verdict"] for r in rows] == ["pass", "pass"] and "PASS" in ok.stdout
    # A layout that really trains differently (another learning rate) must be caught.
    bad = _shardwise(["parity", "--nproc", "2", "--steps", "6", "--out", str(tmp_path / "bad"),
                      *common, "--layout", "dp_shard=2,zero=2,train.micro_batch=4,train.lr=0.01"], tmp_path)
    assert bad.returncode == 1 and "FAIL" in bad.stdout, bad.stdout[-3000:]


def test_plan_search_emits_a_config_train_runs_unchanged(common, tmp_path):
    """`plan search --emit` for the tiny model on 2 "GPUs", then `shardwise train` on that file alone."""
    best = tmp_path / "best.toml"
    run = tmp_path / "run"
    plan = _shardwise(["plan", "search", *common, "--cluster.num_gpus=2", "--cluster.gpus_per_node=2",
                       "--train.steps=3", f"--run.dir={run}", "--checkpoint.every=0", "--top", "3", "--emit", str(best)],
                      tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"wrote {best}" in plan.stdout
    trained = _shardwise(["train", "--config", str(best), "--nproc", "2"], tmp_path)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
