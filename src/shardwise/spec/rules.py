"""Every rule a model shape or a layout must obey, written once.

Each function yields `Violation`s (spec/layout.py) in a fixed order, cheapest first. Pre-flight
(preflight.py) raises the first one as a ConfigError before anything is spawned; the planner
(plan/layout.py check_layout) prunes with the first one and counts its `reason`. A rule marked
`trainer_only` describes what the trainer implements today rather than what could run at all: the
planner still evaluates such layouts and says "trainable: no, because ..." (docs/architecture.md,
"Rules").

Inputs are duck-typed: `m` is anything with the model's shape fields (ModelConfig or ModelShape),
`lay` a spec/layout.py Layout, `dims` anything with the axis sizes (ParallelDims or Layout).
"""
from __future__ import annotations

import math
from typing import Any, Iterator

from shardwise.errors import Violation
from shardwise.spec.compression import METHODS as COMPRESSION_METHODS
from shardwise.spec.dims import ep_fold_rule, world_rules  # noqa: F401  (the world's rules live with the dims)
from shardwise.spec.layout import CP_MODES, PER_OP_POLICIES, RECOMPUTE, Layout
from shardwise.spec.shapes import ARCH_NAMES
from shardwise.spec.stages import SCHEDULES, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED

Rules = Iterator[Violation]


def choice(field: str, value: str, choices: tuple[str, ...], reason: str | None = None) -> Violation | None:
    if value in choices:
        return None
    return Violation(reason or field.rsplit(".", 1)[-1], field, f"{value!r} is not one of {', '.join(choices)}",
                     f"set {field} to one of: {', '.join(choices)}")


def at_least(field: str, value: float, minimum: float = 1) -> Violation | None:
    if value >= minimum:
        return None
    return Violation(field.rsplit(".", 1)[-1], field, f"must be >= {minimum}, got {value}", f"set {field} to at least {minimum}")


def _some(*candidates: Violation | None) -> Rules:
    yield from (v for v in candidates if v is not None)


# ---- the model ---------------------------------------------------------------------------------------
def model_rules(m: Any) -> Rules:
    """The shape rules every consumer of a model shape needs."""
    yield from _some(choice("model.arch", m.arch, ARCH_NAMES))
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        yield from _some(at_least(f"model.{name}", getattr(m, name)))
    if m.dim % m.n_heads:
        yield Violation("heads", "model.n_heads", f"dim({m.dim}) is not divisible by n_heads({m.n_heads})",
                        "choose n_heads among the divisors of model.dim")
    if m.n_heads % m.n_kv_heads:
        yield Violation("kv heads", "model.n_kv_heads", f"n_heads({m.n_heads}) is not divisible by n_kv_heads({m.n_kv_heads})",
                        "grouped-query attention needs n_kv_heads to divide n_heads")


def moe_rules(moe: Any, n_layers: int) -> Rules:
    """model.moe.* on its own (`moe` with num_experts = 0 or None is a dense model)."""
    if moe is None or not moe.num_experts:
        return
    yield from _some(at_least("model.moe.num_experts", moe.num_experts))
    if not 1 <= moe.top_k <= moe.num_experts:
        yield Violation("top_k", "model.moe.top_k", f"top_k({moe.top_k}) must be within 1..num_experts({moe.num_experts})",
                        "choose 1 <= top_k <= num_experts")
    yield from _some(at_least("model.moe.every_k_layers", moe.every_k_layers))
    if moe.every_k_layers > n_layers:
        yield Violation("every_k_layers", "model.moe.every_k_layers", f"every_k_layers({moe.every_k_layers}) > "
                        f"n_layers({n_layers}): no block would be MoE", f"choose every_k_layers <= {n_layers}")
    for name in ("capacity_factor", "expert_ffn_dim", "num_shared_experts", "aux_loss_coef", "z_loss_coef"):
        if hasattr(moe, name):
            yield from _some(at_least(f"model.moe.{name}", getattr(moe, name), 0))


