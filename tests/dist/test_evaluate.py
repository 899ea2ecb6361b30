"""Validation rounds (train/evaluate.py): they change nothing in training, and they compute what they say.

Equality with one device on every layout is in the parity matrix (tests/parity: each case evaluates a
validation set after its last step). Here: training losses are bitwise those of a run without
evaluation on the layouts whose forward differs most from training's — FSDP (ZeRO-3 and ZeRO-2, whose
parameters stay gathered after a forward that no backward follows), a pipeline schedule switched to
eval() and back, tensor parallel, and compiled blocks, which compile the no-grad forward apart — and one
process's validation loss equals a plain forward of its final weights over the same windows.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import build_config
from shardwise.models import build_model
from shardwise.parity import parity_config, train_and_record, valid_losses
from shardwise.train.data import prepare_data
from shardwise.train.evaluate import eval_sets
from tests.harness import run_world

STEPS = 6
EVAL = [("eval.every", "2")]
LAYOUTS = {
    "zero3_dp2": (2, {"parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 2}),
    "zero2_dp2": (2, {"parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 4}),
    "pp2_1f1b": (2, {"parallel.pp": 2, "train.micro_batch": 2}),
    "tp2": (2, {"parallel.tp": 2}),
}


def _overrides(layout: dict) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in layout.items()]


@pytest.fixture(scope="module")
def runs(base_overrides, valid_overrides, tmp_path_factory) -> Path:
    """Every layout trained twice in one world (with evaluation every 2 steps, and with no validation set at
    all), and one compiled process likewise."""
    root = tmp_path_factory.mktemp("evaluate")
    base = [*base_overrides, ("train.steps", str(STEPS))]

    def cases(name: str, layout: list[tuple[str, str]]):
        yield parity_config({}, [*base, *valid_overrides, *EVAL], layout, root / f"{name}_eval")
        yield parity_config({}, base, layout, root / f"{name}_plain")

    def work(rank: int) -> None:
        for name, (_, layout) in LAYOUTS.items():
            for cfg in cases(name, _overrides(layout)):
                train_and_record(cfg, single_process=False)

    run_world(2, work)

    def single(rank: int) -> None:
        for cfg in cases("compiled", [("train.compile", "true"), ("train.compile_backend", "aot_eager")]):
            train_and_record(cfg, single_process=True)
        for cfg in cases("single", []):
            train_and_record(cfg, single_process=True)

    run_world(1, single)
    return root


@pytest.mark.parametrize("name", [*LAYOUTS, "compiled", "single"])
def test_evaluation_leaves_training_bitwise_unchanged(runs, name):
    with_eval = json.loads((runs / f"{name}_eval" / "losses.json").read_text())
    plain = json.loads((runs / f"{name}_plain" / "losses.json").read_text())
    assert len(with_eval) == STEPS and with_eval == plain, f"{name}: {with_eval} != {plain}"
    rows = [json.loads(line) for line in (runs / f"{name}_eval" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r["step"] for r in rows if "valid_loss_heldout" in r]
    assert rounds == [2, 4, 6], f"{name}: validation rounds after steps {rounds}"  # every 2, the end among them
    assert all(r["valid_tokens_heldout"] == 512 for r in rows if "valid_loss_heldout" in r)


def test_validation_loss_is_a_plain_forward_of_the_final_weights(runs, base_overrides, valid_overrides):
    """The evaluator's number, recomputed without it: the final weights, the set's windows in the evaluator's
    order, F.cross_entropy's mean over every token."""
    cfg = build_config({}, [*base_overrides, *valid_overrides, ("train.steps", str(STEPS))])
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)
    (s,) = eval_sets(data.valid_sets(), cfg)
    rows = torch.cat([s.local_rows(b, 0, 1) for b in range(s.batches)])
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(runs / "single_eval" / "final_model.pt", weights_only=True))
    model.reset_buffers()  # RoPE's tables are not in the state dict
    with torch.no_grad():
        logits = model(rows[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()
    got = valid_losses(runs / "single_eval")["heldout"]
    # The same fp32 per-token losses summed in another order (per micro-batch, then in fp64): ~1e-7 relative.
    assert math.isclose(got, expected, rel_tol=1e-6), (got, expected)
