"""Validation data: held-out documents (data.valid_fraction, data/holdout.py), named sets ([[data.valid]]) and
the windows a validation round reads (train/evaluate.py eval_sets). One process, byte tokenizer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from shardwise.config import DataConfig, ValidSet, build_config
from shardwise.data.holdout import held_out, text_key
from shardwise.data.sources import prepare_data
from shardwise.errors import ConfigError
from shardwise.train.evaluate import eval_sets


def _quiet(_line: str) -> None:
    pass


def _docs(stream) -> list[str]:
    """A byte-tokenized stream's documents, split at the end-of-document token (256)."""
    tokens = stream.read(0, len(stream))
    ends = np.flatnonzero(tokens == 256)
    return [bytes(tokens[a + 1:b].astype(np.uint8)).decode() for a, b in zip([-1, *ends[:-1]], ends)]


def _corpus(directory: Path) -> list[str]:
    texts = [f"document {i}: " + "word " * (i % 17) for i in range(500)]
    texts += texts[:20]  # copies of 20 documents
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def _cfg(tmp_path: Path, path: Path, cache: str, **kw) -> DataConfig:
    return DataConfig(path=str(path), tokenizer="byte", cache_dir=str(tmp_path / cache), **kw)


def test_documents_are_held_out_whole_by_their_text_whatever_the_shards_and_workers(tmp_path):
    texts = _corpus(tmp_path / "c")
    small = prepare_data(_cfg(tmp_path, tmp_path / "c", "one", shard_mb=0.002, valid_fraction=0.2), 512, log=_quiet, workers=2)
    big = prepare_data(_cfg(tmp_path, tmp_path / "c", "two", shard_mb=1.0, valid_fraction=0.2), 512, log=_quiet, workers=1)
    assert len(small.sources[0].corpus.manifest["shards"]) > 4 and len(big.sources[0].corpus.manifest["shards"]) == 1
    for data in (small, big):
        train, (valid,) = _docs(data.sources[0].corpus.stream), data.valid_sets()
        held = _docs(valid.stream)
        assert valid.name == "c" and valid.field == "data.valid_fraction"
        assert sorted(train + held) == sorted(texts)  # every document once, whole
        assert not set(train) & set(held)  # a copy lands on its original's side
        assert set(held) == {t for t in texts if held_out(text_key(t), 0.2)}
    assert sorted(_docs(small.valid_sets()[0].stream)) == sorted(_docs(big.valid_sets()[0].stream))
    assert 60 <= len(set(_docs(big.valid_sets()[0].stream))) <= 140  # 20% of 500 distinct documents (sd 9)
    manifest = big.sources[0].corpus.manifest
    assert manifest["valid"]["documents"] == len(_docs(big.valid_sets()[0].stream)) and manifest["valid"]["fraction"] == 0.2
    # Without a fraction: the preparation of before (another directory), nothing held out.
    plain = prepare_data(_cfg(tmp_path, tmp_path / "c", "two", shard_mb=1.0), 512, log=_quiet)
    assert plain.valid_sets() == [] and plain.num_tokens == big.num_tokens + len(big.valid_sets()[0].stream)


