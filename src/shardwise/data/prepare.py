"""Preparing a corpus: its units (data/units.py) tokenized by N worker processes, each unit one shard.

Each worker loads its own tokenizer, streams its unit's documents (data/records.py), and writes the
tokens to its shard as they come (data/shards.py ShardWriter): a worker holds one encode batch
(ENCODE_CHARS of text) and its tokens at a time, and the parent a list of the units, so memory does not
grow with the corpus. The units do not depend on the number of workers, so neither do the shards.

Resumable: a shard is done once its NNNNN.json is written (after its .bin and .idx). A preparation that
is killed, interrupted or runs out of disk keeps its finished shards and leaves no partial one (a
failing worker removes its temporary files; a killed one's are removed by the next run, which holds the
lock); the rerun prepares only the missing shards, and the result is byte for byte the same. The
manifest is written last, atomically.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.finetune import FINETUNE_DTYPE, RecordEncoder, item_key
from shardwise.data.holdout import file_key, held_out, text_key
from shardwise.data.prepared import (
    FORMAT,
    MANIFEST,
    SHARDS,
    TOKENIZER,
    VALID,
    PreparedCorpus,
    PrepareLock,
    open_prepared,
    read_manifest,
)
from shardwise.data.publish import TMP_SUFFIX, publish_bytes
from shardwise.data.records import BAD_KINDS, BadRecord, RecordStats, piece_documents
from shardwise.data.shards import ShardWriter, token_dtype
from shardwise.data.units import Unit, plan_units
from shardwise.errors import EXIT_SIGINT, ConfigError, Interrupted, interrupt_exit_code, storage_failure
from shardwise.orphans import exit_with_parent

# Text handed to the tokenizer per call: large enough that a call's overhead is nothing, small enough that
# the batch, its Encoding objects and its tokens stay a few tens of MB per worker.
ENCODE_CHARS = 1_000_000
# Without a terminal the progress line is printed this often (a terminal's is redrawn every second).
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class ShardJob:
    """What a worker needs to write a unit's shard (sent with every unit: small, whatever the corpus)."""

    directory: Path
    text_key: str
    tokenizer_path: Path
    vocab: int
    eod: int
    policy: str
    valid_fraction: float = 0.0
    fmt: str = "text"  # or a fine-tuning format (data/finetune.py)

    @property
    def dtype(self) -> np.dtype:
        return FINETUNE_DTYPE if self.fmt != "text" else token_dtype(self.vocab)


@dataclass(frozen=True)
class PrepareJob:
    """One corpus to prepare into `directory`, with the tokenizer the run uses."""

    directory: Path
    label: str  # how lines name it: the source's name and path
    field: str  # the config key of its path (data.path, data.sources[1].path)
    key_field: str  # and of its text key (data.text_key, data.sources[1].text_key)
    text_key: str
    files: tuple[Path, ...]
    fingerprints: tuple[dict, ...]
    source_path: str
    corpus: str  # prepared.corpus_key
    tokenizer_path: Path
    tokenizer_sha256: str
    vocab: int
    eod: int
    shard_bytes: int
    policy: str
    valid_fraction: float = 0.0
    fmt: str = "text"

    @property
    def dtype(self) -> np.dtype:
        return self.shard_job.dtype

    @property
    def shard_job(self) -> ShardJob:
        return ShardJob(self.directory, self.text_key, self.tokenizer_path, self.vocab, self.eod, self.policy,
                        self.valid_fraction, self.fmt)


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------- worker side


