"""What a rank holds: memory by category, the activations autograd saves, and the CUDA allocator's peaks.

Counted from the tensors themselves: docs/architecture.md §9 notes that RSS does not show sharding, so
DTensors are counted by their local shard and every storage only once. The planner predicts these
numbers (tests/dist/test_plan_validation.py); train/metrics.py logs them.
"""
from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.parallel.activation_checkpoint import AlternateMatmuls, UncachedRegions, keeps, uncached_regions_of
from shardwise.tensors import local_shard


def _storage_key(t: torch.Tensor) -> tuple[Hashable | None, int]:
    """(key, bytes) of the storage behind `t`. Views of one storage share a key, so it is counted
    once, in full: a view keeps its whole storage alive. Key None means "cannot dedupe" (meta or
    storage-less tensors), which then count by their own size."""
    t = local_shard(t)
    if isinstance(t, AsyncCollectiveTensor):
        # A functional collective's result (a DTensor redistribution's, e.g. the sequence-parallel embedding's
        # reduce-scatter) is a wrapper with no storage of its own: its tensor's storage is the one kept. Counted
        # by size, the same result saved by two ops counted twice (the first block's norm under SP: one
        # h-wide tensor per token, the TP rows' "-1.6%" in tests/dist/test_plan_validation.py).
        t = t.elem
    try:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, t.nelement() * t.element_size()
    if ptr == 0:
        return None, nbytes
    # nbytes in the key: an address freed and reused for a different-sized storage is a new storage.
    return (str(t.device), ptr, nbytes), nbytes


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages behind `tensors` (DTensors by their local shard)."""
    seen: set[Hashable] = set()
    total = 0
    for t in tensors:
        key, nbytes = _storage_key(t)
        if key is None or key not in seen:
            total += nbytes
            if key is not None:
                seen.add(key)
    return total


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer state this rank holds. ZeroOneOptimizer keeps its
    local shard's state in the wrapped `optimizer.optim.state` (ZeRO-1, arXiv 1910.02054)."""
    inner = getattr(optimizer, "optim", None)
    state = inner.state if isinstance(inner, torch.optim.Optimizer) else optimizer.state
    for per_param in state.values():
        yield from _tensors_in(per_param)


def memory_by_category(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds for "params", "grads", "optimizer" state and "buffers" (docs/architecture.md §5/§6;
    the categories of the model-state count 2Ψ+2Ψ+12Ψ in Rajbhandari et al. 2019, arXiv 1910.02054)."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _resident_optimizer_bytes(optimizer),
        "buffers": tensor_bytes(model.buffers()),
    }


def _resident_optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Optimizer state in memory; the NVMe tier (parallel/offload.py) says itself what it keeps resident
    (its I/O buffers and step counters: the moments are in a file)."""
    if optimizer is None:
        return 0
    resident = getattr(optimizer, "resident_bytes", None)
    return resident() if resident is not None else tensor_bytes(optimizer_state_tensors(optimizer))


def cuda_memory(device: torch.device | int | None = None) -> dict[str, int]:
    """Peak allocated / reserved CUDA bytes on this rank ({} without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device)}


