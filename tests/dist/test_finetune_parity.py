"""Fine-tuning records on parallel layouts: `shardwise parity` against one process, each step's loss the
mean over the global batch's tokens that carry loss (data.loss_on = "completion"), packed rows of whole
records, a validation set held out of them.

Why these layouts: data parallelism (replicated and ZeRO-3) splits the step's rows between ranks that hold
different numbers of loss tokens, so a per-rank mean would differ from one device's; tensor parallelism's
loss_parallel must skip the ignored targets as F.cross_entropy does; context parallelism splits each row's
targets; the pipeline computes the loss on its last stage only. Document masking (train.document_mask)
keeps each record of a row to itself, with TP, FSDP and the pipeline. The tolerance is parity's own (loss rtol 1e-5,
parameters atol 1e-4): fp32 sums in another order.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = tmp_path_factory.mktemp("records") / "pairs.jsonl"
    with open(path, "w") as f:
        for i in range(240):
            f.write(json.dumps({"prompt": f"Q{i}: {i}+{i}=", "completion": f" {2 * i}." + " so" * (i % 9)}) + "\n")
    return path


@pytest.mark.parametrize("mask, layouts", [
    ("false", ["dp_replicate=2", "pp=2", "cp=2"]),
    ("true", ["tp=2", "dp_shard=2,zero=3", "pp=2"]),
])
def test_fine_tuning_losses_equal_one_process(records, tmp_path, mask, layouts):
    args = [sys.executable, "-m", "shardwise.cli", "parity", "--nproc", "2", "--steps", "3", "--out", str(tmp_path / "out"),
            f"--data.path={records}", "--data.tokenizer=byte", f"--data.cache_dir={tmp_path / 'cache'}",
            "--data.valid_fraction=0.1", "--model.preset=tiny", "--model.vocab_size=512", "--train.seq_len=64",
            "--train.global_batch=8", "--train.micro_batch=2", "--train.precision=fp32", f"--train.document_mask={mask}"]
    for layout in layouts:
        args += ["--layout", layout]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    rows = json.loads((tmp_path / "out" / "parity.json").read_text()) if (tmp_path / "out" / "parity.json").is_file() else []
    assert p.returncode == 0 and [r["verdict"] for r in rows] == ["pass"] * len(layouts), p.stdout[-3000:] + p.stderr[-3000:]
