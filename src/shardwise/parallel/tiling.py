"""Memory-centric tiling of the dense MLPs (parallel.linear_tiles).

Why: an MLP's activations are its largest: untiled, autograd keeps SwiGLU's four ffn-wide tensors
(w1 x, silu(w1 x), w3 x, their product) and GELU-MLP's two (fc x, gelu(fc x)) from forward to
backward, each b*s*ffn, plus the same again as transient working memory. ZeRO-Infinity's
"memory-centric tiling" (Rajbhandari et al. 2021, arXiv 2104.07857 §5.1.3; DeepSpeed's
`deepspeed.runtime.zero.tiling.TiledLinear`) splits a large operator into tiles computed one after
another, so only one tile's working memory is live at a time. Here the split is along the hidden
(ffn) dim, where an MLP separates exactly:

    SwiGLU:   w2(silu(w1 x) * w3 x)      = sum_i w2[:, i](silu(w1[i] x) * w3[i] x)
    GELU-MLP: proj(gelu(fc x + b1)) + b2 = sum_i proj[:, i] gelu(fc[i] x + b1[i]) + b2

with w1[i] / w3[i] / fc[i] row slices and w2[:, i] / proj[:, i] the matching column slices
(_slices, the cuts torch.tensor_split makes: uneven splits are fine). A custom autograd.Function saves only x and the weights
(no ffn-wide tensor); backward recomputes each tile's up-projection and pointwise ops, one tile at a
time, and writes that tile's slice of full-size weight gradients allocated once (autograd's own
SliceBackward would allocate a zero tensor of the full weight per tile).

Cost: backward recomputes the up-projection GEMMs of every tile: +2 GEMMs of b*s*dim*ffn for SwiGLU
(w1, w3), +1 for GELU (fc), plus the pointwise ops: +2/9 (SwiGLU: 3 forward + 6 backward GEMMs) or
+1/6 (GELU: 2 + 4) of the MLP's training FLOPs. Under train.recompute = "selective" with policy "op" the
block's replay also reruns the tiled forward (see UncachedRegion). In exchange the activations the MLP keeps for backward drop to x alone
(b*s*dim), and the peak working memory of the MLP to one tile's b*s*ffn/tiles tensors. Smaller tiles
mean smaller GEMMs (lower efficiency on a GPU); the numbers are equal up to fp32 rounding (only the
order of the summation over the ffn dim changes).

Parameters are neither renamed nor re-registered: the module keeps its nn.Linear children, only its
class is swapped for a subclass whose forward calls the Function with `module.w1.weight` etc. So state
dicts, checkpoints, FSDP2 units and the parity harness see the same model. Under FSDP2 those are the
unsharded parameters during forward and backward (gathered by the block's pre-forward / pre-backward
hooks), plain tensors, and their gradients reach FSDP's post-backward through AccumulateGrad as usual.

Mixed precision: under torch.autocast the Function computes in the autocast dtype (x and the weights
cast once, as the untiled linears would), with autocast off inside; under FSDP2's param_dtype it
computes in the dtype it is given. Output and dx are accumulated over the tiles in fp32 when the
compute dtype is 16-bit (one GEMM accumulates in fp32 too), weight gradients come back in the
parameters' dtype.

Not implemented (refused by spec/rules.py linear_tiles_rules): tp > 1 (the weights are DTensors),
train.precision = "fp8" (Float8Linear GEMMs would be bypassed), MoE models.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from shardwise.models.feed_forward import GELUMLP, SwiGLU, compute_dtype


class UncachedRegion:
    """Whether a region the selective checkpoint policy must not cache is running (parallel/
    activation_checkpoint.py): a tiled MLP, whose tiles' GEMM outputs (w1 x, w3 x, the partial
    down-projections) are the ffn-wide tensors tiling exists to drop, and more than the untiled MLP's; ring
    attention (parallel/context.py), whose per-block scores and partial outputs would otherwise be cached, a
    score matrix per pair of sequence chunks. The region enters it around its forward, the policy reads
    `active`. One object per checkpointed block for tiles (no module state), one per ring for ring attention.
    The price, measured (tests/unit/test_linear_tiles.py): the checkpoint's replay of the block in
    backward reruns the region's forward (its saved tensors are packed when the Function returns, so
    torch's early stop cannot end the replay before it), i.e. under selective "op" a tiled MLP's forward
    GEMMs run once more on top of the Function's own recomputation, and ring attention's forward, ring
    exchange included, runs again; under train.recompute = "full" the replay happens untiled too."""

    def __init__(self) -> None:
        self.depth = 0

    @property
    def active(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def _scope(module: nn.Module) -> contextlib.AbstractContextManager:
    scope = getattr(module, "tile_scope", None)
    return scope.running() if scope is not None else contextlib.nullcontext()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums over tiles are kept in fp32 for 16-bit compute (as a single GEMM would accumulate)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class _TiledSwiGLUFunction(torch.autograd.Function):
    """out = w2(silu(w1 x) * w3 x), in `tiles` tiles along the hidden dim; saves x and the weights only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, tiles: int) -> torch.Tensor:
        dtype = compute_dtype(x)
        xc = x if x.dtype == dtype else x.to(dtype)  # the input itself when no cast (what compile traces)
        ctx.save_for_backward(xc, w1, w3, w2)
        ctx.tiles, ctx.x_dtype = tiles, x.dtype
        with torch.autocast(x.device.type, enabled=False):
            out = None
            for sl in _slices(w1.shape[0], tiles):  # w1 / w3 rows and w2 columns: the ffn dim
                h = F.silu(F.linear(xc, w1[sl].to(dtype))) * F.linear(xc, w3[sl].to(dtype))
                part = F.linear(h, w2[:, sl].to(dtype))
                del h  # this tile's ffn-wide tensors die here, before the next tile's are made
                out = part.to(_acc_dtype(dtype)) if out is None else out.add_(part)
        return out.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        xc, w1, w3, w2 = ctx.saved_tensors
        dtype, acc = xc.dtype, _acc_dtype(xc.dtype)
        x2 = xc.reshape(-1, xc.shape[-1])
        dy = grad.to(dtype).reshape(-1, grad.shape[-1])
        need_x, need_w1, need_w3, need_w2 = ctx.needs_input_grad[:4]
        dx = torch.zeros(x2.shape, dtype=acc, device=x2.device) if need_x else None
        # Allocated once, each tile writes its own slice.
        dw1 = torch.empty_like(w1) if need_w1 else None
        dw3 = torch.empty_like(w3) if need_w3 else None
        dw2 = torch.empty_like(w2) if need_w2 else None
        with torch.autocast(xc.device.type, enabled=False):
            for sl in _slices(w1.shape[0], ctx.tiles):
                r1, r3, c2 = w1[sl].to(dtype), w3[sl].to(dtype), w2[:, sl].to(dtype)
                a = torch.mm(x2, r1.t())  # recomputed: w1 x and w3 x of this tile
                b = torch.mm(x2, r3.t())
                s = F.silu(a)
                if need_w2:
                    dw2[:, sl].copy_(torch.mm(dy.t(), s * b))
                dh = torch.mm(dy, c2)
                da = torch.ops.aten.silu_backward(dh * b, a)  # the kernel autograd's SiluBackward runs
                db = dh * s
                del a, b, s, dh
                if need_w1:
                    dw1[sl].copy_(torch.mm(da.t(), x2))
                if need_w3:
                    dw3[sl].copy_(torch.mm(db.t(), x2))
                if need_x:
                    dx.add_(torch.mm(da, r1)).add_(torch.mm(db, r3))
        dx = dx.reshape(xc.shape).to(ctx.x_dtype) if need_x else None
        return dx, dw1, dw3, dw2, None


