"""One training step of a dry-run rank (launch/dryrun.py, issue 58): the bytes of every collective per mesh
axis, counted by the trainer's own counter, beside the planner's prediction.

A rank built on the meta device under torch's fake process group (dryrun.py build_rank) runs the trainer's
own step, train/trainer.py Trainer._forward_backward_update (every micro-batch's forward and backward through
the same GradientSync, loss parallel, context-parallel split and pipeline schedule, gradient clipping, the
optimizer's step and ZeRO-1's broadcasts), under parallel/comm_counter.py CommCounter with the trainer's own
axis names (axis_names), as Trainer.train_step counts its first step. The Trainer is not constructed (its
__init__ reads the corpus, opens checkpoints and a control group): `step_trainer` sets on a bare Trainer the
attributes that step reads, made by the functions __init__ calls. The torch seams it needs are in
launch/dryrun_meta.py. What a step on meta tensors cannot do:
  data       the micro-batches are meta int64 tensors of the trainer's shapes (no token is read);
  health     StepGuard's verdict reads the loss and the norm (values a meta tensor has not) over the control
             group, which the counter leaves out anyway: every step is taken (`Taken`; fp16's local overflow
             check likewise, `finite_unscale`);
  compile    torch.compile is held to eager (torch.compiler.set_stance("force_eager")), as the trainer's
             own counting step does: the collectives are those of the eager step;
  DDP        torch's DistributedDataParallel cannot wrap meta parameters (its constructor reads them;
             parallelize.py build_parallel_model leaves it out on meta): not run (`skipped`);
  autocast   torch has no autocast for the meta device: under train.precision bf16 / fp16 / fp8 with fp32
             parameters (no 16-bit FSDP2 / replicate copies) the activations stay fp32, so their TP / CP
             payloads would count more than a real step moves (tp2 bf16: 655,360 B of all-gather counted
             for 524,288): not run (`skipped`);
  MoE, 2-D TP  routing reads the router's values (token counts per expert), 2-D TP's loss the targets'
             (torch.nonzero): not run (`skipped`);
  offload    FSDP2's CPUOffloadPolicy copies gradient shards to host memory (no data to copy): not run.
Every other layout runs: FSDP2 (ZeRO-2/3, HSDP, FP8 all-gathers), replicate and ZeRO-1 with TP, TP / SP with
loss parallel, CP (ring and Ulysses), every pipeline schedule. The fake group moves nothing, so every
collective is a no-op on meta tensors of the right shape: the payload the counter sees is the one a real
step issues. The planner's side is plan/comm.py predict_comm_bytes for this rank.

Checked (2026-11-29): the counted bytes equal, per rank, axis and kind, what the trainer's counter measured
in a real gloo run on CPU (one step; pipelines a second, as tests/dist/test_plan_validation.py counts it) on
every rank of zero3 dp2 (2 micro-batches), tp2, pp2 1F1B, tp2 x zero3 dp2, pp2 x zero1 dp2 bf16, HSDP 2x2
bf16, cp2 ring x zero3 dp2 and pp2 x tp2 x zero1 dp2 bf16 (30 ranks), and the planner's too.
configs/plan-llama3-70b.toml at 1,024 ranks (pp8 x dp_shard16 x tp8, ZeRO-1, bf16, 32 micro-batches): ranks 0
and 1023 equal the planner on every axis and kind (dp_shard 9.61 GB, pp 1.07 GB, tp 438.1 GB a step); each
step took 48-58 s of CPU (95-232 s of wall time on a shared 2-core machine; 139 s alone), at 340-362 MiB peak
RSS a rank: the 32 micro-batches' forward and backward through DTensor dispatch are most of it.
Found so: the same model as ZeRO-3 dp_shard128 x tp8 (4 micro-batches) counted 10,551,296 B less tp
all-reduce than planned, a real gloo run of tp2 x zero3 dp2 bf16 the same: FSDP2 all-reduces TP's Partial
gradients (the norms under SP) in the 16-bit parameters' dtype when it reduces each micro-batch, where the
planner priced fp32; fixed in plan/comm.py _tp_collectives (each step then 83-86 s of CPU, 394 MiB).
The Llama 3 405B layout `plan search` picks on 16,384 H100s (dp_replicate8 x dp_shard256 x tp8, ZeRO-3, bf16,
one micro-batch): ranks 0 and 16,383 equal the planner on every axis and kind after that fix (dp_replicate
0.80 GB, dp_shard 409.1 GB, tp 373.1 GB a step; before it the planner said 8,290,304 B more tp); each step
217-242 s (each rank 223-254 s of CPU), 1.85 GiB peak RSS (the build's 1.7 GiB).
"""
from __future__ import annotations

