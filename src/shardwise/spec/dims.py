"""ParallelDims: the sizes of every mesh axis and what follows from them, without a process group.

Mesh axis order, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp"). TP is innermost so
that on a GPU cluster its ranks are consecutive, i.e. inside one node (NVLink), and PP outermost
because its point-to-point traffic is the lightest (Narayanan et al. 2021, arXiv 2104.04473 §3.3).
The DeviceMesh itself is built from these sizes by parallel/mesh.py; the planner's Layout
(spec/layout.py) derives the same facts through the same functions below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from shardwise.errors import ConfigError, Violation

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


OFFLOAD_TIERS = ("none", "cpu", "nvme")
# The "nvme" tier's file (parallel/offload.py NvmeAdamW), as the trainer writes it, the planner prices it
# (plan/memory.py, cost.py) and `shardwise doctor --disk` measures a disk for it: AdamW's exp_avg +
# exp_avg_sq in fp32 per parameter, read and written in chunks of this much state.
NVME_STATE_BYTES_PER_PARAM = 8
NVME_CHUNK_BYTES = 64 << 20


def offload_tier(p: Any) -> str:
    """parallel.offload as a tier name: the config maps the old true/false to "cpu"/"none" (config.py
    aliases); a bool still arrives from objects built in code. Every reader (trainer, preflight, the
    planner's Layout) goes through here, so an unknown tier is refused here, for all of them."""
    value = getattr(p, "offload", "none")
    if isinstance(value, bool):
        return "cpu" if value else "none"
    if value not in OFFLOAD_TIERS:
        raise Violation("offload", "parallel.offload", f"{value!r} is not one of {', '.join(OFFLOAD_TIERS)}",
                        f"set parallel.offload to one of: {', '.join(OFFLOAD_TIERS)}").error()
    return value


def resolve_dp_shard(p: Any, world_size: int, world_name: str = "world_size") -> int:
    """parallel.dp_shard with -1 (the rest of the world) resolved; every other axis validated >= 1.
    `p` is anything with dp_replicate, dp_shard, cp, tp, pp and ep (ParallelConfig)."""
    for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}", f"set parallel.{name}=1 to disable this axis")
    dp_shard = p.dp_shard
    others = p.dp_replicate * p.cp * p.tp * p.pp
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError("parallel.dp_shard", f"-1 means {world_name} / (dp_replicate * cp * tp * pp) = {world_size} / {others}, "
                              "which is not an integer", f"choose axes whose product divides {world_size}")
        return world_size // others
    if dp_shard < 1:
        raise ConfigError("parallel.dp_shard", f"must be >= 1 or -1 (the rest), got {dp_shard}", "set parallel.dp_shard=-1")
    return dp_shard


def data_parallel_wrapper(dp: int, cp: int, tp: int, pp: int, shard_group: int, zero: int, offload: bool = False) -> str:
    """Which data-parallel machinery a layout trains with (parallel/data_parallel.py applies it):
    "fsdp"      ZeRO-2/3 as FSDP2 `fully_shard` (zero >= 2 and something to shard over: dp_shard x cp > 1;
                or CPU / NVMe offload, which FSDP2 does even over a shard group of one rank);
    "ddp"       DistributedDataParallel (zero 0/1) on a whole model of plain tensors;
    "replicate" FSDP2's `replicate` (zero 0/1) where parameters are DTensors (tp > 1) or the model is a
                pipeline stage (pp > 1): DDP buckets plain tensors and cannot reduce DTensor gradients,
                and the pipeline schedule drives FSDP2-family modules' gradient reduction itself;
    "none"      one data-parallel rank."""
    if zero >= 2 and (shard_group > 1 or offload):
        return "fsdp"
    if dp * cp == 1:
        return "none"
    return "replicate" if tp > 1 or pp > 1 else "ddp"


def lowp_params(wrapper: str) -> bool:
    """Compute runs on 16-bit parameter copies (FSDP2 MixedPrecisionPolicy param_dtype) rather than
    under autocast: FSDP and `replicate` (plan/activations.py regime "lowp")."""
    return wrapper in ("fsdp", "replicate")


