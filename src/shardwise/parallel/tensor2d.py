"""2-D tensor parallelism: SUMMA on a q x q grid of the tp = q^2 ranks (parallel.tp_mode = "2d").

SUMMA (van de Geijn & Watts 1997) as Colossal-AI's 2-D tensor parallelism uses it (Xu, Qian & You
2021, arXiv 2104.05343). Rank (i, j) of the grid (tp rank i·q + j: row-major, so a grid row is q
consecutive ranks) holds
  activations  X[i][j] = X[batch block i, :, hidden block j]   (b/q sequences, all s tokens, h/q)
  a weight     W[i][j] = W[in block i, out block j]            (W is in x out; nn.Linear stores W^T)
and every linear computes Y[i][j] = sum_k X[i][k] W[k][j] in q steps: step k broadcasts X[i][k]
along grid row i (from column k) and W[k][j] along grid column j (from row k). Backward is SUMMA too:
  dX = dY W^T: step k broadcasts W[k][j] along column j, each rank multiplies its dY[i][j], and the
               partial sums are reduced along row i onto column k (dX[i][k]);
  dW = X^T dY: step k broadcasts X[i][k] along row i, each rank multiplies with its dY[i][j], and the
               partial sums are reduced along column j onto row k (dW[k][j], the rank's own block).
Only the local blocks are saved for backward (activation memory 1/q, weights 1/q^2 per rank); the
broadcasts are redone in backward, as Colossal-AI does. Linears that read the same input (wq / wk / wv,
w1 / w3) share one SUMMA call: X is broadcast once per step for all of them and their dX partials
are reduced as one sum.

Process groups: a 2-D DeviceMesh ("tp_row", "tp_col") unflattened from the tp axis of the root mesh
(parallel/mesh.py). As for every DeviceMesh axis, mesh["tp_col"] is the group along which the column
index varies: the ranks of one grid *row*. So traffic "along a row" (activation broadcasts, dX
reduces, norms' and the loss's all-reduces) is counted on axis tp_col, traffic "along a column"
(weight broadcasts, dW reduces, the embedding's and norms' weight-gradient all-reduces) on axis tp_row.
plan/tp2d.py writes the same volumes in closed form.

The rest of the model:
  RMSNorm  the sum of squares over the hidden dim is all-reduced along the row (b/q·s fp32 values,
           and again in backward); the weight is split by columns and replicated over rows, so its
           gradient (rows i's tokens only) is all-reduced along the column.
  attention local: the QKV output holds this rank's sequences and heads [j·H/q, (j+1)·H/q) (and KV heads
           [j·KV/q, ..), the ones those query heads use), so the core (causal SDPA, RoPE) needs nothing.
  embedding split by hidden columns, replicated over grid rows (V·h/q per rank, not V·h/q^2): the
           lookup of rows i's tokens is local, the weight gradient all-reduced along the column.
  head     a SUMMA linear (h x V, V·h/q^2 per rank): logits [b/q, s, V/q], vocab-sharded along the row.
  loss     vocab-parallel cross-entropy along the row (max, sum of exp, target logit all-reduced:
           3·b/q·s fp32), then the per-row sums are added over the column (one scalar), so every tp
           rank holds the whole micro-batch's loss — the single-device value — while its backward
           gives each rank only its own block's gradient (the sum is counted once).
Every parameter is a DTensor on the grid mesh (placements on (tp_row, tp_col)): linears
[Shard(1), Shard(0)], norms [Replicate, Shard(0)], the embedding [Replicate, Shard(1)], so
initialization (materialize), the gradient-norm, the optimizer, checkpoints and FSDP2's `replicate`
(DDP over dp_replicate) see ordinary sharded parameters. The compute runs on local tensors in the
autograd Functions below; each returns its gradient as the parameter's own local block.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from shardwise.tensors import group_sum

LINEAR = (Shard(1), Shard(0))  # nn.Linear weight (out, in): in split over grid rows, out over columns
NORM = (Replicate(), Shard(0))  # a hidden-dim vector: split over columns, replicated over rows
EMBEDDING = (Replicate(), Shard(1))  # (V, h): hidden split over columns, replicated over rows


class Grid:
    """This rank's place in the q x q grid and the row / column process groups."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.q = mesh.size(0)
        self.i = mesh.get_local_rank("tp_row")
        self.j = mesh.get_local_rank("tp_col")
        self.row = mesh["tp_col"].get_group()  # grid row i: the ranks (i, 0..q-1), group rank = j
        self.col = mesh["tp_row"].get_group()  # grid column j: the ranks (0..q-1, j), group rank = i

    def rows(self, batch: int) -> slice:
        """This rank's sequences of a micro-batch of `batch`."""
        n = batch // self.q
        return slice(self.i * n, (self.i + 1) * n)


