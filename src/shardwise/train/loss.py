"""Token cross-entropy in fp32 without an fp32 copy of the whole micro-batch's logits.

`F.cross_entropy(logits.float())` keeps the fp32 log-softmax of every token for backward (4 bytes per
logit: 2.1 GB for 8 x 2048 tokens of a 32k vocabulary) and builds an fp32 gradient of the same size.
Here the tokens are taken in chunks of about LOSS_CHUNK_BYTES (spec/loss.py) of fp32 logits: forward keeps the logits as
they are (bf16 under mixed precision: half the bytes; in fp32 the same tensor the head produced) plus
one fp32 log-sum-exp per token, and backward recomputes each chunk's softmax from them. Only one chunk
is ever in fp32 (the idea of Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024, arXiv
2410.10989, without fusing the head's matmul).

Per token it is the same fp32 arithmetic as F.cross_entropy (max-shifted log-sum-exp minus the target
logit); only the order in which the per-token losses are summed differs, so the loss agrees to fp32
rounding (tests/unit/test_loss.py). A micro-batch that fits one chunk (every model the CPU tests train)
takes F.cross_entropy itself, so its numbers are bit for bit those of before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from shardwise.spec.loss import LOSS_CHUNK_BYTES, loss_chunk_tokens, loss_is_chunked


def chunk_forward(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (fp32 log-sum-exp per token, sum of -log softmax(x)[t]); x (n, V) in any float dtype.
    A negative target (IGNORE_INDEX: a fine-tuning token without loss) adds nothing, as in F.cross_entropy."""
    x = x.float()
    lse = torch.logsumexp(x, dim=-1)
    keep = t >= 0
    return lse, torch.where(keep, lse - x.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0).sum()


def chunk_backward(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """d/dx of the chunk's sum, times grad_total, in x's dtype: softmax(x) - onehot(t), recomputed from lse.
    Subtracting the one-hot as a comparison (not an in-place scatter) is one pointwise expression that a
    compiler fuses with the exp and the cast; the values are the same (p - 1 where t, p - 0 elsewhere)."""
    p = torch.exp(x.float() - lse[:, None])
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == t[:, None]
    grad = torch.where(t[:, None] >= 0, (p - onehot.to(p.dtype)) * grad_total, 0.0)  # an ignored target: none
    return grad.to(x.dtype)


@dataclass(frozen=True)
class LossKernels:
    """The two per-chunk computations, eager or compiled. Eager, each is ~6 kernels over an fp32 copy of
    the chunk (cast, max, subtract, exp, sum, log; and back): on an H100 (886M, bf16, 8 x 2048 tokens of
    a 32k vocabulary) the loss took 54 ms of GPU time per 3 steps where the plain loop's fp32 log-softmax
    took 17 ms (../shared/gpu/h100-2026-11-25/prof_*_compile.txt: logsumexp 28.9 ms, its backward 25.5
    ms, casts 17 ms). Compiled (train.compile), each is one fused kernel that reads the 16-bit logits and
    never writes an fp32 copy."""

    forward: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = chunk_forward
    backward: Callable[..., torch.Tensor] = chunk_backward

    @classmethod
    def compiled(cls, backend: str = "inductor") -> "LossKernels":
        # dynamic=False: a micro-batch has one chunk size (and a last, smaller one): two graphs per run.
        return cls(torch.compile(chunk_forward, backend=backend, fullgraph=True, dynamic=False),
                   torch.compile(chunk_backward, backend=backend, fullgraph=True, dynamic=False))


EAGER = LossKernels()


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tp: int = 1,
                            chunk_bytes: int = LOSS_CHUNK_BYTES, kernels: LossKernels = EAGER) -> torch.Tensor:
    """Sum over tokens of -log softmax(logits)[target], in fp32. logits (..., V), targets (...).
    Chunked where spec/loss.py loss_is_chunked says (the planner's rule): never for TP's vocab-sharded
    DTensor logits, whose cross-entropy loss_parallel computes (the trainer's _loss_context). `kernels`:
    the chunks' computations, compiled when the trainer compiles (LossKernels.compiled)."""
    flat, flat_targets = logits.flatten(0, -2), targets.flatten()
    vocab = flat.shape[-1]
    if not loss_is_chunked(flat.shape[0], vocab, tp, chunk_bytes):
        return F.cross_entropy(flat.float(), flat_targets, reduction="sum")
    return _ChunkedCrossEntropy.apply(flat, flat_targets, loss_chunk_tokens(vocab, chunk_bytes), kernels)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int, kernels: LossKernels) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            lse[start:start + chunk], part = kernels.forward(logits[start:start + chunk], targets[start:start + chunk])
            total += part
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk, ctx.kernels = chunk, kernels
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            grad[start:end] = ctx.kernels.backward(logits[start:end], targets[start:end], lse[start:end], grad_total)
        return grad, None, None, None
