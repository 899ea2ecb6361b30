"""Pre-flight checks: every config and layout error is found here, before any process is spawned."""
from __future__ import annotations

from shardwise.config import Config, ModelConfig
from shardwise.errors import ConfigError
from shardwise.models import ARCH_NAMES
from shardwise.parallel.dims import ParallelDims, refuse_unimplemented
from shardwise.parallel.stages import SCHEDULES, check_pipeline

PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_POLICIES = ("op", "layer")
PP_SPLITS = ("even", "balanced")


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(field, f"{value!r} is not one of {', '.join(choices)}", f"set {field} to one of: {', '.join(choices)}")


def _positive(field: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {value}", f"set {field} to at least {minimum}")


def check_model_shape(m) -> None:
    """The shape rules every consumer of a model shape needs (the trainer's ModelConfig, the
    planner's ModelShape: anything with arch, dim, n_layers, n_heads, n_kv_heads, ffn_dim,
    vocab_size and max_seq_len)."""
    _choice("model.arch", m.arch, ARCH_NAMES)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        _positive(f"model.{name}", getattr(m, name))
    if m.dim % m.n_heads:
        raise ConfigError("model.n_heads", f"dim({m.dim}) is not divisible by n_heads({m.n_heads})",
                          "choose n_heads among the divisors of model.dim")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", f"n_heads({m.n_heads}) is not divisible by n_kv_heads({m.n_kv_heads})",
                          "grouped-query attention needs n_kv_heads to divide n_heads")


def check_model(cfg: Config) -> None:
    m = cfg.model
    check_model_shape(m)
    check_moe(cfg)
    if m.arch == "llama" and (m.dim // m.n_heads) % 2:
        raise ConfigError("model.n_heads", f"head dim {m.dim // m.n_heads} is odd; RoPE rotates pairs of dims",
                          "choose n_heads so that dim / n_heads is even")
    if cfg.train.seq_len > m.max_seq_len:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} exceeds model.max_seq_len({m.max_seq_len})",
                          f"lower train.seq_len or raise model.max_seq_len to >= {cfg.train.seq_len}")


def check_moe(cfg: Config) -> None:
    """model.moe.* on its own (the layout rules are in check_expert_parallel)."""
    m = cfg.model.moe
    if m.num_experts == 0:
        return
    _positive("model.moe.num_experts", m.num_experts)
    if not 1 <= m.top_k <= m.num_experts:
        raise ConfigError("model.moe.top_k", f"top_k({m.top_k}) must be within 1..num_experts({m.num_experts})",
                          "choose 1 <= top_k <= num_experts")
    _positive("model.moe.every_k_layers", m.every_k_layers)
    if m.every_k_layers > cfg.model.n_layers:
        raise ConfigError("model.moe.every_k_layers", f"every_k_layers({m.every_k_layers}) > n_layers({cfg.model.n_layers}): "
                          "no block would be MoE", f"choose every_k_layers <= {cfg.model.n_layers}")
    for name in ("capacity_factor", "expert_ffn_dim", "num_shared_experts", "aux_loss_coef", "z_loss_coef"):
        _positive(f"model.moe.{name}", getattr(m, name), 0)