def test_a_text_file_is_held_out_or_trained_on_whole_even_across_shards(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(40):
        (tmp_path / "c" / f"f{i:02d}.txt").write_text(f"file {i}\n" + "line of text\n" * (400 if i == 7 else 3))
    data = prepare_data(_cfg(tmp_path, tmp_path / "c", "cache", shard_mb=0.002, valid_fraction=0.3), 512, log=_quiet)
    train, held = _docs(data.sources[0].corpus.stream), _docs(data.valid_sets()[0].stream)
    assert len(train) + len(held) == 40 and 3 <= len(held) <= 25
    assert sum(d.startswith("file 7\n") for d in train + held) == 1  # file 7 spans shards, one document still


def test_named_sets_are_prepared_with_the_training_tokenizer_and_checked(tmp_path):
    _corpus(tmp_path / "c")
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "code.txt").write_text("def f():\n    return 1\n" * 50)
    cfg = _cfg(tmp_path, tmp_path / "c", "cache", valid=[ValidSet(path=str(tmp_path / "v"), name="code")], valid_fraction=0.1)
    data = prepare_data(cfg, 512, log=_quiet)
    assert [v.name for v in data.valid_sets()] == ["c", "code"]
    assert _docs(data.valid_sets()[1].stream) == ["def f():\n    return 1\n" * 50]
    clash = _cfg(tmp_path, tmp_path / "c", "cache", valid=[ValidSet(path=str(tmp_path / "v"), name="c")], valid_fraction=0.1)
    with pytest.raises(ConfigError, match="data.valid\\[0\\].name.*held-out part"):
        prepare_data(clash, 512, log=_quiet)
    with pytest.raises(ConfigError, match="data.valid_fraction"):
        prepare_data(_cfg(tmp_path, tmp_path / "c", "cache", valid_fraction=0.7), 512, log=_quiet)
    with pytest.raises(ConfigError, match="data.valid\\[0\\].path"):
        prepare_data(_cfg(tmp_path, tmp_path / "c", "cache", valid=[ValidSet()]), 512, log=_quiet)


def test_a_round_reads_the_same_windows_whatever_the_seed_and_refuses_a_set_too_small(tmp_path):
    _corpus(tmp_path / "c")
    data = prepare_data(_cfg(tmp_path, tmp_path / "c", "cache", valid_fraction=0.2), 512, log=_quiet)
    keys = [("train.seq_len", "16"), ("train.global_batch", "4"), ("train.micro_batch", "2"), ("eval.tokens", "100")]
    (a,) = eval_sets(data.valid_sets(), build_config({}, keys))
    (b,) = eval_sets(data.valid_sets(), build_config({}, [*keys, ("train.seed", "7")]))
    assert a.batches == 2 and a.round_tokens == 128  # 100 tokens -> whole global batches of 4 x 16
    assert np.array_equal(a.order, b.order)
    rows = np.concatenate([a.local_rows(k, r, 2).numpy() for k in range(2) for r in range(2)])
    assert len({tuple(r) for r in rows}) == 8  # 8 different windows, split over 2 ranks
    (whole,) = eval_sets(data.valid_sets(), build_config({}, keys[:3]))
    assert whole.batches == whole.windows // 4  # eval.tokens = 0: every window that fills a global batch
    with pytest.raises(ConfigError, match="data.valid_fraction.*fewer than one global batch"):
        eval_sets(data.valid_sets(), build_config({}, [("train.seq_len", "16"), ("train.global_batch", "100000")]))
    with pytest.raises(ConfigError, match="eval.every.*no validation set"):
        eval_sets([], build_config({}, [("eval.every", "10")]))


@pytest.mark.parametrize(("given", "seen"), [(None, "true"), ("false", "false")])
def test_preparing_in_process_keeps_a_tokenizer_parallelism_switch_already_set(monkeypatch, given, seen):
    """The tokenizers library sets TOKENIZERS_PARALLELISM=false in a process forked after its thread pool ran;
    turning it back on there hung the first encode (a forked test rank, 600 s). Unset, one shard may use every
    core."""
    from shardwise.data import prepare

    if given is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", given)
    monkeypatch.setattr(prepare, "default_workers", lambda: 4)
    recorded = []
    monkeypatch.setattr(prepare, "prepare_unit", lambda job, unit: recorded.append(os.environ.get("TOKENIZERS_PARALLELISM"))
                        or {"input_bytes": 0, "tokens": 0})

    class _Job:
        shard_job = None

    class _Unit:
        index = 0

    prepare._run_here(_Job(), [_Unit()], {}, type("P", (), {"update": lambda *a: None})())
    assert recorded == [seen] and os.environ.get("TOKENIZERS_PARALLELISM") == given
