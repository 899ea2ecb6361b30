"""benchmarks/kernels.py's `sdpa_lengths` section: causal SDPA forward + backward at several sequence lengths
(--sdpa-seqs), the same tokens per call (batch = --tokens / seq), for torch's default kernel and
FlashAttention-2, GQA, in the first of --sdpa-dtypes.

Why: the planner prices attention at one fraction of the peak per kernel, measured at 2,048 tokens
(constants.ATTENTION_FRACTION, ATTENTION_KERNEL_SPEED). A causal kernel's fixed work per query block (loading
it, rescaling and writing its output) and its diagonal tiles weigh less when each query block runs over more
key blocks. torchtitan's published 8B steps at 32K and 64K tokens imply FlashAttention-2 1.2x and 1.4x faster
than that fraction (issue 60, docs/planner.md "Out of sample"). This section measures the rate per length, and
each length's rate over the shortest's, which is what the planner would need.
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


def sdpa_lengths_section(a: Any, device: torch.device, timer: Timer,
                         peak_of: Callable[[str], float | None]) -> dict[str, Any]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
            backend = None if label == "default" else getattr(SDPBackend, label)
            try:
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    t = timer(call)
            except RuntimeError as e:  # e.g. FlashAttention-2 on a CPU: the row says why
                rows.append({**row, "unsupported": reason(e)})
                continue
            row.update(fwd_bwd_s=t["median_s"], fwd_bwd_best_s=t["best_s"], fwd_bwd_flops=flops / t["median_s"],
                       fraction_of_peak=flops / t["median_s"] / peak if peak else None)
            rows.append(row)
        del q, k, v, fwd, call
    for label in BACKENDS:  # each length's rate over the shortest length's, per kernel
        ran = [r for r in rows if r["requested"] == label and "fwd_bwd_flops" in r]
        for r in ran:
            r["rate_vs_shortest"] = r["fwd_bwd_flops"] / ran[0]["fwd_bwd_flops"]
    print(f"\nSDPA by sequence length, causal, GQA {h}/{kv} heads x head_dim {d}, {dtype_name}, "
          f"{a.tokens} tokens a call; forward + backward")
    print(f"{'requested':17s} {'seq':>7s} {'batch':>5s} {'f+b ms':>9s} {'TF/s':>8s} {'of peak':>7s} {'vs shortest':>11s}")
    for r in rows:
        head = f"{r['requested']:17s} {r['seq']:7d} {r['batch']:5d}"
        if "unsupported" in r:
            print(f"{head} unsupported ({r['unsupported'][:80]})")
            continue
        print(f"{head} {1e3 * r['fwd_bwd_s']:9.3f} {r['fwd_bwd_flops'] / 1e12:8.3f} "
              f"{cell(r['fraction_of_peak'], 7, '.1%')} {r['rate_vs_shortest']:11.2f}")
    return {"what": "causal SDPA forward + backward per sequence length at a fixed number of tokens per call; "
                    "FLOP/s count the causal half, backward twice forward", "rows": rows}