def _bcast(t: torch.Tensor, group, src: int, own: bool) -> torch.Tensor:
    buf = t.contiguous() if own else torch.empty_like(t, memory_format=torch.contiguous_format)
    dist.broadcast(buf, group=group, group_src=src)
    return buf


def _reduce(t: torch.Tensor, group, dst: int) -> torch.Tensor:
    t = t.contiguous()
    dist.reduce(t, group=group, group_dst=dst)
    return t


class _Summa(torch.autograd.Function):
    """Y^m = X W^m for the weights W^m that read the same input X (local blocks; see the module doc)."""

    @staticmethod
    def forward(ctx, grid: Grid, x: torch.Tensor, *weights: torch.Tensor):
        ctx.grid, ctx.dtypes = grid, (x.dtype, [w.dtype for w in weights])
        device = x.device.type
        if torch.is_autocast_enabled(device):  # what autocast would do to F.linear: both in its dtype
            dtype = torch.get_autocast_dtype(device)
            x, weights = x.to(dtype), tuple(w.to(dtype) for w in weights)
        ctx.save_for_backward(x, *weights)
        outs = None
        with torch.autocast(device, enabled=False):
            for k in range(grid.q):
                xk = _bcast(x, grid.row, k, grid.j == k)
                wk = [_bcast(w, grid.col, k, grid.i == k) for w in weights]
                parts = [F.linear(xk, w) for w in wk]
                outs = parts if outs is None else [o + p for o, p in zip(outs, parts)]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grid = ctx.grid
        x, *weights = ctx.saved_tensors
        grads = [torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device) if g is None else g.to(x.dtype)
                 for g, w in zip(grads, weights)]
        dx = None
        if ctx.needs_input_grad[1]:
            for k in range(grid.q):  # dX[i][k] = sum_j sum_m dY^m[i][j] W^m[k][j]^T
                wk = [_bcast(w, grid.col, k, grid.i == k) for w in weights]
                part = sum(g @ w for g, w in zip(grads, wk))
                got = _reduce(part, grid.row, k)
                if grid.j == k:
                    dx = got
        dws = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            flat_g = [g.reshape(-1, g.shape[-1]) for g in grads]
            for k in range(grid.q):  # dW^m[k][j] = sum_i X[i][k]^T dY^m[i][j]  (stored transposed)
                xk = _bcast(x, grid.row, k, grid.j == k).reshape(-1, x.shape[-1])
                part = torch.cat([(g.t() @ xk).flatten() for g in flat_g])
                got = _reduce(part, grid.col, k)
                if grid.i == k:
                    dws = list(got.split([w.numel() for w in weights]))
                    dws = [d.view_as(w).to(dtype) for d, w, dtype in zip(dws, weights, ctx.dtypes[1])]
        return (None, None if dx is None else dx.to(ctx.dtypes[0]), *dws)


