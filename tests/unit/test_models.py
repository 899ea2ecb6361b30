"""Models: closed-form parameter counts and FLOPs against the built modules and hand counts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.config import build_config
from shardwise.models import ARCHS, build_model
from shardwise.spec.presets import PRESETS


def _model_cfg(preset: str, **over):
    return build_config({"model": {"preset": preset, **over}}).model


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt", "small"])
def test_param_count_matches_modules(preset):
    cfg = _model_cfg(preset)
    model = build_model(cfg)
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_llama_tiny_hand_count():
    # dim 64, 2 layers, 4 heads (head 16), 2 kv heads (kv dim 32), ffn 192, vocab 2048
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192 + 2 * 64
    assert build_model(_model_cfg("tiny")).num_params() == 2048 * 64 + 2 * per_layer + 64 + 2048 * 64


@pytest.mark.parametrize("preset,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85),
                                             ("gpt3-175b", 174.6)])
def test_published_sizes(preset, billions):
    """Counts agree with the published model sizes (Llama 3 paper; GPT-3 paper's 175B)."""
    cfg = _model_cfg(preset)
    assert ARCHS[cfg.arch].count_params(cfg) / 1e9 == pytest.approx(billions, rel=0.01)


class _FlopCounter:
    """Count forward FLOPs by hand: 2 x in x out per token for every nn.Linear that runs."""

    def __init__(self, model: nn.Module):
        self.flops = 0
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(self._hook)

    def _hook(self, mod, inputs, out):
        tokens = inputs[0].numel() // mod.in_features
        self.flops += 2 * tokens * mod.in_features * mod.out_features


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_flops_per_token_matches_hand_count(preset):
    """Training FLOPs = 3 x forward; forward = every GEMM (counted by hooks) + attention
    QK^T and AV (2 x 2 x seq x dim per token per layer)."""
    cfg = _model_cfg(preset)
    model = build_model(cfg)
    model.init_weights(0)
    seq = 32
    counter = _FlopCounter(model)
    with torch.no_grad():
        model(torch.zeros(1, seq, dtype=torch.long))
    attention = 2 * 2 * seq * cfg.dim * cfg.n_layers * seq
    assert model.flops_per_token(seq) == 3 * (counter.flops + attention) // seq


def test_init_is_seeded_by_name_not_order():
    cfg = _model_cfg("tiny")
    a, b = build_model(cfg), build_model(cfg)
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    v1 = a.init_value("layers.1.attention.wq.weight", torch.Size([64, 64]), 3)
    v0 = a.init_value("layers.0.attention.wq.weight", torch.Size([64, 64]), 3)
    assert not torch.equal(v0, v1)
    assert torch.equal(a.init_value("norm.weight", torch.Size([64]), 3), torch.ones(64))
    # residual projections are scaled by 1/sqrt(2L) (GPT-2)
    wo = a.init_value("layers.0.attention.wo.weight", torch.Size([256, 256]), 0)
    assert wo.std().item() == pytest.approx(0.02 / 2, rel=0.05)


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = build_model(_model_cfg("llama3-405b", n_layers=2))
    assert all(p.is_meta for p in model.parameters())


def test_every_preset_is_consistent():
    from shardwise.preflight import check_model

    for name in PRESETS:
        check_model(build_config({"model": {"preset": name}, "train": {"seq_len": 128}}))


def test_fused_adamw_matches_foreach():
    """build_optimizer(fused=True), what the trainer uses on CUDA, on the same parameter groups as the
    CPU default: torch's fused AdamW exists on CPU too, so the grouping (decay / no decay) is checked
    here. Gradients are unit-scale random (not a model's, where near-zero rows put Adam in its eps
    regime and any reordering shows): 5 steps agree to 1e-6 against steps of lr = 3e-3, fp32
    rounding inside a differently ordered kernel."""
    from shardwise.config import load_config
    from shardwise.models import build_model
    from shardwise.train.optim import build_optimizer

    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=256"])
    models = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        opt = build_optimizer(model, cfg.train, fused=fused)
        assert opt.defaults.get("fused") is (True if fused else None)
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator)
            opt.step()
        models.append(model)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name
