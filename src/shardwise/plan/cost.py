"""Step time of one layout: compute, recompute, exposed communication per axis, pipeline bubble,
optimizer — and the derived tokens/s, model TFLOP/s per GPU, MFU and training days (docs/architecture.md §5/§6).

Compute: plan/compute_time.py (every GEMM, attention and pointwise kernel of a micro-batch).
Overlap rules:
  DDP: the bucketed all-reduce runs during the last micro-batch's backward; exposed = what does not
    fit in that backward, and at least the last bucket (Li et al. 2020, PyTorch DDP, arXiv 2006.15704 §3.2).
  FSDP: the all-gather of block i+1 overlaps block i's compute (prefetch), the reduce-scatter of block
    i overlaps block i-1's backward; per block, exposed = max(0, comm - compute); the first gather and
    last reduce-scatter of each pass are exposed (Zhao et al. 2023, PyTorch FSDP, arXiv 2304.11277 §3.4).
  ZeRO-1's parameter broadcast runs after the optimizer step: exposed. Megatron's distributed optimizer
    (cluster.grad_reduce = "distributed_optimizer"): its bucketed reduce-scatter hides in the last
    backward and its all-gather in the next forward, under PP too (plan/scale.py).
  PP: the schedule reduces gradients (DDP-style all-reduce or FSDP reduce-scatter) once, after the
    last backward of the step (torch.distributed.pipelining's post-backward): exposed.
  TP: exposed (x (1 - TP_OVERLAP_FRACTION)); CP ring: per layer, max(0, K/V transfer - attention
  compute); EP all-to-all: exposed; PP send/recv: on the critical path once per micro-batch, direction
  and owned chunk (twice under DeepSpeed's blocking send / recv, cluster.pp_engine, with its TP all-gathers
  of a boundary split over TP), plus the warm-up (constants.PP_P2P_EXPOSED_FRACTION, pp_p2p_seconds).
Slowest rank: the compute of the slowest of the job's GPUs, plan/scale.py (GPU speed spread, Sinha et al. 2022).
Overlap contention: what the collectives hidden above cost the compute beside them (their SMs and HBM),
  plan/scale.py item 4 (Lee et al. 2025).
Pipeline bubble (t_f, t_b = forward / backward time of one micro-batch; m micro-batches): the makespan of
  the action order torch runs for the schedule, checked against a replay of torch's own orders
  (spec/stages.py bubble_seconds: gpipe / 1f1b (p-1)(t_f + t_b); interleaved /v; ZB-H1
  (p-1) max(t_f, t_b/2)/v; ZB-V and DualPipeV as torch orders them), at the lighter sized rank's times,
  less what a heavier rank fills with its own work (rank_bubble).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from shardwise.plan import constants as C
from shardwise.plan.comm import (
    Collective,
    data_and_model_collectives,
    placements,
    pp_boundary_bytes,
    pp_partitioned,
    pp_whole_boundary_bytes,
    time_of,
)
from shardwise.plan.compression import compression_seconds
from shardwise.plan.compute_time import (  # noqa: F401  (gemm_time: re-exported for tests / benchmarks/kernels.py)
    MicroBatchTimes,
    _device_constant,
    _hbm_fraction,
    gemm_time,
    microbatch_times,
)
from shardwise.plan.inventory import RankModel, pipeline_ranks, priced_layout, sized_ranks, stage_model
from shardwise.plan.layout import Problem
from shardwise.plan.memory import Memory, core_layout, memory, model_state_bytes, nvme_moment_bytes
from shardwise.plan.scale import overlap_contention, overlapped_exposure, slowest_rank_fraction
from shardwise.spec.hardware import lookup
from shardwise.spec.layout import Layout
from shardwise.spec.stages import SINGLE_STAGE, WRITTEN_OUT, bubble_seconds, looped_bubbles, looped_bubbles_by_stage, rank_bubble

AXES = ("dp", "tp", "pp", "cp", "ep")


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    step_time_s: float
    breakdown_s: dict[str, float]
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    days: float
    days_6nd: float
    mfu_source: str = "predicted"
    detail: dict[str, float] = field(default_factory=dict)
    tp2d_bytes: dict[str, dict[str, float]] = field(default_factory=dict)  # 2-D TP: payload per grid axis and kind
    stack: str = ""  # the software stack priced (plan/stack.py Stack.describe)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_json(self) -> dict:
        mem = self.memory.gib()
        return {
            "layout": self.layout.describe(), "stack": self.stack,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu, "mfu_source": self.mfu_source,
            "days": self.days, "days_6nd": self.days_6nd, "fits": self.fits,
            "memory_gib": {k: mem[k] for k in ("params", "grads", "optimizer", "activations", "other", "total")},
            "memory_capacity_gib": mem["capacity"], "memory_rank": self.memory.rank,
            "memory_detail_gib": {k: round(v / 2**30, 3) if not k.startswith("inflight") else v
                                  for k, v in self.memory.detail.items()},
            "cpu_offload_gib": round(self.memory.cpu_bytes / 2**30, 3),
            **({"host_gib": round(self.memory.cpu_bytes / 2**30, 3),
                "host_capacity_gib": round(self.memory.host_capacity / 2**30, 3), "host_fits": self.memory.host_fits,
                "nvme_gib": round(self.memory.disk_bytes / 2**30, 3)} if self.layout.offload else {}),
            "breakdown_s": dict(self.breakdown_s),
            "parallel": self.layout.__dict__.copy(),
            **({"tp2d_bytes_per_step": self.tp2d_bytes} if self.tp2d_bytes else {}),
        }


# ---------------------------------------------------------------------------------------------------
# step
# ---------------------------------------------------------------------------------------------------
def _axis_group(axis: str) -> str:
    if axis in ("tp_row", "tp_col"):  # 2-D TP's grid axes: timed and exposed as TP
        return "tp"
    return "dp" if axis in ("dp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp_cp", "efsdp") else axis


@dataclass(frozen=True)
class RankCore:
    """What one rank's step costs apart from the pipeline schedule (cached per core layout)."""

    mb: MicroBatchTimes
    comm: tuple[tuple[str, float], ...]   # exposed seconds per axis group (dp, tp, cp, ep)
    per_mb_comm: float                    # exposed TP/CP/EP seconds inside one micro-batch
    optimizer: float
    pp_send: float                        # one boundary send
    pp_gather: float                      # one TP all-gather of a boundary split over TP (DeepSpeed), else 0
    detail: tuple[tuple[str, float], ...]
    dopt: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)  # distributed optimizer: (reduce-scatter, bucket, all-gather, bucket) s
    beside: float = 0.0                   # collective seconds hidden behind compute (FSDP, DDP, CP ring), not dopt's


