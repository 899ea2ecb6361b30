"""Gradient compression on DDP's all-reduce (parallel.grad_compression), as DDP communication hooks.

DDP (zero 0, and zero 1: gradients all-reduced by DDP, optimizer state sharded by ZeroOneOptimizer)
hands each gradient bucket to a hook (`register_comm_hook`); the hook returns a future of the
averaged bucket. What each method sends, per rank and bucket of n fp32 gradients on w ranks (the
closed forms, and the planner's bytes, are plan/compression.py's):

  bf16      torch's default_hooks.bf16_compress_hook, restated (`_bf16_hook`): DDP refuses torch's own
            by name unless CUDA 11+ with NCCL 2.10+ (or XPU), and gloo reduces bf16 fine. all_reduce of the
            bucket cast to bf16 and divided by w (2n bytes), cast back into the bucket.
  int8      ours (torch has no int8 hook): each parameter's gradient in chunks of INT8_CHUNK entries,
            each chunk with its own fp32 scale absmax/127, rounded to nearest; one all_gather of
            [int8 payload | scales] (n + 4 x chunks bytes per rank), the w dequantized copies summed
            locally in rank order. An int8 all-reduce
            would overflow (w values of up to 127 summed in int8) and cannot carry per-rank scales.
            Nearest rather than stochastic rounding (QSGD, Alistarh et al. 2017): with error feedback the
            rounding bias is carried into the next step (Karimireddy et al. 2019, arXiv 1901.09847, show
            EF makes biased compressors converge), nearest has half the variance, and it draws no random
            numbers, so a resumed run replays bitwise without an extra RNG to checkpoint.
  topk      ours (torch has none): the ceil(ratio x n) entries of largest magnitude of each parameter's
            gradient (Stich et al. 2018, "Sparsified SGD with memory"; layer-wise); one all_gather of [fp32 values | int32 indices]
            (8k bytes per rank) summed locally with index_add in rank order.
  powersgd  torch's powerSGD_hook / PowerSGDState (Vogels et al. 2019, arXiv 1905.13727): rank-r factors
            P, Q of every matrix gradient, error feedback and warm start on; 1-D tensors and matrices
            it would not shrink by min_compression_rate go uncompressed; plain all-reduce for the first
            powersgd_warmup_steps steps.

int8 and topk keep an error-feedback residual per rank: what was not sent is added to the next step's
gradient (Seide et al. 2014, 1-bit SGD; Karimireddy et al. 2019). It is kept per *parameter* (not per
bucket index) so that DDP's bucket rebuild after the first iteration cannot misalign it and a
checkpoint names it by parameter (state_tensors / load_state_tensors, train/checkpoint.py).

Both gradients are divided by w before compression, as DDP's built-in all-reduce does, so topk with
ratio 1 reproduces it exactly on 2 ranks (a + b summed in either order is one float).

Collectives are issued in the hook itself (on the thread running backward), never in a future's
callback: the communication counter (comm_counter.py) is a thread-local dispatch mode, and gloo runs
callbacks on its own threads. torch's PowerSGD does issue its P and Q all-reduces in callbacks; the
hook wrapper below runs it uncounted and sizes its all-reduces itself (CountedPowerSGD, add_hook_bytes).
"""
# No `from __future__ import annotations`: DDP checks a hook's annotations as objects (GradBucket, Future).

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.utils._python_dispatch import _disable_current_modes

from shardwise.spec.compression import INT8_CHUNK, INT8_LEVELS, powersgd_elements, topk_count


# ---- int8 / topk encodings (pure functions, unit-tested without process groups) ----------------------
def int8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scale per chunk of INT8_CHUNK entries) of a flat fp32 tensor."""
    n = x.numel()
    chunks = max(1, math.ceil(n / INT8_CHUNK))
    padded = torch.nn.functional.pad(x, (0, chunks * INT8_CHUNK - n)).view(chunks, INT8_CHUNK)
    scale = padded.abs().amax(dim=1) / INT8_LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q.view(-1)[:n], scale


def int8_decode(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    chunks = scale.numel()
    padded = torch.nn.functional.pad(q.to(torch.float32), (0, chunks * INT8_CHUNK - n)).view(chunks, INT8_CHUNK)
    return (padded * scale[:, None]).view(-1)[:n]


def int8_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One int8 buffer [values | scales' bytes]: one all_gather carries both."""
    return torch.cat([q, scale.contiguous().view(torch.int8)])


