"""What `shardwise plan evaluate | search` print: rich tables, one JSON object, and the --plot figure."""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from shardwise.plan.cost import Estimate
from shardwise.plan.decode import DecodeEstimate
from shardwise.plan.evaluation import EvalPrice
from shardwise.plan.goodput import RunCost, run_cost
from shardwise.plan.inventory import priced_layout
from shardwise.plan.layout import Problem
from shardwise.plan.memory import GIB
from shardwise.plan.search import SearchResult, why_lost
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape
from shardwise.spec.stages import SINGLE_STAGE, WRITTEN_OUT

MEMORY_ROWS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
               ("activations", "activations"), ("other", "other"))
# plan.png's legend names what "other" holds (the table's "what" column lists it by amount)
OTHER_IN_LEGEND = "other: FSDP's gathered parameters\nand gradients, comm buffers,\nlogits, offload staging"
TIME_ROWS = (("compute", "compute (fwd + bwd)"), ("outside_kernels", "blocks outside their kernels"),
             ("recompute", "recompute"), ("dp_comm", "exposed comm dp"), ("tp_comm", "exposed comm tp"),
             ("pp_comm", "exposed comm pp"), ("cp_comm", "exposed comm cp"),
             ("ep_comm", "exposed comm ep"), ("bubble", "pipeline bubble"), ("optimizer", "optimizer step"),
             ("slowest_rank", "slowest GPU of the job"), ("overlap_contention", "compute slowed by hidden comm"))


# Adaptive units, so a tiny model reads "0.16M params", "1.2 ms", not "0.00B" and "0.000". Each
# helper keeps the large-model form (B params, GFLOP, seconds, GiB, days) unchanged above its threshold.

def _count(n: float) -> str:
    for scale, suffix, fmt in ((1e9, "B", ".2f"), (1e6, "M", ".2f"), (1e3, "K", ".1f")):
        if n >= scale:
            return f"{n / scale:{fmt}}{suffix}"
    return f"{n:.0f}"


def _flops(f: float) -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if f >= scale:
            return f"{f / scale:.1f} {prefix}FLOP"
    return f"{f:.0f} FLOP"


