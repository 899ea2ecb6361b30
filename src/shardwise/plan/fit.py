"""`shardwise plan calibrate RUN_DIR... [--runs FILE.json [--section.key=value ...]] [--out calib.json]`: fit the planner to measured runs.

What is fitted: the achieved HBM fraction of eager pointwise kernels (constants.EAGER_POINTWISE_HBM_FRACTION)
from the eager runs, and that of compiled (fused) kernels (plan/compiled.py; built in: the device's streaming
fraction) from the compiled runs; everything else (GEMM and attention fractions,
bandwidths, launch overhead, the byte inventories) stays as its datasheet / microbenchmark / closed form
says. A predicted step is t = a + b / f in that fraction f (the pointwise bytes over f x bandwidth), so
the fit is closed-form weighted least squares of the relative step-time error over the eager runs.

A refit must not hide a structural error, so every run's residual is printed, before and after, with
the memory residual (never fitted) and a leave-one-out column: each run predicted by the constant fitted
to the others. Runs come from training run directories (config.toml + metrics.jsonl: the median step
time of the logged steps after the first, and the CUDA peak allocated bytes when recorded) or from a
table (tests/fixtures/h100_runs.json: base overrides, then per run its overrides and measurements).
The output is read back by `--cluster.calibration=calib.json` (plan/layout.py Cluster.from_config).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.config import Config, build_config, load_toml, parse_overrides
from shardwise.errors import ConfigError
from shardwise.paths import writable_file
from shardwise.plan import constants as C
from shardwise.plan.calibration import PLAN_SCHEMA as SCHEMA
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.plan.memory import GIB
from shardwise.spec.layout import Layout

INVENTORY = ("params", "grads", "optimizer", "activations")


@dataclass
class MeasuredRun:
    name: str
    cfg: Config
    step_time_s: float
    peak_bytes: float | None  # CUDA max_memory_allocated, or the trainer's inventory (`inventory`); None: not recorded
    inventory: bool = False   # peak_bytes is params + grads + optimizer + activations (a CPU run), not the allocator's


def run_from_dir(path: Path) -> MeasuredRun:
    where = f"RUN_DIR {path}"
    if not (path / "config.toml").is_file() or not (path / "metrics.jsonl").is_file():
        raise ConfigError(where, "has no config.toml and metrics.jsonl", "give the run.dir of a `shardwise train` run")
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))][1:]
    if not times:
        raise ConfigError(where, "logged fewer than two steps with a step time", "train longer (train.steps, train.log_every)")
    per_rank = [r.get("memory_per_rank_bytes", {}) for r in records]
    peaks = [max(m.get("max_memory_allocated") or [0]) for m in per_rank]
    # Without CUDA's allocator peak (a CPU run), the trainer's inventory: what the planner lists
    # except its "other" (transient logits, buffers), compared as such (`inventory`).
    inventory = [max(sum(m.get(k, [0])[r] for k in INVENTORY) for r in range(len(m.get("params", [0]))))
                 for m in per_rank if m.get("params")]
    cfg = build_config(load_toml(path / "config.toml"))
    if cfg.train.compile is None:  # unset: what the trainer chose there (on for CUDA, off on a CPU), which
        # its records say: only a compiled run logs compiled_graphs (train/step_log.py)
        compiled = any("compiled_graphs" in r for r in records)
        cfg = replace(cfg, train=replace(cfg.train, compile=compiled))
    if max(peaks, default=0):
        return MeasuredRun(path.name, cfg, statistics.median(times), max(peaks))
    return MeasuredRun(path.name, cfg, statistics.median(times), max(inventory) if inventory else None, inventory=True)


def runs_from_table(path: Path, extra: list[str] | None = None) -> list[MeasuredRun]:
    """A table of measured runs, either {"base": [overrides], "runs": [{"name", "overrides", "step_time_s",
    "peak_gib"}]} (tests/fixtures/h100_runs.json) or the GPU rows format {"rows": [{"variant", "command",
    "overrides" (strings of overrides), "measured": {"step_time_s", "max_memory_allocated_gib"}}]}
    (../shared/gpu/h100-2026-11-25/h100-runs-compiled.json), with the table's own "planner_overrides"
    and then `extra` (e.g. --cluster.gpu=h100-sxm-80gb) added to every run."""
    try:
        table = json.loads(path.read_text())
        common = list(table.get("planner_overrides", [])) + list(extra or [])
        if "rows" in table:
            return [MeasuredRun(r["variant"], build_config(None, parse_overrides(
                        shlex.split(r["command"]) + shlex.split(r["overrides"]) + common)),
                        float(r["measured"]["step_time_s"]),
                        float(r["measured"]["max_memory_allocated_gib"]) * GIB
                        if r["measured"].get("max_memory_allocated_gib") else None) for r in table["rows"]]
        base = list(table["base"])
        return [MeasuredRun(r["name"], build_config(None, parse_overrides(base + list(r["overrides"]) + common)),
                            float(r["step_time_s"]), float(r["peak_gib"]) * GIB if r.get("peak_gib") else None)
                for r in table["runs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("--runs", f"{path}: {e}", 'give {"base": [overrides], "runs": [{"name", "overrides", '
                          '"step_time_s", "peak_gib"}]} or the GPU rows format {"rows": [{"variant", "command", '
                          '"overrides", "measured": {"step_time_s", "max_memory_allocated_gib"}}]}') from None


def predict(run: MeasuredRun, fraction: float | None = None, compiled: float | None = None) -> tuple[float, float, bool]:
    """(step seconds, peak bytes, eager) the planner predicts for a run, with the eager pointwise fraction
    `fraction` and the compiled (fused) kernels' fraction `compiled` (None: the built-in constant or the
    run's own cluster.calibration)."""
    problem = Problem.from_config(run.cfg)
    if fraction is not None:
        problem = replace(problem, cluster=replace(problem.cluster, pointwise_hbm_fraction=fraction))
    if compiled is not None:
        problem = replace(problem, cluster=replace(problem.cluster, compiled_hbm_fraction=compiled))
    est = evaluate(problem, Layout.from_config(run.cfg, problem.cluster.num_gpus))
    # The trainer's inventory has the activations saved in forward, not the block a recomputation
    # rematerialises during backward (the planner's recompute_working_set) nor the transient "other".
    inventory = est.memory.total - est.memory.other - est.memory.detail.get("recompute_working_set", 0.0)
    memory = inventory if run.inventory else est.memory.total
    return est.step_time_s, memory, problem.eager


