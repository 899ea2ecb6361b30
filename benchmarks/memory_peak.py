"""What was allocated at a step's peak: a CUDA memory snapshot (run.memory_snapshot) read step by step.

    python benchmarks/memory_peak.py SNAPSHOT.pickle|.json[.gz] [--top K] [--json F]

The snapshot is the caching allocator's history (torch.cuda.memory._record_memory_history: every
allocation and free with its stack) that `shardwise train --run.memory_snapshot=true` writes under
<run.dir>/memory_snapshot/. The steps are cut at the optimizer's zero_grad (its record_function range is in
the snapshot's annotations); for each step this prints its peak of allocated bytes and what made it up:
  before the step        alive when the step began: parameters, optimizer state (from the 2nd step on)
  kept to the optimizer  allocated in the step, alive at its peak, and still alive when its optimizer
                         step begins: the gradients (in a run's first step also the parameters, which
                         `run.memory_snapshot` records from the trainer's start; its optimizer state is
                         allocated by that first optimizer step: step 2 is the steady state)
  freed before it        allocated in the step, alive at its peak, freed before the optimizer step:
                         activations and the transients of the moment (the loss's, a block's backward)
and the K largest sources of the step's own bytes at its peak, by the innermost Python line of their
allocation. It answers what the planner's peak (plan/memory.py) assumes: whether the gradients coexist with
the activations (they do not on one GPU without accumulation: zero_grad sets them to None and a block's
gradients appear as its activations go), and how large the transients at the peak are.

A pickle is read with an unpickler that builds nothing but plain containers, numbers and strings (the
snapshot's own content): any other object in the file stops the read instead of running its code.
Exit 0; 2 when the file is unreadable or holds no allocator history.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import io
import json
import pickle
import sys
from collections import defaultdict
from pathlib import Path

GIB = 2**30
# What reading a history can raise when the file is not one (torn, foreign, or naming code).
UNREADABLE = (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError)


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, strings, numbers: nothing that names a class or a function."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"the file names {module}.{name}: not a memory snapshot (plain data only)")


def load(path: Path) -> dict:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    if data[:1] in (b"{", b"["):
        return json.loads(data)
    return _PlainUnpickler(io.BytesIO(data)).load()


def from_profiler_trace(trace: dict, alive_before: int) -> dict:
    """A torch.profiler Chrome trace recorded with profile_memory=True (a CPU's allocator events: "[memory]"
    instants with Addr, Bytes > 0 allocated, < 0 freed), as a snapshot `analyse` reads: each allocation's
    source is the innermost operator open at it on its thread, the optimizer's step and zero_grad ranges are
    the annotations, and `alive_before` (bytes allocated before the trace began: parameters, optimizer state)
    is the history's unseen part."""
    events = trace.get("traceEvents", [])
    # by start, the outer of two that start together first (an operator and the one it calls at once)
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")),
                 key=lambda e: (e["ts"], -e.get("dur", 0)))
    by_tid: dict = defaultdict(list)
    for e in ops:
        by_tid[e.get("tid")].append(e)
    starts = {tid: [e["ts"] for e in spans] for tid, spans in by_tid.items()}

    def innermost(tid, ts: float) -> str:
        """The shortest operator open at `ts`: the latest-starting one that has not ended (nested ops start later)."""
        spans, last = by_tid.get(tid, []), bisect.bisect_right(starts.get(tid, []), ts) - 1
        for i in range(last, max(-1, last - 500), -1):  # a few hundred back: far past any enclosing operator
            if ts <= spans[i]["ts"] + spans[i].get("dur", 0):
                return spans[i]["name"]
        return "(no operator)"

    trace_out, live = [], 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        size = int(e["args"]["Bytes"])
        action = "alloc" if size > 0 else "free_requested"
        frames = [{"name": innermost(e.get("tid"), e["ts"]), "filename": "operator.py", "line": 0}] if size > 0 else []
        trace_out.append({"action": action, "addr": e["args"]["Addr"], "size": abs(size), "time_us": e["ts"], "frames": frames})
        live += size
    notes = [{"stage": stage, "name": e["name"], "time_us": e["ts"] + (e.get("dur", 0) if stage == "END" else 0)}
             for e in ops if e["name"].startswith(("Optimizer.step#", "Optimizer.zero_grad#")) for stage in ("START", "END")]
    return {"device_traces": [trace_out], "external_annotations": notes,
            "segments": [{"blocks": [{"size": alive_before + max(0, live), "state": "active_allocated"}]}]}


def _source(event: dict, prefer: str = "shardwise") -> str:
    """The innermost Python frame of an allocation in `prefer`'s files, else the innermost Python frame."""
    frames = [f for f in event.get("frames", []) if str(f.get("filename", "")).endswith(".py")]
    mine = [f for f in frames if prefer in str(f["filename"])]
    f = (mine or frames or [None])[0]
    if f is None:
        return "(no Python frame)"
    if f["filename"] == "operator.py":  # from_profiler_trace: the operator, not a line
        return f["name"]
    parts = Path(f["filename"]).parts
    short = "/".join(parts[parts.index(prefer) + 1:]) if prefer in parts else parts[-1]
    return f"{short}:{f['line']} {f['name']}"