def _tokens(t: float) -> str:
    """Tokens to train: '2T' as before, else B / M / K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if t >= scale:
            return f"{t / scale:.3g}{suffix}"
    return f"{t:.3g}"


def _time_unit(seconds: float) -> tuple[float, str]:
    """(multiplier, unit) for a table of times whose largest is `seconds`: s from 0.1 s up, else ms or µs."""
    if seconds >= 0.1:
        return 1.0, "s"
    return (1e3, "ms") if seconds >= 1e-4 else (1e6, "µs")


def _days(days: float) -> str:
    if days >= 0.1:
        return f"{days:.1f} days"
    hours = days * 24
    if hours >= 1:
        return f"{hours:.1f} hours"
    return f"{hours * 60:.1f} min" if hours * 60 >= 1 else f"{hours * 3600:.1f} s"


def _bytes(b: float, fmt: str = ".1f", like: float | None = None) -> str:
    """Decimal GB in `fmt` as before, MB / kB (one decimal) below 1 GB; `like` picks the unit instead
    of `b` (one unit for a whole line)."""
    ref = b if like is None else like
    if ref >= 1e9:
        return f"{b / 1e9:{fmt}} GB"
    return f"{b / 1e6:.1f} MB" if ref >= 1e6 else f"{b / 1e3:.1f} kB"


def _console(width: int = 110):
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None, highlight=False)


def _peak_key(problem) -> str:
    """The dtype whose peak the cluster line shows: the precision, or "tf32" for fp32 on TF32 tensor cores."""
    return "tf32" if problem.compute_precision == "tf32" else problem.precision


def problem_lines(problem: Problem) -> list[str]:
    s, cl = problem.shape, problem.cluster
    nodes = max(1, cl.num_gpus // cl.gpus_per_node)
    moe = f", MoE {s.moe.num_experts}x top-{s.moe.top_k}" if s.moe else ""
    # which GEMMs run at the FP8 peak (parallel/float8.py): the blocks' linears, the head too with train.fp8_head
    fp8 = (" (the blocks' and the head's GEMMs)" if problem.head_in_fp8 else " (the blocks' GEMMs; the head bf16)") \
        if problem.precision == "fp8" else ""
    return [
        f"model    {s.arch}: {_count(s.num_params)} params, {s.n_layers} layers, dim {s.dim}, heads {s.n_heads}/{s.n_kv_heads} kv, "
        f"ffn {s.ffn_dim}, vocab {s.vocab_size}{moe}; {_flops(s.flops_per_token(problem.seq_len))}/token (6N + 12Lsh)",
        f"cluster  {cl.num_gpus} x {cl.device.name} ({nodes} node{'s' if nodes > 1 else ''} of {cl.gpus_per_node}), "
        f"{cl.device.memory_gib:g} GiB at {cl.device.memory_bandwidth_gbps:,.0f} GB/s, "
        f"{cl.device.peak_flops(_peak_key(problem)) / 1e12:.1f} TFLOP/s dense {_peak_key(problem)}{fp8}, "
        f"links {cl.intra_gbps:g} GB/s intra / {cl.inter_gbps:g} GB/s inter per GPU",
        f"batch    seq {problem.seq_len} x global batch {problem.global_batch} = {_count(problem.tokens_per_step)} tokens/step; "
        f"{_tokens(problem.tokens)} tokens to train; model states \"{problem.model_states}\"",
    ] + calibration_lines(problem)


def _fitted(problem: Problem) -> str:
    """What cluster.calibration changed in the kernels' rates, for the stack line ("" without it)."""
    cl, parts, fractions = problem.cluster, [], []
    if cl.measured_device is not None:
        parts.append(f"rates measured by benchmarks/kernels.py ({cl.measured_device.device_type})")
    if cl.pointwise_hbm_fraction:
        fractions.append(f"eager kernels at {cl.pointwise_hbm_fraction:.3f}")
    if cl.compiled_hbm_fraction:
        fractions.append(f"fused kernels at {cl.compiled_hbm_fraction:.3f}")
    if fractions:
        parts.append(f"{', '.join(fractions)} of HBM (plan calibrate)")
    return "".join(f"; {p}" for p in parts)


def calibration_lines(problem: Problem, lay: Any = None) -> list[str]:
    """With cluster.calibration: which axes' collectives are priced from measurements (plan/comm.py
    measured_time) and, for one layout, which of its axes still use the datasheet. Nothing without it."""
    cl = problem.cluster
    if not cl.calibration:
        return []
    out = [f"measured {cl.calibration_path}: " + "; ".join(
        f"{a.axis} busbw {a.bus_bytes_per_s / 1e9:.3g} GB/s, latency {a.hop_latency_s * 1e6:.3g} us/hop "
        f"({a.ranks} ranks, all-reduce {a.method})" for a in cl.calibration)]
    if lay is not None:
        from shardwise.plan.comm import collectives

        used = sorted({c.axis for c in collectives(problem, lay)})
        measured = [a for a in used if cl.measured(a)]
        rest = [a for a in used if not cl.measured(a)]
        out.append(f"comm     measured: {', '.join(measured) or 'none'}; datasheet: {', '.join(rest) or 'none'}")
    return out


def tp_bytes(problem: Problem, lay: Layout) -> dict[str, dict[str, float]]:
    """Payload bytes per step of the TP axes (tp, or 2-D's tp_col / tp_row) by kind, on the first
    pipeline rank (plan/comm.py)."""
    from shardwise.plan.comm import collectives

    out: dict[str, dict[str, float]] = {}
    for c in collectives(problem, lay):
        if c.axis in ("tp", "tp_col", "tp_row") and c.total > 0:
            kinds = out.setdefault(c.axis, {})
            kinds[c.kind] = kinds.get(c.kind, 0.0) + c.total
    return out


