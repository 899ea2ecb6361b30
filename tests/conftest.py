"""Shared fixtures: a small fixed corpus and the base config every distributed test starts from."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch

# Forked test workers (tests/harness.py) are only safe if the parent never started a thread pool:
# one intra-op thread, and no tokenizer thread pool, in the pytest process itself.
torch.set_num_threads(1)
os.environ["TOKENIZERS_PARALLELISM"] = "false"

CORPUS_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "json/decoder.py")


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """~250 KB of real Python source (a few stdlib modules), the same on every run of a machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join((stdlib / m).read_text() for m in CORPUS_MODULES))
    return path


@pytest.fixture(scope="session")
def base_overrides(corpus_file, tmp_path_factory) -> list[tuple[str, str]]:
    """Tiny llama, byte tokenizer, seq 32, global batch 8 — small enough for 4 ranks on 2 cores."""
    cache = tmp_path_factory.mktemp("cache")
    return [("data.path", str(corpus_file)), ("data.tokenizer", "byte"), ("data.cache_dir", str(cache)),
            ("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "32"),
            ("train.global_batch", "8"), ("train.micro_batch", "8"), ("train.steps", "20"),
            ("train.warmup_steps", "5"), ("train.lr", "3e-3"), ("run.progress", "false"),
            ("run.tensorboard", "false"), ("checkpoint.final", "false"), ("checkpoint.resume", "false")]
