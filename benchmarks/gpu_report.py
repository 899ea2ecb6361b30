"""The report of `make gpu-check` (benchmarks/gpu_check.py; not a script of its own): what a training row's
run directory says it measured (metrics.jsonl, the allocator history's peak split), the rows as a table
(report.md) and as JSON (report.json, format in docs/gpu.md), the planner's error over the training rows,
and the GPU targets of issues 27, 29 and 30, each with what this check measured: the training rows, and the JSON files
the benchmark rows of this check wrote into its folder (throughput.json, decode.json, ...).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memory_peak import UNREADABLE, run_step_split  # this folder

NINE_MINUTES_S = 9 * 60  # issue 27: the whole check on one H100


@dataclass
class Row:
    name: str
    status: str = "skip"  # pass | fail | skip
    reason: str = ""
    seconds: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)  # tokens_per_s, mfu, step_s, peak_gib, j_per_token
    predicted: dict[str, float] = field(default_factory=dict)  # step_s, peak_gib (and their relative errors)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _json(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def _variant(data: dict | None, variant: str, key: str) -> float | None:
    row = next((r for r in (data or {}).get("rows", []) if r.get("variant") == variant), None)
    return row.get(key) if row else None


def _ratio(data: dict | None, variant: str = "shardwise+compile") -> float | None:
    """A shardwise compiled variant over the plain compiled loop, both measured in the same run (gpu_throughput.py)."""
    ours, plain = _variant(data, variant, "tokens_per_s"), _variant(data, "plain+compile", "tokens_per_s")
    return ours / plain if ours and plain else None


def _decode(data: dict | None, key: str) -> float | None:
    row = next((r for r in (data or {}).get("rows", []) if r.get("batch") == 1), None)
    return row.get(key) if row else None


def _worst(rows: list[Row], key: str) -> float | None:
    errors = [abs(r.predicted[key]) for r in rows if isinstance(r.predicted.get(key), float)]
    return max(errors) if errors else None


def _offload_big(rows: list[Row]) -> float | None:
    big = [r for r in rows if r.name.startswith("offload-big/")]
    return float(all(r.status == "pass" for r in big)) if big else None


# ---- a training row's run directory: what it measured ----
def metrics(run: Path, skip: int = 2) -> dict[str, float]:
    """Medians over the logged steps after the first `skip` (compilation, the communication count)."""
    every = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in every if "loss" in r]  # the steps' records (a validation round has one of its own)
    steady = records[skip:] or records
    rounds = [r["eval_time_s"] for r in every if isinstance(r.get("eval_time_s"), (int, float))]

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    peak = max((r.get("mem_max_memory_allocated_bytes") or 0) for r in records)
    seconds = [r.get("step_time_s") or 0.0 for r in records]
    out = {"tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "step_s": median("step_time_s"),
           "peak_gib": peak / 2**30 if peak else None, "j_per_token": median("energy_j_per_token"),
           "final_loss": records[-1]["loss"],
           # where the row's wall time went (report.md's time table): its first steps (compilation) and all
           "warmup_s": sum(seconds[:skip]), "steps_s": sum(seconds),
           # compiled runs: graphs inductor generated code for, and of those loaded from torch's compile cache
           # (gpu_check.py prewarm)
           "inductor_graphs": records[-1].get("inductor_graphs"),
           "inductor_graphs_from_cache": records[-1].get("inductor_graphs_from_cache"),
           # validation: a round's seconds, the first left out where there are more (it compiles the forward)
           "eval_round_s": statistics.median(rounds[1:] or rounds) if rounds else None}
    return {k: v for k, v in out.items() if v is not None}


def process_times(run: Path, started: float, ended: float) -> dict[str, float]:
    """The training command's wall time (`process_s`: from its command line's start to its exit, Unix seconds
    `started` and `ended`), and how much of it came before its first step began (`before_steps_s`: the
    configuration, the device's start, the model's build, the data), from metrics.jsonl's `time` (when each
    logged step ended) less the first step's own time. {} for records without `time`."""
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    if not isinstance(first.get("time"), (int, float)):
        return {}
    return {"process_s": ended - started, "before_steps_s": max(0.0, first["time"] - first["step_time_s"] - started)}