@lru_cache(maxsize=1 << 17)
def rank_core(problem: Problem, core: Layout, rank: RankModel) -> RankCore:
    cl = problem.cluster
    place = placements(core, cl)
    m = core.accumulation(problem)
    mb = microbatch_times(problem, core, rank)
    comm = {a: 0.0 for a in AXES}
    per_mb_comm = 0.0  # exposed TP / CP / EP time inside one micro-batch (stretches t_f + t_b)
    beside = 0.0  # collective seconds hidden behind compute: they slow it (plan/scale.py overlap_contention)
    detail: dict[str, float] = {}
    fsdp_fwd: list[Collective] = []
    fsdp_bwd: list[Collective] = []
    dopt = problem.stack_for(core).grad_reduce == "distributed_optimizer" and core.zero == 1
    dopt_times = [0.0, 0.0, 0.0, 0.0]  # reduce-scatter, one bucket of it, all-gather, one bucket of it
    for c in data_and_model_collectives(problem, core, rank):
        group = _axis_group(c.axis)
        t = time_of(c, place, cl)
        if group == "tp" and c.unit == "sp_regather":  # started before the input-gradient GEMM, waited after
            beside += t
        elif group == "tp":
            t *= 1.0 - C.TP_OVERLAP_FRACTION
            comm["tp"] += t
            per_mb_comm += t / m
        elif group == "ep" and c.unit == "grad_norm":  # after the backward, with the other norms
            comm["dp"] += t
        elif group == "ep":
            comm["ep"] += t
            per_mb_comm += t / m
        elif group == "cp":
            if c.kind == "recv":
                continue  # a ring round sends and receives at once: timed by the send
            if c.kind == "all_to_all":  # Ulysses: nothing to hide behind
                exposed = t
            else:  # ring: each layer's K/V rounds hide behind that layer's attention
                calls_per_layer = c.calls / max(1, rank.layers * m)
                window = mb.attn_fwd_layer * (2 if c.phase == "bwd" else 1)
                exposed = max(0.0, t / c.calls * calls_per_layer - window) * rank.layers * m
            comm["cp"] += exposed
            beside += 0.0 if c.kind == "all_to_all" else t - exposed
            per_mb_comm += exposed / m
        elif c.unit in ("loss", "grad_norm"):
            comm["dp"] += t
        elif dopt and c.kind == "reduce_scatter" and c.unit == "grads":  # distributed optimizer: dopt_exposed
            detail["dp_reduce_scatter_s"] = t
            dopt_times[0:2] = [t, t / c.calls]
        elif dopt and c.kind == "all_gather" and c.unit == "params":  # ... during the next step's first forward
            detail["dp_param_gather_s"] = t
            dopt_times[2:4] = [t, t / c.calls]
        elif c.phase == "grad" and core.pp > 1:  # reduced after the schedule's last backward
            comm["dp"] += t
        elif core.fsdp and c.phase in ("fwd", "bwd", "grad"):
            (fsdp_fwd if c.phase == "fwd" else fsdp_bwd).append(c)
        elif c.phase == "grad":  # DDP bucketed all-reduce during the last backward (or after it: plan/stack.py)
            last_bucket = min(c.payload, C.DDP_BUCKET_BYTES)
            t_last = time_of(Collective(c.axis, c.kind, last_bucket, 1, c.phase), place, cl)
            detail["ddp_allreduce_s"] = t
            after = problem.stack_for(core).grad_reduce == "after_backward"
            comm["dp"] += t if after else max(t_last, t - mb.bwd)
            beside += 0.0 if after else t - max(t_last, t - mb.bwd)
        else:  # ZeRO-1 broadcast after the step
            comm["dp"] += t
    if fsdp_fwd or fsdp_bwd:
        fsdp = _fsdp_exposed(fsdp_fwd, fsdp_bwd, mb, rank, m, place, cl, detail)
        comm["dp"] += fsdp
        beside += detail["fsdp_comm_total_s"] - fsdp
    if core.grad_compression != "none":  # encode / decode of the gradients (plan/compression.py), not hidden
        detail["grad_compression_compute_s"] = compression_seconds(problem, core, rank)
        comm["dp"] += detail["grad_compression_compute_s"]
    optimizer = _optimizer_time(problem, core, rank, detail)
    if core.offload:
        detail["offload_copy_s"] = _offload_time(problem, core, rank, m)
        optimizer += detail["offload_copy_s"]
    pp_send = pp_gather = 0.0
    if core.pp > 1:
        pp_send = time_of(Collective("pp", "send", pp_boundary_bytes(problem, core), 1, "p2p"), place, cl)
    if pp_partitioned(problem, core):
        pp_gather = time_of(Collective("tp", "all_gather", pp_whole_boundary_bytes(problem, core), 1, "fwd"), place, cl)
    detail.update({"t_fwd_microbatch_s": mb.fwd, "t_bwd_microbatch_s": mb.bwd, "microbatches": m})
    return RankCore(mb, tuple(comm.items()), per_mb_comm, optimizer, pp_send, pp_gather, tuple(detail.items()),
                    tuple(dopt_times), beside)


