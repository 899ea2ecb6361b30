"""Validation: the token-mean loss of every validation set, on any layout, without touching training.

The sets are each source's held-out documents (data.valid_fraction, data/holdout.py) and the named
[[data.valid]] sets. A round reads the same windows of a set every time and on every layout: the set's
(seq_len+1)-token windows in one fixed order (seeded by EVAL_SEED, not train.seed, so that runs with
other seeds are compared on the same windows), eval.tokens of them rounded up to whole global batches,
or all of them (eval.tokens = 0; the last windows that do not fill a global batch are left out). A
global batch is cut over the data-parallel ranks and into micro-batches exactly as in training, so
every layout's forward runs the model it trains (FSDP, TP/SP, CP, EP, offload, compile) and pipeline
layouts run their schedule forward-only (torch.distributed.pipelining's eval()).

The loss is the sum of per-token losses over the round's tokens divided by their count, summed over the
ranks that hold different tokens (data and context parallel; the pipeline's last stage) like the logged
training loss; perplexity is exp(loss). Nothing of training's state moves: no RNG is drawn, the
training batches are a function of the step alone, gradients are not computed (torch.no_grad), and the
optimizer, scheduler and loss scale are not called — the training losses are bitwise those of a run
without evaluation (tests/dist/test_evaluate.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardwise.data.packing import loss_targets, source_rows
from shardwise.errors import ConfigError

# The windows' order in every round, run and layout (any constant would do).
EVAL_SEED = 20_261_128


@dataclass(frozen=True)
class EvalSet:
    """One validation set's rounds: `batches` global batches of `order`'s windows, the same every round."""

    name: str
    field: str
    tokens: Any  # TokenStream
    seq_len: int
    global_batch: int
    batches: int
    windows: int
    order: np.ndarray
    loss_tokens: int = 0  # the round's targets that carry loss (fine-tuning rows); 0: all of them

    @property
    def round_tokens(self) -> int:
        return self.batches * self.global_batch * self.seq_len

    @property
    def round_loss_tokens(self) -> int:
        """What a round's loss sum is divided by: its tokens, or a fine-tuning set's tokens with loss."""
        return self.loss_tokens or self.round_tokens

    def local_rows(self, batch: int, batch_rank: int, batch_size: int) -> torch.Tensor:
        """This batch rank's contiguous share of the set's global batch `batch`, (global_batch / batch_size, seq_len + 1)."""
        local = self.global_batch // batch_size
        start = batch * self.global_batch + batch_rank * local
        windows = self.order[start:start + local]
        return torch.from_numpy(self.tokens.windows(windows * self.seq_len, self.seq_len + 1))


def eval_sets(valid_sets, cfg) -> list[EvalSet]:
    """The sets a round evaluates (data/sources.py PreparedData.valid_sets()); ConfigError before anything is
    spawned when a set cannot fill one global batch, or when eval.* asks for evaluation without a set."""
    t, e = cfg.train, cfg.eval
    if e.every < 0:
        raise ConfigError("eval.every", f"must be >= 0, got {e.every}", "use 0 (only at the end) or a number of steps")
    if e.tokens < 0:
        raise ConfigError("eval.tokens", f"must be >= 0, got {e.tokens}", "use 0 (the whole set) or a number of tokens")
    if not valid_sets:
        if e.every:
            raise ConfigError("eval.every", f"is {e.every}, but there is no validation set",
                              "set data.valid_fraction (e.g. 0.005) or add a [[data.valid]] set, or eval.every=0")
        return []
    out = []
    for v in valid_sets:
        rows = source_rows(v.stream, v.finetune, t.seq_len, cfg.data.loss_on, v.eod)
        windows = max(len(rows) - 1, 0) // t.seq_len
        if windows < t.global_batch:
            what = f"records that fill {windows} rows of train.seq_len + 1 = {t.seq_len + 1} tokens" if v.finetune \
                else f"{len(v.stream):,} tokens: {windows} windows of train.seq_len={t.seq_len}"
            raise ConfigError(v.field, f"validation set {v.name!r} has {what}, fewer than one global batch "
                              f"(train.global_batch={t.global_batch})",
                              "give it more documents (a bigger set, or a larger data.valid_fraction), or lower "
                              "train.global_batch or train.seq_len")
        full = windows // t.global_batch
        batches = full if e.tokens == 0 else min(full, math.ceil(e.tokens / (t.global_batch * t.seq_len)))
        order = torch.randperm(windows, generator=torch.Generator().manual_seed(EVAL_SEED)).numpy()
        loss_tokens = 0
        if v.finetune:  # the round's rows are fixed: count their loss tokens once
            for b in range(batches):
                picked = order[b * t.global_batch:(b + 1) * t.global_batch]
                loss_tokens += loss_targets(rows.windows(picked * t.seq_len, t.seq_len + 1))
        out.append(EvalSet(v.name, v.field, rows, t.seq_len, t.global_batch, batches, windows, order, loss_tokens))
    return out


def describe_sets(sets: list[EvalSet], cfg) -> str:
    """The start-up line: which sets, how much of each a round reads, and when rounds run."""
    when = (f"every {cfg.eval.every} steps" if cfg.eval.every else "") + \
        (" and " if cfg.eval.every and cfg.eval.at_end else "") + ("at the end" if cfg.eval.at_end else "")
    parts = [f"{s.name} {s.round_tokens:,} of {s.windows * s.seq_len:,} tokens ({s.batches} batch"
             f"{'' if s.batches == 1 else 'es'})" for s in sets]
    return f"eval: {', '.join(parts)} per round, {when or 'never (eval.every=0, eval.at_end=false)'}"


def evaluate(trainer, sets: list[EvalSet]) -> dict[str, float]:
    """One round over every set (collective: every rank calls it); the metrics record's valid_* keys."""
    start = time.perf_counter()
    out: dict[str, float] = {}
    for s in sets:
        total = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for batch in range(s.batches):
            rows = s.local_rows(batch, trainer.batch_rank, trainer.dims.dp)
            total += trainer.eval_batch(rows)
        loss = trainer.reduce_eval_sum(total).item() / s.round_loss_tokens
        out[f"valid_loss_{s.name}"] = loss
        out[f"valid_ppl_{s.name}"] = math.exp(loss) if loss < 700 else float("inf")
        out[f"valid_tokens_{s.name}"] = s.round_tokens
    out["eval_time_s"] = time.perf_counter() - start
    return out


def eval_words(record: dict[str, float]) -> str:
    """"valid stdlib 3.2104 (ppl 24.8), code 2.91 (ppl 18.4)" for the progress line and the summary."""
    names = [k[len("valid_loss_"):] for k in record if k.startswith("valid_loss_")]
    return ", ".join(f"{n} {record[f'valid_loss_{n}']:.4f} (ppl {record[f'valid_ppl_{n}']:.4g})" for n in names)
