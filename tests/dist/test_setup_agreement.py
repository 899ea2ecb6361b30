"""Ranks started with different settings end at once, every rank with the same error (train/agreement.py);
ranks that differ only in where their files are train. Two gloo ranks, each building its own Trainer
from its own config, as two nodes do (tests/dist/test_multinode.py runs it with two real agents)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from shardwise.config import build_config
from tests.harness import run_world

LAYOUT = [("parallel.dp_shard", "2"), ("parallel.zero", "3"), ("train.micro_batch", "4"), ("train.steps", "1")]


def _start(base, run: Path, rank_overrides) -> str | None:
    """Builds a Trainer from base + LAYOUT + this rank's overrides; the error it raised, or None after one step."""
    from shardwise.errors import ConfigError
    from shardwise.train.agreement import SetupMismatch
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, base + LAYOUT + list(rank_overrides))
    cfg.run.dir = str(run)
    try:
        trainer = Trainer(cfg, log=None)
    except ConfigError as e:
        assert isinstance(e, SetupMismatch), e.render()
        return e.render()
    trainer.train_step()
    return None


def test_ranks_that_disagree_fail_together_and_paths_may_differ(base_overrides, corpus_file, tmp_path):
    elsewhere = tmp_path / "copy" / "corpus.txt"  # the same corpus at another path, cached elsewhere: node-local
    elsewhere.parent.mkdir()
    shutil.copy(corpus_file, elsewhere)
    edited = tmp_path / "edited.txt"  # the same length, one byte changed near the end
    text = corpus_file.read_text()
    edited.write_text(text[:-10] + ("x" if text[-10] != "x" else "y") + text[-9:])

    def work(rank: int) -> list[str | None]:
        mine = {0: [], 1: [("train.lr", "1e-2"), ("parallel.dp_shard", "1"), ("parallel.dp_replicate", "2")]}[rank]
        local = [] if rank == 0 else [("data.path", str(elsewhere)), ("data.cache_dir", str(tmp_path / "cache1"))]
        data = [] if rank == 0 else [("data.path", str(edited)), ("data.cache_dir", str(tmp_path / "cache2"))]
        return [_start(base_overrides, tmp_path / "a", mine), _start(base_overrides, tmp_path / "b", local),
                _start(base_overrides, tmp_path / "c", data)]

    ranks = run_world(2, work)
    assert ranks[0] == ranks[1]  # every rank prints the same line
    layout, paths, data = ranks[0]
    # Unchecked, these ranks trained (ZeRO-3 shards at two learning rates, exit 0) or hung in their first collective.
    # Each rank names its host (one machine here: the same name twice).
    hosts = re.fullmatch(r"train\.lr: .*: 0\.003 on rank 0 \((.+)\), 0\.01 on rank 1 \((.+)\); also .*", layout.splitlines()[0])
    assert hosts and hosts.group(1) == hosts.group(2), layout
    assert layout == ("train.lr: the ranks of this job were started with different settings: 0.003 on rank 0 "
                      f"({hosts.group(1)}), 0.01 on rank 1 ({hosts.group(1)}); also parallel.dp_replicate, "
                      "parallel.dp_shard\n  fix: start every node with the same config file and the same --a.b=c "
                      "overrides, and the same corpus and tokenizer, then rerun every node; no step was taken"), layout
    assert paths is None  # another path to the same corpus and another cache: one step trained
    assert data.startswith("data.tokens_sha256: the ranks of this job were started with different settings: sha256 "), data

