"""Shared fixtures: a small fixed corpus and the base config every distributed test starts from."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

# Forked test workers (tests/harness.py) are only safe if the parent never started a thread pool:
# one intra-op thread, and no tokenizer thread pool, in the pytest process itself.
torch.set_num_threads(1)
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# And one OpenMP thread in every process a test starts (training commands, torchrun's workers, transformers,
# benchmarks): two pytest-xdist workers each running worlds of 2-8 processes already oversubscribe the 2
# cores, and a pool of more threads spins while it waits (measured: 20 steps of configs/demo.toml on one
# process beside the suite's load: 11 CPU-s on 1 thread, 40-43 on 2). The launcher gives a single-process
# run all the cores (launch/local.py; a user's OMP_NUM_THREADS wins, as it does here).
os.environ["OMP_NUM_THREADS"] = "1"

CORPUS_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "json/decoder.py")
VALID_MODULES = ("textwrap.py", "string.py")


def _stdlib_text(tmp_path_factory, name: str, modules: tuple[str, ...]) -> Path:
    """<tmp>/<name>/<name>.txt: the given stdlib modules' source, joined."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp(name) / f"{name}.txt"
    path.write_text("\n".join((stdlib / m).read_text() for m in modules))
    return path


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    """~250 KB of real Python source (a few stdlib modules), the same on every run of a machine."""
    return _stdlib_text(tmp_path_factory, "corpus", CORPUS_MODULES)


@pytest.fixture(scope="session")
def valid_file(tmp_path_factory) -> Path:
    """A validation set of ~60 KB of other stdlib modules than the corpus's (a [[data.valid]] set)."""
    return _stdlib_text(tmp_path_factory, "valid", VALID_MODULES)


@pytest.fixture(scope="session")
def valid_overrides(valid_file) -> list[tuple[str, str]]:
    """The base config's additions for a validation set: the named set "heldout", 2 global batches per round."""
    return [("data.valid", f'[{{path = "{valid_file}", name = "heldout"}}]'), ("eval.tokens", "512")]


@pytest.fixture(scope="session")
def base_overrides(corpus_file, tmp_path_factory) -> list[tuple[str, str]]:
    """Tiny llama, byte tokenizer, seq 32, global batch 8 — small enough for 4 ranks on 2 cores. fp32 stated:
    what the trainer picks on a CPU anyway, and what the planner must then price (unset, it plans bf16 for
    its default GPU cluster)."""
    cache = tmp_path_factory.mktemp("cache")
    return [("data.path", str(corpus_file)), ("data.tokenizer", "byte"), ("data.cache_dir", str(cache)),
            ("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "32"),
            ("train.global_batch", "8"), ("train.micro_batch", "8"), ("train.steps", "20"),
            ("train.warmup_steps", "5"), ("train.lr", "3e-3"), ("train.precision", "fp32"), ("run.progress", "false"),
            ("run.tensorboard", "false"), ("run.loss_curve", "false"), ("checkpoint.final", "false"),
            ("checkpoint.resume", "false")]


@pytest.fixture()
def read_only_dir(tmp_path):
    """A directory no process can write: a read-only tmpfs as root (root ignores permission bits),
    a mode-555 directory otherwise. Skips, saying why, when root cannot mount."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                                                       capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("running as root, and mounting a read-only tmpfs failed (no CAP_SYS_ADMIN?): root writes anywhere else")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture()
def small_disk(tmp_path):
    """A directory on a 4 MiB tmpfs (root only; skips, saying why, otherwise): fills up for real."""
    path = tmp_path / "small-disk"
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs failed (no CAP_SYS_ADMIN?)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