def peak_split(run: Path) -> dict[str, float]:
    """What made up step 2's peak, from the allocator history every training row records (steps 1-2, which
    no timing reads): memory_peak.py's split of it into what was there before the step (parameters,
    optimizer state), gradients alive at it, and activations and transients. {} without a history (a CPU), or
    when it cannot be read (said on stderr: the row's measurement stands without it)."""
    try:
        last = run_step_split(run)
    except UNREADABLE as e:
        print(f"gpu-check: {run / 'memory_snapshot'}: not split ({e})", file=sys.stderr)
        return {}
    return {} if last is None else {"peak_before_step_gib": last["before_step_gib"], "peak_grads_gib":
                                    last["kept_to_optimizer_gib"], "peak_activations_gib": last["freed_before_optimizer_gib"]}


FUSED, FP8 = "shardwise+compile+fused", "shardwise+compile+fp8"
# The files in the check's folder that the targets read, and the benchmark row that writes each: a file is read
# only when its row passed in this check (one left by an earlier check in the same folder is not this check's).
BENCH_FILES = {"throughput.json": "bench/throughput", "fp8.json": "bench/fp8", "fp8_2p4b.json": "bench/fp8-2.4b",
               "decode.json": "bench/decode"}
# (issue, target, bar as text, measured value from (BENCH_FILES parsed, None where absent; rows; header), met by
# the value, value's format)
TARGETS: list[tuple[str, str, str, Callable[[dict, list[Row], dict], float | None], Callable[[float], bool], str]] = [
    ("27", "shardwise compiled / plain compiled loop (886M bf16)", ">= 1.00x",
     lambda f, rows, h: _ratio(f["throughput.json"]), lambda v: v >= 1.0, ".3f"),
    ("27", "shardwise compiled MFU (886M bf16)", ">= 55%",
     lambda f, rows, h: _variant(f["throughput.json"], "shardwise+compile", "mfu"), lambda v: v >= 0.55, ".1%"),
    ("27", "FP8 compiled / bf16 plain compiled loop (886M)", ">= 1.15x",  # bench/throughput's, else bench/fp8's
     lambda f, rows, h: _ratio(f["throughput.json"], FP8) or _ratio(f["fp8.json"]), lambda v: v >= 1.15, ".3f"),
    ("27", "FP8 compiled / bf16 plain compiled loop (2.4B, mb 4; bench/fp8-2.4b, only when named)", ">= 1.15x",
     lambda f, rows, h: _ratio(f["fp8_2p4b.json"]), lambda v: v >= 1.15, ".3f"),
    # Not the default, measured beside it in bf16: what train.fuse_projections makes of the ratio above (in
    # FP8 it was measured slower, 0.946x, on an H200 on 2026-11-28: docs/precision.md; no longer timed here).
    ("27", "the same with train.fuse_projections (q|k|v, w1|w3 joined; bf16)", ">= 1.00x",
     lambda f, rows, h: _ratio(f["throughput.json"], FUSED), lambda v: v >= 1.0, ".3f"),
    ("27", "offload-big: model states larger than the GPU train", "every row passes",
     lambda f, rows, h: _offload_big(rows), lambda v: v == 1.0, ".0f"),
    ("27", "the whole check (no --only), minutes", "<= 9",
     lambda f, rows, h: h["seconds"] / 60 if h.get("seconds") and not h.get("only") else None,
     lambda v: v <= NINE_MINUTES_S / 60, ".1f"),
    ("29", "planner step time, worst absolute error over the training rows", "<= 10%",
     lambda f, rows, h: _worst(rows, "step_s_error"), lambda v: v <= 0.10, ".1%"),
    ("29", "planner peak memory, worst absolute error over the training rows", "<= 10%",
     lambda f, rows, h: _worst(rows, "peak_gib_error"), lambda v: v <= 0.10, ".1%"),
    ("29", "issue 29's open memory rows trained again (fixture/*): planner peak, worst absolute error", "<= 10%",
     lambda f, rows, h: _worst([r for r in rows if r.name.startswith("fixture/")], "peak_gib_error"),
     lambda v: v <= 0.10, ".1%"),
    ("30", "batch-1 compiled decode, fraction of the HBM roofline (886M bf16)", ">= 50%",
     lambda f, rows, h: _decode(f["decode.json"], "compiled_roofline_fraction"), lambda v: v >= 0.5, ".1%"),
    ("30", "batch-1 end to end / transformers' best", ">= 1.5x",
     lambda f, rows, h: _decode(f["decode.json"], "compiled_over_transformers_best"), lambda v: v >= 1.5, ".2f"),
    ("30", "planner decode / measured compiled decode, batch 1", "within 20%",
     lambda f, rows, h: _decode(f["decode.json"], "compiled_decode_ratio"), lambda v: abs(v - 1) <= 0.2, ".3f"),
]


