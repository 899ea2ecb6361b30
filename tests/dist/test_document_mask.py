"""train.document_mask on the layouts it composes with: each trains like one process (losses, final weights,
validation), on a corpus of short documents packed several to a row. Tolerance as the parity matrix's
(shardwise.parity: relative 1e-5 per step, 1e-4 on the weights): the mask changes which scores are kept,
not the order in which the layouts sum them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.parity import LOSS_RTOL, PARAM_ATOL, compare, compare_valid, parity_config, train_and_record
from tests.harness import run_world

STEPS = 6
LAYOUTS = {
    "zero3_dp2": (2, [("parallel.dp_shard", "2"), ("parallel.zero", "3"), ("train.micro_batch", "4")]),
    "tp2_sp": (2, [("parallel.tp", "2")]),
    # the positions reach every stage as a keyword of the schedule's step (parallel/pipeline.py), and the
    # forward-only validation pass
    "pp2_1f1b": (2, [("parallel.pp", "2"), ("train.micro_batch", "4")]),
    "ddp2_gpt": (2, [("parallel.dp_replicate", "2"), ("train.micro_batch", "4"), ("model.preset", "tiny-gpt")]),
    "compiled": (1, [("train.compile", "true"), ("train.compile_backend", "aot_eager")]),
}


@pytest.fixture(scope="module")
def runs(base_overrides, valid_overrides, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("document_mask")
    corpus = root / "docs.jsonl"  # documents of 5-40 bytes: 1-6 per 32-token row
    corpus.write_text("".join(json.dumps({"text": f"doc {i}: " + "ab " * (i % 12)}) + "\n" for i in range(3000)))
    base = [(k, v) for k, v in base_overrides if k != "data.path"] + [("data.path", str(corpus)), *valid_overrides,
                                                                      ("train.steps", str(STEPS)), ("train.document_mask", "true")]
    configs = {name: parity_config({}, base, keys, root / name) for name, (_, keys) in LAYOUTS.items()}
    configs["ref"] = parity_config({}, base, [], root / "ref")
    configs["ref_gpt"] = parity_config({}, base, [("model.preset", "tiny-gpt")], root / "ref_gpt")
    configs["unmasked"] = parity_config({}, base, [("train.document_mask", "false")], root / "unmasked")
    configs["mask_only"] = parity_config({}, base, [("train.document_positions", "false")], root / "mask_only")

    def world(size: int):
        def work(rank: int) -> None:
            for name, cfg in configs.items():
                if LAYOUTS.get(name, (1,))[0] == size:
                    train_and_record(cfg, single_process=size == 1)
        return work

    run_world(1, world(1))
    run_world(2, world(2))
    return root


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_masking_trains_like_one_process(runs, name):
    ref = runs / ("ref_gpt" if name.endswith("gpt") else "ref")
    dloss, dparam, steps = compare(ref, runs / name)
    dvalid = compare_valid(ref, runs / name)
    assert steps == STEPS and dloss <= LOSS_RTOL and dparam <= PARAM_ATOL and dvalid <= LOSS_RTOL, (dloss, dparam, dvalid)


def test_the_mask_changes_the_losses(runs):
    masked = json.loads((runs / "ref" / "losses.json").read_text())
    plain = json.loads((runs / "unmasked" / "losses.json").read_text())
    assert masked[0] != plain[0]  # from the first step: documents no longer see each other


def test_the_mask_applies_without_restarting_positions(runs):
    """train.document_positions=false keeps the mask (Megatron-LM's reset_attention_mask alone). RoPE's scores
    depend only on the distance between positions, so the llama's losses are the restarting-positions run's up
    to the rounding of other rotation angles (LOSS_RTOL; measured 1e-7), while the unmasked run's differ by up to
    7e-3 relative over these steps (measured): 1e-3 apart at least. (These keys once trained silently without the
    mask: it was built from the restarting positions.)"""
    losses = {name: json.loads((runs / name / "losses.json").read_text()) for name in ("ref", "unmasked", "mask_only")}
    assert losses["mask_only"] == pytest.approx(losses["ref"], rel=LOSS_RTOL)
    assert max(abs(a - b) / b for a, b in zip(losses["mask_only"], losses["unmasked"])) > 1e-3
