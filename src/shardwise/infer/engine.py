"""Generation with a KV cache on one process, or tensor- and pipeline-parallel over several.

Serving splits one model replica, never replicates it (data parallelism is separate replicas): each
rank holds its pipeline stage's blocks (the training split, spec/stages.py), tensor-parallel as in
training but without sequence parallelism (a decode step has one token per sequence). A step runs the
stages one after another, hidden states sent point-to-point (torch.distributed send / recv): decoding
is latency-bound, so the pipeline is not filled with micro-batches. The last stage picks the next
tokens and broadcasts them to every rank, which all keep the same positions and masks.

The weights come from a Hugging Face directory (models/weights.py: each rank reads its slices) or from
a training run's checkpoint (DCP reshards it onto this layout).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.profiler import record_function

from shardwise.config import Config
from shardwise.infer.sampling import Sampler, draw_in_graph, vocab_parallel_argmax
from shardwise.models import ARCHS, build_model
from shardwise.models.common import Attention
from shardwise.models.kv_cache import KVCache, StaticKVCache
from shardwise.models.weights import weight_source
from shardwise.parallel.expert import moe_modules
from shardwise.parallel.mesh import build_meshes
from shardwise.parallel.parallelize import materialize
from shardwise.parallel.precision import set_matmul_precision
from shardwise.parallel.tensor import apply_tensor_parallel
from shardwise.preflight import check_generation_length, check_serving
from shardwise.spec.stages import layers_per_stage, stage_layers
from shardwise.train.checkpoint import load_model_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CAPACITY_BUCKET = 64  # slots: a compiled decode step is specialised to its cache's capacity
DONE_CHECK_EVERY = 8  # greedy compiled decoding looks at the ids (end tokens) every this many steps
# On a GPU a block's ids come back while the next block runs, and are read this many steps into it
# (Engine._decode_on_device): the host has long passed them, and the GPU still has steps queued.
READ_BACK_AT = 4
# The compiled steps' inductor options on a GPU, over CUDA graphs (compile_settings): combo kernels. A tuple
# of pairs: a module-level constant stays immutable.
GPU_DECODE_OPTIONS = (("combo_kernels", True),)
# torch.profiler ranges around a generation's two phases (benchmarks/decode.py --profile reads the decode
# steps' kernels from inside DECODE_MARK); when nothing profiles, a range costs a check.
PREFILL_MARK, DECODE_MARK = "shardwise.prefill", "shardwise.decode"


def bucket(n: int) -> int:
    """`n` rounded up to a whole number of CAPACITY_BUCKET."""
    return -(-n // CAPACITY_BUCKET) * CAPACITY_BUCKET


def _vocab_sharded(logits: DTensor) -> bool:
    (placement,) = logits.placements  # serving's TP mesh is 1-D
    return isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1)


@dataclass
class Generation:
    ids: list[list[int]]  # generated ids after each prompt (up to and including an end token)
    prefill_tokens: int  # real (unpadded) prompt tokens
    prefill_s: float
    decode_tokens: int  # tokens the sequences got from decode steps (after the first, which prefill produced)
    decode_s: float
    decode_rows: int  # rows the decode steps computed: decode_tokens plus finished sequences' rows run on
    kv_cache_bytes: int  # this rank's allocated keys and values

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def compile_settings(device_type: str, mode: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """torch.compile's mode or options for the compiled steps on `device_type`. On a GPU, CUDA graphs
    (what mode "reduce-overhead" sets: every step one graph replay instead of one launch per kernel, which
    bounds eager decoding: 886M bf16 at batch 1 on an H100, 888 tokens/s against 61 eager) with inductor's
    combo kernels (GPU_DECODE_OPTIONS: independent small kernels of a step, e.g. the norms' and rotary
    embeddings' pointwise work beside each other, launched as one): measured on an H200 (torch 2.11,
    886M bf16, batch 1, `decode.py --compare-mode combo_kernels=1`, 2026-11-28), 1,099 tokens/s against
    1,011 with CUDA graphs alone, 1.087x, the same greedy ids, and the compiled prefill 37.6k tokens/s
    against 33.7k. Measured and not taken: coordinate_descent_tuning, with which inductor rewrites each
    one-row decode GEMM as a multiply-and-sum it generates and tunes (torch/_inductor/decomposition.py
    `mm`): 782 tokens/s against 888 (H100, torch 2.11, `decode.py --batches 1 --compare-mode`), 0.88x.
    On a CPU: inductor's defaults. `mode` (benchmarks/decode.py --compile-mode, --compare-mode): a mode
    name, used as it is, or inductor options (e.g. {"combo_kernels": False}), on a GPU over CUDA graphs
    (torch.compile takes a mode or options, not both)."""
    if mode is None and device_type == "cuda":
        mode = dict(GPU_DECODE_OPTIONS)
    if isinstance(mode, dict):
        return {"options": {**({"triton.cudagraphs": True} if device_type == "cuda" else {}), **mode}}
    return {} if mode is None else {"mode": mode}


def serving_tf32(dtype: str) -> bool:
    """TF32 for fp32 matmuls on a GPU when serving in 16 bits: every GEMM of the model then runs in bf16 /
    fp16, so nothing changes, but inductor stops warning that TF32 is "available but not enabled" when it
    compiles the steps (seen in GPU runs of `generate`). An fp32 engine keeps full fp32: its
    greedy ids must equal transformers' (gpu_check.py hf/import)."""
    return dtype != "float32"


