"""Choosing the next token from logits: greedy, or temperature with nucleus (top-p) sampling.

Sampling draws from its own seeded generator on the CPU, so a run is reproducible for a given --seed
whatever the device; under tensor / pipeline parallelism one rank samples and broadcasts its choice.
"""
from __future__ import annotations

import torch


class Sampler:
    """`greedy=True` takes the argmax; otherwise softmax(logits / temperature), keeping the smallest set
    of tokens whose probability reaches top_p (Holtzman et al. 2020, The Curious Case of Neural Text
    Degeneration, §3.1), renormalised."""

    def __init__(self, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0):
        if not greedy and temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy decoding for temperature 0)")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be within (0, 1]")
        self.greedy, self.temperature, self.top_p = greedy, temperature, top_p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[int] | None = None, sequences: int | None = None) -> torch.Tensor:
        """(b, vocab) logits on any device -> (b,) token ids on the CPU. Greedy takes the argmax where the
        logits are and moves b ids, not b x vocab logits (8 MB a step at batch 64 and vocab 32k: a
        decode step's worth of time on a GPU); ties go to the lowest id on every device.
        Sampling moves the logits to the CPU, where its seeded generator is. `rows[i]`: which of
        `sequences` the logits' row i belongs to (default: row i of b): each step draws the noise of every
        sequence and each row takes its own sequence's, so what a sequence samples does not depend on
        which others have ended and left the batch (infer/engine.py Running.shrink)."""
        if self.greedy:
            return logits.float().argmax(dim=-1).cpu()
        logits = logits.float().cpu()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < self.top_p
        sorted_probs = sorted_probs * keep
        # The exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i / sum(p)
        # (no normalisation needed); zeroed tokens never win.
        noise = torch.empty(sequences or len(logits), logits.shape[-1]).exponential_(generator=self.generator)
        if rows is not None:
            noise = noise[rows]
        choice = (sorted_probs / noise).argmax(dim=-1, keepdim=True)
        return order.gather(-1, choice).squeeze(-1)