class _TiledGELUMLPFunction(torch.autograd.Function):
    """out = proj(gelu(fc x + b1, tanh)) + b2, in `tiles` tiles along the hidden dim; saves x and the weights only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fc_w: torch.Tensor, fc_b: torch.Tensor | None, proj_w: torch.Tensor,
                proj_b: torch.Tensor | None, tiles: int) -> torch.Tensor:
        dtype = compute_dtype(x)
        xc = x if x.dtype == dtype else x.to(dtype)  # the input itself when no cast (what compile traces)
        ctx.save_for_backward(xc, fc_w, fc_b, proj_w, proj_b)
        ctx.tiles, ctx.x_dtype = tiles, x.dtype
        with torch.autocast(x.device.type, enabled=False):
            out = None
            for sl in _slices(fc_w.shape[0], tiles):  # fc rows (and bias) and proj columns: the ffn dim
                bias = fc_b[sl].to(dtype) if fc_b is not None else None
                g = F.gelu(F.linear(xc, fc_w[sl].to(dtype), bias), approximate="tanh")
                part = F.linear(g, proj_w[:, sl].to(dtype))
                del g
                out = part.to(_acc_dtype(dtype)) if out is None else out.add_(part)
            if proj_b is not None:
                out.add_(proj_b.to(dtype))
        return out.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        xc, fc_w, fc_b, proj_w, proj_b = ctx.saved_tensors
        dtype, acc = xc.dtype, _acc_dtype(xc.dtype)
        x2 = xc.reshape(-1, xc.shape[-1])
        dy = grad.to(dtype).reshape(-1, grad.shape[-1])
        need_x, need_fw, need_fb, need_pw, need_pb = ctx.needs_input_grad[:5]
        dx = torch.zeros(x2.shape, dtype=acc, device=x2.device) if need_x else None
        dfw = torch.empty_like(fc_w) if need_fw else None
        dfb = torch.empty_like(fc_b) if need_fb and fc_b is not None else None
        dpw = torch.empty_like(proj_w) if need_pw else None
        dpb = dy.sum(0, dtype=acc).to(proj_b.dtype) if need_pb and proj_b is not None else None
        with torch.autocast(xc.device.type, enabled=False):
            for sl in _slices(fc_w.shape[0], ctx.tiles):
                r, c = fc_w[sl].to(dtype), proj_w[:, sl].to(dtype)
                a = torch.mm(x2, r.t())  # recomputed: fc x of this tile
                if fc_b is not None:
                    a.add_(fc_b[sl].to(dtype))
                if need_pw:
                    dpw[:, sl].copy_(torch.mm(dy.t(), F.gelu(a, approximate="tanh")))
                da = torch.ops.aten.gelu_backward(torch.mm(dy, c), a, approximate="tanh")
                del a
                if need_fw:
                    dfw[sl].copy_(torch.mm(da.t(), x2))
                if dfb is not None:
                    dfb[sl].copy_(da.sum(0, dtype=acc))
                if need_x:
                    dx.add_(torch.mm(da, r))
        dx = dx.reshape(xc.shape).to(ctx.x_dtype) if need_x else None
        return dx, dfw, dfb, dpw, dpb, None


def _slices(n: int, tiles: int) -> list[slice]:
    """The index ranges torch.tensor_split(t, tiles) cuts n rows into (the first n % tiles one longer)."""
    size, extra = divmod(n, tiles)
    bounds = [0]
    for i in range(tiles):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class TiledSwiGLU(SwiGLU):
    """A SwiGLU whose forward runs in `tiles` tiles (same children, same parameter names)."""

    tiles: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _scope(self):
            return _TiledSwiGLUFunction.apply(x, self.w1.weight, self.w3.weight, self.w2.weight, self.tiles)


class TiledGELUMLP(GELUMLP):
    """A GELUMLP whose forward runs in `tiles` tiles (same children, same parameter names)."""

    tiles: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _scope(self):
            return _TiledGELUMLPFunction.apply(x, self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias,
                                               self.tiles)


_TILED = {SwiGLU: TiledSwiGLU, GELUMLP: TiledGELUMLP, TiledSwiGLU: TiledSwiGLU, TiledGELUMLP: TiledGELUMLP}


def apply_linear_tiles(model: nn.Module, tiles: int) -> int:
    """In place: every dense MLP (SwiGLU, GELUMLP) of `model` computes in `tiles` tiles along its hidden
    dim. tiles == 1 changes nothing. Returns the number of MLPs tiled.

    Swaps each module's class for its tiled subclass (its forward only); parameters, buffers, names
    and hooks are untouched. Must run before activation checkpointing, compile and FSDP (parallelize.py)
    and after FP8 / TP, which it refuses to combine with (spec/rules.py linear_tiles_rules says so first)."""
    if tiles < 1:
        raise ValueError(f"linear_tiles must be >= 1, got {tiles}")
    if tiles == 1:
        return 0
    count = 0
    for module in model.modules():
        tiled = _TILED.get(type(module))
        if tiled is None:
            continue
        for linear in module.children():
            if type(linear) is not nn.Linear or type(linear.weight.data) is not torch.Tensor:
                raise ValueError(f"linear_tiles needs plain nn.Linear weights; {type(module).__name__} holds a "
                                 f"{type(linear).__name__} (tensor parallel or FP8 are not implemented with tiling)")
        module.__class__ = tiled
        module.tiles = tiles
        count += 1
    return count
