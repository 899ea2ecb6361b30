"""`plan evaluate --straggler S` (plan/straggler.py): a straggler's price against the predicted step, and when
evicting its node pays off, checked against the break-even's own definition (as many steps either way)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.plan.straggler import straggler_price
from shardwise.spec.layout import Layout

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "plan-llama3-70b.toml"
# 70B on 8 nodes of 8, tp8 x dp_shard=-1 (ZeRO-3): one node fewer is dp 7, which the global batch 112 divides.
EIGHT_NODES = ["--parallel.dp_shard=-1", "--parallel.pp=1", "--parallel.zero=3", "--train.global_batch=112",
               "--cluster.num_gpus=64"]


def _price(overrides, slowness):
    cfg = load_config(str(CONFIG), overrides)
    problem = Problem.from_config(cfg)
    est = evaluate(problem, Layout.from_config(cfg, problem.cluster.num_gpus))
    return est, straggler_price(cfg, problem, est, slowness)


def test_a_straggler_slows_the_steps_compute_and_eviction_pays_off_at_the_break_even():
    est, p = _price(EIGHT_NODES, 1.6)
    b = est.breakdown_s
    busy = (b["compute"] + b["recompute"]) / sum(b.values())
    assert p.slow_step_s == pytest.approx(est.step_time_s * (1 + busy * 0.6))
    assert p.evicted_gpus == 56 and p.evicted_fits and p.evicted_step_s > est.step_time_s
    t, e, a, evicted = p.break_even_s, p.eviction_cost_s, p.slow_step_s, p.evicted_step_s
    assert t / a == pytest.approx((t - e) / evicted)  # as many steps kept or evicted after T
    assert p.line().endswith(f"pays off once the straggler lasts over {round(t / 60)} min")
    assert p.slow_days == pytest.approx(est.days * a / est.step_time_s)


def test_a_mild_straggler_is_cheaper_than_a_node_fewer():
    _, p = _price(EIGHT_NODES, 1.05)
    assert math.isinf(p.break_even_s) and "never pays off" in p.line()
    assert p.to_json()["break_even_s"] is None


def test_a_layout_that_cannot_lose_a_node_says_why():
    _, fixed = _price([], 1.3)  # dp_shard = 16 fixed: 1,016 GPUs do not make the layout
    assert fixed.evicted_step_s is None and "cannot run on one node fewer, 1016 GPUs" in fixed.line()
    assert "--parallel.dp_shard=-1" in fixed.line()
    _, one = _price(["--parallel.dp_shard=-1", "--parallel.pp=1", "--cluster.num_gpus=8"], 1.3)
    assert "one node: there is no other node" in one.line()


def test_a_straggler_must_be_slower():
    with pytest.raises(ConfigError, match="--straggler"):
        _price(EIGHT_NODES, 1.0)
