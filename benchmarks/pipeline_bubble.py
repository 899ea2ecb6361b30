"""Measured vs theoretical pipeline bubble, per schedule, from real `shardwise train` runs.

Each schedule trains the same model (`small`-width llama cut to 8 blocks, seq 128, fp32) at pp=4 with
8 micro-batches for a few steps; the trainer times every stage action of its logged steps and writes
pipeline_timeline.json + pipeline_chart.png into the run directory. The table shows the last logged
step: measured bubble (idle share of the pipeline's span, all ranks), theoretical (p-1)/(m+p-1)
(interleaved: (p-1)/(v·m+p-1)), the step span, and the mean forward / backward action times.
On a machine with fewer cores than pipeline ranks the ranks also wait for a core, which shows up as
idle time: compare schedules within one run of this script, not with a GPU cluster.

    python benchmarks/pipeline_bubble.py [--pp 4] [--microbatches 8] [--schedules gpipe,1f1b,interleaved_1f1b]
                                         [--out benchmarks/results/pipeline_bubble.json]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1, "zbv": 2, "dualpipev": 2}


def run(schedule: str, pp: int, m: int, steps: int, work: Path) -> dict:
    run_dir = work / schedule
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--nproc", str(pp), "--model.preset=small", "--model.n_layers=8",
           "--model.vocab_size=2048", f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
           f"--parallel.pp_virtual_stages={VIRTUAL[schedule]}", "--train.seq_len=128", f"--train.global_batch={m}",
           "--train.micro_batch=1", f"--train.steps={steps}", f"--train.log_every={steps}", "--run.progress=false",
           "--run.tensorboard=false", "--checkpoint.final=false", f"--run.dir={run_dir}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"{schedule}: shardwise train failed ({out.returncode}):\n{out.stderr[-3000:]}")
    timeline = json.loads((run_dir / "pipeline_timeline.json").read_text())
    times = {k: [t1 - t0 for r in timeline["ranks"] for kind, _, _, t0, t1 in r["actions"] if kind == k] for k in "FBIW"}
    return {"schedule": schedule, "pp": pp, "virtual_stages": timeline["virtual_stages"], "microbatches": m,
            "bubble_measured": timeline["bubble_measured"], "bubble_theoretical": timeline["bubble_theoretical"],
            "span_s": timeline["span_s"], "chart": str(run_dir / "pipeline_chart.png"),
            "mean_action_ms": {k: 1e3 * sum(v) / len(v) for k, v in times.items() if v}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    ap.add_argument("--keep", default=None, help="directory to keep the runs (charts) in; default: a temporary one")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_bubble.json"))
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    if any(s not in VIRTUAL for s in schedules):
        print(f"--schedules: choose from {', '.join(VIRTUAL)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        rows = [run(s, args.pp, args.microbatches, args.steps, work) for s in schedules]
    print(f"pp={args.pp}, m={args.microbatches} micro-batches, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"{'schedule':<18} {'v':>2} {'measured':>9} {'theory':>7} {'span ms':>8}  mean action ms")
    for r in rows:
        theory = f"{r['bubble_theoretical']:.1%}" if r["bubble_theoretical"] is not None else "-"
        actions = " ".join(f"{k} {v:.1f}" for k, v in r["mean_action_ms"].items())
        print(f"{r['schedule']:<18} {r['virtual_stages']:>2} {r['bubble_measured']:>9.1%} {theory:>7} "
              f"{r['span_s'] * 1e3:>8.1f}  {actions}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": dt.datetime.now(dt.timezone.utc).isoformat(), "cores": os.cpu_count(),
                                          "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
