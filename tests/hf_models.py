"""Small random Hugging Face Llama checkpoints built offline (nothing is downloaded), for the interop tests.

transformers and safetensors are test dependencies: a test module importing this one is skipped,
with the reason printed, where they are missing.
"""
from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install -e '.[test]')")

import torch  # noqa: E402

# Two shapes the parity tests cover: grouped-query (4 query heads over 2 KV heads) and multi-head.
SHAPES = {
    "gqa": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "mha": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
}


def save_random_llama(directory: Path, shape: str = "gqa", tied: bool = False, seed: int = 0, vocab: int = 320,
                      max_shard_size: str | None = None, **overrides) -> Path:
    """A random LlamaForCausalLM in `directory` (fp32 safetensors); its weights are drawn with a std large
    enough (0.2) that a wrong name mapping or transposition changes the logits far above any tolerance."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=128, rms_norm_eps=1e-5,
                                      tie_word_embeddings=tied, initializer_range=0.2,
                                      **(SHAPES[shape] | overrides))
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1; random ones test that they are mapped too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def load_hf(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
