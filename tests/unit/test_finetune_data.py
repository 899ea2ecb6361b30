"""Fine-tuning data (data/finetune.py, data/packing.py): prompt / completion and chat records prepared with
their loss flags, packed whole into rows (best fit), and the loss a step computes from them: the mean over
the tokens that carry loss, as one device computes it with F.cross_entropy's ignore_index. One process;
tiny corpora and the byte tokenizer (a chat tokenizer with ChatML's markers is built here)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardwise.config import build_config
from shardwise.data.finetune import IGNORE_INDEX
from shardwise.data.packing import PackedRows, best_fit
from shardwise.data.shards import index_arrays
from shardwise.data.sources import prepare_data
from shardwise.train.data import split_inputs_targets
from shardwise.train.loss import token_cross_entropy_sum

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _pairs(path: Path, n: int = 120) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Q{i}: {i}+{i}=", "completion": f" {2 * i}." + " so" * (i % 7)}) + "\n")
    return path


def _data(tmp_path: Path, path: Path, **more):
    keys = {"data.path": str(path), "data.tokenizer": "byte", "data.cache_dir": str(tmp_path / "cache"), **more}
    cfg = build_config(None, list(keys.items()))
    return cfg, prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)


def _decode(ids) -> str:
    return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def test_best_fit_places_every_record_once_in_rows_that_fit():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    rows = best_fit(lengths, 65)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 65 for r in rows)
    # Best fit decreasing stays within 11/9 of the optimum (+ a constant); the volume bound is below it.
    assert len(rows) <= 11 / 9 * np.ceil(lengths.sum() / 65) + 1
    assert rows == best_fit(lengths, 65)  # deterministic: every rank packs the same rows


def test_prompt_completion_records_carry_loss_on_the_completion_and_the_end(tmp_path):
    cfg, data = _data(tmp_path, _pairs(tmp_path / "pairs.jsonl"))
    corpus = data.sources[0].corpus
    assert corpus.finetune and corpus.manifest["finetune"]["format"] == "prompt_completion"
    tokens = corpus.stream.read(0, len(corpus.stream)).astype(np.int64)
    first = tokens[:tokens.tolist().index(data.eod_id) + 1]  # record 0, up to its end token
    assert _decode(~first[first < 0]) == "Q0: 0+0="
    assert _decode(first[first >= 0]) == " 0." and first[-1] == data.eod_id  # the end carries loss: the stop
    assert corpus.manifest["finetune"]["loss_tokens"] == int(np.count_nonzero(tokens >= 0))


def test_packed_rows_hold_whole_records_and_pad_without_loss(tmp_path):
    cfg, data = _data(tmp_path, _pairs(tmp_path / "pairs.jsonl"))
    stream, eod = data.sources[0].corpus.stream, data.eod_id
    packed = PackedRows(stream, 63, "completion", eod)
    rows = packed.windows(np.arange(packed.rows) * 63, 64)
    assert rows.shape == (packed.rows, 64) and packed.rows < 120  # several records a row
    records = 0
    for row in rows:
        ids = np.where(row < 0, ~row, row)
        ends = np.flatnonzero(ids == eod)
        records += sum(1 for e in ends if row[e] >= 0)  # a record's own end token carries loss; a pad's does not
        pads = row[ends[-1] + 1:] if len(ends) else row[:0]
        assert (pads == ~eod).all()
    assert records == 120
    facts = packed.facts()
    assert facts.records == 120 and facts.rows == packed.rows and facts.cut == 0
    assert facts.pad_tokens == packed.rows * 64 - int(packed.lengths.sum())
    assert facts.loss_tokens == int(np.count_nonzero(rows[:, 1:] >= 0))
    every = PackedRows(stream, 63, "all", eod).windows(np.arange(packed.rows) * 63, 64)
    assert (every[rows >= 0] == rows[rows >= 0]).all() and ((every < 0) == (rows == ~eod)).all()  # only pads lose
    short = PackedRows(stream, 15, "completion", eod)  # rows of 16: the longer records are cut, and counted
    lengths = np.concatenate([index_arrays(Path(b).with_suffix(".idx"))[0] for b in stream.bins])
    assert short.cut == int(np.count_nonzero(lengths > 16)) > 0 and short.lengths.max() == 16


def test_inputs_are_ids_and_targets_without_loss_are_ignored():
    row = torch.tensor([[~5, ~6, 7, 8, ~9]])
    inputs, targets = split_inputs_targets(row)
    assert inputs.tolist() == [[5, 6, 7, 8]] and targets.tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX]]
    text = torch.tensor([[1, 2, 3]])  # text rows pass unchanged
    assert [t.tolist() for t in split_inputs_targets(text)] == [[[1, 2]], [[2, 3]]]


def test_the_chunked_loss_ignores_what_cross_entropy_ignores():
    """The chunked path (train/loss.py) must skip ignored targets as F.cross_entropy does, forward and
    backward; fp32 sums of 48 terms in another order: within 1e-5 relative."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 100, generator=gen, requires_grad=True)
    targets = torch.randint(0, 100, (48,), generator=gen)
    targets[::3] = IGNORE_INDEX
    ref = F.cross_entropy(logits, targets, reduction="sum")
    (g_ref,) = torch.autograd.grad(ref, logits)
    ours = token_cross_entropy_sum(logits, targets, chunk_bytes=16 * 100 * 4)  # chunks of 16 tokens
    (g,) = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    assert (g[::3] == 0).all()


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_a_step_loss_is_the_mean_over_the_tokens_that_carry_loss(tmp_path, loss_on):
    """One process, four micro-batches a step: the logged loss is F.cross_entropy's mean over the global
    batch's tokens with loss (each micro-batch holds another share of them, so a per-micro-batch mean
    would differ). The same model, rows and fp32 arithmetic, summed in another order: 1e-5 relative."""
    from shardwise.train.trainer import Trainer

    path = _pairs(tmp_path / "pairs.jsonl")
    keys = [("data.path", str(path)), ("data.tokenizer", "byte"), ("data.cache_dir", str(tmp_path / "cache")),
            ("data.loss_on", loss_on), ("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "64"),
            ("train.global_batch", "8"), ("train.micro_batch", "2"), ("train.steps", "1"), ("train.precision", "fp32"),
            ("run.progress", "false"), ("run.tensorboard", "false"), ("run.loss_curve", "false"),
            ("checkpoint.final", "false"), ("checkpoint.resume", "false"), ("run.dir", str(tmp_path / "run"))]
    trainer = Trainer(build_config(None, keys), log=None)
    inputs, targets = split_inputs_targets(trainer.batches.global_batch_at(0))
    share = (targets != IGNORE_INDEX).float().mean().item()
    assert (share < 0.6) if loss_on == "completion" else (share > 0.9)
    with torch.no_grad():
        expected = F.cross_entropy(trainer.model(inputs).flatten(0, 1), targets.flatten()).item()
    assert trainer.train_step().loss == pytest.approx(expected, rel=1e-5)


def _chat_tokenizer(directory: Path) -> Path:
    from shardwise.data.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return directory / "tokenizer.json"


def test_chat_records_are_their_templates_ids_with_loss_on_the_assistant(tmp_path):
    from tokenizers import Tokenizer

    from shardwise.data.chat import ChatTemplate, encode_chat

    tok_path = _chat_tokenizer(tmp_path / "tok")
    chats = [[{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}] for i in range(40)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    cfg, data = _data(tmp_path, path, **{"data.tokenizer": str(tok_path)})
    corpus = data.sources[0].corpus
    assert corpus.manifest["finetune"]["format"] == "chat"
    tokens = corpus.stream.read(0, len(corpus.stream)).astype(np.int64)
    tok = Tokenizer.from_file(str(tok_path))
    ids, mask = encode_chat(tok, ChatTemplate.from_dir(tmp_path / "tok"), chats[0])
    first = tokens[:len(ids) + 1]
    assert np.where(first < 0, ~first, first).tolist() == [*ids, data.eod_id]
    assert (first >= 0).tolist() == [*mask, False]
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == "hello 0<|im_end|>\n"


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.mark.parametrize("records, words", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], "pairs.jsonl:2 has no string 'prompt' and 'completion'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "chat.jsonl:1 has no assistant turn"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}], "chat.jsonl:1 messages[1] has no 'content'"),
])
def test_bad_records_stop_before_any_process_naming_file_and_line(tmp_path, records, words):
    name = words.split(":")[0]
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = _chat_tokenizer(tmp_path / "tok") if name == "chat.jsonl" else "byte"
    p = _cli("data", "prepare", f"--data.path={tmp_path / name}", f"--data.tokenizer={tok}",
             f"--data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_template_that_fails_on_a_record_or_does_not_parse_is_refused_naming_it(tmp_path):
    tok = _chat_tokenizer(tmp_path / "tok")
    failing = "{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}" + CHATML
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": failing}))
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": chat * 2}) + "\n")
    args = ["data", "prepare", f"--data.path={tmp_path / 'chat.jsonl'}", f"--data.tokenizer={tok}",
            f"--data.cache_dir={tmp_path / 'cache'}"]
    p = _cli(*args, cwd=tmp_path)
    assert p.returncode == 2 and "chat.jsonl:2 the chat template failed: too long" in p.stderr, p.stderr
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    p = _cli(*args, cwd=tmp_path)
    assert p.returncode == 2 and "error: data.tokenizer: the chat template of" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_chat_records_without_a_template_and_a_mix_with_text_are_refused(tmp_path):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    p = _cli("data", "prepare", f"--data.path={tmp_path / 'chat.jsonl'}", "--data.tokenizer=byte",
             f"--data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert p.returncode == 2 and "chat records need a chat template" in p.stderr, p.stderr
    (tmp_path / "text.txt").write_text("some text " * 50)
    p = _cli("data", "prepare", f"--data.path={tmp_path}/*", "--data.tokenizer=byte", "--data.format=prompt_completion",
             f"--data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path)
    assert p.returncode == 2 and "reads JSON-lines, JSON or Parquet files" in p.stderr, p.stderr


def test_the_validation_loss_is_the_mean_over_held_out_answer_tokens(tmp_path):
    """The evaluator's number for fine-tuning records, recomputed without it: the set's packed rows in the
    evaluator's order, F.cross_entropy's mean over the targets that carry loss (fp32 sums in another
    order, then in fp64: 1e-6 relative)."""
    from shardwise.train.evaluate import evaluate
    from shardwise.train.trainer import Trainer

    path = _pairs(tmp_path / "pairs.jsonl", 400)
    keys = [("data.path", str(path)), ("data.tokenizer", "byte"), ("data.cache_dir", str(tmp_path / "cache")),
            ("data.valid_fraction", "0.2"), ("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "64"),
            ("train.global_batch", "8"), ("train.micro_batch", "4"), ("train.steps", "1"), ("train.precision", "fp32"),
            ("run.progress", "false"), ("run.tensorboard", "false"), ("run.loss_curve", "false"),
            ("checkpoint.final", "false"), ("checkpoint.resume", "false"), ("run.dir", str(tmp_path / "run"))]
    trainer = Trainer(build_config(None, keys), log=None)
    (s,) = trainer.eval_sets
    got = evaluate(trainer, trainer.eval_sets)["valid_loss_pairs"]
    inputs, targets = split_inputs_targets(torch.cat([s.local_rows(b, 0, 1) for b in range(s.batches)]))
    assert s.round_loss_tokens == int((targets != IGNORE_INDEX).sum()) < 0.8 * s.round_tokens
    with torch.no_grad():
        expected = F.cross_entropy(trainer.model(inputs).flatten(0, 1), targets.flatten()).item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_parquet_records_give_the_tokens_of_the_same_json_lines(tmp_path):
    """Hugging Face datasets keep chats as a Parquet column of lists of structs: read row by row, they give
    the ids and loss flags the same records give as JSON lines (chat and prompt / completion)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = _chat_tokenizer(tmp_path / "tok")
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(30)]
    pairs = [{"prompt": f"Q{i}=", "completion": f" {i}"} for i in range(30)]
    for name, records in (("chat", chats), ("pairs", pairs)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet", row_group_size=7)
        streams = []
        for suffix in ("jsonl", "parquet"):
            _, data = _data(tmp_path, tmp_path / f"{name}.{suffix}", **{"data.tokenizer": str(tok)})
            assert data.sources[0].corpus.manifest["finetune"]["format"] == ("chat" if name == "chat" else "prompt_completion")
            stream = data.sources[0].corpus.stream
            streams.append(stream.read(0, len(stream)).tolist())
        assert streams[0] == streams[1], name


def test_a_mixture_of_chat_and_prompt_completion_sources_trains_on_packed_rows(tmp_path):
    """[[data.sources]] of fine-tuning records (each source's own format, packed on its own): a step draws
    rows of both, and the logged loss is the mean over the rows' tokens with loss."""
    from shardwise.train.trainer import Trainer

    tok = _chat_tokenizer(tmp_path / "tok")
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(200)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    pairs = _pairs(tmp_path / "pairs.jsonl", 200)
    sources = f'[{{path = "{tmp_path / "chat.jsonl"}", weight = 1.0}}, {{path = "{pairs}", weight = 1.0}}]'
    keys = [("data.sources", sources), ("data.tokenizer", str(tok)), ("data.cache_dir", str(tmp_path / "cache")),
            ("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "64"), ("train.global_batch", "8"),
            ("train.micro_batch", "4"), ("train.steps", "1"), ("train.precision", "fp32"), ("run.progress", "false"),
            ("run.tensorboard", "false"), ("run.loss_curve", "false"), ("checkpoint.final", "false"),
            ("checkpoint.resume", "false"), ("run.dir", str(tmp_path / "run"))]
    lines = []
    trainer = Trainer(build_config(None, keys), log=lines.append)
    assert sum("records packed into" in line for line in lines) == 2, lines
    source, _ = trainer.batches.samples(0, slice(None))
    assert set(source.tolist()) == {0, 1}  # rows of both sources in the step
    inputs, targets = split_inputs_targets(trainer.batches.global_batch_at(0))
    with torch.no_grad():
        expected = F.cross_entropy(trainer.model(inputs).flatten(0, 1), targets.flatten()).item()
    assert trainer.train_step().loss == pytest.approx(expected, rel=1e-5)
