"""From the [data] keys to what training reads: the sources (data.path, or the [[data.sources]] of a
mixture), the tokenizer, and each source prepared (found prepared, finished, or prepared now) or, for a
Megatron-LM dataset, read as it is. `shardwise data prepare` and `shardwise train` both come here, so a
corpus one prepared is the corpus the other finds.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.config import DataConfig
from shardwise.data.corpus import corpus_files, corpus_root, file_fingerprints
from shardwise.data.finetune import FORMATS, LOSS_ON, chat_template_check, check_format, detect_format
from shardwise.data.megatron import megatron_prefix, open_megatron
from shardwise.data.prepare import PrepareJob, default_workers, held_out_words, prepare_corpus, records_words
from shardwise.data.prepared import (
    PreparedCorpus,
    PrepareLock,
    corpus_key,
    open_prepared,
    preparations,
    prepared_dir,
    read_manifest,
    refuse_changed_inputs,
)
from shardwise.data.records import BadRecord, RecordStats, piece_documents
from shardwise.data.shards import TokenStream
from shardwise.data.tokenizer import BPE_TRAIN_CHARS, eod_id, file_sha256, load_tokenizer, tokenizer_file, tokenizer_vocab
from shardwise.data.units import file_pieces
from shardwise.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
BAD_RECORD_POLICIES = ("error", "skip")


@dataclass(frozen=True)
class SourceSpec:
    """One source as configured: data.path alone is a mixture of one, named after its path."""

    name: str
    field: str  # the key of its path, for errors
    path: str
    weight: float
    max_epochs: float
    text_key: str


@dataclass
class Source:
    spec: SourceSpec
    corpus: PreparedCorpus
    files: int  # input files (0 for a Megatron dataset)
    how: str  # "cached", "prepared" or "Megatron dataset"


@dataclass(frozen=True)
class ValidStream:
    """A validation set's tokens: `field` is the key that made it (for errors)."""

    name: str
    field: str
    stream: TokenStream
    finetune: bool = False  # fine-tuning records: read as packed rows (data/packing.py)
    eod: int = 0  # their pads' token


@dataclass
class PreparedData:
    """What training needs from the data side; tokenizer_path travels with checkpoints."""

    sources: list[Source]
    tokenizer_path: Path
    tokenizer_vocab: int
    eod_id: int
    valid: list[Source] = field(default_factory=list)  # the named validation sets ([[data.valid]])

    def valid_sets(self) -> list[ValidStream]:
        """Every validation set: each source's held-out documents (data.valid_fraction), then [[data.valid]]."""
        held = [ValidStream(s.spec.name, "data.valid_fraction", s.corpus.valid, s.corpus.finetune, self.eod_id)
                for s in self.sources if s.corpus.valid is not None]
        return held + [ValidStream(s.spec.name, s.spec.field, s.corpus.stream, s.corpus.finetune, self.eod_id)
                       for s in self.valid]

    @property
    def finetune(self) -> bool:
        """Whether the sources are fine-tuning records (prepare_data refuses a mix with text)."""
        return any(s.corpus.finetune for s in self.sources)

    @property
    def valid_sha256(self) -> str:
        """What the ranks of a job compare about their validation sets (train/agreement.py)."""
        text = "\n".join(f"{s.spec.name}:{s.corpus.manifest.get('valid', {}).get('sha256', '')}" for s in self.sources) \
            + "\n" + "\n".join(f"{s.spec.name}:{s.corpus.sha256}" for s in self.valid)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def num_tokens(self) -> int:
        return sum(s.corpus.tokens for s in self.sources)

    @property
    def num_documents(self) -> int:
        return sum(s.corpus.documents for s in self.sources)

    def describe(self) -> str:
        """Which preparations these are, for a line that compares them with another node's."""
        return "; ".join(f"{s.corpus.directory if s.corpus.tokenizer_path else s.corpus.manifest.get('megatron')} "
                         f"(sha256 {s.corpus.sha256[:12]}, {s.corpus.tokens:,} tokens)" for s in self.sources)

    @property
    def tokens_sha256(self) -> str:
        """What the ranks of a job compare (train/agreement.py): the one source's digest, or the mixture's."""
        if len(self.sources) == 1:
            return self.sources[0].corpus.sha256
        text = "\n".join(f"{s.spec.name}:{s.corpus.sha256}" for s in self.sources)
        return hashlib.sha256(text.encode()).hexdigest()


