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

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, vocab) logits on any device -> (b,) token ids on the CPU. Greedy takes the argmax where the
        logits are and moves b ids, not b x vocab logits (8 MB a step at batch 64 and vocab 32k: a
        decode step's worth of time on a GPU); ties go to the lowest id on every device.
        Sampling moves the logits to the CPU, where its seeded generator is."""
        if self.greedy:
            return logits.float().argmax(dim=-1).cpu()
        logits = logits.float().cpu()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < self.top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(dim=-1, keepdim=True), 1, generator=self.generator)
        return order.gather(-1, choice).squeeze(-1)