def tp2d_lines(problem: Problem, lay: Layout) -> list[str]:
    """2-D TP: the payload per grid axis and kind (plan/tp2d.py comm_bytes_per_step), and what 1-D TP
    over the same tp ranks would move."""
    if lay.tp == 1 or lay.tp_mode != "2d":
        return []
    per_axis = tp_bytes(problem, lay)
    one_d = sum(sum(k.values()) for k in tp_bytes(problem, lay.with_(tp_mode="1d")).values())
    names = {"tp_col": "tp_col (grid rows: activations)", "tp_row": "tp_row (grid columns: weights)"}
    parts = [f"{names[a]} " + ", ".join(f"{k} {_bytes(v)}" for k, v in kinds.items()) for a, kinds in per_axis.items()]
    total = sum(sum(k.values()) for k in per_axis.values())
    return [f"tp2d     bytes per step: {'; '.join(parts)}; total {_bytes(total)} (1-D TP on {lay.tp} ranks: {_bytes(one_d)})"]


def model_state_lines(problem: Problem, est: Estimate) -> list[str]:
    """The textbook totals: params + grads + optimizer of the whole model, and per GPU of one model
    replica when only the model-parallel axes (tp x pp, ep for experts) split them (no ZeRO)."""
    n, per = problem.shape.num_params, 16
    split = "4 + 4 + 8 (+4 B per tensor)"
    if problem.model_states == "mixed" and problem.low_precision:
        per = 4 + problem.master_state_bytes
        split = f"2 + 2 + {problem.master_state_bytes}"
    lay = est.layout
    mp = lay.tp * lay.pp
    mem = est.memory
    here = mem.params + mem.grads + mem.optimizer + mem.cpu_bytes
    return [f"model states (params + grads + optimizer, no activations): {_bytes(n * per, ',.0f')} for the whole model "
            f"({split} bytes/param); / (tp x pp = {mp}) = {_bytes(n * per / mp, like=n * per)} per GPU on average; "
            f"{_bytes(here, like=n * per)} on this layout's most loaded GPU"]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"


def eval_line(price: EvalPrice, train_days: float) -> str:
    """`plan evaluate`'s line for validation (plan/evaluation.py): a round's seconds and what the rounds add."""
    per = f"{price.batch_s:.3g} s per global batch forward"
    rounds = f"{price.rounds} round{'s' if price.rounds != 1 else ''}"
    if not price.batches_per_set:
        return f"evaluation: {rounds} over whole sets (eval.tokens=0): {per} x each set's batches (set eval.tokens to price a round)"
    return (f"evaluation: {rounds} x {price.sets} set{'s' if price.sets != 1 else ''} x {price.batches_per_set} "
            f"batch{'es' if price.batches_per_set != 1 else ''} ({per}) = {price.round_s:.3g} s a round, "
            f"{price.total_s:.3g} s in all: +{price.total_s / max(train_days * 86400, 1e-12):.2%} of the training time; "
            f"{_days(train_days + price.total_s / 86400)} with evaluation")


def _amount(x: float) -> str:
    return _count(x) if x >= 1e3 else f"{x:.3g}"


