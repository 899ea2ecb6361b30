"""The layout-parity matrix as data: name -> (world size, reference, config overrides).

Global batch is 8 sequences in every case; micro_batch decides accumulation
(global = micro x accumulation x dp). References: "llama" and "gpt" train on one process with
micro_batch 8 (no accumulation).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    name: str
    world_size: int
    overrides: dict[str, object] = field(default_factory=dict)
    reference: str = "llama"

    def override_list(self) -> list[tuple[str, str]]:
        return [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in self.overrides.items()]


REFERENCES = {"llama": {}, "gpt": {"model.preset": "tiny-gpt", "model.vocab_size": 512},
              # a vocabulary no TP size here divides (509 is prime): the Megatron padding case
              "llama_v509": {"model.vocab_size": 509},
              # 8 blocks: enough for pp4 x 2 virtual stages. lr 1e-3: at the suite's 3e-3 this deeper model
              # has a loss spike (grad norm 13 at step 7) that amplifies fp32 rounding ~100x, so TP alone
              # (tp2 x ZeRO-2, no PP) drifts to 6e-6 by step 8 and the 1e-5 bound would measure the
              # spike, not the layout; at 1e-3 TP and PP x TP stay at 2e-7 over 20 steps.
              "llama_l8": {"model.n_layers": 8, "train.lr": "1e-3"},
              # 4 blocks at the same lr: pp2 needs no more (1F1B and its kin: 2 blocks a stage; V and
              # interleaved schedules with 2 virtual stages: 4 stages of 1 block), and every step of a pipeline
              # layout costs per block and micro-batch (pp2 x tp2: 17.3 s at 8 blocks, 8.9 s at 4)
              "llama_l4": {"model.n_layers": 4, "train.lr": "1e-3"},
              # MoE: tiny-moe (8 experts, top-2, dropless, aux loss 0.01), micro-batch 2 = the layouts' own
              # micro-batch: the load-balancing loss is a product of per-micro-batch statistics, so
              # parity needs the same micro-batch boundaries (each rank's micro-batches are contiguous
              # slices of the global batch, so dp x micro 2 cuts exactly where 4 x micro 2 does).
              "moe": {"model.preset": "tiny-moe", "model.vocab_size": 512, "train.micro_batch": 2},
              # capacity factor 1: tokens are dropped (per micro-batch on one rank: the same set everywhere)
              "moe_cap": {"model.preset": "tiny-moe", "model.vocab_size": 512, "train.micro_batch": 2,
                          "model.moe.capacity_factor": 1.0},
              # 2 experts, top-1: with ep 2 one expert a rank, fewer than efsdp shards, which FSDP2 then cuts on
              # dim 1 (parallel/expert.py expert_placement), not into whole padded experts
              "moe_e2": {"model.preset": "tiny-moe", "model.vocab_size": 512, "train.micro_batch": 2,
                         "model.moe.num_experts": 2, "model.moe.top_k": 1}}

DP_FAMILY = [
    # world size 1: gradient accumulation alone
    Layout("accum4_single", 1, {"train.micro_batch": 2}),
    Layout("recompute_full_single", 1, {"train.recompute": "full"}),
    Layout("recompute_op_single", 1, {"train.recompute": "selective", "train.recompute_policy": "op"}),
    # every other matmul output kept (torchtitan's per-op policy): the rest rerun, bit for bit
    Layout("recompute_op_alternate_single", 1, {"train.recompute": "selective", "train.recompute_policy": "op_alternate"}),
    # world size 2
    Layout("ddp2", 2, {"parallel.dp_replicate": 2, "train.micro_batch": 4}),
    Layout("zero1_dp2", 2, {"parallel.dp_shard": 2, "parallel.zero": 1, "train.micro_batch": 4}),
    Layout("zero2_dp2", 2, {"parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 4}),
    Layout("zero3_dp2", 2, {"parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    Layout("zero3_dp2_offload", 2, {"parallel.dp_shard": 2, "parallel.zero": 3, "parallel.offload": True, "train.micro_batch": 4}),
    Layout("zero2_dp2_accum2", 2, {"parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 2}),
    Layout("zero3_dp2_recompute_layer", 2, {"parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4,
                                            "train.recompute": "selective", "train.recompute_policy": "layer"}),
    Layout("gpt_zero3_dp2", 2, {"model.preset": "tiny-gpt", "model.vocab_size": 512, "parallel.dp_shard": 2,
                                "parallel.zero": 3, "train.micro_batch": 4}, reference="gpt"),
    Layout("gpt_ddp2_accum2", 2, {"model.preset": "tiny-gpt", "model.vocab_size": 512, "parallel.dp_replicate": 2,
                                  "train.micro_batch": 2}, reference="gpt"),
    # world size 4
    Layout("ddp4", 4, {"parallel.dp_replicate": 4, "train.micro_batch": 2}),
    Layout("ddp4_accum2", 4, {"parallel.dp_replicate": 4, "train.micro_batch": 1}),
    Layout("zero1_dp4", 4, {"parallel.dp_shard": 4, "parallel.zero": 1, "train.micro_batch": 2}),
    Layout("zero2_dp4", 4, {"parallel.dp_shard": 4, "parallel.zero": 2, "train.micro_batch": 2}),
    Layout("zero3_dp4", 4, {"parallel.dp_shard": 4, "parallel.zero": 3, "train.micro_batch": 2}),
    Layout("zero3_dp4_accum2", 4, {"parallel.dp_shard": -1, "parallel.zero": 3, "train.micro_batch": 1}),
    Layout("hsdp_2x2_zero3", 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 2}),
    Layout("hsdp_2x2_zero2", 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 2}),
    Layout("zero1_2x2", 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 1, "train.micro_batch": 2}),
]

# Memory-centric tiling (parallel/tiling.py): the MLPs in tiles along the ffn dim change only the order of
# a sum, so they train like the reference to fp32 rounding; alone, under ZeRO-3 (the tiled Function
# gets FSDP2's unsharded weights) and with CPU offload on one process (FSDP2 over a 1-rank mesh).
TILES_FAMILY = [
    Layout("linear_tiles4_single", 1, {"parallel.linear_tiles": 4}),
    Layout("zero3_dp2_tiles2", 2, {"parallel.dp_shard": 2, "parallel.zero": 3, "parallel.linear_tiles": 2,
                                   "train.micro_batch": 4}),
    Layout("offload_zero3_single_tiles2", 1, {"parallel.offload": "cpu", "parallel.zero": 3, "parallel.linear_tiles": 2}),
]

_GPT = {"model.preset": "tiny-gpt", "model.vocab_size": 512}
# The tiny preset has 4 query heads and 2 KV heads: tp=2 splits both, tp=4 replicates each KV head
# on 2 ranks. Sequence parallelism is on unless a layout says otherwise.
TP_FAMILY = [
    # world size 2
    Layout("tp2", 2, {"parallel.tp": 2}),
    Layout("tp2_nosp", 2, {"parallel.tp": 2, "parallel.sequence_parallel": False}),
    Layout("tp2_vocab509", 2, {"parallel.tp": 2, "model.vocab_size": 509}, reference="llama_v509"),
    Layout("tp2_nosp_vocab509", 2, {"parallel.tp": 2, "parallel.sequence_parallel": False, "model.vocab_size": 509},
           reference="llama_v509"),
    Layout("tp2_recompute_full", 2, {"parallel.tp": 2, "train.recompute": "full"}),
    Layout("tp2_nosp_recompute_op", 2, {"parallel.tp": 2, "parallel.sequence_parallel": False,
                                        "train.recompute": "selective", "train.recompute_policy": "op"}),
    Layout("tp2_recompute_op_alternate", 2, {"parallel.tp": 2, "train.recompute": "selective",
                                             "train.recompute_policy": "op_alternate"}),
    Layout("tp2_accum2", 2, {"parallel.tp": 2, "train.micro_batch": 4}),
    Layout("gpt_tp2", 2, {**_GPT, "parallel.tp": 2}, reference="gpt"),
    Layout("gpt_tp2_nosp", 2, {**_GPT, "parallel.tp": 2, "parallel.sequence_parallel": False}, reference="gpt"),
    # world size 4
    Layout("tp4", 4, {"parallel.tp": 4}),
    Layout("tp4_nosp", 4, {"parallel.tp": 4, "parallel.sequence_parallel": False}),
    Layout("tp4_vocab509", 4, {"parallel.tp": 4, "model.vocab_size": 509}, reference="llama_v509"),
    Layout("gpt_tp4", 4, {**_GPT, "parallel.tp": 4}, reference="gpt"),
    Layout("tp2_ddp2", 4, {"parallel.tp": 2, "parallel.dp_replicate": 2, "train.micro_batch": 4}),
    Layout("tp2_ddp2_accum2", 4, {"parallel.tp": 2, "parallel.dp_replicate": 2, "train.micro_batch": 2}),
    Layout("tp2_sp_zero3_dp2", 4, {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    Layout("tp2_nosp_zero2_dp2_accum2", 4, {"parallel.tp": 2, "parallel.sequence_parallel": False, "parallel.dp_shard": 2,
                                            "parallel.zero": 2, "train.micro_batch": 2}),
    Layout("tp2_zero3_dp2_recompute_op", 4, {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                                             "train.micro_batch": 4, "train.recompute": "selective"}),
    Layout("gpt_tp2_zero3_dp2", 4, {**_GPT, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                                    "train.micro_batch": 4}, reference="gpt"),
]


def _pp(name: str, world: int, micro: int, schedule: str, v: int = 1, layers: int = 4, **more) -> Layout:
    overrides = {"model.n_layers": layers, "train.lr": "1e-3", "parallel.pp_schedule": schedule,
                 "parallel.pp_virtual_stages": v, "train.micro_batch": micro, **more}
    return Layout(name, world, overrides, reference=f"llama_l{layers}")


# Every schedule at pp2 (4 blocks) and pp4 (8 blocks: 4 stages x 2 virtual); micro-batch 2 -> 4 micro-batches
# at pp2, 1 -> 8 at pp4; uneven explicit and cost-balanced splits (8 blocks), and PP composed with TP / ZeRO /
# DDP up to 3-D on 8 ranks. (Every PP layout had 8 blocks until 2026-11-29.)
PP_FAMILY = [
    # world size 2
    _pp("pp2_gpipe", 2, 2, "gpipe", **{"parallel.pp": 2}),
    _pp("pp2_1f1b", 2, 2, "1f1b", **{"parallel.pp": 2}),
    _pp("pp2_interleaved_v2", 2, 2, "interleaved_1f1b", 2, **{"parallel.pp": 2}),
    _pp("pp2_zero_bubble", 2, 2, "zero_bubble", **{"parallel.pp": 2}),
    _pp("pp2_zero_bubble_v2", 2, 2, "zero_bubble", 2, **{"parallel.pp": 2}),
    _pp("pp2_zbv", 2, 2, "zbv", 2, **{"parallel.pp": 2}),
    _pp("pp2_dualpipev", 2, 2, "dualpipev", 2, **{"parallel.pp": 2}),
    _pp("pp2_explicit_1_7", 2, 2, "1f1b", layers=8, **{"parallel.pp": 2, "parallel.pp_layers_per_stage": [1, 7]}),
    _pp("pp2_balanced_speeds_1_3", 2, 2, "1f1b", layers=8, **{"parallel.pp": 2, "parallel.pp_split": "balanced",
                                                   "parallel.pp_stage_speeds": [1.0, 3.0]}),
    # A V schedule's own split (plan search offers balanced V variants): rank 0 holds stages 0 and 3
    _pp("pp2_dualpipev_split_1_3_3_1", 2, 2, "dualpipev", 2, layers=8, **{"parallel.pp": 2, "parallel.pp_layers_per_stage": [1, 3, 3, 1]}),
    # world size 4
    _pp("pp4_gpipe", 4, 1, "gpipe", layers=8, **{"parallel.pp": 4}),
    _pp("pp4_1f1b", 4, 1, "1f1b", layers=8, **{"parallel.pp": 4}),
    _pp("pp4_interleaved_v2", 4, 1, "interleaved_1f1b", 2, layers=8, **{"parallel.pp": 4}),
    _pp("pp4_zero_bubble_v2", 4, 1, "zero_bubble", 2, layers=8, **{"parallel.pp": 4}),
    _pp("pp4_zbv", 4, 1, "zbv", 2, layers=8, **{"parallel.pp": 4}),
    _pp("pp4_dualpipev", 4, 1, "dualpipev", 2, layers=8, **{"parallel.pp": 4}),
    _pp("pp4_balanced_v2", 4, 1, "interleaved_1f1b", 2, layers=8, **{"parallel.pp": 4, "parallel.pp_split": "balanced"}),
    _pp("pp2_tp2", 4, 2, "1f1b", **{"parallel.pp": 2, "parallel.tp": 2}),
    _pp("pp2_tp2_nosp_interleaved", 4, 2, "interleaved_1f1b", 2,
        **{"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": False}),
    _pp("pp2_ddp2", 4, 1, "1f1b", **{"parallel.pp": 2, "parallel.dp_replicate": 2}),
    _pp("pp2_zero1_dp2", 4, 1, "1f1b", **{"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 1}),
    _pp("pp2_zero3_dp2_interleaved", 4, 1, "interleaved_1f1b", 2,
        **{"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 3}),
    _pp("pp2_zero2_dp2_zbv", 4, 1, "zbv", 2, **{"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 2}),
    # world size 8: 3-D
    _pp("pp2_tp2_zero1_dp2", 8, 1, "1f1b", **{"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 2,
                                              "parallel.zero": 1}),
    _pp("pp2_tp2_zero3_dp2_interleaved", 8, 1, "interleaved_1f1b", 2,
        **{"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3}),
]

# Context parallel: ring and Ulysses at cp2 / cp4 (seq 32: 2·cp4 = 8 chunks of 4 tokens; the tiny
# preset's 2 KV heads are repeated to 4 for Ulysses at cp4) and composed with every other axis.
_CP2 = {"parallel.cp": 2}
_ULYSSES = {"parallel.cp_mode": "ulysses"}
CP_FAMILY = [
    # world size 2
    Layout("cp2_ring", 2, _CP2),
    Layout("cp2_ulysses", 2, {**_CP2, **_ULYSSES}),
    Layout("gpt_cp2_ring", 2, {**_GPT, **_CP2}, reference="gpt"),
    Layout("cp2_ring_recompute_full", 2, {**_CP2, "train.recompute": "full"}),
    Layout("cp2_ring_recompute_op", 2, {**_CP2, "train.recompute": "selective", "train.recompute_policy": "op"}),
    # world size 4
    Layout("cp4_ring", 4, {"parallel.cp": 4}),
    Layout("cp4_ulysses", 4, {"parallel.cp": 4, **_ULYSSES}),
    Layout("cp2_zero3_dp2", 4, {**_CP2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    Layout("cp2_ddp2", 4, {**_CP2, "parallel.dp_replicate": 2, "train.micro_batch": 4}),
    Layout("cp2_zero1_dp2", 4, {**_CP2, "parallel.dp_shard": 2, "parallel.zero": 1, "train.micro_batch": 4}),
    Layout("cp2_tp2", 4, {**_CP2, "parallel.tp": 2}),
    Layout("cp2_ulysses_tp2", 4, {**_CP2, **_ULYSSES, "parallel.tp": 2}),
    _pp("cp2_pp2", 4, 2, "1f1b", **{"parallel.pp": 2, **_CP2}),
    # world size 8
    Layout("cp2_tp2_zero3_dp2", 8, {**_CP2, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                                    "train.micro_batch": 4}),
    Layout("cp2_hsdp_2x2_zero3", 8, {**_CP2, "parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                                     "train.micro_batch": 2}),
]

_MOE = REFERENCES["moe"]
# Expert parallelism: experts split over ep, tokens exchanged by all-to-all, FSDP for the dense part
# (and over efsdp = dp_shard / ep for the experts when > 1). "Identical routing": every layout routes the
# same tokens to the same experts, so the losses agree to fp32 rounding like the dense families.
# Caveat, measured: top-k is discontinuous, so a token whose k-th and (k+1)-th router probabilities are
# within fp32 rounding (~1e-7) of each other can switch experts in one layout and not another. Over 20 steps
# of this matrix no token does (per-step expert loads are identical; the matrix now runs 10); on the default `shardwise parity` config
# (seq 128, batch 16) ep2 x efsdp2 hit one such near-tie at step 18: the loss still agreed to 3.6e-7 but
# the weights of the experts involved moved by 2.5e-4. Not an EP effect: with train.seed=1 plain ZeRO-3
# over 4 ranks without EP (and ep2 x dp_shard2) hit one too (loss 1.5e-6, weights 7e-4), ep4 did not.
MOE_FAMILY = [
    # world size 2
    Layout("moe_ep1_zero3_dp2", 2, {**_MOE, "parallel.dp_shard": 2, "parallel.zero": 3}, reference="moe"),
    Layout("moe_ep2_zero3", 2, {**_MOE, "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero": 3}, reference="moe"),
    Layout("moe_ep2_zero2", 2, {**_MOE, "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero": 2}, reference="moe"),
    Layout("moe_ep2_zero3_capacity1", 2, {**REFERENCES["moe_cap"], "parallel.dp_shard": 2, "parallel.ep": 2,
                                          "parallel.zero": 3}, reference="moe_cap"),
    # world size 4
    Layout("moe_ep4_zero3_dp4", 4, {**_MOE, "parallel.dp_shard": 4, "parallel.ep": 4, "parallel.zero": 3}, reference="moe"),
    Layout("moe_ep2_efsdp2_zero3", 4, {**_MOE, "parallel.dp_shard": 4, "parallel.ep": 2, "parallel.zero": 3},
           reference="moe"),
    Layout("moe_e2_ep2_efsdp2_zero3_dim1", 4, {**REFERENCES["moe_e2"], "parallel.dp_shard": 4, "parallel.ep": 2,
                                                "parallel.zero": 3}, reference="moe_e2"),
    Layout("moe_ep2_pp2_zero3", 4, {**_MOE, "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.ep": 2,
                                    "parallel.zero": 3}, reference="moe"),
    # CP x EP: ep folded into the cp ranks (dp_shard 1), and into dp_shard x cp; the router statistics
    # of a micro-batch are summed over its cp ranks (without that sum: rel |dloss| 3.5e-4, |dparam| 1.4e-2)
    Layout("moe_cp2_ep2_zero3", 2, {**_MOE, "parallel.cp": 2, "parallel.ep": 2, "parallel.zero": 3}, reference="moe"),
    Layout("moe_cp2_ulysses_dp2_ep4_zero3", 4, {**_MOE, "parallel.cp": 2, "parallel.cp_mode": "ulysses",
                                                "parallel.dp_shard": 2, "parallel.ep": 4, "parallel.zero": 3},
           reference="moe"),
    # MoE x TP (Megatron expert-TP, parallel/tensor.py MoERegion): every tp rank routes the same tokens,
    # experts (and shared experts) split on the ffn dim, one reduction per MoE block like a dense MLP
    Layout("moe_tp2", 2, {**_MOE, "parallel.tp": 2}, reference="moe"),
    Layout("moe_tp2_nosp", 2, {**_MOE, "parallel.tp": 2, "parallel.sequence_parallel": False}, reference="moe"),
    Layout("moe_tp2_zero3_dp2", 4, {**_MOE, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3},
           reference="moe"),
    Layout("moe_ep2_tp2_zero3", 4, {**_MOE, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.ep": 2,
                                    "parallel.zero": 3}, reference="moe"),
    Layout("moe_tp2_recompute_full", 2, {**_MOE, "parallel.tp": 2, "train.recompute": "full"}, reference="moe"),
    Layout("moe_tp2_nosp_recompute_op", 2, {**_MOE, "parallel.tp": 2, "parallel.sequence_parallel": False,
                                            "train.recompute": "selective", "train.recompute_policy": "op"},
           reference="moe"),
    Layout("moe_pp2_tp2", 4, {**_MOE, "parallel.pp": 2, "parallel.tp": 2}, reference="moe"),
    Layout("moe_cp2_tp2_ep2_zero3", 4, {**_MOE, "parallel.cp": 2, "parallel.tp": 2, "parallel.ep": 2, "parallel.zero": 3},
           reference="moe"),
    Layout("moe_tp2_ddp2", 4, {**_MOE, "parallel.tp": 2, "parallel.dp_replicate": 2}, reference="moe"),
    # world size 8, 5-D: pp2 x dp_shard2 x cp2 with ep folded into dp_shard x cp (2 and 4)
    Layout("moe_5d_pp2_dp2_cp2_ep2_zero3", 8, {**_MOE, "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.cp": 2,
                                               "parallel.ep": 2, "parallel.zero": 3}, reference="moe"),
    # EP x TP with the experts also FSDP-sharded over efsdp (FSDP2's "EP+TP" 2-D DTensor parameters)
    Layout("moe_ep2_efsdp2_tp2_zero3", 8, {**_MOE, "parallel.dp_shard": 4, "parallel.ep": 2, "parallel.tp": 2,
                                           "parallel.zero": 3}, reference="moe"),
    Layout("moe_5d_pp2_dp2_cp2_ulysses_ep4_zero2", 8, {**_MOE, "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.cp": 2,
                                                       "parallel.cp_mode": "ulysses", "parallel.ep": 4,
                                                       "parallel.zero": 2}, reference="moe"),
]

# train.compile: every block compiled (parallel/compile.py), layouts of every family. aot_eager traces and
# partitions like inductor (dynamo, AOTAutograd, the checkpoint and DTensor ops) without generating
# code, so 9 layouts compile in seconds on 2 cores; one single-process case runs inductor itself.
# log_every 2: metrics.jsonl's compiled_graphs at steps 2 and 4 must be equal (no recompilation).
_COMPILE = {"train.compile": True, "train.compile_backend": "aot_eager", "train.log_every": 2}
COMPILE_FAMILY = [
    Layout("compile_single", 1, _COMPILE),
    Layout("compile_inductor_single", 1, {**_COMPILE, "train.compile_backend": "inductor"}),
    Layout("compile_recompute_full_single", 1, {**_COMPILE, "train.recompute": "full"}),
    Layout("compile_recompute_op_single", 1, {**_COMPILE, "train.recompute": "selective", "train.recompute_policy": "op"}),
    Layout("compile_tp2", 2, {**_COMPILE, "parallel.tp": 2}),
    Layout("compile_tp2_nosp_vocab509", 2, {**_COMPILE, "parallel.tp": 2, "parallel.sequence_parallel": False,
                                            "model.vocab_size": 509}, reference="llama_v509"),
    Layout("compile_tp2_zero3_dp2", 4, {**_COMPILE, "parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3,
                                        "train.micro_batch": 4}),
    Layout("compile_moe_ep2_zero3", 2, {**_COMPILE, **_MOE, "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero": 3},
           reference="moe"),
    _pp("compile_pp2_zero_bubble", 2, 2, "zero_bubble", **{**_COMPILE, "parallel.pp": 2}),
    _pp("compile_pp2_zbv", 2, 2, "zbv", 2, **{**_COMPILE, "parallel.pp": 2}),
    Layout("compile_cp2_ulysses", 2, {**_COMPILE, **_CP2, **_ULYSSES}),
    Layout("compile_gpt_zero3_dp2", 2, {**_COMPILE, **_GPT, "parallel.dp_shard": 2, "parallel.zero": 3,
                                        "train.micro_batch": 4}, reference="gpt"),
    Layout("compile_ddp2", 2, {**_COMPILE, "parallel.dp_replicate": 2, "train.micro_batch": 4}),
    Layout("compile_zero3_dp2", 2, {**_COMPILE, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}),
    _pp("compile_pp2_1f1b", 2, 2, "1f1b", **{**_COMPILE, "parallel.pp": 2}),
    Layout("compile_cp2_ring", 2, {**_COMPILE, **_CP2}),
]

# 2-D tensor parallelism (parallel/tensor2d.py): SUMMA on a 2 x 2 grid (4 sequences per grid row), with
# accumulation (1 sequence per row), a vocabulary q does not divide, full recompute, and x DDP-style
# data parallelism (FSDP2 replicate over dp_replicate): 8 processes.
_TP2D = {"parallel.tp": 4, "parallel.tp_mode": "2d"}
TP2D_FAMILY = [
    Layout("tp4_2d", 4, _TP2D),
    Layout("tp4_2d_accum4", 4, {**_TP2D, "train.micro_batch": 2}),
    Layout("tp4_2d_vocab509", 4, {**_TP2D, "model.vocab_size": 509}, reference="llama_v509"),
    Layout("tp4_2d_recompute_full", 4, {**_TP2D, "train.recompute": "full"}),
    Layout("tp4_2d_ddp2", 8, {**_TP2D, "parallel.dp_replicate": 2, "train.micro_batch": 4}),
]

# Joined projections (train.fuse_projections, models/feed_forward.py fused_linear): q|k|v and w1|w3 as one GEMM
# each from the same parameters; the input's gradient sums the joined rows in one GEMM instead of adding
# separate ones: fp32 rounding, like the other layouts. One process, under ZeRO-3 (FSDP2's unsharded
# weights joined), and GPT's biased projections compiled.
FUSED_FAMILY = [
    Layout("fused_single", 1, {"train.fuse_projections": True}),
    Layout("fused_zero3_dp2", 2, {"train.fuse_projections": True, "parallel.dp_shard": 2, "parallel.zero": 3,
                                  "train.micro_batch": 4}),
    Layout("fused_gpt_compile_single", 1, {**_COMPILE, **_GPT, "train.fuse_projections": True}, reference="gpt"),
]

MATRIX = (DP_FAMILY + TILES_FAMILY + TP_FAMILY + PP_FAMILY + CP_FAMILY + MOE_FAMILY + COMPILE_FAMILY + TP2D_FAMILY
          + FUSED_FAMILY)