def pp_p2p_seconds(problem: Problem, lay: Layout, core: RankCore, m: int, chunks: int) -> float:
    """Exposed pipeline send / recv of a step: each micro-batch and owned chunk crosses a boundary
    constants.PP_P2P_CROSSINGS_PER_MICROBATCH times on this rank's critical path (cluster.pp_engine), and the
    fill and drain cross the pp - 1 boundaries once each way; DeepSpeed's engine under TP adds its all-gathers
    of the split boundary (constants.DEEPSPEED_PARTITIONED_GATHERS_PER_MICROBATCH), on the compute stream."""
    per_microbatch = C.PP_P2P_CROSSINGS_PER_MICROBATCH[problem.stack_for(lay).pp_engine]
    sends = core.pp_send * (per_microbatch * m * chunks + 2 * (lay.pp - 1)) * C.PP_P2P_EXPOSED_FRACTION
    return sends + core.pp_gather * C.DEEPSPEED_PARTITIONED_GATHERS_PER_MICROBATCH * m * chunks


def dopt_exposed(core: RankCore, pp: int, chunks: int) -> float:
    """Exposed seconds of Megatron's distributed optimizer (cluster.grad_reduce = "distributed_optimizer"):
    its reduce-scatter behind the last backward, its all-gather behind the next first forward, chunk by
    chunk under an interleaved pipeline (plan/scale.py overlapped_exposure)."""
    rs, rs_bucket, ag, ag_bucket = core.dopt
    mb = core.mb
    return (overlapped_exposure(rs, rs_bucket, mb.bwd + mb.recompute, pp, chunks)
            + overlapped_exposure(ag, ag_bucket, mb.fwd, pp, chunks))


