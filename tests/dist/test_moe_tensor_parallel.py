"""MoE x TP (parallel/tensor.py MoERegion): one forward/backward on 2 tp ranks gives every parameter the
single-process gradient — in particular the router's, whose aux / z-loss part every tp rank computes in
full and must count once (MoE.aux_grad_share), and the shared experts' (gpt: the row-wise bias added once).

(Gradients below 1e-4, such as gpt key biases (softmax ignores them), are compared absolutely.)
Large aux (1.0) and z (0.1) coefficients make a double-counted aux gradient visible: the negative control
(aux_grad_share = 1 on every tp rank) must fail the same comparison.
"""
from __future__ import annotations

import pytest
import torch

from shardwise.config import build_config
from tests.harness import run_world

CASES = {
    "llama_sp": ("tiny-moe", True),
    "llama_nosp": ("tiny-moe", False),
    "gpt_sp": ("tiny-gpt", True),
}


def _cfg(preset: str):
    over = [("model.preset", preset), ("model.vocab_size", "512"), ("model.moe.num_experts", "8"),
            ("model.moe.top_k", "2"), ("model.moe.num_shared_experts", "1"), ("model.moe.aux_loss_coef", "1.0"),
            ("model.moe.z_loss_coef", "0.1"), ("train.seq_len", "16")]
    return build_config(None, over).model


def _grads(model, tokens, full) -> dict[str, torch.Tensor]:
    from shardwise.models.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_grad_scale = 1.0
    logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return {n: full(p.grad).clone() for n, p in model.named_parameters()}


def _work(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardwise.models import build_model
    from shardwise.models.moe import MoE
    from shardwise.models.weights import RandomInit
    from shardwise.parallel.parallelize import materialize
    from shardwise.parallel.tensor import align_gradients_with_parameters, apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    out = {}
    for name, (preset, sp) in CASES.items():
        cfg = _cfg(preset)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.device("meta"):
            ref = build_model(cfg)
        materialize(ref, torch.device("cpu"), RandomInit(ref, 0))
        want = _grads(ref, tokens, full)
        errors = {}
        for control in (False, True):
            with torch.device("meta"):
                model = build_model(cfg)
            apply_tensor_parallel(model, mesh, cfg, sp)
            materialize(model, torch.device("cpu"), RandomInit(model, 0))
            align_gradients_with_parameters(model)
            if control:
                for m in model.modules():
                    if isinstance(m, MoE):
                        m.aux_grad_share = 1.0
            got = _grads(model, tokens, full)
            assert got.keys() == want.keys()
            errors[control] = {n: float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-4))
                               for n in want}
        out[name] = errors
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, _work)


@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_matches_one_process(results, case):
    for rank_out in results:
        errors = rank_out[case][False]
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-5, f"{case}: {worst} relative error {errors[worst]:.2e}"
        router = {n: e for n, e in errors.items() if "router" in n}
        shared = {n: e for n, e in errors.items() if "shared_experts" in n}
        assert router and shared
        print(f"{case}: max rel grad error {errors[worst]:.1e} ({worst}), router {max(router.values()):.1e}")


@pytest.mark.parametrize("case", list(CASES))
def test_aux_gradient_counted_tp_times_is_caught(results, case):
    errors = results[0][case][True]
    assert max(e for n, e in errors.items() if "router" in n) > 1e-3
