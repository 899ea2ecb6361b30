"""Key/value cache for incremental decoding: prefill the prompts once, then one token per step.

Each attention layer appends its new keys and values and attends over everything cached, so a decode
step costs one token's projections plus a read of the cache instead of recomputing the prefix (the
"KV cache" of Pope et al. 2022, Efficiently Scaling Transformer Inference, §2.1). Model code with no
parallelism in it: under tensor parallelism each rank's layers simply see (and cache) their own heads.

Batches of prompts of different lengths are left-padded: every sequence's next token is then at the
same cache index, and `valid` marks the padding, which no real token attends to. Positions (for RoPE
or learned position embeddings) count real tokens only, so a padded prompt computes exactly what it
would alone.
"""
from __future__ import annotations

import torch


def attention_mask(slots: torch.Tensor, queries: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(b, 1, s, slots) boolean mask, broadcast over heads: query i (at cache slot queries[i]) sees slot j
    when j is a real token (valid) at or before it, and always its own slot (see KVCache.begin)."""
    causal = slots[None, :] <= queries[:, None]  # (s, slots)
    return ((causal[None] & valid[:, None, :]) | (slots[None, None, :] == queries[None, :, None]))[:, None]


class LayerCache:
    """One attention layer's keys and values, allocated on first use as (batch, local kv heads,
    capacity, head_dim): the heads this rank holds, in the dtype the layer computes in."""

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (b, heads, s, hd) keys and values; return every cached one so far."""
        start, s = self.owner.length, k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.capacity, k.shape[3])
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, start:start + s] = k
        self.v[:, :, start:start + s] = v
        return self.k[:, :, :start + s], self.v[:, :, :start + s]


class KVCache:
    """Every layer's cache for one batch, plus the attention mask of the tokens being added.

    Call `begin(valid)` before a forward over new tokens (prefill: the padded prompts; decode: one
    token each) and `end()` after it."""

    def __init__(self, batch: int, capacity: int, device: torch.device):
        self.batch, self.capacity, self.device = batch, capacity, device
        self.length = 0  # cache slots filled so far (the same for every sequence)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # real token (not padding) per slot
        self.mask: torch.Tensor | None = None
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self)
        return self.layers[name]

    def positions(self, valid: torch.Tensor) -> torch.Tensor:
        """(b, s) position of each new token: the number of real tokens before it in its sequence."""
        before = self.valid.sum(dim=1, keepdim=True)
        return (before + valid.long().cumsum(dim=1) - 1).clamp(min=0)

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Make room for `valid.shape[1]` new tokens; returns their positions. The mask lets query i see
        key j when j is a real token at or before it; a padding query also sees itself, so its row
        has one finite score (its output is never used, but NaN there would reach the real rows
        through 0 x NaN in the next layer's attention)."""
        s = valid.shape[1]
        if self.length + s > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens; {self.length + s} asked")
        positions = self.positions(valid)
        self.valid = torch.cat([self.valid, valid.to(self.device)], dim=1)
        queries = torch.arange(self.length, self.length + s, device=self.device)
        self.mask = attention_mask(torch.arange(self.length + s, device=self.device), queries, self.valid)
        return positions

    def end(self, s: int) -> None:
        self.length += s
        self.mask = None

    def keep_rows(self, keep: list[int]) -> "KVCache":
        """Only the sequences in rows `keep`, in that order, from here on (the engine drops finished ones
        from the batch): the rows are copied out, the others' memory freed."""
        index = torch.tensor(keep, device=self.device)
        self.batch, self.valid = len(keep), self.valid.index_select(0, index)
        for cache in self.layers.values():
            if cache.k is not None:
                cache.k, cache.v = cache.k.index_select(0, index), cache.v.index_select(0, index)
        return self

    def nbytes(self) -> int:
        """Bytes allocated for keys and values on this rank (the planner's kv-cache term)."""
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers.values() if c.k is not None)


