"""Context parallelism (CP): every sequence is cut over the cp axis, attention exchanges what it needs.

Why our own: torch's `torch.distributed.tensor.experimental.context_parallel` has no sharding strategy
for the CPU flash SDPA op (docs/architecture.md §9), so it cannot run here; the two algorithms below are plain
autograd code over a process group and work on gloo and NCCL alike.

Load balance ("zigzag"): with a causal mask the i-th of n equal chunks attends to i+1 chunks, so a
contiguous split leaves the first rank almost idle and the last one doing ~2/cp of the work. Each
sequence is instead cut into 2·cp chunks and cp rank r keeps chunks r and 2cp-1-r, so every rank holds
one "early" and one "late" chunk and does the same work (Brandon et al. 2023, "Striped Attention",
arXiv 2311.09431, and the Llama 3 report, Dubey et al. 2024 §3.3.2, which uses exactly this split).
Tokens, targets and the global positions (RoPE / learned positions) all use `zigzag_index`.

ring: pass-KV ring attention (Liu et al. 2023, arXiv 2310.01889). K/V blocks travel cp-1 hops around
  the ring with `batch_isend_irecv`, the next transfer overlapping the current block's compute; blocks
  are merged with the online-softmax log-sum-exp rule (Milakov & Gimelshein 2018, arXiv 1805.02867).
  Backward recomputes each block from the saved LSE (FlashAttention-2 backward, Dao 2023, arXiv
  2307.08691) and sends the dK/dV accumulators around the same ring so each lands on its owner:
  cp-1 hops of K/V and cp-1 hops of dK/dV, what plan/comm.py predicts.
ulysses: all-to-all from (local heads, sequence shard) to (heads/cp, whole sequence), causal SDPA,
  and back (Jacobs et al. 2023, DeepSpeed-Ulysses, arXiv 2309.14509).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.models.common import Attention
from shardwise.parallel.tiling import UncachedRegion


def zigzag_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds, in its local order: chunk r then chunk
    2cp-1-r of 2·cp equal chunks. Also the index that cuts a (b, seq) batch for this rank."""
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def local_chunks(rank: int, cp: int) -> tuple[int, int]:
    """Global chunk ids (out of 2·cp) of rank `rank`'s two local halves."""
    return rank, 2 * cp - 1 - rank


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 (or fp64) stays as is; 16-bit inputs are computed in fp32 (the merge of block softmaxes
    would otherwise round once per block)."""
    return torch.promote_types(dtype, torch.float32)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: KV head j serves query heads [j·g, (j+1)·g) as in SDPA's enable_gqa."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _compact(grad: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _pairs(q_rank: int, kv_rank: int, cp: int):
    """(q half, kv half, causal) for every pair of local halves that attends: a query chunk sees a
    whole earlier chunk, the causal part of its own, and nothing of a later one (skipped)."""
    for a, qa in enumerate(local_chunks(q_rank, cp)):
        for b, kb in enumerate(local_chunks(kv_rank, cp)):
            if qa > kb:
                yield a, b, False
            elif qa == kb:
                yield a, b, True


class _Ring:
    """The ring of one cp group: this rank's neighbours as global ranks. K/V go to rank-1 and come
    from rank+1, so at step i a rank holds the block of cp rank (rank + i) mod cp."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        self.prev, self.next = ranks[(self.rank - 1) % self.size], ranks[(self.rank + 1) % self.size]
        self.backend = dist.get_backend(group)

    def shift(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending `send` to the previous rank and receiving the next rank's; returns the
        receive buffer and the requests to wait on (the buffer is filled once they are waited on)."""
        if host_staged(self.backend, send.device.type):
            host = send.cpu()
            recv, host_recv = torch.empty_like(send), torch.empty_like(host)
            ops = [dist.P2POp(dist.isend, host, self.prev, self.group),
                   dist.P2POp(dist.irecv, host_recv, self.next, self.group)]
            return recv, [_CopyOnWait(dist.batch_isend_irecv(ops), host_recv, recv)]
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.prev, self.group), dist.P2POp(dist.irecv, recv, self.next, self.group)]
        return recv, dist.batch_isend_irecv(ops)


def host_staged(backend: str, device_type: str) -> bool:
    """Whether point-to-point transfers go through host memory: gloo carries CUDA tensors in its
    collectives but not in send / recv ("Bad address" on an H100, torch 2.11), which is what
    run.backend="gloo" meets when several ranks share a GPU (`make gpu-check`)."""
    return backend == "gloo" and device_type != "cpu"


class _CopyOnWait:
    """A host-staged receive: waiting on it waits on the transfers, then copies the host buffer to the device's."""

    def __init__(self, reqs: list, host: torch.Tensor, device: torch.Tensor):
        self.reqs, self.host, self.device = reqs, host, device

    def wait(self) -> None:
        _wait(self.reqs)
        self.device.copy_(self.host)


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        # The trainer runs forward under torch.autocast for bf16/fp16: left on, it would cast the fp32
        # copies below back to 16 bits inside every matmul, so scores, block merges and LSE would round
        # to bf16 once per block. Off here (and in backward), they are computed in _compute_dtype.
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, ring)

    @staticmethod
    def _forward(ctx, q, k, v, ring: _Ring):
        cp, rank = ring.size, ring.rank
        dt = _compute_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        qc = q.to(dt).chunk(2, dim=2)
        out: list[torch.Tensor | None] = [None, None]
        lse: list[torch.Tensor | None] = [None, None]
        kv = torch.stack([k, v])  # compact (n_kv heads) and in the input dtype on the wire
        for step in range(cp):
            src = (rank + step) % cp
            if step < cp - 1:
                nxt, reqs = ring.shift(kv)
            kk, vv = (_expand(t.to(dt), groups).chunk(2, dim=2) for t in kv)
            for a, b, causal in _pairs(rank, src, cp):
                s = _scores(qc[a], kk[b], scale, causal)
                l_b = torch.logsumexp(s, dim=-1, keepdim=True)
                o_b = torch.matmul(torch.exp(s - l_b), vv[b])
                if out[a] is None:
                    out[a], lse[a] = o_b, l_b
                else:  # online softmax: rescale both partial outputs to the merged normalizer
                    new = torch.logaddexp(lse[a], l_b)
                    out[a] = out[a] * torch.exp(lse[a] - new) + o_b * torch.exp(l_b - new)
                    lse[a] = new
            if step < cp - 1:
                _wait(reqs)
                kv = nxt
        # Like FlashAttention-2, keep the output in the input dtype (the tensor returned, so nothing
        # extra is stored) and the LSE in fp32: the same inventory SDPA saves (plan/activations.py).
        o = torch.cat(out, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        ctx.ring, ctx.scale, ctx.groups = ring, scale, groups
        return o

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        ring, scale, groups = ctx.ring, ctx.scale, ctx.groups
        cp, rank = ring.size, ring.rank
        dt = lse.dtype
        qc, doc = q.to(dt).chunk(2, dim=2), dout.to(dt).chunk(2, dim=2)
        lsec = lse.chunk(2, dim=2)
        delta = [(d * oo).sum(-1, keepdim=True) for d, oo in zip(doc, o.to(dt).chunk(2, dim=2))]  # D = rowsum(dO∘O)
        dq = [torch.zeros_like(x) for x in qc]

        def block_grads(kv: torch.Tensor, src: int) -> torch.Tensor:
            """dK, dV (compact, stacked) of block `src` from this rank's queries; adds into dq."""
            kk, vv = (_expand(t.to(dt), groups) for t in kv)
            dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
            kc, vc, dkc, dvc = kk.chunk(2, 2), vv.chunk(2, 2), dk.chunk(2, 2), dv.chunk(2, 2)
            for a, b, causal in _pairs(rank, src, cp):
                p = torch.exp(_scores(qc[a], kc[b], scale, causal) - lsec[a])
                dvc[b].add_(torch.matmul(p.transpose(-1, -2), doc[a]))
                ds = p * (torch.matmul(doc[a], vc[b].transpose(-1, -2)) - delta[a])
                dq[a].add_(torch.matmul(ds, kc[b]) * scale)
                dkc[b].add_(torch.matmul(ds.transpose(-1, -2), qc[a]) * scale)
            return torch.stack([_compact(dk, groups), _compact(dv, groups)])

        # Step 0 is this rank's own block; steps 1..cp-1 see block rank+i, whose dK/dV accumulator
        # arrives from rank+1 (it handled that block one step earlier) and leaves for rank-1; after
        # the last step the accumulator of this rank's own block arrives, having visited every rank.
        kv = torch.stack([k, v])
        acc, acc_reqs = None, []
        own = None
        for step in range(cp):
            src = (rank + step) % cp
            if step < cp - 1:
                nxt, reqs = ring.shift(kv)
            partial = block_grads(kv, src)
            if step == 0:
                own = partial
            else:
                if step >= 2:
                    _wait(acc_reqs)
                    partial = partial + acc
                acc, acc_reqs = ring.shift(partial)
            if step < cp - 1:
                _wait(reqs)
                kv = nxt
        _wait(acc_reqs)
        dkv = own + acc
        return (torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None)


class RingAttention:
    """Causal ring attention over a cp group; a drop-in for Attention.core (q, k, v) -> out, with
    q (b, heads, s/cp, d) and k, v (b, kv heads, s/cp, d) in zigzag order."""

    def __init__(self, group: dist.ProcessGroup):
        self.ring = _Ring(group)
        # Selective checkpointing must not cache the matmuls inside: a score block per pair of chunks
        # (parallel/activation_checkpoint.py reads it; the replay reruns the ring, exchange included).
        self.uncached = UncachedRegion()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with self.uncached.running():
            return _RingAttention.apply(q, k, v, self.ring)


class UlyssesAttention:
    """Causal attention by two all-to-alls per direction and tensor: the sequence shard of every head
    becomes the whole sequence of heads/cp heads. Local query heads must be divisible by cp
    (preflight). When local KV heads are not (GQA with few KV heads), each is repeated r times,
    r = cp / gcd(kv heads, cp), the fewest copies that split evenly; r divides the query group size,
    so every cp rank's query heads still find their own KV head (plan/comm.py counts those bytes)."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int):
        self.group = group
        self.cp = dist.get_world_size(group)
        order = torch.cat([zigzag_index(seq_len, self.cp, r) for r in range(self.cp)])
        self.order = order                      # gathered (zigzag) position -> global position
        self.natural = torch.argsort(order)     # global position -> gathered position

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        b, h, s, d = x.shape
        send = x.reshape(b, self.cp, h // self.cp, s, d).transpose(0, 1).contiguous()  # dim 0: destination
        recv = wait_tensor(all_to_all_single_autograd(send, None, None, self.group))     # dim 0: source
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)

    def _heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        b, h, s, d = x.shape
        send = x.reshape(b, h, self.cp, s // self.cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = wait_tensor(all_to_all_single_autograd(send, None, None, self.group))
        return recv.transpose(0, 1).reshape(b, self.cp * h, s // self.cp, d)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] % self.cp:
            r = self.cp // math.gcd(k.shape[1], self.cp)
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        natural, order = self.natural.to(q.device), self.order.to(q.device)
        q, k, v = (self._seq_to_heads(t).index_select(2, natural) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self._heads_to_seq(out.index_select(2, order))


def apply_context_parallel(model: nn.Module, cp_mesh, mode: str, seq_len: int) -> None:
    """Install CP on a model (or pipeline stage) in place: every Attention's core becomes ring or
    Ulysses attention over `cp_mesh`, and a forward pre-hook hands the model this rank's global
    positions, so RoPE / learned positions see the right indices without the trainer or the
    pipeline schedule passing them."""
    group = cp_mesh.get_group()
    core = RingAttention(group) if mode == "ring" else UlyssesAttention(group, seq_len)
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = core
    positions = zigzag_index(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())

    def add_positions(_module, args, kwargs):
        if kwargs.get("positions") is None:
            kwargs = {**kwargs, "positions": positions.to(args[0].device)}
        return args, kwargs

    model.register_forward_pre_hook(add_positions, with_kwargs=True)
