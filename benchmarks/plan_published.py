"""The planner against published step times of large training runs (issue 60): 8 to 11,616 GPUs.

Every row of tests/fixtures/published_runs.json (its "note" says how a row is described) is priced with the
planner's own entry points, as `shardwise plan evaluate` does: the row's overrides -> Config -> Problem and
Layout -> check_layout + the pipeline split rules -> plan.cost.evaluate. The error is predicted / published - 1
(negative: the planner predicts a faster step than published, i.e. it is optimistic). A layout the planner
refuses is a finding: it is printed as REFUSED with the rule, never dropped.

Two keys are fitted, each only to the rows whose fitting_data names it (the fixture's "fits" say which key,
why, and the bounds its source allows), by least squares of their relative errors: the Megatron-Core rows'
cluster.block_overhead_us, and the peak of torchtitan's 500 W H100s, cluster.peak_tflops. Those rows are
priced with the fixture's value, and each also with the value fitted to the others (leave-one-out); the
summary counts a fitting row by its leave-one-out error, so every figure it prints is a prediction. Rows on
the same part but not fitted to (predicted_with: the key) are priced with the fixture's value, out of sample.

    python benchmarks/plan_published.py [--fixture tests/fixtures/published_runs.json] [--out FILE.json]

Pure Python, a few seconds on one core (no torch import, no GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "published_runs.json"
# GPU-count bands the summary is split by (inclusive lower bounds).
BANDS = (("8-256", 1), ("512-3,360", 257), ("4,096+", 4096))


def band(gpus: int) -> str:
    return [name for name, low in BANDS if gpus >= low][-1]


def load(path: Path = FIXTURE) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def with_key(row: dict[str, Any], key: str, value: float) -> dict[str, Any]:
    """`row` with --key=value appended to its overrides (the last one wins)."""
    return {**row, "overrides": [*row["overrides"], f"--{key}={value:g}"]}


def _coordinate(form: str, x: float) -> float:
    """Where a key's value sits on the axis a row's step is linear along: the value itself ("linear": a time per
    block and micro-batch), or its reciprocal ("reciprocal": a peak rate, which GEMM time goes as)."""
    return 1.0 / x if form == "reciprocal" else x


def fit(table: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of the fixture's fitted keys over its fitting rows (a row's fitting_data names its key): the value
    minimising the sum of squared relative errors, each row's step taken as linear along the key's coordinate
    (`_coordinate`) through its price at the spec's probe and its price in `results`, at the fixture's value (the
    step is a sum of per-block terms, so the line is exact but where another rank becomes the slowest or a GEMM
    turns memory-bound), kept within the spec's bounds (what the source allows); per row the value fitted to the
    others, and per recipe the value fitted without the recipe's rows."""
    return [_fit_key(spec, [(r, out) for r, out in zip(table["rows"], results) if r.get("fitting_data") == spec["key"]])
            for spec in table.get("fits", [])]


