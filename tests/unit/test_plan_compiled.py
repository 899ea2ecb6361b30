"""plan/compiled.py's inventory of a compiled block, held to what inductor's partitioner saves: a llama and a
gpt block compiled on this CPU under bf16 autocast with fp32 weights (the planner's "autocast" regime), its saved
storages summed by the trainer's activation meter (train/memory_meter.py ActivationMeter)."""
from __future__ import annotations

import pytest
import torch

from shardwise.config import ModelConfig
from shardwise.models.common import RotaryEmbedding
from shardwise.models.llama import LlamaBlock
from shardwise.plan import compiled as K
from shardwise.spec.shapes import ModelShape
from shardwise.train.memory_meter import ActivationMeter

pytest.importorskip("torch._inductor")


def _saved_bytes(call, block: torch.nn.Module, rope: RotaryEmbedding, x: torch.Tensor) -> int:
    # The trainer's own meter; RoPE tables are counted per stage, not per block.
    with ActivationMeter(exclude=[*block.parameters(), *rope.buffers()]) as meter, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        y = call(x)
    y.float().sum().backward()
    return meter.bytes


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_a_compiled_block_saves_what_the_inventory_says(arch, fused):
    """`fused`: train.fuse_projections (the joined weights keep no 16-bit copies: activations.fused_projection_delta)."""
    from shardwise.models.feed_forward import fuse_training_projections
    from shardwise.models.gpt import GPTBlock
    from shardwise.plan.activations import fused_projection_delta

    torch._dynamo.reset()  # a fresh compile of the block class's code for each case
    torch.manual_seed(0)
    h, b, s = 256, 2, 64
    cfg = ModelConfig(arch=arch, dim=h, n_layers=1, n_heads=2, n_kv_heads=1 if arch == "llama" else 2,
                      ffn_dim=704 if arch == "llama" else 1024, vocab_size=256, max_seq_len=s, norm_eps=1e-5,
                      rope_theta=10000.0)
    rope = RotaryEmbedding(h // 2, s, 10000.0)
    rope.reset_buffers()
    block = LlamaBlock(cfg) if arch == "llama" else GPTBlock(cfg)
    if fused:
        assert fuse_training_projections(block) == (2 if arch == "llama" else 1)
    compiled = torch.compile(block)
    call = (lambda x: compiled(x, rope)) if arch == "llama" else compiled
    x = torch.randn(b, s, h, requires_grad=True)
    _saved_bytes(call, block, rope, x)  # compile (first call)
    measured = _saved_bytes(call, block, rope, x)
    shape = ModelShape.from_config(cfg)
    inv = K.block_bytes(shape, "autocast", 1, False)
    delta = fused_projection_delta(shape, "autocast", True) if fused else None
    # The inventory counts the block input (r h per token: the caller's tensor, saved by the graph too)
    # and, under autocast, the 16-bit weight copies (`fixed`), less the joined ones.
    assert measured == (inv.per_token + (delta.per_token if fused else 0)) * b * s + inv.fixed + (delta.fixed if fused else 0)