def _beside(core: RankCore, dopt_out: float) -> float:
    """Seconds of collectives that run beside a rank's compute: FSDP's, DDP's and the CP ring's hidden
    parts, and the distributed optimizer's reduce-scatter and all-gather less their exposed part."""
    return core.beside + core.dopt[0] + core.dopt[2] - dopt_out


def _pipeline_times(core: RankCore) -> tuple[float, float]:
    """(t_f, t_b) of one micro-batch on a rank. Forward holds 1/3 of the activation collectives (TP: 2 of
    the 6 per block), backward the rest."""
    return core.mb.fwd + core.per_mb_comm / 3, core.mb.bwd + core.mb.recompute + core.per_mb_comm * 2 / 3


def _bubble_times(cores: list[RankCore]) -> tuple[float, float]:
    """The lighter sized rank's micro-batch times, at which the bubble is priced (spec/stages.py
    rank_bubble): a looped schedule's first rank is a middle one and the embedding's lookup, a V's last
    rank holds the V's middle (its first both ends)."""
    return min((_pipeline_times(c) for c in cores), key=sum)


def rank_step(problem: Problem, lay: Layout, rank: RankModel, bubble_times: tuple[float, float] | None = None,
              first: bool = False, bubble: float | None = None) -> tuple[float, dict[str, float], dict[str, float]]:
    """(step seconds, breakdown, detail) as seen by one pipeline rank (`first`: the pipeline's first); its
    bubble next to ranks of `bubble_times` (`_bubble_times`; default: its own), or `bubble` where given."""
    core = rank_core(problem, core_layout(lay), rank)
    mb, comm, m = core.mb, dict(core.comm), lay.accumulation(problem)
    own = _pipeline_times(core)
    light = bubble_times or own
    if bubble is None:
        bubble = rank_bubble(lay.schedule, lay.pp, lay.chunks_per_rank, m, light, own, first)
    detail = dict(core.detail)
    dopt_out = dopt_exposed(core, lay.pp, lay.chunks_per_rank)
    comm["dp"] += dopt_out
    detail["comm_beside_compute_s"] = _beside(core, dopt_out)
    if lay.pp > 1:
        # what the report says of the bubble (plan/report.py bubble_line)
        detail["bubble_at_lighter_rank_s"] = bubble_seconds(lay.schedule, lay.pp, lay.chunks_per_rank, m, *light)
        comm["pp"] = pp_p2p_seconds(problem, lay, core, m, lay.chunks_per_rank)
    breakdown = {"compute": m * (mb.fwd + mb.bwd - mb.outside), "recompute": m * mb.recompute, "dp_comm": comm["dp"],
                 "tp_comm": comm["tp"], "pp_comm": comm["pp"], "cp_comm": comm["cp"], "ep_comm": comm["ep"],
                 "bubble": bubble, "optimizer": core.optimizer,
                 "slowest_rank": m * (mb.fwd + mb.bwd + mb.recompute) * slowest_rank_fraction(problem.cluster.num_gpus),
                 "overlap_contention": overlap_contention(problem.cluster, detail["comm_beside_compute_s"],
                                                          m * (mb.fwd + mb.bwd + mb.recompute))}
    if mb.outside:  # cluster.block_overhead_us, its own line (a full checkpoint's replay of it is in "recompute")
        breakdown["outside_kernels"] = m * mb.outside
    return sum(breakdown.values()), breakdown, detail


