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
