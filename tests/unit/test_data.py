"""Corpus discovery, tokenizers, and layout-independent batches (shardwise.data, shardwise.train.data).
Preparation itself (shards, resume, faults, mixtures): test_prepare.py."""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardwise.config import DataConfig
from shardwise.data import corpus
from shardwise.data import tokenizer as T
from shardwise.data.corpus import corpus_files
from shardwise.data.records import iter_documents
from shardwise.data.tokenizer import load_tokenizer, tokenizer_file
from shardwise.errors import ConfigError
from shardwise.train.data import TokenBatches, prepare_data, split_inputs_targets
from shardwise.train.loader import BatchPrefetcher

EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------- discovery and reading


def test_default_corpus_is_stdlib_sorted_without_tests():
    root = corpus.stdlib_root()
    files = corpus_files("")
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any(set(r.split("/")[:-1]) & EXCLUDED for r in rel)
    assert not any(r.split("/")[-1].startswith("test_") for r in rel)
    assert "os.py" in rel and "json/__init__.py" in rel


def test_default_corpus_exclusions_on_a_fake_stdlib(tmp_path, monkeypatch):
    for rel in ["b.py", "a/z.py", "a/b.py", "a.py", "notes.txt", "test_x.py", "pkg/test_y.py", "pkg/mytest.py",
                "test/t.py", "pkg/tests/t.py", "idlelib/idle_test/t.py", "site-packages/s.py",
                "dist-packages/d.py"]:
        _write(tmp_path / rel, "x = 1\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    rel = [f.relative_to(tmp_path).as_posix() for f in corpus_files("")]
    assert rel == ["a.py", "a/b.py", "a/z.py", "b.py", "pkg/mytest.py"]


def test_user_paths_file_directory_glob_and_errors(tmp_path):
    for rel in ["d/b.txt", "d/a.md", "d/sub/c.jsonl", "d/sub/e.parquet", "d/x.bin", "d/.hidden/h.txt", "d/.h.txt"]:
        _write(tmp_path / rel, "{}")
    got = [f.relative_to(tmp_path / "d").as_posix() for f in corpus_files(str(tmp_path / "d"))]
    assert got == ["a.md", "b.txt", "sub/c.jsonl", "sub/e.parquet"]
    assert corpus_files(str(tmp_path / "d/b.txt")) == [tmp_path / "d/b.txt"]
    assert corpus_files(str(tmp_path / "d/**/*.jsonl")) == [tmp_path / "d/sub/c.jsonl"]
    for bad in ["nope.txt", "d/*.nothing"]:
        with pytest.raises(ConfigError) as e:
            corpus_files(str(tmp_path / bad))
        assert e.value.field == "data.path" and e.value.fix
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no"):
        corpus_files(str(tmp_path / "empty"))


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "corpus.txt", "hi")
    assert corpus_files("~/corpus.txt") == [tmp_path / "corpus.txt"]


