"""What document masking computes of attention (spec/documents.py), and the planner's price of it: the tile count
is FlexAttention's own block mask's, measured on the run's prepared data by `shardwise plan`."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from shardwise.config import build_config
from shardwise.data.sources import prepare_data
from shardwise.models.common import document_attention_mask, document_positions
from shardwise.plan.command import measure_document_share
from shardwise.plan.compute_time import microbatch_times
from shardwise.plan.inventory import stage_model
from shardwise.plan.layout import Problem
from shardwise.spec.documents import causal_tiles, document_share, document_tiles
from shardwise.spec.layout import Layout

EOD = 7


@pytest.mark.parametrize("seq_len", [128, 1000, 1024])
def test_the_tiles_counted_are_the_ones_flex_attention_computes(seq_len):
    """FlexAttention's BlockMask lists, per query block, the key blocks it computes (partly and wholly kept): their
    number is the planner's count, for rows with documents across, on and inside block boundaries."""
    gen = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(8, 100, (6, seq_len), generator=gen)
    tokens[0, [i for i in (100, 300, 301, seq_len - 40) if i < seq_len]] = EOD
    tokens[1, [i for i in (126, 127, 128, 255) if i < seq_len]] = EOD
    tokens[3, torch.randint(0, seq_len, (40,), generator=gen)] = EOD
    tokens[4, torch.arange(0, seq_len, 5)] = EOD  # every fifth token; tokens[2] and [5]: one document
    mask = document_attention_mask(document_positions(tokens, EOD), "flex")
    computed = (mask.kv_num_blocks.sum(-1) + mask.full_kv_num_blocks.sum(-1)).flatten().tolist()
    for row, tiles in zip(tokens.tolist(), computed):
        starts = [0] + [i + 1 for i, t in enumerate(row[:-1]) if t == EOD]
        assert document_tiles(starts, seq_len) == tiles
    assert computed[2] == causal_tiles(seq_len)  # one document is causal attention
    share = document_share([[0], [0, seq_len // 2]], seq_len)
    assert share.share < 1.0 or seq_len <= 128


def _problem(overrides, share):
    cfg = build_config({}, [("model.preset", "llama3-8b"), ("train.seq_len", "8192"), ("train.global_batch", "64"),
                            ("cluster.gpu", "h100-sxm-80gb"), ("cluster.num_gpus", "8"), ("parallel.dp_shard", "8"),
                            *overrides])
    problem = Problem.from_config(cfg)
    return dataclasses.replace(problem, document_share=share) if share is not None else problem, cfg


def _attention_s(problem, cfg):
    lay = Layout.from_config(cfg, problem.cluster.num_gpus)
    return microbatch_times(problem, lay, stage_model(problem.shape, 1, 0)).attn_fwd_layer


def test_the_planner_prices_the_tiles_the_documents_leave_at_flex_attentions_speed():
    plain = _attention_s(*_problem([], None))
    unmeasured = _attention_s(*_problem([("train.document_mask", "true")], None))
    half = _attention_s(*_problem([("train.document_mask", "true")], 0.5))
    # Unmeasured: causal's tiles, at FlexAttention's speed (0.49 of cuDNN's on Hopper, plan/constants.py).
    assert unmeasured == pytest.approx(plain / 0.49, rel=1e-9)
    assert half == pytest.approx(unmeasured / 2, rel=1e-9)


def test_on_a_cpu_the_dense_mask_computes_every_tile(tmp_path):
    """CPU SDPA given a mask skips no tile: twice causal attention's executed half."""
    kernels = tmp_path / "kernels.json"  # a measured CPU's rates (benchmarks/kernels.py's file, made up figures)
    kernels.write_text(json.dumps({
        "benchmark": "kernels", "device_type": "cpu", "gemm": {"dtype": "fp32", "peak_flops": 2e11, "rows": []},
        "bandwidth": {"rows": [{"kernel": "copy", "gbps": 40.0}]},
        "sdpa": {"rows": [{"requested": "default", "dtype": "fp32", "fwd_bwd_flops": 1.4e11}]},
        "overhead": {"rows": [{"mode": "eager", "s_per_op": 2e-6}]},
        "optimizer": {"rows": [{"impl": "foreach", "bytes_per_param_at_copy_bw": 100.0}]}}))
    cpu = [("cluster.gpu", "cpu"), ("cluster.num_gpus", "1"), ("parallel.dp_shard", "1"), ("train.global_batch", "1"),
           ("cluster.calibration", str(kernels)), ("train.precision", "fp32")]
    problem, cfg = _problem([*cpu, ("train.document_mask", "true")], None)
    plain, _ = _problem(cpu, None)
    assert problem.device_type == "cpu"
    assert _attention_s(problem, cfg) == pytest.approx(2 * _attention_s(plain, cfg), rel=1e-9)


def _data_config(tmp_path, corpus, fmt):
    return build_config({}, [("model.preset", "tiny"), ("model.vocab_size", "512"), ("data.tokenizer", "byte"),
                             ("data.path", str(corpus)), ("data.cache_dir", str(tmp_path / "cache")),
                             ("data.format", fmt), ("train.seq_len", "512"), ("train.document_mask", "true")])


@pytest.mark.parametrize("fmt", ["text", "prompt_completion"])
def test_the_share_is_measured_on_the_prepared_rows_and_never_prepares(tmp_path, fmt):
    corpus = tmp_path / "corpus.jsonl"
    gen = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(200):
        n = int(torch.randint(5, 120, (1,), generator=gen))
        body = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=gen))
        lines.append({"text": body} if fmt == "text" else {"prompt": body[: n // 2], "completion": body[n // 2:]})
    corpus.write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = _data_config(tmp_path, corpus, fmt)
    share, line = measure_document_share(cfg)
    assert share is None and "not prepared" in line and not (tmp_path / "cache" / "prepared").exists()
    data = prepare_data(cfg.data, cfg.model.vocab_size, lambda _: None)
    share, line = measure_document_share(cfg)
    assert share is not None and 0 < share.share < 1 and share.rows > 0 and line.startswith("document mask: ")
    # The same rows the trainer reads, counted by the trainer's own positions and FlexAttention's block mask.
    from shardwise.train.data import batch_sources, split_inputs_targets
    rows = batch_sources(data, 512, cfg.data.loss_on)[0].tokens
    windows = (len(rows) - 1) // 512
    picks = torch.linspace(0, windows - 1, min(256, windows)).long().unique()
    inputs, _ = split_inputs_targets(torch.as_tensor(rows.windows(picks.numpy() * 512, 513)))
    mask = document_attention_mask(document_positions(inputs, data.eod_id), "flex")
    tiles = int((mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()))
    assert share.share == pytest.approx(tiles / (len(picks) * causal_tiles(512)), rel=1e-12)
