"""Every data-parallel layout trains like one process (DESIGN §3): losses and final weights.

Tolerance, fp32: relative |dloss| <= 1e-5 per step over 20 steps. Layouts sum the same per-token
losses and gradients in another order (sharded reduce-scatter, bucketed all-reduce, accumulation),
so they agree to fp32 rounding (~1e-7 relative), not bitwise; 1e-5 leaves ~100x margin and still
catches real bugs (a mis-scaled loss or a dropped shard changes the loss by >= 1e-3).
Final weights: max |dparam| <= 1e-4 (same reasoning, through 20 AdamW updates of size ~lr=3e-3).
Recomputation replays identical ops, so those layouts must match bitwise.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.config import build_config
from shardwise.parity import LOSS_RTOL, PARAM_ATOL
from tests.harness import run_world
from tests.parity.matrix import DP_FAMILY, REFERENCES, Layout

BITWISE = {"recompute_full_single", "recompute_op_single"}


def _config(base, extra, run_dir: Path):
    cfg = build_config(None, base + extra)
    cfg.run.dir = str(run_dir)
    cfg.run.save_final_model = True
    return cfg


def _train(cfg) -> list[float]:
    from shardwise.train.trainer import Trainer

    return Trainer(cfg, log=None).train()


@pytest.fixture(scope="module")
def runs(base_overrides, tmp_path_factory):
    """name -> (losses, run dir). Every world size is spawned once and runs all its layouts; the
    references run in a world of one, so the pytest process itself never trains (fork safety)."""
    root = tmp_path_factory.mktemp("parity")
    refs = [Layout(f"ref_{name}", 1, extra) for name, extra in REFERENCES.items()]
    out: dict[str, tuple[list[float], Path]] = {}
    for world in (1, 2, 4):
        layouts = [l for l in DP_FAMILY + refs if l.world_size == world]

        def work(rank: int, layouts=layouts) -> dict:
            return {l.name: _train(_config(base_overrides, l.override_list(), root / l.name)) for l in layouts}

        losses = run_world(world, work)[0]
        out.update({name: (ls, root / name) for name, ls in losses.items()})
    return out


def _compare(runs, name: str, ref_name: str) -> tuple[float, float]:
    losses, run_dir = runs[name]
    ref_losses, ref_dir = runs[ref_name]
    assert len(losses) == len(ref_losses) == 20
    dloss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    ref = torch.load(ref_dir / "final_model.pt", weights_only=True)
    assert got.keys() == ref.keys()
    dparam = max((got[k] - ref[k]).abs().max().item() for k in ref)
    return dloss, dparam


@pytest.mark.parametrize("layout", DP_FAMILY, ids=lambda l: l.name)
def test_layout_matches_single_process(runs, layout: Layout):
    dloss, dparam = _compare(runs, layout.name, f"ref_{layout.reference}")
    print(f"{layout.name}: max rel |dloss| {dloss:.2e}, max |dparam| {dparam:.2e}")
    if layout.name in BITWISE:
        assert dloss == 0.0 and dparam == 0.0, f"recompute changed numerics: {dloss:.2e} {dparam:.2e}"
    assert dloss <= LOSS_RTOL, f"{layout.name}: max relative |dloss| {dloss:.2e} > {LOSS_RTOL}"
    assert dparam <= PARAM_ATOL, f"{layout.name}: max |dparam| {dparam:.2e} > {PARAM_ATOL}"


def test_accumulation_on_one_rank_equals_four_way_dp(runs):
    """Accumulation x4 on 1 rank and 4-way DP see the same 4 micro-batches of 2 sequences."""
    a, _ = runs["accum4_single"]
    b, _ = runs["ddp4"]
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) <= LOSS_RTOL


def test_loss_falls(runs):
    losses, _ = runs["ref_llama"]
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_summary(runs, capsys):
    rows = {l.name: _compare(runs, l.name, f"ref_{l.reference}") for l in DP_FAMILY}
    with capsys.disabled():
        print("\nparity (fp32, 20 steps): layout, max rel |dloss|, max |dparam|")
        for name, (dl, dp) in rows.items():
            print(f"  {name:28s} {dl:.2e}  {dp:.2e}")
    Path(runs["ref_llama"][1].parent / "summary.json").write_text(json.dumps(rows))
