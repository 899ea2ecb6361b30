"""How the training loss is chunked (train/loss.py), as a fact the planner needs too (plan/activations.py):
a micro-batch whose fp32 logits exceed LOSS_CHUNK_BYTES is taken in chunks of loss_chunk_tokens tokens,
and then autograd keeps the logits in their own dtype plus one fp32 log-sum-exp per token instead of an
fp32 log-softmax of every logit. Vocab-sharded (TP) logits use loss_parallel and are never chunked."""
from __future__ import annotations

# fp32 logits per chunk: large enough that a chunk's work is not launch-bound on a GPU (256 MiB = 2048
# tokens of a 32k vocabulary), small next to the logits of a micro-batch.
LOSS_CHUNK_BYTES = 256 << 20


def loss_chunk_tokens(vocab: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab))


def loss_is_chunked(tokens: float, vocab: int, tp: int, chunk_bytes: int = LOSS_CHUNK_BYTES) -> bool:
    """Whether a rank's micro-batch of `tokens` tokens takes the chunked loss."""
    return tp == 1 and tokens > loss_chunk_tokens(vocab, chunk_bytes)
