"""benchmarks/kernels.py's `sdpa_lengths` section: causal SDPA forward + backward at several sequence lengths
(--sdpa-seqs), the same tokens per call (batch = --tokens / seq), for torch's default kernel and
FlashAttention-2, GQA, in the first of --sdpa-dtypes.

Why: the planner prices attention at one fraction of the peak per kernel, measured at 2,048 tokens
(constants.ATTENTION_FRACTION, ATTENTION_KERNEL_SPEED). A causal kernel's fixed work per query block (loading
it, rescaling and writing its output) and its diagonal tiles weigh less when each query block runs over more
key blocks. torchtitan's published 8B steps at 32K and 64K tokens imply FlashAttention-2 1.2x and 1.4x faster
than that fraction (issue 60, docs/planner.md "Out of sample"). This section measures the rate per length, and
each length's rate over the shortest's, which is what the planner would need.

Its `cp` rows (--sdpa-cps) time one context-parallel rank's attention as torch's load-balanced ring runs it
(torch/distributed/tensor/experimental/_attention.py, torchtitan's CP): the rank holds two chunks of the longest
length's half each (the first and the mirrored last), makes one causal call on them, then per other rank's K/V
one non-causal call (all queries against that rank's first chunk, or the second chunk's queries against both),
merges each output into fp32 by its log-sum-exp, and in backward accumulates q, k and v gradients in fp32. One
GPU has no peer: the K/V exchange is not timed (the planner hides it behind the attention). Each row's rate is
over the same length's single causal call: torchtitan's 8B at 128K-256K (CP 4-8, 32K a rank) ran slower than
its 32K-64K rows' attention rate extrapolates to (docs/planner.md "Out of sample").
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kernel_timing import DTYPES, Timer, backward, cell, reason
from shardwise.plan import constants as C

BACKENDS = ("default", "FLASH_ATTENTION")


def _timed(timer: Timer, call: Callable[[], Any], label: str) -> dict[str, Any]:
    """`timer(call)` under the SDPA kernel `label` forces ("default": torch's pick), or {"unsupported": why} when
    the kernel refuses the call (e.g. FlashAttention-2 on a CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, label)]) if label != "default" else contextlib.nullcontext():
            return timer(call)
    except RuntimeError as e:
        return {"unsupported": reason(e)}


def _print_table(title: str, header: str, rows: list[dict], head: Callable[[dict], str],
                 body: Callable[[dict], str]) -> None:
    """A section's table: each row's `head`, then its `body`, or why its kernel refused."""
    print(title)
    print(header)
    for r in rows:
        print(f"{head(r)} unsupported ({r['unsupported'][:80]})" if "unsupported" in r else f"{head(r)} {body(r)}")


