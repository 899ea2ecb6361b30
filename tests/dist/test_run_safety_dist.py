"""Divergence and checkpoint integrity on 2 gloo ranks (ZeRO-3, each rank holding a shard).

- A step that is not finite on one rank is skipped on every rank: parameters and optimizer state stay
  bitwise what they were; a streak of them stops the run (Diverged, reported by rank 0 only);
  non-finite weights are never checkpointed.
- A damaged newest checkpoint (truncated shard, crafted .metadata that would run code) is set aside
  and the previous one resumed; the losses then continue the uninterrupted run bitwise.
- A save that fills the disk fails on every rank, leaves no partial checkpoint and the older intact.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest

from shardwise.config import build_config
from tests.harness import run_world

ZERO3 = [("parallel.dp_shard", "2"), ("parallel.zero", "3"), ("train.micro_batch", "2")]


def _trainer(base, run: Path, extra=(), **kw):
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, base + ZERO3 + list(extra))
    cfg.run.dir = str(run)
    return Trainer(cfg, log=None, **kw)


def _local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def _snapshot(trainer) -> list:
    params = [_local(p) for p in trainer.params]
    optim = [_local(v) for p in trainer.params for v in trainer.optimizer.state.get(p, {}).values() if hasattr(v, "shape")]
    return params + optim


def _poison_gradients(trainer, rank: int, steps: set[int]) -> None:
    """After backward, fill one gradient shard of `rank` with NaN on the given (0-based) steps."""
    original = trainer._accumulate

    def accumulate(micro):
        loss = original(micro)
        if trainer.step in steps and trainer.rank == rank:
            grad = next(p.grad for p in trainer.params if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(math.nan)
        return loss

    trainer._accumulate = accumulate


def _divergence_cases(base, root: Path, rank: int) -> dict:
    import torch.distributed as dist

    from shardwise.errors import Diverged

    out = {}
    # 1. one poisoned step on rank 1: skipped everywhere, state bitwise unchanged, counted
    t = _trainer(base, root / "skip")
    t.train_step()
    _poison_gradients(t, rank=1, steps={1})
    before = _snapshot(t)
    r = t.train_step()
    after = _snapshot(t)
    out["skipped"] = r.skipped and t.step == 2
    out["unchanged"] = len(before) > 0 and all(a.equal(b) for a, b in zip(before, after))
    out["resumes_after"] = not t.train_step().skipped and not all(a.equal(b) for a, b in zip(after, _snapshot(t)))
    # 2. a streak of max_skipped_steps stops the run on every rank; rank 0 reports it
    t = _trainer(base, root / "streak", [("train.steps", "10"), ("train.max_skipped_steps", "3"), ("train.log_every", "5"),
                                         ("checkpoint.every", "2"), ("checkpoint.final", "true")])
    _poison_gradients(t, rank=0, steps={3, 4, 5})
    try:
        t.train()
        out["diverged"] = None
    except Diverged as e:
        out["diverged"] = (e.exit_code, e.report, e.message, t.step)
    dist.barrier()
    if rank == 0:
        lines = (root / "streak" / "metrics.jsonl").read_text().splitlines()
        out["records"] = [json.loads(line) for line in lines]
        ckpts = root / "streak" / "checkpoints"
        out["checkpoints"] = sorted(p.name for p in ckpts.iterdir())
        out["good"] = {p.name: json.loads((p / "manifest.json").read_text())["good"] for p in ckpts.iterdir()}
    # 3. non-finite weights are never written
    t = _trainer(base, root / "infweights", [("checkpoint.every", "1")])
    t.train_step()
    if rank == 1:
        _local_view = t.params[0].to_local() if hasattr(t.params[0], "to_local") else t.params[0]
        _local_view.detach().fill_(math.inf)
    try:
        t.save_checkpoint()
        out["inf_saved"] = True
    except Diverged as e:
        out["inf_saved"] = False
        out["inf_report"] = e.report
    dist.barrier()
    out["inf_dirs"] = sorted(os.listdir(root / "infweights" / "checkpoints")) if (root / "infweights" / "checkpoints").exists() else []
    return out


@pytest.fixture(scope="module")
def divergence(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("divergence")
    return run_world(2, lambda rank: _divergence_cases(base_overrides, root, rank))


def test_a_non_finite_step_is_skipped_everywhere_with_state_unchanged(divergence):
    for rank, out in enumerate(divergence):
        assert out["skipped"], f"rank {rank} did not skip the step rank 1 poisoned"
        assert out["unchanged"], f"rank {rank}: parameters or optimizer state changed on a skipped step"
        assert out["resumes_after"], f"rank {rank}: the next finite step did not update"


def test_a_streak_of_skipped_steps_stops_the_run(divergence):
    codes = [out["diverged"] for out in divergence]
    assert all(c is not None and c[0] == 3 for c in codes), codes
    assert [c[1] for c in codes] == [True, False], "exactly rank 0 reports"
    assert "3 steps in a row" in codes[0][2] and "(steps 4-6" in codes[0][2] and "step_00000002" in codes[0][2]
    assert all(c[3] == 6 for c in codes)
    records = {r["step"]: r for r in divergence[0]["records"]}
    assert [records[s]["skipped"] for s in (4, 5, 6)] == [1, 1, 1] and records[6]["skipped_steps"] == 3
    assert records[4]["grad_norm"] is None and records[4]["nonfinite"] == ["grad_norm"]
    # step 2 was good; step 4 and 6 fell in the streak: none was written at 6 (the run stopped first),
    # and the checkpoint of step 4 is marked not good, and set aside at the divergence (never resumed)
    assert divergence[0]["checkpoints"] == ["step_00000002", "step_00000004.diverged"]
    assert divergence[0]["good"] == {"step_00000002": True, "step_00000004.diverged": False}


def test_non_finite_weights_are_never_checkpointed(divergence):
    assert [out["inf_saved"] for out in divergence] == [False, False]
    assert [out["inf_report"] for out in divergence] == [True, False]
    assert divergence[0]["inf_dirs"] == []


# ---------------------------------------------------------------- damaged checkpoints

def _damage_and_resume(base, root: Path, rank: int) -> dict:
    import torch.distributed as dist

    straight = _trainer(base, root / "straight", [("train.steps", "6"), ("checkpoint.final", "false")]).train()
    first = _trainer(base, root / "source", [("train.steps", "4"), ("checkpoint.every", "2"), ("checkpoint.final", "true")])
    first.train()
    out = {"straight": straight}
    marker = root / "code-ran"
    for name in ("truncated", "crafted_metadata"):
        run = root / name
        if rank == 0:
            shutil.copytree(root / "source" / "checkpoints", run / "checkpoints")
            newest = run / "checkpoints" / "step_00000004"
            if name == "truncated":
                shard = sorted(newest.glob("*.distcp"))[0]
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            else:
                class RunsCode:
                    def __reduce__(self):
                        return (os.system, (f"touch {marker}",))
                (newest / ".metadata").write_bytes(pickle.dumps(RunsCode()))
        dist.barrier()
        t = _trainer(base, run, [("train.steps", "6"), ("checkpoint.resume", "true"), ("checkpoint.final", "false")])
        out[name] = {"resumed_at": t.step, "losses": t.train(),
                     "dirs": sorted(p.name for p in (run / "checkpoints").iterdir())}
    out["code_ran"] = marker.exists()
    return out


@pytest.fixture(scope="module")
def damaged(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    return run_world(2, lambda rank: _damage_and_resume(base_overrides, root, rank))


@pytest.mark.parametrize("name", ["truncated", "crafted_metadata"])
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_resumes_bitwise(damaged, name):
    for out in damaged:
        case = out[name]
        assert case["resumed_at"] == 2, "the damaged step 4 must not be loaded"
        assert "step_00000004.corrupt" in case["dirs"] and "step_00000004" not in case["dirs"]
        assert case["losses"] == out["straight"][2:], "resumed losses differ from the uninterrupted run"
    assert not damaged[0]["code_ran"], "a crafted .metadata ran code on resume"


# ---------------------------------------------------------------- full disk

def _fill_disk(base, root: Path, ckpt_dir: Path, rank: int) -> dict:
    from shardwise.errors import StorageFailure

    t = _trainer(base, root / "run", [("train.steps", "6"), ("checkpoint.every", "2"), ("checkpoint.keep", "5"),
                                      ("checkpoint.dir", str(ckpt_dir))])
    try:
        t.train()
        return {"failed": None}
    except StorageFailure as e:
        return {"failed": (e.exit_code, e.report, e.message, t.step)}


def test_a_full_disk_fails_the_save_everywhere_and_keeps_the_older_checkpoint(base_overrides, tmp_path, small_disk):
    ckpt = small_disk / "checkpoints"
    results = run_world(2, lambda rank: _fill_disk(base_overrides, tmp_path, ckpt, rank))
    failed = [r["failed"] for r in results]
    assert all(f is not None and f[0] == 4 for f in failed), failed
    assert sum(f[1] for f in failed) == 1, "one rank reports"
    message = next(f[2] for f in failed if f[1])
    assert "No space left on device" in message and "step_00000002 is intact" in message
    left = sorted(p.name for p in ckpt.iterdir())
    assert left[0] == "step_00000002" and not any(name.endswith(".tmp") for name in left), left
    from shardwise.train.checkpoint import verify_directory

    assert [status for _, status, _ in verify_directory(ckpt)] == ["OK"] * len(left)
