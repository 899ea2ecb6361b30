"""Where a model's initial weights come from: layout-independent random init, or a Hugging Face checkpoint.

parallel/parallelize.py `materialize` asks a source for each parameter's slice (the part this rank
holds of the global tensor, after TP / FSDP / EP / PP). A random init draws the global tensor from a
generator seeded by the parameter's name and keeps the slice (docs/architecture.md §3); a checkpoint
reads only the slice's bytes from its .safetensors file (safetensors' lazy slicing reads the rows and
columns asked for), so no rank ever holds a full copy of a sharded weight.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from shardwise.models.common import Transformer
from shardwise.spec import hf

Index = tuple[slice, ...] | None  # the slice of the global tensor this rank keeps; None = all of it


class WeightSource(Protocol):
    def value(self, fqn: str, shape: torch.Size, index: Index) -> torch.Tensor:
        """The fp32 values of `fqn[index]` (fqn: the model's own parameter name, global `shape`)."""
        ...


class RandomInit:
    """The layout-independent initialisation (Transformer.init_value)."""

    def __init__(self, model: Transformer, seed: int):
        self.model, self.seed = model, seed

    def value(self, fqn: str, shape: torch.Size, index: Index) -> torch.Tensor:
        full = self.model.init_value(fqn, shape, self.seed)
        return full if index is None else full[index]


class HuggingFaceWeights:
    """Slices of a Hugging Face Llama checkpoint's .safetensors files, by our parameter names.

    A tied checkpoint (tie_word_embeddings) gives the head the embedding's values: our head is its own
    parameter, so from here on the two train independently (and export writes them untied)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        self.files = hf.weight_files(directory)
        self._open = {path: safe_open(str(path), framework="pt") for path in sorted(set(self.files.values()))}

    def _slice(self, name: str, index: Index) -> torch.Tensor:
        handle = self._open[self.files[name]].get_slice(name)
        return handle[index] if index is not None else handle[:]

    def value(self, fqn: str, shape: torch.Size, index: Index) -> torch.Tensor:
        name = hf.hf_name(fqn)
        if name == "lm_head.weight" and name not in self.files:
            name = "model.embed_tokens.weight"
        return self._slice(name, index).to(torch.float32)


def weight_source(model: Transformer, init_from: str, seed: int) -> WeightSource:
    directory = hf.hf_directory(init_from)
    return RandomInit(model, seed) if directory is None else HuggingFaceWeights(directory)
