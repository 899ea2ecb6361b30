"""What a collective costs: the Collective record plan/comm.py lists (payload, calls, phase), the wire
bytes one rank sends with the ring algorithms (Thakur et al. 2005; Patarasuk & Yuan 2009), and the
seconds of a call on a group placed over `per_node` ranks x `nodes` nodes — from the datasheet links
(constants.BUS_FRACTION_*, LATENCY_*_S), slowed where the fabric's pods are oversubscribed
(plan/fabric.py), or a `shardwise bench-comm` measurement (cluster.calibration).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from shardwise.plan.calibration import AxisCalibration
from shardwise.plan.fabric import axis_tapers, pattern_of
from shardwise.plan.layout import Cluster, axis_groups, axis_placement
from shardwise.plan.scale import bus_bandwidth, nccl_latency
from shardwise.spec.layout import Layout

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send", "recv")


class Collective(NamedTuple):
    """`calls` calls of one collective of `payload` bytes each on `axis`. `phase` tells the time model
    how it overlaps: fwd / bwd (per micro-batch, inside the compute), recompute, grad (the gradient
    sync that overlaps the last backward), step (after the backward: exposed), p2p."""

    axis: str
    kind: str
    payload: float
    calls: float
    phase: str
    unit: str = ""  # what it moves ("block", "root", "grads", ...), for the FSDP overlap rule

    @property
    def total(self) -> float:
        return self.payload * self.calls


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one rank sends for one call with the ring algorithms: all_reduce 2(n-1)/n S; all_gather
    and reduce_scatter (n-1)/n S; all_to_all (n-1)/n S; broadcast (pipelined ring) and send S."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * payload
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload
    if kind == "recv":
        return 0.0
    return float(payload)


def collective_time(kind: str, payload: float, per_node: int, nodes: int, cluster: Cluster, taper: float = 1.0) -> float:
    """Seconds for one call on a group with `per_node` ranks in each of `nodes` nodes.

    Hierarchical (two-level) algorithms: the intra-node part moves its ring share over NVLink, the
    inter-node part moves 1/per_node of the buffer per GPU over that GPU's own NIC (NCCL rings /
    trees span nodes with one NIC per GPU; 2D schemes as Mikami et al. 2018, arXiv 1811.05233). The
    latency of an all-reduce / all-gather / reduce-scatter is that of the algorithm NCCL picks for the
    node count (plan/scale.py: ring steps, tree or PAT depth); the others, log2(n) hops at the slowest
    level's per-hop latency. `taper` (plan/fabric.py) stretches the network part where the group's flows
    leave an oversubscribed pod faster than its uplinks carry them.
    """
    n = per_node * nodes
    if n <= 1 or payload <= 0:
        return 0.0
    b_intra, b_inter = bus_bandwidth(cluster)
    b_inter /= taper
    g, k = per_node, nodes
    alpha = cluster.inter_latency_s if k > 1 else cluster.intra_latency_s
    if kind in ("send", "recv"):
        return payload / (b_inter if k > 1 else b_intra) + alpha
    hops = math.ceil(math.log2(n))
    if kind in ("all_reduce", "all_gather", "reduce_scatter"):
        # Ring wire bytes inside the node over NVLink, then between nodes for this GPU's 1/g share.
        t = wire_bytes(kind, payload, g) / b_intra + wire_bytes(kind, payload / g, k) / b_inter
        return t + nccl_latency(kind, g, k, cluster.intra_latency_s, cluster.inter_latency_s)[0]
    if kind == "all_to_all":
        return (g - 1) / n * payload / b_intra + (n - g) / n * payload / b_inter + hops * alpha
    if kind in ("broadcast", "reduce"):
        # Pipelined chain / ring broadcast: each rank forwards the whole buffer once. A reduce (2-D TP's
        # SUMMA, plan/tp2d.py) is the same chain run backwards (NCCL runs both as rings), so it is timed
        # as a broadcast of its payload.
        return payload / (b_inter if k > 1 else b_intra) + hops * alpha
    raise ValueError(f"unknown collective kind {kind!r}")


def measured_time(kind: str, payload: float, n: int, cal: AxisCalibration) -> float:
    """Seconds for one call on an axis `shardwise bench-comm` measured (cluster.calibration): the same
    ring wire bytes and log2(n) hops as `collective_time`, over the measured bus bandwidth and per-hop
    latency instead of link x BUS_FRACTION and LATENCY_*_S. busbw already folds in whatever topology
    the axis had (nccl-tests doc/PERFORMANCE.md), so there is no intra / inter split."""
    if n <= 1 or payload <= 0:
        return 0.0
    if kind in ("send", "recv"):
        return payload / cal.bus_bytes_per_s + cal.hop_latency_s
    wire = payload if kind in ("broadcast", "reduce") else wire_bytes(kind, payload, n)
    return wire / cal.bus_bytes_per_s + (2 if kind == "all_reduce" else 1) * math.ceil(math.log2(n)) * cal.hop_latency_s


class Place(NamedTuple):
    """Where one group of a mesh axis sits: ranks per node, nodes spanned, and the fabric's taper of each
    flow pattern (plan/fabric.py; empty = not slowed)."""

    per_node: int
    nodes: int
    tapers: dict[str, float]

    def taper(self, axis: str, kind: str) -> float:
        return self.tapers.get(pattern_of(axis, kind), 1.0)


def placements(lay: Layout, cluster: Cluster) -> dict[str, Place]:
    groups = axis_groups(lay)
    tapers = axis_tapers(groups, cluster)
    return {axis: Place(g, k, tapers.get(axis, {})) for axis, (g, k) in axis_placement(lay, cluster.gpus_per_node).items()}


def time_of(c: Collective, place: dict[str, Place], cluster: Cluster, calls: float | None = None) -> float:
    """Seconds for `calls` (default: all) calls of collective `c`."""
    p = place[c.axis]
    n_calls = c.calls if calls is None else calls
    cal = cluster.measured(c.axis) if cluster.calibration else None
    if cal is not None:
        return measured_time(c.kind, c.payload, 2 if c.axis == "pp" else p.per_node * p.nodes, cal) * n_calls
    taper = p.taper(c.axis, c.kind)
    if c.axis == "pp":
        one = collective_time(c.kind, c.payload, 1, 2, cluster, taper) if p.nodes > 1 else \
            collective_time(c.kind, c.payload, 2, 1, cluster)
        return one * n_calls
    return collective_time(c.kind, c.payload, p.per_node, p.nodes, cluster, taper) * n_calls
