"""The scale-out fabric above the nodes (issue 60 item 1): pods under a non-blocking tier, oversubscribed
uplinks between them, and how much of a collective's network time that taper costs.

A large GPU fabric is a fat tree whose lower tiers are non-blocking over a block of nodes and whose top
tier may be tapered. `cluster.nodes_per_pod` is that block, `cluster.oversubscription` the taper: a
pod's injection bandwidth (its GPUs' NICs) over its uplinks toward the other pods.
  - NVIDIA DGX SuperPOD (H100 reference architecture): scalable units of 32 nodes on rail-optimised
    leaves, spines non-blocking: one pod of the whole cluster, 1:1 (the default: nodes_per_pod 0).
  - Meta's two 24,576-GPU H100 clusters (Llama 3 paper, arXiv 2407.21783 §3.3.1; Gangidi et al.,
    SIGCOMM 2024): pods of 3,072 GPUs (384 nodes) non-blocking inside, 1:7 between pods:
    --cluster.nodes_per_pod=384 --cluster.oversubscription=7.
Rail-optimised or not, a non-blocking tier gives every flow its NIC's rate, so the model needs only the
tier that is tapered. NCCL keeps its rings and trees rail-aligned (PXN: the hop to the right rail goes
over NVLink), so a flow is one NIC's rate on one rail.

What a taper costs depends on how many flows leave a pod at once, counted exactly over every group of
the axis (ranks row-major over the mesh, plan/layout.py axis_groups; pods are consecutive nodes):
  ring   (all-reduce / all-gather / reduce-scatter: the bandwidth term is the hierarchical ring's,
         plan/collective_time.py; NCCL's trees leave a pod by as few edges) — a group that spans q > 1
         pods leaves each of them once per inter-node ring, and there are `per_node` such rings (one
         per local member's NIC);
  chain  (pipeline send / recv) — a stage boundary between pods is one flow per group each way,
         forward out of the lower pod and backward out of the upper one (one GPU's NIC, one flow at a
         time, when the pod holds a single stage of the group);
  p2p ring (context parallelism's ring attention: each rank sends its K/V to the next) — one flow out of
         each pod the group spans, whatever its members per node;
  all-to-all — each member sends to every other member alike: the share of its network bytes bound
         for members outside its pod leaves the pod.
The pod's uplinks carry its GPUs' NIC rate / oversubscription (a pod the job fills only partly: the share
its GPUs inject, other jobs using the rest); when the flows leaving the worst pod
want more, every one of them slows by that ratio (the collective ends with its last byte), so the
network part of the call takes `taper` = max(1, demand / uplink capacity) times longer. Latency is
unchanged. Nothing here is fitted: a ring whose groups keep at least `oversubscription` nodes in
each pod is not slowed at all (its flows cross the pod boundary once), a strided pipeline across
pods is.
A bench-comm measurement of an axis (cluster.calibration) already holds the fabric it ran on and is
not tapered again.
"""
from __future__ import annotations

from functools import lru_cache

PATTERNS = ("ring", "chain", "p2p_ring", "all_to_all")


def pattern_of(axis: str, kind: str) -> str:
    """The flow pattern a collective `kind` on mesh axis `axis` puts on the fabric (module doc)."""
    if axis == "pp":
        return "chain"
    if kind in ("send", "recv"):
        return "p2p_ring"
    return "all_to_all" if kind == "all_to_all" else "ring"


def _members_in(base: int, stride: int, n: int, lo: int, hi: int) -> int:
    """How many of base, base + stride, ..., base + (n-1) stride lie in [lo, hi)."""
    first = max(0, -((base - lo) // stride))       # ceil((lo - base) / stride), at least 0
    last = min(n - 1, (hi - 1 - base) // stride)
    return max(0, last - first + 1)


def _non_blocking(num_gpus: int, pod_gpus: int, oversubscription: float) -> bool:
    """Whether the job sees one non-blocking fabric: no pods, no taper, or all of it inside one pod."""
    return pod_gpus <= 0 or oversubscription <= 1 or num_gpus <= pod_gpus


@lru_cache(maxsize=1 << 12)
def pod_tapers(n: int, stride: int, gpus_per_node: int, num_gpus: int, pod_gpus: int,
               oversubscription: float) -> dict[str, float]:
    """For each flow pattern (PATTERNS), how many times longer the network part of one collective takes on
    groups of `n` ranks `stride` apart, `num_gpus` ranks in pods of `pod_gpus` (module doc); 1 = not
    slowed. One pass over the groups counts every pattern's flows."""
    block = n * stride
    if n <= 1 or _non_blocking(num_gpus, pod_gpus, oversubscription) or (block <= pod_gpus and pod_gpus % block == 0):
        return dict.fromkeys(PATTERNS, 1.0)          # (the last: every group lies inside one pod)
    per_node = max(1, min(n, gpus_per_node // stride)) if stride < gpus_per_node else 1
    pods = -(-num_gpus // pod_gpus)
    # per pattern and pod: flows out of it (ring, chain, p2p ring) or NIC-rate shares (all-to-all)
    leaving = {pat: [0.0] * pods for pat in PATTERNS}
    for high in range(0, num_gpus, block):
        for low in range(stride):
            base = high + low
            first, last = base // pod_gpus, (base + (n - 1) * stride) // pod_gpus
            if first == last:
                continue
            for p in range(first, last + 1):
                inside = _members_in(base, stride, n, p * pod_gpus, (p + 1) * pod_gpus)
                if not inside:
                    continue
                leaving["ring"][p] += per_node
                leaving["p2p_ring"][p] += 1
                # forward out of the pod's last stage, backward out of its first: one GPU sends both (one
                # after the other) when the pod holds one stage of the group
                leaving["chain"][p] += min(inside, (p < last) + (p > first))
                leaving["all_to_all"][p] += inside * (n - inside) / max(1, n - per_node)
    size = [min(pod_gpus, num_gpus - p * pod_gpus) for p in range(pods)]
    return {pat: max(1.0, oversubscription * max(out[p] / size[p] for p in range(pods))) for pat, out in leaving.items()}


def pod_taper(pattern: str, n: int, stride: int, gpus_per_node: int, num_gpus: int, pod_gpus: int,
              oversubscription: float) -> float:
    """`pod_tapers` of one pattern."""
    return pod_tapers(n, stride, gpus_per_node, num_gpus, pod_gpus, oversubscription)[pattern]


def axis_tapers(groups: dict[str, tuple[int, int]], cluster) -> dict[str, dict[str, float]]:
    """Per mesh axis ({axis: (group size, stride)}, plan/layout.py axis_groups): the taper of each flow
    pattern; empty when the cluster is one non-blocking fabric."""
    pod_gpus = cluster.nodes_per_pod * cluster.gpus_per_node
    if _non_blocking(cluster.num_gpus, pod_gpus, cluster.oversubscription):
        return {}
    out = {}
    for axis, (n, stride) in groups.items():
        tapers = pod_tapers(n, stride, cluster.gpus_per_node, cluster.num_gpus, pod_gpus, cluster.oversubscription)
        if any(t > 1 for t in tapers.values()):
            out[axis] = tapers
    return out
