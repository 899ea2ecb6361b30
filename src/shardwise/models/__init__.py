"""Model code with no parallelism in it. `build_model` picks the architecture from the config."""
from __future__ import annotations

from shardwise.config import ModelConfig
from shardwise.models.gpt import GPT
from shardwise.models.llama import Llama
from shardwise.models.common import Transformer

ARCHS: dict[str, type[Transformer]] = {"llama": Llama, "gpt": GPT}


def build_model(cfg: ModelConfig) -> Transformer:
    """Construct the model (call under `torch.device("meta")` to allocate nothing)."""
    return ARCHS[cfg.arch](cfg)


__all__ = ["ARCHS", "GPT", "Llama", "Transformer", "build_model"]
