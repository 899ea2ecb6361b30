"""benchmarks/kernels.py's overhead section: the per-kernel launch / dispatch cost of eager against compiled
execution (a chain of tiny dependent `x = x + 1`), and a real block's host cost per kernel on 1 token, plain
and under full / selective checkpointing (plan/constants.py EAGER_BLOCK_KERNELS)."""
from __future__ import annotations

import functools
import shutil

import torch

from kernel_timing import DTYPES, reason  # this folder
from shardwise.plan import constants as C


def overhead_section(a, device, timer) -> dict:
    n = a.chain_ops

    def chain(x):
        for _ in range(n):
            x = x + 1
        return x

    x = torch.zeros(1024, device=device)
    leaf = torch.zeros(1024, device=device, requires_grad=True)
    from torch.utils.checkpoint import checkpoint

    from shardwise.parallel.activation_checkpoint import selective_op_context

    def selective():  # the trainer's selective "op" checkpoint: its policy runs in a Python dispatch mode per op
        out = checkpoint(chain, leaf, use_reentrant=False, context_fn=selective_op_context)
        return torch.autograd.grad(out.sum(), leaf)

    rows = [{"mode": "eager", **timer(lambda: chain(x))},
            {"mode": "eager+autograd (fwd+bwd)", **timer(lambda: torch.autograd.grad(chain(leaf).sum(), leaf))},
            {"mode": "selective checkpoint (fwd+recompute+bwd)", **timer(selective)}]
    compiled = {"mode": "compiled (inductor)"}
    if a.smoke or a.no_compile:
        compiled["unavailable"] = "skipped (--smoke: compiling the chain takes seconds)" if a.smoke else "--no-compile"
    elif device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        compiled["unavailable"] = "no C++ compiler on PATH (inductor's CPU backend needs one)"
    else:
        try:
            torch._dynamo.reset()
            fn = functools.partial(torch.compile(chain, backend="inductor"), x)
            compiled["compile_s"] = timer.elapsed(fn, 1)  # the first call compiles
            compiled.update(timer(fn))
        except Exception as e:  # noqa: BLE001 - any compiler failure is a result to report
            compiled["unavailable"] = reason(e)
    rows.append(compiled)
    for r in rows:
        r["chain_ops"] = n
        r["s_per_op"] = r["median_s"] / n if "median_s" in r else None
    block = block_overhead(a, device, timer)
    print(f"\nper-kernel overhead: chain of {n} dependent `x = x + 1` on 1024 elements, time per original op")
    print(f"{'mode':42s} {'chain ms':>9s} {'us/op':>9s}")
    for r in rows:
        if r["s_per_op"] is None:
            print(f"{r['mode']:42s} unavailable ({r['unavailable']})")
        else:
            extra = f"  (compile {r['compile_s']:.1f} s)" if "compile_s" in r else ""
            print(f"{r['mode']:42s} {1e3 * r['median_s']:9.3f} {1e6 * r['s_per_op']:9.3f}{extra}")
    print(f"a llama block of this model on 1 token (host cost only), per kernel of plan/constants.py "
          f"EAGER_BLOCK_KERNELS {block['kernels']} (views and autograd folded in):")
    for r in block["rows"]:
        print(f"  {r['mode']:40s} {1e3 * r['median_s']:9.3f} ms {1e6 * r['s_per_kernel']:9.3f} us/kernel")
    return {"rows": rows, "block": block}


def block_overhead(a, device, timer) -> dict:
    """A real llama block's host cost (this model's dims, 1 token: its kernels do no work), where `x + 1` is not
    typical: forward + backward, and what a full / selective checkpoint adds, per kernel of the planner's
    EAGER_BLOCK_KERNELS (views and autograd folded in). plan/compute_time.py charges them on a CPU."""
    from torch.utils.checkpoint import checkpoint

    from shardwise.config import load_config
    from shardwise.models import build_model
    from shardwise.models.weights import RandomInit
    from shardwise.parallel.activation_checkpoint import selective_op_context
    from shardwise.parallel.parallelize import materialize

    cfg = load_config(None, ["--model.preset=tiny", "--model.arch=llama", "--model.n_layers=1", f"--model.dim={a.dim}",
                             f"--model.n_heads={a.heads}", f"--model.n_kv_heads={a.kv_heads}", f"--model.ffn_dim={a.ffn}",
                             "--data.tokenizer=byte"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    materialize(model, device, RandomInit(model, 0))
    model.to(DTYPES[a.dtype])
    block, kwargs = model.layers[0], model.block_kwargs()
    x = torch.randn(1, 1, a.dim, device=device, dtype=DTYPES[a.dtype], requires_grad=True)

    def train(wrap=None):
        out = block(x, **kwargs) if wrap is None else checkpoint(block, x, use_reentrant=False, **wrap, **kwargs)
        out.float().sum().backward()

    fwd_k, bwd_k = C.EAGER_BLOCK_KERNELS[("llama", "fp32" if a.dtype == "fp32" else "lowp")]
    base = timer(train)
    full, sel = timer(lambda: train({})), timer(lambda: train({"context_fn": selective_op_context}))
    rows = [{"mode": "block forward + backward", **base, "s_per_kernel": base["median_s"] / (fwd_k + bwd_k)}]
    for mode, r in (("full checkpoint, extra", full), ("selective checkpoint, extra", sel)):
        extra = max(0.0, r["median_s"] - base["median_s"])
        rows.append({"mode": mode, **r, "median_s": extra, "s_per_kernel": extra / fwd_k})
    return {"kernels": [fwd_k, bwd_k], "tokens": 1, "rows": rows}