def compute_lower_bound(problem: Problem, core: Layout, schedule: str, v: int) -> float:
    """Forward + backward + recompute of the busiest pipeline rank: no layout runs faster than its own
    compute, so the search can skip timing the communication of a candidate this bound already loses."""
    chunks = v if core.pp > 1 else 1
    first, last = pipeline_ranks(problem.shape, core.pp, chunks, schedule)
    m = core.accumulation(problem)
    return max(m * (t.fwd + t.bwd + t.recompute) for t in
               (microbatch_times(problem, core, r) for r in ((first, last) if core.pp > 1 else (first,))))


def step_seconds(problem: Problem, core: Layout, schedule: str, v: int) -> float:
    """`step(...)[0]` for `core` run with `schedule` / `v`, without building the breakdown (search path). An
    uneven even split that priced_layout prices rank by rank is priced so here too under GPipe and 1F1B (their
    bubbles are closed forms of every rank's times); under the schedules whose orders are replayed it is
    screened with the rank's average (replaying their orders here took the 405B search with --allow-uneven-pp from 3 s
    to 153 s; plan/search.py prices the layouts it shows exactly)."""
    if schedule in SINGLE_STAGE and priced_layout(problem.shape, whole := core.with_(schedule=schedule)) is not whole:
        return step(problem, whole)[0]
    chunks = v if core.pp > 1 else 1
    first, last = pipeline_ranks(problem.shape, core.pp, chunks, schedule)
    m = core.accumulation(problem)
    cores = [rank_core(problem, core, rank) for rank in ((first, last) if core.pp > 1 else (first,))]
    light = _bubble_times(cores)
    slow = slowest_rank_fraction(problem.cluster.num_gpus)
    worst = 0.0
    for index, c in enumerate(cores):
        mb = c.mb
        work = m * (mb.fwd + mb.bwd + mb.recompute)
        dopt_out = dopt_exposed(c, core.pp, chunks)
        t = work * (1 + slow) + sum(v_ for _, v_ in c.comm) + c.optimizer + dopt_out \
            + overlap_contention(problem.cluster, _beside(c, dopt_out), work)
        if core.pp > 1:
            t += rank_bubble(schedule, core.pp, chunks, m, light, _pipeline_times(c), first=index == 0)
            t += pp_p2p_seconds(problem, core, c, m, chunks)
        worst = max(worst, t)
    return worst


