"""What the ranks of a job compare when they start (train/agreement.py), and the error they all print."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np

from shardwise.config import build_config
from shardwise.errors import EXIT_BAD_INPUT
from shardwise.train.agreement import NODE_LOCAL, mismatch, setup_facts


def _facts(*overrides: tuple[str, str], tokens: str = "t" * 64, tokenizer: str = "a" * 64) -> dict:
    return setup_facts(build_config(None, list(overrides)), 10_000, tokens, tokenizer)


def test_paths_are_not_compared_but_what_they_hold_is():
    here = _facts(("data.path", "/mnt/a/corpus"), ("data.cache_dir", "/a"), ("run.dir", "/mnt/a/run"))
    there = _facts(("data.path", "/shared/corpus"), ("data.cache_dir", "/b"), ("run.dir", "/shared/run"))
    assert here == there and not NODE_LOCAL & set(here)
    assert here["data.tokens"] == 10_000 and here["train.lr"] == build_config().train.lr
    assert _facts(tokens="u" * 64) != here and _facts(tokenizer="b" * 64) != here
    assert _facts(("model.moe.top_k", "1"))["model.moe.top_k"] == 1  # nested sections are flattened


def test_the_token_digest_is_of_the_tokens_whatever_their_path(corpus_file, tmp_path):
    """The digest does not depend on the corpus's path or cache (another node's copy), is read from the
    prepared corpus's manifest on a warm start, and changes with one byte of the corpus (the same length)."""
    from shardwise.train.data import prepare_data

    def prepared(path, cache):
        return prepare_data(build_config(None, [("data.path", str(path)), ("data.tokenizer", "byte"),
                                                ("data.cache_dir", str(cache))]).data, 512, log=lambda _: None)

    first = prepared(corpus_file, tmp_path / "a")
    stream = first.sources[0].corpus.stream
    shard_digest = hashlib.sha256(np.ascontiguousarray(stream.read(0, len(stream))).tobytes()).hexdigest()
    assert first.tokens_sha256 == hashlib.sha256(shard_digest.encode()).hexdigest()  # one shard's digest, hashed
    [manifest] = (tmp_path / "a" / "prepared").glob("*/manifest.json")
    assert json.loads(manifest.read_text())["sha256"] == first.tokens_sha256
    copy = tmp_path / "copy.txt"
    shutil.copy(corpus_file, copy)
    assert prepared(copy, tmp_path / "b").tokens_sha256 == first.tokens_sha256
    text = corpus_file.read_text()
    copy.write_text(text[:-10] + ("x" if text[-10] != "x" else "y") + text[-9:])
    edited = prepared(copy, tmp_path / "c")
    assert edited.num_tokens == first.num_tokens and edited.tokens_sha256 != first.tokens_sha256


def test_the_error_names_the_first_key_each_groups_value_and_the_others():
    base = _facts()
    stale = {**base, "train.lr": 0.01, "model.n_layers": 3, "data.tokens": 9}
    error = mismatch([base, base, stale, stale, base], ["a", "a", "b", "b", "c"])
    assert error.exit_code == EXIT_BAD_INPUT and error.field == "model.n_layers"  # the config's order
    assert error.problem == (f"the ranks of this job were started with different settings: {base['model.n_layers']} on "
                             "ranks 0-1, 4 (a, c), 3 on ranks 2-3 (b); also train.lr, data.tokens")
    assert "same config file" in error.fix and "rerun every node" in error.fix


def test_digests_are_shortened_and_long_lists_cut():
    base = _facts()
    other = {**base, "data.tokens_sha256": "f" * 64, **{f"x.k{i}": i for i in range(8)}}
    error = mismatch([base, other], ["a", "b"])
    assert error.field == "data.tokens_sha256"
    assert "sha256 tttttttttttt on rank 0 (a), sha256 ffffffffffff on rank 1 (b)" in error.problem
    assert error.problem.endswith("also x.k0, x.k1, x.k2, x.k3, x.k4 and 3 more")
    assert "(unset) on rank 0" in mismatch([{"a": 1}, {"a": 1, "b": 2}], ["h", "h"]).problem