def _default_name(path: str) -> str:
    if not path:
        return "stdlib"
    stem = Path(os.path.expanduser(path).rstrip("/*")).name.split(".")[0] or "source"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)


def source_specs(cfg: DataConfig) -> list[SourceSpec]:
    """The configured sources, checked: ConfigError on a missing path, a bad weight or a clash of names."""
    if cfg.bad_records not in BAD_RECORD_POLICIES:
        raise ConfigError("data.bad_records", f"{cfg.bad_records!r} is not a policy", 'use "error" or "skip"')
    if cfg.format not in FORMATS:
        raise ConfigError("data.format", f"{cfg.format!r} is not a format", f"use one of {', '.join(FORMATS)}")
    if cfg.loss_on not in LOSS_ON:
        raise ConfigError("data.loss_on", f"{cfg.loss_on!r} is not a choice", 'use "completion" or "all"')
    if not cfg.shard_mb > 0:
        raise ConfigError("data.shard_mb", f"must be > 0, got {cfg.shard_mb}", "use e.g. 32")
    if not 0 <= cfg.valid_fraction < 0.5:
        raise ConfigError("data.valid_fraction", f"must be >= 0 and < 0.5, got {cfg.valid_fraction}",
                          "hold out a small share, e.g. 0.005 (0: none)")
    if not cfg.sources:
        return [SourceSpec(_default_name(cfg.path), "data.path", cfg.path, 1.0, 0.0, cfg.text_key)]
    if cfg.path:
        raise ConfigError("data.sources", "both data.path and data.sources are set",
                          "give the corpus either as data.path or as [[data.sources]] entries, not both")
    specs = []
    for i, s in enumerate(cfg.sources):
        key = f"data.sources[{i}]"
        if not s.path:
            raise ConfigError(f"{key}.path", "is empty", "give each source the path of its files")
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise ConfigError(f"{key}.weight", f"must be > 0, got {s.weight}", "give each source a positive weight "
                              "(remove a source to stop drawing from it)")
        if s.max_epochs < 0:
            raise ConfigError(f"{key}.max_epochs", f"must be >= 0, got {s.max_epochs}", "use 0 (no limit) or e.g. 1")
        name = s.name or _default_name(s.path)
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{key}.name", f"{name!r} has characters other than letters, digits, _ . -",
                              "give it a name like web or code_v2")
        if name in {x.name for x in specs}:
            raise ConfigError(f"{key}.name", f"two sources are named {name!r}", f"give {key} a name of its own")
        specs.append(SourceSpec(name, f"{key}.path", s.path, s.weight, s.max_epochs, s.text_key or cfg.text_key))
    return specs


def valid_specs(cfg: DataConfig, sources: list[SourceSpec]) -> list[SourceSpec]:
    """The [[data.valid]] sets, checked: a path each, names unique among them and the sources (whose held-out
    parts are evaluated under the sources' names)."""
    specs: list[SourceSpec] = []
    taken = {s.name for s in sources} if cfg.valid_fraction > 0 else set()
    for i, v in enumerate(cfg.valid):
        key = f"data.valid[{i}]"
        if not v.path:
            raise ConfigError(f"{key}.path", "is empty", "give each validation set the path of its files")
        name = v.name or _default_name(v.path)
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{key}.name", f"{name!r} has characters other than letters, digits, _ . -",
                              "give it a name like web or code_v2")
        if name in taken or name in {x.name for x in specs}:
            what = "a source's held-out part (data.valid_fraction)" if name in taken else "another validation set"
            raise ConfigError(f"{key}.name", f"{name!r} is already the name of {what}", f"give {key} a name of its own")
        specs.append(SourceSpec(name, f"{key}.path", v.path, 1.0, 0.0, v.text_key or cfg.text_key))
    return specs


def _sample(raw: list[tuple[SourceSpec, list[Path]]], policy: str) -> Iterator[str]:
    """The text a BPE is trained on: the first documents of each source, an equal share of the budget each
    (a big file's first pieces, never the whole file)."""
    budget = BPE_TRAIN_CHARS // max(len(raw), 1)
    stats = RecordStats(policy)
    for spec, files in raw:
        seen = 0
        try:
            for path in files:
                for piece, _ in file_pieces(path, 1 << 22):
                    for text, _end in piece_documents(piece, spec.text_key, stats):
                        yield text
                        seen += len(text)
                        if seen >= budget:
                            break
                    if seen >= budget:
                        break
                if seen >= budget:
                    break
        except BadRecord as e:
            raise e.error(spec.field, _key_field(spec)) from None


