"""What grows with scale (issue 60): the terms of a step whose cost depends on how many ranks and nodes
a collective spans, each with its source.

1. NCCL's algorithm and its latency, by collective and node count, as NCCL's own tuning model prices it
   (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel; NCCL_ALGO in the NCCL user guide's environment
   variables):
     ring        (n-1) steps for all-gather / reduce-scatter, 2(n-1) for all-reduce: the k-1 (2(k-1))
                 steps that cross a node boundary at the network's latency, the others at NVLink's
                 (at least the network's per-step post overhead once the ring spans nodes);
     tree        all-reduce only (double binary trees, NCCL 2.4; Sanders et al. 2009): 2((g-1) intra +
                 log2(k) inter), where NCCL picks it over the ring as soon as the ring's latency is larger
                 at the same bus bandwidth (the NCCL 2.4 announcement: full bandwidth, log latency);
     PAT         all-gather / reduce-scatter with one rank per node (NCCL 2.23+): log2(k) inter steps.
   NVLS / CollNet need NVSwitch multicast / SHARP switches the cluster keys do not describe: not priced.
   Inside one node the latency stays constants.LATENCY_INTRA_S x log2(n) (small messages: LL protocol).
   Bandwidth stays plan/collective_time.py's hierarchical model (busbw = link x BUS_FRACTION_*).
2. The data-parallel reduction's exposure under Megatron-Core's distributed optimizer
   (cluster.grad_reduce = "distributed_optimizer": --use-distributed-optimizer --overlap-grad-reduce
   --overlap-param-gather; Megatron-Core docs, "Distributed Optimizer" and DistributedDataParallelConfig):
   the gradients are reduce-scattered bucket by bucket as the last micro-batch's backward produces them
   (under pipeline parallelism too: only the first stage keeps buckets, its DP traffic being the one on
   the critical path — megatron/core/distributed), and the updated parameters are all-gathered bucket by
   bucket during the next step's first forward. Exposed: what does not fit in that backward / forward,
   and at least one bucket each. A bucket holds max(40M, 1M x dp) parameters (DistributedDataParallelConfig
   bucket_size's documented default). When compute per GPU shrinks (strong scaling) these windows shrink
   with it, so the exposure grows with the GPU count at a fixed global batch.
3. The slowest rank: a synchronous step waits for its slowest GPU at every data-parallel sync, so its
   compute runs at the pace of the slowest of the job's N GPUs. Same-SKU GPUs of one cluster differ in speed
   on the same work (power management, manufacturing variability): Sinha et al. 2022, "Not All GPUs Are
   Created Equal" (SC22, arXiv 2208.11035), measured an 8% average spread (max 22%) between GPUs of a
   cluster over >90% of the GPUs of five clusters. Read as the range of ~1,000 normal draws (2 x 3.24
   sigma), that is a sigma of 1.2% of a GPU's compute time (GPU_SPEED_SIGMA; derived from the paper, not
   fitted to any published step). The expected slowest of N is sigma x E[max of N standard normals]
   (Blom 1958: inv_cdf((N - 0.375) / (N + 0.25)); ~ sqrt(2 ln N) for large N): 0 on one GPU, +1.7% of
   the compute on 8, +3.9% on 1,024, +4.5% on 16,384.
4. Compute beside a collective runs slower. The planner hides a collective behind compute (FSDP's
   prefetched gathers and reduce-scatters, DDP's buckets, the distributed optimizer, the CP ring), but an
   NCCL kernel holds SMs (one thread block per channel) and HBM bandwidth while it runs, so the GEMMs beside
   it lose them. Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated
   Distributed Deep Learning" (arXiv 2507.03114), measured GPT and LLaMA training on 4 A100s, H100s,
   MI250s and MI210s: overlapped compute ran 18.9% slower on average than alone (at most 40%). That is
   what an SM count predicts on an H100: an NCCL all-gather launched 24 blocks beside a GEMM on its 132
   SMs (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance Degradation
   because of Tail Effect", 2025), 18.2%. So every second of collective that runs beside compute adds
   OVERLAP_COMPUTE_SLOWDOWN of a second of compute (up to the compute there is). It grows with scale
   because the hidden collectives do: a data-parallel reduction keeps its size per GPU while the compute
   beside it shrinks (strong scaling), and a group across nodes runs longer at the network's bandwidth.
   Not fitted to any published step. A CPU's gloo collectives (threads, not SMs) are not priced unless
   measured: `shardwise bench-comm` times a GEMM loop alone and beside its all-reduces, and its file
   (cluster.calibration) replaces the constant, on a GPU or a CPU.
"""
from __future__ import annotations

