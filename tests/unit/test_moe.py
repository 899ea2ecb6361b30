"""Mixture of experts on one process: routing, capacity, the auxiliary losses against their formulas,
the losses' gradient injection, counts against the planner, and the model.moe config keys.

Tolerances: the hand formulas are evaluated in float64 from the module's own fp32 router probabilities,
so they agree to fp32 rounding of a handful of operations (1e-6 relative). The per-token reference of
the MoE output sums the same fp32 products in another grouping: 1e-5 absolute on outputs ~1e-1.
"""
from __future__ import annotations

import math

import pytest
import torch

from shardwise.config import build_config
from shardwise.config_reference import describe
from shardwise.errors import ConfigError
from shardwise.models import build_model
from shardwise.models.moe import MoE
from shardwise.spec.shapes import ModelShape


def _moe(num_experts=4, top_k=2, cf=0.0, aux=0.01, z=0.0, shared=0, arch_preset="tiny-moe", seed=0) -> MoE:
    cfg = build_config(None, [("model.preset", arch_preset), ("model.moe.num_experts", str(num_experts)),
                              ("model.moe.top_k", str(top_k)), ("model.moe.capacity_factor", str(cf)),
                              ("model.moe.aux_loss_coef", str(aux)), ("model.moe.z_loss_coef", str(z)),
                              ("model.moe.num_shared_experts", str(shared))])
    torch.manual_seed(seed)
    moe = MoE(cfg.model)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return moe


def test_routing_topk_renormalised():
    moe = _moe(num_experts=4, top_k=2)
    x = torch.randn(5, moe.router.in_features)
    top_i, weights, keep, probs, _ = moe.route(x)
    expected = torch.softmax(x @ moe.router.weight.t(), dim=-1)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    ranked = expected.argsort(dim=-1, descending=True)[:, :2]
    assert torch.equal(top_i, ranked)
    chosen = expected.gather(1, ranked)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    assert keep.all()  # dropless


def test_output_equals_per_token_sum_of_weighted_experts():
    moe = _moe(num_experts=4, top_k=2, shared=1)
    x = torch.randn(2, 3, moe.router.in_features)
    out = moe(x)
    tokens = x.reshape(-1, x.shape[-1])
    top_i, weights, *_ = moe.route(tokens)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    want = []
    for t in range(tokens.shape[0]):
        acc = moe.shared_experts(tokens[t])
        for j in range(2):
            e = top_i[t, j]
            h = torch.nn.functional.silu(w1[e] @ tokens[t]) * (w3[e] @ tokens[t])
            acc = acc + weights[t, j] * (w2[e] @ h)
        want.append(acc)
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), torch.stack(want), atol=1e-5, rtol=1e-5)