def cost_lines(rc: RunCost) -> list[str]:
    """The cost block of `plan evaluate` (plan/goodput.py): GPU-hours and price, energy, failures and checkpoints."""
    priced = (f"{_amount(rc.cost)} at {rc.price_per_gpu_hour:g} per GPU-hour ({_amount(rc.cost_with_failures)} with failures)"
              if rc.cost is not None else "not priced (cluster.price_per_gpu_hour = 0)")
    out = [f"cost     {_amount(rc.gpu_hours)} GPU-hours ({_amount(rc.gpu_hours_with_failures)} with failures)  |  {priced}"]
    if rc.energy_kwh is not None:
        energy = f"{rc.energy_kwh / 1e3:,.0f} MWh" if rc.energy_kwh >= 1e3 else f"{rc.energy_kwh:.3g} kWh"
        out.append(f"energy   {rc.power_w_per_gpu:.0f} W per GPU (TDP {rc.tdp_w:g} W, busy {rc.busy_fraction * 100:.0f}% of the step, "
                   f"waiting at {rc.idle_power_fraction:.0%} of TDP, assumed)  |  {energy} for the run, "
                   f"{rc.energy_j_per_token:.3g} J/token (all GPUs; failures excluded)")
    if rc.checkpoint_every_steps is None:
        out.append("failures none (cluster.failures_per_gpu_hour = 0): no checkpoint or restart overhead")
        return out
    out += [f"failures MTBF {rc.mtbf_hours:.3g} h ({rc.failures_per_gpu_hour:.3g}/GPU-hour, {rc.failures_source}), "
            f"{rc.expected_failures:,.0f} expected  |  checkpoint save {_duration(rc.checkpoint_save_s)} "
            f"({rc.checkpoint_source}{f', {_bytes(rc.checkpoint_bytes_per_gpu)}/GPU' if rc.checkpoint_source == 'estimated' else ''})"
            f", restart {_duration(rc.restart_s)} ({rc.restart_source})",
            f"goodput  checkpoint every {_duration(rc.checkpoint_interval_s)} = checkpoint.every {rc.checkpoint_every_steps} "
            f"(Young/Daly{', longer than the run' if rc.checkpoint_interval_s > rc.days * 86400 else ''})  |  "
            f"overhead {rc.overhead * 100:.1f}%, goodput {rc.goodput * 100:.1f}%  |  "
            f"{_days(rc.days_with_failures)} including failures",
            f"elastic  (train --nnodes MIN:MAX) goes on on the nodes left: restart {_duration(rc.elastic_restart_s)} instead of "
            f"{_duration(rc.restart_s)}, the work since the last checkpoint still lost  |  overhead "
            f"{rc.elastic_overhead * 100:.1f}%, goodput {rc.elastic_goodput * 100:.1f}%  |  "
            f"{_days(rc.elastic_days_with_failures)} including failures"]
    return out + ([f"note: {rc.note}"] if rc.note else [])


def offload_lines(problem: Problem, est: Estimate) -> list[str]:
    """Where offload puts the model states (host memory, local disk) and what it and tiling cost a step."""
    lay, mem, d = est.layout, est.memory, est.detail
    out = []
    if lay.offload and problem.cluster.device_is_host:
        out.append("offload  the device is the CPU: host and device are the same memory, so offload moves nothing off the "
                   "device (no host link to cross; FSDP2's copies to the device are no-ops)"
                   + ("; nvme moves the AdamW moments to disk" if lay.nvme else ""))
    elif lay.offload:
        host = problem.cluster.host_memory_bytes()
        out.append(f"host     {mem.cpu_bytes / GIB:.2f} GiB of host memory per GPU (parameters, gradients, "
                   f"{'step counters and NVMe buffers' if lay.nvme else 'optimizer state'}): "
                   f"{'fits' if mem.host_fits else 'DOES NOT FIT'} in {host / GIB:.1f} GiB usable "
                   f"(constants.HOST_MEMORY_GIB_PER_GPU x HOST_USABLE_FRACTION)"
                   + ("" if mem.host_fits or lay.nvme else '; parallel.offload="nvme" keeps the AdamW moments on disk'))
        out.append(f"copies   {d.get('offload_copy_s', 0.0) * 1e3:.1f} ms per step over the host link (fp32 parameter shards "
                   f"to the device per gather, gradient shards back), CPU AdamW {d.get('offload_adamw_s', 0.0) * 1e3:.1f} ms")
    if lay.offload and lay.nvme:
        read, write = problem.cluster.disk_bytes_per_s()
        source = "cluster.disk_gbps" if problem.cluster.disk_gbps else "datasheet NVMe drive x NVME_FRACTION"
        out.append(f"disk     {mem.disk_bytes / GIB:.2f} GiB of AdamW moments in parallel.offload_dir; "
                   f"{d.get('nvme_bytes_per_step', 0.0) / 1e9:.2f} GB read + written per step at {read / 1e9:.2g} / "
                   f"{write / 1e9:.2g} GB/s ({source}) = {d.get('nvme_disk_s', 0.0) * 1e3:.0f} ms, overlapped with the "
                   "CPU AdamW chunk by chunk")
    if lay.linear_tiles > 1:
        out.append(f"tiles    every dense MLP in {lay.linear_tiles} tiles: only its input is saved; backward recomputes "
                   f"the up-projections tile by tile (in the recompute term); one tile's working set is in the "
                   f"activations' working set")
    return out


