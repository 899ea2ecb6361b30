"""`shardwise plan evaluate --mode=decode` (plan/decode.py): KV-cache and weight bytes per rank derived by
hand, how decode time scales with bandwidth and tp, the refusal of other axes, and the CLI's outputs."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.plan.decode import decode_estimate, stage_forward_flops
from shardwise.plan.inventory import pipeline_rank
from shardwise.spec.shapes import ModelShape


def config(preset: str = "tiny", tp: int = 1, pp: int = 1, precision: str = "fp32", *extra: str):
    return load_config(None, [f"--model.preset={preset}", f"--parallel.tp={tp}", f"--parallel.pp={pp}",
                              f"--train.precision={precision}", *extra])


# ---- KV cache --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_kv_cache_bytes_per_rank_by_hand_with_gqa(tp, pp):
    # tiny: 2 blocks, 4 query heads sharing 2 KV heads (GQA), head_dim 64 / 4 = 16; fp32.
    batch, prompt, new = 3, 40, 24
    est = decode_estimate(config("tiny", tp, pp), batch, prompt, new)
    blocks_per_rank = 2 // pp
    kv_heads_per_rank = 2 // tp
    expected = 2 * blocks_per_rank * batch * kv_heads_per_rank * (prompt + new) * 16 * 4
    assert [s.kv_cache_bytes for s in est.stages] == [expected] * pp


def test_kv_cache_of_llama3_8b_tp2_bf16_to_the_byte():
    # 32 blocks x k,v x batch 8 x 8/2 KV heads x 1280 positions x head_dim 128 x 2 B.
    est = decode_estimate(config("llama3-8b", 2, 1, "bf16"), 8, 1024, 256)
    assert est.stages[0].kv_cache_bytes == 2 * 32 * 8 * 4 * 1280 * 128 * 2 == 671_088_640


def test_fewer_kv_heads_than_ranks_cache_one_head_each():
    # tiny has 2 KV heads; at tp=4 each rank computes (ReplicatedKVColwise) and caches the one its queries use.
    est = decode_estimate(config("tiny", 4), 1, 10, 6)
    assert est.stages[0].kv_cache_bytes == 2 * 2 * 1 * 1 * 16 * 16 * 4


# ---- weights ---------------------------------------------------------------------------------------
def llama_counts(h, layers, kv, f, vocab):
    """(all parameters, those replicated over tp) of a llama model, from the architecture."""
    block = 2 * h + h * h + 2 * kv * h + h * h + 3 * h * f   # 2 RMSNorms, wq, wk, wv, wo, w1 w3 w2
    return vocab * h + layers * block + h + vocab * h, (2 * layers + 1) * h  # RMSNorm weights


def gpt_counts(h, layers, f, vocab, positions):
    """gpt (n_kv = n_heads): biases everywhere; norms, row-parallel biases (wo, proj) and positions replicated."""
    block = 2 * (2 * h) + 4 * (h * h + h) + (f * h + f) + (h * f + h)
    total = vocab * h + positions * h + layers * block + 2 * h + vocab * h
    return total, positions * h + layers * (2 * 2 * h + 2 * h) + 2 * h


@pytest.mark.parametrize("preset,counts,precision,elt", [
    ("small", llama_counts(256, 4, 128, 704, 8192), "bf16", 2),
    ("tiny-gpt", gpt_counts(64, 2, 256, 2048, 512), "fp32", 4),
])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_weights_summed_over_ranks_are_the_model_plus_replicas(preset, counts, precision, elt, tp, pp):
    total, replicated = counts
    est = decode_estimate(config(preset, tp, pp, precision), 1, 16, 16)
    assert est.bytes_per_element == elt
    assert sum(s.weight_bytes for s in est.stages) * tp == (total + (tp - 1) * replicated) * elt
    assert ModelShape.from_config(config(preset).model).num_params == total  # the hand count is the model


def test_fp8_is_planned_in_bf16_and_says_so():
    est = decode_estimate(config("small", 1, 1, "fp8"), 1, 16, 16)
    assert est.bytes_per_element == 2 and any("fp8" in n for n in est.notes)


# ---- time ------------------------------------------------------------------------------------------
def test_stage_flops_split_the_models_forward_flops():
    for preset in ("llama3-8b", "mixtral-8x7b"):
        shape = ModelShape.from_config(config(preset).model)
        for pp in (1, 2, 3):
            parts = [stage_forward_flops(shape, pipeline_rank(shape, pp, 1, "1f1b", r), 700) for r in range(pp)]
            assert sum(g + a for g, a in parts) == shape.flops_per_token(700) / 3


def test_doubling_memory_bandwidth_halves_memory_bound_decode():
    cfg = config("llama3-8b", 1, 1, "bf16")
    slow = decode_estimate(cfg, 1, 512, 128, memory_bandwidth_gbps=1000.0)
    fast = decode_estimate(cfg, 1, 512, 128, memory_bandwidth_gbps=2000.0)
    assert fast.stages[0].decode_memory_s == pytest.approx(slow.stages[0].decode_memory_s / 2)
    assert slow.stages[0].decode_memory_s > 10 * slow.stages[0].decode_compute_s  # memory-bound at batch 1
    assert fast.decode_s_per_token / slow.decode_s_per_token == pytest.approx(0.5, abs=0.02)
    # 16.06 GB of bf16 weights less the 1.05 GB embedding table (a step gathers one row of it), plus 75 MB
    # of KV cache at the average context 576, at 1 TB/s: 15.09 ms a token.
    assert slow.decode_s_per_token == pytest.approx(15.09e-3, rel=0.01)
    assert slow.decode_tokens_per_s == pytest.approx(1 / slow.decode_s_per_token)


def test_tp2_halves_the_sharded_bytes_a_decode_step_reads():
    # llama3-8b, bf16, batch 4: a step reads the TP-split weights (blocks' matmuls, head) and KV cache,
    # plus what tp does not split: norms and the batch's embedding rows (a gather on every rank).
    h, layers, kv, f, vocab, batch, prompt, new = 4096, 32, 1024, 14336, 128256, 4, 1000, 200
    split_weights = layers * (2 * h * h + 2 * kv * h + 3 * h * f) + vocab * h
    kv_cache = 2 * layers * batch * 8 * (prompt + new / 2) * 128
    unsplit = (2 * layers + 1) * h + batch * h
    reads = {tp: decode_estimate(config("llama3-8b", tp, 1, "bf16"), batch, prompt, new).stages[0].decode_read_bytes
             for tp in (1, 2)}
    for tp in (1, 2):
        assert reads[tp] == pytest.approx(2 * ((split_weights + kv_cache) / tp + unsplit))
    assert (reads[1] - 2 * unsplit) / (reads[2] - 2 * unsplit) == pytest.approx(2.0)


def test_prefill_is_compute_bound_and_counts_prompt_tokens():
    est = decode_estimate(config("llama3-8b", 1, 1, "bf16"), 8, 1024, 16)
    stage = est.stages[0]
    assert stage.prefill_compute_s > 5 * stage.prefill_memory_s
    assert est.prefill_tokens_per_s == pytest.approx(8 * 1024 / est.prefill_s)
    assert est.generate_s == pytest.approx(est.prefill_s + 15 * est.decode_s_per_token)


def test_pipeline_stages_add_their_latencies_and_split_the_cache():
    one = decode_estimate(config("llama3-8b", 1, 1, "bf16"), 2, 256, 64)
    two = decode_estimate(config("llama3-8b", 1, 2, "bf16"), 2, 256, 64)
    assert sum(s.kv_cache_bytes for s in two.stages) == one.stages[0].kv_cache_bytes
    assert two.decode_s_per_token > one.decode_s_per_token  # same bytes, plus a send and a broadcast
    assert two.decode_s_per_token == pytest.approx(one.decode_s_per_token, rel=0.05)


def test_context_beyond_max_seq_len_is_refused():
    with pytest.raises(ConfigError, match="max_seq_len"):
        decode_estimate(config("tiny"), 1, 500, 100)


# ---- CLI -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,args", [
    ("parallel.dp_replicate", ["--parallel.dp_replicate=2"]),
    ("parallel.dp_shard", ["--parallel.dp_shard=2", "--parallel.zero=3"]),
    ("parallel.cp", ["--parallel.cp=2"]),
    ("parallel.ep", ["--model.preset=tiny-moe", "--parallel.ep=2", "--parallel.zero=3"]),
])
def test_other_axes_than_tp_and_pp_are_refused_with_exit_2(field, args, capsys):
    assert main(["plan", "evaluate", "--mode=decode", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}:" in err and "serving runs one model replica" in err


def test_cli_text_shows_memory_prefill_and_latency(capsys):
    assert main(["plan", "evaluate", "--mode=decode", "--model.preset=small", "--parallel.tp=2", "--parallel.pp=2",
                 "--batch", "4", "--prompt-len", "100", "--max-new-tokens", "50"]) == 0
    out = capsys.readouterr().out
    for text in ("KV cache", "batch 4, prompt 100, 50 new tokens", "per-token latency", "tokens/s", "prefill",
                 "0 emb", "1 head", "fits"):
        assert text in out, text


def test_cli_json_keys(capsys):
    assert main(["plan", "evaluate", "--mode", "decode", "--model.preset=small", "--json", "--batch", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes", "kv_cache_bytes", "total_bytes", "fits", "prefill_s", "prefill_tokens_per_s",
                "decode_s_per_token", "decode_tokens_per_s", "memory_gib", "stages", "notes"):
        assert key in data, key
    assert data["prompt_len"] == 128 and data["max_new_tokens"] == 128 and data["batch"] == 2  # defaults
    assert {"decode_read_bytes", "decode_memory_s", "decode_compute_s", "decode_comm_s", "prefill_s"} <= set(data["stages"][0])


def test_train_mode_is_the_default(capsys):
    assert main(["plan", "evaluate", "--json"]) == 0
    assert "step_time_s" in json.loads(capsys.readouterr().out)


def test_a_cuda_graph_decode_step_against_the_h200_measurement():
    """The GPU decode model (plan/decode.py decode_kernel_s) against compiled decoding measured on one
    H200 (tests/fixtures/h200_decode.json, benchmarks/decode.py): the GEMMs it counts are the 113 kernels
    of the profile, and the decode tokens/s are within issue 30's 20% at batch 1 and 64 (the model was
    derived from the batch-1 profile: batch 64 is the held-out row). That engine ran q, k, v, w1 and w3
    as separate GEMMs (fused_projections=False); serving now fuses them: 4 GEMMs a block instead of 7.
    Eager decoding is host-bound and not what the planner prices."""
    from pathlib import Path

    from shardwise.plan import constants as C
    from shardwise.plan.decode import decode_kernel_s

    fx = json.loads((Path(__file__).parents[1] / "fixtures" / "h200_decode.json").read_text())
    cfg = load_config(None, fx["model"] + [f"--train.precision={fx['precision']}", f"--cluster.gpu={fx['gpu']}"])
    shape = ModelShape.from_config(cfg.model)
    one_stage = pipeline_rank(shape, 1, 1, "1f1b", 0)
    assert decode_kernel_s(shape, one_stage, fused=False) == pytest.approx(
        fx["profile_batch1"]["gemm_kernels_per_step"] * C.DECODE_GEMM_KERNEL_S + 16 * C.DECODE_BLOCK_OTHER_S)
    assert decode_kernel_s(shape, one_stage) == pytest.approx((16 * 4 + 1) * C.DECODE_GEMM_KERNEL_S + 16 * C.DECODE_BLOCK_OTHER_S)
    for row in fx["rows"]:
        est = decode_estimate(cfg, row["batch"], row["prompt_len"], row["new_tokens"], fused_projections=False)
        assert est.stages[0].kv_cache_bytes == row["kv_cache_bytes"]
        error = est.decode_tokens_per_s / row["compiled_decode_tokens_per_s"] - 1
        assert abs(error) < 0.20, (row["batch"], error)  # measured: +12.6% at batch 1, +11.7% at 64