def _affine(run: MeasuredRun, eager: bool, fixed: float | None) -> tuple[float, float, float]:
    """(a, b, measured t) of the predicted step t = a + b x in x = 1 / fraction of the run's own kind
    (eager or compiled; the other fraction held at `fixed`), from two predictions: the pointwise time is
    its bytes over (fraction x bandwidth); exact where nothing overlaps that time (FSDP's overlap window
    makes it piecewise: the fit then takes the secant)."""
    if eager:
        t1, t2 = predict(run, 1.0)[0], predict(run, 0.5)[0]
    else:
        t1, t2 = predict(run, fixed, 1.0)[0], predict(run, fixed, 0.5)[0]
    return 2 * t1 - t2, t2 - t1, run.step_time_s


def fit_fraction(lines: list[tuple[float, float, float]]) -> float | None:
    """The fraction minimising sum(((a + b x) / t - 1)^2) over the runs' (a, b, t); None without one."""
    num = sum(b * (t - a) / t**2 for a, b, t in lines)
    den = sum(b * b / t**2 for a, b, t in lines)
    if den <= 0 or num <= 0:
        return None
    return min(1.0, max(0.05, den / num))


def calibrate(runs: list[MeasuredRun]) -> dict[str, Any]:
    """Two fractions, each from its own runs: the eager pointwise kernels' (eager runs), then the compiled
    (fused) kernels' (compiled runs, with the eager fraction as fitted: a compiled run's eager leftovers,
    e.g. an eager loss, use it). Leave-one-out refits the run's own kind without it."""
    predicted = [predict(run) for run in runs]
    # Each run's line once: the full fit and every leave-one-out fit reuse them.
    eager_lines = {i: _affine(run, True, None) for i, run in enumerate(runs) if predicted[i][2]}
    fraction = fit_fraction(list(eager_lines.values()))
    # A CPU run directory (its peak is the trainer's inventory) says nothing of a GPU's fused kernels.
    compiled_lines = {i: _affine(run, False, fraction) for i, run in enumerate(runs)
                      if not predicted[i][2] and not run.inventory}
    compiled = fit_fraction(list(compiled_lines.values()))
    rows = []
    for i, run in enumerate(runs):
        before, peak, is_eager = predicted[i]
        after = predict(run, fraction, compiled)[0] if (fraction, compiled) != (None, None) else before
        own = eager_lines if is_eager else compiled_lines
        others = [line for j, line in own.items() if j != i]
        held_out = fit_fraction(others) if others and i in own else None
        loo = None
        if held_out is not None:
            loo = predict(run, held_out)[0] if is_eager else predict(run, fraction, held_out)[0]
        rows.append({"name": run.name, "eager": is_eager, "inventory": run.inventory, "measured_step_s": run.step_time_s,
                     "predicted_step_s": before, "fitted_step_s": after,
                     "leave_one_out_fraction": held_out, "leave_one_out_step_s": loo,
                     "step_error": before / run.step_time_s - 1, "fitted_step_error": after / run.step_time_s - 1,
                     "leave_one_out_error": None if loo is None else loo / run.step_time_s - 1,
                     "measured_peak_gib": None if run.peak_bytes is None else run.peak_bytes / GIB,
                     "predicted_peak_gib": peak / GIB,
                     "memory_error": None if run.peak_bytes is None else peak / run.peak_bytes - 1})
    return {"schema": SCHEMA, "eager_pointwise_hbm_fraction": fraction,
            "built_in_eager_pointwise_hbm_fraction": C.EAGER_POINTWISE_HBM_FRACTION,
            "compiled_pointwise_hbm_fraction": compiled, "runs": rows}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def calibration_text(result: dict[str, Any]) -> str:
    f, fc = result["eager_pointwise_hbm_fraction"], result.get("compiled_pointwise_hbm_fraction")
    lines = [f"eager pointwise HBM fraction: fitted {f:.3f} (built in: {result['built_in_eager_pointwise_hbm_fraction']} of a "
             "datasheet bandwidth, 1.0 of a measured one)" if f is not None else "eager pointwise HBM fraction: no eager run",
             f"compiled (fused) kernels' HBM fraction: fitted {fc:.3f} (built in: the device's streaming fraction, "
             "plan/constants.py HBM_FRACTION_BY_FAMILY)" if fc is not None else "compiled kernels' HBM fraction: no compiled run",
             f"{'run':34} {'measured s':>10} {'built in':>9} {'fitted':>8} {'leave-one-out':>13} {'peak GiB':>9} {'memory':>8}"]
    for r in result["runs"]:
        peak = "-" if r["measured_peak_gib"] is None else f"{r['measured_peak_gib']:.2f}" + ("*" if r["inventory"] else "")
        lines.append(f"{r['name'][:34]:34} {r['measured_step_s']:>10.4f} {_pct(r['step_error']):>9} "
                     f"{_pct(r['fitted_step_error']):>8} {_pct(r['leave_one_out_error']):>13} {peak:>9} {_pct(r['memory_error']):>8}")
    lines.append("errors: predicted / measured - 1; leave-one-out: fitted without that run; memory is never fitted "
                 "(CUDA: the allocator's peak; CPU: the trainer's inventory, * after the GiB)")
    return "\n".join(lines) + "\n"