class Engine:
    """One rank's share of the model, ready to prefill and decode."""

    def __init__(self, cfg: Config, device: torch.device, dtype: str = "float32", checkpoint: Path | None = None,
                 fuse_projections: bool = True, compile_mode: str | dict[str, Any] | None = None):
        """`fuse_projections`: on one TP rank, q|k|v and w1|w3 as one GEMM each (False: the benchmark's
        comparison). `compile_mode`: torch.compile's mode or inductor options for the compiled steps
        (compile_settings; benchmarks/decode.py --compile-mode compares others)."""
        self.cfg, self.device, self.compile_mode = cfg, device, compile_mode
        set_matmul_precision(serving_tf32(dtype), device)
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        world = dist.get_world_size() if distributed else 1
        self.dims = check_serving(cfg, world)
        self.mesh = build_meshes(self.dims, device.type)
        coords = self.dims.coordinates(self.rank)
        self.pp_rank, self.pp = coords["pp"], self.dims.pp
        with torch.device("meta"):
            model = build_model(cfg.model)
        if self.pp > 1:
            # An even split, one stage per rank (serving_rules; the planner prices the same split).
            p = dataclasses.replace(cfg.parallel, pp_virtual_stages=1, pp_split="even", pp_layers_per_stage=[],
                                    pp_schedule="1f1b")
            costs = ARCHS[cfg.model.arch].pipeline_costs(cfg.model, cfg.train.seq_len)
            layers = stage_layers(layers_per_stage(p, cfg.model, cfg.train.seq_len, costs))
            model.keep_only(layers[self.pp_rank], embedding=self.pp_rank == 0, head=self.pp_rank == self.pp - 1)
            self.pp_group = self.mesh["pp"].get_group()
        if self.dims.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], cfg.model, sequence_parallel=False)
        # From a checkpoint, DCP fills every weight: no initial values to draw first.
        materialize(model, device, None if checkpoint else weight_source(model, cfg.model.init_from, cfg.train.seed))
        if checkpoint is not None:
            load_model_weights(checkpoint, model)
        self.model = model.to(DTYPES[dtype]).eval()
        self.dtype = DTYPES[dtype]
        if fuse_projections and self.dims.tp == 1:  # q|k|v and w1|w3 as one GEMM each (models/feed_forward.py fuse_linears)
            for module in self.model.modules():
                if hasattr(module, "fuse_projections"):
                    module.fuse_projections()
        # A rank of the last stage decides the next tokens (its TP peers compute the same full logits).
        self.last_rank = next(r for r in range(world) if self.dims.coordinates(r)["pp"] == self.pp - 1)
        self._compiled: dict[str, Any] = {}  # the compiled steps (_compile), built on first use
        self._static_cache: StaticKVCache | None = None  # kept between generations (static_cache)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                last_only: bool = False, gather: bool = True) -> torch.Tensor | None:
        """Logits (b, s or 1, vocab) on the last pipeline stage's ranks, None on the others. Under tensor
        parallelism they are vocab-sharded; `gather=False` leaves them so (a DTensor: `choose`)."""
        out = self._through_stage(lambda x: self.model(x, positions, cache, last_only=last_only), tokens)
        return out.full_tensor() if gather and isinstance(out, DTensor) else out

    def _through_stage(self, run, tokens: torch.Tensor, *args) -> torch.Tensor | None:
        """`run(x, *args)` on this pipeline stage (the model's forward, or a compiled step of it), `x` being
        the (b, s) `tokens` on the first stage and the hidden states received from the previous stage on
        the others. Its output goes on to the next stage; the last stage's is returned, None elsewhere.
        The point-to-point transfers stay outside any compiled graph: each stage's step is one graph."""
        if self.pp_rank == 0:
            x = tokens.to(self.device)
        else:
            x = torch.empty(*tokens.shape, self.cfg.model.dim, dtype=self.dtype, device=self.device)
            dist.recv(x, group=self.pp_group, group_src=self.pp_rank - 1)
        out = run(x, *args)
        if self.pp_rank < self.pp - 1:
            # A copy: a CUDA graph's output buffer is overwritten by its next replay.
            dist.send(out.clone(), group=self.pp_group, group_dst=self.pp_rank + 1)
            return None
        return out

    def choose(self, logits: torch.Tensor | None, sampler: Sampler, running: "Running") -> torch.Tensor:
        """The next ids (b,) on the CPU of every rank, from the last position's logits (b, vocab) of the last
        stage, chosen on its device (infer/sampling.py). Under TP from the vocab shards (Sampler.vocab_parallel):
        b maxima and ids per rank (greedy), or each rank's most probable candidates (sampling), cross the TP
        group instead of b x vocab logits."""
        if logits is None:
            chosen = torch.zeros(len(running.rows), dtype=torch.long)
        elif isinstance(logits, DTensor) and _vocab_sharded(logits):
            chosen = sampler.vocab_parallel(logits, rows=running.rows, sequences=len(running.out))
        else:
            full = logits.full_tensor() if isinstance(logits, DTensor) else logits
            chosen = sampler(full, rows=running.rows, sequences=len(running.out))
        return self._share(chosen).cpu()

    def _share(self, ids: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor:
        """The ids of `last_rank` (a rank of the last stage) on every rank's device: the first stage feeds
        them to the next step. `ids` None (a rank before the last stage): received into a buffer shaped
        as `like`."""
        if not dist.is_initialized():
            return ids.to(self.device)
        ids = ids.to(self.device).contiguous() if ids is not None else torch.empty_like(like, device=self.device)
        dist.broadcast(ids, src=self.last_rank)
        return ids

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _decode_step(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """One decode step over a static cache, what torch.compile traces: the same shapes and the same
        Python values every step (the cache's fill is a tensor), so it is compiled once."""
        return self._forward_into_cache(tokens, torch.ones(tokens.shape[:2], dtype=torch.bool, device=self.device), cache)

    def _forward_into_cache(self, tokens: torch.Tensor, valid: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """New tokens through the model into the static cache, `valid` marking the real ones: the prefill
        (prompts left-padded to a bucket of CAPACITY_BUCKET, compiled once per batch size and bucket)
        and each decode step (one token per sequence)."""
        positions = cache.begin(valid)
        logits = self.model(tokens, positions, cache, last_only=True)
        cache.advance(tokens.shape[1])
        return logits

    def _greedy_step(self, tokens: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """`_decode_step` and the argmax in the same graph: (b, 1) next ids on the device, which feed the
        next step without a trip to the host (Sampler's greedy choice: the argmax of fp32 logits; under
        TP from the vocab shards, vocab_parallel_argmax). A stage before the last returns its hidden
        states, which `_through_stage` sends on."""
        out = self._decode_step(tokens, cache)
        if self.pp_rank < self.pp - 1:
            return out
        last = out[:, -1]
        if isinstance(last, DTensor) and _vocab_sharded(last):
            return vocab_parallel_argmax(last)[:, None]
        return (last.full_tensor() if isinstance(last, DTensor) else last).float().argmax(dim=-1, keepdim=True)

    def _sampled_step(self, tokens: torch.Tensor, cache: StaticKVCache, uniform: torch.Tensor, temperature: float,
                      top_p: float) -> torch.Tensor:
        """`_decode_step` and the sampled choice in the same graph (sampling.draw_in_graph, given the step's
        numbers `uniform`): (b, 1) next ids on the device, like `_greedy_step`; one process or a pipeline
        (under TP the choice is made from the vocabulary shards on the host's schedule: Engine.choose)."""
        out = self._decode_step(tokens, cache)
        if self.pp_rank < self.pp - 1:
            return out
        return draw_in_graph(out[:, -1], uniform, temperature, top_p)[:, None]

    def static_cache(self, batch: int, capacity: int) -> StaticKVCache:
        """The static cache for a generation, reused (emptied in place) while the batch and capacity stay
        the same: its buffers keep their addresses, so the CUDA graph recorded for the first generation
        replays for the next ones instead of being recorded again (transformers keeps its static cache
        between generate calls for the same reason)."""
        cache = self._static_cache
        if cache is not None and (cache.batch, cache.capacity) == (batch, capacity):
            cache.reset()
            return cache
        self._static_cache = None  # free the old buffers before allocating the new ones
        cache = StaticKVCache(batch, capacity, self.device)
        for name, block in self.model.named_blocks():  # every layer's keys and values, before any graph
            attention = next(m for m in block.modules() if isinstance(m, Attention))
            weight = attention.wk.weight  # under TP a DTensor: this rank caches only its own kv heads
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            cache.layer(name).allocate(local.shape[0] // attention.head_dim, attention.head_dim, self.dtype)
        self._static_cache = cache
        return cache

    def _compile(self, kind: str, sampler: Sampler | None = None):
        """The compiled step of `kind` ("logits", "greedy", "sampled": the decode steps; "prefill"), built on
        first use with `compile_settings` (CUDA graphs on a GPU, inductor's kernels on a CPU); "sampled":
        one per temperature and top_p of `sampler`. dynamic=False: a new batch size or capacity is a new
        graph, never a dynamic-shape one."""
        if not self._compiled:
            # MoE feed-forwards stay eager, as in training (parallel/compile.py apply_compile: data-dependent
            # routing and Python-side load statistics): the step is then a few graphs around them.
            for block in self.model.blocks():
                for moe in moe_modules(block):
                    moe.forward = torch.compiler.disable(moe.forward)
        key = (kind, sampler.temperature, sampler.top_p) if kind == "sampled" else kind
        if key not in self._compiled:
            if kind == "sampled":
                def step(tokens, cache, uniform, temperature=sampler.temperature, top_p=sampler.top_p):
                    return self._sampled_step(tokens, cache, uniform, temperature, top_p)
            else:
                step = {"logits": self._decode_step, "greedy": self._greedy_step, "prefill": self._forward_into_cache}[kind]
            self._compiled[key] = torch.compile(step, dynamic=False, **compile_settings(self.device.type, self.compile_mode))
        return self._compiled[key]

    def _decode_on_device(self, first: torch.Tensor, cache: StaticKVCache, max_new_tokens: int,
                          running: "Running", sampler: Sampler) -> None:
        """Compiled decoding with no host round trip per step: each step's ids stay on the device and feed
        the next step, so the host queues steps ahead of the GPU (a CUDA graph replay each) instead of
        waiting for every token. The ids come back to the host every DONE_CHECK_EVERY steps, where
        `running` keeps what each sequence produced up to its end token and says which rows to keep
        (`Running.shrink`, at a block's end); a finished sequence costs at most DONE_CHECK_EVERY - 1 steps
        more in its row, whose ids are dropped. On a GPU (ids_read_back_async) a block's ids are copied to
        the host behind its steps and read READ_BACK_AT steps into the next block, so the GPU never waits
        for the host to read them (the H200 profile: 16% of a batch-1 step's wall time idle, 2026-11-28);
        a finished sequence then costs up to DONE_CHECK_EVERY + READ_BACK_AT - 1 steps. Sampled: the
        block's random numbers are drawn up front, one step's after another as the step-by-step loop
        draws them (Sampler.uniform), so the ids are the same."""
        ids, pending, unread = first[:, None].to(self.device), [], []
        step = self._compile("greedy") if sampler.greedy else self._compile("sampled", sampler)
        later = ids_read_back_async(self.device.type)
        for n in range(1, max_new_tokens):
            extra: tuple[torch.Tensor, ...] = ()
            if not sampler.greedy:
                if not pending:  # a block's numbers: each row its own sequence's (Running.rows)
                    steps = min(DONE_CHECK_EVERY, max_new_tokens - n)
                    draws = torch.stack([sampler.uniform(running.rows, len(running.out), torch.device("cpu"))
                                         for _ in range(steps)]).to(self.device)
                extra = (draws[len(pending)],)
            out = self._through_stage(step, ids, cache, *extra)
            # A copy: the graph's output buffer is overwritten by its next replay. Under TP alone every
            # rank chose the same ids (vocab_parallel_argmax): only a pipeline's first stage needs them sent.
            ids = out.clone() if self.pp == 1 else self._share(out, like=ids)
            cache.length += 1
            running.rows_computed += ids.shape[0]
            pending.append(ids)
            last = n == max_new_tokens - 1
            if len(pending) == READ_BACK_AT and unread and unread.pop(0).take(running):  # the previous block
                return
            if len(pending) == DONE_CHECK_EVERY or last:
                unread.append(IdsOnTheWay.start(torch.cat(pending, dim=1), running.rows, later and not last))
                pending = []
                while unread and (unread[0].arrived or last):  # every rank alike: no race with the copy
                    if unread.pop(0).take(running):
                        return
                keep = running.shrink(bucketed=True)
                if keep is not None:
                    cache, ids = cache.keep_rows(keep), ids[torch.tensor(keep, device=self.device)]

    def _decode(self, chosen: torch.Tensor, cache: KVCache | StaticKVCache, max_new_tokens: int, running: "Running",
                sampler: Sampler, compiled: bool) -> None:
        """The decode steps after the prefill chose `chosen`: on the device (compiled, `_decode_on_device`) or
        one step at a time with the host choosing each token."""
        if compiled and (sampler.greedy or self.dims.tp == 1):
            self._decode_on_device(chosen, cache, max_new_tokens, running, sampler)
            return
        step_tokens = chosen[:, None]
        for _ in range(1, max_new_tokens):
            if compiled:
                logits = self._through_stage(self._compile("logits"), step_tokens, cache)
                cache.length += 1
            else:
                positions = cache.begin(torch.ones(len(running.rows), 1, dtype=torch.bool, device=self.device))
                logits = self.forward(step_tokens, positions, cache, last_only=True, gather=False)
                cache.end(1)
            running.rows_computed += step_tokens.shape[0]
            chosen = self.choose(None if logits is None else logits[:, -1], sampler, running)
            if running.take(chosen[:, None]):
                break
            step_tokens = chosen[:, None]
            keep = running.shrink(bucketed=compiled)
            if keep is not None:
                cache, step_tokens = cache.keep_rows(keep), step_tokens[keep]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler,
                 eos_ids: set[int] | frozenset[int] = frozenset(), compiled: bool = False,
                 compact: bool = True) -> Generation:
        """Left-pad the prompts, prefill them in one forward, then decode one token per step (`compiled`:
        the prefill and each step one compiled graph over a static cache, `_compile`). `compact`: drop
        finished sequences from the batch (Running.shrink); False keeps every row to the end (the
        benchmark's comparison)."""
        b, longest = len(prompts), max(len(p) for p in prompts)
        check_generation_length(self.cfg, longest, max_new_tokens)
        # Compiled: the prompts are left-padded to a bucket of 64 and the cache's capacity rounded up to
        # one, so other prompts and lengths mostly reuse the compiled prefill and decode steps.
        width = bucket(longest) if compiled else longest
        tokens = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[i, width - len(p):] = True
        if compiled:
            cache = self.static_cache(b, bucket(width + max_new_tokens))
        else:
            cache = KVCache(b, longest + max_new_tokens, self.device)
        running = Running(b, eos_ids, compact)

        self._sync()
        start = time.perf_counter()
        with record_function(PREFILL_MARK):
            if compiled:  # the padded prompts in one forward: one compiled graph per batch size and bucket
                logits = self._through_stage(self._compile("prefill"), tokens, valid.to(self.device), cache)
                cache.length += width
            else:
                positions = cache.begin(valid.to(self.device))
                logits = self.forward(tokens, positions, cache, last_only=True, gather=False)
                cache.end(width)
            chosen = self.choose(None if logits is None else logits[:, -1], sampler, running)
            ended = running.take(chosen[:, None])
        kv_bytes = cache.nbytes()  # allocated by now (the eager cache allocates on first use), before any shrinking
        self._sync()
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        if not ended:
            with record_function(DECODE_MARK):
                self._decode(chosen, cache, max_new_tokens, running, sampler, compiled)
        self._sync()
        decode_s = time.perf_counter() - start
        decode_tokens = sum(max(0, len(o) - 1) for o in running.out)
        return Generation(running.out, int(valid.sum()), prefill_s, decode_tokens, decode_s if decode_tokens else 0.0,
                          running.rows_computed, kv_bytes)


def ids_read_back_async(device_type: str) -> bool:
    """Whether a compiled decode block's ids come back to the host behind the next block's steps (a GPU:
    the copy is asynchronous, and waiting for it would leave the GPU idle until the host queues again),
    or at once (a CPU computes each step before the host goes on: nothing to overlap)."""
    return device_type == "cuda"


@dataclass
class IdsOnTheWay:
    """A decode block's ids on their way to the host, with the batch's rows when the block ran."""

    ids: torch.Tensor  # (rows, steps) on the host: pinned, and being filled while `copied` is pending
    rows: list[int]
    copied: Any = None  # torch.cuda.Event recorded after the copy; None: the ids are there

    @classmethod
    def start(cls, ids: torch.Tensor, rows: list[int], asynchronous: bool) -> "IdsOnTheWay":
        if not asynchronous:
            return cls(ids.cpu(), list(rows))
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(host, list(rows), copied)

    @property
    def arrived(self) -> bool:
        """Read at once (no copy pending): decided when the block started back, the same on every rank."""
        return self.copied is None

    def take(self, running: "Running") -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        return running.take(self.ids, self.rows)


class Running:
    """The sequences of one generation: what each has produced, which have ended, and which sequence each
    row of the running batch holds (rows shrink as sequences end: `shrink`)."""

    def __init__(self, batch: int, eos_ids: set[int] | frozenset[int], compact: bool):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.done = [False] * batch
        self.rows = list(range(batch))  # rows[r]: the sequence in row r of the batch
        self.eos_ids, self.compact = eos_ids, compact
        self.rows_computed = 0  # rows the decode steps ran, finished sequences' included

    def take(self, chosen: torch.Tensor, rows: list[int] | None = None) -> bool:
        """Append (rows, k) ids on the CPU, k steps' worth, to the unfinished sequences; True once all ended.
        `rows`: the batch's rows when those steps ran (default: now). Python lists, not tensor indexing: at
        batch 64 that would cost a GPU step's time per token."""
        rows = self.rows if rows is None else rows
        for column in zip(*chosen.tolist()):
            for row, token in enumerate(column):
                i = rows[row]
                if not self.done[i]:
                    self.out[i].append(token)
                    self.done[i] = token in self.eos_ids
            if all(self.done):
                return True
        return False

    def shrink(self, bucketed: bool) -> list[int] | None:
        """The rows to keep, once at most half the rows hold unfinished sequences: theirs, and with
        `bucketed` (compiled steps: each batch size is a graph of its own) finished ones up to the next
        power of two; None: go on as is. Halving bounds the copies (each moves the kept rows of the
        cache once: together less than one whole cache) and the compiled graphs (log2 of the batch)."""
        alive = [r for r, i in enumerate(self.rows) if not self.done[i]]
        if not self.compact or not alive or len(alive) > len(self.rows) // 2:
            return None
        size = 1 << (len(alive) - 1).bit_length() if bucketed else len(alive)
        ended = [r for r, i in enumerate(self.rows) if self.done[i]]
        keep = sorted(alive + ended[:size - len(alive)])
        self.rows = [self.rows[r] for r in keep]
        return keep
