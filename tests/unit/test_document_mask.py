"""Document masking (train.document_mask, models/common.py): a packed row's documents do not see each other,
and their positions restart, so each document's loss in the row is the loss it has alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import build_config
from shardwise.errors import ConfigError
from shardwise.models import build_model
from shardwise.models.common import document_attention, document_kernel, document_positions
from shardwise.preflight import check

EOD = 256


def _model(preset: str):
    cfg = build_config({}, [("model.preset", preset), ("model.vocab_size", "512")])
    model = build_model(cfg.model)
    model.init_weights(0)
    return model


def test_positions_restart_after_each_end_of_document():
    tokens = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 1], [EOD, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(tokens, EOD).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_a_packed_row_gives_each_document_the_loss_it_has_alone(preset):
    model = _model(preset)
    model.document_kernel = "sdpa"
    gen = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(0, 256, (n,), generator=gen), torch.tensor([EOD])]) for n in (9, 14, 6)]
    row = torch.cat(docs)[None]
    inputs, targets = row[:, :-1], row[:, 1:]
    with torch.no_grad():
        within = document_positions(inputs, EOD)
        packed = F.cross_entropy(model(inputs, positions=within, documents=within)[0], targets[0], reduction="none")
        start = 0
        for doc in docs:
            alone_in, alone_t = doc[None, :-1], doc[None, 1:]
            alone = F.cross_entropy(model(alone_in)[0], alone_t[0], reduction="none")
            # The packed row's targets at the document's own tokens (the EOD's target is the next document's first
            # token, which a document alone does not predict).
            n = len(doc) - 1
            torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-6)
            start += len(doc)
        plain = F.cross_entropy(model(inputs)[0], targets[0], reduction="none")
    assert not torch.allclose(packed, plain)  # without the mask the later documents see the earlier ones


def _packed_row(lengths):
    gen = torch.Generator().manual_seed(0)
    docs = [torch.cat([torch.randint(0, 256, (n,), generator=gen), torch.tensor([EOD])]) for n in lengths]
    return docs, torch.cat(docs)[None]


def test_the_mask_without_restarting_positions_still_keeps_documents_apart():
    """train.document_mask=true with train.document_positions=false (Megatron-LM's reset_attention_mask without
    reset_position_ids): positions run over the row, attention stays in each document. RoPE scores depend only on
    the distance between positions, so a llama document's loss in the row equals its loss alone, up to the
    rounding of the rotations' other angles (fp32 sin/cos: 1e-4 relative is ~100x that); before the mask had a
    channel of its own, these keys silently trained without it."""
    model = _model("tiny")
    model.document_kernel = "sdpa"
    docs, row = _packed_row((9, 14, 6))
    inputs, targets = row[:, :-1], row[:, 1:]
    with torch.no_grad():
        packed = F.cross_entropy(model(inputs, documents=document_positions(inputs, EOD))[0], targets[0], reduction="none")
        plain = F.cross_entropy(model(inputs)[0], targets[0], reduction="none")
        start = 0
        for doc in docs:
            n = len(doc) - 1
            alone = F.cross_entropy(model(doc[None, :-1])[0], doc[1:], reduction="none")
            torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-4, atol=1e-5)
            start += len(doc)
    assert not torch.allclose(packed, plain)


def test_one_mask_a_forward_shared_by_every_layer(monkeypatch):
    """Building FlexAttention's block mask evaluates the mask over the whole s x s grid: once per forward (per
    pipeline stage), not once per layer. Counted on CPU's dense mask, built by the same call."""
    from shardwise.models import common

    model = _model("tiny")
    assert model.cfg.n_layers > 1
    model.document_kernel = "sdpa"
    built = []
    real = common.document_mask
    monkeypatch.setattr(common, "document_mask", lambda documents: built.append(1) or real(documents))
    _, row = _packed_row((9, 14))
    with torch.no_grad():
        model(row, documents=document_positions(row, EOD))
    assert len(built) == 1


def test_documents_without_a_kernel_are_an_error_not_a_silent_causal_run():
    model = _model("tiny")
    _, row = _packed_row((5, 6))
    with pytest.raises(RuntimeError, match="document_kernel"):
        model(row, documents=document_positions(row, EOD))


def test_flex_attention_computes_what_the_dense_mask_does():
    """The GPU kernel's mask, run by FlexAttention's eager path on CPU: the decision is tested here, its speed
    only on a GPU."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=gen) for _ in range(3))
    tokens = torch.randint(0, 256, (2, 32), generator=gen)
    tokens[0, [5, 17]] = EOD
    tokens[1, 20] = EOD
    positions = document_positions(tokens, EOD)
    torch.testing.assert_close(document_attention(q, k, v, positions, "flex"), document_attention(q, k, v, positions, "sdpa"),
                               rtol=1e-5, atol=1e-5)
    assert document_kernel("cuda") == "flex" and document_kernel("cpu") == "sdpa"


@pytest.mark.parametrize(("axis", "keys"), [("cp", [("parallel.cp", "2")])])
def test_layouts_without_it_are_refused_before_anything_starts(axis, keys):
    cfg = build_config({}, [("train.document_mask", "true"), ("train.global_batch", "8"), ("train.micro_batch", "4"), *keys])
    with pytest.raises(ConfigError, match=f"train.document_mask: is not implemented with parallel.{axis}"):
        check(cfg, 2)