def calibrate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plan calibrate")
    parser.add_argument("run_dirs", nargs="*", help="run directories of `shardwise train` runs")
    parser.add_argument("--runs", default=None, help="a table of measured runs (JSON: base overrides, per-run overrides)")
    parser.add_argument("--out", default=None, help="write the calibration here (read back by --cluster.calibration=FILE)")
    parser.add_argument("--json", action="store_true")
    args, extra = parser.parse_known_args(argv)
    if any(not a.startswith("--") or "=" not in a for a in extra):
        raise ConfigError("plan calibrate", f"unrecognized arguments: {' '.join(extra)}",
                          "config overrides for every --runs row look like --section.key=value")
    if args.out:
        writable_file(Path(args.out), "--out")
    runs = [run_from_dir(Path(d)) for d in args.run_dirs] + (runs_from_table(Path(args.runs), extra) if args.runs else [])
    if not runs:
        raise ConfigError("RUN_DIR", "no run given", "pass run directories and/or --runs FILE.json")
    result = calibrate(runs)
    print(json.dumps(result, indent=2) if args.json else calibration_text(result), end="\n" if args.json else "")
    if args.out:
        if result["eager_pointwise_hbm_fraction"] is None and result["compiled_pointwise_hbm_fraction"] is None:
            raise ConfigError("--out", "nothing was fitted (no run whose pointwise time a fraction explains)",
                              "include GPU runs, eager (train.compile=false) or compiled")
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}: use it with --cluster.calibration={args.out}")
    return 0
