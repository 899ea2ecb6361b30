"""The planner's price of validation rounds (plan/evaluation.py) and `plan evaluate`'s line for it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.config import build_config
from shardwise.plan.evaluation import eval_price, eval_rounds, forward_batch_seconds, validation_sets

BREAKDOWN = {"compute": 3.0, "tp_comm": 0.3, "cp_comm": 0.0, "ep_comm": 0.0, "pp_comm": 0.2, "dp_comm": 0.6}
DETAIL = {"t_fwd_microbatch_s": 0.25, "microbatches": 4}


@pytest.mark.parametrize(("keys", "rounds"), [([("eval.every", "50")], 4), ([("eval.every", "30")], 7),
                                              ([("eval.every", "30"), ("eval.at_end", "false")], 6), ([], 1),
                                              ([("eval.at_end", "false")], 0)])
def test_rounds_are_every_n_steps_and_one_at_the_end(keys, rounds):
    assert eval_rounds(build_config({}, [("train.steps", "200"), *keys])) == rounds


def test_a_forward_batch_is_the_forward_share_of_the_step():
    # 4 x 0.25 s of forward, a third of tp, half of pp; the dp all-gather's third only under ZeRO-3; the fill.
    assert forward_batch_seconds(BREAKDOWN, DETAIL, pp=1, chunks_per_rank=1, zero=1) == pytest.approx(1.0 + 0.1 + 0.1)
    assert forward_batch_seconds(BREAKDOWN, DETAIL, pp=1, chunks_per_rank=1, zero=3) == pytest.approx(1.2 + 0.2)
    assert forward_batch_seconds(BREAKDOWN, DETAIL, pp=4, chunks_per_rank=2, zero=1) == pytest.approx(1.2 + 3 * 0.125)


def test_a_round_counts_every_set_and_whole_global_batches():
    cfg = build_config({}, [("data.sources", '[{path = "a"}, {path = "b"}]'), ("data.valid_fraction", "0.01"),
                            ("data.valid", '[{path = "c"}]'), ("train.global_batch", "8"), ("train.seq_len", "128"),
                            ("eval.tokens", "2049"), ("eval.every", "100"), ("train.steps", "200")])
    assert validation_sets(cfg) == 3
    price = eval_price(cfg, BREAKDOWN, DETAIL, pp=1, chunks_per_rank=1)
    assert (price.batches_per_set, price.rounds) == (3, 2)  # 2049 tokens -> 3 batches of 1,024
    assert price.total_s == pytest.approx(2 * 3 * 3 * 1.2)
    assert eval_price(build_config({}, []), BREAKDOWN, DETAIL, 1, 1) is None  # no validation set


def test_plan_evaluate_prints_the_rounds_and_their_share_of_the_run():
    base = [sys.executable, "-m", "shardwise.cli", "plan", "evaluate", "--model.preset=tiny", "--data.valid_fraction=0.01",
            "--eval.every=50", "--eval.tokens=100000"]
    text = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    assert "evaluation: 4 rounds x 1 set x 49 batches" in text and "of the training time" in text
    report = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True, check=True).stdout)
    assert report["evaluation"]["rounds"] == 4 and report["evaluation"]["total_s"] > 0