def static(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile that `t` keeps its address from step to step: a CUDA graph then reads and writes
    it in place. Without it the graph's in-place writes to the cache (an input it mutates) make inductor
    skip CUDA graphs altogether ("skipping cudagraphs due to mutated inputs"), and each step pays one
    launch per kernel again. guard=False: a cache at a new address re-records the graph, never recompiles."""
    torch._dynamo.mark_static_address(t, guard=False)
    return t


class StaticLayerCache:
    """A `LayerCache` whose keys and values live at fixed addresses for the whole generation: written at
    the owner's `slots` (a tensor) and always returned whole, so a step's shapes never change."""

    def __init__(self, owner: "StaticKVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def allocate(self, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Keys and values of (batch, heads, capacity, head_dim), before any compiled step runs: a graph
        must find them (allocating inside one would trace the static marking)."""
        shape = (self.owner.batch, heads, self.owner.capacity, head_dim)
        self.k = static(torch.zeros(shape, dtype=dtype, device=self.owner.device))
        self.v = static(torch.zeros(shape, dtype=dtype, device=self.owner.device))

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:  # an eager first use allocates (the engine allocates up front: Engine.static_cache)
            self.allocate(k.shape[1], k.shape[3], k.dtype)
        self.k.index_copy_(2, self.owner.slots, k)
        self.v.index_copy_(2, self.owner.slots, v)
        return self.k, self.v


class StaticKVCache(KVCache):
    """The KV cache of a compiled decode step (infer/engine.py): every buffer is allocated once at the
    full capacity and addressed by position tensors, so one decode step is one graph with the same
    shapes every time — torch.compile traces it once (and on a GPU replays it as a CUDA graph) instead
    of recompiling as the cache grows (the static cache of gpt-fast and transformers'
    cache_implementation="static"). Attention covers every slot; the mask hides the unwritten ones, so
    each query sees exactly the keys `KVCache` would give it."""

    def __init__(self, batch: int, capacity: int, device: torch.device, rows_of: "StaticKVCache | None" = None):
        """`rows_of`: no buffers of its own, views of the first `batch` rows of that cache's (keep_rows)."""
        super().__init__(batch, capacity, device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)
        if rows_of is None:
            self.valid = static(torch.zeros(batch, capacity, dtype=torch.bool, device=device))
            self.filled = static(torch.zeros((), dtype=torch.long, device=device))  # slots written, as a tensor
            self.keys = static(torch.arange(capacity, device=device))
            return
        self.valid, self.filled, self.keys = static(rows_of.valid[:batch]), rows_of.filled, rows_of.keys
        self.length = rows_of.length
        for name, cache in rows_of.layers.items():
            if cache.k is not None:
                mine = self.layer(name)
                mine.k, mine.v = static(cache.k[:batch]), static(cache.v[:batch])

    def keep_rows(self, keep: list[int]) -> "StaticKVCache":  # type: ignore[override]
        """The cache of the rows `keep` only, moved (in that order) to the front of the same buffers and
        viewed there: no new memory, and the views start at the buffers' addresses, so the compiled step
        of the smaller batch (a graph of its own) finds the same addresses in every generation and
        replays its CUDA graph. The full cache stays the engine's, emptied for the next generation."""
        index = torch.tensor(keep, device=self.device)
        for t in (self.valid, *(t for c in self.layers.values() for t in (c.k, c.v) if t is not None)):
            t[:len(keep)] = t.index_select(0, index)  # a copy first: rows may move onto rows still to be read
        return StaticKVCache(len(keep), self.capacity, self.device, rows_of=self)

    def reset(self) -> None:
        """Empty the cache in place for the next generation, keeping every buffer's address (what the
        compiled step's CUDA graph was recorded with). Stale keys and values stay behind the mask: `valid`
        is all False, so no query sees them, and masked scores weigh exactly 0."""
        self.valid.zero_()
        self.filled.zero_()
        self.length, self.mask = 0, None

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the compiled step reads or writes in place."""
        kv = [t for c in self.layers.values() for t in (c.k, c.v) if t is not None]
        return [self.valid, self.filled, self.keys, *kv]

    def layer(self, name: str) -> StaticLayerCache:  # type: ignore[override]
        if name not in self.layers:
            self.layers[name] = StaticLayerCache(self)
        return self.layers[name]  # type: ignore[return-value]

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """`KVCache.begin` with tensor arithmetic only (no Python value of the cache's fill in the graph);
        the capacity is checked by the caller, which counts the steps (`end`)."""
        self.slots = self.filled + torch.arange(valid.shape[1], device=self.device)
        positions = self.positions(valid)  # unwritten slots are not valid: the sum counts the real tokens so far
        self.valid.index_copy_(1, self.slots, valid.to(self.device))
        self.mask = attention_mask(self.keys, self.slots, self.valid)
        return positions

    def advance(self, s: int) -> None:
        """The tensor half of `end`: inside a compiled step (the Python count is kept outside it)."""
        self.filled.add_(s)

    def end(self, s: int) -> None:
        self.advance(s)
        self.length += s
