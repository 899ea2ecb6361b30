"""Preparing a corpus into token shards (shardwise.data): units, shards, resuming, bad records, changed
files, Megatron-format shards, and the mixture's blend. The faults that need real processes (SIGKILL,
Ctrl-C, a full disk, several preparers at once) are tests/dist/test_data_prepare.py."""
from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardwise.config import DataConfig, DataSource
from shardwise.data.mixture import Blend
from shardwise.data.prepare import prepare_unit
from shardwise.data.shards import TokenStream, index_arrays, read_index_header
from shardwise.data.sources import prepare_data
from shardwise.data.units import plan_units
from shardwise.errors import ConfigError
from shardwise.train.data import BatchSource, TokenBatches


def _jsonl(path: Path, texts, extra: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + extra)
    return path


def _cfg(tmp_path: Path, path: Path | str, **kw) -> DataConfig:
    return DataConfig(path=str(path), tokenizer=kw.pop("tokenizer", "byte"), cache_dir=str(tmp_path / kw.pop("cache", "cache")),
                      shard_mb=kw.pop("shard_mb", 0.002), **kw)


def _tree(directory: Path) -> dict[str, bytes]:
    """Every file of a prepared directory (its lock aside), by relative path."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _quiet(_line: str) -> None:
    pass


# ---------------------------------------------------------------- units and shards


def test_units_cut_big_files_at_newlines_and_pack_small_ones_whatever_the_worker_count(tmp_path):
    big = _jsonl(tmp_path / "c/a.jsonl", [f"record {i} " + "x" * (i % 37) for i in range(400)])
    (tmp_path / "c/b.txt").write_text("".join(f"line {i}\n" for i in range(3000)))
    for i in range(5):
        (tmp_path / f"c/small{i}.txt").write_text(f"small file {i}\n")
    files = sorted((tmp_path / "c").iterdir())
    units = plan_units(files, 4000)
    assert units == plan_units(files, 4000)
    for unit in units:
        assert unit.bytes <= 4000 or len(unit.pieces) == 1
        for piece in unit.pieces:
            data = Path(piece.path).read_bytes()
            assert piece.start == 0 or data[piece.start - 1:piece.start] == b"\n"  # every cut after a newline
    pieces = [p for u in units for p in u.pieces if p.path == str(big)]
    assert [p.start for p in pieces][0] == 0 and pieces[-1].stop == big.stat().st_size
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))  # the whole file, nothing twice
    text = [p for u in units for p in u.pieces if p.path.endswith("b.txt")]
    assert len(text) > 1 and [p.ends_document for p in text] == [False] * (len(text) - 1) + [True]
    smalls = [u for u in units if any("small" in p.path for p in u.pieces)]
    assert len(smalls) == 1 and len(smalls[0].pieces) >= 5  # packed into one unit


def test_a_text_file_cut_in_pieces_is_still_one_document(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c/book.txt").write_text("".join(f"sentence {i} of one long book.\n" for i in range(2000)))
    data = prepare_data(_cfg(tmp_path, tmp_path / "c"), 512, log=_quiet)
    corpus = data.sources[0].corpus
    assert len(corpus.manifest["shards"]) > 5 and corpus.documents == 1
    stream = corpus.stream
    tokens = stream.read(0, len(stream))
    assert bytes(tokens[:-1].astype(np.uint8)) == (tmp_path / "c/book.txt").read_bytes() and tokens[-1] == 256
    assert [s["open_end"] for s in corpus.manifest["shards"]][:-1] == [True] * (len(corpus.manifest["shards"]) - 1)


def test_shards_are_megatron_indexed_datasets(tmp_path):
    texts = [f"doc {i} " + "y" * i for i in range(50)]
    data = prepare_data(_cfg(tmp_path, _jsonl(tmp_path / "c.jsonl", texts)), 512, log=_quiet)
    corpus = data.sources[0].corpus
    lengths = []
    for shard in corpus.manifest["shards"]:
        idx = corpus.directory / "shards" / f"{shard['name']}.idx"
        header = read_index_header(idx)
        assert header.dtype == np.uint16 and header.documents == header.sequences + 1
        lens, ptrs, dindex = index_arrays(idx)
        assert list(dindex) == list(range(len(lens) + 1)) and list(ptrs) == [2 * x for x in np.cumsum([0, *lens[:-1]])]
        lengths += list(lens)
    assert lengths == [len(t.encode()) + 1 for t in texts]  # one sequence per document, its end token included


def test_windows_across_many_shards_read_the_concatenated_tokens(tmp_path):
    rng = np.random.default_rng(0)
    counts = [int(c) for c in rng.integers(0, 40, size=60)]
    arrays = [rng.integers(0, 500, size=c).astype(np.uint16) for c in counts]
    bins = []
    for i, a in enumerate(arrays):
        a.tofile(tmp_path / f"{i}.bin")
        bins.append(str(tmp_path / f"{i}.bin"))
    stream = TokenStream(bins, counts, np.uint16)
    whole = np.concatenate(arrays)
    assert len(stream) == len(whole) and np.array_equal(stream.read(0, len(whole)), whole)
    starts = rng.integers(0, len(whole) - 17, size=200)
    assert np.array_equal(stream.windows(starts, 17), whole[starts[:, None] + np.arange(17)].astype(np.int64))
    assert len(stream._maps) <= 64  # at most MAX_OPEN files mapped at once


# ---------------------------------------------------------------- byte-identical, resumable


def test_the_shards_do_not_depend_on_the_worker_count_and_a_rerun_finishes_only_what_is_missing(tmp_path):
    texts = [f"record {i}: " + "word " * (i % 23) for i in range(600)]
    _jsonl(tmp_path / "c/a.jsonl", texts)
    (tmp_path / "c/b.txt").write_text("free text\n" * 200)
    one = prepare_data(_cfg(tmp_path, tmp_path / "c", cache="one"), 512, log=_quiet, workers=1)
    two = prepare_data(_cfg(tmp_path, tmp_path / "c", cache="two"), 512, log=_quiet, workers=2)
    d1, d2 = one.sources[0].corpus.directory, two.sources[0].corpus.directory
    assert d1.name == d2.name and _tree(d1) == _tree(d2) and len(one.sources[0].corpus.manifest["shards"]) > 4
    # An interrupted preparation: the manifest and some shards gone, a temporary file left by a killed worker.
    shards = d2 / "shards"
    (d2 / "manifest.json").unlink()
    for name in ("00001", "00003"):
        for ext in ("bin", "idx", "json"):
            (shards / f"{name}.{ext}").unlink()
    (shards / ".00001.bin.999.tmp").write_bytes(b"half a shard")
    lines: list[str] = []
    again = prepare_data(_cfg(tmp_path, tmp_path / "c", cache="two"), 512, log=lines.append, workers=2)
    assert any("resuming" in line and "of" in line for line in lines), lines
    assert _tree(again.sources[0].corpus.directory) == _tree(d1)  # byte for byte


def test_bad_records_stop_the_preparation_naming_file_and_line_or_are_skipped_and_counted(tmp_path):
    path = _jsonl(tmp_path / "c/a.jsonl", ["one", "two"], '{"text": "three"\n{"body": "four"}\n{"text": 5}\n{"text": null}\n')
    with (tmp_path / "c/a.jsonl").open("ab") as f:
        f.write(b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8: read with U+FFFD and counted
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, path), 512, log=_quiet)
    assert e.value.field == "data.path" and f"{path}:3 is not valid JSON" in e.value.problem
    assert 'data.bad_records = "skip"' in e.value.fix
    assert not list((tmp_path / "cache/prepared").glob("*/manifest.json"))
    lines: list[str] = []
    data = prepare_data(_cfg(tmp_path, path, bad_records="skip"), 512, log=lines.append)
    records = data.sources[0].corpus.manifest["records"]
    assert records["bad"] == {"no_text": 1, "not_json": 1, "not_text": 1} and records["empty"] == 1
    assert records["invalid_utf8"] == 1 and records["first_bad"].startswith(f"{path}:3: is not valid JSON")
    assert data.num_documents == 3  # one, two, café
    summary = next(line for line in lines if line.startswith("data: prepared"))
    assert "skipped 3 bad records (1 no text field, 1 not valid JSON, 1 text is not a string)" in summary
    assert "1 records had bytes that are not UTF-8" in summary
    # A record without the key, alone: the key is named (the likely mistake), with the keys found.
    only = _jsonl(tmp_path / "d/b.jsonl", [])
    only.write_text('{"content": "x", "id": 1}\n')
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, only), 512, log=_quiet)
    assert e.value.field == "data.text_key" and f"{only}:1 has no key 'text' (found: content, id)" in e.value.problem


def test_an_empty_source_and_a_parquet_file_without_the_column_are_refused(tmp_path):
    empty = _jsonl(tmp_path / "e/empty.jsonl", [], '{"text": ""}\n\n')
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, empty), 512, log=_quiet)
    assert e.value.field == "data.path" and "holds no text" in e.value.problem
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, tmp_path / "t.parquet"), 512, log=_quiet)
    assert e.value.field == "data.text_key" and "has no column 'text' (found: body)" in e.value.problem


def _documents(data) -> list[str]:
    """A byte-tokenized corpus's documents, split at the end-of-document token (256)."""
    stream = data.sources[0].corpus.stream
    tokens = stream.read(0, len(stream))
    ends = np.flatnonzero(tokens == 256)
    return [bytes(tokens[a + 1 if i else 0:b].astype(np.uint8)).decode() for i, (a, b) in enumerate(zip([-1, *ends], ends))]