def _worker_init() -> None:
    """A worker ignores Ctrl-C (its parent stops it, after cleaning up) and dies with its parent. Each runs
    its tokenizer on one thread: N workers use N cores."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked with the parent's handler (_sigterm_stops)
    exit_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the library's own switch, read when it encodes


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    tok.encode_special_tokens = True  # text that spells <|endoftext|> stays text: eod marks document ends only
    return tok


def _encode(tok, texts: list[str], ends: list[bool], eod: int, writer: ShardWriter) -> None:
    ids: list[int] = []
    items = []
    for enc, end in zip(tok.encode_batch_fast(texts, add_special_tokens=False), ends):
        n = len(ids)
        ids.extend(enc.ids)
        if end:
            ids.append(eod)
        items.append((len(ids) - n, end))
    writer.add(np.asarray(ids, dtype=writer.dtype), items)


class _Output:
    """One shard being written (the training part, or the held-out part) and the text waiting to be encoded."""

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.texts: list[str] = []
        self.ends: list[bool] = []
        self.size = 0

    def add(self, tok, text: str, end: bool, eod: int) -> None:
        self.texts.append(text)
        self.ends.append(end)
        self.size += len(text)
        if self.size >= ENCODE_CHARS:
            self.flush(tok, eod)

    def flush(self, tok, eod: int) -> None:
        if self.texts:
            _encode(tok, self.texts, self.ends, eod, self.writer)
        self.texts, self.ends, self.size = [], [], 0


def prepare_unit(job: ShardJob, unit: Unit) -> dict:
    """Tokenize one unit into its shard (in a worker process); returns the shard's facts. With
    job.valid_fraction, the held-out documents (data/holdout.py) go to a shard of their own under valid/."""
    if job.fmt != "text":
        return _prepare_records(job, unit)
    tok = _tokenizer(str(job.tokenizer_path))
    stats = RecordStats(job.policy)
    name = f"{unit.index:05d}"
    dtype = job.dtype
    outputs = [_Output(ShardWriter(job.directory / SHARDS, name, dtype))]
    try:
        if job.valid_fraction > 0:
            outputs.append(_Output(ShardWriter(job.directory / VALID, name, dtype)))
        fraction = job.valid_fraction
        for piece in unit.pieces:
            # A text file is one document, whose chunks may lie in several units: its side is the file's.
            whole = held_out(file_key(piece.path), fraction) if piece.kind == "text" and fraction > 0 else None
            for text, end in piece_documents(piece, job.text_key, stats):
                side = whole if whole is not None else fraction > 0 and held_out(text_key(text), fraction)
                outputs[int(side)].add(tok, text, end, job.eod)
        for out in outputs:
            out.flush(tok, job.eod)
        facts = outputs[0].writer.finish()
        if len(outputs) > 1:
            facts["valid"] = outputs[1].writer.finish()
    except BaseException:
        for out in outputs:
            out.writer.abort()
        raise
    return _publish_facts(job, unit, facts, stats)


def _publish_facts(job: ShardJob, unit: Unit, facts: dict, stats: RecordStats) -> dict:
    name = f"{unit.index:05d}"
    facts = {"name": name, **facts, "input_bytes": unit.bytes, "records": stats.as_dict(),
             "pieces": [[p.path, p.kind, p.start, p.stop, p.ends_document] for p in unit.pieces]}
    publish_bytes(job.directory / SHARDS / f"{name}.json", json.dumps(facts, sort_keys=True).encode(), replace=True)
    return facts


def _prepare_records(job: ShardJob, unit: Unit) -> dict:
    """A fine-tuning unit: each record tokenized with its loss flags (data/finetune.py), one sequence of
    its shard; `loss_tokens` counts the tokens that carry loss."""
    encoder = RecordEncoder(job.fmt, _tokenizer(str(job.tokenizer_path)), job.tokenizer_path.parent, job.eod)
    stats = RecordStats(job.policy)
    name = f"{unit.index:05d}"
    writers = [ShardWriter(job.directory / SHARDS, name, job.dtype)]
    loss = [0, 0]
    try:
        if job.valid_fraction > 0:
            writers.append(ShardWriter(job.directory / VALID, name, job.dtype))
        for piece in unit.pieces:
            for (item, where), _ in piece_documents(piece, job.text_key, stats, job.fmt):
                ids = encoder.encode(item, where, stats)
                if ids is None:
                    continue
                side = int(held_out(text_key(item_key(item)), job.valid_fraction))
                writers[side].add(ids, [(len(ids), True)])
                loss[side] += int(np.count_nonzero(ids >= 0))
        facts = writers[0].finish() | {"loss_tokens": loss[0]}
        if len(writers) > 1:
            facts["valid"] = writers[1].finish() | {"loss_tokens": loss[1]}
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return _publish_facts(job, unit, facts, stats)


# ---------------------------------------------------------------- parent side


def _done_shard(directory: Path, unit: Unit, itemsize: int, valid: bool) -> dict | None:
    """The facts of a shard an earlier run finished for this very unit (and its held-out part when `valid`),
    else None."""
    name = f"{unit.index:05d}"
    try:
        facts = json.loads((directory / SHARDS / f"{name}.json").read_text())
        parts = [(SHARDS, facts)] + ([(VALID, facts["valid"])] if valid else [])
        for part, counts in parts:
            (directory / part / f"{name}.idx").stat()
            if (directory / part / f"{name}.bin").stat().st_size != counts.get("tokens", -1) * itemsize:
                return None
    except (OSError, ValueError, KeyError):
        return None
    pieces = [[p.path, p.kind, p.start, p.stop, p.ends_document] for p in unit.pieces]
    return facts if facts.get("pieces") == pieces else None


def _remove_temporaries(directory: Path) -> None:
    for tmp in directory.glob(f".*{TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)


class _Progress:
    """One line: shards, input bytes, MB/s, tokens/s and the time left; redrawn on a terminal, else
    printed every PROGRESS_EVERY_S."""

    def __init__(self, log: Callable[[str], None], total_shards: int, total_bytes: int, done_bytes: int):
        self.log, self.total_shards, self.total_bytes = log, total_shards, total_bytes
        self.tty = sys.stdout.isatty()
        self.start = self.last = time.monotonic()
        self.base_bytes = done_bytes  # finished by an earlier run: not this run's speed
        self.bytes, self.tokens, self.shards = done_bytes, 0, 0

    def line(self) -> str:
        dt = max(time.monotonic() - self.start, 1e-9)
        rate = (self.bytes - self.base_bytes) / dt
        eta = (self.total_bytes - self.bytes) / rate if rate > 0 else float("nan")
        eta_text = f"{eta / 60:.0f} min" if eta >= 120 else (f"{eta:.0f} s" if eta == eta else "?")
        return (f"data: {self.shards}/{self.total_shards} shards, {size_words(self.bytes)} of {size_words(self.total_bytes)}, "
                f"{rate / 1e6:.1f} MB/s, {self.tokens / dt / 1e6:.2f}M tokens/s, {eta_text} left")

    def update(self, facts: dict, done_shards: int) -> None:
        self.bytes += facts["input_bytes"]
        self.tokens += facts["tokens"]
        self.shards = done_shards
        now = time.monotonic()
        if self.tty:
            print(f"\r{self.line()}\033[K", end="", flush=True)
        elif now - self.last >= PROGRESS_EVERY_S:
            self.log(self.line())
            self.last = now

    def end(self) -> None:
        if self.tty:
            print("\r\033[K", end="", flush=True)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def size_words(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _Stop(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    """Stop every worker now. ProcessPoolExecutor has no public way to (Python 3.14 adds terminate_workers);
    its process table is read as 3.11-3.13 keep it."""
    for process in list(getattr(executor, "_processes", {}).values()):
        process.kill()
    executor.shutdown(wait=True, cancel_futures=True)


def _manifest(job: PrepareJob, shards: list[dict]) -> dict:
    stats = RecordStats("skip")
    for s in shards:
        stats.add(s["records"])
    keep = ("name", "tokens", "documents", "sha256", "open_end", "input_bytes")
    valid = {}
    if job.valid_fraction > 0:
        parts = [{"name": s["name"], **{k: s["valid"][k] for k in ("tokens", "documents", "sha256", "open_end")}} for s in shards]
        valid = {"valid": {"fraction": job.valid_fraction, "tokens": sum(p["tokens"] for p in parts),
                           **({"loss_tokens": sum(s["valid"]["loss_tokens"] for s in shards)} if job.fmt != "text" else {}),
                           "documents": sum(p["documents"] for p in parts),
                           "sha256": hashlib.sha256("\n".join(p["sha256"] for p in parts).encode()).hexdigest(),
                           "shards": parts}}
    return {**valid, "format": FORMAT, "corpus": job.corpus, "name": job.label,
            "source": {"path": job.source_path, "text_key": job.text_key, "files": list(job.fingerprints)},
            "tokenizer": {"sha256": job.tokenizer_sha256, "vocab": job.vocab, "eod_id": job.eod},
            "dtype": job.dtype.name, "shard_bytes": job.shard_bytes, "bad_records": job.policy,
            **({"finetune": {"format": job.fmt, "loss_tokens": sum(s["loss_tokens"] for s in shards)}}
               if job.fmt != "text" else {}),
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "input_bytes": sum(s["input_bytes"] for s in shards),
            "sha256": hashlib.sha256("\n".join(s["sha256"] for s in shards).encode()).hexdigest(),
            "records": stats.as_dict(), "shards": [{k: s[k] for k in keep} for s in shards]}


def records_words(records: dict) -> str:
    """"; skipped 3 bad records (2 not valid JSON, 1 no text field), first: a.jsonl:7: ..." or ""."""
    out = ""
    bad = records.get("bad", {})
    if bad:
        kinds = ", ".join(f"{n:,} {BAD_KINDS.get(k, k)}" for k, n in bad.items())
        out += f"; skipped {sum(bad.values()):,} bad records ({kinds}), first: {records.get('first_bad', '')}"
    if records.get("invalid_utf8"):
        out += f"; {records['invalid_utf8']:,} records had bytes that are not UTF-8 (read as U+FFFD)"
    return out


def prepare_corpus(job: PrepareJob, workers: int, log: Callable[[str], None] = print) -> tuple[PreparedCorpus, bool]:
    """Prepare `job` (or finish an interrupted preparation of it, or wait for another process preparing
    it); returns the complete preparation, and whether this process prepared it. Raises ConfigError on a
    bad record (with policy "error"), StorageFailure when the disk fills, Interrupted on SIGINT / SIGTERM."""
    lock = PrepareLock(job.directory)
    shard_dir = job.directory / SHARDS
    lock.acquire(log, lambda: f"{len(list(shard_dir.glob('*.json')))} shards done")
    try:
        manifest = read_manifest(job.directory)  # another process may have finished it while this one waited
        here = manifest is None
        if here:
            manifest = _prepare_locked(job, workers, log)
        return open_prepared(job.directory, manifest), here
    finally:
        lock.release()


def _prepare_locked(job: PrepareJob, workers: int, log: Callable[[str], None]) -> dict:
    shard_dir = job.directory / SHARDS
    valid_dir = job.directory / VALID
    for d in (shard_dir, valid_dir) if job.valid_fraction > 0 else (shard_dir,):
        d.mkdir(parents=True, exist_ok=True)
        _remove_temporaries(d)
    _remove_temporaries(job.directory)
    units = plan_units(list(job.files), job.shard_bytes)
    if not units:
        raise ConfigError(job.field, f"{job.label} holds no data", "give it files with text in them")
    itemsize = job.dtype.itemsize
    done = {u.index: f for u in units if (f := _done_shard(job.directory, u, itemsize, job.valid_fraction > 0)) is not None}
    todo = [u for u in units if u.index not in done]
    total = sum(u.bytes for u in units)
    workers = max(1, min(workers, len(todo) or 1))
    if done:
        log(f"data: resuming the preparation of {job.label}: {len(done)} of {len(units)} shards were done by an "
            "earlier run and are kept")
    log(f"data: preparing {job.label}: {size_words(total)} in {_plural(len(units), 'shard')}, "
        f"{_plural(workers, 'worker')} -> {job.directory}")
    start = time.monotonic()
    progress = _Progress(log, len(units), total, sum(u.bytes for u in units if u.index in done))
    try:
        _run_workers(job, todo, workers, done, progress)
    except BadRecord as e:
        raise e.error(job.field, job.key_field) from None
    except (KeyboardInterrupt, _Stop) as e:
        code = interrupt_exit_code(e.signum) if isinstance(e, _Stop) else EXIT_SIGINT
        name = "SIGINT" if code == EXIT_SIGINT else str(e)
        raise Interrupted(f"interrupted ({name}) while preparing {job.label}: {len(done)} of {len(units)} shards are "
                          f"prepared and kept in {job.directory}; rerun the same command to finish the preparation",
                          code) from None
    except OSError as e:
        left = sum(u.bytes for u in units if u.index not in done)
        written = sum(f["tokens"] for f in done.values()) * itemsize
        per_byte = written / max(1, sum(f["input_bytes"] for f in done.values())) if done else itemsize / 3.5
        failure = storage_failure(e, then=f"{len(done)} of {len(units)} shards are prepared and kept in "
                                          f"{job.directory} (no partial shard is left); about {left * per_byte / 1e9:.2f} GB "
                                          "more is needed, then rerun the same command to resume the preparation")
        if failure is None:
            raise
        raise failure from None
    finally:
        progress.end()
        _remove_temporaries(shard_dir)
        if job.valid_fraction > 0:
            _remove_temporaries(valid_dir)
    shards = [done[u.index] for u in units]
    manifest = _manifest(job, shards)
    shutil.copyfile(job.tokenizer_path, job.directory / f".{TOKENIZER}{TMP_SUFFIX}")
    os.replace(job.directory / f".{TOKENIZER}{TMP_SUFFIX}", job.directory / TOKENIZER)
    publish_bytes(job.directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode(), replace=True)
    dt = time.monotonic() - start
    work = sum(u.bytes for u in todo)
    log(f"data: prepared {job.label}: {manifest['tokens'] / 1e6:,.1f}M tokens, {manifest['documents']:,} documents, "
        f"{_plural(len(units), 'shard')} in {dt:.1f} s ({work / dt / 1e6:.1f} MB/s, "
        f"{sum(done[u.index]['tokens'] for u in todo) / dt / 1e6:.2f}M tokens/s, {_plural(workers, 'worker')})"
        f"{held_out_words(manifest)}{records_words(manifest['records'])}")
    return manifest


def held_out_words(manifest: dict) -> str:
    """"; held out for validation: 1,234 documents, 0.4M tokens (data.valid_fraction 0.01)" or ""."""
    valid = manifest.get("valid")
    if not valid:
        return ""
    return (f"; held out for validation: {valid['documents']:,} documents, {valid['tokens'] / 1e6:,.2f}M tokens "
            f"(data.valid_fraction {valid['fraction']:g})")


def _run_workers(job: PrepareJob, todo: list[Unit], workers: int, done: dict[int, dict], progress: _Progress) -> None:
    """Run the units left on `workers` processes; each finished shard lands in `done` as it completes."""
    if not todo:
        return
    if workers == 1:  # no process to start: here, single-threaded too unless one shard is all there is to do
        with _sigterm_stops():
            _run_here(job, todo, done, progress)
    else:
        _run_pool(job, todo, workers, done, progress)


@contextlib.contextmanager
def _sigterm_stops():
    """SIGTERM (a scheduler's, `kill`) stops the preparation as Ctrl-C does: the shard being written is
    removed, the finished ones kept, and the line says so (143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise _Stop(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _StopRequest:
    """SIGINT and SIGTERM while a pool prepares: the handler only records the signal, and the pool's loop
    acts on it between two waits. A handler that raises would raise at whatever bytecode the main thread is
    at, also halfway through `concurrent.futures.wait` taking its futures' locks one by one: the locks it
    took stay held, the pool's manager thread blocks on one when it fails the pending futures, and the
    shutdown that joins that thread never returns (a CI run hung so after Ctrl-C; test_data_prepare
    reproduces it). A SIGINT the process inherited ignored (a background job) stays ignored."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self.previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, _frame) -> None:
        self.signum = self.signum or signum

    def raise_if_asked(self) -> None:
        if self.signum is not None:
            raise _Stop(self.signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


STOP_POLL_S = 0.1  # how soon a recorded Ctrl-C / SIGTERM is acted on while every worker is busy


def _run_pool(job: PrepareJob, todo: list[Unit], workers: int, done: dict[int, dict], progress: _Progress) -> None:
    # Forked (where there is fork), as torch's DataLoader workers are: a spawned worker would import the
    # parent's __main__ again (a user's script without a main guard would prepare again, recursively), and
    # fork starts in milliseconds. The parent runs no tokenizer thread pool a worker could inherit locked:
    # its BPE training has ended, and a worker's tokenizer is its own (_tokenizer), single-threaded.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with _StopRequest() as stop:
        executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_worker_init)
        try:
            work = job.shard_job
            pending = {executor.submit(prepare_unit, work, unit): unit for unit in todo}
            while pending:
                stop.raise_if_asked()
                finished, _ = wait(pending, timeout=STOP_POLL_S, return_when=FIRST_COMPLETED)
                for future in finished:
                    unit = pending.pop(future)
                    done[unit.index] = future.result()
                    progress.update(done[unit.index], len(done))
            stop.raise_if_asked()  # asked as the last shard finished: stopped all the same, everything kept
            executor.shutdown(wait=True)
        except BaseException:
            _kill_workers(executor)
            raise


def _run_here(job: PrepareJob, todo: list[Unit], done: dict[int, dict], progress: _Progress) -> None:
    """One worker: the units in this process. The tokenizer's thread pool may encode a lone shard on every
    core (the library reads its switch at each call) — unless the switch is set already: by the user, or by
    the library itself in a process forked after its pool was used, where the pool's threads are gone and
    turning it back on hangs the first encode (a forked test rank hung 600 s so, in a full test run)."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if saved is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if len(todo) < default_workers() else "false"
    try:
        for unit in todo:
            done[unit.index] = prepare_unit(job.shard_job, unit)
            progress.update(done[unit.index], len(done))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
