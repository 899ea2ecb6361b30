"""Model code with no parallelism in it. `build_model` picks the architecture from the config.

The shapes and closed-form counts of these modules live one floor down, torch-free, in
spec/shapes.py (the planner reads them without building anything); tests/unit/test_models.py holds
the built modules to them.
"""
from __future__ import annotations

from shardwise.config import ModelConfig
from shardwise.models.common import Transformer
from shardwise.models.gpt import GPT
from shardwise.models.llama import Llama
from shardwise.spec.shapes import ARCH_NAMES

ARCHS: dict[str, type[Transformer]] = {"llama": Llama, "gpt": GPT}
assert tuple(ARCHS) == ARCH_NAMES


def build_model(cfg: ModelConfig) -> Transformer:
    """Construct the model (call under `torch.device("meta")` to allocate nothing)."""
    return ARCHS[cfg.arch](cfg)


__all__ = ["ARCHS", "ARCH_NAMES", "GPT", "Llama", "Transformer", "build_model"]