class ActivationMeter:
    """Bytes of the unique storages autograd saves for backward during one forward.

    Uses `torch.autograd.graph.saved_tensors_hooks`: the pack hook sees every tensor saved for
    backward. Parameters (and views of them, e.g. the `weight.t()` that addmm saves) are not
    activations, so their storages are excluded. Pass the model itself as `exclude` to also exclude
    parameters that appear only during forward (FSDP2's unsharded parameters): a forward pre-hook on
    every submodule then adds the parameters registered at call time. Autocast's low-precision weight
    copies are new storages and count as activations (they are held until backward).
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] = (), cached_regions: Iterable[nn.Module] = (),
                 alternate_matmuls: bool = False):
        """`cached_regions`: under selective recomputation ("op", "op_alternate") torch's checkpoint keeps the
        outputs of the ops its policy keeps (matmuls, SDPA: parallel/activation_checkpoint.py `keeps`) run
        inside those blocks in a cache of its own, where saved-tensor hooks cannot see them; a dispatch mode
        counts their storages instead, by the same rule (they are kept until the block's backward, like any
        saved tensor). `alternate_matmuls`: the blocks run "op_alternate"."""
        self.bytes = 0
        self._regions = list(cached_regions)
        self._uncached = UncachedRegions(uncached_regions_of(self._regions))
        self._alternate_matmuls = alternate_matmuls
        self._matmuls: AlternateMatmuls | None = None  # "op_alternate": the running block's count
        self._depth = 0
        self._mode: Any = None
        self._module = exclude if isinstance(exclude, nn.Module) else None
        self._excluded: set[Hashable] = set()
        self._excluded_by: dict[Hashable, torch.Tensor] = {}
        self._seen: set[Hashable] = set()
        self._exclude(exclude.parameters() if self._module is not None else exclude)
        self._handles: list[Any] = []
        self._hooks: Any = None

    def _exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key, _ = _storage_key(t)
            if key is not None:
                self._excluded.add(key)
                self._excluded_by[key] = t

    def _still_excluded(self, key: Hashable) -> bool:
        """An excluded key is stale once its parameter's storage has moved or been freed: FSDP2 frees
        the unsharded parameters after forward (ZeRO-3), and the allocator may hand the address to
        an activation of the same size, which must then be counted."""
        param = self._excluded_by.get(key)
        if param is None or _storage_key(param)[0] == key:
            return True
        self._excluded.discard(key)
        del self._excluded_by[key]
        return False

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        self._exclude(module.parameters())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            key, nbytes = _storage_key(t)
            if key is None:
                self.bytes += nbytes
            elif not (key in self._excluded and self._still_excluded(key)) and key not in self._seen:
                self._seen.add(key)
                self.bytes += nbytes
        # A detached alias, not `t`: for a saved output (ReLU, SDPA out, ...) `t` holds its own
        # grad_fn, and autograd keeping it would be a reference cycle through the C++ graph: the
        # measured micro-batch's graph (and those storages) would never be freed.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _count(self, t: torch.Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key is None or key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes

    def _enter_region(self, *_: Any) -> None:
        if self._depth == 0 and self._alternate_matmuls:  # a block's forward: its matmuls count from one
            self._matmuls = AlternateMatmuls()
        self._depth += 1

    def _leave_region(self, *_: Any) -> None:
        self._depth -= 1

    def __enter__(self) -> ActivationMeter:
        self.bytes = 0
        self._seen.clear()
        if self._module is not None:
            self._handles = [m.register_forward_pre_hook(self._pre_forward) for m in self._module.modules()]
        for region in self._regions:
            self._handles += [region.register_forward_pre_hook(self._enter_region),
                              region.register_forward_hook(self._leave_region)]
        if self._regions:
            self._mode = _CachedOutputs(self)
            self._mode.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []


class _CachedOutputs(TorchDispatchMode):
    """ActivationMeter's count of what selective checkpointing caches (see ActivationMeter.__init__)."""

    def __init__(self, meter: ActivationMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        meter = self.meter
        if meter._depth and keeps(func, meter._uncached, meter._matmuls):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.meter._count(t)
        return out


class _SavedActivation:
    """What PeakActivationMeter's pack hook gives autograd in place of a saved tensor (a detached
    alias: the tensor itself would, for a saved output, hold its own grad_fn, a reference cycle
    through autograd's C++ graph that never frees the graph; unpacking re-attaches it). Autograd keeps
    it as long as the saved tensor: it drops it when the node's backward has run (retain_graph=False;
    a split backward's input pass retains it until the weight pass) or when the graph is freed. The
    finalizer then releases the storage from the meter's live set."""

    __slots__ = ("tensor", "key", "nbytes", "meter")

    def __init__(self, tensor: torch.Tensor, key: Hashable | None, nbytes: int, meter: PeakActivationMeter):
        self.tensor, self.key, self.nbytes, self.meter = tensor, key, nbytes, meter

    def __del__(self) -> None:
        self.meter._release(self.key, self.nbytes)


class PeakActivationMeter(ActivationMeter):
    """The peak, over everything run inside it, of the bytes of the unique storages autograd holds
    saved for backward at once (the exclusion rules of ActivationMeter: parameters, and with a module
    as `exclude` the parameters its submodules hold at call time).

    Under a pipeline schedule a rank runs the forwards and backwards of several micro-batches
    interleaved, so what it needs is the peak of the activations alive at once (1F1B: rank r holds
    p - r micro-batches; GPipe: all m). The pack hook returns a holder (`_SavedActivation`) instead
    of the tensor and the storage counts as live while any holder of it exists (a refcount per
    storage key); `peak` is the maximum of the live bytes; `bytes` counts unique storage keys over the whole run
    (an address freed and reused makes it undercount: use `peak`).
    A live storage cannot be freed, so its address key cannot be reused while it is counted.

    Limits (the same as ActivationMeter's): tensors saved inside a non-reentrant checkpoint region
    (train.recompute = full, selective "layer") are packed by the checkpoint's own inner hooks, so only
    the checkpoint's saved block inputs are seen, and the recomputation in backward (also under the
    checkpoint's hooks) is not; the outputs selective "op" recomputation caches are invisible.
    saved_tensors_hooks are thread-local: the meter must wrap the calls that run the forwards (the
    pipelining schedule runs them on the calling thread); a holder may be released on an autograd
    worker thread, hence the lock.
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] = ()):
        super().__init__(exclude)
        self.live = 0
        self.peak = 0
        self._refs: dict[Hashable, int] = {}
        self._lock = threading.RLock()

    def _pack(self, t: torch.Tensor) -> Any:  # type: ignore[override]
        if isinstance(t, nn.Parameter):
            return t
        key, nbytes = _storage_key(t)
        if key is not None and key in self._excluded and self._still_excluded(key):
            return t
        with self._lock:
            if key is None:
                self.bytes += nbytes
                self.live += nbytes
            else:
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += nbytes
                count = self._refs.get(key, 0)
                self._refs[key] = count + 1
                if count == 0:
                    self.live += nbytes
            self.peak = max(self.peak, self.live)
        return _SavedActivation(t.detach(), key, nbytes, self)

    def _release(self, key: Hashable | None, nbytes: int) -> None:
        with self._lock:
            if key is None:
                self.live -= nbytes
                return
            count = self._refs.pop(key) - 1
            if count:
                self._refs[key] = count
            else:
                self.live -= nbytes

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _SavedActivation) else saved

    def __enter__(self) -> PeakActivationMeter:
        super().__enter__()
        with self._lock:
            self.peak = self.live
        return self
