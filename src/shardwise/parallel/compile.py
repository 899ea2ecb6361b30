"""torch.compile of each transformer block, in place (train.compile, train.compile_backend).

Per block, not the whole model (torchtitan's choice, docs/architecture.md §4): every block has the same
code and shapes, so one graph is compiled and reused by all of them (a whole-model graph would be
n_layers times longer to compile), and the boundaries between blocks stay where FSDP2's per-block
all-gather / reduce-scatter hooks and the pipeline's stage split need them.

`Module.compile` compiles the module's call in place: no `_orig_mod` wrapper, so parameter names,
checkpoints and the optimizer's groups are the same with and without compile.

It runs after TP/SP, CP, EP and activation checkpointing (parallelize.py's order): dynamo then traces
the block as it will run — DTensor ops, the checkpoint (a higher-order op, selective policies included)
and the MoE routing. Where a block cannot be one graph, dynamo splits it and runs the rest eagerly
(fullgraph=False), with the same numerics:
- CP's ring / Ulysses attention (parallel/context.py) is an autograd.Function whose forward and
  backward issue their own send/recv and all-to-all: the graph breaks around it (cp2 ring: 11
  graphs for 2 blocks, compiled once, parity 1e-7).
- MoE: the feed-forward runs eagerly (apply_compile says why); attention and norms compile.
TP/SP: the blocks compile with their DTensor collectives inside; the embedding's async output is
waited for before block 0 (_wait_for_async_output).
"""
from __future__ import annotations

import torch
from torch import nn

from shardwise.config import Config
from shardwise.parallel.expert import moe_modules


def compile_enabled(cfg: Config, device_type: str) -> bool:
    """train.compile: unset means on for CUDA and off for CPU, where compiling does not pay for itself
    yet (benchmarks/gpu_throughput.py --device cpu: 1.07x eager in steady state on the tiny model, after
    ~25 s of inductor compilation that a short CPU run does not earn back). Unset with 2-D tensor
    parallelism means off everywhere: its SUMMA collectives are not traced yet, and preflight refuses an
    explicit true (preflight.py)."""
    if cfg.train.compile is None:
        return device_type == "cuda" and getattr(cfg.parallel, "tp_mode", "1d") != "2d"
    return cfg.train.compile


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compile every block of `model` (a whole model or a pipeline stage) in place."""
    for _, block in model.named_blocks():
        for moe in moe_modules(block):
            # The MoE feed-forward runs eagerly inside the compiled block (a graph break on each side):
            # its routing sizes buckets from the router's counts (data-dependent shapes) and it keeps
            # load statistics and the aux-loss gradient scale as Python state (models/moe.py), which a
            # graph would bake in: compiled, the loss drifted by 2e-3 in 20 steps and the block
            # recompiled every step until dynamo's limit of 8. Attention and norms still compile.
            moe.forward = torch.compiler.disable(moe.forward)
        block.compile(backend=backend, fullgraph=False)
    if getattr(model, "norm", None) is not None:
        # The final norm, outside every block: eager it is ~5 kernels forward and ~10 backward over the
        # last hidden state (the H100 profile of issue 27 counted these among the eager leftovers). In
        # place like the blocks, so parameter names and checkpoints do not change. The embedding (one
        # gather) and the head (one GEMM) gain nothing from a graph; the loss compiles its own chunk
        # kernels (train/loss.py LossKernels).
        model.norm.compile(backend=backend, fullgraph=False)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_async_output)


def _wait_for_async_output(_module: nn.Module, _inputs, output):
    """TP: the vocab-parallel embedding's output comes out of DTensor's async reduce-scatter as an
    AsyncCollectiveTensor. Given to a compiled block as is, AOTAutograd unwraps it and the block's
    input gradient bypasses DTensor's to_local backward, reaching the redistribute backward as a plain
    tensor (AttributeError '_local_tensor', torch 2.13). A copy taken here, eagerly, waits for the
    collective and keeps autograd's path through to_local (a view would still be an
    AsyncCollectiveTensor): one (b, s/tp, h) copy per micro-batch."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far: constant after the first steps, or something
    recompiles every step (metrics.jsonl `compiled_graphs`; tests/parity checks it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor_graphs() -> tuple[int, int]:
    """Graphs inductor generated code for in this process so far (a forward and a backward for each graph
    dynamo compiled for training), and how many of them it loaded from torch's compile cache on disk
    instead: a run of a command that ran before on this machine, with the same config, loads them
    (metrics.jsonl `inductor_graphs`, `inductor_graphs_from_cache`; gpu-check fills the cache ahead of its
    timed compiled rows). Counted at inductor, not at AOTAutograd's cache of whole graphs: that one passes
    over graphs with tensor subclasses (torchao's FP8: measured on this torch, 2026-11-28), whose
    generated code inductor's cache still holds. (0, 0) with compile_backend "aot_eager", which generates none."""
    from torch._dynamo.utils import counters

    made = counters["inductor"]
    hits = int(made["fxgraph_cache_hit"])
    return hits + int(made["fxgraph_cache_miss"]) + int(made["fxgraph_cache_bypass"]), hits
