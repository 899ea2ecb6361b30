"""train.fuse_projections (models/feed_forward.py fused_linear, parallel/float8.py float8_fused_linear): q|k|v
and w1|w3 as one GEMM each from the same parameters, against the separate GEMMs on the same weights and
batch; its refusals. End to end (one process, ZeRO-3, GPT compiled) in tests/parity (FUSED_FAMILY)."""
from __future__ import annotations

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.models import build_model
from shardwise.models.feed_forward import fuse_training_projections
from shardwise.parallel import float8 as F8
from shardwise.parallel.precision import autocast
from shardwise.preflight import check


def _model(preset: str):
    cfg = load_config(None, [f"--model.preset={preset}", "--model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights(0)
    return model


def _run(model, precision: str = "fp32"):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    with autocast(precision, "cpu"):
        logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset, groups", [("tiny", 4), ("tiny-gpt", 2)])
def test_joined_gemms_give_the_separate_products(preset, groups):
    """fp32: each output is the same dot products, so the logits are bitwise equal; the input gradient of
    a joined GEMM sums its rows in one reduction where the separate GEMMs were added, a different order of
    fp32 additions (~1e-7 relative), which then reaches every earlier weight's gradient: 1e-5 relative, the
    parity contract's bound. GPT: attention's biased q|k|v (its MLP reads one linear: nothing to join)."""
    plain, fused = _model(preset), _model(preset)
    assert fuse_training_projections(fused) == groups  # 2 blocks x (attention, SwiGLU) or x attention
    assert list(fused.state_dict()) == list(plain.state_dict())  # the same parameters, names, checkpoints
    (ref, ref_grads), (got, got_grads) = _run(plain), _run(fused)
    assert torch.equal(ref, got)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.float().norm() / (ref.float() - got.float()).norm()))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_joined_gemms_stay_fp8(recipe):
    """torchao's emulation on CPU. Rowwise scales each weight row and each input row on its own: joined or
    apart the same FP8 values, so the logits are bitwise equal. Tensorwise takes one scale over the joined
    weight instead of one per weight: other roundings, as close to the separate FP8 GEMMs as FP8 is to
    bf16 (test_float8.py's 25 dB bound); and it is still FP8 (not a bf16 GEMM: that would match bf16 better
    than the separate FP8 GEMMs do)."""
    results = {}
    for kind in ("bf16", "fp8", "fused"):
        model = _model("tiny")
        if kind != "bf16":
            F8.apply_float8(model, recipe, fsdp=False, emulate=True)
        if kind == "fused":
            assert fuse_training_projections(model, F8.fused_linear_for) == 4
            assert all(m.fused_projection is F8.float8_fused_linear for m in model.modules()
                       if getattr(m, "fused_projection", None) is not None)
        results[kind] = _run(model, "bf16")
    (bf16, _), (fp8, fp8_grads), (fused, fused_grads) = results["bf16"], results["fp8"], results["fused"]
    if recipe == "rowwise":
        assert torch.equal(fp8, fused)
    else:
        assert _sqnr_db(fp8, fused) > 25.0
    assert _sqnr_db(bf16, fused) < 60.0  # FP8 rounding is there: a bf16 GEMM would be far closer
    assert _sqnr_db(bf16, fused) == pytest.approx(_sqnr_db(bf16, fp8), abs=6.0)
    for name, grad in fp8_grads.items():
        if grad.abs().sum() > 0:
            assert _sqnr_db(grad, fused_grads[name]) > 15.0, name


@pytest.mark.parametrize("overrides, problem", [
    (["--parallel.tp=2"], "with tp=2 are not implemented"),
    (["--train.precision=fp8", "--parallel.dp_shard=2", "--parallel.zero=3"], "(tensorwise) under FSDP")])
def test_refused_where_the_weights_cannot_be_joined(overrides, problem):
    cfg = load_config(None, ["--model.preset=tiny", "--train.fuse_projections=true", *overrides])
    with pytest.raises(ConfigError) as e:
        check(cfg, 2)
    assert e.value.field == "train.fuse_projections" and problem in e.value.problem
    fine = load_config(None, ["--model.preset=tiny", "--train.fuse_projections=true", "--train.precision=fp8",
                              "--train.fp8_recipe=rowwise", "--parallel.dp_shard=2", "--parallel.zero=3"])
    assert check(fine, 2).dp_shard == 2  # rowwise gathers bf16 weights: they join
