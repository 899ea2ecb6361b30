"""The next-token choice (infer/sampling.py): seeded, drawn from the nucleus, computed where the logits are,
and the same whether a row's nucleus is found among the top candidates or by sorting the whole row."""
from __future__ import annotations

import pytest
import torch

from shardwise.infer import sampling
from shardwise.infer.sampling import Sampler


def test_sampling_is_seeded_and_top_p_narrows_to_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3

    def draws(seed: int) -> list[list[int]]:
        sampler = Sampler(False, 2.0, 0.95, seed=seed)
        return [sampler(logits).tolist() for _ in range(5)]

    assert draws(7) == draws(7)  # the same seed draws the same tokens
    assert draws(7) != draws(8) and len({tuple(d) for d in draws(7)}) > 1  # and it is random
    assert torch.equal(Sampler(False, 1.0, 1e-6, seed=3)(logits), logits.argmax(-1))  # only the top token survives
    # Rows 3 and 1 of a batch of 4 (the others ended) draw what they would in the whole batch.
    for top_p in (1.0, 0.9):
        assert Sampler(False, 2.0, top_p, seed=9)(logits[[3, 1]], rows=[3, 1], sequences=4).tolist() == \
            Sampler(False, 2.0, top_p, seed=9)(logits)[[3, 1]].tolist()
    draws = torch.stack([Sampler(False, 1.0, 1.0, seed=s)(logits[:1]) for s in range(400)])
    probs = torch.softmax(logits[0], -1)
    top = int(probs.argmax())
    assert abs((draws == top).float().mean().item() - probs[top].item()) < 0.08  # 400 draws: ~3.5 sigma


def test_nucleus_draws_follow_the_renormalised_distribution():
    """p = 0.4, 0.3, 0.2, 0.1 at top_p 0.75: the first three are kept (the mass before the third is 0.7),
    renormalised to 4/9, 3/9, 2/9; the fourth is never drawn. 4,000 rows are 4,000 draws: a frequency's
    standard deviation is <= 0.008, so 0.04 is 5 sigma."""
    logits = torch.tensor([0.2, 0.4, 0.1, 0.3]).log().expand(4000, 4)  # ids out of probability order
    ids = Sampler(False, 1.0, 0.75, seed=1)(logits)
    freq = torch.bincount(ids, minlength=4).double() / len(ids)
    assert freq[2] == 0, freq
    assert torch.allclose(freq[[1, 3, 0]], torch.tensor([4 / 9, 3 / 9, 2 / 9], dtype=torch.float64), atol=0.04), freq


@pytest.mark.parametrize("candidates", [2, 5, 16])
def test_the_top_candidates_give_the_ids_a_full_sort_gives(monkeypatch, candidates):
    """Rows of every kind: peaked (decided by the candidates), flat (sorted whole), and integer logits with
    many equal probabilities, whose order (ties: lower id first) must not depend on topk's."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(6, 40, generator=generator) * 6, torch.randn(6, 40, generator=generator) * 0.3,
                        torch.randint(0, 3, (6, 40), generator=generator).float() * 2,
                        torch.zeros(2, 40)])
    for top_p in (0.5, 0.8, 0.97):
        monkeypatch.setattr(sampling, "CANDIDATES", 40)  # every row sorted whole
        whole = Sampler(False, 1.0, top_p, seed=5)
        reference = [whole(logits).tolist() for _ in range(6)]
        monkeypatch.setattr(sampling, "CANDIDATES", candidates)
        fast = Sampler(False, 1.0, top_p, seed=5)
        assert [fast(logits).tolist() for _ in range(6)] == reference


def test_the_logits_never_leave_their_device(monkeypatch):
    """What a GPU user meets: the choice is made where the logits are, and only the b ids (and b random
    numbers) cross between host and device. Moving b x vocab logits to the host and sorting them there
    took 0.6 s a step at batch 64, vocabulary 128k (this CPU) before. On the CPU no copy is visible, so
    every .cpu() and .to() is recorded."""
    moved = []
    for name in ("cpu", "to"):
        original = getattr(torch.Tensor, name)

        def record(self, *args, _original=original, **kwargs):
            moved.append(self.numel())
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, record)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 4
    for sampler in (Sampler(), Sampler(False, 0.8, 0.9), Sampler(False, 1.0, 1.0)):
        ids = sampler(logits)
        assert ids.shape == (3,) and ids.device == logits.device
    assert all(n <= 3 for n in moved), moved


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_the_in_graph_draw_equals_the_samplers_choice():
    """sampling.draw_in_graph (a compiled decode step's choice: no host sync, every row sorted whole) takes the
    same ids as Sampler from the same numbers, on rows of every kind (peaked, flat, tied, all equal), with
    and without a nucleus, and compiled as the engine compiles it."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.randn(5, 300, generator=generator) * 6, torch.randn(5, 300, generator=generator) * 0.3,
                        torch.randint(0, 3, (5, 300), generator=generator).float() * 2, torch.zeros(2, 300)])
    compiled = torch.compile(sampling.draw_in_graph, dynamic=False)
    for temperature, top_p in ((1.0, 0.5), (0.7, 0.9), (1.3, 0.999), (1.0, 1.0)):
        ours, theirs = Sampler(False, temperature, top_p, seed=4), Sampler(False, temperature, top_p, seed=4)
        for _ in range(4):
            uniform = ours.uniform(None, len(logits), logits.device)
            want = theirs(logits)
            assert torch.equal(sampling.draw_in_graph(logits, uniform, temperature, top_p), want)
            assert torch.equal(compiled(logits, uniform, temperature, top_p), want)
