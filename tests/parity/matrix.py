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


REFERENCES = {"llama": {}, "gpt": {"model.preset": "tiny-gpt", "model.vocab_size": 512}}

DP_FAMILY = [
    # world size 1: gradient accumulation alone
    Layout("accum4_single", 1, {"train.micro_batch": 2}),
    Layout("recompute_full_single", 1, {"train.recompute": "full"}),
    Layout("recompute_op_single", 1, {"train.recompute": "selective", "train.recompute_policy": "op"}),
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
