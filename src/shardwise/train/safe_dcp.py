"""Reading a DCP checkpoint without running code from it (train/checkpoint.py loads through these).

DCP's stock reader unpickles `.metadata` and `torch.load(weights_only=False)`s non-tensor values: a
crafted checkpoint could run code on resume. `.metadata` goes through an unpickler that only builds
DCP's own metadata classes, and non-tensor values must load with weights_only=True first.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# What DCP pickles into `.metadata` (torch 2.13): its metadata dataclasses, torch.Size, dtypes, layouts
# (by name, through torch.serialization._get_layout) and the checkpoint's path.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}
class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP metadata never holds")


def read_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` without running code: only DCP's own classes can be built."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def metadata_problem(step_dir: Path) -> str | None:
    """None when `.metadata` reads safely, else why not."""
    try:
        read_metadata(step_dir / ".metadata")
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # any failure to read it is a reason not to load the checkpoint
        return f"{type(e).__name__}: {e}"
    return None


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through `read_metadata` (the stock one calls pickle.load)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses non-tensor values other than plain data: the stock planner
    torch.load()s them with weights_only=False. A value that loads with weights_only=True holds only
    allow-listed types, so handing the same bytes on to the stock planner runs nothing."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)