def step_bounds(snapshot: dict) -> list[int]:
    """The times (us) at which steps end: each zero_grad's end (Optimizer.zero_grad#... END)."""
    return sorted(a["time_us"] for a in snapshot.get("external_annotations", [])
                  if a.get("stage") == "END" and str(a.get("name", "")).startswith("Optimizer.zero_grad"))


def optimizer_starts(snapshot: dict) -> list[int]:
    return sorted(a["time_us"] for a in snapshot.get("external_annotations", [])
                  if a.get("stage") == "START" and str(a.get("name", "")).startswith("Optimizer.step"))


def analyse(snapshot: dict, top: int = 10) -> dict:
    """Per step: its peak and the split above; bytes allocated before the history began (still alive at its
    end, never seen allocated) count as `before the step` in every step."""
    trace = (snapshot.get("device_traces") or [[]])[0]
    if not trace:
        raise ValueError("the snapshot holds no allocator history (recording was off)")
    ends, opt_starts = step_bounds(snapshot), optimizer_starts(snapshot)
    live_end = sum(b["size"] for s in snapshot.get("segments", []) for b in s.get("blocks", [])
                   if b.get("state") == "active_allocated")
    # Replay: when each allocation was made and freed (free_requested: the bytes stop counting as allocated).
    born, freed, size, first = {}, {}, {}, {}
    live, current = {}, 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = i
            born[i], size[i], first[i] = e["time_us"], e["size"], e
            current += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in live:
            j = live.pop(e["addr"])
            freed[j] = e["time_us"]
            current -= size[j]
    unseen = max(0, live_end - current)  # allocated before the history began (the ring dropped them, or earlier)
    starts = [trace[0]["time_us"] - 1] + ends
    steps = []
    for n, (t0, t1) in enumerate(zip(starts, starts[1:] + [trace[-1]["time_us"] + 1]), start=1):
        if t1 <= t0:
            continue
        opt = next((t for t in opt_starts if t0 < t <= t1), None)
        before = unseen + sum(size[i] for i in born if born[i] <= t0 and freed.get(i, float("inf")) > t0)
        timeline = sorted([(born[i], size[i]) for i in born if t0 < born[i] <= t1]
                          + [(freed[i], -size[i]) for i in freed if t0 < freed[i] <= t1])
        level, peak, at = before, before, t0
        for t, delta in timeline:  # a free and an alloc at the same microsecond: the free first (sorted by delta)
            level += delta
            if level > peak:
                peak, at = level, t
        if peak - before < 0.01 * peak:  # next to nothing of its own (the tail after the last zero_grad)
            continue
        alive = [i for i in born if t0 < born[i] <= at and freed.get(i, float("inf")) > at]
        kept = {i for i in alive if opt is not None and freed.get(i, float("inf")) > opt}
        sources: dict[str, float] = defaultdict(float)
        for i in alive:
            sources[_source(first[i])] += size[i]
        still_before = sum(size[i] for i in born if born[i] <= t0 and freed.get(i, float("inf")) > at) + unseen
        steps.append({"step": n, "peak_gib": peak / GIB, "before_step_gib": still_before / GIB,
                      "kept_to_optimizer_gib": sum(size[i] for i in kept) / GIB,
                      "freed_before_optimizer_gib": sum(size[i] for i in alive if i not in kept) / GIB,
                      "optimizer_step_seen": opt is not None,
                      "top": [(s, b / GIB) for s, b in sorted(sources.items(), key=lambda x: -x[1])[:top]]})
    return {"steps": steps, "unseen_gib": unseen / GIB, "events": len(trace)}


def run_step_split(run_dir: Path, top: int = 0) -> dict | None:
    """The last step that reached its optimizer step in rank 0's newest history under RUN_DIR/memory_snapshot
    (run.memory_snapshot), split as `analyse` does; None without a history or such a step. Raises UNREADABLE
    when the file cannot be read."""
    files = sorted((run_dir / "memory_snapshot").glob("rank_0_step_*.pickle"))
    steps = analyse(load(files[-1]), top)["steps"] if files else []
    return next((s for s in reversed(steps) if s["optimizer_step_seen"]), None)


def report(result: dict) -> str:
    lines = []
    for s in result["steps"]:
        lines.append(f"step {s['step']}: peak {s['peak_gib']:.2f} GiB = before the step {s['before_step_gib']:.2f} "
                     f"+ kept to the optimizer step {s['kept_to_optimizer_gib']:.2f} (gradients) + freed before it "
                     f"{s['freed_before_optimizer_gib']:.2f} (activations, transients)"
                     + ("" if s["optimizer_step_seen"] else "  [no optimizer step in this part of the history]"))
        for source, gib in s["top"]:
            lines.append(f"    {gib:8.3f} GiB  {source}")
    if result["unseen_gib"]:
        lines.append(f"{result['unseen_gib']:.2f} GiB were allocated before the history began (counted before each step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memory_peak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", type=Path)
    p.add_argument("--top", type=int, default=10, help="largest sources of a step's bytes at its peak")
    p.add_argument("--json", type=Path, default=None, help="write the analysis as JSON")
    args = p.parse_args(argv)
    try:
        result = analyse(load(args.snapshot), args.top)
    except UNREADABLE as e:
        print(f"memory_peak.py: {args.snapshot}: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
