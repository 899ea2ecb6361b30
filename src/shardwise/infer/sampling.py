"""Choosing the next token from logits: greedy, or temperature with nucleus (top-p) sampling.

Everything runs where the logits are (a GPU's sort of 64 x 128k probabilities takes a millisecond; moving
them to the host and sorting there took 0.6 s a step on this 2-core CPU). The randomness is one uniform
number per sequence and step from a seeded generator on the CPU, so a run is reproducible for a given
--seed, and what a sequence draws does not depend on which others are in the batch. Under tensor /
pipeline parallelism one rank's choice is broadcast (infer/engine.py); under tensor parallelism the choice
is made from the vocabulary shards (Sampler.vocab_parallel), without gathering the logits.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

# torch 2.13 renamed the functional all-gather; the GPU machines run 2.11, which has only the old name.
ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

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
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        uniform = self.uniform(rows, sequences or len(logits), probs.device)
        if self.top_p >= 1:  # nothing is cut: the distribution in id order needs no sorting
            return _draw_whole(probs, uniform, self.top_p)
        values, ids = probs.topk(min(CANDIDATES, probs.shape[-1]), dim=-1)
        return self._nucleus(*_by_probability(values, ids), uniform, lambda rest: probs[rest])

    def vocab_parallel(self, logits: DTensor, rows: list[int] | None = None, sequences: int | None = None) -> torch.Tensor:
        """The same choice from (b, vocab) logits sharded over the vocabulary on a 1-D TP mesh, the same ids on
        every rank (vocab_parallel_argmax when greedy). The softmax's maximum and sum are all-reduced
        (2 x b numbers); each rank's CANDIDATES most probable tokens are all-gathered, and contain the
        whole vocabulary's. Rows the candidates do not decide gather their probabilities, as does top_p = 1
        (b x vocab: the fallback). Ids can differ from one process's only where a rounding of the softmax
        moves a token across the nucleus's edge or the drawn number."""
        if self.greedy:
            return vocab_parallel_argmax(logits)
        mesh = logits.device_mesh
        tp, rank, vocab = mesh.size(), mesh.get_local_rank(), logits.shape[-1]
        local = logits.to_local().float() / self.temperature
        b, width = local.shape[0], -(-vocab // tp)  # shards follow torch.chunk: rank r starts at r x width
        start = min(rank * width, vocab)
        top = local.amax(dim=-1) if local.shape[-1] else torch.full((b,), float("-inf"), device=local.device)
        top = funcol.all_reduce(top, "max", mesh)
        exp = (local - top[:, None]).exp()
        probs = exp / funcol.all_reduce(exp.sum(dim=-1), "sum", mesh)[:, None]
        uniform = self.uniform(rows, sequences or b, probs.device)

        def gathered(rest: torch.Tensor) -> torch.Tensor:  # b x vocab probabilities of the rows `rest`, every rank
            return _side_by_side(torch.nn.functional.pad(probs[rest], (0, width - probs.shape[-1])), mesh)[:, :vocab]

        if self.top_p >= 1:
            return _draw_whole(gathered(torch.arange(b, device=probs.device)), uniform, self.top_p)
        k = min(CANDIDATES, width)
        values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        pad = k - values.shape[-1]  # a shorter last shard (or an empty one) pads with tokens that are never kept
        values = torch.nn.functional.pad(values, (0, pad), value=-1.0)
        ids = torch.nn.functional.pad(ids + start, (0, pad), value=vocab)
        values, ids = _by_probability(_side_by_side(values, mesh), _side_by_side(ids, mesh))
        return self._nucleus(values[:, :CANDIDATES], ids[:, :CANDIDATES], uniform, gathered)

    def uniform(self, rows: list[int] | None, sequences: int, device: torch.device) -> torch.Tensor:
        """One number in [0, 1) per sequence from the seeded generator, the rows' ones, on `device`: what
        one step draws (a compiled decode loop draws a block of steps' at once, in the same order)."""
        uniform = torch.rand(sequences, generator=self.generator, dtype=torch.float64)
        return (uniform if rows is None else uniform[rows]).to(device=device, dtype=torch.float32)

    def _nucleus(self, values: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor, whole) -> torch.Tensor:
        """The draw from the candidates `values` / `ids` (most probable first, ties by id); the rows whose
        nucleus they do not decide are sorted whole from `whole(rows)`, their full probabilities."""
        kept = _kept(values, self.top_p)
        # A row is decided by its candidates when its nucleus ends before their smallest value: every token
        # more probable than that is among them, in the same order as in a full sort.
        chosen = _invert(values, ids, kept, uniform)
        decided = ~(kept & (values == values[:, -1:])).any(dim=-1)
        if not bool(decided.all()):  # the same on every TP rank: computed from gathered candidates
            rest = (~decided).nonzero().squeeze(-1)
            chosen[rest] = _draw_whole(whole(rest), uniform[rest], self.top_p)
        return chosen


def _kept(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus of probabilities sorted descending: a token whose mass before it is below top_p
    (vocab_parallel's padding, value -1, is never kept)."""
    return (values.cumsum(dim=-1) - values < top_p) & (values >= 0)


def draw_in_graph(logits: torch.Tensor, uniform: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampler's choice (b,) from (b, vocab) logits, given this step's (b,) numbers `uniform`, with nothing
    that waits for the host: every row's nucleus from a sort of the whole row, the path Sampler falls back
    to (and whose ids its candidate shortcut equals, tests/unit/test_sampling.py). That shortcut needs the
    host to learn which rows the candidates decided, once per step; a compiled decode step that draws on
    the device instead feeds its ids to the next step without a host round trip (infer/engine.py
    _decode_on_device), at the cost of sorting the vocabulary of each row: microseconds on a GPU."""
    return _draw_whole(torch.softmax(logits.float() / temperature, dim=-1), uniform, top_p)


def _draw_whole(probs: torch.Tensor, uniform: torch.Tensor, top_p: float) -> torch.Tensor:
    """The draw from whole rows of probabilities (b, vocab): in id order when nothing is cut (top_p 1: no
    sorting), else from each row sorted by probability (ties: lower id first), its nucleus kept."""
    if top_p >= 1:
        ids = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        return _invert(probs, ids, torch.ones_like(probs, dtype=torch.bool), uniform)
    values, ids = _by_probability(probs, None)
    return _invert(values, ids, _kept(values, top_p), uniform)


def _side_by_side(x: torch.Tensor, mesh) -> torch.Tensor:
    """(b, w) on each of the TP mesh's ranks -> (b, tp x w) on every rank, rank r's columns r x w onwards."""
    tp, b = mesh.size(), x.shape[0]
    return ALL_GATHER(x.contiguous(), 0, mesh).view(tp, b, -1).permute(1, 0, 2).reshape(b, -1)


def _by_probability(values: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates `values` with their `ids` (None: the whole row, ids 0..n-1) most probable first, ties by
    ascending id. topk's order among equal values is unspecified: they are put in id order first, then
    stably sorted by value."""
    if ids is None:
        ids = torch.arange(values.shape[-1], device=values.device).expand_as(values)
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


def vocab_parallel_argmax(logits: DTensor) -> torch.Tensor:
    """Greedy ids (b,), on the logits' device and the same on every TP rank, from (b, vocab) logits sharded
    over the vocabulary on a TP mesh: each rank takes its shard's maximum and its global id (shards
    follow torch.chunk: rank r starts at r x ceil(vocab / tp)), the TP group all-gathers the (maximum,
    id) pairs, and the largest wins — on a tie the lowest rank, whose ids are lower, so the lowest id as
    in a full argmax. The logits of one rank are compared in fp32, like Sampler's greedy choice.
    Functional collectives: the same code runs eagerly and inside a compiled decode step."""
    mesh = logits.device_mesh
    tp, rank = mesh.size(), mesh.get_local_rank()
    local = logits.to_local().float()
    b, vocab = local.shape[0], logits.shape[-1]
    if local.shape[-1]:
        best, index = local.max(dim=-1)
    else:  # a rank beyond the vocabulary's last chunk (vocab < tp) holds nothing
        best, index = torch.full((b,), float("-inf"), device=local.device), torch.zeros(b, dtype=torch.long, device=local.device)
    index = index + min(rank * -(-vocab // tp), vocab)
    bests = ALL_GATHER(best.contiguous(), 0, mesh).view(tp, b)
    indices = ALL_GATHER(index.contiguous(), 0, mesh).view(tp, b)
    winner = bests.argmax(dim=0)  # the first maximal rank
    return indices.gather(0, winner[None]).squeeze(0)
