"""Measured vs theoretical pipeline bubble, per schedule, from real `shardwise train` runs.

Each schedule trains the same model (`small`-width llama cut to 8 blocks, seq 128, fp32) at pp=4 with
8 micro-batches for a few steps; the trainer times every stage action of its logged steps and writes
pipeline_timeline.json + pipeline_chart.png into the run directory. The table shows the last logged
step: measured bubble (idle share of the pipeline's span, all ranks); order, the idle the schedule's
own action order costs at the measured action times (the actions replayed with no time for the sends:
the rest of the measured bubble is waiting on sends and slower ranks); theoretical (that order with
equal stages and a backward twice the forward, spec/stages.py bubble_fraction: 1F1B (p-1)/(m+p-1)); the
step span, and the mean forward / backward action times.
On a machine with fewer cores than pipeline ranks the ranks also wait for a core, which shows up as
idle time: compare schedules within one run of this script, not with a GPU cluster.

    python benchmarks/pipeline_bubble.py [--pp 4] [--microbatches 8] [--schedules gpipe,1f1b,interleaved_1f1b]
                                         [--out benchmarks/results/pipeline_bubble.json] [--smoke]

--smoke checks that the script still runs end to end (tests/dist/test_benchmarks_smoke.py): one 1f1b run
at pp=2 with 2 micro-batches for 1 step, on the `tiny` preset with the byte tokenizer (no BPE training,
caches in the temporary work directory), written to benchmarks/results/pipeline_bubble.smoke.json unless
--out is given. Its bubble is not a measurement.
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
# The model and data of the measurement: `small`-width llama cut to 8 blocks (so pp=4 x v=2 has a block
# per stage), seq 128; the corpus and tokenizer are the config's defaults.
MODEL = ["--model.preset=small", "--model.n_layers=8", "--model.vocab_size=2048", "--train.seq_len=128"]
# --smoke: the smallest run that still writes a pipeline timeline: 2 stages of the 2-block `tiny` preset, and
# the byte tokenizer with its caches under the work directory, so that a cold machine trains no BPE tokenizer
# and nothing is written to the user's cache.
SMOKE_MODEL = ["--model.preset=tiny", "--train.seq_len=32", "--data.tokenizer=byte"]
SMOKE = {"pp": 2, "microbatches": 2, "steps": 1, "schedules": "1f1b",
         "out": str(ROOT / "benchmarks/results/pipeline_bubble.smoke.json")}


def run(schedule: str, pp: int, m: int, steps: int, work: Path, model: list[str]) -> dict:
    run_dir = work / schedule
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--nproc", str(pp), *model,
           f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
           f"--parallel.pp_virtual_stages={VIRTUAL[schedule]}", f"--train.global_batch={m}",
           "--train.micro_batch=1", f"--train.steps={steps}", f"--train.log_every={steps}", "--run.progress=false",
           "--run.tensorboard=false", "--checkpoint.final=false", f"--run.dir={run_dir}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"{schedule}: shardwise train failed ({out.returncode}):\n{out.stderr[-3000:]}")
    timeline = json.loads((run_dir / "pipeline_timeline.json").read_text())
    times = {k: [t1 - t0 for r in timeline["ranks"] for kind, _, _, t0, t1 in r["actions"] if kind == k] for k in "FBIW"}
    return {"schedule": schedule, "pp": pp, "virtual_stages": timeline["virtual_stages"], "microbatches": m,
            "bubble_measured": timeline["bubble_measured"], "bubble_order": timeline["bubble_order"],
            "bubble_theoretical": timeline["bubble_theoretical"],
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
    ap.add_argument("--smoke", action="store_true",
                    help="does the script still run? one tiny 1f1b run of 1 step at pp=2 (not a measurement)")
    args = ap.parse_args()
    if args.smoke:  # smoke sizes replace the defaults only: options given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    schedules = args.schedules.split(",")
    if any(s not in VIRTUAL for s in schedules):
        print(f"--schedules: choose from {', '.join(VIRTUAL)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        model = SMOKE_MODEL + [f"--data.cache_dir={work / 'cache'}"] if args.smoke else MODEL
        rows = [run(s, args.pp, args.microbatches, args.steps, work, model) for s in schedules]
    print(f"pp={args.pp}, m={args.microbatches} micro-batches, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"{'schedule':<18} {'v':>2} {'measured':>9} {'order':>7} {'theory':>7} {'span ms':>8}  mean action ms")
    for r in rows:
        order = f"{r['bubble_order']:.1%}" if r["bubble_order"] is not None else "-"  # None: a step not replayable
        actions = " ".join(f"{k} {v:.1f}" for k, v in r["mean_action_ms"].items())
        print(f"{r['schedule']:<18} {r['virtual_stages']:>2} {r['bubble_measured']:>9.1%} {order:>7} {r['bubble_theoretical']:>7.1%} "
              f"{r['span_s'] * 1e3:>8.1f}  {actions}")
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(), "cores": os.cpu_count(), "rows": rows}
    if args.smoke:
        result["smoke"] = True  # so that nobody reads a smoke run's bubble as a measurement
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
