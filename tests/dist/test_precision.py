"""bf16 and fp16 (dynamic loss scaling) train under DDP, FSDP and TP; fp32 master weights throughout.

Tolerance: relative |dloss| vs the fp32 run <= 3e-3 over 10 steps, for every low-precision layout and
between bf16 layouts. bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative rounding per value), but the
loss averages 256 tokens and the weights stay fp32, so the observed gap is ~1e-4 (fp16, 11 bits:
~1e-5). 3e-3 leaves ~20x margin, while a real fault (a gradient left scaled, weights not cast back,
master weights in bf16) moves the loss by 1e-2 or more. fp16 matmuls are slow on CPU, hence the tiny
shapes and 10 steps.
"""
from __future__ import annotations

import math

import pytest

from shardwise.config import build_config
from tests.harness import run_world

STEPS = 10
CP_BF16_RTOL = 1e-3  # CP layouts against bf16_single, see test_bf16_context_parallel_tracks_bf16_single
CASES = {
    "fp32_single": (1, {}),
    "bf16_single": (1, {"train.precision": "bf16"}),
    "fp16_single": (1, {"train.precision": "fp16"}),
    "bf16_zero3_dp2": (2, {"train.precision": "bf16", "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    "bf16_ddp2": (2, {"train.precision": "bf16", "parallel.dp_replicate": 2, "train.micro_batch": 4}),
    "fp16_zero2_dp2": (2, {"train.precision": "fp16", "parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 4}),
    "fp16_zero1_dp2_recompute": (2, {"train.precision": "fp16", "parallel.dp_shard": 2, "parallel.zero": 1,
                                     "train.micro_batch": 2, "train.recompute": "full"}),
    # tensor parallel: autocast around DTensor ops, loss parallel in fp32 on the upcast logits
    "bf16_tp2": (2, {"train.precision": "bf16", "parallel.tp": 2}),
    "fp16_tp2_nosp_accum2": (2, {"train.precision": "fp16", "parallel.tp": 2, "parallel.sequence_parallel": False,
                                 "train.micro_batch": 4}),
    # 2-D: FSDP2's bf16 parameter cast on top of TP DTensors
    "bf16_zero3_dp2_tp2": (4, {"train.precision": "bf16", "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                               "train.micro_batch": 4}),
    # context parallel (parallel/context.py), against bf16_single: see test_bf16_context_parallel_tracks_bf16_single
    "bf16_cp2_ring": (2, {"train.precision": "bf16", "parallel.cp": 2}),
    "bf16_cp2_ulysses": (2, {"train.precision": "bf16", "parallel.cp": 2, "parallel.cp_mode": "ulysses"}),
    # FP8 (parallel/float8.py; torchao's emulation on CPU): against fp32 like the others, and see test_fp8_*
    "fp8_single": (1, {"train.precision": "fp8"}),
    "fp8_rowwise_single": (1, {"train.precision": "fp8", "train.fp8_recipe": "rowwise"}),
    "fp8_accum2_single": (1, {"train.precision": "fp8", "train.micro_batch": 4}),
    # FSDP2 all-gathers the FP8 weights (tensorwise); micro-batch 4 = fp8_accum2_single's micro-batches
    "fp8_zero3_dp2": (2, {"train.precision": "fp8", "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    "fp8_ddp2": (2, {"train.precision": "fp8", "parallel.dp_replicate": 2, "train.micro_batch": 4}),
    "fp8_pp2": (2, {"train.precision": "fp8", "parallel.pp": 2, "train.micro_batch": 4}),
    # TP splits the Float8Linears; tensorwise scales are the whole DTensor's amax (parallel/float8.py)
    "fp8_tp2": (2, {"train.precision": "fp8", "parallel.tp": 2}),
    "fp8_zero3_dp2_tp2": (4, {"train.precision": "fp8", "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                              "train.micro_batch": 4}),
    # train.fp8_head: the output head's GEMMs in FP8 too; under FSDP it is gathered unconverted (the root unit)
    "fp8_head_single": (1, {"train.precision": "fp8", "train.fp8_head": True}),
    "fp8_head_accum2_single": (1, {"train.precision": "fp8", "train.fp8_head": True, "train.micro_batch": 4}),
    "fp8_head_zero3_dp2": (2, {"train.precision": "fp8", "train.fp8_head": True, "parallel.dp_shard": 2, "parallel.zero": 3,
                               "train.micro_batch": 4}),
    "fp8_head_tp2": (2, {"train.precision": "fp8", "train.fp8_head": True, "parallel.tp": 2}),
}
# The one-process FP8 run each FP8 layout is held to: the same micro-batches (test_fp8_layouts_track_fp8_single).
FP8_REFERENCE = {"fp8_zero3_dp2": "fp8_accum2_single", "fp8_ddp2": "fp8_accum2_single", "fp8_pp2": "fp8_accum2_single",
                 "fp8_tp2": "fp8_single", "fp8_zero3_dp2_tp2": "fp8_accum2_single",
                 "fp8_head_zero3_dp2": "fp8_head_accum2_single", "fp8_head_tp2": "fp8_head_single"}


@pytest.fixture(scope="module")
def results(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for world in (1, 2, 4):
        def work(rank: int, world=world) -> dict:
            import torch

            from shardwise.train.trainer import Trainer

            res = {}
            for name, (ws, ov) in CASES.items():
                if ws != world:
                    continue
                cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in ov.items()] + [("train.steps", str(STEPS))])
                cfg.run.dir = str(root / name)
                trainer = Trainer(cfg, log=None)
                losses = trainer.train()
                dtypes = {p.dtype for p in trainer.model.parameters()}
                res[name] = {"losses": losses, "scale": trainer.scaler.scale, "skipped": trainer.scaler.skipped_steps,
                             "master_fp32": dtypes == {torch.float32}}
            return res

        out.update(run_world(world, work)[0])
    return out


@pytest.mark.parametrize("name", [n for n in CASES if n != "fp32_single"])
def test_low_precision_tracks_fp32(results, name):
    fp32 = results["fp32_single"]["losses"]
    got = results[name]
    assert all(math.isfinite(x) for x in got["losses"])
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], fp32))
    print(f"{name}: max relative |dloss| vs fp32 over {STEPS} steps {worst:.2e}, final loss scale {got['scale']:g}")
    assert worst < 3e-3, f"{name}: max relative |dloss| vs fp32 {worst:.2e}"
    assert got["losses"][-1] < got["losses"][0] - 0.3
    assert got["master_fp32"], "master weights must stay fp32"


def test_fp16_uses_a_finite_loss_scale(results):
    for name in ("fp16_single", "fp16_zero2_dp2", "fp16_zero1_dp2_recompute", "fp16_tp2_nosp_accum2"):
        assert results[name]["scale"] > 1 and results[name]["skipped"] <= 2


def test_bf16_layouts_agree(results):
    a, b = results["bf16_single"]["losses"], results["bf16_zero3_dp2"]["losses"]
    assert max(abs(x - y) / y for x, y in zip(a, b)) < 3e-3


@pytest.mark.parametrize("name", ["bf16_cp2_ring", "bf16_cp2_ulysses"])
def test_bf16_context_parallel_tracks_bf16_single(results, name):
    """cp2 ring / Ulysses in bf16 against the single-process bf16 run (docs/architecture.md §3: 16-bit tolerances are
    per feature). Same data, same fp32 master weights; what differs is only the attention's rounding:
    Ulysses runs the same causal SDPA on whole sequences of half the heads; ring attention computes
    each rank's (query half, KV half) blocks separately and merges them with the log-sum-exp rule.
    Under the trainer's autocast the ring Function's matmuls return bf16, so the block scores, LSE
    and partial outputs are bf16 and every merge rounds once more (up to 2cp - 1 = 3 merges for the
    last zigzag chunk at cp2, which sees all 2cp chunks). Observed over 10 steps: ring 4.7e-5, Ulysses 3.4e-5 (vs fp32: 6.6e-5, 7.6e-5, like the other
    bf16 layouts). Bound CP_BF16_RTOL = 1e-3: >= 20x those, and tighter than the 3e-3 above because a
    real ring fault is small at this size: dropping every off-diagonal block (measured by patching
    context._pairs) gives 7e-4 at step 1 and 5.5e-3 at worst, 5x over 1e-3 but under 2x over 3e-3."""
    ref, got = results["bf16_single"]["losses"], results[name]["losses"]
    assert all(math.isfinite(x) for x in got)
    worst = max(abs(a - b) / b for a, b in zip(got, ref))
    print(f"{name}: max relative |dloss| vs bf16_single over {STEPS} steps {worst:.2e}")
    assert worst < CP_BF16_RTOL, f"{name}: max relative |dloss| vs bf16_single {worst:.2e}"
    assert results[name]["master_fp32"], "master weights must stay fp32"


@pytest.mark.parametrize("name", sorted(FP8_REFERENCE))
def test_fp8_layouts_track_fp8_single(results, name):
    """FP8 under data, pipeline and tensor parallelism against one process with the same micro-batches
    (FP8_REFERENCE: *_accum2_single, 2 micro-batches of 4; *_single, one of 8, for tp2). Dynamic scaling takes each
    tensor's amax per micro-batch, so equal micro-batches get equal scales and equal FP8 roundings; what remains is the
    layouts' fp32 and bf16 summation order, as in test_bf16_layouts_agree, amplified where a different sum moves an
    amax and with it a whole tensor's rounding: bound 3e-3. With train.fp8_head the vocab-sharded head under TP
    scales by the whole DTensor's amax too, so tp2 rounds as one process does."""
    which = FP8_REFERENCE[name]
    ref, got = results[which]["losses"], results[name]["losses"]
    worst = max(abs(a - b) / b for a, b in zip(got, ref))
    print(f"{name}: max relative |dloss| vs {which} over {STEPS} steps {worst:.2e}")
    assert worst < 3e-3, f"{name}: max relative |dloss| vs {which} {worst:.2e}"