def evaluate_text(problem: Problem, est: Estimate) -> str:
    from rich.table import Table

    con = _console()
    lay = est.layout
    q = math.isqrt(lay.tp)
    mode = f"2-D TP on a {q} x {q} grid" if lay.tp > 1 and lay.tp_mode == "2d" else \
        f"sequence parallel {'on' if lay.sp else 'off'}"
    coded = est.detail.get("grad_compression_compute_s", 0.0)
    squeeze = "" if lay.grad_compression == "none" else f", gradients {lay.grad_compression}" + (
        f" (kept fraction {lay.grad_compression_ratio:g})" if lay.grad_compression == "topk" else "") + (
        f": encode / decode {coded:.3g} s in dp_comm" if coded else ": not applied (no data-parallel hook on this layout)")
    # cluster.selective_recompute = "attention_core" replaces the policy the layout's name carries (rc-op, ...)
    core = ", selective recomputation of the attention core only, not its policy" if problem.core_recompute(lay) else ""
    out = problem_lines(problem) + [f"layout   {lay.describe()}  (accumulation / micro-batches {lay.accumulation(problem)}, "
                                    f"{mode}{squeeze}{core})",
                                    f"stack    {problem.stack_description(lay)}  (cluster.*_kernel: plan/stack.py)"
                                    + _fitted(problem)]
    out += calibration_lines(problem, lay)[1:] + tp2d_lines(problem, lay)
    con.print("\n".join(out), soft_wrap=True)
    mem = est.memory
    where = {"first": "first pipeline stage", "last": "last pipeline stage", "only": "every rank"}.get(
        mem.rank, f"pipeline {mem.rank}")
    # GiB as before; MiB when the whole rank holds less than 1 GiB (a tiny model's would read 0.00).
    unit, scale = ("GiB", GIB) if mem.total >= GIB else ("MiB", GIB / 1024)
    t = Table(title=f"memory per GPU ({where}), {unit}", title_justify="left")
    t.add_column("category")
    t.add_column(unit, justify="right")
    t.add_column("what", overflow="fold")
    d = mem.detail
    mixed = problem.model_states == "mixed" and problem.low_precision
    offloaded = lay.offload and not problem.cluster.device_is_host
    nvme = (f"AdamW moments on disk (nvme), {d.get('nvme_buffers', 0) / scale:.2f} of chunk buffers + step counters "
            "in memory") if lay.offload and lay.nvme else ""
    notes = {
        "params": "offloaded to CPU" if offloaded else ("local shard" if lay.zero >= 3 or lay.fsdp else "replicated over dp"),
        "grads": "offloaded to CPU" if offloaded else ("local shard" if lay.fsdp else
                                                        "full, 16-bit" if mixed else "full, fp32 DDP buckets"),
        "optimizer": "offloaded to CPU" + (f"; {nvme}" if nvme else "") if offloaded else
                     nvme or ("sharded over dp_shard" if lay.zero >= 1 else "replicated"),
        "activations": f"{d.get('inflight_microbatches', 1):.3g} in-flight micro-batch(es) of {lay.micro_batch} seq; "
                       f"stored {d.get('activations_stored', 0) / scale:.2f} + recompute working set "
                       f"{d.get('recompute_working_set', 0) / scale:.2f}",
        "other": ", ".join(f"{k.replace('_', ' ')} {v / scale:.2f}" for k, v in d.items()
                           if k in ("fsdp_unsharded_params", "fsdp_unsharded_grads", "offload_staging", "logits_transient",
                                    "comm_buffers")),
    }
    for key, label in MEMORY_ROWS:
        t.add_row(label, f"{getattr(mem, key) / scale:.2f}", notes[key])
    t.add_row("total", f"{mem.total / scale:.2f}",
              f"{'fits' if mem.fits else 'DOES NOT FIT'}: usable {mem.capacity / GIB:.1f} of {problem.cluster.device.memory_gib:g} GiB"
              + (f"; {mem.cpu_bytes / GIB:.2f} GiB on the host" if mem.cpu_bytes else "")
              + (f"; {mem.disk_bytes / GIB:.2f} GiB on disk" if mem.disk_bytes else "")
              + ("" if mem.host_fits else " (host memory)"))
    con.print(t)
    if lay.offload or lay.linear_tiles > 1:
        con.print("\n".join(offload_lines(problem, est)), soft_wrap=True)
    tt = Table(title="step time", title_justify="left")
    tt.add_column("term")
    k, unit = _time_unit(est.step_time_s)
    tt.add_column({"s": "seconds", "ms": "ms", "µs": "µs"}[unit], justify="right")
    tt.add_column("share", justify="right")
    for key, label in TIME_ROWS:
        if key not in est.breakdown_s:  # a term this step has not got (outside_kernels: cluster.block_overhead_us unset)
            continue
        v = est.breakdown_s[key]
        tt.add_row(label, f"{v * k:.3f}", f"{v / est.step_time_s * 100:.1f}%" if est.mfu_source == "predicted" else "")
    tt.add_row("step", f"{est.step_time_s * k:.3f}", "assumed MFU" if est.mfu_source == "assumed" else "100%")
    con.print(tt)
    if "bubble_at_lighter_rank_s" in est.detail:
        con.print(bubble_line(est, problem.shape), soft_wrap=True)
    con.print(f"tokens/s {est.tokens_per_s:,.0f}  |  model TFLOP/s per GPU {est.model_tflops_per_gpu:.1f}  |  "
              f"MFU {est.mfu * 100:.1f}% ({est.mfu_source})  |  {_days(est.days)} for {_tokens(problem.tokens)} tokens "
              f"({f'{est.days_6nd:.1f}' if est.days_6nd >= 0.1 else _days(est.days_6nd)} by the 6ND rule)", soft_wrap=True)
    con.print("\n".join(cost_lines(run_cost(problem, est))), soft_wrap=True)
    con.print("\n".join(model_state_lines(problem, est)), soft_wrap=True)
    return con.file.getvalue()