def world_rules(dims: Any, world: int, world_name: str) -> Iterator[Violation]:
    """The axes fill the world exactly."""
    product = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp * dims.pp
    if product != world:
        yield Violation("world size", "parallel",
                        f"dp_replicate({dims.dp_replicate}) * dp_shard({dims.dp_shard}) * cp({dims.cp}) * tp({dims.tp}) "
                        f"* pp({dims.pp}) = {product} != {world_name} {world}", _world_fix(dims, product, world, world_name))


def _world_fix(dims: Any, product: int, world: int, world_name: str) -> str:
    """Advice that works as given: dp_shard=-1 alone is refused when zero=0 (it would shard nothing), so a
    data-parallel remainder is offered both ways, DDP (dp_replicate) and sharded (dp_shard=-1 + zero)."""
    count = "the number of processes (--nproc)" if world_name == "world_size" else "cluster.num_gpus"
    if world % product:
        return f"make the product equal {count}: each axis a factor of {world}"
    rest = world // product
    return (f"give the missing factor {rest} to an axis: parallel.dp_replicate={dims.dp_replicate * rest} (DDP), or "
            f"parallel.dp_shard=-1 (takes the rest) with parallel.zero=1, 2 or 3 (sharded); or set {count} to {product}")


def ep_fold_rule(dims: Any) -> Violation | None:
    """Experts are sharded over the data-parallel x context ranks (ep folds into dp_shard x cp, as in
    torchtitan), so ep must divide their product."""
    if (dims.dp_shard * dims.cp) % dims.ep:
        return Violation("ep", "parallel.ep", f"ep({dims.ep}) must divide dp_shard({dims.dp_shard}) * cp({dims.cp})",
                         "choose ep among the divisors of dp_shard * cp")
    return None


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    offload: bool = False  # parallel.offload is "cpu" or "nvme": FSDP2 keeps model states on the host
    tp_mode: str = "1d"  # parallel.tp_mode: "2d" runs the tp ranks as a q x q SUMMA grid (parallel/tensor2d.py)

    @classmethod
    def from_config(cls, p: Any, world_size: int) -> "ParallelDims":
        """Resolve dp_shard=-1 (the rest of the world) and validate every factor
        (world_rules: the product of the axes is the world size; ep_fold_rule)."""
        if world_size < 1:
            raise ConfigError("--nproc", f"must be >= 1, got {world_size}", "pass --nproc 1 or more")
        dims = cls(p.dp_replicate, resolve_dp_shard(p, world_size), p.cp, p.tp, p.pp, p.ep, world_size,
                   offload_tier(p) != "none", str(getattr(p, "tp_mode", "1d")))
        for violation in (*world_rules(dims, world_size, "world_size"), ep_fold_rule(dims)):
            if violation is not None:
                raise violation.error()
        return dims

    # ---- derived sizes ----
    @property
    def dp(self) -> int:
        """Ranks that see different data (the batch view): dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks that shard model states: dp_shard x cp (CP ranks hold identical weights, so
        torchtitan shards over both)."""
        return self.dp_shard * self.cp

    @property
    def non_dp(self) -> int:
        """Ranks that cooperate on one sample; tokens/s per device divides by this
        (docs/architecture.md, "Metrics")."""
        return self.world_size // self.dp

    def wrapper(self, zero: int) -> str:
        """The data-parallel machinery for parallel.zero = `zero` (data_parallel_wrapper)."""
        return data_parallel_wrapper(self.dp, self.cp, self.tp, self.pp, self.shard_group, zero, self.offload)

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def enabled_axes(self) -> list[str]:
        """Axes of size > 1, in mesh order: only these get a process group. Offload with a shard group of
        one rank keeps dp_shard (size 1): FSDP2 needs a mesh to shard over, even a trivial one."""
        one_rank_fsdp = self.offload and self.shard_group == 1
        return [a for a in AXES if getattr(self, a) > 1 or (a == "dp_shard" and one_rank_fsdp)]

    def describe(self) -> str:
        parts = [f"{a}={getattr(self, a)}" for a in (*AXES, "ep") if getattr(self, a) > 1]
        return ",".join(parts) if parts else "single"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every axis (row-major over AXES), computed without a process group."""
        coords = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            coords[axis] = rank % size
            rank //= size
        return coords

    def batch_rank(self, rank: int) -> int:
        """Which slice of the global batch this rank reads: its index in the dp_replicate x dp_shard view."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]
