"""Where a step's GPU time goes: the kernels of a torch.profiler Chrome trace, by class, per step.

    python benchmarks/kernel_breakdown.py TRACE.json[.gz] [OTHER.json[.gz] ...] [--steps N] [--top K] [--json F]

One trace: a table of milliseconds per step by kernel class, with each class's share of the GPU's busy
time and its kernel count; then the step's wall span on the GPU, the busy time (the union of the kernels'
intervals) and the idle rest (launch-bound time: the host did not keep the GPU fed). Two traces (e.g.
FP8 and bf16 of the same model): the same table for both side by side and the difference, which says
where the faster variant saved its time and what it spent instead; more traces: a column each. --top K lists the K longest kernels
of each class. benchmarks/gpu_throughput.py and decode.py write such traces with --profile DIR
(`record` below), and print this table for them.

Why classes: issue 27 asks what keeps FP8 under its bound (its GEMMs against the casts and scales that
feed them, the head in bf16, ...) and issue 30 what a decode step spends outside its GEMMs; a torch.profiler
key-averages table lists hundreds of kernel names, and the question is their sum by kind. A kernel's class
comes from its name (inductor names its kernels after the ops they fuse: triton_red_fused_abs_amax_3),
the operator that launched it (aten::_scaled_mm, linked by the trace's External id) and, for the loss,
the operator around that one (the chunked cross-entropy's autograd function). Steps: the trace's
`shardwise_steps` metadata (written by `record`), else its ProfilerStep# or optimizer-step annotations.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

CLASSES = ("gemm", "gemm fp8", "attention", "fp8 scale+cast", "norm", "loss", "optimizer", "copy", "pointwise",
           "reduction", "other")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
_GEMM_NAME = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|triton_tem_fused", re.I)
_FP8_NAME = re.compile(r"e4m3|e5m2|fp8", re.I)
_ATTENTION = re.compile(r"fmha|flash|sdpa|attention|cudnn::fusion", re.I)
_LOSS = re.compile(r"crossentropy|cross_entropy|logsumexp|log_softmax|nll_loss", re.I)
_OPTIMIZER = re.compile(r"adam|multi_tensor_apply|_foreach_|Optimizer\.step", re.I)
# Inductor's kernels are named after the ops they fuse; a kernel of only these moves bytes and computes nothing.
_MOVES = {"to", "copy", "t", "view", "unsafe", "transpose", "permute", "clone", "expand", "slice", "cat", "split",
          "squeeze", "unsqueeze", "select", "reshape", "as", "strided", "contiguous", ""}


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _fused_ops(name: str) -> list[str]:
    """The op tokens of an inductor kernel's name (triton_* on a GPU, cpp_* on a CPU): triton_poi_fused__to_copy_t_6
    -> ["", "to", "copy", "t"]; [] for any other kernel."""
    if not name.startswith(("triton_", "cpp_fused")):
        return []
    body = re.sub(r"^(triton_(poi|red|per|tem)|cpp)_fused_?", "", name)
    return [tok for tok in re.sub(r"_\d+$", "", body).split("_") if not tok.isdigit()]


def classify(name: str, op: str, around: str) -> str:
    """The class of a kernel called `name`, launched by the operator `op` ("" unknown) inside the operator
    `around` (the loss's or optimizer's, "" none)."""
    if op == "aten::_scaled_mm" or (_GEMM_NAME.search(name) and _FP8_NAME.search(name)):
        return "gemm fp8"
    if op in GEMM_OPS or _GEMM_NAME.search(name):
        return "gemm"
    if _ATTENTION.search(name) or _ATTENTION.search(op):
        return "attention"
    ops = set(_fused_ops(name))
    if ("abs" in ops and ops & {"max", "amax"}) or ops >= {"clamp", "to", "copy"}:
        # torchao's tensorwise scale (max(abs(x)): float8_utils.tensor_to_amax) and its clamped cast to float8
        # (to_fp8_saturated); a producer inductor fused into the same kernel (a norm, SwiGLU) counts here too.
        return "fp8 scale+cast"
    if _LOSS.search(around) or _LOSS.search(name) or _LOSS.search(op):
        return "loss"
    if _OPTIMIZER.search(around) or _OPTIMIZER.search(name) or _OPTIMIZER.search(op):
        return "optimizer"
    if "rsqrt" in name or "pow_sum" in name or "rms_norm" in name or "rms_norm" in op:
        return "norm"
    if re.search(r"memcpy|memset|copy_kernel", name, re.I) or (ops and ops <= _MOVES):
        return "copy"
    if name.startswith("triton_poi") or "elementwise" in name:
        return "pointwise"
    if name.startswith(("triton_red", "triton_per")) or "reduce_kernel" in name:
        return "reduction"
    return "other"


class _Intervals:
    """Named intervals per thread, for 'which of them encloses time t on thread tid'. `per_thread=False`: one
    pool for all (a GPU range covers kernels of every stream)."""

    def __init__(self, events: list[dict], pattern: re.Pattern, per_thread: bool = True):
        self.per_thread = per_thread
        self.by_tid: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and pattern.search(e.get("name", "")):
                self.by_tid[e.get("tid") if per_thread else None].append((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]))
        for spans in self.by_tid.values():
            spans.sort()

    def around(self, tid: Any, ts: float) -> str:
        spans = self.by_tid.get(tid if self.per_thread else None, [])
        i = bisect.bisect_right(spans, (ts, float("inf"), "")) - 1
        while i >= 0:  # the nearest starts first; an enclosing one may start earlier (nested ops)
            start, end, name = spans[i]
            if start <= ts <= end:
                return name
            if ts - start > 600e6:  # no operator lasts 10 minutes: stop looking
                return ""
            i -= 1
        return ""


def steps_of(trace: dict) -> int:
    """How many steps the trace holds: `record`'s metadata, else ProfilerStep# annotations, else optimizer
    steps on the host, else 1."""
    if trace.get("shardwise_steps"):
        return int(trace["shardwise_steps"])
    events = trace.get("traceEvents", [])
    marks = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op")]
    for pattern in (r"^ProfilerStep#", r"^Optimizer\.step#"):
        n = sum(1 for e in marks if re.search(pattern, e.get("name", "")))
        if n:
            return n
    return 1


def breakdown(trace: dict, steps: int | None = None, top: int = 0, window: str | None = None) -> dict:
    """{"steps", "classes": {class: {"ms", "kernels", "top": [(name, ms)]}}, "busy_ms", "wall_ms", "idle_ms"},
    every time per step. `window`: only the kernels inside the GPU ranges of the torch.profiler
    record_function of that name (infer/engine.py DECODE_MARK: a generation's decode steps, not its prefill)."""
    events = trace.get("traceEvents", [])
    steps = steps or steps_of(trace)
    inside = None
    if window is not None:
        inside = _Intervals([e for e in events if e.get("cat") == "gpu_user_annotation"], re.compile(f"^{re.escape(window)}$"),
                            per_thread=False)
        if not inside.by_tid and any(e.get("cat") == "kernel" for e in events):
            raise ValueError(f"the trace has GPU kernels but no GPU range named {window!r}")
    launcher = {e["args"]["External id"]: e for e in events
                if e.get("cat") in ("cpu_op", "user_annotation") and "External id" in e.get("args", {})}
    loss = _Intervals([e for e in events if e.get("cat") in ("cpu_op", "user_annotation")], _LOSS)
    optimizer = _Intervals([e for e in events if e.get("cat") == "gpu_user_annotation"], re.compile(r"^Optimizer\.step"),
                           per_thread=False)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    spans = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") != "X":
            continue
        if inside is not None and not inside.around(e.get("tid"), e["ts"]):
            continue
        op = launcher.get(e.get("args", {}).get("External id"), {})
        around = loss.around(op.get("tid"), op["ts"]) if op else ""
        around = around or optimizer.around(e.get("tid"), e["ts"])
        kind = classify(e.get("name", ""), op.get("name", ""), around)
        totals[kind] += e["dur"]
        counts[kind] += 1
        names[kind][e["name"]] += e["dur"]
        spans.append((e["ts"], e["ts"] + e["dur"]))
    busy, wall = _union(spans), (max(s[1] for s in spans) - min(s[0] for s in spans)) if spans else 0.0
    if inside is not None:  # the ranges' own time, not the gaps between them
        wall = _union([(start, end) for ranges in inside.by_tid.values() for start, end, _ in ranges])
    per = 1e3 * steps
    classes = {k: {"ms": totals[k] / per, "kernels": counts[k] / steps,
                   "top": [(n, d / per) for n, d in sorted(names[k].items(), key=lambda x: -x[1])[:top]]}
               for k in CLASSES if counts[k]}
    return {"steps": steps, "classes": classes, "busy_ms": busy / per, "wall_ms": wall / per,
            "idle_ms": (wall - busy) / per}


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def table(results: list[dict], labels: list[str]) -> str:
    """The breakdown(s) as text: one column per trace, and the second's difference from the first when there
    are two."""
    two, w = len(results) == 2, max(12, *(len(label) for label in labels)) + 2
    head = "".join(f"{label:>{w}s}" for label in labels) + (f"{'difference':>12s}" if two else "")
    lines = [f"{'ms per step':18s}{head}   (share of busy, kernels per step)"]
    for kind in CLASSES:
        got = [r["classes"].get(kind) for r in results]
        if not any(got):
            continue
        cells = "".join(f"{(g['ms'] if g else 0.0):{w}.2f}" for g in got)
        diff = f"{(got[1]['ms'] if got[1] else 0) - (got[0]['ms'] if got[0] else 0):+12.2f}" if two else ""
        shares = ", ".join(f"{100 * g['ms'] / r['busy_ms']:.1f}% x{g['kernels']:.0f}" if g and r["busy_ms"] else "-"
                           for g, r in zip(got, results))
        lines.append(f"{kind:18s}{cells}{diff}   ({shares})")
        for r, label in zip(results, labels):
            for name, ms in (r["classes"].get(kind) or {}).get("top", []):
                lines.append(f"    {ms:8.3f} ms  {name[:100]}" + (f"  [{label}]" if len(results) > 1 else ""))
    for key, what in (("busy_ms", "GPU busy"), ("idle_ms", "GPU idle"), ("wall_ms", "wall (GPU span)")):
        cells = "".join(f"{r[key]:{w}.2f}" for r in results)
        diff = f"{results[1][key] - results[0][key]:+12.2f}" if two else ""
        lines.append(f"{what:18s}{cells}{diff}")
    lines.append(f"{'steps in trace':18s}" + "".join(f"{r['steps']:{w}d}" for r in results))
    if not any(r["classes"] for r in results):
        lines.append("no GPU kernels in the trace(s): a CPU run records operators only")
    return "\n".join(lines)


def record(step: Callable[[], Any], calls: int, path: Path, sync: Callable[[], None], steps_per_call: int = 1,
           window: str | None = None) -> dict:
    """Call `step` `calls` times under torch.profiler (CPU and, where there is one, CUDA activity), write the
    Chrome trace to `path` (gzip when it ends in .gz) with the step count (calls x steps_per_call) in its
    metadata, and return its breakdown (over `window`'s ranges only, if given; if the trace has none, over
    every kernel, with a "note" that says so). On a CPU the trace holds no kernels: the breakdown is empty."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        prof.add_metadata_json("shardwise_steps", str(calls * steps_per_call))  # while it records, or it is lost
        for _ in range(calls):
            step()
        sync()
    path.parent.mkdir(parents=True, exist_ok=True)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    prof.export_chrome_trace(str(plain))
    if path.suffix == ".gz":
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        plain.unlink()
    return summarize(path, window)


def summarize(path: Path, window: str | None = None) -> dict:
    """The breakdown of the trace at `path` over `window`'s GPU ranges; over every kernel, with a "note"
    that says so, when the trace has none of that name (how a profiler projects ranges onto CUDA graph
    replays may vary, and a benchmark must not lose its row to its profile)."""
    trace = load(path)
    try:
        return breakdown(trace, window=window)
    except ValueError as e:
        return {**breakdown(trace), "note": f"{e}: every kernel of the trace is counted"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kernel_breakdown.py", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz): one, two to compare, or more")
    p.add_argument("--steps", type=int, default=None, help="steps in each trace (default: read from the trace)")
    p.add_argument("--top", type=int, default=0, help="also list the K longest kernels of each class")
    p.add_argument("--json", type=Path, default=None, help="write the breakdown(s) as JSON")
    p.add_argument("--window", default=None, help="only the kernels inside the GPU ranges of this record_function "
                   "name (e.g. shardwise.decode)")
    args = p.parse_args(argv)
    for path in args.traces:
        if not path.is_file():
            p.error(f"{path}: no such file")
    try:
        results = [breakdown(load(path), args.steps, args.top, args.window) for path in args.traces]
    except (OSError, ValueError, KeyError) as e:
        print(f"kernel_breakdown.py: cannot read the trace: {e}", file=sys.stderr)
        return 2
    labels = [path.name.removesuffix(".gz").removesuffix(".json") for path in args.traces]
    print(table(results, labels))
    if args.json:
        args.json.write_text(json.dumps(dict(zip(labels, results)), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