def bubble_line(est: Estimate, shape: ModelShape) -> str:
    """How the pipeline bubble of the step-time table was priced: the idle of the schedule's action order at the
    lighter pipeline rank's micro-batch times, less what the step's own rank fills with its extra work
    (spec/stages.py rank_bubble); or, under a split sized rank by rank (the trainer's own split, or an uneven even
    one: plan/inventory.py priced_layout), the order replayed at every stage's own times, whose idle on the step's
    rank is the table's figure (the lighter rank's figure, which that replay does not use, is not printed: it read
    "idles 0.106 s" beside a table's 0.295 s)."""
    lay, base, bubble = priced_layout(shape, est.layout), est.detail["bubble_at_lighter_rank_s"], est.breakdown_s["bubble"]
    k, unit = _time_unit(max(base, bubble, 1e-9))
    r = int(est.detail.get("step_on_pipeline_rank", 0))
    which = {0: "the first pipeline rank", lay.pp - 1: "the last pipeline rank"}.get(r, f"pipeline rank {r}")
    head = f"bubble   {lay.schedule} over {lay.pp} ranks, {int(est.detail.get('microbatches', 0))} micro-batches: "
    if lay.stage_layers:
        how = ("every rank's times, spec/stages.py looped_bubbles" if lay.schedule in SINGLE_STAGE else
               "its order replayed at every stage's times, spec/stages.py looped_bubbles_by_stage"
               if lay.schedule in WRITTEN_OUT else "spec/stages.py rank_bubble")
        return (head + f"blocks per stage {list(lay.stage_layers)}, priced at each stage's own times ({how}): the step's "
                f"rank ({which}) idles {bubble * k:.3f} {unit}, the table's pipeline bubble")
    line = head + f"its action order idles {base * k:.3f} {unit} at the lighter pipeline rank's micro-batch times"
    if base - bubble > 1e-12:
        return line + (f"; the step's rank ({which}), heavier, fills {(base - bubble) * k:.3f} {unit} of it with its own "
                       f"work, leaving the table's pipeline bubble {bubble * k:.3f} {unit} (spec/stages.py rank_bubble)")
    return line + ", the table's pipeline bubble (spec/stages.py rank_bubble)"


