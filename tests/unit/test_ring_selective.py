"""Selective recomputation over ring attention (parallel/context.py): the checkpoint policy caches nothing run
inside the ring's forward. It used to cache every matmul there, the scores of each pair of sequence chunks and
their partial outputs: at 32K tokens over cp 4, a llama3-8b block would have kept 18 GiB of fp32 scores a
rank. Checked from the policy's own decisions on one process (a ring of one: no exchange, the same blocks and
matmuls), and against the memory meter and the planner in tests/dist/test_plan_validation.py cp2_ring_op*."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from shardwise.config import build_config
from shardwise.models import build_model
from shardwise.models.common import Attention
from shardwise.parallel import activation_checkpoint
from shardwise.parallel.activation_checkpoint import apply_activation_checkpointing
from shardwise.parallel.context import RingAttention
from shardwise.parallel.tiling import UncachedRegion


def _ring_of_one() -> RingAttention:
    ring = RingAttention.__new__(RingAttention)  # no process group: one rank never exchanges
    ring.ring, ring.uncached = SimpleNamespace(rank=0, size=1), UncachedRegion()
    return ring


def _model(ring: RingAttention | None):
    model = build_model(build_config({"model": {"preset": "tiny", "vocab_size": 512}}).model)
    model.init_weights(seed=0)
    if ring is not None:
        for module in model.modules():
            if isinstance(module, Attention):
                module.core = ring
    return model


@pytest.mark.parametrize("policy", ["op", "op_alternate"])
def test_nothing_inside_ring_attention_is_cached(policy, monkeypatch):
    """The forward's decisions (a ring of one has no backward of its own: the cp2 parity rows,
    tests/parity/matrix.py cp2_ring_recompute_op, check the numbers)."""
    decisions: Counter = Counter()
    save = activation_checkpoint._save_matmuls

    def counting(scope, ctx, op, *args, **kwargs):
        decision = save(scope, ctx, op, *args, **kwargs)
        if not ctx.is_recompute and decision == CheckpointPolicy.MUST_SAVE:
            decisions[op] += 1
        return decision

    monkeypatch.setattr(activation_checkpoint, "_save_matmuls", counting)
    ring = _ring_of_one()
    model = _model(ring)
    apply_activation_checkpointing(model, "selective", policy, 1)
    model(torch.randint(0, 512, (2, 32)))
    # the ring's scores and partial outputs (aten.bmm) are not cached; the block's linears (aten.mm) are
    assert torch.ops.aten.bmm.default not in decisions and decisions[torch.ops.aten.mm.default] > 0, decisions
    assert not ring.uncached.active


def test_the_meter_reads_the_regions_the_policy_does():
    ring = _ring_of_one()
    model = _model(ring)
    apply_activation_checkpointing(model, "selective", "op", 1)
    assert activation_checkpoint.uncached_regions_of(model.blocks()) == [ring.uncached]


def test_the_planner_keeps_no_ring_core_and_reruns_its_forward(capsys):
    """Llama 3 8B, 8 H100s, cp 2, 8192 tokens: under selective recomputation ring attention keeps neither
    its output nor its LSE (Ulysses' SDPA keeps both) and its forward runs again in the replay: the
    recompute differs from Ulysses' by the 32 blocks' attention forward, at the planner's attention rate."""
    import json

    from shardwise.cli import main
    from shardwise.plan import constants as C

    got = {}
    for mode in ("ring", "ulysses"):
        assert main(["plan", "evaluate", "--json", "--model.preset=llama3-8b", "--train.seq_len=8192",
                     "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=8", "--parallel.cp=2", "--parallel.dp_shard=4",
                     "--parallel.zero=3", "--train.micro_batch=1", "--train.global_batch=4", "--train.recompute=selective",
                     f"--parallel.cp_mode={mode}", "--train.precision=bf16"]) == 0
        got[mode] = json.loads(capsys.readouterr().out)
    tokens, seq, dim = 4096, 8192, 4096
    attention = 4.0 * tokens * seq * dim * C.CAUSAL_EXECUTED_FRACTION / (989.4e12 * C.ATTENTION_FRACTION["h100"])
    rerun = got["ring"]["breakdown_s"]["recompute"] - got["ulysses"]["breakdown_s"]["recompute"]
    assert rerun == pytest.approx(32 * attention, rel=1e-6)
    # the core's output (bf16) and LSE (fp32) a token and block, not kept: 2 x 4096 + 4 x 32 bytes
    kept = {mode: got[mode]["memory_detail_gib"]["activations_blocks"] for mode in got}  # GiB to 3 decimals
    assert kept["ulysses"] - kept["ring"] == pytest.approx(32 * tokens * (2 * 4096 + 4 * 32) / 2**30, abs=0.002)