def test_capacity_drops_later_slots_first_then_later_tokens():
    """E=2, k=2, cf=0.5, T=4: C = ceil(0.5 * 4 * 2 / 2) = 2. Every token's first choice is expert 0 and
    second expert 1: expert 0 keeps the first choices of tokens 0, 1, expert 1 the second choices of
    tokens 0, 1; the 4 slots of tokens 2 and 3 are dropped."""
    moe = _moe(num_experts=2, top_k=2, cf=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 5.0
    x = torch.zeros(4, moe.router.in_features)
    x[:, 0] = 1.0
    assert moe.capacity(4) == 2
    top_i, _, keep, _, _ = moe.route(x)
    assert top_i.tolist() == [[0, 1]] * 4
    assert keep.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    out = moe(x.view(1, 4, -1))
    assert moe.stats_dropped == 4 and moe.stats_load.tolist() == [4.0, 4.0]
    assert out[0, 2:].abs().max() == 0 and out[0, :2].abs().max() > 0  # dropped tokens get no expert output

    # cf = 1: C = 4 per expert, nothing dropped; top-1 with cf = 1, T = 4, E = 2: C = 2 of the 4 first choices.
    assert _moe(num_experts=2, top_k=1, cf=1.0).capacity(4) == 2
    moe1 = _moe(num_experts=2, top_k=1, cf=1.0)
    with torch.no_grad():
        moe1.router.weight.copy_(moe.router.weight)
    assert moe1.route(x)[2].squeeze(1).tolist() == [True, True, False, False]


def test_aux_and_z_loss_match_formulas():
    moe = _moe(num_experts=4, top_k=2, aux=0.01, z=0.001)
    x = torch.randn(16, moe.router.in_features)
    top_i, _, _, probs, logits = moe.route(x)
    aux, z, counts = moe.aux_losses(top_i, probs, logits)
    p64, l64 = probs.double(), logits.double()
    f = torch.tensor([(top_i == e).sum().item() / (16 * 2) for e in range(4)], dtype=torch.float64)
    want_aux = 0.01 * 4 * (f * p64.mean(0)).sum()
    want_z = 0.001 * (torch.logsumexp(l64, -1) ** 2).mean()
    assert math.isclose(aux.item(), want_aux.item(), rel_tol=1e-6)
    assert math.isclose(z.item(), want_z.item(), rel_tol=1e-6)
    assert counts.tolist() == [(top_i == e).sum().item() for e in range(4)]
    # balanced routing gives alpha (Switch: the loss is minimised at uniform routing)
    uniform = torch.full((8, 4), 0.25)
    top = torch.tensor([[0, 1], [2, 3]] * 4)
    assert math.isclose(moe.aux_losses(top, uniform, uniform.log())[0].item(), 0.01, rel_tol=1e-6)


def test_aux_loss_gradient_is_injected_with_the_step_scale():
    """out.sum() backward with aux_grad_scale s gives the gradient of out.sum() + s * (aux + z)."""
    torch.manual_seed(1)
    moe = _moe(num_experts=4, top_k=2, aux=0.05, z=0.01)
    x = torch.randn(1, 12, moe.router.in_features)
    moe.aux_grad_scale = 0.25
    moe(x).sum().backward()
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_grad_scale = 0.0  # the function still runs, with a zero gradient for the losses
    out = moe(x)
    top_i, _, _, probs, logits = moe.route(x.reshape(-1, x.shape[-1]))
    aux, z, _ = moe.aux_losses(top_i, probs, logits)
    (out.sum() + 0.25 * (aux + z)).backward()
    # Two graphs add the same fp32 terms in another order (gradients ~0.1-1): 1e-5 absolute.
    torch.testing.assert_close(injected, moe.router.weight.grad, rtol=1e-4, atol=1e-5)
    assert (injected - moe.router.weight.grad).abs().max() < 1e-2 * 0.25 * 0.05  # far below the injected term


@pytest.mark.parametrize("overrides", [
    [("model.preset", "tiny-moe")],
    [("model.preset", "tiny-moe"), ("model.n_layers", "4"), ("model.moe.every_k_layers", "2"),
     ("model.moe.num_shared_experts", "2"), ("model.moe.top_k", "1")],
    [("model.preset", "tiny-gpt"), ("model.moe.num_experts", "4"), ("model.moe.num_shared_experts", "1"),
     ("model.moe.expert_ffn_dim", "32")],
    [("model.preset", "mixtral-8x7b")],
    [("model.preset", "deepseekmoe-16b")],
], ids=["tiny-moe", "every2-shared", "gpt-shared", "mixtral", "deepseekmoe"])
def test_counts_match_planner_and_modules(overrides):
    cfg = build_config(None, overrides)
    with torch.device("meta"):
        model = build_model(cfg.model)
    shape = ModelShape.from_config(cfg.model)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(s.name, s.shape) for s in shape.params()]
    assert model.num_params() == sum(p.numel() for p in model.parameters()) == shape.num_params
    assert model.flops_per_token(128) == shape.flops_per_token(128)
    # FLOPs count the active experts only: fewer than a dense model holding every expert
    m = cfg.model.moe
    if m.num_experts > m.top_k:
        assert shape.active_matmul_params < sum(s.numel for s in shape.params() if len(s.shape) >= 2)


def test_published_sizes():
    """Mixtral 8x7B: 46.7B parameters, 12.9B active (Jiang et al. 2024, §2)."""
    shape = ModelShape.from_config(build_config(None, [("model.preset", "mixtral-8x7b")]).model)
    assert abs(shape.num_params / 1e9 - 46.7) < 0.05
    assert abs(shape.active_matmul_params / 1e9 - 12.9) < 0.2  # + embeddings' lookup (not a GEMM)


def test_moe_config_keys():
    cfg = build_config({"model": {"preset": "tiny-moe", "moe": {"top_k": 1, "capacity_factor": 1.25}}},
                       [("model.moe.num_shared_experts", "1")])
    m = cfg.model.moe
    assert (m.num_experts, m.top_k, m.capacity_factor, m.num_shared_experts, m.aux_loss_coef) == (8, 1, 1.25, 1, 0.01)
    assert build_config(None, []).model.moe.num_experts == 0  # dense by default
    assert build_config(None, []).model.moe.capacity_factor == 0.0  # dropless by default
    assert "[model.moe]" in cfg.to_toml() and "[model.moe]" in describe() and "# top_k = (unset)" in describe()
    for bad in ([("model.moe.topk", "1")], [("model.moe", "1")], [("model.moe.top_k", "two")], [("model.moe.x.y", "1")]):
        with pytest.raises(ConfigError):
            build_config(None, bad)
    with pytest.raises(ConfigError, match="remove the quotes"):
        build_config({"model": {"moe": {"top_k": "2"}}})
    with pytest.raises(ConfigError, match="did you mean"):
        build_config({"model": {"moe": {"num_expert": 2}}})
