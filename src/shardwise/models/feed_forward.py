"""The dense feed-forward blocks of the two architectures; models/moe.py builds its experts' math and
shared experts from the same definitions, so it imports these rather than the architectures."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


def fuse_linears(owner: nn.Module, name: str, *linears: nn.Linear) -> None:
    """For inference: one weight (and bias) for linears that read the same input, so one GEMM replaces
    several — a decode step's GEMMs are a few MB each and every kernel pays a fixed time of its own
    (plan/constants.py DECODE_GEMM_KERNEL_S, measured on an H200: 5.1 us, next to 1-4 us of bytes).
    The linears' weights become views of the fused one: no extra memory, the same parameter names and
    state_dict. It is `owner`'s non-persistent buffer `name` (`name`_bias for the biases): a buffer, so
    torch.compile's CUDA graphs read it in place (a static input) and checkpoints never see it."""
    rows = [lin.out_features for lin in linears]
    for attr, buffer in (("weight", name), ("bias", f"{name}_bias")):
        if getattr(linears[0], attr) is None:
            continue
        fused = torch.cat([getattr(lin, attr).detach() for lin in linears])
        for lin, part in zip(linears, fused.split(rows)):
            getattr(lin, attr).data = part
        owner.register_buffer(buffer, fused, persistent=False)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear of `x` computes in: autocast's, or the input's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def join_rows(weights: list[torch.Tensor] | tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """`weights` stacked along their rows into a new tensor of `dtype`, for a backward that joins them again:
    a copy into a fresh buffer rather than torch.cat, since under torch.compile AOTAutograd's CSE would merge
    a torch.cat there with the forward's, and its partitioner then keeps that join from forward to backward
    (an input the backward's GEMM materialises is never recomputed: torch/_functorch/partitioners.py
    should_ban_recomputation), the very copy _JoinedLinear exists not to keep."""
    out = torch.empty((sum(w.shape[0] for w in weights), *weights[0].shape[1:]), dtype=dtype, device=weights[0].device)
    row = 0
    for w in weights:
        out[row:row + w.shape[0]].copy_(w)
        row += w.shape[0]
    return out


class _JoinedLinear(torch.autograd.Function):
    """F.linear over weights joined along their rows (fused_linear), saving the weights themselves for
    backward, which joins them again, instead of the joined copy that autograd's linear would keep from
    forward to backward: a copy the size of the weights, per block. Under FSDP2 that copy is of the
    unsharded weights, which FSDP frees after each block's forward, so ZeRO-3 would hold every block's
    projections at once (measured on the small preset, dp_shard 2, bf16: activations 6.6 -> 10.9 MB). The
    same GEMMs as F.linear's forward and backward in the dtype it would use (autocast's, as the separate
    linears would cast to), so the same numbers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, *weights: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        xc = x if x.dtype == dtype else x.to(dtype)  # the input itself when no cast (what compile traces)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):
            joined = torch.cat([w.to(dtype) for w in weights])
            return F.linear(xc, joined, None if bias is None else bias.to(dtype))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        xc, *weights = ctx.saved_tensors
        need_x, need_bias, *need_weights = ctx.needs_input_grad
        dy = grad.to(xc.dtype).reshape(-1, grad.shape[-1])
        with torch.autocast(xc.device.type, enabled=False):
            dx = torch.mm(dy, join_rows(weights, xc.dtype)).reshape(xc.shape).to(ctx.x_dtype) if need_x else None
            dw = torch.mm(dy.t(), xc.reshape(-1, xc.shape[-1])) if any(need_weights) else None
        parts = dw.split([w.shape[0] for w in weights]) if dw is not None else [None] * len(weights)
        dws = [part.to(w.dtype) if need else None for part, w, need in zip(parts, weights, need_weights)]
        db = dy.sum(0).to(ctx.bias_dtype) if need_bias and ctx.bias_dtype is not None else None
        return dx, db, *dws


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """For training (train.fuse_projections): `linears`, which read the same input, as one GEMM over their
    weights (and biases) joined at every call, split back per linear. The weights stay parameters of
    their own (names, checkpoints, FSDP's units); the join is a transient copy the size of the weights
    (_JoinedLinear: made again in backward, not kept), next to a GEMM over every token. Outputs and weight
    gradients are the separate GEMMs' products; the input's gradient is one GEMM's sum over the joined
    rows instead of separate GEMMs added (a different order of the same fp32 additions)."""
    bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
    out = _JoinedLinear.apply(x, bias, *(lin.weight for lin in linears))
    return out.split([lin.out_features for lin in linears], dim=-1)


def fuse_training_projections(model: nn.Module, choose=lambda linears: fused_linear) -> int:
    """Every module of `model` that has linears reading one input (`training_projections`: attention's
    q, k, v; SwiGLU's w1, w3) computes them with `choose(linears)` (fused_linear, or the FP8 one that
    parallel/float8.py gives for torchao's linears); returns how many. A group whose linears are not all of
    one type stays as it is."""
    fused = 0
    for module in model.modules():
        group = getattr(module, "training_projections", None)
        if group is None:
            continue
        linears = group()
        if len({type(lin) for lin in linears}) == 1:
            module.fused_projection = choose(linears)
            fused += 1
    return fused


class GELUMLP(nn.Module):
    """proj(gelu(fc x)) with the tanh approximation (GPT-2 / Megatron), biases on both linears."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.register_buffer("w13", None, persistent=False)  # fuse_projections (inference): w1 and w3 in one GEMM
        self.fused_projection = None  # training: w1 and w3 in one GEMM (fuse_training_projections)

    def fuse_projections(self) -> None:
        fuse_linears(self, "w13", self.w1, self.w3)

    def training_projections(self) -> tuple[nn.Linear, ...]:
        return self.w1, self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            gate, up = F.linear(x, self.w13).split(self.w1.out_features, dim=-1)
            return self.w2(F.silu(gate) * up)
        if self.fused_projection is not None:
            gate, up = self.fused_projection(x, (self.w1, self.w3))
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