def int8_unpack(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return buf[:n], buf[n:].contiguous().view(torch.float32)


def topk_encode(x: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int32 indices) of the ceil(ratio x n) entries of largest magnitude."""
    k = topk_count(x.numel(), ratio)
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return x[idx], idx.to(torch.int32)


def topk_pack(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.cat([values.contiguous().view(torch.int32), idx])


def topk_unpack(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = buf.numel() // 2
    return buf[:k].contiguous().view(torch.float32), buf[k:].long()


# ---- the hooks' state --------------------------------------------------------------------------------
class ErrorFeedback:
    """A DDP hook state holding one residual per parameter (zeros until first written)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, method: str, ratio: float):
        self.group, self.method, self.ratio = group, method, ratio
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.residual: dict[str, torch.Tensor] = {}

    def take(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
        """The bucket's residual, flat in the bucket's order."""
        parts = [self.residual.get(self.names[id(p)]) for p in params]
        return torch.cat([r if r is not None else torch.zeros(g.numel(), dtype=g.dtype, device=g.device)
                          for r, g in zip(parts, grads)])

    def keep(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for p in params:
            self.residual[self.names[id(p)]] = flat[offset:offset + p.numel()].clone()
            offset += p.numel()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"residual.{name}": t for name, t in self.residual.items()}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        self.residual = {k.removeprefix("residual."): v.clone() for k, v in state.items() if k.startswith("residual.")}


def _ef_hook(state: ErrorFeedback, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """int8 / topk with error feedback: compress (g / w + residual) parameter by parameter, all_gather
    one buffer, sum the w decoded copies in rank order. Per parameter (int8's chunks, topk's k) rather
    than per bucket: what is sent then does not depend on how DDP groups and orders a bucket, which
    changes once (its rebuild after the first iteration; a resumed run starts from the initial order),
    so a resumed run sends exactly what the straight one does."""
    buf = bucket.buffer()
    w = dist.get_world_size(state.group)
    params, grads = bucket.parameters(), bucket.gradients()
    x = buf.div(w) + state.take(params, grads)
    sizes = [g.numel() for g in grads]
    xs = x.split(sizes)
    n = x.numel()
    if state.method == "int8":
        encoded = [int8_encode(part) for part in xs]
        sent = torch.cat([int8_decode(q, scale) for q, scale in encoded])
        payload = int8_pack(torch.cat([q for q, _ in encoded]), torch.cat([scale for _, scale in encoded]))
        chunks = [scale.numel() for _, scale in encoded]
    else:
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        encoded = [topk_encode(part, state.ratio) for part in xs]
        values = torch.cat([v for v, _ in encoded])
        idx = torch.cat([i + o for (_, i), o in zip(encoded, offsets)])
        sent = torch.zeros_like(x).index_put_((idx.long(),), values)
        payload = topk_pack(values, idx)
    state.keep(params, x - sent)
    gathered = torch.empty(w * payload.numel(), dtype=payload.dtype, device=payload.device)
    fut = dist.all_gather_single(gathered, payload, group=state.group, async_op=True).get_future()

    def decode(_fut) -> torch.Tensor:
        total = torch.zeros(n, dtype=buf.dtype, device=buf.device)
        for part in gathered.view(w, -1):
            if state.method == "int8":
                q, scale = int8_unpack(part, n)
                total += torch.cat([int8_decode(qp, sp) for qp, sp in zip(q.split(sizes), scale.split(chunks))])
            else:
                values, idx = topk_unpack(part)
                total.index_add_(0, idx, values)
        buf.copy_(total)
        return buf
    return fut.then(decode)


def _bf16_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """default_hooks._compress_hook(torch.bfloat16, ...) (torch 2.13), which DDP will not register on CPU."""
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(_fut) -> torch.Tensor:
        buf.copy_(compressed)
        return buf
    return fut.then(decompress)


class CountedPowerSGD:
    """torch's PowerSGDState, plus the bytes its hook's all-reduces move. The hook issues the P and Q
    all-reduces inside future callbacks, which run on gloo's threads — or inline on the calling thread
    when the previous collective has already finished — so whether the communication counter (a
    thread-local dispatch mode) would see them is a race. The hook therefore runs with the counter
    suspended and sizes all three all-reduces itself (`last_step_bytes`, for the last completed step);
    add_hook_bytes() adds them to what the counter saw."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, rank: int, warmup: int):
        # torch requires start_powerSGD_iter > 1 with error feedback / warm start (DDP rebuilds its
        # buckets after the first iteration, and the per-bucket state would not line up): spec/rules.py
        # refuses powersgd_warmup_steps < 2 before anything starts.
        self.group = group
        self.state = psgd.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup,
                                        use_error_feedback=True, warm_start=True)
        self.pending = 0
        self.last_step_bytes = 0
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        # The parameter order each bucket's state (error, P, Q) is laid out in. DDP orders a bucket by
        # parameter creation first and by gradient arrival after its rebuild (iteration 2); a resumed
        # run starts over from the first order. torch's PowerSGD keys its state by bucket index and
        # assumes one layout, so the state is permuted when the order changes (_reorder).
        self.order: dict[int, list[str]] = {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        s = self.state
        out = {"iter": torch.tensor(s.iter, dtype=torch.int64)}
        for name, table in (("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict)):
            out.update({f"{name}.{i}": t for i, t in table.items()})
        out.update({f"order.{i}": names for i, names in self.order.items()})
        kind, keys, pos, has_gauss, gauss = s.rng.get_state()
        out.update({"rng.keys": torch.from_numpy(keys.astype("int64")), "rng.pos": torch.tensor(pos),
                    "rng.has_gauss": torch.tensor(has_gauss), "rng.gauss": torch.tensor(gauss, dtype=torch.float64)})
        return out

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        s = self.state
        s.iter = int(state["iter"])
        for name, table in (("error", s.error_dict), ("p", s.p_memory_dict), ("q", s.q_memory_dict)):
            table.clear()
            table.update({int(k.split(".", 1)[1]): v.clone() for k, v in state.items() if k.startswith(f"{name}.")})
        self.order = {int(k.split(".", 1)[1]): list(v) for k, v in state.items() if k.startswith("order.")}
        s.rng.set_state(("MT19937", state["rng.keys"].numpy().astype("uint32"), int(state["rng.pos"]),
                         int(state["rng.has_gauss"]), float(state["rng.gauss"])))


def _powersgd_hook(counted: CountedPowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    s = counted.state
    compressing = s.iter >= s.start_powerSGD_iter  # the hook counts iterations itself
    names = [counted.names[id(p)] for p in bucket.parameters()]
    if compressing and bucket.index() in s.error_dict and counted.order.get(bucket.index(), names) != names:
        _reorder(counted, bucket.index(), counted.order[bucket.index()], names)
    counted.order[bucket.index()] = names
    if not compressing:  # warm-up: one plain all-reduce of the bucket
        counted.pending += bucket.buffer().numel() * bucket.buffer().element_size()
    with _disable_current_modes():
        fut = psgd.powerSGD_hook(s, bucket)
    if compressing:  # the uncompressed tensors (as torch decides: spec/compression.py), then P and Q
        counted.pending += 4 * sum(powersgd_elements(tuple(g.shape), s.matrix_approximation_rank)[0]
                                   for g in bucket.gradients())
        counted.pending += sum(t.numel() * t.element_size()
                               for t in (s.p_memory_dict[bucket.index()], s.q_memory_dict[bucket.index()]))
    if bucket.is_last():
        counted.last_step_bytes, counted.pending = counted.pending, 0
    return fut


def _reorder(counted: CountedPowerSGD, b: int, old: list[str], new: list[str]) -> None:
    """Permute bucket b's error vector and P / Q memories from parameter order `old` to `new`."""
    s = counted.state
    if sorted(old) != sorted(new):  # another set of parameters in this bucket: its state no longer applies
        for table in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            table.pop(b, None)
        return

    def by_shape(names: list[str]) -> list[str]:
        groups: dict[tuple, list[str]] = {}
        for name in names:
            if powersgd_elements(counted.shapes[name], s.matrix_approximation_rank)[1]:
                groups.setdefault(tuple(counted.shapes[name][:1]) + (math.prod(counted.shapes[name]),), []).append(name)
        return [name for group in groups.values() for name in group]

    def permute(flat: torch.Tensor, old_names: list[str], new_names: list[str], size) -> torch.Tensor:
        parts = dict(zip(old_names, flat.split([size(name) for name in old_names])))
        return torch.cat([parts[name] for name in new_names]) if new_names else flat

    r = s.matrix_approximation_rank
    s.error_dict[b] = permute(s.error_dict[b], old, new, lambda name: math.prod(counted.shapes[name]))
    s.p_memory_dict[b] = permute(s.p_memory_dict[b], by_shape(old), by_shape(new),
                                 lambda name: powersgd_elements(counted.shapes[name], r)[1])
    s.q_memory_dict[b] = permute(s.q_memory_dict[b], by_shape(old), by_shape(new),
                                 lambda name: powersgd_elements(counted.shapes[name], r)[2])


def steady_state_step(p, dims) -> int:
    """The 0-based step whose collectives are those of every later step: PowerSGD's first compressed
    step (it all-reduces plainly before powersgd_warmup_steps), else the first."""
    if p.grad_compression == "powersgd" and dims.wrapper(p.zero) == "ddp" and dims.dp * dims.cp > 1:
        return p.powersgd_warmup_steps
    return 0


def add_hook_bytes(totals: dict[str, dict[str, int]], state, group_axes: dict[str, str]) -> dict[str, dict[str, int]]:
    """The counter's totals for a step plus the all-reduces of PowerSGD's hook (CountedPowerSGD)."""
    if not isinstance(state, CountedPowerSGD) or not state.last_step_bytes:
        return totals
    axis = group_axes.get(state.group.group_name, "dp")
    kinds = dict(totals.get(axis, {}))
    kinds["all_reduce"] = kinds.get("all_reduce", 0) + state.last_step_bytes
    return {**totals, axis: kinds}


def register_compression(model: nn.Module, ddp: nn.Module, group: dist.ProcessGroup, p) -> object | None:
    """Register parallel.grad_compression's hook on `ddp` (a DistributedDataParallel around `model`);
    returns its state (for checkpoints: state_tensors / load_state_tensors), or None."""
    method = p.grad_compression
    if method == "none":
        return None
    if method == "bf16":
        ddp.register_comm_hook(group, _bf16_hook)
        return None
    if method in ("int8", "topk"):
        state = ErrorFeedback(model, group, method, p.grad_compression_ratio)
        ddp.register_comm_hook(state, _ef_hook)
        return state
    if method == "powersgd":
        counted = CountedPowerSGD(model, group, p.powersgd_rank, p.powersgd_warmup_steps)
        ddp.register_comm_hook(counted, _powersgd_hook)
        return counted
    raise ValueError(f"unknown parallel.grad_compression {method!r}")  # spec/rules.py refuses it first


def checkpoint_state(state, p, layout: str) -> dict | None:
    """What checkpoints save of this rank's compression state (train/checkpoint.py rank_state): the
    method, the layout it belongs to and its tensors (ints as 0-d tensors); None when stateless."""
    if state is None:
        return None
    return {"method": p.grad_compression, "layout": layout, "tensors": state.state_tensors()}


def restore_state(state, p, layout: str, saved: dict | None) -> str | None:
    """Load a checkpoint's compression state into `state`; returns why it was not restored (a note for
    the log) or None. Another method or layout starts error feedback afresh: the residuals are per rank
    and per parameter of this layout, and PowerSGD's are per DDP bucket."""
    if state is None:
        return None
    if saved is None:
        return "the checkpoint holds no compression state: error feedback starts from zero"
    if saved.get("method") != p.grad_compression or saved.get("layout") != layout:
        return (f"the checkpoint's compression state is for {saved.get('method')} on {saved.get('layout')}, "
                f"not {p.grad_compression} on {layout}: error feedback starts from zero")
    state.load_state_tensors(saved["tensors"])
    return None
