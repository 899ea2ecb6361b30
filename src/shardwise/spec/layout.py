"""One candidate layout, as the planner searches it and the trainer runs it: the sizes of the mesh axes
plus every parallel.* / train.* choice that changes memory, time or the rules (spec/rules.py).

`Layout.from_config` reads the same keys as training; the facts it derives (data-parallel wrapper,
shard group, 16-bit parameter copies) come from spec/dims.py, the functions ParallelDims uses.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardwise.spec.dims import data_parallel_wrapper, lowp_params, offload_tier, resolve_dp_shard
from shardwise.spec.stages import trainer_split

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe: torchao Float8LinearConfig recipe names


def fp8_gemm_fits(in_features: int, out_features: int) -> bool:
    """Whether a linear of these dims can run FP8 (parallel/float8.py): torch._scaled_mm needs both
    multiples of 16. The trainer's conversion and the planner's pricing ask the same question."""
    return in_features % 16 == 0 and out_features % 16 == 0


def compute_precision(precision: str, tf32: bool = False) -> str:
    """The dtype a run computes in outside FP8's GEMMs, and the peak its MFU is measured against:
    "fp8" computes in bf16, and counting it against the bf16 peak keeps its MFU comparable to bf16's;
    "fp32" with `tf32` (train.tf32 on a GPU) multiplies on TF32 tensor cores."""
    if precision == "fp32" and tf32:
        return "tf32"
    return "bf16" if precision == "fp8" else precision


def default_precision(device_type: str, has_bf16: bool) -> str:
    """train.precision unset: "bf16" on a GPU that computes it natively (what a GPU user expects: half
    the activation and weight-gather bytes, the tensor cores' bf16 peak), "fp32" on a CPU (whose bf16
    matmuls are emulated or slow, and where the tests' references are fp32) and on older GPUs."""
    return "bf16" if device_type != "cpu" and has_bf16 else "fp32"


def attention_backend(device: str, precision: str, gqa: bool) -> str:
    """Which kernel torch's scaled_dot_product_attention runs for our causal call (models/common.py
    causal_attention) — "flash", "efficient" or "math" — a fact the planner needs for memory and time.

    CPU: torch's CPU flash kernel takes fp32 and bf16 alike (what tests/dist/test_plan_validation.py
    measures). CUDA: FlashAttention needs 16-bit inputs; in fp32 the memory-efficient kernel would run,
    but it does not take enable_gqa (torch 2.11's sdp_utils: only the flash, cuDNN and math backends
    accept grouped KV heads), so a grouped-query model in fp32 falls back to the math backend, which
    materialises the s x s probabilities (the 17 GiB of the fp32 row in shared/gpu/h100-runs.json)."""
    if device == "cpu" or precision != "fp32":
        return "flash"
    return "math" if gqa else "efficient"


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_POLICIES = ("op", "op_alternate", "layer")
PER_OP_POLICIES = ("op", "op_alternate")  # selective checkpointing of each block by op (parallel/activation_checkpoint.py)
PP_SPLITS = ("even", "balanced")
CP_MODES = ("ring", "ulysses")
COMPILE_BACKENDS = ("inductor", "aot_eager")  # train.compile_backend (parallel/compile.py)
PROCESS_GROUP_BACKENDS = ("auto", "nccl", "gloo")  # run.backend (train/distributed.py process_group_backend)


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"
    recompute_policy: str = "op"
    recompute_every: int = 2
    offload: bool = False  # model states in host memory (parallel.offload "cpu" or "nvme")
    sequence_parallel: bool = True
    cp_mode: str = "ring"  # "ring" (pass-KV ring attention) or "ulysses" (all-to-all heads)
    nvme: bool = False  # with offload: the optimizer state in files on a local disk (parallel.offload = "nvme")
    linear_tiles: int = 1  # parallel.linear_tiles: the MLP computed in this many tiles (parallel/tiling.py)
    grad_compression: str = "none"  # parallel.grad_compression: none | bf16 | int8 | topk | powersgd
    grad_compression_ratio: float = 0.01  # parallel.grad_compression_ratio (topk's kept fraction)
    powersgd_rank: int = 4  # parallel.powersgd_rank
    tp_mode: str = "1d"  # parallel.tp_mode: "1d" (Megatron) or "2d" (SUMMA on a q x q grid)
    # blocks per stage where the trainer does not cut evenly (spec/stages.py trainer_split); () = even
    stage_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, cfg: Any, num_gpus: int) -> "Layout":
        """The layout a config asks for on `num_gpus` (dp_shard = -1 takes the rest, as ParallelDims)."""
        p, t = cfg.parallel, cfg.train
        dp_shard = resolve_dp_shard(p, num_gpus, "num_gpus")
        return cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, p.zero, t.micro_batch, p.pp_schedule,
                   p.pp_virtual_stages, t.recompute, t.recompute_policy, t.recompute_every, offload_tier(p) != "none",
                   bool(getattr(p, "sequence_parallel", True)), str(getattr(p, "cp_mode", "ring")),
                   offload_tier(p) == "nvme", int(getattr(p, "linear_tiles", 1)),
                   str(getattr(p, "grad_compression", "none")), float(getattr(p, "grad_compression_ratio", 0.01)),
                   int(getattr(p, "powersgd_rank", 4)), str(getattr(p, "tp_mode", "1d")),
                   trainer_split(p, cfg.model, t.seq_len) if hasattr(p, "pp_split") else ())

    # ---- derived ----
    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sp(self) -> bool:
        """Sequence parallelism is on when asked for and there is a TP axis to shard over."""
        return self.sequence_parallel and self.tp > 1 and self.tp_mode != "2d"  # 2-D: not applicable

    @property
    def shard_group(self) -> int:
        """Ranks that shard model states: dp_shard x cp (spec/dims.py ParallelDims.shard_group)."""
        return self.dp_shard * self.cp

    @property
    def wrapper(self) -> str:
        """"fsdp", "ddp", "replicate" or "none": spec/dims.py data_parallel_wrapper, as the trainer."""
        return data_parallel_wrapper(self.dp, self.cp, self.tp, self.pp, self.shard_group, self.zero, self.offload)

    @property
    def fsdp(self) -> bool:
        return self.wrapper == "fsdp"

    @property
    def replicate(self) -> bool:
        return self.wrapper == "replicate"

    @property
    def lowp_params(self) -> bool:
        return lowp_params(self.wrapper)

    @property
    def chunks_per_rank(self) -> int:
        return self.virtual_stages if self.pp > 1 else 1

    def accumulation(self, problem: Any) -> int:
        """Micro-batches per optimizer step per data-parallel rank (= pipeline micro-batches); `problem`
        is anything with global_batch (plan/layout.py Problem)."""
        return problem.global_batch // (self.micro_batch * self.dp)

    def with_(self, **kw: Any) -> "Layout":
        return replace(self, **kw)

    def describe(self) -> str:
        axes = [f"{a}{getattr(self, a)}" for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") if getattr(self, a) > 1]
        text = "x".join(axes) or "single"
        extra = [f"z{self.zero}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            extra.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.stage_layers:  # the trainer's own split, blocks per stage
            extra.append("split " + ",".join(map(str, self.stage_layers)))
        if self.recompute != "none":
            extra.append("rc-" + ({"layer": "layer", "op_alternate": "op-alt"}.get(self.recompute_policy, "op")
                                  if self.recompute == "selective" else "full"))
        if self.offload:
            extra.append("offload-nvme" if self.nvme else "offload")
        if self.linear_tiles > 1:
            extra.append(f"tiles{self.linear_tiles}")
        if self.tp > 1 and self.tp_mode == "2d":
            extra.append("tp2d")
        elif self.tp > 1 and not self.sequence_parallel:
            extra.append("no-sp")
        return f"{text} {' '.join(extra)}"

    def config_values(self, problem: Any) -> dict[str, dict[str, Any]]:
        """The parallel.* / train.* keys that make `shardwise train` run this layout."""
        return {
            "parallel": {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "zero": self.zero, "tp": self.tp,
                         "pp": self.pp, "cp": self.cp, "ep": self.ep, "pp_schedule": self.schedule,
                         "pp_virtual_stages": self.virtual_stages, "pp_layers_per_stage": list(self.stage_layers),
                         "offload": ("nvme" if self.nvme else "cpu") if self.offload else "none",
                         "linear_tiles": self.linear_tiles, "sequence_parallel": self.sequence_parallel,
                         "grad_compression": self.grad_compression, "grad_compression_ratio": self.grad_compression_ratio,
                         "powersgd_rank": self.powersgd_rank, "tp_mode": self.tp_mode},
            "train": {"micro_batch": self.micro_batch, "global_batch": problem.global_batch, "seq_len": problem.seq_len,
                      "recompute": self.recompute, "recompute_policy": self.recompute_policy,
                      "recompute_every": self.recompute_every, "precision": problem.precision},
        }