import math
from statistics import NormalDist

from shardwise.plan import constants as C

# Megatron-Core DistributedDataParallelConfig.bucket_size default: max(40,000,000, 1,000,000 x dp) parameters
# ("larger DP sizes need larger buckets to ensure collectives do not become latency-bound").
MEGATRON_BUCKET_MIN_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP_RANK = 1_000_000
# NCCL tuning.cc: once a ring spans nodes its NVLink steps cost at least the network's per-step overhead
# (getNetOverhead, 1 us on most hosts), x3 for the Simple protocol large messages use (send, recv, ack).
NCCL_NET_OVERHEAD_S = 3e-6
# Spread of GPU speed within a cluster, one sigma, as a fraction of compute time (module doc, item 3).
GPU_SPEED_SIGMA = 0.012
# How much slower compute runs beside a collective than alone (module doc, item 4: Lee et al. 2025's mean).
OVERLAP_COMPUTE_SLOWDOWN = 0.189


def expected_max_normal(n: int) -> float:
    """E[max of n standard normal draws], Blom's approximation (0 for one draw)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def slowest_rank_fraction(num_gpus: int) -> float:
    """How much longer the slowest of `num_gpus` GPUs computes than a typical one (module doc, item 3)."""
    return GPU_SPEED_SIGMA * expected_max_normal(num_gpus)


def overlap_slowdown(cluster) -> float:
    """How much slower compute runs beside a collective (module doc, item 4): `shardwise bench-comm`'s
    measurement when cluster.calibration has one, else OVERLAP_COMPUTE_SLOWDOWN on a GPU and none on a CPU."""
    if cluster.overlap_slowdown is not None:
        return cluster.overlap_slowdown
    return 0.0 if cluster.device_is_host else OVERLAP_COMPUTE_SLOWDOWN


def overlap_contention(cluster, beside_s: float, compute_s: float) -> float:
    """Seconds a step's compute loses to the `beside_s` seconds of collectives that run beside it, out of
    `compute_s` of compute (module doc, item 4)."""
    return overlap_slowdown(cluster) * min(max(0.0, beside_s), compute_s)


def megatron_bucket_params(dp: int) -> int:
    """Parameters per gradient / parameter bucket of Megatron-Core's DDP at data-parallel size `dp`."""
    return max(MEGATRON_BUCKET_MIN_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP_RANK * dp)


def nccl_algorithm(kind: str, per_node: int, nodes: int) -> str:
    """The algorithm NCCL runs `kind` with on a group of `per_node` ranks x `nodes` nodes (module doc)."""
    if kind == "all_reduce":
        return "tree" if nodes > 1 else "ring"
    if kind in ("all_gather", "reduce_scatter"):
        return "pat" if per_node == 1 and nodes > 1 else "ring"
    return "ring"


def bus_bandwidth(cluster) -> tuple[float, float]:
    """Bytes/s of bus bandwidth a collective reaches inside a node (NVLink) and between nodes (one NIC per
    GPU): the links' rates times the fraction nccl-tests reach (plan/constants.py)."""
    return cluster.intra_gbps * 1e9 * C.BUS_FRACTION_INTRA, cluster.inter_gbps * 1e9 * C.BUS_FRACTION_INTER


