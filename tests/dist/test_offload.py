"""Offload to host memory and to disk (parallel.offload = "cpu" | "nvme") through the trainer.

Contract: offload changes where model states live, not the math. Both tiers run torch's fused CPU
AdamW on the same values, so "nvme" equals "cpu" bit for bit (losses and weights), on one process
(FSDP2 over a 1-rank mesh) and on two; both match the single-process reference without offload within
the parity tolerance (fused vs foreach AdamW round differently: ~1e-7 relative, tests/parity). A
resumed run continues bitwise, across tiers too; a full disk is exit code 4 before the first step; a
killed run's state directory is removed by the next run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.config import build_config
from shardwise.parity import LOSS_RTOL
from tests.harness import run_world

STEPS, CUT = 6, 3
CPU = {"parallel.offload": "cpu", "parallel.zero": 3}


def _nvme(directory: Path) -> dict:
    return {"parallel.offload": "nvme", "parallel.offload_dir": str(directory), "parallel.zero": 3}


def _cfg(base, overrides: dict, root: Path, resume: bool = False):
    cfg = build_config(None, base + [(k, str(v)) for k, v in overrides.items()] + [("train.steps", str(STEPS))])
    cfg.run.dir = str(root / "run")
    cfg.checkpoint.dir = str(root / "ckpt")
    cfg.checkpoint.resume = resume
    cfg.checkpoint.final = False
    return cfg


def _weights(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(trainer.inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


def _straight(base, overrides: dict, root: Path) -> tuple[list[float], dict]:
    from shardwise.train.trainer import Trainer

    trainer = Trainer(_cfg(base, overrides, root), log=None)
    return trainer.train(), _weights(trainer)


def _resumed(base, overrides: dict, root: Path, checkpoint_from: dict | None = None) -> list[float]:
    """CUT steps and a checkpoint (with `checkpoint_from`'s tier when given), then a fresh Trainer with
    `overrides` resumes it and runs the rest."""
    from shardwise.train.trainer import Trainer

    first = Trainer(_cfg(base, checkpoint_from or overrides, root), log=None)
    for _ in range(CUT):
        first.train_step()
    first.save_checkpoint()
    if hasattr(first.optimizer, "close"):
        first.optimizer.close()
    del first
    second = Trainer(_cfg(base, overrides, root, resume=True), log=None)
    assert second.step == CUT
    return second.train()


@pytest.fixture(scope="module")
def results(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    disk = root / "nvme"
    disk.mkdir()

    def one(rank: int) -> dict:
        out = {name: _straight(base_overrides, ov, root / f"1_{name}")
               for name, ov in (("none", {}), ("cpu", CPU), ("nvme", _nvme(disk)))}
        out["nvme_left"] = sorted(p.name for p in disk.iterdir())
        out["nvme_resumed"] = _resumed(base_overrides, _nvme(disk), root / "1_nvme_resume")
        out["nvme->cpu"] = _resumed(base_overrides, CPU, root / "1_nvme_cpu", checkpoint_from=_nvme(disk))
        out["none->nvme"] = _resumed(base_overrides, _nvme(disk), root / "1_none_nvme", checkpoint_from={})
        return out

    def two(rank: int) -> dict:
        dp2 = {"parallel.dp_shard": 2, "train.micro_batch": 4}
        return {f"dp2_{name}": _straight(base_overrides, {**dp2, **ov}, root / f"2_{name}")
                for name, ov in (("cpu", CPU), ("nvme", _nvme(disk)))}

    out = run_world(1, one)[0]
    out.update(run_world(2, two)[0])
    return out


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_nvme_is_bitwise_the_cpu_tier(results):
    for one, other in (("cpu", "nvme"), ("dp2_cpu", "dp2_nvme")):
        (la, wa), (lb, wb) = results[one], results[other]
        assert la == lb, f"{one} vs {other}: losses differ"
        assert all(wa[k].equal(wb[k]) for k in wa), f"{one} vs {other}: weights differ"


def test_offload_trains_like_one_device(results):
    reference = results["none"][0]
    for name in ("cpu", "dp2_cpu"):
        assert len(results[name][0]) == STEPS
        assert _close(results[name][0], reference) <= LOSS_RTOL, name
    assert results["nvme_left"] == [], "the state directory outlived the run"


def test_resume_is_bitwise_across_tiers(results):
    nvme = results["nvme"][0][CUT:]
    assert results["nvme_resumed"] == nvme
    assert results["nvme->cpu"] == nvme  # an nvme checkpoint resumed in host memory: the same steps
    assert _close(results["none->nvme"], results["none"][0][CUT:]) <= LOSS_RTOL  # foreach -> fused from step 4


def _train_cli(base_overrides, run_dir: Path, *extra: str, steps: int = 2) -> list[str]:
    args = [f"--{k}={v}" for k, v in base_overrides if k != "train.steps"]
    return [sys.executable, "-m", "shardwise.cli", "train", *args, f"--train.steps={steps}", f"--run.dir={run_dir}",
            "--parallel.zero=3", *extra]


def test_full_disk_is_exit_4_before_the_first_step(base_overrides, tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount (a 64 KiB tmpfs) to fill a disk")
    try:
        run = subprocess.run(_train_cli(base_overrides, tmp_path / "run", "--parallel.offload=nvme",
                                        f"--parallel.offload_dir={disk}"), capture_output=True, text=True, timeout=300)
        assert run.returncode == 4, run.stderr
        assert "No space left on device" in run.stderr and "adamw_state.bin" in run.stderr
        assert "Traceback" not in run.stderr and list(disk.iterdir()) == []
        assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_killed_runs_state_is_removed_by_the_next_run(base_overrides, tmp_path):
    disk = tmp_path / "nvme"
    disk.mkdir()
    first = subprocess.Popen(_train_cli(base_overrides, tmp_path / "a", "--parallel.offload=nvme",
                                        f"--parallel.offload_dir={disk}", steps=100000),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list(disk.glob("shardwise-*/adamw_state.bin")) and time.time() < deadline:
            time.sleep(0.2)
        assert list(disk.glob("shardwise-*")), "the run never created its state directory"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert len(list(disk.glob("shardwise-*"))) == 1  # a killed process cannot clean up
    second = subprocess.run(_train_cli(base_overrides, tmp_path / "b", "--parallel.offload=nvme",
                                       f"--parallel.offload_dir={disk}"), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "nvme offload:" in second.stdout and list(disk.iterdir()) == []
    # every metrics record carries what the disk achieved so far (parallel/offload.py IOStats)
    import json

    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["nvme_read_gbps"] > 0 and record["nvme_write_gbps"] > 0 and record["nvme_bytes_per_step"] > 0, record
