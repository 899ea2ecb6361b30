"""Count the kernels our modules launch in eager forward, op by op, for the planner's table
(plan/constants.py EAGER_FORWARD_KERNELS): tests/unit/test_plan_kernels.py holds the table to these counts.

Every aten op that reaches the dispatcher is a kernel launch on a GPU, except views and metadata ops
(VIEW_OPS), which move no data. The counts do not depend on tensor sizes, so tiny modules on the CPU
give what a CUDA run launches (autocast's CPU and CUDA policies cast the same ops for these modules).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "transpose", "t", "expand", "as_strided", "detach", "alias", "split", "split_with_sizes",
    "slice", "select", "unsqueeze", "squeeze", "permute", "unbind", "chunk", "_reshape_alias", "reshape", "narrow",
    "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty_strided", "_local_scalar_dense", "sym_size",
})


class KernelCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEW_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _model(preset: str, experts: int | None, regime: str, fused: bool = False):
    from shardwise.config import load_config
    from shardwise.models import build_model
    from shardwise.models.weights import RandomInit
    from shardwise.parallel.parallelize import materialize

    extra = [f"--model.moe.num_experts={experts}"] if experts else []
    cfg = load_config(None, [f"--model.preset={preset}", "--model.n_layers=1", "--data.tokenizer=byte"] + extra)
    with torch.device("meta"):
        model = build_model(cfg.model)
    materialize(model, torch.device("cpu"), RandomInit(model, 0))
    if regime == "lowp":
        model.to(torch.bfloat16)
    if fused:  # train.fuse_projections
        from shardwise.models.feed_forward import fuse_training_projections

        fuse_training_projections(model)
    return model


def _context(regime: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast")


def count_kernels(preset: str, regime: str, experts: int | None = None, fused: bool = False) -> dict[str, int]:
    """Kernels of one block's forward and backward, and of the rest of a training forward and backward
    (embedding, final norm, head, loss), for a model of `preset` in `regime` ("fp32", "autocast", "lowp");
    `fused`: with train.fuse_projections."""
    from shardwise.train.loss import token_cross_entropy_sum

    model = _model(preset, experts, regime, fused)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    block_kwargs = model.block_kwargs()
    x = torch.randn(2, 16, model.cfg.dim, dtype=torch.bfloat16 if regime == "lowp" else torch.float32, requires_grad=True)
    counters = {name: KernelCounter() for name in ("block_fwd", "block_bwd", "all_fwd", "all_bwd")}
    with _context(regime), counters["block_fwd"]:
        out = model.layers[0](x, **block_kwargs)
    with counters["block_bwd"]:
        out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    with _context(regime), counters["all_fwd"]:
        loss = token_cross_entropy_sum(model(tokens), tokens)
    with counters["all_bwd"]:
        loss.backward()
    c = {name: counter.count for name, counter in counters.items()}
    # the block's own backward was seeded by .float().sum() (2 kernels the model's backward does not run)
    c["block_bwd"] -= 2 if regime == "lowp" else 1
    return {"block_fwd": c["block_fwd"], "block_bwd": c["block_bwd"], "rest_fwd": c["all_fwd"] - c["block_fwd"],
            "rest_bwd": c["all_bwd"] - c["block_bwd"]}