def nccl_latency(kind: str, per_node: int, nodes: int, intra_s: float, inter_s: float) -> tuple[float, str]:
    """(latency seconds of one call, algorithm) of an all-reduce / all-gather / reduce-scatter on `per_node`
    x `nodes` ranks, NCCL's tuning model (module doc): per-step latencies intra_s (NVLink) and inter_s
    (network)."""
    g, k = per_node, nodes
    n = g * k
    if n <= 1:
        return 0.0, "none"
    algo = nccl_algorithm(kind, g, k)
    if k == 1:
        # Inside one node small messages take NCCL's LL protocol (and NVLS on NVSwitch systems), whose
        # latencies constants.LATENCY_INTRA_S's log2(n) hops stand for (~10 us for an all-reduce on a DGX);
        # the ring's per-step latency below is what grows once the group spans nodes.
        return (2 if kind == "all_reduce" else 1) * math.ceil(math.log2(n)) * intra_s, f"{algo}, LL latency"
    if algo == "tree":
        return 2 * ((g - 1) * intra_s + math.ceil(math.log2(k)) * inter_s), algo
    if algo == "pat":
        return math.ceil(math.log2(k)) * inter_s, algo
    steps = (2 if kind == "all_reduce" else 1) * (n - 1)
    inter_steps = (2 if kind == "all_reduce" else 1) * (k - 1)
    intra = max(intra_s, NCCL_NET_OVERHEAD_S) if k > 1 else intra_s
    return (steps - inter_steps) * intra + inter_steps * inter_s, algo


def overlapped_exposure(total_s: float, bucket_s: float, window_s: float, pp: int = 1, chunks: int = 1) -> float:
    """Seconds of a bucketed collective not hidden in the compute of one micro-batch's pass (`window_s`: the
    last backward for the gradients, the first forward for the parameters), at least one bucket (the last
    gradient bucket / the first parameter bucket waits for nothing).

    Under an interleaved pipeline (`chunks` model chunks per rank) the data-parallel traffic goes chunk by
    chunk (NeMo's performance guide: "the granularity of DP communication becomes the Transformer layers
    per virtual pipeline stage"): a chunk's gradients are ready `pp` chunk-backwards before the next
    chunk's (the cool-down runs pp micro-batches per chunk), so the chunks queue behind each other when one
    chunk's collective outlasts that spacing. Exposed: the last chunk's own (as above, in its own pass) plus
    the queue's backlog, (chunks - 1) x max(0, per chunk - spacing)."""
    if total_s <= 0:
        return 0.0
    v = max(1, chunks)
    per_chunk, own_pass = total_s / v, window_s / v
    last = max(min(bucket_s, per_chunk), per_chunk - own_pass)
    return last + (v - 1) * max(0.0, per_chunk - pp * own_pass)


# ---------------------------------------------------------------------------------------------------
# what `plan evaluate` shows of these terms (issue 60 item 4)
# ---------------------------------------------------------------------------------------------------
AXIS_KINDS = {"tp": "all_reduce", "cp": "all_gather", "ep": "all_to_all", "pp": "send"}