WIDE = 16  # the category column of dryrun.py's table: "comm dp_shard_cp"


class Taken:
    """StepGuard's stand-in: every step finite, no stop requested (module doc)."""

    def verdict(self, loss, grad_norm, overflow):
        from shardwise.train.health import Verdict

        return Verdict(False, 0)


class MetaBatches:
    """The loader's stand-in: a step's micro-batches as meta int64 windows of (micro_batch, seq_len + 1)."""

    def __init__(self, micro_batch: int, seq_len: int, count: int):
        self.shape, self.count = (micro_batch, seq_len + 1), count

    def micro_batches(self, step: int) -> list:
        import torch

        return [torch.zeros(self.shape, dtype=torch.int64, device="meta") for _ in range(self.count)]


class NoTimeline:
    """TimelineRecorder's stand-in: nothing recorded."""

    recording = False

    def start(self) -> float:
        return 0.0

    def stop(self, start, actions) -> None:
        pass


class NoData:
    """PreparedData's stand-in: pre-training rows (no fine-tuning loss count)."""

    finetune = False
    eod_id = 0


def skipped(cfg, dims) -> str | None:
    """Why this layout's step cannot run on meta tensors (module doc), or None."""
    from shardwise.spec.dims import lowp_params, offload_tier

    wrapper = dims.wrapper(cfg.parallel.zero)
    if wrapper == "ddp":
        return "step not run: DDP cannot wrap meta parameters (its constructor reads their values)"
    if cfg.model.moe is not None and getattr(cfg.model.moe, "num_experts", 0):
        return "step not run: MoE routing reads the router's values (tokens per expert), which meta tensors lack"
    if offload_tier(cfg.parallel) != "none":
        return "step not run: offload copies the gradient shards to host memory, which meta tensors cannot"
    if dims.tp > 1 and dims.tp_mode == "2d":
        return "step not run: 2-D TP's loss picks its rows of the targets by value (torch.nonzero), which meta lacks"
    if cfg.train.precision != "fp32" and not lowp_params(wrapper) and (dims.tp > 1 or dims.cp > 1):
        return ("step not run: autocast has no meta device, so TP / CP activations would travel in fp32 "
                "(fp32 parameters under autocast)")
    return None


def finite_unscale(scaler, grads) -> bool:
    """DynamicLossScaler.unscale_ without its overflow check, which reads values (none on meta): the local
    gradient shards divided by the scale, no overflow."""
    import torch

    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:
        torch._foreach_mul_(local, 1.0 / scaler.scale)
    return False


