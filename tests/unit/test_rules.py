"""spec/rules.py is the one place a layout rule lives: the trainer's pre-flight and the planner report
the same violation in the same words, and rules marked trainer_only refuse a training run without
pruning the planner's search (the planner says "trainable: no" instead)."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.plan.layout import Problem, check_layout
from shardwise.preflight import check
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape


def _both(*overrides: str, world: int):
    """(pre-flight's ConfigError or None, the planner's first violation or None) for one config."""
    cfg = load_config(overrides=[*overrides, f"--cluster.num_gpus={world}", f"--cluster.gpus_per_node={world}"])
    try:
        check(cfg, world)
        trainer = None
    except ConfigError as e:
        trainer = e
    return trainer, check_layout(Problem.from_config(cfg), Layout.from_config(cfg, world))


@pytest.mark.parametrize("overrides, world, field", [
    (("--parallel.tp=3", "--parallel.dp_shard=1"), 3, "parallel.tp"),                        # heads % tp
    (("--parallel.tp=2", "--parallel.dp_shard=1", "--model.ffn_dim=191"), 2, "parallel.tp"),  # ffn % tp
    (("--parallel.cp=2", "--parallel.dp_shard=1", "--train.seq_len=30"), 2, "train.seq_len"),  # seq % 2cp
    (("--parallel.pp=2", "--parallel.dp_shard=1", "--parallel.pp_schedule=zbv"), 2, "parallel.pp_virtual_stages"),
    (("--parallel.zero=0", "--parallel.dp_shard=-1"), 2, "parallel.zero"),  # zero 0 shards nothing
    (("--train.global_batch=7", "--parallel.dp_shard=-1", "--parallel.zero=3"), 2, "train.global_batch"),
])
def test_the_trainer_and_the_planner_report_the_same_violation(overrides, world, field):
    trainer, planner = _both(*overrides, world=world)
    assert trainer is not None and planner is not None
    assert (trainer.field, trainer.problem, trainer.fix) == (planner.field, planner.problem, planner.fix) and trainer.field == field


def test_trainer_only_rules_refuse_training_but_not_planning(capsys):
    """Expert parallelism with ZeRO-1 is a limit of today's trainer (the experts' gradients would be
    all-reduced together), not of the layout: the planner prices it and says why it cannot train."""
    overrides = ("--model.preset=tiny-moe", "--parallel.ep=2", "--parallel.zero=1", "--parallel.dp_shard=-1")
    trainer, planner = _both(*overrides, world=2)
    assert planner is None
    assert trainer is not None and trainer.field == "parallel.zero" and "needs FSDP" in trainer.problem
    cfg = load_config(overrides=[*overrides, "--cluster.num_gpus=2"])
    found = list(rules.layout_rules(ModelShape.from_config(cfg.model), Layout.from_config(cfg, 2), 32, 8))
    assert [v.trainer_only for v in found] == [True]
    assert main(["plan", "evaluate", *overrides, "--cluster.num_gpus=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] is False and "needs FSDP" in out["trainer_refusal"]


def test_rules_yield_every_violation_in_order():
    """A layout breaking several rules gets all of them, cheapest first (the planner counts the first)."""
    shape = ModelShape("llama", 64, 2, 4, 2, 190, 512, 64)
    lay = Layout(tp=3, zero=0, dp_shard=2)
    reasons = [v.reason for v in rules.layout_rules(shape, lay, 32, 8)]
    assert reasons[:4] == ["zero", "heads % tp", "kv heads vs tp", "ffn % tp"]
