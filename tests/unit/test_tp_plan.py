"""The tensor-parallel plan as data: every parameter of both architectures is covered, GQA picks the
replicated-KV style only when there are fewer KV heads than TP ranks."""
from __future__ import annotations

import torch

from shardwise.config import build_config
from shardwise.models import build_model
from shardwise.parallel.tensor import COLWISE, COLWISE_REPLICATED_KV, ROWWISE, expand_plan, tp_plan


def _model_cfg(*overrides):
    return build_config({}, [tuple(o.split("=")) for o in overrides]).model


def test_plan_covers_every_parameter_of_both_architectures():
    for preset in ("tiny", "tiny-gpt"):
        cfg = _model_cfg(f"model.preset={preset}")
        with torch.device("meta"):
            model = build_model(cfg)
        plan = expand_plan(tp_plan(cfg, 2), model)
        owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
        assert owners <= set(plan), owners - set(plan)


def test_megatron_split_and_kv_replication():
    cfg = _model_cfg("model.preset=tiny")  # 4 query heads, 2 KV heads
    two, four = tp_plan(cfg, 2), tp_plan(cfg, 4)
    assert two["layers.*.attention.wq"] == two["layers.*.feed_forward.w1"] == COLWISE
    assert two["layers.*.attention.wo"] == two["layers.*.feed_forward.w2"] == ROWWISE
    assert two["layers.*.attention.wk"] == COLWISE                 # 2 KV heads over 2 ranks: split
    assert four["layers.*.attention.wk"] == four["layers.*.attention.wv"] == COLWISE_REPLICATED_KV


def test_moe_plan_covers_every_parameter_and_names_moe_blocks_by_index():
    """MoE models: every k-th block's feed-forward is one MoE region (router, experts and shared
    experts inside it), the other blocks keep the dense MLP entries."""
    from shardwise.parallel.tensor import MOE_REGION, REGION_INPUT

    for preset, ffn in (("tiny-moe", "feed_forward"), ("tiny-gpt", "mlp")):
        cfg = _model_cfg(f"model.preset={preset}", "model.moe.num_experts=4", "model.moe.every_k_layers=2",
                         "model.moe.num_shared_experts=1")
        with torch.device("meta"):
            model = build_model(cfg)
        raw = tp_plan(cfg, 2)
        assert raw[f"layers.1.{ffn}"] == MOE_REGION and raw[f"layers.0.{ffn}"] == REGION_INPUT
        plan = expand_plan(raw, model)
        owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
        covered = {o for o in owners if any(o == k or o.startswith(k + ".") for k, v in plan.items()
                                            if v == MOE_REGION or o == k)}
        assert covered == owners, owners - covered
