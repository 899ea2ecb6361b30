"""What the planner reasons about: the problem (model, cluster, batch) and one candidate layout.

`Problem.from_config` and `Layout.from_config` read the same config tree as training (model.*,
train.*, parallel.*) plus [cluster]; `check_layout` names the first rule a layout breaks (the search
counts these as prune reasons, `plan evaluate` raises them as ConfigErrors). Nothing here needs a
process group: the layout rules are those of ParallelDims / preflight, minus the training-only
"not implemented yet" refusal, plus the pipeline / context / expert rules of DESIGN §2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from shardwise.errors import ConfigError
from shardwise.parallel.stages import (  # torch-free names and rules shared with the trainer
    SCHEDULES,
    V_SHAPED,
    microbatch_refusal,
    split_backward_refusal,
    virtual_stage_refusal,
)
from shardwise.plan import constants as C
from shardwise.plan.hardware import Device, lookup
from shardwise.plan.shapes import ModelShape

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16")
MODEL_STATES = ("shardwise", "mixed")
# Mesh order, outermost first (parallel/dims.py AXES); tp innermost = consecutive ranks = one node.
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
        for key in ("intra_node_gbps", "inter_node_gbps", "intra_node_latency_us", "inter_node_latency_us"):
            if getattr(c, key) < 0:
                raise ConfigError(f"cluster.{key}", f"must be >= 0, got {getattr(c, key)}", "0 takes the default")
        return cls(device, c.num_gpus, min(c.gpus_per_node, c.num_gpus),
                   c.intra_node_gbps or device.intra_node_gbps, c.inter_node_gbps or device.inter_node_gbps,
                   (c.intra_node_latency_us * 1e-6) or C.LATENCY_INTRA_S, (c.inter_node_latency_us * 1e-6) or C.LATENCY_INTER_S)


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

    @classmethod
    def from_config(cls, cfg: Any) -> "Problem":
        t = cfg.train
        shape = ModelShape.from_config(cfg.model)
        if t.precision not in PRECISIONS:
            raise ConfigError("train.precision", f"{t.precision!r} is not one of {', '.join(PRECISIONS)}", 'use "bf16"')
        states = cfg.cluster.model_states
        if states not in MODEL_STATES:
            raise ConfigError("cluster.model_states", f"{states!r} is not one of {', '.join(MODEL_STATES)}",
                              '"shardwise" (what the trainer does) or "mixed" (2+2+12 bytes/param)')
        if not 0 <= cfg.cluster.assume_mfu < 1:
            raise ConfigError("cluster.assume_mfu", f"must be within [0, 1), got {cfg.cluster.assume_mfu}", "e.g. 0.4; 0 predicts")
        for name in ("seq_len", "global_batch"):
            if getattr(t, name) < 1:
                raise ConfigError(f"train.{name}", f"must be >= 1, got {getattr(t, name)}", f"set train.{name}")
        if t.seq_len > shape.max_seq_len:
            raise ConfigError("train.seq_len", f"{t.seq_len} exceeds model.max_seq_len({shape.max_seq_len})",
                              f"lower train.seq_len or raise model.max_seq_len to >= {t.seq_len}")
        tokens = t.tokens or t.steps * t.global_batch * t.seq_len
        cluster_cfg = cfg.cluster
        if cluster_cfg.num_gpus == 0:  # the world the parallel.* axes describe (dp_shard = -1 counts as 1)
            pa = cfg.parallel
            world = pa.dp_replicate * max(1, pa.dp_shard) * pa.cp * pa.tp * pa.pp
            cluster_cfg = replace(cluster_cfg, num_gpus=world, gpus_per_node=min(cluster_cfg.gpus_per_node, world))
        return cls(shape, Cluster.from_config(cluster_cfg), t.seq_len, t.global_batch, tokens, t.precision, states,
                   cfg.cluster.assume_mfu)

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
    offload: bool = False
    sequence_parallel: bool = True
    cp_mode: str = "ring"  # "ring" (pass-KV ring attention) or "ulysses" (all-to-all heads)

    @classmethod
    def from_config(cls, cfg: Any, num_gpus: int) -> "Layout":
        """The layout a config asks for on `num_gpus` (dp_shard = -1 takes the rest, as ParallelDims)."""
        p, t = cfg.parallel, cfg.train
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}", f"set parallel.{name}=1 to disable it")
        dp_shard = p.dp_shard
        if dp_shard == -1:
            others = p.dp_replicate * p.cp * p.tp * p.pp
            if num_gpus % others:
                raise ConfigError("parallel.dp_shard", f"-1 means num_gpus / (dp_replicate * cp * tp * pp) = {num_gpus} / {others}, "
                                  "which is not an integer", f"choose axes whose product divides {num_gpus}")
            dp_shard = num_gpus // others
        return cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, p.zero, t.micro_batch, p.pp_schedule,
                   p.pp_virtual_stages, t.recompute, t.recompute_policy, t.recompute_every, p.offload,
                   bool(getattr(p, "sequence_parallel", True)), str(getattr(p, "cp_mode", "ring")))

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
        return self.sequence_parallel and self.tp > 1

    @property
    def fsdp(self) -> bool:
        """ZeRO-2/3 run as FSDP2 in this codebase (parallel/data.py: zero >= 2 and dp_shard x cp > 1)."""
        return self.zero >= 2 and self.shard_group > 1

    @property
    def replicate(self) -> bool:
        """Data parallel by FSDP2's `replicate` instead of DDP (parallel/data.py uses_replicate): TP or
        PP layouts with dp > 1 that do not shard with FSDP (zero 0 and 1)."""
        return self.dp * self.cp > 1 and not self.fsdp and (self.tp > 1 or self.pp > 1)

    @property
    def lowp_params(self) -> bool:
        """Compute runs on 16-bit parameter copies (FSDP2 MixedPrecisionPolicy param_dtype) rather than
        under autocast: FSDP (zero 2/3) and `replicate` (activations.regime's "lowp")."""
        return self.fsdp or self.replicate

    @property
    def shard_group(self) -> int:
        """Ranks that shard model states: dp_shard x cp (CP ranks hold identical weights, so torchtitan
        shards over both: parallel/data.py)."""
        return self.dp_shard * self.cp

    @property
    def chunks_per_rank(self) -> int:
        return self.virtual_stages if self.pp > 1 else 1

    def accumulation(self, problem: Problem) -> int:
        """Micro-batches per optimizer step per data-parallel rank (= pipeline micro-batches)."""
        return problem.global_batch // (self.micro_batch * self.dp)

    def with_(self, **kw: Any) -> "Layout":
        return replace(self, **kw)

    def describe(self) -> str:
        axes = [f"{a}{getattr(self, a)}" for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") if getattr(self, a) > 1]
        text = "x".join(axes) or "single"
        extra = [f"z{self.zero}", f"mb{self.micro_batch}"]
        if self.pp > 1:
            extra.append(self.schedule + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.recompute != "none":
            extra.append("rc-" + ("layer" if self.recompute == "selective" and self.recompute_policy == "layer" else
                                  "op" if self.recompute == "selective" else "full"))
        if self.offload:
            extra.append("offload")
        if self.tp > 1 and not self.sequence_parallel:
            extra.append("no-sp")
        return f"{text} {' '.join(extra)}"

    def config_values(self, problem: Problem) -> dict[str, dict[str, Any]]:
        """The parallel.* / train.* keys that make `shardwise train` run this layout."""
        return {
            "parallel": {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "zero": self.zero, "tp": self.tp,
                         "pp": self.pp, "cp": self.cp, "ep": self.ep, "pp_schedule": self.schedule,
                         "pp_virtual_stages": self.virtual_stages, "offload": self.offload,
                         "sequence_parallel": self.sequence_parallel},
            "train": {"micro_batch": self.micro_batch, "global_batch": problem.global_batch, "seq_len": problem.seq_len,
                      "recompute": self.recompute, "recompute_policy": self.recompute_policy,
                      "recompute_every": self.recompute_every, "precision": problem.precision},
        }


@dataclass(frozen=True)
class Violation:
    """The first rule a layout breaks: `reason` is the short key the search counts."""

    reason: str
    field: str
    problem: str
    fix: str

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.problem, self.fix)


def check_layout(problem: Problem, lay: Layout, allow_cross_node_tp: bool = True,
                 allow_uneven_pp: bool = True) -> Violation | None:
    """None when the layout can run; else the first broken rule (cheap, used inside the search)."""
    s, cl = problem.shape, problem.cluster
    if lay.world != cl.num_gpus:
        return Violation("world size", "parallel", f"dp_replicate({lay.dp_replicate}) * dp_shard({lay.dp_shard}) * cp({lay.cp}) * "
                         f"tp({lay.tp}) * pp({lay.pp}) = {lay.world} != cluster.num_gpus {cl.num_gpus}",
                         "make the product equal cluster.num_gpus, or set parallel.dp_shard=-1 to take the rest")
    if lay.zero not in (0, 1, 2, 3):
        return Violation("zero", "parallel.zero", f"must be 0, 1, 2 or 3, got {lay.zero}", "0 DDP, 1 optimizer, 2 + grads, 3 + params")
    if lay.zero == 0 and lay.dp_shard > 1:
        return Violation("zero", "parallel.zero", f"zero=0 shards nothing, but dp_shard={lay.dp_shard}",
                         "set parallel.zero >= 1, or move the ranks to parallel.dp_replicate")
    if lay.zero > 0 and lay.shard_group == 1:
        return Violation("zero", "parallel.zero", f"zero={lay.zero} shards over dp_shard x cp, which is 1",
                         "set parallel.dp_shard > 1 or parallel.zero=0")
    if lay.offload and lay.zero < 2:
        return Violation("offload", "parallel.offload", f"CPU offload needs FSDP (zero >= 2), got zero={lay.zero}",
                         "set parallel.zero=2 or 3, or parallel.offload=false")
    if s.n_heads % lay.tp:
        return Violation("heads % tp", "parallel.tp", f"n_heads({s.n_heads}) is not divisible by tp({lay.tp})",
                         "choose tp among the divisors of model.n_heads")
    if s.n_kv_heads % lay.tp and lay.tp % s.n_kv_heads:
        return Violation("kv heads vs tp", "parallel.tp", f"n_kv_heads({s.n_kv_heads}) and tp({lay.tp}) do not divide one another",
                         "choose tp dividing n_kv_heads, or a multiple of it (KV heads are then replicated)")
    if s.ffn_dim % lay.tp:
        return Violation("ffn % tp", "parallel.tp", f"ffn_dim({s.ffn_dim}) is not divisible by tp({lay.tp})",
                         "choose tp among the divisors of model.ffn_dim")
    if s.moe is not None and s.expert_ffn % lay.tp:
        return Violation("expert ffn % tp", "model.moe.expert_ffn_dim", f"expert ffn dim({s.expert_ffn}) is not divisible by tp({lay.tp})",
                         "choose tp among the divisors of the expert ffn dim (experts are split on it)")
    if lay.sp and problem.seq_len % lay.tp:
        return Violation("seq % tp", "train.seq_len", f"sequence parallelism splits seq_len({problem.seq_len}) over tp({lay.tp})",
                         "choose seq_len divisible by tp, or parallel.sequence_parallel=false")
    if lay.tp > cl.gpus_per_node and not allow_cross_node_tp:
        return Violation("tp > gpus_per_node", "parallel.tp", f"tp({lay.tp}) spans nodes of {cl.gpus_per_node} GPUs",
                         "keep tp <= cluster.gpus_per_node (or pass --allow-cross-node-tp)")
    if lay.schedule not in SCHEDULES:
        return Violation("schedule", "parallel.pp_schedule", f"{lay.schedule!r} is not one of {', '.join(SCHEDULES)}",
                         f"use one of {', '.join(SCHEDULES)}")
    v = lay.chunks_per_rank
    if lay.pp > 1:
        refusal = virtual_stage_refusal(lay.schedule, v)
        if refusal is not None:
            return Violation(*refusal)
    if lay.pp * v > s.n_layers:
        return Violation("layers % (pp*v)", "parallel.pp", f"pp({lay.pp}) x virtual stages({v}) = {lay.pp * v} > n_layers({s.n_layers})",
                         "use fewer pipeline stages")
    if s.n_layers % (lay.pp * v) and not allow_uneven_pp:
        return Violation("layers % (pp*v)", "parallel.pp", f"n_layers({s.n_layers}) is not divisible by pp({lay.pp}) x virtual stages({v})",
                         "choose pp * pp_virtual_stages dividing model.n_layers")
    if lay.cp_mode not in ("ring", "ulysses"):
        return Violation("cp_mode", "parallel.cp_mode", f"{lay.cp_mode!r} is not one of ring, ulysses", 'use "ring"')
    if problem.seq_len % (2 * lay.cp) and lay.cp > 1:
        return Violation("seq % 2cp", "train.seq_len", f"seq_len({problem.seq_len}) is not divisible by 2 x cp({lay.cp})",
                         "causal load balancing splits each sequence into 2*cp chunks")
    if lay.cp > 1 and lay.sp and (problem.seq_len // lay.cp) % lay.tp:
        return Violation("seq/cp % tp", "train.seq_len", f"SP splits seq_len/cp({problem.seq_len // lay.cp}) over tp({lay.tp})",
                         "choose seq_len divisible by cp x tp, or parallel.sequence_parallel=false")
    if lay.cp > 1 and lay.cp_mode == "ulysses" and (s.n_heads // lay.tp) % lay.cp:
        return Violation("heads/tp % cp", "parallel.cp", f"Ulysses splits n_heads/tp({s.n_heads // lay.tp}) over cp({lay.cp})",
                         "choose cp dividing n_heads / tp, or parallel.cp_mode=ring")
    if lay.ep > 1 and (s.moe is None or s.moe.num_experts % lay.ep):
        what = "the model has no experts" if s.moe is None else f"num_experts({s.moe.num_experts}) is not divisible by ep({lay.ep})"
        return Violation("ep", "parallel.ep", what, "set parallel.ep=1" if s.moe is None else "choose ep dividing num_experts")
    if (lay.dp_shard * lay.cp) % lay.ep:
        return Violation("ep", "parallel.ep", f"ep({lay.ep}) must divide dp_shard({lay.dp_shard}) * cp({lay.cp})",
                         "choose ep among the divisors of dp_shard * cp")
    if lay.micro_batch < 1 or problem.global_batch % (lay.micro_batch * lay.dp):
        return Violation("batch", "train.global_batch",
                         f"global_batch({problem.global_batch}) is not divisible by micro_batch({lay.micro_batch}) x dp({lay.dp})",
                         f"use a global_batch that is a multiple of {lay.micro_batch * lay.dp}")
    bad = pipeline_microbatch_rule(lay.schedule, lay.pp, lay.accumulation(problem))
    if bad is not None:
        return bad
    if lay.pp > 1:
        split = split_backward_refusal(lay.schedule, lay.zero, lay.recompute, lay.recompute_policy)
        if split is not None:
            return Violation(*split)
    if lay.recompute not in RECOMPUTE:
        return Violation("recompute", "train.recompute", f"{lay.recompute!r} is not one of {', '.join(RECOMPUTE)}", 'use "none"')
    return None


def pipeline_microbatch_rule(schedule: str, pp: int, m: int) -> Violation | None:
    """The micro-batch counts the trainer's schedules need (parallel/stages.py, the same rules)."""
    refusal = microbatch_refusal(schedule, pp, m)
    return None if refusal is None else Violation(*refusal)


def axis_placement(lay: Layout, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """For each mesh axis: (ranks of one group inside a node, nodes the group spans).

    Ranks are laid out row-major over MESH_ORDER (tp fastest), as DeviceMesh does; a group of axis A
    with size n has stride = product of the sizes inside A. If stride * n <= gpus_per_node the group
    lives in one node; if stride >= gpus_per_node every member is on another node; in between it has
    gpus_per_node / stride members per node. The flattened "dp" group (dp_replicate x dp_shard) is
    contiguous in the mesh, so it is placed like one axis of size dp with dp_shard's stride.
    """
    sizes = {"pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp}
    out: dict[str, tuple[int, int]] = {}
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
    for axis, n in groups.items():
        st = strides[axis]
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
