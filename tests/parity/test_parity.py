"""Every layout of the matrix (data parallel, tensor parallel, pipeline, up to 3-D) trains like one process
(docs/architecture.md §3): losses and final weights.

Tolerance, fp32: relative |dloss| <= 1e-5 per step over STEPS = 4 steps (2 of warm-up, 2 at the full lr). Layouts sum the same per-token
losses and gradients in another order (sharded reduce-scatter, bucketed all-reduce, accumulation),
and TP splits GEMM reductions and the softmax over ranks (PP only runs the micro-batches of an
accumulation through stages, in the same order), so they agree to fp32 rounding (~1e-7
relative), not bitwise; 1e-5 leaves ~100x margin and still
catches real bugs (a mis-scaled loss or a dropped shard changes the loss by >= 1e-3).
Final weights: max |dparam| <= 1e-4 (same reasoning, through 4 AdamW updates of size ~lr=3e-3).
Recomputation replays identical ops, so those layouts must match bitwise.

Why 4 steps: a layout bug shows from the first step or the first update (the scale, a missing shard, ZeRO's
sharded optimizer step), and rounding differences only grow with steps, so fewer steps lose no margin; the
last two, at the full lr, still exercise the optimizer past warm-up with moments of earlier updates. The longest
runs stay with `shardwise parity` (20 steps by default) and the 60-step elastic comparison. Measured on 2 ranks
(2 cores, quiet): a step is ~75% of a layout's time (tp2: 1.25 s of 1.7 s at 6 steps; set-up 0.2 s, its
validation round 0.19 s), so each step less is ~12% of the matrix, the suite's longest fixture (971 s of a
58-minute full run at 6 steps).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.parity import LOSS_RTOL, PARAM_ATOL, compare, compare_valid, parity_config, train_and_record, valid_losses
from tests.harness import run_world
from tests.parity.matrix import COMPILE_FAMILY, MATRIX, REFERENCES, Layout

BITWISE = {"recompute_full_single", "recompute_op_single", "recompute_op_alternate_single"}
STEPS = 4
WARMUP = 2


@pytest.fixture(scope="module")
def runs(base_overrides, valid_overrides, tmp_path_factory) -> dict[str, Path]:
    """name -> run dir holding losses.json and final_model.pt, written by the same code as
    `shardwise parity`. Every world size is spawned once and runs all its layouts; the references
    run in a world of one, so the pytest process itself never trains (fork safety). Every case also
    evaluates a validation set after its last step (the same 2 global batches everywhere)."""
    root = tmp_path_factory.mktemp("parity")
    refs = [Layout(f"ref_{name}", 1, extra) for name, extra in REFERENCES.items()]
    for world in (1, 2, 4, 8):
        layouts = [lay for lay in MATRIX + refs if lay.world_size == world]

        def work(rank: int, layouts=layouts) -> None:
            for lay in layouts:
                train_and_record(parity_config({}, [*base_overrides, *valid_overrides, ("train.steps", str(STEPS)),
                                                                   ("train.warmup_steps", str(WARMUP))], lay.override_list(),
                                               root / lay.name), single_process=False)

        # A hang guard, not a time limit: 60 s a layout (4 ranks on 2 cores: ~12 s each in a full test run).
        run_world(world, work, timeout_s=max(600, 60 * len(layouts)))
    return {lay.name: root / lay.name for lay in MATRIX + refs}


@pytest.mark.parametrize("layout", MATRIX, ids=lambda lay: lay.name)
def test_layout_matches_single_process(runs, layout: Layout):
    dloss, dparam, steps = compare(runs[f"ref_{layout.reference}"], runs[layout.name])
    print(f"{layout.name}: max rel |dloss| {dloss:.2e}, max |dparam| {dparam:.2e}")
    assert steps == STEPS
    if layout.name in BITWISE:
        assert dloss == 0.0 and dparam == 0.0, f"recompute changed numerics: {dloss:.2e} {dparam:.2e}"
    assert dloss <= LOSS_RTOL, f"{layout.name}: max relative |dloss| {dloss:.2e} > {LOSS_RTOL}"
    assert dparam <= PARAM_ATOL, f"{layout.name}: max |dparam| {dparam:.2e} > {PARAM_ATOL}"
    # Validation, forward only on the same windows: the training loss's bound and reasons (parity.compare_valid).
    dvalid = compare_valid(runs[f"ref_{layout.reference}"], runs[layout.name])
    assert dvalid is not None and dvalid <= LOSS_RTOL, f"{layout.name}: validation loss differs by {dvalid}"
    if layout.name in BITWISE:
        assert dvalid == 0.0


def test_accumulation_on_one_rank_equals_four_way_dp(runs):
    """Accumulation x4 on 1 rank and 4-way DP see the same 4 micro-batches of 2 sequences."""
    dloss, dparam, _ = compare(runs["ddp4"], runs["accum4_single"])
    assert dloss <= LOSS_RTOL and dparam <= PARAM_ATOL


def test_loss_falls(runs):
    losses = json.loads((runs["ref_llama"] / "losses.json").read_text())
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    # Text the model never saw (other modules), evaluated after the last update: it learned what carries over
    # (the first step's loss is a uniform guess, ~ln 512 = 6.24). Not "above the last training loss": after 4
    # steps the model is still far from fitting its own batches (measured: 6.23 -> 5.29 in 4 steps, valid 5.07).
    valid = valid_losses(runs["ref_llama"])["heldout"]
    assert valid < losses[0] - 0.5, f"validation loss {valid:.3f}, first training loss {losses[0]:.3f}"


def test_summary(runs):
    rows = {lay.name: compare(runs[f"ref_{lay.reference}"], runs[lay.name])[:2] for lay in MATRIX}
    print(f"\nparity (fp32, {STEPS} steps): layout, max rel |dloss|, max |dparam|")  # shown with -s
    for name, (dl, dp) in rows.items():
        print(f"  {name:28s} {dl:.2e}  {dp:.2e}")


def test_capacity_dropping_is_counted_and_logged(runs):
    """With capacity_factor 1 the router overflows some experts: metrics.jsonl reports the dropped
    fraction (the same on one process and under EP, since dropping is decided per micro-batch), the
    per-expert load and the aux loss; dropless runs report 0 dropped."""
    def last(name: str) -> dict:
        rows = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "loss" in r][-1]  # the last step's (a validation round's record follows it)

    capped, ref_capped, dropless = last("moe_ep2_zero3_capacity1"), last("ref_moe_cap"), last("moe_ep2_zero3")
    assert 0 < capped["moe_dropped_frac"] < 0.5
    assert abs(capped["moe_dropped_frac"] - ref_capped["moe_dropped_frac"]) < 1e-12
    assert dropless["moe_dropped_frac"] == 0
    for record in (capped, dropless):
        assert len(record["moe_expert_load"]) == 8 and abs(sum(record["moe_expert_load"]) - 1) < 1e-9
        assert record["moe_load_max"] >= 1 >= record["moe_load_min"] >= 0
        assert 0 < record["moe_aux_loss"] < 1  # 2 blocks x alpha 0.01 x ~1 (balanced = alpha per block)


@pytest.mark.parametrize("layout", COMPILE_FAMILY, ids=lambda lay: lay.name)
def test_compiled_blocks_do_not_recompile(runs, layout: Layout):
    """train.compile: dynamo compiled graphs (compiled_graphs > 0; the counting first step runs eagerly,
    train_step) and compiled none after the first steps: the count logged at steps 2 and 4 is the same.
    Parity itself is test_layout_matches_single_process (same 1e-5 bound: compiled kernels and
    AOTAutograd's decompositions reorder fp32 sums like any other layout)."""
    records = [json.loads(line) for line in (runs[layout.name] / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]  # the steps' records, not the validation round's
    graphs = [r["compiled_graphs"] for r in records]
    assert [r["step"] for r in records] == [2, 4]
    assert graphs[0] > 0 and len(set(graphs)) == 1, f"{layout.name}: compiled graphs per logged step {graphs}"