def search_text(problem: Problem, result: SearchResult, top: int) -> str:
    from rich.table import Table

    con = _console(130)
    con.print("\n".join(problem_lines(problem)), soft_wrap=True)
    if result.note:
        con.print(result.note, soft_wrap=True)
    t = Table(title=f"top {min(top, len(result.ranked))} layouts by step time", title_justify="left")
    k, unit = _time_unit(max((e.step_time_s for e in result.ranked[:top]), default=1.0))
    for col, just in (("#", "right"), ("layout", "left"), (f"step {unit}", "right"), ("tokens/s", "right"), ("MFU", "right"),
                      ("days", "right"), ("mem GiB", "right"), (f"bubble {unit}", "right"), (f"exposed comm {unit}", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, e in enumerate(result.ranked[:top], 1):
        comm = sum(e.breakdown_s[k] for k in ("dp_comm", "tp_comm", "pp_comm", "cp_comm", "ep_comm"))
        t.add_row(str(i), e.layout.describe(), f"{e.step_time_s * k:.3f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}%",
                  f"{e.days:.1f}" if e.days >= 0.1 else _days(e.days), f"{e.memory.total / GIB:.1f}",
                  f"{e.breakdown_s['bubble'] * k:.3f}", f"{comm * k:.3f}")
    con.print(t)
    if problem.assume_mfu:
        con.print(f"MFU assumed at {problem.assume_mfu:.2f} for the reported times; the ranking uses predicted step times")
    con.print("why the rest lost:")
    con.print("\n".join(why_lost(result, top)), soft_wrap=True)
    return con.file.getvalue()


def search_json(problem: Problem, result: SearchResult, top: int) -> dict[str, Any]:
    return {
        "best": result.best.to_json() if result.best else None,
        "top": [e.to_json() for e in result.ranked[:top]],
        "considered": result.considered, "feasible": result.feasible, "search_seconds": result.seconds,
        "pruned": dict(result.pruned.most_common()),
        "needs": result.needs, "note": result.note,
    }


def _runs(split: str) -> str:
    """A split's blocks per stage with repeats counted: '5,5,5,6,4' -> '5x3,6,4'."""
    out: list[list] = []
    for n in split.split(","):
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ",".join(n if k == 1 else f"{n}x{k}" for n, k in out)


def _wrapped_layout(described: str, width: int = 14) -> str:
    """Layout.describe() on short lines for a tick label (next to each other, long ones ran together): the
    mesh axes packed into lines of at most 13 characters, then the options likewise, a split's blocks per
    stage with repeats counted (issue 62: "split 5,5,5,5,5,5,5,5,5,5,5,5,5,5,6,4" on one line ran into the
    next bars' labels)."""
    axes, _, options = described.partition(" ")
    words = options.split()
    if "split" in words[:-1]:  # "split" and its blocks on one line
        i = words.index("split")
        words[i:i + 2] = [f"split {_runs(words[i + 1])}"]
    lines: list[str] = []
    for sep, parts in (("x", axes.split("x")), (" ", words)):  # no axis name contains an "x"
        fresh, join = True, " x " if sep == "x" else " "
        for name in parts:
            if lines and not fresh and len(lines[-1]) + len(join) + len(name) <= (width - 1 if sep == "x" else width):
                lines[-1] += join + name
            else:
                lines.append(name)
            fresh = False
    return "\n".join(lines)


def plot(path: str | Path, problem: Problem, estimates: list[Estimate], points: list[tuple[float, float]] | None = None) -> None:
    """Memory breakdown per candidate (stacked bars, device capacity line) and, for a search, step
    time vs memory of every feasible candidate with the chosen layout marked. matplotlib Agg, no pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13 if points else 7, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if points else 1, 1)
    # Each candidate's layout under its bar, wrapped (_wrapped_layout): written over the bars (rotated),
    # the long names ran into the legend and the title.
    labels = [f"#{i + 1}\n{_wrapped_layout(e.layout.describe())}" for i, e in enumerate(estimates)]
    bottom = [0.0] * len(estimates)
    for key, label in MEMORY_ROWS:
        vals = [getattr(e.memory, key) / GIB for e in estimates]
        ax.bar(labels, vals, bottom=bottom, label=OTHER_IN_LEGEND if key == "other" else label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = problem.cluster.device.memory_gib
    ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"{problem.cluster.device.name} {cap:g} GiB")
    ax.axhline(estimates[0].memory.capacity / GIB, color="grey", linestyle=":", linewidth=1,
               label=f"usable {estimates[0].memory.capacity / GIB:.0f} GiB")
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title("memory by category, best layouts first")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.06), ncol=3, frameon=False)
    ax.set_ylim(0, max([cap] + bottom) * 1.08)
    if points:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.scatter([p[1] / GIB for p in points], [p[0] for p in points], s=3, alpha=0.3, linewidths=0,
                    label="feasible layouts", rasterized=True)
        best = estimates[0]
        ax2.scatter([best.memory.total / GIB], [best.step_time_s], s=80, marker="*", color="red",
                    label=f"chosen: {_wrapped_layout(best.layout.describe(), 60).replace(chr(10), ' ')}")
        ax2.set_xlabel("GiB per GPU")
        ax2.set_ylabel("step time (s)")
        ax2.set_yscale("log")
        ax2.set_title(f"search space: {len(points):,} timed layouts (those bounded out are not drawn)")
        ax2.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def decode_text(est: DecodeEstimate) -> str:
    """`plan evaluate --mode=decode`: memory per rank (KV cache included), prefill, per-token latency, per stage."""
    from rich.table import Table

    con = _console(130)
    s = est.memory_stage
    con.print("\n".join([
        f"serving  tp{est.tp} x pp{est.pp} on {est.device}, {est.precision} ({est.bytes_per_element} B/element); "
        f"batch {est.batch}, prompt {est.prompt_len}, {est.max_new_tokens} new tokens (average context {est.context_avg:g})",
        f"achieved memory bandwidth {est.memory_bandwidth_gbps:g} GB/s, GEMM {est.gemm_flops_per_s / 1e12:.3g} TFLOP/s",
        f"memory per GPU (stage {s.stage}): weights {s.weight_bytes / GIB:.2f} GiB + KV cache {s.kv_cache_bytes / GIB:.2f} GiB "
        f"+ comm buffers {est.other_bytes / GIB:.2f} GiB = {est.total_bytes / GIB:.2f} GiB, "
        f"{'fits' if est.fits else 'DOES NOT FIT'}: usable {est.capacity_bytes / GIB:.1f} GiB",
    ]), soft_wrap=True)
    k, unit = _time_unit(est.decode_s_per_token)  # decode columns
    kp, unit_p = _time_unit(est.prefill_s)
    t = Table(title="per pipeline stage (one TP rank): one decode step, and the prefill", title_justify="left")
    for col in ("stage", "blocks", "weights GiB", "KV GiB", "step reads GiB", f"read {unit}", f"compute {unit}",
                f"kernels {unit}", f"comm {unit}", f"step {unit}", f"prefill {unit_p}"):
        t.add_column(col, justify="left" if col == "stage" else "right", no_wrap=col == "stage")
    for st in est.stages:
        holds = "+".join(name for name, has in (("emb", st.embedding), ("head", st.head)) if has)
        t.add_row(f"{st.stage} {holds}".strip(), str(st.layers), f"{st.weight_bytes / GIB:.2f}", f"{st.kv_cache_bytes / GIB:.2f}",
                  f"{st.decode_read_bytes / GIB:.2f}", f"{st.decode_memory_s * k:.3f}", f"{st.decode_compute_s * k:.3f}",
                  f"{st.decode_kernel_s * k:.3f}", f"{st.decode_comm_s * k:.3f}", f"{st.decode_s * k:.3f}", f"{st.prefill_s * kp:.3f}")
    con.print(t)
    con.print(f"prefill {est.prefill_s * kp:.3f} {unit_p} ({est.prefill_tokens_per_s:,.0f} tokens/s)  |  per-token latency "
              f"{est.decode_s_per_token * k:.3f} {unit} (token broadcast {est.token_broadcast_s * k:.3f})  |  decode "
              f"{est.decode_tokens_per_s:,.0f} tokens/s  |  whole generation {est.generate_s:.3g} s", soft_wrap=True)
    if est.notes:
        con.print("\n".join(f"note: {n}" for n in est.notes), soft_wrap=True)
    return con.file.getvalue()