def step_trainer(cfg, dims, mesh, model, parts, optimizer, rank: int):
    """A bare Trainer (Trainer.__new__) with what Trainer._forward_backward_update reads, each made as
    Trainer.__init__ makes it; `parts` is build_pipeline's PipelineParts (pp > 1) or None."""
    import torch

    from shardwise.models.common import Transformer, document_kernel
    from shardwise.parallel.comm_counter import axis_names
    from shardwise.parallel.context import zigzag_index
    from shardwise.parallel.data_parallel import gradient_group, gradient_sync, unwrap
    from shardwise.parallel.precision import DynamicLossScaler
    from shardwise.parallel.tensor2d import Grid, vocab_offset
    from shardwise.preflight import check_batch
    from shardwise.train import moe_stats
    from shardwise.train.loss import EAGER
    from shardwise.train.optim import build_scheduler
    from shardwise.train.trainer import Trainer

    t = cfg.train
    tr = Trainer.__new__(Trainer)
    tr.cfg, tr.dims, tr.mesh, tr.rank, tr.model = cfg, dims, mesh, rank, model
    tr.device = torch.device("meta")
    tr.accumulation = check_batch(cfg, dims)
    tr.inner = unwrap(model)
    tr.params = [p for p in model.parameters() if p.requires_grad]
    tr.optimizer, tr.scheduler = optimizer, build_scheduler(optimizer, t)
    tr.scaler = DynamicLossScaler(enabled=t.precision == "fp16")
    if tr.scaler.enabled:  # fp16: its overflow check reads the gradients' values (local; agreed as `Taken` does)
        tr.scaler.unscale_ = lambda grads: finite_unscale(tr.scaler, grads)
    tr.guard, tr.data, tr.timeline = Taken(), NoData(), NoTimeline()
    tr.loader = MetaBatches(t.micro_batch, t.seq_len, tr.accumulation)
    tr.loss_group = gradient_group(mesh)
    tr.cp_index = zigzag_index(t.seq_len, dims.cp, dims.coordinates(rank)["cp"]) if dims.cp > 1 else None
    tr.tokens_per_rank_step = t.micro_batch * tr.accumulation * t.seq_len // dims.cp
    tr.loss_denominator = tr.tokens_per_rank_step
    tr.document_positions = t.document_mask if t.document_positions is None else t.document_positions
    tr.document_mask = t.document_mask
    if t.document_mask:  # as Trainer.__init__ sets it; SDPA's dense mask, which a meta step can build (no kernel moves bytes)
        for module in tr.inner.modules():
            if isinstance(module, Transformer):
                module.document_kernel = document_kernel("cpu")
    tr.grid = Grid(mesh.tp_grid) if mesh.tp_grid is not None else None
    tr.vocab_offset = vocab_offset(tr.inner) if tr.grid is not None else 0
    tr.loss_kernels = EAGER  # compiled kernels are held to eager as the counting step holds them (module doc)
    tr.gradient_sync = gradient_sync(model, dims, cfg.parallel)
    tr.moe_layers = moe_stats.moe_layers(tr.inner)
    tr.step = 0
    tr.activation_bytes = 1  # not metered: the first micro-batch runs as the others
    tr.group_axes = axis_names(mesh)
    tr.grad_compression = None
    tr.pipeline = None
    if parts is not None:  # as Trainer._build_pipeline starts it, over the stages on meta
        tr._start_pipeline(parts)
    return tr


def step_bytes(cfg, dims, mesh, model, parts, optimizer, rank: int) -> dict:
    """The trainer's step on this meta rank under its counter (module doc): {"counted": {axis: {kind:
    bytes}}, "step_s": seconds}, or {"step_note": why it did not run, or how it failed}. The rank's
    gradients are dropped first (the memory accounting made zero ones), as the trainer's zero_grad does."""
    import time

    import torch

    from shardwise.launch.dryrun_meta import fsdp_on_meta, meta_backends, meta_step
    from shardwise.parallel.comm_counter import CommCounter
    from shardwise.parallel.parallelize import _finish

    why = skipped(cfg, dims)
    if why is not None:
        return {"step_note": why}
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    for module in (parts.stages.values() if parts is not None else [model]):
        _finish(module, dims, cfg)  # TP's gradient hooks, which build_parallel_model sets after materializing
        fsdp_on_meta(module)
    try:
        tr = step_trainer(cfg, dims, mesh, model, parts, optimizer, rank)
        meta_backends(tr.group_axes)
        with torch.compiler.set_stance("force_eager"), meta_step(), CommCounter(tr.group_axes) as counter:
            tr._forward_backward_update()
    except Exception as e:  # noqa: BLE001  (reported on the rank's line, not guessed around)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return {"step_note": f"step failed: {type(e).__name__}: {first}"}
    counted = {axis: dict(kinds) for axis, kinds in counter.totals().items() if axis != "world"}
    return {"counted": counted, "step_s": round(time.perf_counter() - start, 3)}


def comm_lines(row: dict) -> list[str]:
    """The table's lines for a rank's step (dryrun.py table): per mesh axis the counted payload bytes, the
    planner's and the difference (the kinds that differ named); or the one line saying why the step did not
    run."""
    if "step_note" in row:
        return [f"{'':>6} {'':>3} {'comm':<{WIDE}} {row['step_note']}"]
    counted, planned = row.get("counted"), row.get("planned_comm", {})
    if counted is None:
        return []
    lines = []
    for axis in sorted(set(counted) | set(planned)):
        mine, theirs = counted.get(axis, {}), planned.get(axis, {})
        got, want = sum(mine.values()), sum(theirs.values())
        kinds = sorted(k for k in {*mine, *theirs} if mine.get(k, 0) != theirs.get(k, 0))
        note = f" ({', '.join(kinds)} differ)" if kinds else ""
        lines.append(f"{'':>6} {'':>3} {'comm ' + axis:<{WIDE}} {got:>16,} {want:>16,} {got - want:>+14,} "
                     f"{got / 2**30:>10.3f} {want / 2**30:>8.3f}{note}")
    return lines
