"""ParallelDims: the sizes of every mesh axis, validated without a process group, and the mesh views.

Mesh axis order, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp"). TP is innermost so
that on a GPU cluster its ranks are consecutive, i.e. inside one node (NVLink), and PP outermost
because its point-to-point traffic is the lightest (Narayanan et al. 2021, arXiv 2104.04473 §3.3).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.config import ParallelConfig
from shardwise.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Axes that are validated now but trained by later milestones; each entry says what refuses it.
NOT_YET_TRAINABLE: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, p: ParallelConfig, world_size: int) -> "ParallelDims":
        """Resolve dp_shard=-1 (the rest of the world) and validate every factor."""
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}", f"must be >= 1, got {getattr(p, name)}", f"set parallel.{name}=1 to disable this axis")
        if world_size < 1:
            raise ConfigError("--nproc", f"must be >= 1, got {world_size}", "pass --nproc 1 or more")
        dp_shard = p.dp_shard
        others = p.dp_replicate * p.cp * p.tp * p.pp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError("parallel.dp_shard", f"-1 means world_size / (dp_replicate * cp * tp * pp) = {world_size} / {others}, "
                                  "which is not an integer", f"choose axes whose product divides {world_size}")
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise ConfigError("parallel.dp_shard", f"must be >= 1 or -1 (the rest), got {dp_shard}", "set parallel.dp_shard=-1")
        dims = cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, world_size)
        dims._validate()
        return dims

    def _validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            raise ConfigError(
                "parallel",
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) "
                f"* pp({self.pp}) = {product} != world_size {self.world_size}",
                f"make the product equal the number of processes (--nproc), or set parallel.dp_shard=-1 "
                f"to take the rest")
        # Experts are sharded over the data-parallel x context ranks (ep is folded into dp_shard x cp,
        # as in torchtitan), so it must divide their product.
        if (self.dp_shard * self.cp) % self.ep:
            raise ConfigError("parallel.ep", f"ep({self.ep}) must divide dp_shard({self.dp_shard}) * cp({self.cp})",
                              "choose ep among the divisors of dp_shard * cp")

    # ---- derived sizes ----
    @property
    def dp(self) -> int:
        """Ranks that see different data (the batch view): dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_dp(self) -> int:
        """Ranks that cooperate on one sample; tokens/s per device divides by this (DESIGN §5)."""
        return self.world_size // self.dp

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def enabled_axes(self) -> list[str]:
        """Axes of size > 1, in mesh order: only these get a process group."""
        return [a for a in AXES if getattr(self, a) > 1]

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

    def build_mesh(self, device_type: str) -> "Meshes | None":
        """The DeviceMesh over the enabled axes and its named views. None on one process: the
        reference path runs without any process group."""
        from torch.distributed.device_mesh import init_device_mesh

        axes = self.enabled_axes()
        if not axes:
            return None
        root = init_device_mesh(device_type, tuple(getattr(self, a) for a in axes), mesh_dim_names=tuple(axes))
        batch = None
        if self.dp_replicate > 1 and self.dp_shard > 1:
            # Keep the flattened view itself: slicing it back out of the root mesh is deprecated.
            batch = root["dp_replicate", "dp_shard"]._flatten("dp")
        elif self.dp > 1:
            batch = root["dp_replicate" if self.dp_replicate > 1 else "dp_shard"]
        from shardwise.parallel.expert import build_expert_mesh

        expert = build_expert_mesh(self, device_type)
        if self.cp == 1:
            return Meshes(root, batch, expert=expert)
        # CP ranks hold the same weights but see other tokens: gradients are averaged over
        # dp_replicate x dp_shard x cp and model states sharded over dp_shard x cp (torchtitan's
        # "dp_cp" / "dp_shard_cp"). A flattened view of one non-trivial axis is that axis (DeviceMesh
        # returns the same group), and it keeps that axis's name, as the planner does (plan/comm.py).
        shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp") if self.dp_shard > 1 else root["cp"]
        if self.dp_replicate == 1:
            grad = shard_cp
        else:
            grad = root[tuple(a for a in ("dp_replicate", "dp_shard", "cp") if getattr(self, a) > 1)]._flatten("dp_cp")
        # HSDP with CP: FSDP2's 2-D mesh (replicate, shard) with the shard dim over dp_shard x cp.
        # With dp_shard > 1 this slices the flattened dim back out of the root mesh, which torch
        # warns will be deprecated; it reuses the existing groups (a fresh 2-D DeviceMesh would
        # create new communicators). Parity: tests/parity/matrix.py cp2_hsdp_2x2_zero3.
        hsdp = root["dp_replicate", shard_cp.mesh_dim_names[0]] if self.dp_replicate > 1 else None
        return Meshes(root, batch, grad, shard_cp, hsdp, expert)


@dataclass(frozen=True)
class Meshes:
    """The root mesh (index it by axis names) and the 1-D batch view over dp_replicate x dp_shard:
    the ranks that read different data (None when there is one such rank). With cp > 1 also the
    gradient view `dp_cp` (dp_replicate x dp_shard x cp: gradient and loss averaging), the sharding
    view `dp_shard_cp` (dp_shard x cp: FSDP / ZeRO-1) and, with dp_replicate > 1, `hsdp_cp`, the
    2-D (dp_replicate, dp_shard_cp) mesh of HSDP; all None when cp == 1."""

    root: object
    batch: object | None
    dp_cp: object | None = None
    dp_shard_cp: object | None = None
    hsdp_cp: object | None = None
    expert: object | None = None  # the (efsdp, ep) expert mesh (parallel/expert.py); None without EP

    def __getitem__(self, names):
        return self.root[names]


def refuse_unimplemented(dims: ParallelDims) -> None:
    """Axes whose training lands in later milestones are refused before anything is spawned."""
    for axis in NOT_YET_TRAINABLE:
        size = getattr(dims, axis)
        if size > 1:
            raise ConfigError(f"parallel.{axis}", f"{axis}={size} is not implemented yet in this version of shardwise",
                              f"set parallel.{axis}=1 (use the data-parallel axes dp_replicate / dp_shard)")

