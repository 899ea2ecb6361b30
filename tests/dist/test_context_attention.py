"""Ring and Ulysses attention (parallel/context.py) against plain causal SDPA on the whole sequence,
forward and backward, at cp2 and cp4, with and without grouped-query KV heads.

Each world size is spawned once and runs every case. Every rank computes the single-process reference
on the full sequence itself and compares its zigzag slice of the output and of dq, dk, dv.
Errors are max |x - ref| / max |ref| per tensor (dk, dv sum over many query rows, so their scale
grows with the sequence). Tolerances: fp64 ~1e-15 measured, bound 1e-12 (only the summation order
differs, ~eps·sqrt(n) with eps 1.1e-16); fp32 ~1e-6 measured (ring; Ulysses runs the same SDPA: 0), bound 4e-6 (eps 6e-8 times the
terms of a softmax-weighted sum plus the online-softmax rescaling of each merged block).
"""
from __future__ import annotations

import pytest

from tests.harness import run_world

# (name, heads, kv heads, dtype)
CASES = [("mha", 4, 4, "float64"), ("gqa", 4, 2, "float64"), ("mqa", 8, 1, "float64"),
         ("mha", 4, 4, "float32"), ("gqa", 8, 2, "float32")]
TOL = {"float64": 1e-12, "float32": 4e-6}


def _cases(rank: int) -> list[tuple[str, float]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.parallel.context import RingAttention, UlyssesAttention, zigzag_index

    cp = dist.get_world_size()
    group = dist.group.WORLD
    seq, b, d = 8 * cp, 2, 8
    results = []
    for mode in ("ring", "ulysses"):
        for name, h, hkv, dtype in CASES:
            dt = getattr(torch, dtype)
            gen = torch.Generator().manual_seed(1234)
            q, k, v = (torch.randn(b, n, seq, d, generator=gen, dtype=dt) for n in (h, hkv, hkv))
            dout = torch.randn(b, h, seq, d, generator=gen, dtype=dt)
            ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out_ref = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=h != hkv)
            out_ref.backward(dout)
            idx = zigzag_index(seq, cp, rank)
            local = [t[:, :, idx].clone().requires_grad_(True) for t in (q, k, v)]
            core = RingAttention(group) if mode == "ring" else UlyssesAttention(group, seq)
            out = core(*local)
            out.backward(dout[:, :, idx])
            pairs = [(out, out_ref[:, :, idx])] + [(l.grad, r.grad[:, :, idx]) for l, r in zip(local, ref)]
            err = max(((a - e).abs().max() / e.abs().max()).item() for a, e in pairs)
            results.append((f"{mode}_{name}_{dtype}", err))
    return results


@pytest.fixture(scope="module")
def errors() -> dict[int, list[list[tuple[str, float]]]]:
    return {cp: run_world(cp, _cases) for cp in (2, 4)}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_attention_matches_sdpa(errors, cp):
    for rank, cases in enumerate(errors[cp]):
        for name, err in cases:
            dtype = name.rsplit("_", 1)[1]
            print(f"cp{cp} rank{rank} {name}: max rel error {err:.1e}")
            assert err <= TOL[dtype], f"cp{cp} rank {rank} {name}: {err:.2e} > {TOL[dtype]}"


def _staged_equals_direct(rank: int) -> dict:
    """Ring attention with its K/V transfers staged through host memory (what run.backend="gloo" does
    when several ranks share a GPU) gives the same bits as the direct transfers: only the buffers move."""
    import torch

    from shardwise.parallel import context
    from shardwise.parallel.context import RingAttention

    assert context.host_staged("gloo", "cuda") and not context.host_staged("gloo", "cpu")
    assert not context.host_staged("nccl", "cuda")
    gen = torch.Generator().manual_seed(7 + rank)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    original, out = context.host_staged, {}
    try:
        for staged in (False, True):
            context.host_staged = (lambda backend, device_type: True) if staged else original
            local = [t.clone().requires_grad_(True) for t in (q, k, v)]
            y = RingAttention(torch.distributed.group.WORLD)(*local)
            y.square().sum().backward()
            out[staged] = [y.detach(), *(t.grad for t in local)]
    finally:
        context.host_staged = original
    return {"equal": all(a.equal(b) for a, b in zip(out[False], out[True]))}


def test_ring_attention_staged_through_host_memory_is_bitwise():
    assert all(r["equal"] for r in run_world(2, _staged_equals_direct))
