"""Gradient compression priced (parallel.grad_compression; the hooks: parallel/grad_compression.py).

Bytes on the wire: the payload of every data-parallel gradient collective per rank and optimizer step
(the counter's convention, parallel/comm_counter.py), for n fp32 gradient entries of this rank over a
batch group of w ranks, against the uncompressed all_reduce of 4n:

  none      all_reduce 4n
  bf16      all_reduce 2n                                                     ratio 1/2
  int8      all_gather of every rank's [int8 entries | fp32 scale per 1024 of each tensor]:
            w (n + 4 S), S = sum over tensors of ceil(n_t / 1024)             ratio w (1 + 4S/n) / 4
  topk      all_gather of every rank's k = sum over tensors of ceil(ratio n_t) (fp32 value, int32 index):
            w 8 k                                                             ratio ~ 2 w ratio
  powersgd  all_reduce of the uncompressed tensors U (1-D ones, and matrices that would not shrink by
            torch's min_compression_rate 2), of P and of Q: 4 (U + sum r'(rows + cols)) over matrices
            viewed as (shape[0], rest), r' = min(rows, cols, powersgd_rank)
            (Vogels et al. 2019, arXiv 1905.13727: rank r' x (rows + cols) / (rows x cols) per matrix)

Payload ratios of an all_gather overstate what it costs against an all_reduce: a ring all_gather puts
(w-1)/w of its payload on each link, an all_reduce 2(w-1)/w (plan/comm.py wire_bytes), so int8 sends
w (1 + 4S/n) / 8 and topk w ratio of the uncompressed wire bytes: gathering grows with w, and int8
stops paying at w = 8 (a reduce-scatter of int8 cannot sum without overflow; the hook's docstring).
The time model (plan/comm.py time_of) prices the wire bytes, so the planner shows that.

Compute (encode / decode, memory bound at the device's HBM bandwidth; PowerSGD's GEMMs at peak):
  bf16      cast, divide, cast back: 12 n bytes
  int8      add residual, absmax, quantize, keep residual: 21 n; dequantize + add w copies: 9 w n
  topk      add residual, select, keep residual: 20 n; scatter-add w k pairs and copy back: 8 n + 12 w k
  powersgd  error feedback 16 n; P = M Q, Q = M^T P, M = P Q^T: 3 reads and 6 rows cols r' FLOPs per
            matrix; Gram-Schmidt of P and Q: 2 r'^2 (rows + cols) FLOPs
Torch-free; plan/comm.py calls `compress_collectives`, plan/cost.py `compression_seconds`.
"""
from __future__ import annotations

from typing import Any

from shardwise.plan.inventory import RankModel, local_shape, rank_params
from shardwise.spec.compression import TOPK_ENTRY_BYTES, int8_chunks, powersgd_elements, topk_count
from shardwise.spec.layout import Layout


def hooked(lay: Layout) -> bool:
    """int8 / topk / powersgd run only on DDP's hooks (spec/rules.py grad_compression_rules)."""
    return lay.wrapper == "ddp"


