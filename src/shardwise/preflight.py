"""Pre-flight checks: every config and layout error is found here, before any process is spawned.

The model and layout rules are spec/rules.py's, shared with the planner; this module raises the
first violation as a ConfigError (field, problem, fix) and adds the rules only a training run has:
optimizer settings, checkpoint and run options.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from shardwise.config import Config
from shardwise.errors import ConfigError, Violation
from shardwise.spec import rules
from shardwise.spec.dims import ParallelDims, offload_tier
from shardwise.spec.layout import (
    COMPILE_BACKENDS,
    FP8_RECIPES,
    PP_SPLITS,
    PRECISIONS,
    PROCESS_GROUP_BACKENDS,
    RECOMPUTE,
    RECOMPUTE_POLICIES,
    Layout,
)
from shardwise.spec.shapes import ModelShape
from shardwise.spec.stages import SCHEDULES


def raise_first(*violations: Iterable[Violation | None]) -> None:
    for group in violations:
        for v in group:
            if v is not None:
                raise v.error()


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    raise_first([rules.choice(field, value, choices)])


def _positive(field: str, value: float, minimum: float = 1) -> None:
    raise_first([rules.at_least(field, value, minimum)])


def check_model(cfg: Config) -> None:
    m = cfg.model
    raise_first(rules.model_rules(m), rules.moe_rules(m.moe, m.n_layers), rules.trainable_model_rules(m, cfg.train.seq_len))


def check_train(cfg: Config) -> None:
    t = cfg.train
    if t.precision is not None:  # unset: the worker picks bf16 or fp32 by its device (parallel/precision.py)
        _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.recompute", t.recompute, RECOMPUTE)
    _choice("train.recompute_policy", t.recompute_policy, RECOMPUTE_POLICIES)
    _choice("train.compile_backend", t.compile_backend, COMPILE_BACKENDS)
    _choice("train.fp8_recipe", t.fp8_recipe, FP8_RECIPES)
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
    """The layout rules of spec/rules.py, trainer-only ones included, for `world_size` processes."""
    p = cfg.parallel
    raise_first([rules.zero_rule(p.zero)])  # before the axes: zero decides what dp_shard means
    _choice("parallel.pp_schedule", p.pp_schedule, SCHEDULES)
    _choice("parallel.pp_split", p.pp_split, PP_SPLITS)
    _positive("parallel.pp_virtual_stages", p.pp_virtual_stages)
    _positive("parallel.linear_tiles", p.linear_tiles)
    if offload_tier(p) == "nvme":  # (offload_tier refuses an unknown tier)
        check_offload_dir(p.offload_dir)
    dims = ParallelDims.from_config(p, world_size)
    layout = Layout.from_config(cfg, world_size)
    shape = ModelShape.from_config(cfg.model)
    raise_first(rules.layout_rules(shape, layout, cfg.train.seq_len, cfg.train.global_batch,
                                   precision=cfg.train.precision),
                rules.pipeline_split_rules(p, cfg.model.n_layers),
                rules.fused_projection_rules(cfg.train.fuse_projections, dims.tp, cfg.train.precision, cfg.train.fp8_recipe,
                                             dims.wrapper(p.zero) == "fsdp"),
                rules.fp8_head_rules(cfg.train.fp8_head, cfg.train.precision),
                [rules.powersgd_warmup_rule(p.grad_compression, p.powersgd_warmup_steps)])
    t = cfg.train
    if t.document_mask or t.document_positions:
        what = "train.document_mask" if t.document_mask else "train.document_positions"
        for axis, size, why in (("cp", dims.cp, "ring and Ulysses attention are causal over the whole row"),
                                ("tp_mode", 2 if dims.tp_mode == "2d" else 1, "the SUMMA attention takes no mask")):
            if size > 1:
                raise ConfigError(what, f"is not implemented with parallel.{axis}={getattr(p, axis)} ({why})",
                                  f"set {what}=false, or train without parallel.{axis}")
    if dims.tp_mode == "2d" and cfg.train.compile:
        raise ConfigError("train.compile", 'tp_mode="2d" with compiled blocks is not implemented yet (the SUMMA '
                          "autograd Functions call c10d collectives, which dynamo does not trace)",
                          'set train.compile=false, or parallel.tp_mode="1d"')
    return dims


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


# A loader worker hands its batches over through a socket at <temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX
# (multiprocessing's resource sharer, torch's file-descriptor sharing); AF_UNIX paths end at 107 bytes.
_WORKER_SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")
_AF_UNIX_PATH_MAX = 107


def check_data(cfg: Config, temp_dir: str | None = None) -> None:
    """data.num_workers, and a temp directory short enough for the workers' sockets: past it, a worker's
    batch failed to pickle in a background thread that only printed the error, and the rank waited for it
    (found in a test run whose TMPDIR was 76 bytes long)."""
    import tempfile

    _positive("data.num_workers", cfg.data.num_workers, 0)
    temp = temp_dir if temp_dir is not None else tempfile.gettempdir()
    if cfg.data.num_workers > 0 and len(temp) + _WORKER_SOCKET_SUFFIX > _AF_UNIX_PATH_MAX:
        raise ConfigError("data.num_workers", f"loader workers hand batches over through sockets under the temp "
                          f"directory {temp} ({len(temp)} bytes), whose paths would pass the {_AF_UNIX_PATH_MAX} "
                          "bytes a Unix socket path may have",
                          f"set TMPDIR to a directory of at most {_AF_UNIX_PATH_MAX - _WORKER_SOCKET_SUFFIX} bytes "
                          "(e.g. /tmp), or data.num_workers=0")


def check_offload_dir(path: str) -> None:
    """offload="nvme" writes the optimizer state under parallel.offload_dir: it must be a writable
    directory. Its free space is checked where the files are created (parallel/offload.py reserves
    them with posix_fallocate before the first step: a full disk is exit code 4 there, not mid-run)."""
    if not path:
        raise ConfigError("parallel.offload_dir", 'offload="nvme" needs a directory for the optimizer state',
                          "set parallel.offload_dir to a directory on a local NVMe disk, e.g. /local_nvme/shardwise")
    where = Path(path).expanduser()
    if not where.is_dir():
        raise ConfigError("parallel.offload_dir", f"{where} is not a directory", "create it, or point to an existing one")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError("parallel.offload_dir", f"{where} is not writable by this user", "choose a writable directory")


def check_checkpoint(cfg: Config) -> None:
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.every", cfg.checkpoint.every, 0)


def check_run(cfg: Config) -> None:
    _positive("run.max_restarts", cfg.run.max_restarts, 0)
    _choice("run.backend", cfg.run.backend, PROCESS_GROUP_BACKENDS)
    if not cfg.run.rendezvous_timeout_s > 0:
        raise ConfigError("run.rendezvous_timeout_s", f"must be > 0, got {cfg.run.rendezvous_timeout_s}",
                          "use e.g. 600 (seconds): how long the nodes have to meet")
    if not 0 < cfg.run.rendezvous_last_call_s < cfg.run.rendezvous_timeout_s:
        raise ConfigError("run.rendezvous_last_call_s", f"must be > 0 and below run.rendezvous_timeout_s "
                          f"({cfg.run.rendezvous_timeout_s:g}), got {cfg.run.rendezvous_last_call_s:g}",
                          "the wait for more nodes must end before the rendezvous itself times out: e.g. "
                          f"{min(30.0, cfg.run.rendezvous_timeout_s / 2):g}")
    _positive("run.straggler_every", cfg.run.straggler_every, 0)
    _positive("run.straggler_steps", cfg.run.straggler_steps)
    if not 0 < cfg.run.straggler_margin < 10:
        raise ConfigError("run.straggler_margin", f"must be within (0, 10), got {cfg.run.straggler_margin}",
                          "e.g. 0.2: a rank 20% slower than the median rank")
    if cfg.run.evict_stragglers and cfg.run.straggler_every == 0:
        raise ConfigError("run.evict_stragglers", "is on, but run.straggler_every is 0: nothing names a straggler",
                          "set run.straggler_every (e.g. 50), or run.evict_stragglers=false")
    if cfg.run.evict_stragglers and not (cfg.checkpoint.every > 0 or cfg.checkpoint.final):
        raise ConfigError("run.evict_stragglers", "is on, but checkpoints are off: the nodes left would start over",
                          "set checkpoint.every (the evicted node's last step is checkpointed either way)")
    if not cfg.run.evict_cooldown_s >= 0:
        raise ConfigError("run.evict_cooldown_s", f"must be >= 0, got {cfg.run.evict_cooldown_s:g}",
                          "e.g. 3600 (seconds an evicted node is refused); 0 lets it join again at once")
    if not cfg.run.collective_timeout_s > 0:
        raise ConfigError("run.collective_timeout_s", f"must be > 0, got {cfg.run.collective_timeout_s}",
                          "use e.g. 300 (seconds); raise it if a checkpoint save or first step takes longer")
    if not 0 <= cfg.run.metrics_port <= 65535:  # whether it is free: `shardwise train` binds it (train/live_metrics.py)
        raise ConfigError("run.metrics_port", f"must be a port from 1 to 65535, or 0 for no endpoint; got {cfg.run.metrics_port}",
                          "e.g. --run.metrics_port=9400, then read http://127.0.0.1:9400/metrics")
    if cfg.run.metrics_port and not cfg.run.metrics_address.strip():
        raise ConfigError("run.metrics_address", "is empty", "use 127.0.0.1 (the default: loopback) or an address of this machine")


def check(cfg: Config, world_size: int) -> ParallelDims:
    """All checks; returns the validated ParallelDims."""
    check_model(cfg)
    check_train(cfg)
    dims = check_parallel(cfg, world_size)
    check_data(cfg)
    check_checkpoint(cfg)
    check_run(cfg)
    return dims


def check_elastic(cfg: Config, nproc: int, min_nodes: int, max_nodes: int) -> ParallelDims:
    """`check` at every world size an elastic job can have (`shardwise train --nnodes MIN:MAX`, nproc per
    node): a size the config does not fit is refused before anything starts, naming it, instead of at
    the restart that reaches it hours later. Returns the dims at MAX nodes."""
    bad, dims = [], None
    for n in range(min_nodes, max_nodes + 1):
        try:
            dims = check(cfg, nproc * n)
        except ConfigError as e:
            bad.append((n, e))
    if not bad:
        if cfg.run.evict_stragglers and min_nodes == max_nodes:
            raise ConfigError("run.evict_stragglers", f"is on, but the job must keep all {max_nodes} nodes "
                              f"(--nnodes {min_nodes}:{max_nodes}): no node can be evicted",
                              f"give the job room to lose one, e.g. --nnodes {max(1, max_nodes - 1)}:{max_nodes}")
        if cfg.run.max_restarts < 1:
            raise ConfigError("run.max_restarts", "is 0, but an elastic job (--nnodes MIN:MAX) goes on after losing a node by "
                              "restarting its worker group on the nodes left, which uses one restart",
                              "pass --run.max_restarts=3 or more (each lost node uses one; a node joining uses none)")
        return dims
    if len(bad) == max_nodes - min_nodes + 1:  # no size fits: the config's own error, at MAX nodes
        raise bad[-1][1]
    n, first = bad[0]
    sizes = ", ".join(f"{k} node{'s' * (k > 1)} ({nproc * k} processes)" for k, _ in bad)
    raise ConfigError("--nnodes", f"the job may run on {min_nodes} to {max_nodes} nodes, but the config does not fit {sizes}: "
                      f"at {nproc * n} processes {first.field}: {first.problem}",
                      "let one axis absorb the change (-1, e.g. --parallel.dp_shard=-1), pick a train.global_batch that "
                      "train.micro_batch x every data-parallel size divides, or narrow the --nnodes range")


def check_serving(cfg: Config, world: int, prompt_len: int = 1) -> ParallelDims:
    """Generation's layout (`shardwise generate`, infer/engine.py): one model replica over parallel.tp x
    parallel.pp = `world` processes, under spec/rules.py serving_rules (the planner's decode mode too)."""
    p = cfg.parallel
    raise_first(rules.serving_rules(ModelShape.from_config(cfg.model), p, prompt_len))
    if p.tp * p.pp != world:
        raise ConfigError("--nproc", f"{world} processes for tp={p.tp} x pp={p.pp}",
                          f"use --nproc {p.tp * p.pp} (generation has no data-parallel axis)")
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=p.tp, pp=p.pp, ep=1, world_size=world)


def check_generation_length(cfg: Config, longest_prompt: int, new_tokens: int) -> None:
    """The prompts and what is generated after them fit the model's positions (the KV cache's size)."""
    if longest_prompt + new_tokens > cfg.model.max_seq_len:
        raise ConfigError("--max-new-tokens", f"the longest prompt ({longest_prompt}) + {new_tokens} new tokens exceed "
                          f"model.max_seq_len = {cfg.model.max_seq_len}", "generate fewer tokens or shorten the prompt")
