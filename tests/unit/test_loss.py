"""train/loss.py: the chunked fp32 cross-entropy against F.cross_entropy(logits.float())."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.spec.loss import loss_chunk_tokens
from shardwise.train.loss import token_cross_entropy_sum
from shardwise.train.memory_meter import ActivationMeter

VOCAB = 1000


def _inputs(dtype: torch.dtype, tokens: int = 3 * 64 + 17):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, VOCAB, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_plain_cross_entropy(dtype):
    """Per token the same fp32 arithmetic; the sum over 209 tokens in 4 chunks (64 tokens each, the last
    17) is ordered differently, so loss and gradient agree to fp32 rounding: 1e-6 relative on a sum of
    ~1500, and gradients (softmax - onehot, each < 1) to 1e-6 absolute in fp32. In bf16 the gradient is
    rounded to bf16 in both (8 bits of mantissa), so 1 ulp of bf16 at values < 1: 4e-3."""
    chunk_bytes = 64 * 4 * VOCAB
    assert loss_chunk_tokens(VOCAB, chunk_bytes) == 64
    a, targets = _inputs(dtype)
    b = a.detach().clone().requires_grad_()
    plain = F.cross_entropy(a.float(), targets, reduction="sum")
    chunked = token_cross_entropy_sum(b, targets, chunk_bytes=chunk_bytes)
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())
    (plain * 0.5).backward()
    (chunked * 0.5).backward()
    assert b.grad.dtype == dtype
    assert torch.allclose(a.grad.float(), b.grad.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)


def test_one_chunk_is_f_cross_entropy_bit_for_bit():
    logits, targets = _inputs(torch.float32, tokens=50)
    assert torch.equal(token_cross_entropy_sum(logits, targets), F.cross_entropy(logits.float(), targets, reduction="sum"))


def test_chunked_keeps_no_fp32_copy_of_bf16_logits():
    """What autograd keeps for backward: F.cross_entropy(logits.float()) an fp32 log-softmax of every logit
    (4 bytes each); the chunked loss the bf16 logits themselves (2 bytes) and one fp32 value per token."""
    logits, targets = _inputs(torch.bfloat16)
    tokens = logits.shape[0]
    with ActivationMeter(exclude=[logits]) as plain:
        F.cross_entropy(logits.float(), targets, reduction="sum")
    with ActivationMeter() as chunked:
        token_cross_entropy_sum(logits, targets, chunk_bytes=64 * 4 * VOCAB)
    assert plain.bytes >= tokens * VOCAB * 4
    assert chunked.bytes <= tokens * VOCAB * 2 + tokens * (4 + 8)  # logits + lse + int64 targets


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunk_kernels_equal_the_eager_ones(dtype):
    """train.compile fuses each chunk's computation (LossKernels.compiled). Traced without code generation
    (aot_eager) it is the eager arithmetic, bit for bit; inductor's fused kernels reorder the exp and
    the sums: the loss agrees to fp32 rounding of a ~1500 sum (1e-6 relative) and the gradient to 1 ulp of
    its dtype (values < 1: 2e-6 in fp32, 4e-3 in bf16)."""
    from shardwise.train.loss import LossKernels

    chunk_bytes = 64 * 4 * VOCAB
    logits, targets = _inputs(dtype)
    results = {}
    for name, kernels in (("eager", LossKernels()), ("aot_eager", LossKernels.compiled("aot_eager")),
                          ("inductor", LossKernels.compiled("inductor"))):
        x = logits.detach().clone().requires_grad_()
        loss = token_cross_entropy_sum(x, targets, chunk_bytes=chunk_bytes, kernels=kernels)
        (loss * 0.5).backward()
        results[name] = (loss.detach(), x.grad)
    eager = results["eager"]
    assert results["aot_eager"][0].equal(eager[0]) and results["aot_eager"][1].equal(eager[1])
    loss, grad = results["inductor"]
    assert abs(loss.item() - eager[0].item()) <= 1e-6 * abs(eager[0].item()) and grad.dtype == dtype
    assert torch.allclose(grad.float(), eager[1].float(), rtol=0, atol=2e-6 if dtype == torch.float32 else 4e-3)
