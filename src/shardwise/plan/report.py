"""What `shardwise plan evaluate | search` print: rich tables, one JSON object, and the --plot figure."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from shardwise.plan.cost import Estimate
from shardwise.plan.layout import Problem
from shardwise.plan.memory import GIB
from shardwise.plan.search import SearchResult, why_lost

MEMORY_ROWS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
               ("activations", "activations"), ("other", "other"))
TIME_ROWS = (("compute", "compute (fwd + bwd)"), ("recompute", "recompute"), ("dp_comm", "exposed comm dp"),
             ("tp_comm", "exposed comm tp"), ("pp_comm", "exposed comm pp"), ("cp_comm", "exposed comm cp"),
             ("ep_comm", "exposed comm ep"), ("bubble", "pipeline bubble"), ("optimizer", "optimizer step"))


def _console(width: int = 110):
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None, highlight=False)


def problem_lines(problem: Problem) -> list[str]:
    s, cl = problem.shape, problem.cluster
    nodes = max(1, cl.num_gpus // cl.gpus_per_node)
    moe = f", MoE {s.moe.num_experts}x top-{s.moe.top_k}" if s.moe else ""
    return [
        f"model    {s.arch}: {s.num_params / 1e9:.2f}B params, {s.n_layers} layers, dim {s.dim}, heads {s.n_heads}/{s.n_kv_heads} kv, "
        f"ffn {s.ffn_dim}, vocab {s.vocab_size}{moe}; {s.flops_per_token(problem.seq_len) / 1e9:.1f} GFLOP/token (6N + 12Lsh)",
        f"cluster  {cl.num_gpus} x {cl.device.name} ({nodes} node{'s' if nodes > 1 else ''} of {cl.gpus_per_node}), "
        f"{cl.device.memory_gib:g} GiB, {cl.device.peak_flops(problem.precision) / 1e12:.1f} TFLOP/s dense {problem.precision}, "
        f"links {cl.intra_gbps:g} GB/s intra / {cl.inter_gbps:g} GB/s inter per GPU",
        f"batch    seq {problem.seq_len} x global batch {problem.global_batch} = {problem.tokens_per_step / 1e6:.2f}M tokens/step; "
        f"{problem.tokens / 1e12:.3g}T tokens to train; model states \"{problem.model_states}\"",
    ]


def model_state_lines(problem: Problem, est: Estimate) -> list[str]:
    """The textbook totals: params + grads + optimizer of the whole model, and per GPU of one model
    replica when only the model-parallel axes (tp x pp, ep for experts) split them (no ZeRO)."""
    n, per = problem.shape.num_params, 16
    split = "2 + 2 + 12" if problem.model_states == "mixed" and problem.low_precision else "4 + 4 + 8 (+4 B per tensor)"
    lay = est.layout
    mp = lay.tp * lay.pp
    mem = est.memory
    here = (mem.params + mem.grads + mem.optimizer + mem.cpu_bytes) / 1e9
    return [f"model states (params + grads + optimizer, no activations): {n * per / 1e9:,.0f} GB for the whole model "
            f"({split} bytes/param); / (tp x pp = {mp}) = {n * per / mp / 1e9:.1f} GB per GPU on average; "
            f"{here:.1f} GB on this layout's most loaded GPU"]


def evaluate_text(problem: Problem, est: Estimate) -> str:
    from rich.table import Table

    con = _console()
    lay = est.layout
    out = problem_lines(problem) + [f"layout   {lay.describe()}  (accumulation / micro-batches {lay.accumulation(problem)}, "
                                    f"sequence parallel {'on' if lay.sp else 'off'})"]
    con.print("\n".join(out), soft_wrap=True)
    mem = est.memory
    where = {"first": "first pipeline stage", "last": "last pipeline stage", "only": "every rank"}[mem.rank]
    t = Table(title=f"memory per GPU ({where}), GiB", title_justify="left")
    t.add_column("category")
    t.add_column("GiB", justify="right")
    t.add_column("what", overflow="fold")
    d = mem.detail
    mixed = problem.model_states == "mixed" and problem.low_precision
    notes = {
        "params": "offloaded to CPU" if lay.offload else ("local shard" if lay.zero >= 3 or lay.fsdp else "replicated over dp"),
        "grads": "offloaded to CPU" if lay.offload else ("local shard" if lay.fsdp else
                                                          "full, 16-bit" if mixed else "full, fp32 DDP buckets"),
        "optimizer": "offloaded to CPU" if lay.offload else ("sharded over dp_shard" if lay.zero >= 1 else "replicated"),
        "activations": f"{d.get('inflight_microbatches', 1):.3g} in-flight micro-batch(es) of {lay.micro_batch} seq; "
                       f"stored {d.get('activations_stored', 0) / GIB:.2f} + recompute working set "
                       f"{d.get('recompute_working_set', 0) / GIB:.2f}",
        "other": ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in d.items()
                           if k in ("fsdp_unsharded_params", "fsdp_unsharded_grads", "logits_transient", "comm_buffers")),
    }
    for key, label in MEMORY_ROWS:
        t.add_row(label, f"{getattr(mem, key) / GIB:.2f}", notes[key])
    t.add_row("total", f"{mem.total / GIB:.2f}",
              f"{'fits' if mem.fits else 'DOES NOT FIT'}: usable {mem.capacity / GIB:.1f} of {problem.cluster.device.memory_gib:g} GiB"
              + (f"; {mem.cpu_bytes / GIB:.2f} GiB on the host" if mem.cpu_bytes else ""))
    con.print(t)
    tt = Table(title="step time", title_justify="left")
    tt.add_column("term")
    tt.add_column("seconds", justify="right")
    tt.add_column("share", justify="right")
    for key, label in TIME_ROWS:
        v = est.breakdown_s.get(key, 0.0)
        tt.add_row(label, f"{v:.3f}", f"{v / est.step_time_s * 100:.1f}%" if est.mfu_source == "predicted" else "")
    tt.add_row("step", f"{est.step_time_s:.3f}", "assumed MFU" if est.mfu_source == "assumed" else "100%")
    con.print(tt)
    con.print(f"tokens/s {est.tokens_per_s:,.0f}  |  model TFLOP/s per GPU {est.model_tflops_per_gpu:.1f}  |  "
              f"MFU {est.mfu * 100:.1f}% ({est.mfu_source})  |  {est.days:.1f} days for {problem.tokens / 1e12:.3g}T tokens "
              f"({est.days_6nd:.1f} by the 6ND rule)", soft_wrap=True)
    con.print("\n".join(model_state_lines(problem, est)), soft_wrap=True)
    return con.file.getvalue()


def search_text(problem: Problem, result: SearchResult, top: int) -> str:
    from rich.table import Table

    con = _console(130)
    con.print("\n".join(problem_lines(problem)), soft_wrap=True)
    t = Table(title=f"top {min(top, len(result.ranked))} layouts by step time", title_justify="left")
    for col, just in (("#", "right"), ("layout", "left"), ("step s", "right"), ("tokens/s", "right"), ("MFU", "right"),
                      ("days", "right"), ("mem GiB", "right"), ("bubble s", "right"), ("exposed comm s", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, e in enumerate(result.ranked[:top], 1):
        comm = sum(e.breakdown_s[k] for k in ("dp_comm", "tp_comm", "pp_comm", "cp_comm", "ep_comm"))
        t.add_row(str(i), e.layout.describe(), f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}%",
                  f"{e.days:.1f}", f"{e.memory.total / GIB:.1f}", f"{e.breakdown_s['bubble']:.3f}", f"{comm:.3f}")
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
    }


def plot(path: str | Path, problem: Problem, estimates: list[Estimate], points: list[tuple[float, float]] | None = None) -> None:
    """Memory breakdown per candidate (stacked bars, device capacity line) and, for a search, step
    time vs memory of every feasible candidate with the chosen layout marked. matplotlib Agg, no pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13 if points else 7, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if points else 1, 1)
    labels = [f"#{i + 1}" for i in range(len(estimates))]
    bottom = [0.0] * len(estimates)
    for key, label in MEMORY_ROWS:
        vals = [getattr(e.memory, key) / GIB for e in estimates]
        ax.bar(labels, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = problem.cluster.device.memory_gib
    ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"{problem.cluster.device.name} {cap:g} GiB")
    ax.axhline(estimates[0].memory.capacity / GIB, color="grey", linestyle=":", linewidth=1,
               label=f"usable {estimates[0].memory.capacity / GIB:.0f} GiB (constants.USABLE_MEMORY_FRACTION)")
    ax.set_ylabel("GiB per GPU (most loaded rank)")
    ax.set_title("memory by category")
    ax.legend(fontsize=8)
    for i, e in enumerate(estimates):
        ax.annotate(e.layout.describe(), (i, bottom[i]), rotation=90, fontsize=6, ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, max([cap] + bottom) * 1.6)
    if points:
        ax2 = fig.add_subplot(1, 2, 2)
        ax2.scatter([p[1] / GIB for p in points], [p[0] for p in points], s=4, alpha=0.3, label="feasible layouts")
        best = estimates[0]
        ax2.scatter([best.memory.total / GIB], [best.step_time_s], s=80, marker="*", color="red",
                    label=f"chosen: {best.layout.describe()}")
        ax2.set_xlabel("GiB per GPU")
        ax2.set_ylabel("step time (s)")
        ax2.set_yscale("log")
        ax2.set_title(f"search space: {len(points):,} timed layouts (those bounded out are not drawn)")
        ax2.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
