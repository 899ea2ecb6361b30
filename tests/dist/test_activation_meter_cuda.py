"""The trainer's activation meter against the CUDA allocator (issue: the meter read 4.39 GiB for both full
and selective recomputation on an H100, whose peaks differ by 10 GiB).

What the meter counts — the storages autograd saves for backward, plus what selective "op"
checkpointing caches — is what stays allocated between the end of a forward and its backward, so the
allocator's growth over the forward must match it: within 10% (the allocator rounds each block to 512 B
and keeps the loss's outputs; a missed category such as the checkpoint cache is 30% or more here).
CPU: tests/dist/test_plan_validation.py compares the same meter with the planner on every layout.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU meter is validated in test_plan_validation.py)", allow_module_level=True)

from shardwise.config import load_config  # noqa: E402
from shardwise.train.data import split_inputs_targets  # noqa: E402
from shardwise.train.memory_meter import ActivationMeter  # noqa: E402
from shardwise.train.trainer import Trainer  # noqa: E402


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_meter_matches_the_allocator(tmp_path, recompute):
    cfg = load_config(None, ["--model.preset=small", "--train.seq_len=512", "--train.micro_batch=4", "--train.global_batch=4",
                             "--train.precision=bf16", f"--train.recompute={recompute}", "--data.tokenizer=byte",
                             f"--run.dir={tmp_path}", "--run.progress=false", "--train.compile=false"])
    trainer = Trainer(cfg, log=None, single_process=True)
    batch = trainer.loader.micro_batches(0)[0].to(trainer.device)
    inputs, targets = split_inputs_targets(batch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with trainer._loss_context(), ActivationMeter(exclude=trainer.inner, **trainer._cached_by_checkpoint()) as meter:
        loss = trainer._loss(inputs, targets)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert meter.bytes == pytest.approx(grown, rel=0.10), (recompute, meter.bytes, grown)
    loss.backward()