def sdpa_lengths_section(a: Any, device: torch.device, timer: Timer,
                         peak_of: Callable[[str], float | None]) -> dict[str, Any]:
    dtype_name = a.sdpa_dtypes.split(",")[0]
    dtype, peak = DTYPES[dtype_name], peak_of(dtype_name)
    h, kv, d = a.heads, a.kv_heads, a.dim // a.heads
    rows: list[dict[str, Any]] = []
    for s in sorted({int(x) for x in a.sdpa_seqs.split(",") if x.strip()}):
        batch = max(1, a.tokens // s)
        # QK^T and PV over the causal half, forward; backward twice that (the convention of kernels.py's sdpa rows)
        flops = 3 * 4.0 * batch * h * s * s * d * C.CAUSAL_EXECUTED_FRACTION
        q = torch.randn(batch, h, s, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, kv, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
        call = functools.partial(backward, fwd, (q, k, v), torch.randn_like(q))
        for label in BACKENDS:
            row: dict[str, Any] = {"dtype": dtype_name, "requested": label, "seq": s, "batch": batch, "heads": h,
                                   "kv_heads": kv, "head_dim": d}
            t = _timed(timer, call, label)
            if "unsupported" in t:
                rows.append({**row, **t})
                continue
            row.update(fwd_bwd_s=t["median_s"], fwd_bwd_best_s=t["best_s"], fwd_bwd_flops=flops / t["median_s"],
                       fraction_of_peak=flops / t["median_s"] / peak if peak else None)
            rows.append(row)
        del q, k, v, fwd, call
    for label in BACKENDS:  # each length's rate over the shortest length's, per kernel
        ran = [r for r in rows if r["requested"] == label and "fwd_bwd_flops" in r]
        for r in ran:
            r["rate_vs_shortest"] = r["fwd_bwd_flops"] / ran[0]["fwd_bwd_flops"]
    cp_rows = _cp_rows(a, device, timer, dtype, rows)
    _print_table(f"\nSDPA by sequence length, causal, GQA {h}/{kv} heads x head_dim {d}, {dtype_name}, "
                 f"{a.tokens} tokens a call; forward + backward",
                 f"{'requested':17s} {'seq':>7s} {'batch':>5s} {'f+b ms':>9s} {'TF/s':>8s} {'of peak':>7s} {'vs shortest':>11s}",
                 rows, lambda r: f"{r['requested']:17s} {r['seq']:7d} {r['batch']:5d}",
                 lambda r: f"{1e3 * r['fwd_bwd_s']:9.3f} {r['fwd_bwd_flops'] / 1e12:8.3f} "
                           f"{cell(r['fraction_of_peak'], 7, '.1%')} {r['rate_vs_shortest']:11.2f}")
    if cp_rows:
        _print_table(f"\nOne context-parallel rank (torch's load-balanced ring), {cp_rows[0]['local_seq']} tokens a rank; "
                     "forward + backward, no exchange timed; rate over the single causal call of that length",
                     f"{'requested':17s} {'cp':>3s} {'total':>7s} {'calls ms':>9s} {'merge ms':>9s} {'TF/s':>8s} "
                     f"{'vs one call':>11s}", cp_rows, lambda r: f"{r['requested']:17s} {r['cp']:3d} {r['total_seq']:7d}",
                     lambda r: f"{1e3 * r['calls_s']:9.3f} {1e3 * r['bookkeeping_s']:9.3f} "
                               f"{r['fwd_bwd_flops'] / 1e12:8.3f} {cell(r['rate_vs_one_call'], 11, '.2f')}")
    return {"what": "causal SDPA forward + backward per sequence length at a fixed number of tokens per call; "
                    "FLOP/s count the causal half, backward twice forward; cp_rows: one load-balanced ring CP rank's "
                    "calls and fp32 merges at the longest length a rank", "rows": rows, "cp_rows": cp_rows}


def rank_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int) -> list[tuple]:
    """(q, k, v, causal, partial) of each SDPA call one rank of torch's load-balanced ring makes: its two local
    chunks causally, then per step i a non-causal call, all queries against the first K/V chunk of an earlier
    rank (i <= rank) or the second query chunk against a later rank's K/V (`partial`: half the outputs)."""
    half = q.shape[2] // 2
    calls = [(q, k, v, True, False)]
    for i in range(1, cp):
        calls.append((q, k[:, :, :half], v[:, :, :half], False, False) if i <= rank else
                     (q[:, :, half:], k, v, False, True))
    return calls


def _cp_rows(a: Any, device: torch.device, timer: Timer, dtype: torch.dtype, rows: list[dict]) -> list[dict]:
    """benchmarks/kernels.py's cp rows (module docstring): a middle rank of each --sdpa-cps, at the longest length."""
    local = max((r["seq"] for r in rows), default=0)
    h, kv, d = a.heads, a.kv_heads, a.dim // a.heads
    batch = max(1, a.tokens // local) if local else 1
    out: list[dict[str, Any]] = []
    for cp in sorted({int(x) for x in a.sdpa_cps.split(",") if x.strip()}) if local else []:
        rank = cp // 2
        q = torch.randn(batch, h, local, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, kv, local, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        plan = rank_calls(q, k, v, cp, rank)
        calls = [(functools.partial(F.scaled_dot_product_attention, qi, ki, vi, is_causal=causal, enable_gqa=True),
                  torch.randn_like(qi)) for qi, ki, vi, causal, _ in plan]

        def sdpa(calls=calls, q=q, k=k, v=v):
            for fwd, grad_out in calls:
                backward(fwd, (q, k, v), grad_out)
        bookkeeping = functools.partial(_merges_and_accumulation, q, k, v, [partial for *_, partial in plan])
        flops = 3 * 4.0 * batch * h * (local * cp) ** 2 * d * C.CAUSAL_EXECUTED_FRACTION / cp
        for label in BACKENDS:
            row: dict[str, Any] = {"requested": label, "cp": cp, "rank": rank, "local_seq": local,
                                   "total_seq": local * cp, "batch": batch, "heads": h, "kv_heads": kv, "head_dim": d}
            t = _timed(timer, sdpa, label)
            if "unsupported" in t:
                out.append({**row, **t})
                continue
            t_calls = t["median_s"]
            t_book = timer(bookkeeping)["median_s"]
            one = next((r for r in rows if r["requested"] == label and r["seq"] == local and "fwd_bwd_s" in r), None)
            row.update(calls_s=t_calls, bookkeeping_s=t_book, fwd_bwd_flops=flops / (t_calls + t_book),
                       rate_vs_one_call=one["fwd_bwd_s"] * cp / (t_calls + t_book) if one else None)
            out.append(row)
        del q, k, v, plan, calls
    return out


def _merges_and_accumulation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partial: list[bool]) -> None:
    """The fp32 work of a ring rank around its calls: forward, each later call's output merged into the running
    output by log-sum-exp (out -= sigmoid(lse_i - lse) (out - out_i); lse -= logsigmoid(lse - lse_i)) and its K/V
    packed for the next rank; backward, each call's q, k, v gradients added into fp32 accumulators and the K/V
    gradients packed to rotate."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, d, device=q.device, dtype=torch.float32)
    lse = torch.zeros(b, h, n, 1, device=q.device, dtype=torch.float32)
    grads = [torch.zeros(t.shape, device=q.device, dtype=torch.float32) for t in (q, k, v)]
    for half in partial[1:]:
        rows = slice(n // 2 if half else 0, n)
        o, l_run = out[:, :, rows], lse[:, :, rows]
        o_i, l_i = q.detach()[:, :, rows], l_run.detach() + 0.5
        o.sub_(torch.sigmoid(l_i - l_run) * (o - o_i.float()))
        l_run.sub_(F.logsigmoid(l_run - l_i))
        torch.cat([k.detach().flatten(), v.detach().flatten()])
    for half in partial:
        rows = slice(n // 2 if half else 0, n)
        grads[0][:, :, rows] += q.detach()[:, :, rows].float()
        grads[1] += k.detach().float()
        grads[2] += v.detach().float()
        torch.cat([grads[1].flatten(), grads[2].flatten()])