def test_parquet_row_groups_and_a_json_array_are_read_in_pieces(tmp_path):
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"text": [f"row {i}" if i % 7 else None for i in range(1000)]}), tmp_path / "c/t.parquet",
                   row_group_size=100)
    (tmp_path / "c/a.json").write_text(json.dumps([{"text": "first"}, "second", {"text": "third \u00e9"}]))
    data = prepare_data(_cfg(tmp_path, tmp_path / "c", shard_mb=0.001), 512, log=_quiet)
    assert _documents(data) == ["first", "second", "third é"] + [f"row {i}" for i in range(1000) if i % 7]
    corpus = data.sources[0].corpus
    assert corpus.manifest["records"]["empty"] == len(range(0, 1000, 7))
    assert len(corpus.manifest["shards"]) > 3  # the Parquet file's row groups went to several shards


def test_train_names_files_changed_since_the_preparation_and_data_prepare_keeps_the_old_one(tmp_path):
    path = _jsonl(tmp_path / "c/a.jsonl", ["alpha", "beta"])
    first = prepare_data(_cfg(tmp_path, tmp_path / "c"), 512, log=_quiet)
    _jsonl(tmp_path / "c/a.jsonl", ["alpha", "beta", "gamma"])
    _jsonl(tmp_path / "c/new.jsonl", ["delta"])
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, tmp_path / "c"), 512, log=_quiet)
    assert e.value.field == "data.path" and "a.jsonl (size" in e.value.problem and "new.jsonl (new)" in e.value.problem
    assert "shardwise data prepare --data.path=" in e.value.fix
    again = prepare_data(_cfg(tmp_path, tmp_path / "c"), 512, log=_quiet, refuse_changed=False)  # `data prepare`
    assert again.num_documents == 4 and first.sources[0].corpus.directory.is_dir()
    assert prepare_data(_cfg(tmp_path, tmp_path / "c"), 512, log=_quiet).num_documents == 4  # now found
    assert path.exists()