def scale_terms(problem, est) -> dict:
    """Per mesh axis of size > 1: how it is placed (ranks per node x nodes), the algorithm NCCL runs its
    main collectives with, the bus bandwidth and per-call latency assumed (or measured: cluster.calibration);
    and the slowest-GPU allowance and the distributed optimizer's exposure when priced."""
    from shardwise.plan.fabric import axis_tapers, pattern_of
    from shardwise.plan.layout import axis_groups, axis_placement

    cl, lay = problem.cluster, est.layout
    place = axis_placement(lay, cl.gpus_per_node)
    fabric = axis_tapers(axis_groups(lay), cl)
    axes = {}
    for axis in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        g, k = place[axis]
        tapers = fabric.get(axis, {})
        if g * k <= 1:
            continue
        cal = cl.measured(axis) if cl.calibration else None
        kinds = ("send",) if axis == "pp" else ("all_reduce", "reduce_scatter") if axis.startswith("dp") else (AXIS_KINDS[axis],)
        entry = {"ranks_per_node": g, "nodes": k}
        if cal is not None:
            entry.update(measured=True, bus_gbps=cal.bus_bytes_per_s / 1e9, hop_latency_us=cal.hop_latency_s * 1e6)
        else:
            entry["bus_gbps"] = bus_bandwidth(cl)[1 if k > 1 else 0] / 1e9
            for kind in kinds:
                if kind in ("all_reduce", "all_gather", "reduce_scatter"):
                    lat, algo = nccl_latency(kind, g, k, cl.intra_latency_s, cl.inter_latency_s)
                    entry[kind] = {"algorithm": algo, "latency_us": lat * 1e6}
            # cp's ring attention sends K/V rank to rank besides its gathers (Ulysses: all-to-all)
            used = {pattern_of(axis, kind) for kind in kinds} | ({"p2p_ring", "all_to_all"} if axis == "cp" else set())
            slowed = {pat: t for pat, t in tapers.items() if t > 1 and pat in used}
            if slowed:
                entry["pod_taper"] = slowed
        axes[axis] = entry
    out = {"axes": axes, "fabric": {"nodes_per_pod": cl.nodes_per_pod, "oversubscription": cl.oversubscription},
           "slowest_rank": {"gpus": cl.num_gpus, "sigma": GPU_SPEED_SIGMA,
                                          "fraction": slowest_rank_fraction(cl.num_gpus),
                                          "seconds": est.breakdown_s.get("slowest_rank", 0.0)},
           "overlap_contention": {"slowdown": overlap_slowdown(cl), "measured": cl.overlap_slowdown is not None,
                                  "comm_beside_compute_s": est.detail.get("comm_beside_compute_s", 0.0),
                                  "seconds": est.breakdown_s.get("overlap_contention", 0.0)}}
    if "dp_reduce_scatter_s" in est.detail:
        out["distributed_optimizer"] = {"reduce_scatter_s": est.detail["dp_reduce_scatter_s"],
                                        "param_gather_s": est.detail.get("dp_param_gather_s", 0.0)}
    return out


def scale_lines(problem, est) -> list[str]:
    """`plan evaluate`'s lines on what grows with scale (`scale_terms`)."""
    terms = scale_terms(problem, est)
    lines = []
    for axis, e in terms["axes"].items():
        where = f"{e['ranks_per_node']} per node x {e['nodes']} node{'s' if e['nodes'] > 1 else ''}"
        if e.get("measured"):
            lines.append(f"  {axis}: {where}, measured {e['bus_gbps']:.0f} GB/s busbw, {e['hop_latency_us']:.1f} us per hop")
            continue
        algos = ", ".join(f"{k.replace('_', '-')} {v['algorithm']} ({v['latency_us']:.0f} us/call)"
                          for k, v in e.items() if isinstance(v, dict) and "algorithm" in v)
        taper = ", ".join(f"{pat.replace('_', '-')} x{t:.2f}" for pat, t in e.get("pod_taper", {}).items())
        lines.append(f"  {axis}: {where}, busbw {e['bus_gbps']:.0f} GB/s" + (f"; {algos}" if algos else "")
                     + (f"; leaves its pod: network time {taper}" if taper else ""))
    f = terms["fabric"]
    if f["nodes_per_pod"] and f["oversubscription"] > 1:
        lines.insert(0, f"  fabric: pods of {f['nodes_per_pod']:,} nodes, {f['oversubscription']:g}:1 between pods "
                        "(plan/fabric.py)")
    s = terms["slowest_rank"]
    lines.append(f"  slowest GPU of {s['gpus']:,}: +{s['fraction']:.1%} of the compute ({s['seconds']:.3g} s; "
                 f"GPU speed sigma {s['sigma']:.1%}, plan/scale.py)")
    o = terms["overlap_contention"]
    if o["comm_beside_compute_s"] > 0:
        lines.append(f"  compute beside hidden comm: {o['comm_beside_compute_s']:.3g} s of collectives run beside compute, "
                     f"which runs {o['slowdown']:.1%} slower there ({'measured' if o['measured'] else 'plan/scale.py'}): "
                     f"+{o['seconds']:.3g} s")
    if "distributed_optimizer" in terms:
        d = terms["distributed_optimizer"]
        lines.append(f"  distributed optimizer: reduce-scatter {d['reduce_scatter_s']:.3g} s, all-gather "
                     f"{d['param_gather_s']:.3g} s per step, overlapped (the exposed part is in dp comm)")
    return ["what grows with scale (NCCL algorithm and bus bandwidth per axis, the fabric's taper, the slowest GPU, "
            "compute beside hidden comm):", *lines]
