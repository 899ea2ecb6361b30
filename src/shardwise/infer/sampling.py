"""Choosing the next token from logits: greedy, or temperature with nucleus (top-p) sampling.

Everything runs where the logits are (a GPU's sort of 64 x 128k probabilities takes a millisecond; moving
them to the host and sorting there took 0.6 s a step on this 2-core CPU). The randomness is one uniform
number per sequence and step from a seeded generator on the CPU, so a run is reproducible for a given
--seed, and what a sequence draws does not depend on which others are in the batch. Under tensor /
pipeline parallelism one rank's choice is broadcast (infer/engine.py).
"""
from __future__ import annotations

import torch

# Nucleus sampling looks at the CANDIDATES most probable tokens first (torch.topk: a selection, ~16x
# faster than sorting 128k probabilities here); a row whose nucleus does not end inside them (a flat
# distribution, top_p near 1) is sorted whole. Both give the same ids.
CANDIDATES = 1024


class Sampler:
    """`greedy=True` takes the argmax; otherwise softmax(logits / temperature), keeping the smallest set
    of tokens whose probability reaches top_p (Holtzman et al. 2020, The Curious Case of Neural Text
    Degeneration, §3.1), renormalised, and draws from it by inverting its cumulative distribution, the
    tokens ordered by probability (ties: lower id first)."""

    def __init__(self, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0):
        if not greedy and temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy decoding for temperature 0)")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be within (0, 1]")
        self.greedy, self.temperature, self.top_p = greedy, temperature, top_p
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[int] | None = None, sequences: int | None = None) -> torch.Tensor:
        """(b, vocab) logits -> (b,) token ids on the logits' device; b ids, not b x vocab logits, are what
        a caller moves. Greedy: the argmax of the fp32 logits, ties to the lowest id on every device.
        `rows[i]`: which of `sequences` the logits' row i belongs to (default: row i of b): each step draws
        a number for every sequence and each row takes its own sequence's, so what a sequence samples does
        not depend on which others have ended and left the batch (infer/engine.py Running.shrink)."""
        if self.greedy:
            return logits.float().argmax(dim=-1)
        uniform = torch.rand(sequences or len(logits), generator=self.generator, dtype=torch.float64)
        if rows is not None:
            uniform = uniform[rows]
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        uniform = uniform.to(device=probs.device, dtype=probs.dtype)
        if self.top_p >= 1:  # nothing is cut: the distribution in id order needs no sorting
            ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
            return _invert(probs, ids, torch.ones_like(probs, dtype=torch.bool), uniform)
        values, ids = _by_probability(probs, min(CANDIDATES, probs.shape[-1]))
        kept = values.cumsum(dim=-1) - values < self.top_p  # the mass before a token is below top_p
        # A row is decided by its candidates when its nucleus ends before their smallest value: every token
        # more probable than that is among them, in the same order as in a full sort.
        decided = ~(kept & (values == values[:, -1:])).any(dim=-1)
        if not bool(decided.all()):
            rest = (~decided).nonzero().squeeze(-1)
            full_values, full_ids = _by_probability(probs[rest], probs.shape[-1])
            full_kept = full_values.cumsum(dim=-1) - full_values < self.top_p
            chosen = _invert(values, ids, kept, uniform)
            chosen[rest] = _invert(full_values, full_ids, full_kept, uniform[rest])
            return chosen
        return _invert(values, ids, kept, uniform)


def _by_probability(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest probabilities of each row, descending, ties by ascending id, and their ids. topk's order
    among equal values is unspecified: the candidates are put in id order, then stably sorted by value."""
    values, ids = probs.topk(k, dim=-1) if k < probs.shape[-1] else (probs, None)
    if ids is None:
        ids = torch.arange(k, device=probs.device).expand_as(probs)
    else:
        ids, by_id = ids.sort(dim=-1)
        values = values.gather(-1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _invert(values: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token at which the cumulative kept probability first exceeds uniform x the kept total (inverse
    transform sampling). A kept token of probability 0 is never chosen; rounding past the end takes the
    last kept token."""
    cdf = torch.where(kept, values, 0.0).cumsum(dim=-1)
    position = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(-1), right=True)
    position = torch.minimum(position, kept.sum(dim=-1, keepdim=True) - 1)
    return ids.gather(-1, position).squeeze(-1)