def test_the_unit_worker_writes_no_partial_shard_when_it_fails(tmp_path, monkeypatch):
    from shardwise.data import prepare as P

    path = _jsonl(tmp_path / "a.jsonl", [f"doc {i}" for i in range(200)])
    cfg = _cfg(tmp_path, path)
    data = prepare_data(cfg, 512, log=_quiet)  # a finished one, for its job's shape
    directory = tmp_path / "scratch"
    (directory / "shards").mkdir(parents=True)
    job = P.PrepareJob(directory, "a", "data.path", "data.text_key", "text", (path,), (), str(path), "k",
                       data.tokenizer_path, "sha", 257, 256, 2000, "error")
    unit = plan_units([path], 2000)[0]

    def full_disk(self, ids, items):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(P.ShardWriter, "add", full_disk)
    with pytest.raises(OSError):
        prepare_unit(job, unit)
    assert list((directory / "shards").iterdir()) == []


# ---------------------------------------------------------------- the mixture's blend


def _replay(weights: list[float], n: int) -> list[int]:
    """The blend's counts by replaying the tree's rule sample by sample (the closed form must match)."""
    blend = Blend.start([str(i) for i in range(len(weights))], weights)
    src, _ = blend.assign(np.arange(n))
    return [int((src == i).sum()) for i in range(len(weights))]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [3, 1e-3, 2, 5, 0.4]])
