"""Mixture-of-experts feed-forward block (no parallelism in here; parallel/expert.py adds EP,
parallel/tensor.py MoERegion TP).

A MoE block replaces the MLP of every k-th transformer block ((index + 1) % every_k_layers == 0, as
the planner's `MoESpec.is_moe_layer`) by a linear router and `num_experts` experts of the
architecture's MLP (Shazeer et al. 2017, arXiv 1701.06538; Mixtral: Jiang et al. 2024, arXiv
2401.04088), plus optional always-on shared experts (DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066).

Routing (Mixtral): fp32 router logits, softmax over all experts, top-k, the k weights renormalised to
sum to 1. Capacity (Switch, Fedus et al. 2021, arXiv 2101.03961 §2.1): with capacity_factor cf > 0
each expert takes at most C = ceil(cf * T * k / E) token-slots of the T tokens of this forward (one
micro-batch on one rank); overflow slots are dropped (their token gets no output from that expert;
the residual carries it). Priority (GShard, Lepikhin et al. 2020 §2.2): all first choices before any
second choice, and within one choice rank, earlier tokens first. cf = 0 is dropless.

Losses (added to the objective through `_AttachAuxLoss`, see there):
  load balancing  alpha * E * sum_i f_i * P_i   (Switch eq. 4), f_i = fraction of the T*k routed
                  slots that chose expert i (before capacity dropping: what the router asked for),
                  P_i = mean router probability of expert i;
  router z-loss   beta * mean_t logsumexp(logits_t)^2   (ST-MoE, Zoph et al. 2022, arXiv 2202.08906 eq. 5).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.config import ModelConfig
from shardwise.models.feed_forward import GELUMLP, SwiGLU
from shardwise.tensors import group_sum, local_shard


class GroupedExperts(nn.Module):
    """E experts as stacked (E, out, in) weights, named as the planner expects (spec/shapes.py):
    llama w1, w3 (E, f, h) and w2 (E, h, f) (SwiGLU); gpt fc (E, f, h) and proj (E, h, f) (GELU).
    No biases (torchtitan GroupedExperts)."""

    def __init__(self, arch: str, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.arch = arch
        e, h, f = num_experts, dim, hidden
        if arch == "llama":
            self.w1 = nn.Parameter(torch.empty(e, f, h))
            self.w3 = nn.Parameter(torch.empty(e, f, h))
            self.w2 = nn.Parameter(torch.empty(e, h, f))
        else:
            self.fc = nn.Parameter(torch.empty(e, f, h))
            self.proj = nn.Parameter(torch.empty(e, h, f))

    def weights(self) -> list[torch.Tensor]:
        return [self.w1, self.w3, self.w2] if self.arch == "llama" else [self.fc, self.proj]

    def compute(self, x: torch.Tensor, counts: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
        """Rows of `x` sorted by expert, `counts[e]` rows for (local) expert e: each segment through
        its expert's MLP. A loop of GEMMs (a grouped GEMM on GPUs); every row is computed
        independently, so how rows are grouped does not change the result beyond GEMM rounding."""
        outs = []
        # Empty segments are computed too: then every expert weight gets a gradient (zero when no
        # token chose it) on every rank and every step, so AdamW treats all layouts alike (a None
        # gradient would skip the update) and every rank runs the same backward graph — under EP a
        # rank whose experts got no tokens must still take part in the backward all-to-alls.
        for e, seg in enumerate(torch.split(x, counts)):
            if self.arch == "llama":
                w1, w3, w2 = (w[e] for w in weights)
                outs.append((F.silu(seg @ w1.t()) * (seg @ w3.t())) @ w2.t())
            else:
                fc, proj = (w[e] for w in weights)
                outs.append(F.gelu(seg @ fc.t(), approximate="tanh") @ proj.t())
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x`: token copies sorted by expert; `counts`: (E,) copies per expert. Under tensor
        parallelism the weights are DTensors split on the ffn dim: this rank's slices compute a
        partial output (parallel/tensor.py MoERegion sums it over tp)."""
        return self.compute(x, counts.tolist(), [local_shard(w).to(x.dtype) for w in self.weights()])




