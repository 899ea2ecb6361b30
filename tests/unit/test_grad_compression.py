"""Gradient compression's pure pieces: the int8 / topk encodings against exact sums, the closed forms of
plan/compression.py, the planner's default untouched, and the refusals before spawning (exit 2)."""
from __future__ import annotations

import pytest
import torch

from shardwise.cli import main
from shardwise.config import build_config
from shardwise.parallel.grad_compression import int8_decode, int8_encode, int8_pack, int8_unpack, topk_encode, topk_pack, topk_unpack
from shardwise.plan.comm import predict_comm_bytes
from shardwise.spec.compression import INT8_CHUNK, INT8_LEVELS, powersgd_elements, topk_count

TINY = [("model.preset", "tiny"), ("model.vocab_size", "512"), ("train.seq_len", "32"), ("train.global_batch", "8"),
        ("train.micro_batch", "4"), ("parallel.dp_replicate", "2"), ("cluster.num_gpus", "2")]


def test_int8_sum_over_ranks_plus_residuals_is_the_gradient_sum():
    """What the ranks send (dequantized) plus what they keep (error feedback) is exactly what they had:
    nothing is lost, only delayed. Rounding to nearest leaves at most half a step per entry behind."""
    g = torch.Generator().manual_seed(0)
    # 3 ranks, 2.5 chunks each, with an outlier that coarsens only its own chunk
    grads = [torch.randn(int(2.5 * INT8_CHUNK), generator=g) * (10 ** r) for r in range(3)]
    grads[0][7] = 1e4
    sent, kept = torch.zeros_like(grads[0]), torch.zeros_like(grads[0])
    for x in grads:
        q, scale = int8_encode(x)
        assert q.dtype == torch.int8 and q.abs().max() <= INT8_LEVELS and scale.numel() == 3
        q2, scale2 = int8_unpack(int8_pack(q, scale), x.numel())
        assert torch.equal(q2, q) and torch.equal(scale2, scale)
        deq = int8_decode(q, scale)
        residual = x - deq
        step = scale.repeat_interleave(INT8_CHUNK)[:x.numel()]
        assert (residual.abs() <= step / 2 * (1 + 1e-5)).all()
        sent += deq
        kept += residual
    total = sum(grads)
    torch.testing.assert_close(sent + kept, total, rtol=1e-6, atol=1e-4)
    # the outlier's chunk is coarse, the others are not
    assert int8_encode(grads[0])[1][1] < int8_encode(grads[0])[1][0] / 100


def test_topk_keeps_the_largest_and_ratio_one_keeps_all():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.05, 0.0, 1.0, -2.0])
    values, idx = topk_encode(x, 0.25)
    assert sorted(idx.tolist()) == [1, 3]
    v2, i2 = topk_unpack(topk_pack(values, idx))
    assert torch.equal(v2, values) and torch.equal(i2, idx.long())
    values, idx = topk_encode(x, 1.0)
    rebuilt = torch.zeros_like(x).index_add_(0, idx.long(), values)
    assert torch.equal(rebuilt, x)
    assert topk_count(1000, 0.01) == 10 and topk_count(5, 1e-9) == 1 and topk_count(5, 1.0) == 5


def test_powersgd_elements_follow_torch():
    """1-D tensors whole; a matrix compressed only when (n + m) r x 2 < n m (torch's min_compression_rate)."""
    assert powersgd_elements((64,), 4) == (64, 0, 0)
    assert powersgd_elements((192, 64), 4) == (0, 192 * 4, 64 * 4)
    assert powersgd_elements((8, 8), 4) == (64, 0, 0)  # (8 + 8) 4 2 = 128 >= 64
    assert powersgd_elements((2, 3, 4), 8) == (24, 0, 0)  # viewed (2, 12): r' = 2, (14) 2 2 = 56 >= 24


def _planned(method: str, **extra) -> int:
    cfg = build_config(None, TINY + [("parallel.grad_compression", method)] + list(extra.items()))
    return sum(sum(k.values()) for k in predict_comm_bytes(cfg).values())