def summa(grid: Grid, x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """The outputs (local blocks) of `linears` (weights DTensors on the grid, no bias) applied to x."""
    return _Summa.apply(grid, x, *(lin.weight.to_local() for lin in linears))


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (a weight replicated over the group
    whose members each saw a different part of the batch)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def rms_norm(grid: Grid, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """models/llama.py RMSNorm on hidden-split activations."""
    xf = x.float()
    squares = group_sum(xf.pow(2).sum(-1, keepdim=True), grid.row)
    dim = x.shape[-1] * grid.q
    weight = _SumGradient.apply(norm.weight.to_local(), grid.col)
    return (xf * torch.rsqrt(squares / dim + norm.eps)).type_as(x) * weight


class _VocabCrossEntropy(torch.autograd.Function):
    """Sum over this rank's tokens' -log softmax[target] with the vocab split over grid row `grid.row`
    (this rank's columns [offset, offset + V_j)), summed over the grid's rows: the micro-batch's sum."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, grid: Grid, offset: int) -> torch.Tensor:
        x = logits.float().reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        peak = x.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=grid.row)
        shifted = x - peak[:, None]
        sumexp = shifted.exp().sum(-1)
        dist.all_reduce(sumexp, group=grid.row)
        local = t - offset
        mine = (local >= 0) & (local < x.shape[-1])
        target = torch.where(mine, shifted.gather(1, local.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(1),
                             torch.zeros((), dtype=x.dtype, device=x.device))
        dist.all_reduce(target, group=grid.row)
        lse = sumexp.log()
        total = (lse - target).sum()
        dist.all_reduce(total, group=grid.col)  # the other grid rows' sequences
        ctx.save_for_backward(logits, local, mine, peak, lse)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local, mine, peak, lse = ctx.saved_tensors
        x = logits.float().reshape(-1, logits.shape[-1])
        g = torch.exp(x - peak[:, None] - lse[:, None])
        rows = torch.nonzero(mine).squeeze(1)
        g[rows, local[rows]] -= 1
        return (g * grad).to(logits.dtype).view_as(logits), None, None, None


def cross_entropy_sum(grid: Grid, logits: torch.Tensor, targets: torch.Tensor, offset: int) -> torch.Tensor:
    """The micro-batch's token cross-entropy sum (the single-device value, on every tp rank) from this
    rank's logits block [b/q, s, V_j] and the micro-batch's (b, s) targets."""
    return _VocabCrossEntropy.apply(logits, targets[grid.rows(targets.shape[0])].contiguous(), grid, offset)


# ---- the model --------------------------------------------------------------------------------------
def _distribute(owner: nn.Module, name: str, mesh, placements: tuple[Placement, ...]) -> None:
    param = getattr(owner, name)
    dt = distribute_tensor(param.data, mesh, list(placements), src_data_rank=None)
    owner.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def apply_tensor_parallel_2d(model: nn.Module, mesh) -> Grid:
    """Shard a llama model (meta, before materialize) over the 2-D grid `mesh` and swap the forwards
    of its embedding, norms, attention, MLPs and head for the 2-D ones. Returns the Grid."""
    from shardwise.models.common import Attention
    from shardwise.models.feed_forward import SwiGLU
    from shardwise.models.llama import RMSNorm

    grid = Grid(mesh)
    for module in list(model.modules()):
        if isinstance(module, RMSNorm):
            _distribute(module, "weight", mesh, NORM)
            module.forward = _bind(rms_norm, grid, module)
        elif isinstance(module, Attention):
            for lin in (module.wq, module.wk, module.wv, module.wo):
                _distribute(lin, "weight", mesh, LINEAR)
            module.forward = _bind(_attention, grid, module)
        elif isinstance(module, SwiGLU):
            for lin in (module.w1, module.w3, module.w2):
                _distribute(lin, "weight", mesh, LINEAR)
            module.forward = _bind(_swiglu, grid, module)
    if model.tok_embeddings is not None:
        _distribute(model.tok_embeddings, "weight", mesh, EMBEDDING)
        model.tok_embeddings.forward = _bind(_embedding, grid, model.tok_embeddings)
    if model.output is not None:
        _distribute(model.output, "weight", mesh, LINEAR)
        model.output.forward = _bind(lambda g, lin, x: summa(g, x, lin)[0], grid, model.output)
    leftover = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if leftover:
        raise NotImplementedError(f"2-D tensor parallelism does not place {leftover}")
    return grid


def vocab_offset(model: nn.Module) -> int:
    """The first vocabulary id of this rank's logits columns (DTensor's split of the head's rows)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    w = model.output.weight
    return compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)[1][0]


def _bind(fn, grid: Grid, module: nn.Module):
    def forward(*args, **kwargs):
        return fn(grid, module, *args, **kwargs)
    return forward


def _embedding(grid: Grid, emb: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    weight = _SumGradient.apply(emb.weight.to_local(), grid.col)
    return F.embedding(tokens[grid.rows(tokens.shape[0])], weight)


def _attention(grid: Grid, attn: nn.Module, x: torch.Tensor, rope=None, positions=None, cache=None,
               mask=None) -> torch.Tensor:
    """Attention.forward's signature (models/common.py), computed by SUMMA."""
    if cache is not None or positions is not None or mask is not None:
        raise NotImplementedError("2-D tensor parallelism trains only (no KV cache, no explicit positions, no "
                                  "document mask: pre-flight refuses them)")
    b, s, _ = x.shape
    q, k, v = (t.view(b, s, -1, attn.head_dim).transpose(1, 2) for t in summa(grid, x, attn.wq, attn.wk, attn.wv))
    if rope is not None:
        q, k = rope(q, None), rope(k, None)
    out = attn.core(q, k, v)
    return summa(grid, out.transpose(1, 2).reshape(b, s, -1), attn.wo)[0]


def _swiglu(grid: Grid, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = summa(grid, x, mlp.w1, mlp.w3)
    return summa(grid, F.silu(gate) * up, mlp.w2)[0]