class _AttachAuxLoss(torch.autograd.Function):
    """Return the MoE output unchanged; in backward give `aux` the constant gradient `scale`.

    Why (Megatron-LM's MoEAuxLossAutoScaler idea, written anew): the auxiliary losses then need no
    path to the trainer's loss, so they work on any pipeline stage (only the last stage has the
    cross-entropy), and scale = loss_scale / (micro-batches per step) makes the step's gradient
    alpha * mean over this rank's micro-batches of aux_mb; the data-parallel gradient average then
    gives the mean over the global batch's micro-batches, as on one process (micro-batch boundaries
    coincide across layouts, docs/architecture.md §3)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def _in_backward() -> bool:
    """True while autograd replays a forward (activation checkpointing recomputation): the router
    statistics of that forward were already recorded, so they are not counted twice."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.capacity_factor = m.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = m.aux_loss_coef, m.z_loss_coef
        hidden = m.expert_ffn_dim or cfg.ffn_dim
        self.router = nn.Linear(cfg.dim, m.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.arch, m.num_experts, cfg.dim, hidden)
        self.shared_experts = None
        if m.num_shared_experts:
            # DeepSeekMoE merges its shared experts into one MLP of n_shared x expert ffn (same FLOPs).
            if cfg.arch == "llama":
                self.shared_experts = SwiGLU(cfg.dim, m.num_shared_experts * hidden)
            else:
                self.shared_experts = GELUMLP(cfg.dim, m.num_shared_experts * hidden)
        # Set by the trainer every step: loss scale / micro-batches per step (see _AttachAuxLoss).
        self.aux_grad_scale = 1.0
        # This rank's share of that gradient: 1, or 1 / tp under tensor parallelism, where every tp
        # rank computes the same aux loss and the gradients are summed over tp (parallel/tensor.py).
        self.aux_grad_share = 1.0
        # Optional process group over which the router statistics f and P are summed (context
        # parallelism: one micro-batch's tokens live on several ranks). None: this rank's tokens.
        self.stats_group = None
        self.reset_stats()

    # ---- statistics for logging (detached, accumulated over a step's forwards) ----
    def reset_stats(self) -> None:
        self.stats_load = torch.zeros(self.num_experts, dtype=torch.float64)   # routed slots per expert
        self.stats_dropped = 0.0
        self.stats_aux = 0.0     # sum over forwards of alpha * aux (the weighted term)
        self.stats_z = 0.0
        self.stats_forwards = 0

    # Overridden per instance by tensor parallelism (parallel/tensor.py MoERegion): the weight as a
    # local tensor, and the shared experts computed on this rank's ffn slice.
    def router_weight(self) -> torch.Tensor:
        return self.router.weight

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)

    def capacity(self, tokens: int) -> int:
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def route(self, x: torch.Tensor):
        """x (T, h) -> (top-k expert ids (T, k), renormalised weights (T, k) fp32, keep mask (T, k),
        probs (T, E) fp32, logits (T, E) fp32)."""
        logits = F.linear(x.float(), self.router_weight().float())
        probs = logits.softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        keep = torch.ones_like(top_i, dtype=torch.bool)
        if self.capacity_factor > 0:
            # Slot-major order (all first choices, then all second ...): position of each slot in
            # its expert's queue; slots at position >= C overflow.
            slot_major = top_i.t().reshape(-1)
            onehot = F.one_hot(slot_major, self.num_experts)
            position = (onehot.cumsum(0) * onehot).sum(-1) - 1
            keep = (position < self.capacity(x.shape[0])).view(self.top_k, -1).t()
        return top_i, weights, keep, probs, logits

    def aux_losses(self, top_i: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha * load-balancing loss, beta * z-loss, routed slots per expert (no grad))."""
        counts = torch.bincount(top_i.reshape(-1), minlength=self.num_experts).to(probs.dtype)
        tokens = torch.tensor(float(probs.shape[0]), dtype=probs.dtype, device=probs.device)
        prob_sum = probs.sum(0)
        # Without a z-loss its term is a constant: no graph, nothing saved for backward.
        z_sum = logits.logsumexp(-1).pow(2).sum() if self.z_loss_coef > 0 else probs.new_zeros(())
        if self.stats_group is not None:
            # Sum over the ranks sharing this micro-batch. f (counts, tokens) carries no gradient.
            # P and z go through the differentiable all-reduce: its backward sums the (identical)
            # upstream gradients of all group ranks, so each rank's router gradient is group-size x
            # its tokens' share of grad(aux); averaging gradients over the group (dp_cp) divides that
            # factor out again, leaving exactly grad(aux) of the whole micro-batch's statistics.
            import torch.distributed as dist

            plain = torch.cat([counts, tokens.view(1)])
            dist.all_reduce(plain, group=self.stats_group)
            counts, tokens = plain[:-1], plain[-1]
            summed = group_sum(torch.cat([prob_sum, z_sum.view(1)]), self.stats_group)
            prob_sum, z_sum = summed[:-1], summed[-1]
        f = counts / (tokens * self.top_k)
        p = prob_sum / tokens
        aux = self.aux_loss_coef * self.num_experts * (f * p).sum()
        z = self.z_loss_coef * z_sum / tokens
        return aux, z, counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        top_i, weights, keep, probs, logits = self.route(tokens)
        # Dispatch: the kept (token, slot) pairs, sorted by expert (stable: token order inside one).
        flat_e = top_i.reshape(-1)
        kept = keep.reshape(-1).nonzero().squeeze(-1)
        order = kept[torch.argsort(flat_e[kept], stable=True)]
        counts = torch.bincount(flat_e[order], minlength=self.num_experts)
        token_of = order // self.top_k
        y = self.experts(tokens[token_of], counts)
        y = (y.float() * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        # Combine: put each kept copy back in its (token, slot) place and sum the k slots. Unlike
        # index_add (whose backward keeps the whole source alive) this saves only the indices, and it
        # adds a token's slots in the same order (slot 0 + slot 1 ...) whatever the layout.
        slots = tokens.new_zeros(flat_e.numel(), shape[-1]).index_put((order,), y)
        out = slots.view(-1, self.top_k, shape[-1]).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_forward(tokens)

        # Always the same ops (also when recomputed: activation checkpointing needs the replay to
        # save the same tensors); without a loss to train they only feed the logged statistics.
        train_aux = self.aux_loss_coef > 0 or self.z_loss_coef > 0
        with contextlib.nullcontext() if train_aux else torch.no_grad():
            aux, z, routed = self.aux_losses(top_i, probs, logits)
        if not _in_backward():
            self.stats_load += routed.detach().double().cpu()
            self.stats_dropped += float(flat_e.numel() - order.numel())
            self.stats_aux += float(aux.detach())
            self.stats_z += float(z.detach())
            self.stats_forwards += 1
        if train_aux and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, aux + z, self.aux_grad_scale * self.aux_grad_share)
        return out.view(shape)
