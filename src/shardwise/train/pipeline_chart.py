"""The measured pipeline schedule: time one step's actions on every rank (TimelineRecorder), gather
them, compute the bubble, draw it as a Gantt chart (one row per pipeline rank), and read it back for
`shardwise pipeline-chart`.

Measured bubble = 1 - mean over the pipeline's ranks of (busy time / step span), where busy time is
the sum of the rank's forward / backward actions and the span runs from a barrier all ranks pass
just before the step to the last rank's end of it. The order's bubble: the same share for the rank's
actions, in the order they ran and as long as they took, replayed without time for the sends
(spec/stages.py replay_span); the rest of the measured bubble is waiting on sends and slower ranks.
Theoretical: that of the schedule's action order with equal stages and backward = 2 x forward
(spec/stages.py bubble_fraction): GPipe and 1F1B (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al.
2021 §2.2), interleaved 1F1B (p-1)/(v·m+p-1) (ibid. §2.2.2), zero bubble (p-1)/(3·v·m+p-1) (Qi et al.
2024, arXiv 2401.10241), ZB-V and DualPipeV as torch orders them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import ParallelConfig
from shardwise.parallel.pipeline import Action
from shardwise.spec.dims import ParallelDims
from shardwise.spec.stages import bubble_fraction, replay_span

TIMELINE_FILE = "pipeline_timeline.json"
CHART_FILE = "pipeline_chart.png"
KINDS = "FBIW"
KIND_NAMES = {"F": "forward", "B": "backward (input + weight)", "I": "backward-input", "W": "backward-weight"}
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}


def gather_timeline(start: float, end: float, actions: list[Action], rank: int, world: int,
                    coords: dict[str, int], device: torch.device) -> list[dict] | None:
    """Every rank's actions of one step on rank 0 (None elsewhere), times relative to `start` (the
    barrier). Tensors only: counts first, then a padded (n, 5) float64 table per rank."""
    rows = torch.tensor([[KINDS.index(a.kind), a.stage, a.microbatch, a.start - start, a.end - start] for a in actions]
                        or torch.zeros(0, 5).tolist(), dtype=torch.float64, device=device).reshape(-1, 5)
    head = torch.tensor([rows.shape[0], end - start, coords["pp"], *(coords[a] for a in sorted(coords))],
                        dtype=torch.float64, device=device)
    heads = [torch.zeros_like(head) for _ in range(world)]
    dist.all_gather(heads, head)
    longest = int(max(h[0].item() for h in heads))
    padded = torch.zeros(longest, 5, dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows
    tables = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(tables, padded)
    if rank != 0:
        return None
    out = []
    for r, (h, table) in enumerate(zip(heads, tables)):
        other = [float(x) for x in h[3:]]
        out.append({"rank": r, "pp_rank": int(h[2]), "step_s": float(h[1]),
                    "in_rank0_pipeline": all(other[i] == 0 for i, axis in enumerate(sorted(coords)) if axis != "pp"),
                    "actions": [[KINDS[int(k)], int(s), int(mb), float(t0), float(t1)]
                                for k, s, mb, t0, t1 in table[: int(h[0])].tolist()]})
    return out


class TimelineRecorder:
    """Times the pipeline schedule of chosen steps on every rank and summarizes them on rank 0.

    The trainer sets `recording` for a step (its logging steps: the barrier and the two all-gathers
    cost time, so not every step pays them), brackets the schedule with start() / stop(), and after
    the step every rank calls collect() (a collective)."""

    def __init__(self, parallel: ParallelConfig, dims: ParallelDims, microbatches: int, rank: int,
                 device: torch.device):
        self.parallel, self.dims, self.microbatches, self.rank, self.device = parallel, dims, microbatches, rank, device
        self.recording = False
        self._measured: tuple[float, float, list[Action]] | None = None

    def start(self) -> float:
        """The step's start time; on a recorded step every rank first passes a barrier, so their
        timelines share an origin."""
        if self.recording:
            dist.barrier()
        return time.perf_counter()

    def stop(self, start: float, actions: list[Action]) -> None:
        if self.recording:
            self._measured = (start, time.perf_counter(), actions)

    def collect(self, step: int) -> dict | None:
        """The recorded step's timeline summary on rank 0 (None elsewhere); every rank calls it."""
        start, end, actions = self._measured
        ranks = gather_timeline(start, end, actions, self.rank, self.dims.world_size, self.dims.coordinates(self.rank),
                                self.device)
        if ranks is None:
            return None
        p = self.parallel
        return summarize(ranks, p.pp_schedule, p.pp, p.pp_virtual_stages, self.microbatches, step)


def summarize(ranks: list[dict], schedule: str, p: int, v: int, m: int, step: int) -> dict:
    """The timeline record written to the run directory: rank 0's pipeline, bubble measured, that of the
    schedule's own order at the measured action times (`order_bubble`), and theoretical."""
    pipeline = sorted((r for r in ranks if r["in_rank0_pipeline"]), key=lambda r: r["pp_rank"])
    span = max(r["step_s"] for r in pipeline)
    for r in pipeline:
        r["busy_s"] = sum(t1 - t0 for _, _, _, t0, t1 in r["actions"])
        r["bubble"] = 1 - r["busy_s"] / span
    busy = sum(r["busy_s"] for r in pipeline)
    return {"schedule": schedule, "pp": p, "virtual_stages": v, "microbatches": m, "step": step, "span_s": span,
            "bubble_measured": 1 - busy / (len(pipeline) * span), "bubble_order": order_bubble(pipeline, p * v, busy),
            "bubble_theoretical": bubble_fraction(schedule, p, v, m), "ranks": pipeline}