def _key_field(spec: SourceSpec) -> str:
    return "data.text_key" if spec.field == "data.path" else spec.field.replace(".path", ".text_key")


def _path_spec(path: str) -> str:
    return f"stdlib:{corpus_root('')}" if not path else os.path.abspath(os.path.expanduser(path))


def _prepare_advice(spec: SourceSpec, command: str | None) -> str:
    """How to prepare the changed files: the caller's own command as `data prepare` when it gave one."""
    if command:
        return f"`{command}`"
    keys = f"--data.path={spec.path}" if spec.field == "data.path" else "--config FILE.toml"
    return f"`shardwise data prepare {keys}` with this run's other data.* keys and model.vocab_size"


def _remove_unfinished(cache_dir: Path, corpus: str, but: Path, log: Callable[[str], None]) -> None:
    """Unfinished preparations of the same corpus from other inputs can never be finished: removed, unless a
    live process holds one."""
    for directory in (cache_dir / "prepared").glob(f"{corpus}-*"):
        if directory == but or not directory.is_dir() or read_manifest(directory) is not None:
            continue
        lock = PrepareLock(directory)
        if not lock.try_acquire():
            continue
        shutil.rmtree(directory, ignore_errors=True)
        lock.release()
        log(f"data: removed an unfinished preparation of earlier files: {directory}")