def _fit_key(spec: dict[str, Any], pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    key, form, value, (lo, hi) = spec["key"], spec["form"], float(spec["value"]), spec["bounds"]
    upper = math.inf if hi is None else hi
    if not pairs or not lo <= value <= upper or value == spec["probe"]:
        raise ValueError(f"the fixture's {key}: fitting rows {len(pairs)}, value {value} not a point within "
                         f"{lo}..{hi} other than the probe {spec['probe']}")
    rows = [r for r, _ in pairs]
    at, probe = _coordinate(form, value), _coordinate(form, spec["probe"])
    lines = []  # (published, step at the probe, step per unit of the coordinate)
    for r, out in pairs:
        t_probe = price(with_key(r, key, spec["probe"]))["predicted_s"]
        lines.append((r["step_time_s"], t_probe, (out["predicted_s"] - t_probe) / (at - probe)))
    # the bounds on the coordinate: a reciprocal key's are both finite and > 0 (a peak between two parts')
    low, high = (1.0 / hi, 1.0 / lo) if form == "reciprocal" else (lo, upper)

    def unbounded(points: list[tuple[float, float, float]]) -> float:
        return probe + sum((y - t0) * k / y**2 for y, t0, k in points) / sum(k * k / y**2 for y, _, k in points)

    def value_of(u: float) -> float:
        return 1.0 / u if form == "reciprocal" else u

    def best(points: list[tuple[float, float, float]]) -> float:
        return value_of(min(max(unbounded(points), low), high))
    # A stricter check than one row: each recipe (a row's id less its GPU count: the same run at several
    # scales) fitted without any of its rows.
    recipes = [recipe(r["id"]) for r in rows]
    by_recipe = {}
    for name in dict.fromkeys(recipes):
        without = best([p for p, other in zip(lines, recipes) if other != name])
        by_recipe.update({r["id"]: without for r, other in zip(rows, recipes) if other == name})
    recipe_errors = [(t0 + (_coordinate(form, by_recipe[r["id"]]) - probe) * k) / y - 1
                     for r, (y, t0, k) in zip(rows, lines)]
    return {"key": key, "form": form, "value": best(lines), "bounds": [lo, hi],
            # where the rows alone would put it: a fit at its bound says the source's range binds
            "unbounded_value": value_of(unbounded(lines)),
            "held_out": {r["id"]: best(lines[:i] + lines[i + 1:]) for i, r in enumerate(rows)},
            "recipes": len(set(recipes)), "recipe_held_out": by_recipe,
            "recipe_held_out_mean_abs_error": statistics.fmean(abs(e) for e in recipe_errors),
            "recipe_held_out_worst_error": max(recipe_errors, key=abs)}


def recipe(row_id: str) -> str:
    """A row's recipe: its id less the trailing GPU count (dgxc-gpt3-175b-tp4-pp8-128 -> ...-pp8)."""
    head, _, tail = row_id.rpartition("-")
    return head if tail.isdigit() else row_id


def price(row: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction for one published row: step time, error, MFU, whether it fits and the
    step's terms; `refused` holds the planner's rule when it will not price the layout."""
    from shardwise.config import build_config, parse_overrides
    from shardwise.errors import ConfigError
    from shardwise.plan.command import _trainer_refusal
    from shardwise.plan.cost import evaluate
    from shardwise.plan.layout import Problem, check_layout
    from shardwise.spec.layout import Layout
    from shardwise.spec.rules import pipeline_split_rules

    out: dict[str, Any] = {"id": row["id"], "gpus": row["gpus"], "band": band(row["gpus"]),
                           "published_s": row["step_time_s"], "predicted_s": None, "error": None, "refused": None,
                           "fitting_data": row.get("fitting_data") or False, "predicted_with": row.get("predicted_with")}
    try:
        cfg = build_config(None, parse_overrides(list(row["overrides"])))
        problem = Problem.from_config(cfg)
        layout = Layout.from_config(cfg, problem.cluster.num_gpus)
        violation = check_layout(problem, layout) or next(pipeline_split_rules(cfg.parallel, problem.shape.n_layers), None)
        if violation is not None:
            raise violation.error()
        est = evaluate(problem, layout)
    except ConfigError as e:
        out["refused"] = f"{e.field}: {e.problem}"
        return out
    out.update(predicted_s=est.step_time_s, error=est.step_time_s / row["step_time_s"] - 1, mfu=est.mfu,
               fits=est.fits, memory_gib=round(est.memory.total / 2**30, 1), layout=layout.describe(), stack=est.stack,
               breakdown_s={k: round(v, 4) for k, v in est.breakdown_s.items()},
               trainer_refusal=_trainer_refusal(cfg, problem.cluster.num_gpus))
    return out


def price_all(table: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every row priced; a fitting row also with its key's value fitted to the other rows (`leave_one_out_error`,
    the error the summary counts for it)."""
    results = [price(row) for row in table["rows"]]
    fitted = fit(table, results)
    by_key = {f["key"]: f for f in fitted}
    for row, out in zip(table["rows"], results):
        spec = by_key.get(row.get("fitting_data"))
        if spec and out["error"] is not None:
            held = spec["held_out"][row["id"]]
            step = price(with_key(row, spec["key"], held))["predicted_s"]
            out.update(leave_one_out_value=held, leave_one_out_s=step, leave_one_out_error=step / row["step_time_s"] - 1)
    return results, fitted


def prediction_error(r: dict[str, Any]) -> float | None:
    """A row's error as a prediction: a fitting row's leave-one-out error, any other row's own."""
    return r.get("leave_one_out_error", r["error"])


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean |error| and the worst row, over all priced rows and per GPU-count band (prediction_error)."""
    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        errs = [(r, prediction_error(r)) for r in rows if r["error"] is not None]
        if not errs:
            return {"rows": 0}
        worst, worst_error = max(errs, key=lambda e: abs(e[1]))
        return {"rows": len(errs), "mean_abs_error": statistics.fmean(abs(e) for _, e in errs),
                "mean_error": statistics.fmean(e for _, e in errs),
                "worst_error": worst_error, "worst_id": worst["id"]}
    return {"all": stats(results), "refused": [r["id"] for r in results if r["refused"]],
            "bands": {name: stats([r for r in results if r["band"] == name]) for name, _ in BANDS}}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table_text(results: list[dict[str, Any]], summ: dict[str, Any]) -> str:
    lines = [f"{'row':<46} {'GPUs':>6} {'published s':>12} {'predicted s':>12} {'error':>8} {'left out':>9}  fits"]
    for r in results:
        if r["refused"]:
            lines.append(f"{r['id']:<46} {r['gpus']:>6} {r['published_s']:>12.3f} {'REFUSED':>12}   {r['refused']}")
            continue
        lines.append(f"{r['id']:<46} {r['gpus']:>6} {r['published_s']:>12.3f} {r['predicted_s']:>12.3f} "
                     f"{_pct(r['error']):>8} {_pct(r.get('leave_one_out_error')):>9}  {'yes' if r['fits'] else 'no'}")
    for name, s in [("all", summ["all"]), *summ["bands"].items()]:
        if s["rows"]:
            lines.append(f"{name:>10}: {s['rows']:>2} rows, mean |error| {100 * s['mean_abs_error']:.1f}% "
                         f"(mean {_pct(s['mean_error'])}), worst {_pct(s['worst_error'])} ({s['worst_id']})")
    lines.append("left out: a fitting row priced with the value fitted to the other fitting rows; the summary counts it")
    if summ["refused"]:
        lines.append(f"refused by the planner: {', '.join(summ['refused'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default=str(FIXTURE))
    parser.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    table = load(Path(args.fixture))
    results, fitted = price_all(table)
    summ = summary(results)
    print(table_text(results, summ), end="")
    for spec, f in zip(table.get("fits", []), fitted):
        lo, hi = f["bounds"]
        bounds = f"within {lo:,.1f}-{hi:,.1f}" if hi is not None else f">= {lo:,.0f}"
        free = "" if f["unbounded_value"] == f["value"] else f"; unbounded {f['unbounded_value']:,.1f}"
        print(f"fitted {f['key']} = {f['value']:,.1f} ({bounds}{free}) over {len(f['held_out'])} fitting rows "
              f"(the fixture prices them with {spec['value']:,}; leave-one-out values "
              f"{min(f['held_out'].values()):,.1f}-{max(f['held_out'].values()):,.1f})")
        outside = [r for r in results if r["predicted_with"] == f["key"] and r["error"] is not None]
        if outside:
            worst = max(outside, key=lambda r: abs(r["error"]))
            print(f"  {len(outside)} rows on the same part priced with it, not fitted to it: mean |error| "
                  f"{100 * statistics.fmean(abs(r['error']) for r in outside):.1f}%, worst {_pct(worst['error'])} "
                  f"({worst['id']})")
        if f["recipes"] < len(f["held_out"]):
            print(f"  each of its {f['recipes']} recipes left out whole (the fit of the others): mean |error| "
                  f"{100 * f['recipe_held_out_mean_abs_error']:.1f}%, worst {_pct(f['recipe_held_out_worst_error'])}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"fixture": str(args.fixture), "error": table.get("error"), "summary": summ,
                                   "fit": fitted, "rows": results}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
