"""The planner against published step times of large training runs (issue 60): 8 to 11,616 GPUs.

Every row of tests/fixtures/published_runs.json (its "note" says how a row is described) is priced with the
planner's own entry points, as `shardwise plan evaluate` does: the row's overrides -> Config -> Problem and
Layout -> check_layout + the pipeline split rules -> plan.cost.evaluate. Nothing is fitted to these rows
(each says fitting_data: false); the error is predicted / published - 1 (negative: the planner predicts a
faster step than published, i.e. it is optimistic). A layout the planner refuses is a finding: it is
printed as REFUSED with the rule, never dropped.

    python benchmarks/plan_published.py [--fixture tests/fixtures/published_runs.json] [--out FILE.json]

Pure Python, about a second on one core (no torch import, no GPU).
"""
from __future__ import annotations

import argparse
import json
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
                           "fitting_data": bool(row.get("fitting_data"))}
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


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean |error| and the worst row, over all priced rows and per GPU-count band."""
    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        errs = [r for r in rows if r["error"] is not None]
        if not errs:
            return {"rows": 0}
        worst = max(errs, key=lambda r: abs(r["error"]))
        return {"rows": len(errs), "mean_abs_error": statistics.fmean(abs(r["error"]) for r in errs),
                "mean_error": statistics.fmean(r["error"] for r in errs),
                "worst_error": worst["error"], "worst_id": worst["id"]}
    return {"all": stats(results), "refused": [r["id"] for r in results if r["refused"]],
            "bands": {name: stats([r for r in results if r["band"] == name]) for name, _ in BANDS}}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table_text(results: list[dict[str, Any]], summ: dict[str, Any]) -> str:
    lines = [f"{'row':<46} {'GPUs':>6} {'published s':>12} {'predicted s':>12} {'error':>8}  fits"]
    for r in results:
        if r["refused"]:
            lines.append(f"{r['id']:<46} {r['gpus']:>6} {r['published_s']:>12.3f} {'REFUSED':>12}   {r['refused']}")
            continue
        lines.append(f"{r['id']:<46} {r['gpus']:>6} {r['published_s']:>12.3f} {r['predicted_s']:>12.3f} "
                     f"{_pct(r['error']):>8}  {'yes' if r['fits'] else 'no'}")
    for name, s in [("all", summ["all"]), *summ["bands"].items()]:
        if s["rows"]:
            lines.append(f"{name:>10}: {s['rows']:>2} rows, mean |error| {100 * s['mean_abs_error']:.1f}% "
                         f"(mean {_pct(s['mean_error'])}), worst {_pct(s['worst_error'])} ({s['worst_id']})")
    if summ["refused"]:
        lines.append(f"refused by the planner: {', '.join(summ['refused'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default=str(FIXTURE))
    parser.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    table = load(Path(args.fixture))
    results = [price(row) for row in table["rows"]]
    summ = summary(results)
    print(table_text(results, summ), end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"fixture": str(args.fixture), "error": table.get("error"), "summary": summ,
                                   "rows": results}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