def test_closed_forms_of_the_planner():
    """The module doc's formulas on the tiny model (n = 164160 gradient entries in its tensors, w = 2)."""
    from shardwise.spec.shapes import ModelShape

    shape = ModelShape.from_config(build_config(None, TINY).model)
    sizes = [spec.numel for spec in shape.params()]
    n, w = sum(sizes), 2
    assert n == 164160
    assert _planned("none") == 4 * n
    assert _planned("bf16") == 2 * n
    assert _planned("int8") == w * (n + 4 * sum(-(-t // INT8_CHUNK) for t in sizes))
    assert _planned("topk") == w * 8 * sum(-(-t // 100) for t in sizes)  # ratio 0.01
    assert _planned("topk", **{"parallel.grad_compression_ratio": "1.0"}) == w * 8 * n
    u = p = q = 0
    for spec in shape.params():
        a, b, c = powersgd_elements(spec.shape, 4)
        u, p, q = u + a, p + b, q + c
    assert _planned("powersgd") == 4 * (u + p + q)
    assert _planned("powersgd", **{"parallel.powersgd_rank": "1"}) < _planned("powersgd")


def test_planner_prices_compression_and_leaves_none_unchanged():
    """The dp communication shrinks (on 8 ranks of a 1B-class model over a slow network) and the encode /
    decode compute is reported; 'none' has no compression detail at all."""
    from shardwise.plan.cost import evaluate
    from shardwise.plan.layout import Problem
    from shardwise.spec.layout import Layout

    def estimate(method: str):
        cfg = build_config(None, [("model.preset", "small"), ("parallel.dp_replicate", "8"), ("cluster.num_gpus", "8"),
                                  ("cluster.gpus_per_node", "1"), ("parallel.grad_compression", method)])
        return evaluate(Problem.from_config(cfg), Layout.from_config(cfg, 8))

    base = estimate("none")
    assert "grad_compression_compute_s" not in base.detail
    for method in ("bf16", "powersgd", "topk"):
        e = estimate(method)
        assert e.detail["grad_compression_compute_s"] > 0
        assert e.breakdown_s["dp_comm"] < base.breakdown_s["dp_comm"], method


@pytest.mark.parametrize("argv, phrase", [
    (["--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.grad_compression=int8"], "FSDP2 (zero=3) reduce-scatters"),
    (["--parallel.dp_shard=2", "--parallel.zero=2", "--parallel.grad_compression=powersgd"], "no communication hook"),
    (["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.zero=2", "--parallel.grad_compression=topk"],
     "HSDP (zero=2, dp_replicate=2) reduce-scatters"),
    (["--parallel.tp=2", "--parallel.dp_replicate=2", "--parallel.grad_compression=topk"], "FSDP2's replicate"),
    (["--parallel.dp_replicate=2", "--parallel.grad_compression=zip"], "not one of"),
    (["--parallel.dp_replicate=2", "--parallel.grad_compression=topk", "--parallel.grad_compression_ratio=0"],
     "within (0, 1]"),
    (["--parallel.dp_replicate=2", "--parallel.grad_compression=powersgd", "--parallel.powersgd_rank=0"], "must be >= 1"),
    (["--parallel.dp_replicate=2", "--parallel.grad_compression=powersgd", "--parallel.powersgd_warmup_steps=1"],
     "must be >= 2"),
])
def test_refused_before_spawning(argv, phrase, capsys, tmp_path):
    nproc = "4" if "--parallel.tp=2" in argv or "--parallel.dp_shard=2" in argv and "--parallel.dp_replicate=2" in argv else "2"
    code = main(["train", *argv, "--nproc", nproc, f"--data.cache_dir={tmp_path}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert phrase in err and "Traceback" not in err


def test_bf16_allowed_everywhere():
    from shardwise.preflight import check

    for extra in ([("parallel.dp_shard", "2"), ("parallel.zero", "3")], [("parallel.tp", "2")], [("parallel.dp_replicate", "2")]):
        check(build_config(None, [("model.preset", "tiny"), ("parallel.grad_compression", "bf16")] + extra), 2)


def test_plan_evaluate_says_what_gradient_compression_costs_or_that_it_is_not_applied(capsys):
    base = ["plan", "evaluate", "--model.preset=llama3-8b", "--cluster.num_gpus=8", "--train.global_batch=64",
            "--train.micro_batch=1", "--train.seq_len=2048", "--parallel.grad_compression=int8"]
    assert main([*base, "--parallel.dp_replicate=8"]) == 0  # DDP: its communication hook encodes
    layout = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layout"))
    assert "gradients int8: encode / decode " in layout and " s in dp_comm" in layout
    assert main([*base, "--parallel.dp_replicate=4", "--parallel.tp=2"]) == 0  # FSDP2's replicate: no hook
    layout = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layout"))
    assert "gradients int8: not applied" in layout