def order_bubble(pipeline: list[dict], num_stages: int, busy: float) -> float | None:
    """The idle share the schedule's action order itself costs at the measured action times: each rank's
    actions, in the order they ran and as long as they took, replayed with no time for the sends
    (spec/stages.py replay_span). What the measured bubble has beyond it is waiting on the sends and on
    slower ranks. None where the recorded actions do not form a whole step."""
    orders = {r["pp_rank"]: [(kind, stage, mb, t1 - t0) for kind, stage, mb, t0, t1 in sorted(r["actions"], key=lambda a: a[3])]
              for r in pipeline}
    try:
        span = replay_span(orders, num_stages)
    except ValueError:
        return None
    return 1 - busy / (len(pipeline) * span) if span > 0 else None


def write_timeline(run_dir: Path, timeline: dict) -> Path:
    path = run_dir / TIMELINE_FILE
    path.write_text(json.dumps(timeline, indent=1))
    draw_chart(timeline, run_dir / CHART_FILE)
    return path


def load_timeline(run_dir: Path) -> dict:
    from shardwise.errors import ConfigError

    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        raise ConfigError("RUN_DIR", f"{path} not found: only pipeline-parallel runs (parallel.pp > 1) record a schedule",
                          "pass the run.dir of a run trained with --parallel.pp=2 or more")
    return json.loads(path.read_text())


def describe(timeline: dict) -> str:
    theory = timeline["bubble_theoretical"]
    theory_text = f"{theory:.1%}" if theory is not None else "not recorded"  # timelines written before zbv / dualpipev had one
    order = timeline.get("bubble_order")  # absent from timelines written before it was measured
    order_text = "" if order is None else \
        f" (the schedule's own order at these action times {order:.1%}, the rest waiting on sends and slower ranks)"
    return (f"{timeline['schedule']} pp={timeline['pp']} v={timeline['virtual_stages']} m={timeline['microbatches']} "
            f"(step {timeline['step']}): bubble measured {timeline['bubble_measured']:.1%}{order_text}, theoretical {theory_text}")


def text_chart(timeline: dict, width: int = 100) -> str:
    """The chart as text for a terminal: one row per pipeline rank, one character per span/width seconds,
    F forward, B backward, I backward-input, W backward-weight, . idle; the kind that covers most of a
    character's time interval wins it. The rows only: the caller prints describe(timeline) once above them."""
    span = timeline["span_s"]
    lines = []
    for r in timeline["ranks"]:
        cover = [dict.fromkeys("FBIW", 0.0) for _ in range(width)]
        for kind, _, _, t0, t1 in r["actions"]:
            first, last = int(t0 / span * width), min(width - 1, int(t1 / span * width))
            for c in range(first, last + 1):
                lo, hi = c * span / width, (c + 1) * span / width
                cover[c][kind] += max(0.0, min(hi, t1) - max(lo, t0))
        row = "".join(max(c, key=c.get) if max(c.values()) > 0.5 * span / width else "." for c in cover)
        lines.append(f"pp{r['pp_rank']:<3}|{row}| idle {r['bubble']:.0%}")
    return "\n".join(lines)


def draw_chart(timeline: dict, path: Path) -> None:
    """Gantt chart, one row per pipeline rank: forward, backward(-input), backward-weight; gaps are idle.
    Each bar is labelled with its micro-batch (and stage, when a rank runs several). matplotlib Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = timeline["ranks"]
    span = timeline["span_s"]
    fig = Figure(figsize=(max(8.0, 0.35 * len(ranks[0]["actions"]) + 4), 1.0 + 0.6 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    several = timeline["virtual_stages"] > 1
    used = set()
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.barh(y, span, left=0, height=0.8, color="#EEEEEE")  # idle unless covered
        for kind, stage, mb, t0, t1 in r["actions"]:
            used.add(kind)
            ax.barh(y, t1 - t0, left=t0, height=0.8, color=COLORS[kind], edgecolor="white", linewidth=0.5)
            label = f"{mb}" + (f"/s{stage}" if several else "")
            ax.text((t0 + t1) / 2, y, label, ha="center", va="center", fontsize=6, color="white", clip_on=True)
        ax.text(span * 1.005, y, f"idle {r['bubble']:.0%}", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"pp rank {r['pp_rank']}" for r in reversed(ranks)])
    ax.set_xlim(0, span * 1.08)
    ax.set_xlabel("seconds since the step's barrier")
    ax.set_title(describe(timeline), fontsize=9)
    handles = [Patch(color=COLORS[k], label=KIND_NAMES[k]) for k in KINDS if k in used]
    handles.append(Patch(color="#EEEEEE", label="idle"))
    # Right of the axes; bbox_inches="tight" grows the image to hold it.
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130, bbox_inches="tight")
