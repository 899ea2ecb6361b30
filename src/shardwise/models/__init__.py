"""Model code with no parallelism in it. `build_model` picks the architecture from the config.

The torch-backed names (`ARCHS`, `Llama`, `GPT`, `Transformer`) are imported on first use (PEP 562
module `__getattr__`), so that reading `shardwise.models.presets` — which the config does for every
command, and the planner does without torch — does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.config import ModelConfig
    from shardwise.models.common import Transformer

ARCH_NAMES = ("llama", "gpt")
_LAZY = {"Llama": "shardwise.models.llama", "GPT": "shardwise.models.gpt", "Transformer": "shardwise.models.common"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "ARCHS":
        return {"llama": __getattr__("Llama"), "gpt": __getattr__("GPT")}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(cfg: "ModelConfig") -> "Transformer":
    """Construct the model (call under `torch.device("meta")` to allocate nothing)."""
    return __getattr__("ARCHS")[cfg.arch](cfg)


__all__ = ["ARCHS", "ARCH_NAMES", "GPT", "Llama", "Transformer", "build_model"]