def prepare_data(cfg: DataConfig, vocab_size: int, log: Callable[[str], None] = print, *, workers: int = 0,
                 refuse_changed: bool = True, prepare_command: str | None = None,
                 cached_only: bool = False) -> PreparedData | None:
    """Every source prepared (or found prepared) with the run's tokenizer. `refuse_changed`: a source whose
    files changed since a preparation of it is named (ConfigError) instead of prepared again, with
    `prepare_command` (the caller's own options as `shardwise data prepare`) as the fix; `shardwise
    data prepare` passes False. `workers`: 0 = data.prepare_workers, then one per core. `cached_only`: None
    instead of training a tokenizer or preparing a source (the planner reads data only if it is there)."""
    t0 = time.perf_counter()
    cache_dir = Path(os.path.expanduser(cfg.cache_dir))
    if cfg.tokenizer not in ("bpe", "byte"):  # a tokenizer file: its size and end-of-document token before the corpus is read
        given = tokenizer_file(cfg.tokenizer, cache_dir, vocab_size, str, list, create=False)[0]
        eod_id(load_tokenizer(given, vocab_size), given)
    specs = source_specs(cfg)
    every = specs + valid_specs(cfg, specs)  # the validation sets are prepared like sources, never trained on
    shard_bytes = int(cfg.shard_mb * 1e6)
    raw: list[tuple[SourceSpec, list[Path]]] = []
    fingerprints: dict[str, list[dict]] = {}
    for spec in every:
        if megatron_prefix(spec.path) is None:
            # The cache may lie inside the corpus's directory: its shards are not corpus.
            inside = cache_dir.resolve()
            files = [f for f in corpus_files(spec.path, spec.field) if inside not in f.resolve().parents]
            raw.append((spec, files))
            fingerprints[spec.field] = file_fingerprints(spec.path, files)
        elif cfg.valid_fraction > 0 and spec in specs:
            raise ConfigError("data.valid_fraction", f"{spec.path} is a Megatron-LM dataset, tokenized already: its "
                              "documents are not split here", "give the validation documents as a dataset of their own "
                              "([[data.valid]] with its path), and data.valid_fraction=0")
    tokenizer_kind = cfg.tokenizer if cfg.tokenizer in ("bpe", "byte") else os.path.abspath(os.path.expanduser(cfg.tokenizer))
    formats = {spec.field: cfg.format if cfg.format != "auto" else detect_format(files) for spec, files in raw}
    for spec, files in raw:
        check_format(formats[spec.field], files, spec.field)
    if len({f != "text" for f in formats.values()}) > 1:
        listed = ", ".join(f"{field} {f}" for field, f in formats.items())
        raise ConfigError("data.format", f"the sources mix text and fine-tuning records ({listed})",
                          "train on one kind at a time: fine-tuning records, or text (set data.format to say which)")
    if cfg.tokenizer == "bpe" and "text" not in formats.values() and formats:
        raise ConfigError("data.tokenizer", "a BPE is trained on text documents, and these are fine-tuning records",
                          "set data.tokenizer to the tokenizer.json of the model you fine-tune (or \"byte\")")
    keys = {spec.field: corpus_key(_path_spec(spec.path), spec.text_key, tokenizer_kind, vocab_size, shard_bytes,
                                   cfg.bad_records, cfg.valid_fraction if spec in specs else 0.0, formats[spec.field])
            for spec, _ in raw}
    if refuse_changed:  # before a tokenizer is trained on files that were not meant to change
        for spec, _ in raw:
            found = preparations(cache_dir, keys[spec.field])
            same = any(m["source"]["files"] == fingerprints[spec.field] for _, m in found)
            if found and not same:
                refuse_changed_inputs(spec.field, spec.path or "the stdlib corpus", found[0][0], found[0][1],
                                      fingerprints[spec.field], _prepare_advice(spec, prepare_command))
    training = [(spec, files) for spec, files in raw if spec in specs]
    if cfg.tokenizer == "bpe" and not training:
        raise ConfigError("data.tokenizer", "a BPE cannot be trained on Megatron-LM datasets (they are tokenized already)",
                          "set data.tokenizer to the tokenizer.json the dataset was preprocessed with")
    # Trained on the training sources only: adding a validation set keeps the tokenizer (and the shards).
    bpe_key = json.dumps([[s.text_key, fingerprints[s.field]] for s, _ in training], sort_keys=True)
    tok_path, _ = tokenizer_file(cfg.tokenizer, cache_dir, vocab_size, lambda: hashlib.sha256(bpe_key.encode()).hexdigest(),
                                 lambda: _sample(training, cfg.bad_records), create=not cached_only)
    if cached_only and not tok_path.is_file():
        return None
    tok = load_tokenizer(tok_path, vocab_size)
    if "chat" in formats.values():
        chat_template_check(tok_path)
    vocab, eod, tok_sha = tokenizer_vocab(tok), eod_id(tok, tok_path), file_sha256(tok_path)
    workers = workers or cfg.prepare_workers or default_workers()
    prepared = []
    for spec in every:
        prefix = megatron_prefix(spec.path)
        if prefix is not None:
            corpus = open_megatron(prefix, spec.field, spec.name, cache_dir, vocab, str(tok_path), log)
            prepared.append(Source(spec, corpus, 0, "Megatron dataset"))
            continue
        files = next(f for s, f in raw if s is spec)
        directory = prepared_dir(cache_dir, keys[spec.field], fingerprints[spec.field], tok_sha)
        manifest = read_manifest(directory)
        if manifest is None and cached_only:
            return None
        if manifest is not None:
            prepared.append(Source(spec, open_prepared(directory, manifest), len(files), "cached"))
            continue
        _remove_unfinished(cache_dir, keys[spec.field], directory, log)
        label = spec.name if spec.name == _default_name(spec.path) else f"{spec.name} ({spec.path})"
        job = PrepareJob(directory, label, spec.field, _key_field(spec), spec.text_key, tuple(files),
                         tuple(fingerprints[spec.field]), spec.path, keys[spec.field], tok_path, tok_sha, vocab, eod,
                         shard_bytes, cfg.bad_records, cfg.valid_fraction if spec in specs else 0.0, formats[spec.field])
        corpus, here = prepare_corpus(job, workers, log)
        prepared.append(Source(spec, corpus, len(files), "prepared" if here else "prepared by another process"))
    for s in prepared:
        if s.corpus.tokens == 0:
            raise ConfigError(s.spec.field, f"{s.spec.path or 'the stdlib corpus'} holds no text (0 tokens"
                              f"{records_words(s.corpus.manifest.get('records', {}))})", "give it files with text in them")
    sources, valid = prepared[:len(specs)], prepared[len(specs):]
    data = PreparedData(sources, tok_path, vocab, eod, valid)
    dt = time.perf_counter() - t0
    for i, s in enumerate(prepared):
        where = "stdlib" if not s.spec.path else s.spec.path
        name = f"validation set {s.spec.name} = " if i >= len(sources) else ("" if len(sources) == 1 else f"{s.spec.name} = ")
        files = f"{s.files} file{'' if s.files == 1 else 's'}, " if s.files else ""
        log(f"data: {name}{where}, {files}{s.corpus.documents} docs, {s.corpus.tokens / 1e6:.1f}M tokens, vocab {vocab} "
            f"({s.how}, {dt:.1f}s)" + (held_out_words(s.corpus.manifest) + records_words(s.corpus.manifest.get("records", {}))
                                       if s.how == "cached" else ""))
    return data
