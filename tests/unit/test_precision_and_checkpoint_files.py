"""Dynamic loss scaling rules and the checkpoint directory protocol (no process group needed)."""
from __future__ import annotations

import torch

from shardwise.parallel.precision import DynamicLossScaler
from shardwise.train.checkpoint import MARKER, CheckpointManager, complete_checkpoints


def test_loss_scaler_backs_off_on_overflow_and_grows_after_interval():
    s = DynamicLossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    grads = [torch.tensor([2048.0, 1024.0])]
    assert s.unscale_(grads, None) is False and torch.equal(grads[0], torch.tensor([2.0, 1.0]))
    assert s.unscale_([torch.tensor([float("inf")])], None) is True
    s.update(True)
    assert s.scale == 512.0 and s.skipped_steps == 1
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024.0
    restored = DynamicLossScaler(enabled=True)
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale and restored.good_steps == s.good_steps


def test_disabled_scaler_is_identity():
    s = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale_loss(loss) is loss and s.unscale_([torch.tensor([float("nan")])], None) is False


def _fake_checkpoint(directory, step, complete=True, suffix=""):
    path = directory / f"step_{step:08d}{suffix}"
    path.mkdir(parents=True)
    if complete:
        (path / MARKER).write_text("done")
    return path


def test_only_complete_checkpoints_are_candidates(tmp_path):
    _fake_checkpoint(tmp_path, 100)
    _fake_checkpoint(tmp_path, 200, complete=False)          # crashed before its marker
    _fake_checkpoint(tmp_path, 300, complete=False, suffix=".tmp")  # crashed mid-write
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000100"]
    assert CheckpointManager(tmp_path, keep=2).latest().name == "step_00000100"


def test_pruning_keeps_the_newest_k_complete(tmp_path):
    for step in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 50, complete=False)
    CheckpointManager(tmp_path, keep=2)._prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040", "step_00000050"]


def test_steps_sort_numerically(tmp_path):
    for step in (9, 100000000, 10):
        _fake_checkpoint(tmp_path, step)
    assert complete_checkpoints(tmp_path)[-1].name == "step_100000000"
