"""What the planner reasons about: the problem (model, cluster, batch) and one candidate layout.

`Problem.from_config` reads the same config tree as training (model.*, train.*) plus [cluster]; the
layout itself is spec/layout.py's. `check_layout` names the first rule a layout breaks (the search
counts these as prune reasons, `plan evaluate` raises them as ConfigErrors): spec/rules.py's rules,
the ones the trainer's pre-flight raises, minus those only today's trainer has
(marked trainer_only; `plan evaluate` reports them as "trainable: no", cli.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from shardwise.errors import ConfigError, Violation
from shardwise.plan import constants as C
from shardwise.plan.calibration import AxisCalibration, MeasuredDevice, read_calibration
from shardwise.plan.stack import CHOICES as STACK_CHOICES
from shardwise.plan.stack import Stack
from shardwise.plan.stack import resolve as resolve_stack
from shardwise.spec import rules
from shardwise.spec.hardware import Device, lookup
from shardwise.spec.layout import (
    PRECISIONS,
    Layout,
    attention_backend,
    compute_precision,
    default_precision,
    fp8_gemm_fits,
)
from shardwise.spec.shapes import ModelShape

MODEL_STATES = ("shardwise", "mixed")
# AdamW's fp32 master copy, exp_avg and exp_avg_sq (Rajbhandari et al. 2019, Fig. 1), or all three in bf16
OPTIMIZER_STATE_BYTES = {"fp32": 12, "bf16": 6}
# Mesh order, outermost first (spec/dims.py AXES); tp innermost = consecutive ranks = one node.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Cluster:
    device: Device
    num_gpus: int
    gpus_per_node: int
    intra_gbps: float
    inter_gbps: float
    intra_latency_s: float
    inter_latency_s: float
    # Measured per mesh axis (cluster.calibration, plan/calibration.py); () = the datasheet model only.
    calibration: tuple[AxisCalibration, ...] = ()
    calibration_path: str = ""
    # Fitted by `shardwise plan calibrate` (plan/fit.py): eager pointwise kernels' HBM fraction; None = the
    # built-in constants.EAGER_POINTWISE_HBM_FRACTION.
    pointwise_hbm_fraction: float | None = None
    # ... and compiled (fused) kernels' fraction of the datasheet bandwidth; None = compute_time's streaming
    # fraction (constants.HBM_FRACTION_BY_FAMILY / HBM_FRACTION).
    compiled_hbm_fraction: float | None = None
    # Measured by `shardwise bench-comm` (cluster.calibration): how much slower compute runs beside its
    # collectives; None = plan/scale.py's OVERLAP_COMPUTE_SLOWDOWN on a GPU, none on a CPU.
    overlap_slowdown: float | None = None
    # Measured by benchmarks/kernels.py (cluster.calibration): replaces the datasheet rates; `device` is then
    # its measured-* stand-in. Needed to plan a CPU.
    measured_device: MeasuredDevice | None = None
    # What a run costs (plan/goodput.py): None = unset, the planner's default (plan/constants.py).
    price_per_gpu_hour: float = 0.0
    failures_per_gpu_hour: float | None = None
    checkpoint_save_s: float | None = None
    restart_s: float | None = None
    elastic_restart_s: float | None = None
    # parallel.offload = "nvme": the local disk's bandwidth per GPU, GB/s (cluster.disk_gbps, measured by
    # `shardwise doctor --disk DIR`); 0 = the datasheet NVMe drive of constants.NVME_*.
    disk_gbps: float = 0.0
    # The tapered tier of the fabric (cluster.nodes_per_pod / oversubscription, plan/fabric.py): 0 / 1 = none.
    nodes_per_pod: int = 0
    oversubscription: float = 1.0

    @property
    def device_is_host(self) -> bool:
        """The planned device is the CPU itself (cluster.gpu = "cpu", measured): host memory is device
        memory, so offload moves nothing off the device and copies nothing over a host link."""
        return self.measured_device is not None and self.measured_device.device_type == "cpu"

    def host_memory_bytes(self) -> float:
        """Host memory one rank may fill with offloaded states (constants.HOST_MEMORY_GIB_PER_GPU x
        HOST_USABLE_FRACTION); a CPU device: its own memory (offload keeps everything there)."""
        if self.device_is_host:
            return self.device.memory_gib * 2**30 * C.USABLE_MEMORY_FRACTION
        gib = C.HOST_MEMORY_GIB_PER_GPU.get(C.family(self.device.name.removeprefix("measured-")),
                                            C.HOST_MEMORY_GIB_PER_GPU_DEFAULT)
        return gib * 2**30 * C.HOST_USABLE_FRACTION

    def disk_bytes_per_s(self) -> tuple[float, float]:
        """(read, write) bytes/s of the local disk for the NVMe tier: cluster.disk_gbps (measured, both
        directions) or the datasheet drive at constants.NVME_FRACTION."""
        if self.disk_gbps > 0:
            return self.disk_gbps * 1e9, self.disk_gbps * 1e9
        return C.NVME_READ_GBPS * 1e9 * C.NVME_FRACTION, C.NVME_WRITE_GBPS * 1e9 * C.NVME_FRACTION

    def measured(self, axis: str) -> AxisCalibration | None:
        """The calibration of `axis` when `shardwise bench-comm` measured it, else None."""
        return next((a for a in self.calibration if a.axis == axis), None)

    @classmethod
    def from_config(cls, c: Any) -> "Cluster":
        device = lookup(c.gpu)
        if c.num_gpus < 1:
            raise ConfigError("cluster.num_gpus", f"must be >= 1, got {c.num_gpus}", "set cluster.num_gpus")
        if c.gpus_per_node < 1:
            raise ConfigError("cluster.gpus_per_node", f"must be >= 1, got {c.gpus_per_node}", "e.g. 8 for a DGX/HGX node")
        if c.num_gpus > c.gpus_per_node and c.num_gpus % c.gpus_per_node:
            raise ConfigError("cluster.num_gpus", f"{c.num_gpus} GPUs do not fill whole nodes of {c.gpus_per_node}",
                              "use a multiple of cluster.gpus_per_node")
        for key in ("intra_node_gbps", "inter_node_gbps", "intra_node_latency_us", "inter_node_latency_us", "memory_gib",
                    "memory_bandwidth_gbps", "peak_tflops"):
            if not (math.isfinite(getattr(c, key)) and getattr(c, key) >= 0):
                raise ConfigError(f"cluster.{key}", f"must be a finite number >= 0, got {getattr(c, key)}",
                                  "0 takes the default")
        fixes = {"price_per_gpu_hour": "0 = not priced", "failures_per_gpu_hour": "0 = no failures; unset = Llama 3's rate",
                 "checkpoint_save_s": "unset = estimated from the checkpoint's bytes", "restart_s": "unset = an assumed 600 s",
                 "elastic_restart_s": "unset = the measured 47 s",
                 "disk_gbps": "0 = a datasheet NVMe drive per GPU"}
        if c.nodes_per_pod < 0:
            raise ConfigError("cluster.nodes_per_pod", f"must be >= 0, got {c.nodes_per_pod}",
                              "0 = one non-blocking fabric; else the nodes under one non-blocking tier, e.g. 384")
        if not (math.isfinite(c.oversubscription) and c.oversubscription >= 1):
            raise ConfigError("cluster.oversubscription", f"must be a finite number >= 1, got {c.oversubscription}",
                              "a pod's injection bandwidth / its uplinks', e.g. 7 for 1:7; 1 = non-blocking")
        costs = {k: getattr(c, k, None) for k in fixes}
        for key, v in costs.items():
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"cluster.{key}", f"must be a finite number >= 0, got {v}", fixes[key])
        path = getattr(c, "calibration", None) or ""
        # cluster.calibration: one file or several, comma-separated: bench-comm results (links) and / or a
        # `plan calibrate` result (the eager pointwise fraction).
        calibration = read_calibration(path)
        measured = calibration.measured_device
        if measured is not None:
            device = measured.as_device(device)
        elif device.name == "cpu":
            raise ConfigError("cluster.gpu", "a CPU has no datasheet rates to plan with",
                              "measure them: `python benchmarks/kernels.py --device cpu --out kernels.json`, then "
                              "--cluster.calibration=kernels.json")
        # A variant of the table's part (cluster.memory_gib / memory_bandwidth_gbps): stated values win over the
        # datasheet and over a measured copy rate; the name stays, so per-family constants still apply.
        device = replace(device, memory_gib=c.memory_gib or device.memory_gib,
                         memory_bandwidth_gbps=c.memory_bandwidth_gbps or device.memory_bandwidth_gbps)
        if c.peak_tflops:
            # cluster.peak_tflops: a part clocked lower than the datasheet's (a power limit): one clock drives every
            # unit, so every precision's peak scales by the stated bf16 peak over the datasheet's. The per-family
            # GEMM efficiencies (constants.MAMF) still apply, as fractions of that lower peak.
            if "bf16" not in device.peak_tflops:
                raise ConfigError("cluster.peak_tflops", f"{device.name} has no bf16 peak to scale from",
                                  "leave cluster.peak_tflops at 0 for this device")
            ratio = c.peak_tflops / device.peak_tflops["bf16"]
            device = replace(device, peak_tflops={k: v * ratio for k, v in device.peak_tflops.items()})
        intra, inter = c.intra_node_gbps or device.intra_node_gbps, c.inter_node_gbps or device.inter_node_gbps
        latency = (c.intra_node_latency_us * 1e-6) or C.LATENCY_INTRA_S
        if c.num_gpus > 1 and not intra:
            # A CPU has no datasheet link (this was a ZeroDivisionError). Its processes share one host, so
            # every mesh axis's collectives take the same path (gloo over loopback): a bench-comm measurement
            # of one axis stands for the axes it did not measure.
            if not calibration.links:
                raise ConfigError("cluster.calibration", f"{c.num_gpus} processes on {device.name} need a link bandwidth, "
                                  "and it has no datasheet one", "measure it: `shardwise bench-comm --nproc N --out "
                                  "comm.json`, then --cluster.calibration=kernels.json,comm.json (or set cluster.intra_node_gbps)")
            link = calibration.links[0]
            intra = inter = link.bus_bytes_per_s / 1e9 / C.BUS_FRACTION_INTRA
            latency = link.hop_latency_s
        return cls(device, c.num_gpus, min(c.gpus_per_node, c.num_gpus), intra, inter or intra,
                   latency, (c.inter_node_latency_us * 1e-6) or C.LATENCY_INTER_S,
                   calibration.links, path, pointwise_hbm_fraction=calibration.pointwise_hbm_fraction,
                   compiled_hbm_fraction=calibration.compiled_hbm_fraction, measured_device=measured,
                   overlap_slowdown=calibration.overlap_slowdown,
                   price_per_gpu_hour=costs["price_per_gpu_hour"] or 0.0,
                   failures_per_gpu_hour=costs["failures_per_gpu_hour"], checkpoint_save_s=costs["checkpoint_save_s"],
                   restart_s=costs["restart_s"], elastic_restart_s=costs["elastic_restart_s"],
                   disk_gbps=costs["disk_gbps"] or 0.0, nodes_per_pod=c.nodes_per_pod,
                   oversubscription=c.oversubscription)


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything a layout does not change. Compared and hashed by identity (eq=False): it is the
    first key of every planner cache, and one search uses one Problem."""

    shape: ModelShape
    cluster: Cluster
    seq_len: int
    global_batch: int
    tokens: int           # tokens to train on (days)
    precision: str
    model_states: str
    assume_mfu: float = 0.0
    # "mixed" states: bytes per parameter of AdamW's master copy and moments (cluster.optimizer_state_dtype)
    master_state_bytes: int = 12
    fp8_recipe: str = "tensorwise"  # train.fp8_recipe, read when precision is "fp8"
    # The SDPA kernel of the blocks (spec/layout.py attention_backend): the planner plans GPUs; the CPU
    # validation replaces it with what runs there ("flash").
    attention: str = "flash"
    # train.compile resolved as the trainer does on a GPU (unset: compiled): eager forwards pay a cost per
    # kernel (constants.EAGER_FORWARD_KERNEL_S).
    eager: bool = False
    # train.compile unset: the trainer also runs 2-D tensor-parallel layouts eagerly (parallel/compile.py
    # compile_enabled), so a 2-D candidate is priced eager (eager_for).
    compile_unset: bool = False
    # train.tf32 on a GPU: fp32 GEMMs run on TF32 tensor cores (parallel/precision.py set_matmul_precision).
    tf32: bool = False
    # cluster.*_kernel as given ((key, value) pairs, unset left out) and the device type: plan/stack.py.
    stack_choices: tuple[tuple[str, str], ...] = ()
    device_type: str = "cuda"
    fp8_head: bool = False  # train.fp8_head: the output head's GEMMs in FP8 too (precision "fp8" only)
    fuse_projections: bool = False  # train.fuse_projections: q|k|v and w1|w3 as one GEMM each (fused_for)
    # train.document_mask: the share of causal attention's tiles the mask computes (spec/documents.py), measured
    # on the run's prepared data by `shardwise plan` (plan/command.py), 1.0 until measured; None: no mask.
    document_share: float | None = None
    # cluster.block_overhead_us: seconds per block and micro-batch a stack spends outside the priced kernels
    # (plan/compute_time.py); 0 = the trainer's compiled blocks.
    block_overhead_s: float = 0.0

    def eager_for(self, lay: Layout) -> bool:
        """Whether `lay` runs eagerly under this problem's train.compile (see compile_unset)."""
        return self.eager or (self.compile_unset and getattr(lay, "tp_mode", "1d") == "2d")

    def stack_for(self, lay: Layout) -> Stack:
        """The software stack `lay` is priced on (plan/stack.py): compiled or eager, the rest is the problem's."""
        return self._stacks[not self.eager_for(lay)]

    @cached_property
    def _stacks(self) -> tuple[Stack, Stack]:
        """(eager, compiled) stacks, resolved once: the search asks for a candidate's stack many times."""
        # torch's default fused SDPA kernel: cuDNN's on Hopper and later (torch 2.5+), FlashAttention-2 elsewhere
        hopper = C.family(self.cluster.device.name.removeprefix("measured-")) in ("h100", "h200", "b200")
        default = "math" if self.attention == "math" else ("cudnn" if self.device_type == "cuda" and hopper else "flash")
        return tuple(resolve_stack(dict(self.stack_choices), compiled, default, self.device_type) for compiled in (False, True))

    @classmethod
    def from_config(cls, cfg: Any) -> "Problem":
        t = cfg.train
        shape = ModelShape.from_config(cfg.model)
        for v in (*rules.model_rules(shape), *rules.moe_rules(shape.moe, shape.n_layers),
                  *rules.fp8_head_rules(t.fp8_head, t.precision)):
            raise v.error()
        if t.precision is not None and t.precision not in PRECISIONS:
            raise ConfigError("train.precision", f"{t.precision!r} is not one of {', '.join(PRECISIONS)}", 'use "bf16"')
        states = cfg.cluster.model_states
        if states not in MODEL_STATES:
            raise ConfigError("cluster.model_states", f"{states!r} is not one of {', '.join(MODEL_STATES)}",
                              '"shardwise" (what the trainer does) or "mixed" (2+2+12 bytes/param)')
        state_dtype = cfg.cluster.optimizer_state_dtype or "fp32"
        if state_dtype not in OPTIMIZER_STATE_BYTES:
            raise ConfigError("cluster.optimizer_state_dtype", f"{state_dtype!r} is not one of {', '.join(OPTIMIZER_STATE_BYTES)}",
                              'leave it unset for fp32 (what the trainer keeps)')
        if state_dtype != "fp32" and states != "mixed":
            raise ConfigError("cluster.optimizer_state_dtype", f'{state_dtype!r} is read with model_states = "mixed" only, '
                              f"not {states!r}", 'set cluster.model_states = "mixed", or leave this unset')
        overhead = cfg.cluster.block_overhead_us
        if overhead is not None and not (math.isfinite(overhead) and 0 <= overhead <= 1e6):
            raise ConfigError("cluster.block_overhead_us", f"must be a finite number of microseconds in [0, 1e6], got {overhead}",
                              "leave it unset for the trainer's blocks; e.g. 1027 for Megatron-Core (docs/planner.md)")
        if not 0 <= cfg.cluster.assume_mfu < 1:
            raise ConfigError("cluster.assume_mfu", f"must be within [0, 1), got {cfg.cluster.assume_mfu}", "e.g. 0.4; 0 predicts")
        for name in ("seq_len", "global_batch"):
            if getattr(t, name) < 1:
                raise ConfigError(f"train.{name}", f"must be >= 1, got {getattr(t, name)}", f"set train.{name}")
        if t.seq_len > shape.max_seq_len:
            raise Violation("seq_len", "train.seq_len", f"{t.seq_len} exceeds model.max_seq_len({shape.max_seq_len})",
                                  f"lower train.seq_len or raise model.max_seq_len to >= {t.seq_len}").error()
        tokens = t.tokens or t.steps * t.global_batch * t.seq_len
        cluster_cfg = cfg.cluster
        if cluster_cfg.num_gpus == 0:  # the world the parallel.* axes describe (dp_shard = -1 counts as 1)
            pa = cfg.parallel
            world = pa.dp_replicate * max(1, pa.dp_shard) * pa.cp * pa.tp * pa.pp
            cluster_cfg = replace(cluster_cfg, num_gpus=world, gpus_per_node=min(cluster_cfg.gpus_per_node, world))
        cluster = Cluster.from_config(cluster_cfg)
        kind = cluster.measured_device.device_type if cluster.measured_device else "cuda"
        # train.precision unset: what the trainer picks on this device (spec/layout.py default_precision).
        precision = t.precision or default_precision(kind, "bf16" in cluster.device.peak_tflops)
        choices = {k: getattr(cfg.cluster, k) for k in STACK_CHOICES if getattr(cfg.cluster, k, None)}
        for key, value in choices.items():
            if value not in STACK_CHOICES[key]:
                raise ConfigError(f"cluster.{key}", f"{value!r} is not one of {', '.join(STACK_CHOICES[key])}",
                                  "leave it unset for what the trainer runs (plan/stack.py)")
        if choices.get("pp_engine") == "deepspeed" and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule != "1f1b":
            raise ConfigError("cluster.pp_engine", f"DeepSpeed's PipelineEngine runs only 1F1B (its TrainSchedule), "
                              f"and parallel.pp_schedule is {cfg.parallel.pp_schedule!r}",
                              "set --parallel.pp_schedule=1f1b, or leave cluster.pp_engine unset")
        attention = attention_backend(kind, precision, shape.n_kv_heads != shape.n_heads)
        if "attention_kernel" in choices:  # memory: only the math kernel keeps the s x s scores
            attention = "math" if choices["attention_kernel"] == "math" else "flash"
        if t.document_mask and kind == "cuda":  # FlexAttention keeps no s x s scores either (models/common.py)
            attention = "flash"
        return cls(shape, cluster, t.seq_len, t.global_batch, tokens, precision, states,
                   cfg.cluster.assume_mfu, OPTIMIZER_STATE_BYTES[state_dtype], t.fp8_recipe, attention,
                   # the trainer's default (train.compile unset): compiled on a GPU, eager on a CPU
                   eager=(t.compile is False or (t.compile is None and kind == "cpu")
                          or t.compile_backend == "aot_eager"),  # aot_eager: eager kernels, a debugging backend
                   compile_unset=t.compile is None,
                   tf32=t.tf32 and kind == "cuda", stack_choices=tuple(choices.items()), device_type=kind,
                   fp8_head=t.fp8_head, fuse_projections=t.fuse_projections,
                   document_share=1.0 if t.document_mask else None, block_overhead_s=(overhead or 0.0) * 1e-6)

    def fused_for(self, lay: Layout) -> bool:
        """train.fuse_projections in effect on `lay` (models/feed_forward.py fused_linear): the trainer joins
        the projections where each weight is whole on its rank, tp = 1, and not under FSDP's FP8 all-gather
        (spec/rules.py fused_projection_rules, which refuses the rest: a search prices those layouts unjoined)."""
        return self.fuse_projections and lay.tp == 1 and not self.fp8_gathers(lay)

    def stack_description(self, lay: Layout) -> str:
        """The software stack `lay` is priced on, in words (plan/stack.py), with the joined projections and, under
        FP8, whose casts (cluster.fp8_kernel: read only then, so said only then)."""
        stack = self.stack_for(lay)
        fp8 = {"torchao": ", FP8 cast as torchao does", "transformer_engine": ", FP8 cast as Transformer Engine does"}
        return (stack.describe() + (fp8[stack.fp8] if self.precision == "fp8" else "")
                + (", q|k|v and w1|w3 joined" if self.fused_for(lay) else "")
                + (", SP linear inputs kept sharded (all-gathered again in backward)" if self.sp_sharded(lay) else "")
                + (", selective recomputation of the attention core only" if self.core_recompute(lay) else "")
                + (", SP all-gathers in FP8 (torchao's float8 TP styles)" if self.fp8_sp_gathers(lay) else "")
                + (", DeepSpeed's pipeline engine (blocking send / recv" + (", sends split over TP)" if lay.tp > 1 else ")")
                   if self.deepspeed_pipeline(lay) else "")
                + (f", {self.block_overhead_s * 1e6:,.0f} us per block and micro-batch outside its kernels"
                   if self.block_overhead_s else ""))

    def sp_sharded(self, lay: Layout) -> bool:
        """cluster.sp_saved_input = "sharded" in effect on `lay`: sequence parallelism over tp > 1 (plan/stack.py)."""
        return lay.sp and lay.tp > 1 and self.stack_for(lay).sp_input == "sharded"

    def deepspeed_pipeline(self, lay: Layout) -> bool:
        """cluster.pp_engine = "deepspeed" in effect on `lay`: pipeline parallel (plan/stack.py)."""
        return lay.pp > 1 and self.stack_for(lay).pp_engine == "deepspeed"

    def fp8_sp_gathers(self, lay: Layout) -> bool:
        """cluster.sp_gather = "fp8" in effect on `lay` (plan/stack.py): FP8 tensorwise training, whose float8 TP
        styles gather in FP8, and sequence parallelism over tp > 1, whose all-gathers they are."""
        return (self.precision == "fp8" and self.fp8_recipe == "tensorwise" and lay.sp and lay.tp > 1
                and self.stack_for(lay).sp_gather == "fp8")

    def core_recompute(self, lay: Layout) -> bool:
        """cluster.selective_recompute = "attention_core" in effect on `lay`: selective recomputation reruns only the
        attention core (plan/stack.py), whatever train.recompute_policy says."""
        return lay.recompute == "selective" and self.stack_for(lay).selective == "attention_core"

    @property
    def head_in_fp8(self) -> bool:
        """train.fp8_head in effect: FP8 training, and a head torch._scaled_mm takes (spec/layout.py)."""
        return self.fp8_head and self.precision == "fp8" and fp8_gemm_fits(self.shape.dim, self.shape.vocab_size)

    def fp8_gathers(self, lay: Layout) -> bool:
        """FSDP2 all-gathers the blocks' FP8 weights (tensorwise recipe; parallel/float8.py)."""
        return self.precision == "fp8" and self.fp8_recipe == "tensorwise" and lay.fsdp

    @property
    def compute_precision(self) -> str:
        """The dtype everything but FP8's GEMMs computes in: "fp8" computes in bf16 (parallel/float8.py),
        "fp32" in TF32 on a GPU with train.tf32."""
        return compute_precision(self.precision, self.tf32)

    @property
    def low_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element in the compute dtype."""
        return 2 if self.low_precision else 4

    @cached_property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def check_layout(problem: Problem, lay: Layout, allow_cross_node_tp: bool = True,
                 allow_uneven_pp: bool = True) -> Violation | None:
    """None when the layout can run; else the first broken rule (cheap, used inside the search).
    The rules are spec/rules.py's (the trainer's pre-flight raises the same ones) minus those marked
    trainer_only, plus two planning options: tp inside a node, and an even pipeline split."""
    cl = problem.cluster
    for v in rules.world_rules(lay, cl.num_gpus, "cluster.num_gpus"):
        return v
    for v in rules.layout_rules(problem.shape, lay, problem.seq_len, problem.global_batch,
                                0 if allow_cross_node_tp else cl.gpus_per_node, not allow_uneven_pp):
        if not v.trainer_only:
            return v
    return None


def axis_groups(lay: Layout) -> dict[str, tuple[int, int]]:
    """For each mesh axis: (group size, stride in ranks between consecutive members).

    Ranks are laid out row-major over MESH_ORDER (tp fastest), as DeviceMesh does; a group of axis A
    with size n has stride = product of the sizes inside A. The flattened "dp" group (dp_replicate x
    dp_shard) is contiguous in the mesh, so it is placed like one axis of size dp with dp_shard's stride.
    """
    sizes = {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp}
    stride = 1
    strides = {}
    for axis in reversed(MESH_ORDER):
        strides[axis] = stride
        stride *= sizes[axis]
    groups = dict(sizes, dp=lay.dp, dp_shard_cp=lay.dp_shard * lay.cp, dp_cp=lay.dp * lay.cp)
    strides["dp"] = strides["dp_shard"]
    # With CP, the ranks that hold the same weights are dp x cp (torchtitan's flattened "dp_shard_cp" /
    # "dp_cp" meshes): contiguous in the mesh, starting at cp's stride.
    strides["dp_shard_cp"] = strides["dp_cp"] = strides["cp"]
    # Experts live on the dp_shard x cp ranks (dims.py): an ep group of size e is the innermost e of them.
    groups["ep"] = lay.ep
    strides["ep"] = strides["cp"] if lay.cp > 1 else strides["dp_shard"]
    # ... and efsdp (the ranks holding the same experts, parallel/expert.py) is the rest of that block,
    # outside ep: stride ep x ep's stride.
    groups["efsdp"] = max(1, lay.dp_shard * lay.cp // lay.ep)
    strides["efsdp"] = strides["ep"] * lay.ep
    if lay.tp > 1 and lay.tp_mode == "2d":
        # 2-D TP's q x q grid, row-major over the tp ranks (parallel/mesh.py build_tp_grid): "tp_col" (a
        # grid row) is q consecutive ranks, "tp_row" (a grid column) q ranks q apart.
        q = math.isqrt(lay.tp)
        groups["tp_col"], strides["tp_col"] = q, strides["tp"]
        groups["tp_row"], strides["tp_row"] = q, strides["tp"] * q
    return {axis: (n, strides[axis]) for axis, n in groups.items()}


def axis_placement(lay: Layout, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """For each mesh axis: (ranks of one group inside a node, nodes the group spans).

    A group of size n and stride st (`axis_groups`) lives in one node if st * n <= gpus_per_node; if
    st >= gpus_per_node every member is on another node; in between it has gpus_per_node / st members
    per node.
    """
    out: dict[str, tuple[int, int]] = {}
    for axis, (n, st) in axis_groups(lay).items():
        if n == 1:
            out[axis] = (1, 1)
        elif st * n <= gpus_per_node:
            out[axis] = (n, 1)
        elif st >= gpus_per_node:
            out[axis] = (1, n)
        else:
            per_node = max(1, gpus_per_node // st)
            out[axis] = (per_node, math.ceil(n / per_node))
    return out