def test_the_blend_follows_its_weights_in_closed_form(weights):
    blend = Blend.start([str(i) for i in range(len(weights))], weights)
    src, idx = blend.assign(np.arange(5000))
    for i, w in enumerate(weights):
        mine = np.flatnonzero(src == i)
        assert list(idx[mine]) == list(range(len(mine)))  # each source's samples in order, none twice
        assert abs(len(mine) - 5000 * w / sum(weights)) <= len(weights)  # within a sample per tree level
    for n in (0, 1, 17, 999, 5000):
        assert blend.consumed(n) == _replay(weights, n)
    assert blend.consumed(10**12)[0] == pytest.approx(10**12 * weights[0] / sum(weights), rel=1e-5)  # no replay


def test_changing_the_weights_neither_repeats_nor_skips_a_sample():
    blend = Blend.start(["web", "code", "math"], [0.6, 0.3, 0.1])
    first = [blend.assign(np.arange(s * 64, (s + 1) * 64)) for s in range(30)]
    later = blend.reweighted([0.2, 0.2, 0.6], 30 * 64)
    assert later.segments[-1].base == tuple(blend.consumed(30 * 64))
    second = [later.assign(np.arange(s * 64, (s + 1) * 64)) for s in range(30, 80)]
    assert Blend.from_state(json.loads(json.dumps(later.state()))).consumed(80 * 64) == later.consumed(80 * 64)
    for i in range(3):
        taken = np.concatenate([idx[src == i] for src, idx in first + second])
        assert list(taken) == list(range(len(taken)))  # every sample of every source once, in order
    src = np.concatenate([s for s, _ in second])
    assert abs((src == 2).mean() - 0.6) < 0.01 and later.reweighted([0.2, 0.2, 0.6], 80 * 64) is later
    assert Fraction(0.6).limit_denominator(1 << 20) == Fraction(3, 5)