def check_expert_parallel(cfg: Config, dims: ParallelDims) -> None:
    """Which layouts MoE / EP train with (refused here, before anything is spawned)."""
    p, moe = cfg.parallel, cfg.model.moe
    if dims.ep > 1 and not moe.num_experts:
        raise ConfigError("parallel.ep", f"ep={dims.ep} splits experts, but the model has none (model.moe.num_experts=0)",
                          "set model.moe.num_experts (e.g. --model.preset=tiny-moe) or parallel.ep=1")
    if dims.ep > 1 and moe.num_experts % dims.ep:
        raise ConfigError("parallel.ep", f"num_experts({moe.num_experts}) is not divisible by ep({dims.ep})",
                          "choose ep among the divisors of model.moe.num_experts")
    if moe.num_experts and dims.tp > 1:
        # Expert tensor parallelism (parallel/tensor.py MoERegion): every expert (and the merged
        # shared experts) is split on its ffn dim over tp, as the dense MLP.
        hidden = moe.expert_ffn_dim or cfg.model.ffn_dim
        field = "model.moe.expert_ffn_dim" if moe.expert_ffn_dim else "model.ffn_dim"
        if hidden % dims.tp:
            raise ConfigError(field, f"tensor parallelism splits every expert's ffn dim over tp={dims.tp}, but the expert "
                              f"ffn dim {hidden} is not divisible by it",
                              f"choose {field} divisible by {dims.tp}, or another parallel.tp")
    if dims.ep == 1:
        return
    if p.zero not in (2, 3):
        # DDP / ZeRO-1 reduce a whole model's gradients over the batch group; the experts differ per
        # ep rank and must not be all-reduced with each other. FSDP's units let them be left out.
        raise ConfigError("parallel.zero", f"expert parallelism needs FSDP (zero 2 or 3), got zero={p.zero}",
                          "set parallel.zero=2 or 3 (with dp_shard = ep x efsdp)")
    if dims.dp_replicate > 1:
        raise ConfigError("parallel.dp_replicate", f"dp_replicate={dims.dp_replicate} with ep={dims.ep} is not implemented "
                          "(the expert gradients would need an all-reduce across replicas outside FSDP)",
                          "put the data-parallel ranks in parallel.dp_shard instead")
    if p.offload:
        raise ConfigError("parallel.offload", "CPU offload with expert parallelism is not implemented (the experts are "
                          "outside the offloaded FSDP units when efsdp = 1)", "set parallel.offload=false")


def check_train(cfg: Config) -> None:
    t = cfg.train
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.recompute", t.recompute, RECOMPUTE)
    _choice("train.recompute_policy", t.recompute_policy, RECOMPUTE_POLICIES)
    for name in ("seq_len", "global_batch", "micro_batch", "steps", "recompute_every", "log_every", "max_skipped_steps"):
        _positive(f"train.{name}", getattr(t, name))
    _positive("train.warmup_steps", t.warmup_steps, 0)
    if t.lr <= 0:
        raise ConfigError("train.lr", f"must be > 0, got {t.lr}", "use a learning rate such as 3e-4")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", f"must be within [0, 1], got {t.min_lr_ratio}", "use e.g. 0.1")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise ConfigError(f"train.{name}", f"must be within [0, 1), got {getattr(t, name)}", "use 0.9 / 0.95")
    _positive("train.grad_clip", t.grad_clip, 0)
    _positive("train.weight_decay", t.weight_decay, 0)


def check_parallel(cfg: Config, world_size: int) -> ParallelDims:
    p = cfg.parallel
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero", f"must be 0, 1, 2 or 3, got {p.zero}",
                          "0: DDP, 1: shard optimizer state, 2: + gradients, 3: + parameters (FSDP)")
    _choice("parallel.pp_schedule", p.pp_schedule, SCHEDULES)
    _choice("parallel.pp_split", p.pp_split, PP_SPLITS)
    _positive("parallel.pp_virtual_stages", p.pp_virtual_stages)
    dims = ParallelDims.from_config(p, world_size)
    refuse_unimplemented(dims)
    if p.zero == 0 and dims.dp_shard > 1:
        raise ConfigError("parallel.zero", f"zero=0 shards nothing, but dp_shard={dims.dp_shard}",
                          f"set parallel.zero to 1, 2 or 3 to shard over dp_shard, or move the {dims.dp_shard} "
                          "ranks to parallel.dp_replicate for plain DDP")
    if p.zero > 0 and dims.dp_shard * dims.cp == 1:
        raise ConfigError("parallel.zero", f"zero={p.zero} shards over dp_shard x cp, which is 1",
                          "set parallel.dp_shard > 1 (e.g. -1 for all ranks) or parallel.zero=0")
    if p.offload and p.zero < 2:
        raise ConfigError("parallel.offload", f"CPU offload needs FSDP (zero >= 2), got zero={p.zero}",
                          "set parallel.zero=2 or 3, or parallel.offload=false")
    check_tensor_parallel(cfg.model, dims.tp, cfg.train.seq_len, p.sequence_parallel)
    check_context_parallel(cfg.model, dims.cp, dims.tp, cfg.train.seq_len, p.cp_mode, p.sequence_parallel)
    check_expert_parallel(cfg, dims)
    return dims


CP_MODES = ("ring", "ulysses")