def powersgd_split(shape: Any, rank: RankModel, r: int) -> tuple[int, int, int, list[tuple[int, int, int]]]:
    """(uncompressed entries, P entries, Q entries, [(rows, cols, r')] of compressed matrices) of the
    whole-model gradients a DDP rank holds (DDP: no tp / ep split)."""
    u = p = q = 0
    matrices = []
    for spec, copies, _ in rank_params(shape, rank):
        s = local_shape(spec, shape, 1, 1)
        eu, ep, eq = powersgd_elements(s, r)
        u, p, q = u + copies * eu, p + copies * ep, q + copies * eq
        if ep:
            rows, r_eff = s[0], ep // s[0]
            matrices += [(rows, eq // r_eff, r_eff)] * copies
    return u, p, q, matrices


def _sizes(shape: Any, rank: RankModel) -> list[int]:
    """Entries of every gradient tensor a DDP rank holds (whole model: no tp / ep split)."""
    return [spec.numel for spec, copies, _ in rank_params(shape, rank) for _ in range(copies)]


def compressed_payloads(lay: Layout, n: int, shape: Any, rank: RankModel) -> list[tuple[str, float]]:
    """[(kind, payload bytes)] of the gradient sync of n fp32 entries per rank under lay.grad_compression
    (the closed forms of the module doc; int8's chunks and topk's k count per parameter, as the hook)."""
    method, w = lay.grad_compression, lay.dp * lay.cp
    if method == "bf16":
        return [("all_reduce", 2.0 * n)]
    if method == "int8":
        return [("all_gather", float(w * (n + 4 * sum(int8_chunks(k) for k in _sizes(shape, rank)))))]
    if method == "topk":
        kept = sum(topk_count(k, lay.grad_compression_ratio) for k in _sizes(shape, rank))
        return [("all_gather", float(w * TOPK_ENTRY_BYTES * kept))]
    if method == "powersgd":
        u, p, q, _ = powersgd_split(shape, rank, lay.powersgd_rank)
        return [("all_reduce", 4.0 * u), ("all_reduce", 4.0 * p), ("all_reduce", 4.0 * q)]
    return [("all_reduce", 4.0 * n)]


def compress_collectives(collectives: list, problem: Any, lay: Layout, rank: RankModel) -> list:
    """plan/comm.py's data-parallel collectives with lay.grad_compression applied: DDP's gradient
    all_reduce becomes the method's collectives; under FSDP2 / replicate bf16 halves the gradient
    reduce-scatters and all-reduces (reduce_dtype). `collectives` are plan/comm.py Collectives
    (NamedTuples, changed with _replace: no import back into comm.py)."""
    if lay.grad_compression == "none":
        return collectives
    out = []
    for c in collectives:
        grad_sync = c.phase == "grad" and c.kind in ("all_reduce", "reduce_scatter")
        if not grad_sync:
            out.append(c)
        elif hooked(lay) and c.kind == "all_reduce":
            n = round(c.payload / (2 if problem.model_states == "mixed" and problem.low_precision else 4))
            out += [c._replace(kind=kind, payload=payload) for kind, payload in
                    compressed_payloads(lay, n, problem.shape, rank) if payload > 0]
        elif lay.grad_compression == "bf16" and not (problem.model_states == "mixed" and problem.low_precision):
            out.append(c._replace(payload=c.payload / 2))
        else:  # refused for this wrapper (spec/rules.py, trainer_only): priced uncompressed
            out.append(c)
    return out


def compression_seconds(problem: Any, lay: Layout, rank: RankModel) -> float:
    """Encode + decode time of one step's gradient sync on this rank (module doc), 0 for none."""
    method, w = lay.grad_compression, lay.dp * lay.cp
    if method == "none" or w <= 1 or (method != "bf16" and not hooked(lay)):
        return 0.0
    n = sum(copies * spec.numel for spec, copies, _ in rank_params(problem.shape, rank))
    if lay.fsdp:  # bf16 on a reduce-scatter: the cast passes run over the unsharded gradients too
        n = n // max(1, lay.tp)
    dev = problem.cluster.device
    bw = dev.memory_bandwidth_gbps * 1e9
    if method == "bf16":
        return 12.0 * n / bw
    if method == "int8":
        return (21.0 + 9.0 * w) * n / bw
    if method == "topk":
        k = sum(topk_count(t, lay.grad_compression_ratio) for t in _sizes(problem.shape, rank))
        return (28.0 * n + 12.0 * w * k) / bw
    _, _, _, matrices = powersgd_split(problem.shape, rank, lay.powersgd_rank)
    peak = dev.peak_flops("fp32")
    gemm = sum(max(12.0 * rows * cols / bw, 6.0 * rows * cols * r / peak) + 2.0 * r * r * (rows + cols) / peak
               for rows, cols, r in matrices)
    return 16.0 * n / bw + gemm