def test_a_mixture_reads_every_sample_once_across_a_weight_change_and_any_layout():
    def source(name, n):
        return BatchSource(name, np.arange(n, dtype=np.int64) + (10**6 if name == "b" else 0), 1.0)

    a, b = source("a", 32 * 50 + 1), source("b", 32 * 80 + 1)
    batches = TokenBatches([a, BatchSource("b", b.tokens, 3.0)], 32, 8, seed=5)
    seen = {"a": [], "b": []}

    def take(batches, step, ranks):
        rows = torch.cat([batches.local_rows(step, r, ranks) for r in range(ranks)])
        assert torch.equal(rows, batches.global_batch_at(step))  # any layout reads the same global batch
        for row in rows:
            seen["b" if row[0] >= 10**6 else "a"].append(int(row[0]) % 10**6 // 32)

    for step in range(10):
        take(batches, step, 2)
    state = json.loads(json.dumps(batches.state_dict()))
    resumed = TokenBatches([BatchSource("a", a.tokens, 1.0), BatchSource("b", b.tokens, 1.0)], 32, 8, seed=5)
    note = resumed.load_state(state, 10)
    assert note.startswith("data: mixture weights changed at step 10 (shares of the samples: a 0.25 -> 0.5, b 0.75 -> 0.5)")
    for step in range(10, 30):
        take(resumed, step, 4)  # resumed on 4 ranks instead of 2
    for name, windows in (("a", 50), ("b", 80)):
        # n samples of a source of W windows: whole passes over it, then part of one — every window read
        # n // W times, and n % W of them once more; none skipped, none read twice in one pass.
        n = len(seen[name])
        counts = np.bincount(seen[name], minlength=windows)
        assert sorted(counts.tolist()) == [n // windows] * (windows - n % windows) + [n // windows + 1] * (n % windows)
    assert resumed.consumed(30) == {"a": len(seen["a"]), "b": len(seen["b"])}


def test_a_mixture_source_read_over_more_than_its_max_epochs_is_refused(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", ["x" * 2000])
    b = _jsonl(tmp_path / "b.jsonl", ["y" * 200])
    cfg = DataConfig(sources=[DataSource(path=str(a), weight=1.0), DataSource(path=str(b), weight=1.0, max_epochs=2.0)],
                     tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, 512, log=_quiet)
    assert [s.spec.name for s in data.sources] == ["a", "b"]
    batches = TokenBatches([BatchSource(s.spec.name, s.corpus.stream, s.spec.weight, s.spec.max_epochs, s.spec.field)
                            for s in data.sources], 16, 4, seed=0)
    batches.check_epochs(12)  # 24 samples of b's 12 windows: 2 epochs
    with pytest.raises(ConfigError) as e:
        batches.check_epochs(13)
    assert e.value.field == "data.sources[1].max_epochs" and "read 2.17 times over by train.steps=13" in e.value.problem
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(path=str(a), sources=cfg.sources, tokenizer="byte"), 512, log=_quiet)
    assert e.value.field == "data.sources"


# ---------------------------------------------------------------- Megatron-LM datasets


def test_a_megatron_dataset_written_by_megatron_core_is_read_as_it_is(tmp_path):
    """Written with megatron-core's own IndexedDatasetBuilder (a test extra), not with our writer."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                  reason="megatron-core (the test extra) is not installed: pip install -e '.[test]'")
    from shardwise.data.tokenizer import byte_tokenizer

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(n)).astype(np.int64) for n in rng.integers(5, 300, size=40)]
    prefix = tmp_path / "corpus_text_document"
    builder = indexed.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.append(doc, 256), [len(doc) + 1])  # as with --append-eod
    builder.finalize(str(prefix) + ".idx")
    tokenizer = tmp_path / "tokenizer.json"
    byte_tokenizer().save(str(tokenizer))
    lines: list[str] = []
    for path in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        data = prepare_data(DataConfig(path=str(path), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache")), 512,
                            log=lines.append)
        stream = data.sources[0].corpus.stream
        assert np.array_equal(stream.read(0, len(stream)), np.concatenate([np.append(d, 256) for d in docs]))
        assert data.num_documents == 40 and data.sources[0].how == "Megatron dataset"
    assert sum("reading" in line for line in lines) == 1  # its digest and largest id, computed once and kept
    assert not (tmp_path / "cache" / "prepared").exists()  # nothing prepared: read in place
    ours = TokenBatches([BatchSource("m", stream)], 16, 4, seed=1)
    assert ours.global_batch_at(0).shape == (4, 17)
    with pytest.raises(ConfigError) as e:  # a BPE cannot be trained on tokens
        prepare_data(DataConfig(path=str(prefix), tokenizer="bpe", cache_dir=str(tmp_path / "cache")), 512, log=_quiet)
    assert e.value.field == "data.tokenizer" and "Megatron" in e.value.problem
    other = indexed.IndexedDatasetBuilder(str(tmp_path / "wide.bin"), dtype=np.uint16)
    other.add_document(np.array([1, 300, 256]), [3])  # id 300: made with another tokenizer than the byte one
    other.finalize(str(tmp_path / "wide.idx"))
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(path=str(tmp_path / "wide"), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache")),
                     512, log=_quiet)
    assert e.value.field == "data.tokenizer" and "token ids up to 300, but the tokenizer" in e.value.problem
    with open(f"{prefix}.bin", "ab") as f:  # a .bin that does not match its index
        f.write(b"\0\0")
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(path=str(prefix), tokenizer=str(tokenizer), cache_dir=str(tmp_path / "cache")), 512,
                     log=_quiet)
    assert e.value.field == "data.path" and "its index" in e.value.problem


def test_an_unreadable_parquet_row_group_is_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(300)]}), path, row_group_size=100,
                   compression="NONE")
    meta = pq.ParquetFile(path).metadata
    middle = meta.row_group(1).column(0)
    start = middle.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start:start + 64] = b"\xff" * 64  # the second row group's page header: garbage
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as e:
        prepare_data(_cfg(tmp_path, path), 512, log=_quiet)
    assert e.value.field == "data.path" and f"{path} row group 1 (rows 0-99 of it) cannot be read" in e.value.problem
    data = prepare_data(_cfg(tmp_path, path, bad_records="skip"), 512, log=_quiet)
    records = data.sources[0].corpus.manifest["records"]
    assert records["bad"] == {"unreadable": 100} and data.num_documents == 200