def trainable_model_rules(m: Any, seq_len: int) -> Rules:
    """What the model code needs beyond the shape: RoPE's pairs, the position table."""
    if m.arch == "llama" and (m.dim // m.n_heads) % 2:
        yield Violation("rope", "model.n_heads", f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs of dims",
                        "choose n_heads so that dim / n_heads is even")
    if seq_len > m.max_seq_len:
        yield Violation("seq_len", "train.seq_len", f"{seq_len} exceeds model.max_seq_len({m.max_seq_len})",
                        f"lower train.seq_len or raise model.max_seq_len to >= {seq_len}")


# ---- one layout --------------------------------------------------------------------------------------
def layout_rules(s: Any, lay: Layout, seq_len: int, global_batch: int, node_size: int = 0,
                 even_pp: bool = False, precision: str | None = None) -> Rules:
    """Every rule of one layout of model shape `s` (spec/shapes.py ModelShape), in the order the
    planner counts them. The world size is checked by world_rules. Two constraints are the planner's
    choices rather than rules (the trainer runs either): `node_size` > 0 keeps tp inside a node of that
    many devices, `even_pp` asks for an even pipeline split. `precision` (train.precision; None: not
    known) is read by the rules that depend on it (linear_tiles_rules)."""
    yield from data_parallel_rules(lay)
    yield from tensor_parallel_rules(s, lay, seq_len, node_size)
    yield from tensor_parallel_2d_rules(s, lay, node_size, precision)
    yield from pipeline_rules(s, lay, even_pp)
    yield from context_parallel_rules(s, lay, seq_len)
    yield from expert_parallel_rules(s, lay)
    yield from linear_tiles_rules(s, lay, precision)
    yield from grad_compression_rules(lay)
    if lay.micro_batch < 1 or global_batch % (lay.micro_batch * lay.dp):
        yield Violation("batch", "train.global_batch",
                        f"global_batch({global_batch}) is not divisible by micro_batch({lay.micro_batch}) x "
                        f"data-parallel size({lay.dp}) = {lay.micro_batch * lay.dp}",
                        f"use a global_batch that is a multiple of {lay.micro_batch * lay.dp}, or change train.micro_batch")
        return  # the micro-batch count below is meaningless
    yield from _some(microbatch_rule(lay.schedule, lay.pp, global_batch // (lay.micro_batch * lay.dp)))
    if lay.pp > 1:
        yield from _some(split_backward_rule(lay.schedule, lay.zero, lay.recompute, lay.recompute_policy))
    yield from _some(choice("train.recompute", lay.recompute, RECOMPUTE, "recompute"))
    yield from _some(alternate_matmuls_rule(s, lay))


def alternate_matmuls_rule(s: Any, lay: Layout) -> Violation | None:
    """recompute_policy "op_alternate" keeps every other matmul of a block by its place in the forward
    (parallel/activation_checkpoint.py): a dense block's linears, in a fixed order the planner prices. A MoE
    block's matmuls depend on the routing, and a tiled MLP's are not cached at all."""
    if lay.recompute != "selective" or lay.recompute_policy != "op_alternate":
        return None
    if s.moe is not None:
        return Violation("op_alternate", "train.recompute_policy", "op_alternate is priced and measured for dense "
                         "blocks; a MoE block's matmuls follow its routing", 'use train.recompute_policy="op" for a MoE model')
    if lay.tp_mode == "2d":
        return Violation("op_alternate", "train.recompute_policy", "op_alternate with 2-D tensor parallelism: its "
                         "SUMMA matmuls are not a block's linears in order", 'use train.recompute_policy="op" with tp_mode="2d"')
    if lay.linear_tiles > 1:
        return Violation("op_alternate", "train.recompute_policy", f"op_alternate with parallel.linear_tiles={lay.linear_tiles}: "
                         "a tiled MLP's matmuls are recomputed tile by tile already", 'use train.recompute_policy="op" '
                         "with tiles, or parallel.linear_tiles=1")
    return None


def zero_rule(zero: int) -> Violation | None:
    if zero in (0, 1, 2, 3):
        return None
    return Violation("zero", "parallel.zero", f"must be 0, 1, 2 or 3, got {zero}",
                     "0: DDP, 1: shard optimizer state, 2: + gradients, 3: + parameters (FSDP)")


def data_parallel_rules(lay: Layout) -> Rules:
    yield from _some(zero_rule(lay.zero))
    if lay.zero == 0 and lay.dp_shard > 1:
        yield Violation("zero", "parallel.zero", f"zero=0 shards nothing, but dp_shard={lay.dp_shard}",
                        f"set parallel.zero to 1, 2 or 3 to shard over dp_shard, or move the {lay.dp_shard} "
                        "ranks to parallel.dp_replicate for plain DDP")
    # Offload runs FSDP2 even over one rank (spec/dims.py data_parallel_wrapper): that is ZeRO-Offload on
    # one device, so zero 2/3 with a shard group of 1 is allowed there and nowhere else.
    if lay.zero > 0 and lay.shard_group == 1 and not (lay.offload and lay.zero >= 2):
        yield Violation("zero", "parallel.zero", f"zero={lay.zero} shards over dp_shard x cp, which is 1",
                        "set parallel.dp_shard > 1 (e.g. -1 for all ranks), parallel.zero=0, or parallel.offload=cpu "
                        "with zero=2/3 to keep model states in host memory on one device")
    if lay.offload and lay.zero < 2:
        yield Violation("offload", "parallel.offload", f"CPU offload needs FSDP (zero >= 2), got zero={lay.zero}",
                        "set parallel.zero=2 or 3, or parallel.offload=none")
    if lay.nvme and not lay.offload:
        yield Violation("offload", "parallel.offload", "the NVMe tier extends CPU offload", 'set parallel.offload="nvme"')


def tensor_parallel_rules(s: Any, lay: Layout, seq_len: int, node_size: int = 0) -> Rules:
    """Heads, KV heads and every ffn dim must split evenly over tp (parallel/tensor.py). 2-D TP has
    its own rules (tensor_parallel_2d_rules)."""
    tp = lay.tp
    if tp == 1 or getattr(lay, "tp_mode", "1d") == "2d":
        return
    if tp > s.n_heads:
        yield Violation("heads % tp", "parallel.tp", f"tp={tp} is larger than model.n_heads={s.n_heads}: a rank would own no head",
                        f"choose tp <= {s.n_heads} that divides n_heads")
    elif s.n_heads % tp:
        yield Violation("heads % tp", "parallel.tp", f"model.n_heads={s.n_heads} is not divisible by tp={tp}",
                        f"choose tp among the divisors of {s.n_heads}")
    if s.n_kv_heads % tp and tp % s.n_kv_heads:
        yield Violation("kv heads vs tp", "parallel.tp", f"model.n_kv_heads={s.n_kv_heads} and tp={tp}: neither divides "
                        "the other, so key/value heads can be neither split nor replicated evenly",
                        f"choose tp that divides n_kv_heads={s.n_kv_heads} or a multiple of it")
    if s.ffn_dim % tp:
        yield Violation("ffn % tp", "parallel.tp", f"model.ffn_dim={s.ffn_dim} is not divisible by tp={tp}",
                        f"choose tp among the divisors of {s.ffn_dim}, or change model.ffn_dim")
    if s.moe is not None and s.expert_ffn % tp:
        # Expert tensor parallelism (parallel/tensor.py MoERegion): every expert (and the merged
        # shared experts) is split on its ffn dim over tp, as the dense MLP.
        field = "model.moe.expert_ffn_dim" if s.moe.expert_ffn_dim else "model.ffn_dim"
        yield Violation("expert ffn % tp", field, f"tensor parallelism splits every expert's ffn dim over tp={tp}, but "
                        f"the expert ffn dim {s.expert_ffn} is not divisible by it",
                        f"choose {field} divisible by {tp}, or another parallel.tp")
    if lay.sp and seq_len % tp:
        yield Violation("seq % tp", "train.seq_len", f"sequence parallelism splits the sequence over tp={tp} ranks, "
                        f"but seq_len={seq_len} is not divisible by it",
                        f"choose seq_len divisible by {tp}, or set parallel.sequence_parallel=false")
    yield from _some(tp_node_rule(tp, node_size))


def tp_node_rule(tp: int, node_size: int) -> Violation | None:
    """The planner's choice (layout_rules' node_size > 0) to keep every TP group, 1-D or 2-D, inside a
    node: its per-layer collectives need the intra-node fabric."""
    if node_size and tp > node_size:
        return Violation("tp > gpus_per_node", "parallel.tp", f"tp({tp}) spans nodes of {node_size} GPUs",
                         "keep tp <= cluster.gpus_per_node (or pass --allow-cross-node-tp)")
    return None


TP_MODES = ("1d", "2d")


def tensor_parallel_2d_rules(s: Any, lay: Layout, node_size: int = 0, precision: str | None = None) -> Rules:
    """parallel.tp_mode="2d" (parallel/tensor2d.py: SUMMA on a q x q grid, tp = q^2): the grid, the
    splits it needs (heads, KV heads, dim, ffn dim by columns; the micro-batch by rows), and what
    is not implemented yet (trainer_only: the planner still prices those layouts). sequence_parallel
    does not apply (the grid already splits activations by batch rows and hidden columns) and is
    ignored. `precision` None (not known) skips the precision rule."""
    yield from _some(choice("parallel.tp_mode", lay.tp_mode, TP_MODES, "tp_mode"))
    if lay.tp_mode != "2d":
        return
    tp, q = lay.tp, math.isqrt(max(lay.tp, 0))
    if tp < 4 or q * q != tp:
        yield Violation("tp2d grid", "parallel.tp", f'tp_mode="2d" arranges the tp ranks in a q x q grid, so tp must be a '
                        f"perfect square >= 4, got tp={tp}", 'choose parallel.tp = 4, 9, 16, ... or tp_mode="1d"')
        return
    for field, value in (("model.n_heads", s.n_heads), ("model.n_kv_heads", s.n_kv_heads), ("model.dim", s.dim),
                         ("model.ffn_dim", s.ffn_dim)):
        if value % q:
            yield Violation("tp2d split", field, f'tp_mode="2d" splits {field.split(".")[1]} over the q={q} grid columns, '
                            f"but {field}={value} is not divisible by {q}",
                            f"choose {field} divisible by {q}, or another parallel.tp / tp_mode")
    if lay.micro_batch % q:
        yield Violation("tp2d split", "train.micro_batch", f'tp_mode="2d" splits each micro-batch\'s sequences over the '
                        f"q={q} grid rows, but micro_batch={lay.micro_batch} is not divisible by {q}",
                        f"choose train.micro_batch divisible by {q}")
    yield from _some(tp_node_rule(tp, node_size))
    missing = [(lay.pp > 1, "parallel.pp", f"pp={lay.pp}", "set parallel.pp=1"),
               (lay.cp > 1, "parallel.cp", f"cp={lay.cp}", "set parallel.cp=1"),
               (lay.ep > 1 or s.moe is not None, "parallel.ep", "expert parallelism / an MoE model",
                "set parallel.ep=1 and model.moe.num_experts=0"),
               (s.arch != "llama", "model.arch", f"arch={s.arch!r} (biases, GELU MLP, learned positions)",
                'use a llama model'),
               (lay.zero >= 1, "parallel.zero", f"zero={lay.zero} (ZeRO-1 / FSDP over 2-D sharded parameters)",
                "set parallel.zero=0 (data parallelism over parallel.dp_replicate)"),
               (lay.linear_tiles > 1, "parallel.linear_tiles", f"linear_tiles={lay.linear_tiles}",
                "set parallel.linear_tiles=1"),
               (precision not in (None, "fp32", "bf16"), "train.precision", f"precision={precision!r}",
                'set train.precision="fp32" or "bf16"')]
    for refused, field, what, fix in missing:
        if refused:
            yield Violation("tp2d not implemented", field, f'tp_mode="2d" with {what} is not implemented yet',
                            f'{fix}, or tp_mode="1d"', trainer_only=True)


def pipeline_rules(s: Any, lay: Layout, even_pp: bool = False) -> Rules:
    """The schedule, its stages per rank and the blocks to cut (micro-batches: microbatch_rule)."""
    yield from _some(choice("parallel.pp_schedule", lay.schedule, SCHEDULES, "schedule"))
    v = lay.chunks_per_rank
    if lay.pp > 1:
        yield from _some(virtual_stage_rule(lay.schedule, v))
    if lay.pp * v > s.n_layers:
        yield Violation("layers % (pp*v)", "parallel.pp", f"pp({lay.pp}) x pp_virtual_stages({v}) = {lay.pp * v} stages, "
                        f"but the model has only {s.n_layers} blocks", "use fewer stages or a deeper model")
    if even_pp and s.n_layers % (lay.pp * v):
        yield Violation("layers % (pp*v)", "parallel.pp", f"n_layers({s.n_layers}) is not divisible by pp({lay.pp}) x "
                        f"virtual stages({v})", "choose pp * pp_virtual_stages dividing model.n_layers")


def context_parallel_rules(s: Any, lay: Layout, seq_len: int) -> Rules:
    """The splits context parallelism needs (parallel/context.py): 2·cp equal chunks per sequence
    (the load-balanced causal split), SP's further split of each cp shard, and for Ulysses whole
    heads per cp rank."""
    yield from _some(choice("parallel.cp_mode", lay.cp_mode, CP_MODES, "cp_mode"))
    cp, tp = lay.cp, lay.tp
    if cp == 1:
        return
    if seq_len % (2 * cp):
        yield Violation("seq % 2cp", "train.seq_len", f"context parallelism cuts each sequence into 2 x cp = {2 * cp} equal "
                        f"chunks (load-balanced causal split), but seq_len={seq_len} is not divisible by {2 * cp}",
                        f"choose seq_len divisible by {2 * cp}, or another parallel.cp")
    if lay.sp and (seq_len // cp) % tp:
        yield Violation("seq/cp % tp", "train.seq_len", f"sequence parallelism splits each cp shard of seq_len/cp = "
                        f"{seq_len // cp} tokens over tp={tp} ranks, which does not divide it",
                        f"choose seq_len divisible by cp x tp = {cp * tp}, or set parallel.sequence_parallel=false")
    heads = s.n_heads // tp
    if lay.cp_mode == "ulysses" and heads % cp:
        yield Violation("heads/tp % cp", "parallel.cp", f"Ulysses gives each cp rank n_heads / tp / cp heads, but "
                        f"n_heads / tp = {heads} is not divisible by cp={cp}",
                        f"choose cp dividing {heads}, or set parallel.cp_mode=ring (any head count)")


def expert_parallel_rules(s: Any, lay: Layout) -> Rules:
    if lay.ep == 1:
        return
    if s.moe is None:
        yield Violation("ep", "parallel.ep", f"ep={lay.ep} splits experts, but the model has none (model.moe.num_experts=0)",
                        "set model.moe.num_experts (e.g. --model.preset=tiny-moe) or parallel.ep=1")
        return
    if s.moe.num_experts % lay.ep:
        yield Violation("ep", "parallel.ep", f"num_experts({s.moe.num_experts}) is not divisible by ep({lay.ep})",
                        "choose ep among the divisors of model.moe.num_experts")
    yield from _some(ep_fold_rule(lay))
    if lay.zero not in (2, 3):
        # DDP / ZeRO-1 reduce a whole model's gradients over the batch group; the experts differ per
        # ep rank and must not be all-reduced with each other. FSDP's units let them be left out.
        yield Violation("ep needs fsdp", "parallel.zero", f"expert parallelism needs FSDP (zero 2 or 3), got zero={lay.zero}",
                        "set parallel.zero=2 or 3 (with dp_shard = ep x efsdp)", trainer_only=True)
    if lay.dp_replicate > 1:
        yield Violation("ep with dp_replicate", "parallel.dp_replicate", f"dp_replicate={lay.dp_replicate} with ep={lay.ep} "
                        "is not implemented (the expert gradients would need an all-reduce across replicas outside FSDP)",
                        "put the data-parallel ranks in parallel.dp_shard instead", trainer_only=True)
    if lay.offload:
        yield Violation("ep with offload", "parallel.offload", "CPU offload with expert parallelism is not implemented "
                        "(the experts are outside the offloaded FSDP units when efsdp = 1)", "set parallel.offload=none",
                        trainer_only=True)


def linear_tiles_rules(s: Any, lay: Layout, precision: str | None = None) -> Rules:
    """parallel.linear_tiles (parallel/tiling.py, memory-centric tiling of the dense MLPs): at least one
    hidden unit per tile; combinations the tiled MLP does not implement yet are trainer_only (the
    planner may still evaluate them). `precision` None (not known) skips the FP8 rule."""
    tiles = lay.linear_tiles
    if tiles == 1:
        return
    yield from _some(at_least("parallel.linear_tiles", tiles))
    if tiles < 1:
        return
    if tiles > s.ffn_dim:
        yield Violation("linear_tiles", "parallel.linear_tiles", f"linear_tiles={tiles} is more than the MLP's hidden "
                        f"dim model.ffn_dim={s.ffn_dim}: a tile would hold no hidden unit",
                        f"choose parallel.linear_tiles <= {s.ffn_dim} (a few tiles, e.g. 2-8, already cut the MLP's "
                        "activations to its input)")
    if lay.tp > 1:
        yield Violation("linear_tiles with tp", "parallel.linear_tiles", f"linear_tiles={tiles} with tp={lay.tp} is not "
                        "implemented yet (the tiled MLP needs plain, unsplit weights; TP makes them DTensors)",
                        "set parallel.linear_tiles=1, or parallel.tp=1 (TP already splits the MLP's hidden dim over "
                        "ranks)", trainer_only=True)
    if precision == "fp8":
        yield Violation("linear_tiles with fp8", "parallel.linear_tiles", f"linear_tiles={tiles} with train.precision="
                        '"fp8" is not implemented yet (the tiled MLP would bypass the Float8Linear GEMMs)',
                        'set parallel.linear_tiles=1, or train.precision="bf16"', trainer_only=True)
    if s.moe is not None:
        yield Violation("linear_tiles with moe", "parallel.linear_tiles", f"linear_tiles={tiles} with an MoE model "
                        f"(model.moe.num_experts={s.moe.num_experts}) is not implemented yet (only dense MLPs are tiled)",
                        "set parallel.linear_tiles=1, or model.moe.num_experts=0", trainer_only=True)


def fused_projection_rules(fuse: bool, tp: int, precision: str | None, fp8_recipe: str, fsdp: bool) -> Rules:
    """train.fuse_projections (models/feed_forward.py fused_linear): trainer-only (the planner prices these
    layouts unjoined: plan/layout.py Problem.fused_for). The joined weight must be whole on the rank (TP splits
    q, k and v by heads, each its own DTensor), and FSDP's FP8 all-gather (tensorwise, parallel/float8.py)
    gathers each weight already cast with its own scale, which cannot be joined."""
    if not fuse:
        return
    if tp > 1:
        yield Violation("fuse_projections with tp", "train.fuse_projections", f"joined projections with tp={tp} are not "
                        "implemented (TP splits q, k, v and w1, w3 over ranks, each weight a DTensor of its own)",
                        "set train.fuse_projections=false, or parallel.tp=1", trainer_only=True)
    if precision == "fp8" and fp8_recipe == "tensorwise" and fsdp:
        yield Violation("fuse_projections with fp8 all-gather", "train.fuse_projections", "joined projections with "
                        'train.precision="fp8" (tensorwise) under FSDP: each weight is all-gathered in FP8 with its own '
                        "scale, and weights of different scales cannot be joined into one GEMM operand",
                        'set train.fuse_projections=false, or train.fp8_recipe="rowwise" (gathered in bf16)',
                        trainer_only=True)


def grad_compression_rules(lay: Layout) -> Rules:
    """parallel.grad_compression (parallel/grad_compression.py): the values, then where each method can
    run. DDP (zero 0/1 without tp / pp) takes any method through its communication hooks. FSDP2 (zero
    2/3, HSDP included) and its `replicate` (tp > 1 or pp > 1) reduce in MixedPrecisionPolicy's
    reduce_dtype, so bf16 only: torch 2.13 has no hook that replaces their reduce-scatter or all-reduce
    (FSDPModule.set_all_reduce_hook runs *after* native HSDP's all-reduce; replacing it would mean 1-D
    FSDP plus a hand-written replicate all-reduce, not implemented)."""
    method = lay.grad_compression
    yield from _some(choice("parallel.grad_compression", method, COMPRESSION_METHODS, "grad_compression"))
    if method == "topk" and not 0 < lay.grad_compression_ratio <= 1:
        yield Violation("grad_compression_ratio", "parallel.grad_compression_ratio",
                        f"topk keeps this fraction of the entries; must be within (0, 1], got {lay.grad_compression_ratio}",
                        "use e.g. 0.01 (1% of the entries) or 0.1")
    if method == "powersgd":
        yield from _some(at_least("parallel.powersgd_rank", lay.powersgd_rank))
    if method not in ("int8", "topk", "powersgd") or lay.wrapper in ("ddp", "none"):
        return
    if lay.wrapper == "fsdp":
        what = (f"HSDP (zero={lay.zero}, dp_replicate={lay.dp_replicate}) reduce-scatters gradient shards and all-reduces "
                "them over dp_replicate" if lay.dp_replicate > 1 else
                f"FSDP2 (zero={lay.zero}) reduce-scatters the gradients")
        fix = 'set parallel.grad_compression="bf16" (FSDP2 reduces in bf16), or parallel.zero=0 / 1 (DDP) for ' + method
    else:
        what = f"FSDP2's replicate (the data-parallel wrapper of tp={lay.tp} / pp={lay.pp} layouts) all-reduces the gradients"
        fix = 'set parallel.grad_compression="bf16" (replicate reduces in bf16), or parallel.tp=1 and parallel.pp=1 (DDP)'
    yield Violation("grad_compression", "parallel.grad_compression",
                    f"{what} with no communication hook to put {method} in (torch 2.13: only its reduce dtype can "
                    "change; set_all_reduce_hook runs after HSDP's all-reduce, not instead of it)", fix, trainer_only=True)


def powersgd_warmup_rule(method: str, warmup: int) -> Violation | None:
    """torch's PowerSGDState refuses start_powerSGD_iter <= 1 with error feedback or warm start (both on
    here): DDP rebuilds its buckets after the first iteration, and its per-bucket state must be
    created on the rebuilt ones."""
    if method != "powersgd" or warmup >= 2:
        return None
    return Violation("powersgd_warmup_steps", "parallel.powersgd_warmup_steps", f"must be >= 2, got {warmup}: torch's "
                     "PowerSGD with error feedback starts after DDP has rebuilt its buckets (after step 1)",
                     "set parallel.powersgd_warmup_steps to 2 or more (Vogels et al. 2019 warm up for a few epochs' worth)")


# ---- pipeline schedules (torch.distributed.pipelining's own requirements) ---------------------------
def virtual_stage_rule(schedule: str, v: int) -> Violation | None:
    """`schedule` cannot run `v` stages per pipeline rank."""
    if schedule in SINGLE_STAGE and v != 1:
        return Violation("schedule", "parallel.pp_virtual_stages", f"{schedule} runs one stage per rank, got "
                         f"pp_virtual_stages={v}", "set parallel.pp_virtual_stages=1, or use interleaved_1f1b / zero_bubble")
    if schedule == "interleaved_1f1b" and v < 2:
        return Violation("schedule", "parallel.pp_virtual_stages", "interleaved_1f1b needs pp_virtual_stages >= 2",
                         "set parallel.pp_virtual_stages=2 (or use 1f1b)")
    if schedule in V_SHAPED and v != 2:
        return Violation("schedule", "parallel.pp_virtual_stages", f"{schedule} runs two (V-shaped) stages per rank, got {v}",
                         "set parallel.pp_virtual_stages=2")
    return None


def microbatch_rule(schedule: str, pp: int, m: int) -> Violation | None:
    """The schedules' own requirements on the micro-batches per step, checked before spawning rather
    than discovered as an exception (or a hang) on every rank."""
    if pp == 1:
        return None
    if schedule != "gpipe" and m < pp:
        return Violation("microbatches < pp", "train.micro_batch", f"{schedule} needs at least pp({pp}) micro-batches "
                         f"per step, got {m}", "lower train.micro_batch or raise train.global_batch")
    if schedule == "dualpipev" and m < 2 * pp:
        return Violation("microbatches < 2pp", "train.micro_batch", f"dualpipev needs at least 2 x pp = {2 * pp} "
                         f"micro-batches, got {m}", "lower train.micro_batch or raise train.global_batch")
    rounds = max(1, m // pp)
    if schedule in ("interleaved_1f1b", "zero_bubble") and m % rounds:
        return Violation("microbatches % rounds", "train.micro_batch", f"{schedule} runs micro-batches in rounds of "
                         f"pp({pp}); {m} micro-batches is not a multiple of its {rounds} rounds",
                         f"use a multiple of pp({pp}) micro-batches per step")
    return None


def split_backward_rule(schedule: str, zero: int, recompute: str, recompute_policy: str) -> Violation | None:
    """A split-backward schedule meets a feature that breaks it (torch 2.13, found by the parity
    tests): with ZeRO-3 the weight-gradient pass misses parameters FSDP2 resharded after forward (some
    blocks get no gradient at all); per-op selective recompute allows one backward through a
    checkpointed region and the split runs two."""
    if schedule not in SPLIT_BACKWARD:
        return None
    if zero == 3:
        return Violation("split backward", "parallel.zero", f"{schedule} computes weight gradients in a separate pass, which "
                         "misses parameters ZeRO-3 reshards after forward (wrong gradients)", "use parallel.zero=2 (under a "
                         "pipeline schedule it holds the same memory as ZeRO-3) or zero=1, or the 1f1b / interleaved_1f1b schedule")
    if recompute == "selective" and recompute_policy in PER_OP_POLICIES:
        return Violation("split backward", "train.recompute_policy", f"{schedule} runs backward twice through each block "
                         "(input, then weight gradients); per-op selective recompute allows only one",
                         'use train.recompute="full" or train.recompute_policy="layer", or the 1f1b / interleaved_1f1b schedule')
    return None


def pipeline_split_rules(p: Any, n_layers: int) -> Rules:
    """How the trainer is told to cut the blocks (parallel.pp_layers_per_stage, pp_split,
    pp_stage_speeds: spec/stages.py layers_per_stage). The planner cuts evenly."""
    if p.pp == 1:
        return
    n_stages = p.pp * p.pp_virtual_stages
    if p.pp_layers_per_stage:
        counts = p.pp_layers_per_stage
        if p.pp_split == "balanced":
            yield Violation("pp split", "parallel.pp_layers_per_stage", "an explicit split and pp_split=balanced were both given",
                            "drop one of them")
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            from shardwise.spec.stages import even_split

            yield Violation("pp split", "parallel.pp_layers_per_stage",
                            f"{list(counts)} must give each of pp x pp_virtual_stages = {n_stages} stages at least one "
                            f"block and sum to model.n_layers = {n_layers}",
                            f"e.g. {even_split(n_layers, n_stages)}" if n_layers >= n_stages else "use fewer stages")
    if p.pp_stage_speeds:
        if p.pp_split != "balanced":
            yield Violation("pp split", "parallel.pp_stage_speeds", "stage speeds are used by the cost-balanced split only",
                            'set parallel.pp_split="balanced" or drop pp_stage_speeds')
        if len(p.pp_stage_speeds) != p.pp or min(p.pp_stage_speeds) <= 0:
            yield Violation("pp split", "parallel.pp_stage_speeds", f"{list(p.pp_stage_speeds)} must give one positive "
                            f"relative speed per pipeline rank ({p.pp})", f"e.g. {[1.0] * p.pp}")


# Serving (`shardwise generate`, `plan evaluate --mode=decode`) splits one model replica over tp x pp.
SERVING_REFUSED_AXES = {"dp_replicate": "data parallelism is separate replicas", "dp_shard": "data parallelism is separate replicas",
                        "cp": "context parallelism is not used for inference", "ep": "expert parallelism is not used for inference"}


def serving_rules(s: Any, p: Any, prompt_len: int) -> Rules:
    """One replica of model shape `s` over parallel.tp x parallel.pp (ParallelConfig `p`; dp_shard=-1
    counts as 1): no other axis; TP without sequence parallelism (a decode step has one token per
    sequence); blocks split evenly over pp, one stage per rank (infer/engine.py, plan/decode.py)."""
    for axis, why in SERVING_REFUSED_AXES.items():
        size = getattr(p, axis)
        if size not in (1, -1) or (axis != "dp_shard" and size != 1):
            yield Violation("serving axis", f"parallel.{axis}", f"serving runs one model replica on tp x pp ranks, got "
                            f"{axis}={size}", f"set parallel.{axis}=1: {why}")
    lay = Layout(tp=p.tp, pp=p.pp, sequence_parallel=False)
    yield from tensor_parallel_rules(s, lay, prompt_len)
    yield from pipeline_rules(s, lay)


def fp8_head_rules(fp8_head: bool, precision: str | None) -> Rules:
    """train.fp8_head (parallel/float8.py): the head's GEMMs in FP8 means FP8 training."""
    if fp8_head and precision != "fp8":
        yield Violation("fp8_head without fp8", "train.fp8_head", f'the output head in FP8 needs train.precision="fp8" '
                        f"(now {precision or 'unset'})", 'set train.precision="fp8", or train.fp8_head=false')