def _fsdp_exposed(fwd: list[Collective], bwd: list[Collective], mb: MicroBatchTimes, rank: RankModel, m: int,
                  place, cl, detail: dict[str, float]) -> float:
    """Per block: exposed = max(0, comm - compute of the neighbouring block); the root unit's gather
    and the last reduce-scatter are exposed; per micro-batch, with the syncs that happen only on the
    last micro-batch (ZeRO-2 reduce-scatter) counted once."""
    n_blocks = max(1, rank.layers)
    exposed = 0.0
    total = 0.0
    for colls, window in ((fwd, mb.block_fwd), (bwd, mb.block_bwd)):
        by_calls: dict[float, float] = {}
        for c in colls:
            t_all = time_of(c, place, cl)
            total += t_all
            if c.unit in ("block", "experts"):
                # An MoE block's experts unit (efsdp, plan/comm.py) moves with its block: its time
                # spread over the blocks (all of them are MoE in the presets).
                units = n_blocks if c.unit == "block" else max(1, rank.moe_layers)
                times_per_step = c.calls / units
                per_block = t_all / (times_per_step * n_blocks)
                by_calls[times_per_step] = by_calls.get(times_per_step, 0.0) + per_block
            else:  # root gather / root reduce-scatter / HSDP all-reduce of the shards
                if c.unit == "grads":
                    per_block = t_all / c.calls / n_blocks
                    by_calls[c.calls] = by_calls.get(c.calls, 0.0) + per_block
                else:
                    exposed += t_all
        for times_per_step, per_block in by_calls.items():
            exposed += times_per_step * (n_blocks * max(0.0, per_block - window) + min(per_block, window))
    detail["fsdp_comm_total_s"] = total
    return exposed