def targets(out: Path, rows: list[Row], header: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value (None: not run in this check) and whether it is met (None where
    not run, or on a CPU, where the check tests itself and measures nothing)."""
    passed = {r.name for r in rows if r.status == "pass"}
    files, found = {name: _json(out, name) if row in passed else None for name, row in BENCH_FILES.items()}, []
    for issue, what, bar, measure, met, spec in TARGETS:
        value = measure(files, rows, header)
        found.append({"issue": issue, "target": what, "bar": bar, "measured": value, "format": spec,
                      "met": None if value is None or header.get("device") != "cuda" else bool(met(value))})
    return found


def report_md(rows: list[Row], header: dict[str, Any], goals: list[dict[str, Any]] | None = None) -> str:
    lines = [f"# shardwise GPU check: {header['device_name']}", "",
             f"{header['when']}, torch {header['torch']}, commit {header['commit']}, {header['steps']} steps per "
             f"training row; planner device: {header['planner_gpu'] or 'none (no table entry)'}", "",
             "| row | result | tokens/s | MFU | step s (plan, err) | peak GiB (plan, err) | J/token | s | reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r.measured, r.predicted
        step = _fmt(m.get("step_s"), ".4f") + (f" ({p['step_s']:.4f}, {p['step_s_error']:+.0%})" if "step_s_error" in p else "")
        peak = _fmt(m.get("peak_gib"), ".2f") + (f" ({p['peak_gib']:.2f}, {p['peak_gib_error']:+.0%})"
                                                 if "peak_gib_error" in p else "")
        lines.append(f"| {r.name} | {r.status.upper()} | {_fmt(m.get('tokens_per_s'), ',.0f')} | "
                     f"{_fmt(m.get('mfu'), '.1%')} | {step} | {peak} | {_fmt(m.get('j_per_token'), '.2e')} | "
                     f"{r.seconds:.0f} | {r.reason.replace('|', '/')} |")
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
    lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"]
    lines += planner_summary(rows) + peak_splits(rows) + time_spent(rows, header)
    if goals:
        lines += ["", "| issue | target | bar | measured | met |", "|---|---|---|---|---|"]
        verdict = {True: "yes", False: "**no**", None: ""}
        lines += [f"| {g['issue']} | {g['target'].replace('|', '/')} | {g['bar']} | "
                  f"{'not run' if g['measured'] is None else format(g['measured'], g['format'])} | {verdict[g['met']]} |"
                  for g in goals]
    return "\n".join(lines) + "\n"


def planner_summary(rows: list[Row]) -> list[str]:
    """The planner's error over every row it predicted: mean and worst |error| of step time and peak memory
    (issue 29's bar is 10% on each)."""
    out = []
    for key, what in (("step_s_error", "step time"), ("peak_gib_error", "peak memory")):
        errors = [(abs(r.predicted[key]), r.name) for r in rows if isinstance(r.predicted.get(key), float)]
        if errors:
            worst, name = max(errors)
            out.append(f"planner {what}: mean |error| {statistics.mean(e for e, _ in errors):.1%}, worst {worst:.1%} "
                       f"({name}) over {len(errors)} rows")
    return [""] + out if out else []


def peak_splits(rows: list[Row]) -> list[str]:
    """Step 2's peak of each training row that recorded its allocator history (memory_peak.py), split: do the
    gradients coexist with the activations, as plan/memory.py's sum assumes?"""
    split = [r for r in rows if "peak_grads_gib" in r.measured]
    if not split:
        return []
    return ["", "| row | step 2 peak GiB | before the step | gradients at the peak | activations, transients |",
            "|---|---|---|---|---|"] + [
        f"| {r.name} | {sum(r.measured[k] for k in ('peak_before_step_gib', 'peak_grads_gib', 'peak_activations_gib')):.2f} | "
        f"{r.measured['peak_before_step_gib']:.2f} | {r.measured['peak_grads_gib']:.2f} | {r.measured['peak_activations_gib']:.2f} |"
        for r in split]


def _time_group(name: str) -> str:
    kind = name.split("/")
    return "/".join(kind[:2]) if kind[0] in ("train", "bench") else kind[0]


def time_spent(rows: list[Row], header: dict[str, Any]) -> list[str]:
    """Where the check's wall time went (issue 27 bounds the whole check at 9 minutes on one H100): seconds by
    kind of row, and for training rows how much of it was before their first step (the configuration, the
    device's start, the model's build, the data: process_times), in their warm-up steps (compilation: steps
    1-2), in the timed steps, in the rest of the training process (between and after the steps: logging, the
    allocator history's file, the process's end), and in the harness (the history's split, the planner). The
    untimed rows, and the compiled rows' commands run ahead to fill torch's compile cache (`prewarmed`), run
    side by side: their seconds add up to more than the pool's wall time (`parallel_seconds`)."""
    if not any(r.seconds for r in rows):
        return []
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(_time_group(r.name), []).append(r)
    lines = ["", "| rows | count | s | before the first step | in warm-up steps (compilation) | in timed steps | "
             "the rest of the process | in the harness |", "|---|---|---|---|---|---|---|---|"]
    for group, members in groups.items():
        trained = [r for r in members if "steps_s" in r.measured]
        total, warm = sum(r.seconds for r in members), sum(r.measured["warmup_s"] for r in trained)
        steps = sum(r.measured["steps_s"] for r in trained)
        split = " |  |  |  | "
        if trained:
            timed = [r for r in trained if "process_s" in r.measured]  # a row's split as its process_times say
            before = sum(r.measured["before_steps_s"] for r in timed)
            process = sum(r.measured["process_s"] for r in timed)
            rest = process - before - sum(r.measured["steps_s"] for r in timed)
            harness = sum(r.seconds - r.measured["process_s"] for r in timed)
            split = (f"{before:.0f} | {warm:.0f} | {steps - warm:.0f} | {rest:.0f} | {harness:.0f}" if len(timed) == len(trained)
                     else f" | {warm:.0f} | {steps - warm:.0f} | {sum(r.seconds for r in trained) - steps:.0f} | ")
        lines.append(f"| {group} | {len(members)} | {total:.0f} | {split} |")
    lines += ran_ahead(rows, header.get("prewarmed") or {})
    phases = [f"{what} {header[key]:.0f} s" for key, what in (("serial_seconds", "measured rows one at a time"),
              ("parallel_seconds", "untimed rows and runs ahead side by side")) if isinstance(header.get(key), (int, float))]
    if isinstance(header.get("seconds"), (int, float)):
        lines.append("")
        lines.append(f"the check took {header['seconds']:.0f} s" + (f": {'; '.join(phases)}" if phases else ""))
    return lines


def ran_ahead(rows: list[Row], prewarmed: dict[str, dict[str, Any]]) -> list[str]:
    """The compiled rows whose commands ran ahead (gpu_check.py prewarm): their seconds, side by side, and how
    many of their timed runs' graphs came from the compile cache they filled."""
    if not prewarmed:
        return []
    timed = [r for r in rows if r.name in prewarmed and "inductor_graphs" in r.measured]
    graphs = sum(r.measured["inductor_graphs"] for r in timed)
    cached = sum(r.measured.get("inductor_graphs_from_cache", 0) for r in timed)
    passed = [d for d in prewarmed.values() if d["status"] == "pass"]
    return ["", f"{len(prewarmed)} compiled rows ran ahead, untimed, side by side with the untimed rows "
            f"({len(passed)} passed, {sum(d.get('seconds', 0) for d in prewarmed.values()):.0f} s of their own): "
            f"their timed runs loaded {cached:.0f} of {graphs:.0f} inductor graphs from torch's compile cache"]


def write_report(out: Path, rows: list[Row], header: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    goals = targets(out, rows, header)
    (out / "report.json").write_text(json.dumps({**header, "rows": [dataclasses.asdict(r) for r in rows],
                                                 "targets": goals}, indent=1))
    (out / "report.md").write_text(report_md(rows, header, goals))


def one_line(p: subprocess.CompletedProcess) -> str:
    """The line a failed command ended with: shardwise's own error line, else the last line of stderr."""
    lines = [ln.strip() for ln in (p.stderr or p.stdout or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error")]
    return (errors[-1] if errors else lines[-1] if lines else f"exit code {p.returncode}")[:300]
