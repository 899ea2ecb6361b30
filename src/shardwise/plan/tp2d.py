"""2-D tensor parallelism (parallel/tensor2d.py, SUMMA on a q x q grid) in closed form, torch-free: the
payload bytes its collectives move per step (what parallel/comm_counter.py counts, per grid axis and
kind), per-rank memory, and the 1-D / 2-D / 2.5-D / 3-D comparison of docs/tensor_parallel_2d.md.

Notation: T = micro_batch x seq_len tokens of one micro-batch of a data-parallel rank, h = model.dim,
f = ffn_dim, kv = n_kv_heads x head_dim, V = vocab, L = blocks, q = sqrt(tp), e = bytes per element.
Axes as the counter names them: "tp_col" is the group of a grid *row* (activation traffic), "tp_row"
the group of a grid *column* (weight traffic); see parallel/tensor2d.py.

One SUMMA call of input width `in` and total output width `out` (the linears sharing that input:
wq+wk+wv, wo, w1+w3, w2, the head) moves per micro-batch
  tp_col: broadcast 2·T·in/q·e (X blocks, forward and again for dW), reduce T·in/q·e (dX partials)
  tp_row: broadcast 2·in·out/q·e (W blocks, forward and again for dX), reduce in·out/q·e (dW partials)
(q calls of one block each; a rank's payload is q blocks of T/q x in/q, resp. in/q x out/q).
Every RMSNorm (2L + 1) all-reduces T/q fp32 sums of squares along the row in forward and their
gradient in backward, and its weight gradient (h/q) along the column; the embedding's weight gradient
(V·h/q) is all-reduced along the column; the loss all-reduces 3·T/q fp32 (max, sum of exp, target
logit) along the row and one fp32 scalar along the column. All of the above per micro-batch; once per
step the gradient norm all-reduces one fp32 per parameter tensor (9L + 3: DTensor reduces each tensor's
partial norm) on each grid axis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FP32 = 4


def grid_q(tp: int) -> int:
    return math.isqrt(tp)


def summa_groups(s: Any) -> list[tuple[int, int]]:
    """(input width, total output width) of each SUMMA call of one llama block."""
    kv = s.n_kv_heads * (s.dim // s.n_heads)
    return [(s.dim, s.dim + 2 * kv), (s.dim, s.dim), (s.dim, 2 * s.ffn_dim), (s.ffn_dim, s.dim)]


def comm_bytes_per_step(s: Any, tp: int, micro_batch: int, seq_len: int, accumulation: int = 1,
                        act_bytes: int = FP32, param_bytes: int = FP32, grad_bytes: int | None = None,
                        layers: int | None = None, embedding: bool = True, head: bool = True) -> dict[str, dict[str, int]]:
    """{axis: {kind: payload bytes}} of one training step of 2-D TP (train.recompute = "none").

    `act_bytes` / `param_bytes`: what SUMMA broadcasts and reduces (activations and their gradients /
    weights and weight gradients: the compute dtype, autocast casts before the broadcast);
    `grad_bytes` (default param_bytes): the norms' and the embedding's weight gradients, all-reduced in
    the parameters' dtype (fp32 under autocast). `layers` / `embedding` / `head`: the share of the model
    one rank holds (default all of it; the planner passes a pipeline rank's)."""
    q = grid_q(tp)
    T = micro_batch * seq_len
    L = s.n_layers if layers is None else layers
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    groups = summa_groups(s) * L + ([(s.dim, s.vocab_size)] if head else [])
    norms = 2 * L + (1 if head else 0)
    row_bcast = sum(2 * T * i // q * act_bytes for i, _ in groups)
    row_reduce = sum(T * i // q * act_bytes for i, _ in groups)
    row_ar = norms * 2 * (T // q) * FP32 + (3 * (T // q) * FP32 if head else 0)
    col_bcast = sum(2 * i * o // q * param_bytes for i, o in groups)
    col_reduce = sum(i * o // q * param_bytes for i, o in groups)
    col_ar = (norms * (s.dim // q) * grad_bytes + (s.vocab_size * s.dim // q * grad_bytes if embedding else 0)
              + (FP32 if head else 0))
    m, norm = accumulation, param_tensors_2d(s, L, embedding, head) * FP32
    return {"tp_col": {"broadcast": m * row_bcast, "reduce": m * row_reduce, "all_reduce": m * row_ar + norm},
            "tp_row": {"broadcast": m * col_bcast, "reduce": m * col_reduce, "all_reduce": m * col_ar + norm}}


def param_tensors_2d(s: Any, layers: int, embedding: bool = True, head: bool = True) -> int:
    """Parameter tensors of a llama rank (each reduces its gradient norm on both grid axes): 9 per block
    (7 linears, 2 norms), the embedding, the final norm and the head."""
    return 9 * layers + (1 if embedding else 0) + (2 if head else 0)


def recompute_bytes_per_step(s: Any, tp: int, micro_batch: int, seq_len: int, accumulation: int, layers: float,
                             act_bytes: int = FP32, param_bytes: int = FP32) -> dict[str, dict[str, float]]:
    """What re-running the forward of `layers` checkpointed blocks adds (full recompute): per block and
    micro-batch the forward's broadcasts of every SUMMA call (X along the row, W along the column:
    half of each call's broadcasts) and its 2 norms' forward all-reduce of T/q fp32. Not counted by
    tests/dist/test_tp2d.py (recompute "none"): the forward's own terms, repeated."""
    q = grid_q(tp)
    T = micro_batch * seq_len
    m = accumulation * layers
    return {"tp_col": {"broadcast": m * sum(T * i // q * act_bytes for i, _ in summa_groups(s)),
                       "all_reduce": m * 2 * (T // q) * FP32},
            "tp_row": {"broadcast": m * sum(i * o // q * param_bytes for i, o in summa_groups(s))}}


def summa_calls(s: Any, tp: int, layers: int, head: bool = True) -> dict[str, dict[str, int]]:
    """Collective calls per micro-batch behind `comm_bytes_per_step`'s broadcasts and reduces (for the
    latency term): each SUMMA call runs q steps; forward and dW each broadcast X once per step along the
    row, forward and dX each broadcast every weight of the call once per step along the column, dX and
    dW reduce once per step (the weights' dW partials concatenated)."""
    q = grid_q(tp)
    calls = 4 * layers + (1 if head else 0)
    weights = 7 * layers + (1 if head else 0)  # q,k,v | o | w1,w3 | w2 (+ head)
    return {"tp_col": {"broadcast": 2 * q * calls, "reduce": q * calls},
            "tp_row": {"broadcast": 2 * q * weights, "reduce": q * calls}}


def comm_bytes_1d(s: Any, tp: int, micro_batch: int, seq_len: int, accumulation: int = 1, act_bytes: int = FP32) -> int:
    """Megatron 1-D TP's payload per step (tests/dist/test_comm_volume.py): (2L + 1) all-reduces of
    T·h in forward and as many in backward (with SP: all-gather + reduce-scatter of the same bytes)."""
    return 2 * (2 * s.n_layers + 1) * micro_batch * seq_len * s.dim * act_bytes * accumulation


# ---- per-rank memory --------------------------------------------------------------------------------
def block_params(s: Any) -> int:
    return sum(i * o for i, o in summa_groups(s)) + 2 * s.dim


def param_elements_2d(s: Any, tp: int) -> float:
    """Parameters one rank holds: blocks and head 1/q^2, norms 1/q, the embedding V·h/q (split by hidden
    columns, replicated over grid rows: parallel/tensor2d.py)."""
    q = grid_q(tp)
    linears = s.n_layers * sum(i * o for i, o in summa_groups(s)) + s.dim * s.vocab_size
    return linears / q ** 2 + (2 * s.n_layers + 1) * s.dim / q + s.vocab_size * s.dim / q


def param_elements_1d(s: Any, tp: int) -> float:
    """Megatron: linears, vocab-parallel embedding and head 1/tp; norms replicated."""
    linears = s.n_layers * sum(i * o for i, o in summa_groups(s)) + 2 * s.dim * s.vocab_size
    return linears / tp + (2 * s.n_layers + 1) * s.dim


def activation_fraction(mode: str, tp: int, sp: bool = True) -> float:
    """Fraction of the single-device activations one rank stores. 1-D with SP and 2-D split every
    activation tp ways (2-D: b/q sequences x h/q hidden); 1-D without SP keeps the norms' and residual
    activations whole (about 10 of the 34 bytes per token and hidden unit, Korthikanti et al. 2022 §4)."""
    if mode == "1d" and not sp:
        return (24 / tp + 10) / 34
    return 1 / tp


# ---- 1-D / 2-D / 2.5-D / 3-D per layer, for the docs table -----------------------------------------
@dataclass(frozen=True)
class Scheme:
    name: str
    ranks: int
    weights: float  # weight elements per rank, per block
    activations: float  # stored activation elements per rank and token x hidden of the block input
    comm: float  # payload elements per rank per block, forward + backward, one micro-batch


def depth_25d(p: int) -> int:
    """Tesseract's depth d for p = d·q^2 ranks with 2 <= d <= q (the largest); 0 when there is none."""
    for d in range(p, 1, -1):
        q = math.isqrt(p // d)
        if p % d == 0 and q * q * d == p and d <= q:
            return d
    return 0


def schemes(s: Any, p: int, micro_batch: int, seq_len: int) -> list[Scheme]:
    """Per-block memory and payload of each scheme on p ranks (p a square for 2-D, p = d·q^2 with
    2 <= d <= q for 2.5-D, a cube for 3-D), from the algorithms' papers' leading terms:
      1-D (Megatron, Shoeybi et al. 2019, + SP): W/p weights; 4 collectives of T·h per block per pass.
      2-D (SUMMA, Xu et al. 2021, arXiv 2104.05343): W/p weights; per linear 3·T·in/q + 3·in·out/q.
      2.5-D (Tesseract, Wang et al. 2021, arXiv 2105.14500): d layers of q x q grids; the weights are split
        q^2 ways and replicated over the d layers (W/q^2 per rank), the tokens split d ways over the
        layers; per linear SUMMA on T/d tokens, 3·T·in/(d·q) + 3·in·out/q, plus the weight gradient's
        all-reduce over the d layers (in·out/q^2).
      3-D (Bian et al. 2021, arXiv 2105.14450): an l x l x l cube, W/l^3 weights per rank; per linear the
        input and weight blocks are all-gathered and the output reduce-scattered over l ranks each, in
        forward and twice in backward: 3·(T·in + in·out + T·out)/l^2.
    Activations are the per-rank share of T·h (1/p for all but 2.5-D's weights); T = micro_batch x seq."""
    T = micro_batch * seq_len
    W = sum(i * o for i, o in summa_groups(s))
    out: list[Scheme] = [Scheme("1-D (Megatron + SP)", p, W / p, T / p, 2 * 2 * 2 * T * s.dim)]
    q = math.isqrt(p)
    if q * q == p:
        out.append(Scheme("2-D (SUMMA)", p, W / p, T / p,
                          sum(3 * T * i / q + 3 * i * o / q for i, o in summa_groups(s))))
    depth = depth_25d(p)
    qd = math.isqrt(p // depth) if depth else 0
    if depth:
        out.append(Scheme(f"2.5-D (d={depth})", p, W / (qd * qd), T / p,
                          sum(3 * T * i / (depth * qd) + 3 * i * o / qd + i * o / (qd * qd) for i, o in summa_groups(s))))
    side = round(p ** (1 / 3))
    if side ** 3 == p:
        out.append(Scheme("3-D", p, W / p, T / p,
                          sum(3 * (T * i + i * o + T * o) / (side * side) for i, o in summa_groups(s))))
    return out


def table(s: Any, ps: tuple[int, ...], micro_batch: int, seq_len: int, bytes_per: int = 2) -> list[str]:
    """Markdown rows: scheme, ranks, weights / activations / payload per block and rank (MiB, 16-bit)."""
    rows = ["| scheme | ranks | weights / block / rank | stored activations (block input) / rank | "
            "payload / block / rank / micro-batch |", "|---|---|---|---|---|"]
    mib = 2 ** 20
    for p in ps:
        for sc in schemes(s, p, micro_batch, seq_len):
            rows.append(f"| {sc.name} | {p} | {sc.weights * bytes_per / mib:.1f} MiB | "
                        f"{sc.activations * s.dim * bytes_per / mib:.1f} MiB | {sc.comm * bytes_per / mib:.1f} MiB |")
    return rows