def test_reading_text_jsonl_parquet(tmp_path):
    txt = _write(tmp_path / "a.txt", "héllo\nworld\n")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe end")
    jl = _write(tmp_path / "b.jsonl", '{"text": "one", "id": 1}\n\n{"text": "two"}\n{"text": ""}\n')
    pq.write_table(pa.table({"body": ["p1", None, "p2"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    docs = list(iter_documents([txt, tmp_path / "bad.txt", jl], "text"))
    assert docs == ["héllo\nworld\n", "ok \ufffd\ufffd end", "one", "two"]
    assert list(iter_documents([tmp_path / "c.parquet"], "body")) == ["p1", "p2"]


def test_missing_text_key_names_the_keys_found(tmp_path):
    jl = _write(tmp_path / "b.jsonl", '{"content": "one", "id": 1}\n')
    with pytest.raises(ConfigError) as e:
        list(iter_documents([jl], "text"))
    assert e.value.field == "data.text_key" and "content" in e.value.problem and "id" in e.value.problem
    pq.write_table(pa.table({"body": ["p1"]}), tmp_path / "c.parquet")
    with pytest.raises(ConfigError) as e:
        list(iter_documents([tmp_path / "c.parquet"], "text"))
    assert e.value.field == "data.text_key" and "body" in e.value.problem
    broken = _write(tmp_path / "broken.jsonl", "{not json\n")
    with pytest.raises(ConfigError, match="not valid JSON"):
        list(iter_documents([broken], "text"))


# ---------------------------------------------------------------- tokenizers


def _tokenizer(cfg: DataConfig, vocab: int, documents=()):
    path, _ = tokenizer_file(cfg.tokenizer, Path(cfg.cache_dir), vocab, lambda: "corpus", lambda: iter(documents))
    return load_tokenizer(path, vocab)


def test_byte_tokenizer_roundtrip(tmp_path):
    cfg = DataConfig(tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    tok = _tokenizer(cfg, 257)
    text = "def f(x):\n\treturn 'héllo wörld' 🙂  \x00\xff"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == 256 and tok.get_vocab_size() == 257
    assert len(list((tmp_path / "cache/tokenizers").glob("*.json"))) == 1
    with pytest.raises(ConfigError) as e:
        _tokenizer(cfg, 256)
    assert e.value.field == "model.vocab_size"


def _small_corpus(tmp_path: Path) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "return", "self", "value", "import"]
    for i in range(6):
        body = "\n".join(f"def f{j}(x):\n    return {words[(i + j) % 8]} + x * {j}" for j in range(40))
        _write(tmp_path / "corpus" / f"doc{i}.py", body)
    return tmp_path / "corpus"


def test_bpe_is_trained_once_and_cached(tmp_path, monkeypatch):
    cfg = DataConfig(path=str(_small_corpus(tmp_path)), tokenizer="bpe", cache_dir=str(tmp_path / "cache"))
    cold = prepare_data(cfg, 300, log=lambda _: None)
    tok = load_tokenizer(cold.tokenizer_path, 300)
    cached = list((tmp_path / "cache/tokenizers").glob("*.json"))
    assert len(cached) == 1 and 257 < tok.get_vocab_size() <= 300
    assert tok.token_to_id("<|endoftext|>") is not None
    stamp = cached[0].stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(T, "_train_bpe", no_training)
    warm = prepare_data(cfg, 300, log=lambda _: None)
    assert warm.tokenizer_path.read_text() == cold.tokenizer_path.read_text()
    assert list((tmp_path / "cache/tokenizers").glob("*.json")) == cached and cached[0].stat().st_mtime_ns == stamp
    assert not list((tmp_path / "cache/tokenizers").glob(".*"))  # no temp files left behind
    with pytest.raises(AssertionError, match="retrained"):  # another vocab size is another tokenizer
        prepare_data(cfg, 320, log=lambda _: None)


def test_tokenizer_file_errors(tmp_path):
    cache = str(tmp_path / "cache")
    with pytest.raises(ConfigError) as e:
        _tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json"), cache_dir=cache), 1000)
    assert e.value.field == "data.tokenizer"
    path = tmp_path / "tok.json"
    T.byte_tokenizer().save(str(path))
    assert _tokenizer(DataConfig(tokenizer=str(path), cache_dir=cache), 300).get_vocab_size() == 257
    with pytest.raises(ConfigError) as e:
        _tokenizer(DataConfig(tokenizer=str(path), cache_dir=cache), 200)
    assert e.value.field == "model.vocab_size" and "257" in e.value.fix


# ---------------------------------------------------------------- prepared tokens


def _all_tokens(data) -> np.ndarray:
    stream = data.sources[0].corpus.stream
    return stream.read(0, len(stream))


def test_prepare_data_byte_tokens_are_the_bytes(tmp_path):
    _write(tmp_path / "c/a.txt", "ab<|endoftext|>")
    _write(tmp_path / "c/b.jsonl", '{"text": "x"}\n{"text": "yz"}\n')
    _write(tmp_path / "c/e.txt", "")
    logs: list[str] = []
    d = prepare_data(DataConfig(path=str(tmp_path / "c"), tokenizer="byte", cache_dir=str(tmp_path / "cache")),
                     512, log=logs.append)
    want = [*b"ab<|endoftext|>", 256, *b"x", 256, *b"yz", 256]
    assert _all_tokens(d).tolist() == want and _all_tokens(d).dtype == np.uint16
    assert d.eod_id == 256 and d.tokenizer_vocab == 257 and d.num_documents == 3
    assert logs[-1].startswith("data: ") and "3 docs" in logs[-1]


def test_prepare_data_is_cached(tmp_path, monkeypatch):
    from shardwise.data import prepare as P

    cfg = DataConfig(path=str(_small_corpus(tmp_path)), tokenizer="bpe", cache_dir=str(tmp_path / "cache"))
    logs: list[str] = []
    cold = prepare_data(cfg, 300, log=logs.append)
    assert cold.num_documents == 6 and int(_all_tokens(cold)[-1]) == cold.eod_id
    assert len(list((tmp_path / "cache/prepared").glob("*/manifest.json"))) == 1

    def no_work(*a, **k):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(P, "prepare_unit", no_work)
    monkeypatch.setattr(T, "_train_bpe", no_work)
    warm = prepare_data(cfg, 300, log=logs.append)
    assert np.array_equal(_all_tokens(warm), _all_tokens(cold)) and warm.tokens_sha256 == cold.tokens_sha256
    assert warm.tokenizer_path == cold.tokenizer_path and "cached" in logs[-1]


# ---------------------------------------------------------------- batches


def _batches(n_tokens: int = 1001, seq_len: int = 10, global_batch: int = 8, seed: int = 3) -> TokenBatches:
    return TokenBatches(np.arange(n_tokens, dtype=np.uint16), seq_len, global_batch, seed)


def test_windows_and_targets():
    tb = _batches()
    assert tb.num_windows == 100
    batch = tb.global_batch_at(0)
    assert batch.shape == (8, 11) and batch.dtype == torch.int64
    for row in batch:
        start = int(row[0])
        assert start % 10 == 0 and row.tolist() == list(range(start, start + 11))
    x, y = split_inputs_targets(batch)
    assert x.shape == y.shape == (8, 10) and torch.equal(x[:, 1:], y[:, :-1])
    assert x.is_contiguous() and y.is_contiguous()


def test_order_is_deterministic_and_seeded():
    a, b, c = _batches(seed=3), _batches(seed=3), _batches(seed=4)
    for step in [0, 5, 12, 30]:
        assert torch.equal(a.global_batch_at(step), b.global_batch_at(step))
    assert not torch.equal(a.global_batch_at(0), c.global_batch_at(0))
    g = torch.Generator().manual_seed(3 * 7919 + 1)
    first_of_epoch1 = int(torch.randperm(100, generator=g)[0])  # step 12, row 4 = stream item 100 = epoch 1, pos 0
    assert int(a.global_batch_at(12)[4, 0]) == first_of_epoch1 * 10


@pytest.mark.parametrize("batch_size", [1, 2, 4])
def test_local_micro_batches_cover_the_global_batch(batch_size):
    tb = _batches(global_batch=8)
    for step in [0, 3, 12]:  # 12 spans the epoch boundary
        full = tb.global_batch_at(step)
        for micro in [m for m in (1, 2, 4, 8) if (8 // batch_size) % m == 0]:
            parts = [mb for r in range(batch_size) for mb in tb.local_micro_batches(step, r, batch_size, micro)]
            assert all(mb.shape == (micro, 11) for mb in parts)
            assert torch.equal(torch.cat(parts), full)
    with pytest.raises(ValueError):
        tb.local_micro_batches(0, 0, 3, 1)
    with pytest.raises(ValueError):
        tb.local_micro_batches(0, 0, 2, 3)


def test_epochs_wrap_and_cover_every_window_once():
    tb = _batches(n_tokens=161, seq_len=10, global_batch=4)  # 16 windows: 4 steps per epoch
    for epoch in range(3):
        starts = torch.cat([tb.global_batch_at(s)[:, 0] for s in range(4 * epoch, 4 * epoch + 4)])
        assert sorted(starts.tolist()) == list(range(0, 160, 10))
    assert not torch.equal(tb.global_batch_at(0), tb.global_batch_at(4))


def test_too_small_corpus_and_resume_checks():
    with pytest.raises(ConfigError) as e:
        _batches(n_tokens=10, seq_len=10)
    assert e.value.field == "data.path"
    with pytest.raises(ConfigError) as e:
        _batches(n_tokens=51, seq_len=10, global_batch=8)
    assert e.value.field == "train.global_batch" and "5 windows" in e.value.problem
    tb = _batches()
    state = tb.state_dict()
    assert state == {"seed": 3, "seq_len": 10, "global_batch": 8, "num_windows": 100}
    assert tb.load_state(json.loads(json.dumps(state)), 5) is None
    for key, field in [("seed", "train.seed"), ("num_windows", "data.path"), ("global_batch", "train.global_batch")]:
        with pytest.raises(ConfigError) as e:
            tb.load_state({**state, key: state[key] + 1}, 5)
        assert e.value.field == field


def test_a_stalled_batch_starts_the_workers_again_and_a_second_stall_is_an_error(tmp_path, monkeypatch, capsys):
    """A worker that never answers (made for real: it sleeps forever on its first batch) is waited for
    stalled_batch_s, then the workers start again at that step and the batch is the right one; workers that
    stall again end the rank with a line that says what to do."""
    from shardwise.train import loader

    np.save(tmp_path / "tokens.npy", (np.arange(20_000) % 300).astype(np.uint16))
    tb = TokenBatches(np.load(tmp_path / "tokens.npy", mmap_mode="r"), 16, 8, seed=3)
    hang = tmp_path / "hang-once"
    getitem = loader._RankBatches.__getitem__

    def first_one_hangs(self, step):  # runs in the forked worker
        if hang.exists():
            hang.unlink()
            time.sleep(3600)
        return getitem(self, step)
    monkeypatch.setattr(loader._RankBatches, "__getitem__", first_one_hangs)
    prefetcher = BatchPrefetcher(tb, batch_rank=0, batch_size=2, micro_batch=2, num_workers=1, total_steps=12)
    prefetcher.stalled_batch_s = 1.0
    try:
        hang.touch()
        got = prefetcher.micro_batches(3)
        assert all(torch.equal(a, b) for a, b in zip(got, tb.local_micro_batches(3, 0, 2, 2)))
        assert "no batch for step 4 in 1 s, its workers alive; starting them again" in capsys.readouterr().out
        assert all(torch.equal(a, b) for a, b in zip(prefetcher.micro_batches(4), tb.local_micro_batches(4, 0, 2, 2)))
        monkeypatch.setattr(loader._RankBatches, "__getitem__", lambda self, step: time.sleep(3600))
        with pytest.raises(RuntimeError, match="no batch for step 2 in 1 s, twice.*data.num_workers=0"):
            prefetcher.micro_batches(1)
    finally:
        prefetcher.close()


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_prefetched_batches_equal_direct_ones_for_any_worker_count(tmp_path, num_workers):
    """train/loader.py: workers prepare steps ahead, in order; asking for another step restarts them there."""
    np.save(tmp_path / "tokens.npy", (np.arange(20_000) % 300).astype(np.uint16))
    tokens = np.load(tmp_path / "tokens.npy", mmap_mode="r")
    tb = TokenBatches(tokens, 16, 8, seed=3)
    prefetcher = BatchPrefetcher(tb, batch_rank=1, batch_size=2, micro_batch=2, num_workers=num_workers, total_steps=12)
    try:
        asked = [*range(4, 12), 6, 7, 0]  # a run resumed at 4, then a restart at 6, then one at 0
        for step in asked:
            got = prefetcher.micro_batches(step)
            want = tb.local_micro_batches(step, 1, 2, 2)
            assert len(got) == len(want) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
        if num_workers:  # the batches really came from worker processes
            assert prefetcher._iterator is not None and prefetcher._iterator._num_workers == num_workers
    finally:
        prefetcher.close()
    # What a worker receives: the token file's path, not a copy of the corpus.
    assert len(pickle.dumps(tb)) < 4096 < tokens.nbytes
    clone = pickle.loads(pickle.dumps(tb))
    assert isinstance(clone.sources[0].tokens.tokens, np.memmap) and torch.equal(clone.global_batch_at(5), tb.global_batch_at(5))


# Run in a process of its own: it installs torch's SIGCHLD handler and kills a loader worker.
_WORKER_DIES_WHILE_STARTING = """
import os, sys, time
import numpy as np
from torch.utils.data import dataloader
from shardwise.train.data import TokenBatches
from shardwise.train.loader import BatchPrefetcher

reset = dataloader._MultiProcessingDataLoaderIter._reset

def reset_after_the_worker_died(self, loader, first_iter=False):
    # The workers are forked, torch's SIGCHLD handler is set, the iterator not yet complete: the moment
    # at which a worker killed (the OOM killer, or a test's SIGKILL) interrupted its construction.
    pid = self._workers[0].pid
    os.kill(pid, 9)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    time.sleep(0.1)  # SIGCHLD delivered: its handler, if unblocked, has run by now
    reset(self, loader, first_iter)

dataloader._MultiProcessingDataLoaderIter._reset = reset_after_the_worker_died
tokens = (np.arange(20_000) % 300).astype(np.uint16)
np.save(sys.argv[1], tokens)
prefetcher = BatchPrefetcher(TokenBatches(np.load(sys.argv[1], mmap_mode="r"), 16, 8, seed=3), batch_rank=0,
                             batch_size=2, micro_batch=2, num_workers=1, total_steps=12)
try:
    prefetcher.micro_batches(0)
except RuntimeError as e:
    print("raised:", e)
finally:
    prefetcher.close()
"""


def test_a_loader_worker_killed_while_the_loader_starts_fails_the_rank_without_stray_output(tmp_path):
    """A loader worker that dies while the rank builds its DataLoader iterator: torch's SIGCHLD handler
    raised inside the iterator's construction, and the half-built iterator's garbage collection then
    printed 'Exception ignored in: ..._MultiProcessingDataLoaderIter.__del__' with a traceback (9 lines
    of stderr: test_recovery.py's one-line check failed in CI of 2026-11-27). SIGCHLD is now blocked while
    the iterator is built, like the stop signals: the death is reported once it is whole, and it shuts
    down cleanly."""
    done = subprocess.run([sys.executable, "-c", _WORKER_DIES_WHILE_STARTING, str(tmp_path / "tokens.npy")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raised: DataLoader worker" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]


# Run in a process of its own, like the scripts around it: a worker dies while torch imports its profiler's
# CUPTI monitor (the first record_function of the process, which DataLoader.__next__ opens).
_WORKER_DIES_WHILE_THE_PROFILER_IMPORTS = """
import multiprocessing, os, sys, time
import numpy as np
from shardwise.train.data import TokenBatches
from shardwise.train.loader import BatchPrefetcher

class KillTheWorkerOnImport:
    # The import's window: a loader worker alive then is killed and its SIGCHLD handled inside the import.
    def find_spec(self, name, path=None, target=None):
        if name == "torch.profiler._cupti_monitor":
            for worker in multiprocessing.active_children():
                os.kill(worker.pid, 9)
                while open(f"/proc/{worker.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                    time.sleep(0.01)
                time.sleep(0.2)  # SIGCHLD delivered: torch's handler, if set, has raised by now
        return None

sys.meta_path.insert(0, KillTheWorkerOnImport())
np.save(sys.argv[1], (np.arange(20_000) % 300).astype(np.uint16))
prefetcher = BatchPrefetcher(TokenBatches(np.load(sys.argv[1], mmap_mode="r"), 16, 8, seed=3), batch_rank=0,
                             batch_size=2, micro_batch=2, num_workers=1, total_steps=12)
try:
    for step in range(12):
        prefetcher.micro_batches(step)
    print("trained")
except RuntimeError as e:
    print("raised:", e)
finally:
    prefetcher.close()
"""


def test_a_loader_worker_killed_while_torch_imports_its_profiler_leaves_no_stray_output(tmp_path):
    """The first record_function of a process (DataLoader.__next__ opens one) imports torch's CUPTI monitor and
    logs any exception raised meanwhile, traceback and all: a worker killed then, its death raised by torch's
    SIGCHLD handler inside that import, printed a warning of 9 lines beside the rank's one line (a full test
    run, tests/dist/test_recovery.py). The loader now opens one before its workers exist: nothing is left to
    import when a worker can die, and the run trains."""
    done = subprocess.run([sys.executable, "-c", _WORKER_DIES_WHILE_THE_PROFILER_IMPORTS, str(tmp_path / "tokens.npy")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]


# Run in a process of its own, like the script above. argv[2] "kill": the worker dies as the pipe breaks;
# "alive": the pipe breaks for another reason, every worker alive.
_PIPE_BREAKS_AS_THE_WORKER_DIES = """
import os, signal, sys
import numpy as np
from torch.utils.data import dataloader
from shardwise.train.data import TokenBatches
from shardwise.train.loader import BatchPrefetcher

def next_data(self):
    # What torch does 1 time in 7 here when a worker is SIGKILLed mid-batch: the dead worker's socket is
    # reset before waitpid can see it dead, so DataLoader._try_get_data re-raises the bare error.
    if sys.argv[2] == "kill":
        # torch's SIGCHLD handler would name the worker itself once the death is visible: off, so that
        # the loader's own wait is what is tested (with it on, either of the two reports first).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.kill(self._workers[0].pid, signal.SIGKILL)
    raise ConnectionResetError(104, "Connection reset by peer")

dataloader._MultiProcessingDataLoaderIter._next_data = next_data
np.save(sys.argv[1], (np.arange(20_000) % 300).astype(np.uint16))
prefetcher = BatchPrefetcher(TokenBatches(np.load(sys.argv[1], mmap_mode="r"), 16, 8, seed=3), batch_rank=0,
                             batch_size=2, micro_batch=2, num_workers=1, total_steps=12)
try:
    prefetcher.micro_batches(0)
except Exception as e:
    print(f"raised: {type(e).__name__}: {e}")
finally:
    prefetcher.close()
"""


@pytest.mark.parametrize("worker", ["kill", "alive"])
def test_a_pipe_broken_by_a_dying_loader_worker_names_the_worker(tmp_path, worker):
    """A worker killed while it hands over a batch can reset the rank's socket before it is seen dead;
    torch then re-raised ConnectionResetError, which the rank reported as "Connection reset by peer" (a
    CI run of 2026-11-27: tests/dist/test_recovery.py, 6 failures in 40 runs here). The loader now waits
    up to WORKER_EXIT_GRACE_S for the death and names the worker; with every worker alive the error is
    the original one."""
    done = subprocess.run([sys.executable, "-c", _PIPE_BREAKS_AS_THE_WORKER_DIES, str(tmp_path / "tokens.npy"),
                           worker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    if worker == "kill":
        assert re.search(r"raised: RuntimeError: DataLoader worker \(pid \d+\) exited unexpectedly: killed by SIGKILL",
                         done.stdout), done.stdout + done.stderr[-3000:]
    else:
        assert "raised: ConnectionResetError: [Errno 104] Connection reset by peer" in done.stdout, done.stdout
    assert done.stderr == "", done.stderr[-3000:]


def test_a_temp_directory_too_long_for_the_loader_workers_sockets_is_refused_before_anything_starts():
    """A loader worker's batch travels through a socket under the temp directory: past 107 bytes it failed to
    pickle in a thread that only printed the error, and the rank waited for the batch (an xdist test run's
    76-byte TMPDIR). Pre-flight refuses it while workers are asked for, with the fix."""
    from shardwise.config import build_config
    from shardwise.errors import ConfigError
    from shardwise.preflight import check_data

    cfg = build_config({}, [("data.num_workers", "2")])
    check_data(cfg, "/tmp/" + "x" * 70)  # 75 bytes: the sockets' 107 are not passed
    with pytest.raises(ConfigError, match="(?s)data.num_workers: loader workers hand batches over.*set TMPDIR"):
        check_data(cfg, "/tmp/" + "x" * 71)
    check_data(build_config({}, [("data.num_workers", "0")]), "/tmp/" + "x" * 200)  # no workers, no sockets


def test_a_tokenizer_over_the_vocab_size_is_refused_before_the_corpus_is_read(tmp_path, monkeypatch, capsys):
    """Issue 62: a tokenizer.json with more tokens than model.vocab_size is known to be too large from the file
    alone: it is refused (model.vocab_size: what the tokenizer needs) before the corpus is listed, read or
    tokenized, and `shardwise train` says so once (exit 2, no traceback)."""
    from shardwise.cli import main
    from shardwise.data import sources

    path = tmp_path / "tok.json"
    T.byte_tokenizer().save(str(path))
    corpus_dir = _write(tmp_path / "c" / "a.txt", "some text " * 50).parent

    def no_reading(*a, **k):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(sources, "corpus_files", no_reading)
    monkeypatch.setattr(sources, "detect_format", no_reading)
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(path=str(corpus_dir), tokenizer=str(path), cache_dir=str(tmp_path / "cache")), 256)
    assert e.value.field == "model.vocab_size" and "257 tokens" in e.value.problem and ">= 257" in e.value.fix
    capsys.readouterr()
    code = main(["train", "--model.preset=tiny", "--model.vocab_size=256", f"--data.path={corpus_dir}",
                 f"--data.tokenizer={path}", f"--data.cache_dir={tmp_path / 'cache'}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr()
    assert code == 2 and (err.out + err.err).count("257 tokens") == 1 and "Traceback" not in err.out + err.err
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(path))  # fits, but no end-of-document token
    with pytest.raises(ConfigError) as e:
        prepare_data(DataConfig(path=str(corpus_dir), tokenizer=str(path), cache_dir=str(tmp_path / "cache")), 256)
    assert e.value.field == "data.tokenizer" and "end-of-document" in e.value.problem
