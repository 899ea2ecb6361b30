"""Dynamic loss scaling rules and the checkpoint directory protocol (no process group needed)."""
from __future__ import annotations

import torch

from shardwise.parallel.precision import DynamicLossScaler
from shardwise.train import manifest as mf


def test_loss_scaler_backs_off_on_overflow_and_grows_after_interval():
    s = DynamicLossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    grads = [torch.tensor([2048.0, 1024.0])]
    assert s.unscale_(grads) is False and torch.equal(grads[0], torch.tensor([2.0, 1.0]))
    assert s.unscale_([torch.tensor([float("inf")])]) is True
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
    assert s.scale_loss(loss) is loss and s.unscale_([torch.tensor([float("nan")])]) is False


def _fake_checkpoint(directory, step, complete=True, suffix="", good=True, legacy=False):
    path = directory / f"step_{step:08d}{suffix}"
    path.mkdir(parents=True)
    if complete and legacy:
        (path / mf.LEGACY_MARKER).write_text("done")
    elif complete:
        mf.write_manifest(path, {"format": mf.FORMAT, "step": step, "good": good, "files": {}})
    return path


def test_only_complete_checkpoints_are_candidates(tmp_path):
    _fake_checkpoint(tmp_path, 100)
    _fake_checkpoint(tmp_path, 150, legacy=True)            # written before manifests: complete
    _fake_checkpoint(tmp_path, 200, complete=False)          # crashed before its manifest
    _fake_checkpoint(tmp_path, 300, complete=False, suffix=".tmp")  # crashed mid-write
    _fake_checkpoint(tmp_path, 400, suffix=".corrupt")      # set aside: never loaded
    assert [p.name for p in mf.complete_checkpoints(tmp_path)] == ["step_00000100", "step_00000150"]


def test_pruning_keeps_the_newest_k_complete(tmp_path):
    for step in (10, 20, 30, 40):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 50, complete=False)
    for old in mf.to_prune(mf.complete_checkpoints(tmp_path), keep=2):
        mf.remove(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000030", "step_00000040", "step_00000050"]


def test_pruning_never_deletes_the_newest_good_checkpoint(tmp_path):
    """Checkpoints written during a streak of skipped (non-finite) steps are not good: the newest
    good one survives however many of them follow, and while the streak runs (the newest checkpoint is
    bad) so does the good one before it: the newest good one may hold the weights the streak came from."""
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20)
    for step in (30, 40, 50):
        _fake_checkpoint(tmp_path, step, good=False)
    doomed = mf.to_prune(mf.complete_checkpoints(tmp_path), keep=2)
    assert [p.name for p in doomed] == ["step_00000030"]
    _fake_checkpoint(tmp_path, 60)  # the streak ended: only the newest good one is kept beyond `keep`
    doomed = mf.to_prune(mf.complete_checkpoints(tmp_path), keep=2)
    assert [p.name for p in doomed] == ["step_00000010", "step_00000020", "step_00000030", "step_00000040"]


def test_steps_sort_numerically(tmp_path):
    for step in (9, 100000000, 10):
        _fake_checkpoint(tmp_path, step)
    assert mf.complete_checkpoints(tmp_path)[-1].name == "step_100000000"


def test_a_pipeline_stage_is_gathered_to_host_memory_one_tensor_at_a_time(monkeypatch):
    """run.save_final_model under pipeline parallelism: a stage's weights are made whole one tensor at a
    time and kept in host memory. Asking torch for the whole state dict unsharded without its offload (the
    offload keeps them on global rank 0 only) held every gathered tensor on the device at once: ~35 GB of
    fp32 for a 70B stage of pp=8 on a GPU full with training. A CUDA-only failure; the decision is tested
    here (the gathering itself by the parity matrix's pipeline layouts with ZeRO-3 and TP)."""
    from torch import nn

    from shardwise.train import full_model

    asked = []

    def state_dict(model, options=None):
        asked.append(options)
        return {"b": torch.ones(2), "a": torch.zeros(3)}

    monkeypatch.setattr(full_model, "get_model_state_dict", state_dict)
    assert full_model.gather_pipeline_state(nn.Linear(1, 1), {}, {}, None, 1, in_rank0_pipeline=False) == {}
    assert asked and all(o is None or not o.full_state_dict for o in asked)
    on_host = full_model.full_tensors_on_host(nn.Linear(1, 1))
    assert list(on_host) == ["a", "b"] and all(t.device.type == "cpu" for t in on_host.values())


def test_a_save_that_fails_for_neither_disk_nor_memory_raises_the_rank_s_own_error(tmp_path, monkeypatch):
    """DCP wraps each rank's error in CheckpointException, a BaseException: the entry points' `except Exception`
    let it through as a traceback (a data-loader worker killed during a save, tests/dist/test_recovery.py).
    The save raises the rank's own error instead, so it is a crash like any other: one line."""
    import pytest
    from torch.distributed.checkpoint.api import CheckpointException

    from shardwise.train import checkpoint as ck
    from shardwise.train.control import Control

    died = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed.")

    def failing_save(state, checkpoint_id, **kwargs):
        raise CheckpointException("save", {0: (died, None)})

    monkeypatch.setattr(ck.dcp, "save", failing_save)
    manager = ck.CheckpointManager(tmp_path / "checkpoints", keep=2, control=Control(False, 10), log=lambda _: None)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError) as raised:
        manager.save(2, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, {}, {})
    assert raised.value is died and isinstance(raised.value.__cause__, CheckpointException)
    assert not mf.complete_checkpoints(tmp_path / "checkpoints")  # nothing published as a checkpoint
    assert not list((tmp_path / "checkpoints").iterdir())  # nor its partial step_2.tmp left holding the disk
    assert ck._rank_error(CheckpointException("save", {3: (died, None), 1: (OSError(5, "x"), None)}), 0) is not died
    assert ck._rank_error(CheckpointException("save", {3: (died, None)}), 0) is died  # another rank's, on a rank that did not fail


def test_a_step_on_disk_already_is_not_written_again_and_says_so(tmp_path):
    """A final save right after a periodic one, or a run resumed at its last step, finds the step on disk: the
    save writes nothing and returns written=False, so the trainer's line does not say "saved" (it did)."""
    from shardwise.train import checkpoint as ck
    from shardwise.train.control import Control

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = ck.CheckpointManager(tmp_path / "checkpoints", keep=2, control=Control(False, 10), log=lambda _: None)
    path, written = manager.save(2, model, optimizer, {"step": 2}, {}, {"good": True})
    assert written and mf.is_complete(path)
    manifest = (path / "manifest.json").read_bytes()
    assert manager.save(2, model, optimizer, {"step": 2}, {}, {"good": True}) == (path, False)
    resumed = ck.CheckpointManager(tmp_path / "checkpoints", keep=2, control=Control(False, 10), log=lambda _: None)
    assert resumed.load_newest(model, optimizer)[0] == path
    assert resumed.save(2, model, optimizer, {"step": 2}, {}, {"good": True}) == (path, False)
    assert (path / "manifest.json").read_bytes() == manifest  # not rewritten