def check_context_parallel(model: ModelConfig, cp: int, tp: int, seq_len: int, mode: str, sequence_parallel: bool) -> None:
    """The splits context parallelism needs (parallel/context.py): 2·cp equal chunks per sequence
    (the load-balanced causal split), SP's further split of each cp shard, and for Ulysses whole
    heads per cp rank."""
    _choice("parallel.cp_mode", mode, CP_MODES)
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise ConfigError("train.seq_len", f"context parallelism cuts each sequence into 2 x cp = {2 * cp} equal chunks "
                          f"(load-balanced causal split), but seq_len={seq_len} is not divisible by {2 * cp}",
                          f"choose seq_len divisible by {2 * cp}, or another parallel.cp")
    if tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        raise ConfigError("train.seq_len", f"sequence parallelism splits each cp shard of seq_len/cp = {seq_len // cp} "
                          f"tokens over tp={tp} ranks, which does not divide it",
                          f"choose seq_len divisible by cp x tp = {cp * tp}, or set parallel.sequence_parallel=false")
    heads = model.n_heads // tp
    if mode == "ulysses" and heads % cp:
        raise ConfigError("parallel.cp", f"Ulysses gives each cp rank n_heads / tp / cp heads, but n_heads / tp = {heads} "
                          f"is not divisible by cp={cp}",
                          f"choose cp dividing {heads}, or set parallel.cp_mode=ring (any head count)")


def check_tensor_parallel(model: ModelConfig, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Refuse a TP size the model cannot be split by (ConfigError names the field and the fix)."""
    if tp == 1:
        return
    if tp > model.n_heads:
        raise ConfigError("parallel.tp", f"tp={tp} is larger than model.n_heads={model.n_heads}: a rank would own no head",
                          f"choose tp <= {model.n_heads} that divides n_heads")
    if model.n_heads % tp:
        raise ConfigError("parallel.tp", f"model.n_heads={model.n_heads} is not divisible by tp={tp}",
                          f"choose tp among the divisors of {model.n_heads}")
    if model.n_kv_heads % tp and tp % model.n_kv_heads:
        raise ConfigError("parallel.tp", f"model.n_kv_heads={model.n_kv_heads} and tp={tp}: neither divides the other, "
                          "so key/value heads can be neither split nor replicated evenly",
                          f"choose tp that divides n_kv_heads={model.n_kv_heads} or a multiple of it")
    if model.ffn_dim % tp:
        raise ConfigError("parallel.tp", f"model.ffn_dim={model.ffn_dim} is not divisible by tp={tp}",
                          f"choose tp among the divisors of {model.ffn_dim}, or change model.ffn_dim")
    if sequence_parallel and seq_len % tp:
        raise ConfigError("train.seq_len", f"sequence parallelism splits the sequence over tp={tp} ranks, "
                          f"but seq_len={seq_len} is not divisible by it",
                          f"choose seq_len divisible by {tp}, or set parallel.sequence_parallel=false")


def check_batch(cfg: Config, dims: ParallelDims) -> int:
    """Return gradient-accumulation steps: global_batch = micro_batch x accumulation x dp."""
    t = cfg.train
    per_step = t.micro_batch * dims.dp
    if t.global_batch % per_step:
        raise ConfigError("train.global_batch",
                          f"global_batch({t.global_batch}) is not divisible by micro_batch({t.micro_batch}) x "
                          f"data-parallel size({dims.dp}) = {per_step}",
                          f"use a global_batch that is a multiple of {per_step}, or change train.micro_batch")
    return t.global_batch // per_step


def check_checkpoint(cfg: Config) -> None:
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.every", cfg.checkpoint.every, 0)


def check_run(cfg: Config) -> None:
    _positive("run.max_restarts", cfg.run.max_restarts, 0)
    if not cfg.run.collective_timeout_s > 0:
        raise ConfigError("run.collective_timeout_s", f"must be > 0, got {cfg.run.collective_timeout_s}",
                          "use e.g. 300 (seconds); raise it if a checkpoint save or first step takes longer")


def check(cfg: Config, world_size: int) -> ParallelDims:
    """All checks; returns the validated ParallelDims."""
    check_model(cfg)
    check_train(cfg)
    dims = check_parallel(cfg, world_size)
    microbatches = check_batch(cfg, dims)
    check_pipeline(cfg.parallel, cfg.model, microbatches, cfg.train.recompute, cfg.train.recompute_policy)
    check_checkpoint(cfg)
    check_run(cfg)
    return dims