def _optimizer_time(problem: Problem, lay: Layout, rank: RankModel, detail: dict[str, float] | None = None) -> float:
    """AdamW over this rank's (sharded) parameters, memory bound; grad clipping included.

    Offload ("cpu"): the step runs in host memory (torch's fused CPU AdamW, train/optim.py) at
    constants.HOST_MEMORY_GBPS_PER_GPU with the datasheet bytes per parameter; on a CPU device, at its
    measured fused (else foreach) AdamW rate. "nvme" (parallel/offload.py NvmeAdamW) streams the moments,
    8 B/param of the shard, in from the disk and back out every step in chunks, the I/O thread running
    one chunk ahead of the update (two buffers): disk-bound, the thread is busy from the first read to
    the last write, t_disk = 8n / read + 8n / write; CPU-bound, the updates run back to back after the
    first chunk's read and before the last chunk's write. Step = max(t_disk, t_adamw + chunk / read +
    chunk / write), chunk = min(8n, 64 MiB) (constants.NVME_CHUNK_BYTES)."""
    shard = lay.shard_group if lay.zero else 1
    st = model_state_bytes(problem, rank, lay.tp, lay.ep, lay.zero, shard, max(1, shard // lay.ep), lay.tp_mode)
    # parameters in the shard; AdamW's traffic per parameter is the fp32 state's measured one, also for a bf16
    # state (cluster.optimizer_state_dtype: a little pessimistic there)
    numel = (st.optimizer / 8 if problem.model_states == "shardwise" or not problem.low_precision
             else st.optimizer / problem.master_state_bytes)
    dev = problem.cluster.device
    hbm = dev.memory_bandwidth_gbps * 1e9 * _hbm_fraction(dev.name)
    measured = problem.cluster.measured_device
    # The stack's AdamW kernel and the gradient clipping (plan/stack.py; measured bytes, constants.py); a
    # device benchmarks/kernels.py measured: its own AdamW rate.
    kernel = problem.stack_for(lay).optimizer
    optimizer_bytes = (measured.optimizer_bytes_per_param + measured.clip_bytes_per_param if measured
                       else C.OPTIMIZER_KERNEL_BYTES[kernel] + C.CLIP_BYTES_PER_PARAM)
    # fp16: the loss scaler unscales and checks every gradient first (on the GPU, also under offload).
    # Its per-tensor checks (isfinite, all: 2 small kernels per gradient, and the foreach multiply's share)
    # run at the host's pace (constants.EAGER_HOST_OP_S), not the GPU's.
    scaler = 0.0
    if problem.precision == "fp16":
        host_op = 0.0 if measured and measured.device_type == "cpu" else (measured.eager_op_s if measured else C.EAGER_HOST_OP_S)
        scaler = numel * C.LOSS_SCALER_BYTES_PER_PARAM / hbm + 3 * st.tensors * host_op
    # A GPU idles while the host syncs on the gradient norm and starts the next step (constants.STEP_HOST_SYNC_S).
    sync = 0.0 if problem.cluster.device_is_host or (measured and measured.device_type == "cpu") else C.STEP_HOST_SYNC_S
    if not lay.offload:
        return numel * optimizer_bytes / hbm + scaler + sync
    if problem.cluster.device_is_host:  # the host is the device: its own measured fused AdamW
        adamw = numel * (measured.fused_optimizer_bytes_per_param or optimizer_bytes) / hbm
    else:  # a GPU's measured rates say nothing of its host: the datasheet bytes at the host's bandwidth
        adamw = numel * C.OPTIMIZER_BYTES_PER_PARAM / (C.HOST_MEMORY_GBPS_PER_GPU * 1e9)
    if detail is not None:
        detail["offload_adamw_s"] = adamw
    if not lay.nvme:
        return adamw + scaler
    moments = nvme_moment_bytes(st.optimizer, st.tensors, problem.model_states == "mixed" and problem.low_precision)
    read, write = problem.cluster.disk_bytes_per_s()
    disk = moments / read + moments / write
    chunk = min(moments, C.NVME_CHUNK_BYTES)
    if detail is not None:
        detail["nvme_disk_s"] = disk
        detail["nvme_bytes_per_step"] = 2 * moments
    return max(disk, adamw + chunk / read + chunk / write) + scaler


def _offload_time(problem: Problem, lay: Layout, rank: RankModel, m: int) -> float:
    """FSDP2 CPUOffloadPolicy: the fp32 shard is copied to the GPU before each all-gather (every
    micro-batch; twice with ZeRO-3, whose backward gathers again) and the gradient shard back after
    each reduce-scatter (ZeRO-2 with accumulation: once, on the last micro-batch), over PCIe; exposed.
    A shard group of one rank (ZeRO-Offload on one device) copies the whole model's states so. On a
    CPU device nothing moves: FSDP2's `.to(device)` of a tensor already there returns it (torch
    Tensor.to), so the term is 0."""
    if problem.cluster.device_is_host:
        return 0.0
    shard = lay.shard_group
    st = model_state_bytes(problem, rank, lay.tp, lay.ep, lay.zero, shard, max(1, shard // lay.ep), lay.tp_mode)
    pcie = _device_constant(C.PCIE_GBPS, problem.cluster.device.name.removeprefix("measured-"), 32.0) * 1e9 * C.PCIE_FRACTION
    gathers = m * (2 if lay.zero == 3 else 1)
    syncs = m if lay.zero == 3 else 1
    return (st.params * gathers + st.grads * syncs) / pcie


# ---------------------------------------------------------------------------------------------------
# the whole estimate
# ---------------------------------------------------------------------------------------------------
def _split_bubbles(problem: Problem, lay: Layout, core: Layout, times: list[tuple[float, float]]) -> list[float]:
    """Every rank's bubble under the trainer's own split (`times`: each rank's micro-batch times): GPipe's and
    1F1B's from those (spec/stages.py looped_bubbles); interleaved 1F1B's, zero bubble's, ZB-V's and
    DualPipeV's from their orders replayed with each stage's own times (looped_bubbles_by_stage)."""
    m = lay.accumulation(problem)
    if lay.schedule not in WRITTEN_OUT:
        return looped_bubbles(lay.schedule, m, times)
    n = lay.pp * lay.chunks_per_rank
    stages = [_pipeline_times(rank_core(problem, core, stage_model(problem.shape, n, s, lay.stage_layers))) for s in range(n)]
    return looped_bubbles_by_stage(lay.schedule, lay.pp, lay.chunks_per_rank, m, stages)


def step(problem: Problem, lay: Layout) -> tuple[float, dict[str, float], dict[str, float]]:
    """The slowest pipeline rank decides the step (first: embedding; last: head + loss; under the trainer's
    own split any rank, plan/inventory.py sized_ranks; and the even split priced_layout prices so), its bubble
    then from `_split_bubbles`."""
    lay = priced_layout(problem.shape, lay)
    ranks = sized_ranks(problem.shape, lay)
    if lay.pp == 1:
        return rank_step(problem, lay, ranks[0][1])
    core = core_layout(lay)
    cores = [rank_core(problem, core, rank) for _, rank in ranks]
    times = _bubble_times(cores)
    exact = _split_bubbles(problem, lay, core, [_pipeline_times(c) for c in cores]) if lay.stage_layers else None
    steps = [(rank_step(problem, lay, rank, times, r == 0, None if exact is None else exact[i]), r)
             for i, (r, rank) in enumerate(ranks)]
    (t, breakdown, detail), r = max(steps, key=lambda s: s[0][0])  # the first of equals
    return t, breakdown, {**detail, "step_on_last_rank": float(r == lay.pp - 1),  # whose step this is
                          "step_on_pipeline_rank": float(r)}


def evaluate(problem: Problem, lay: Layout, mem: Memory | None = None) -> Estimate:
    mem = mem if mem is not None else memory(problem, lay)
    t, breakdown, detail = step(problem, lay)
    cl = problem.cluster
    peak = cl.device.peak_flops(problem.compute_precision)  # MFU: FP8 runs count against the bf16 peak too
    if cl.measured_device is not None and cl.measured_device.device_type == "cuda":
        # A GPU's measured rates price the step; its MFU stays against the datasheet peak, as everyone's.
        peak = lookup(cl.device.name.removeprefix("measured-")).peak_flops(problem.compute_precision)
    flops_token = problem.shape.flops_per_token(problem.seq_len)
    tokens_step = problem.tokens_per_step
    source = "predicted"
    if problem.assume_mfu > 0:
        # Fix MFU: the step takes the model FLOPs at that fraction of the cluster's peak.
        t = flops_token * tokens_step / (cl.num_gpus * peak * problem.assume_mfu)
        source = "assumed"
    tokens_per_s = tokens_step / t
    tflops = flops_token * tokens_per_s / cl.num_gpus / 1e12
    mfu = tflops * 1e12 / peak
    days = problem.tokens / tokens_per_s / C.SECONDS_PER_DAY
    # The 6ND rule of thumb (Kaplan et al. 2020, arXiv 2001.08361 §2.1): 6 FLOPs per parameter per
    # token, attention ignored, at the same MFU.
    six_nd_rate = cl.num_gpus * peak * mfu / (6.0 * problem.shape.num_params)
    days_6nd = problem.tokens / six_nd_rate / C.SECONDS_PER_DAY
    tp2d: dict[str, dict[str, float]] = {}
    if lay.tp > 1 and lay.tp_mode == "2d":  # the first pipeline rank's, per grid axis (plan/tp2d.py)
        for c in data_and_model_collectives(problem, lay, pipeline_ranks(problem.shape, lay.pp, lay.chunks_per_rank,
                                                                         lay.schedule)[0]):
            if c.axis in ("tp_col", "tp_row"):
                tp2d.setdefault(c.axis, {}).setdefault(c.kind, 0.0)
                tp2d[c.axis][c.kind] += c.total
    return Estimate(lay, mem, t, breakdown, tokens_per_s, tflops, mfu, days, days_6nd, source, detail, tp2d,
                    problem.stack_description(lay))
