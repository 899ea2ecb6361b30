"""The planner's step time and memory against real CPU runs, with leave-one-out calibration.

1. `benchmarks/kernels.py` measures this machine (GEMM rate, copy bandwidth, SDPA, per-op overhead,
   AdamW bytes): the planner's `cluster.gpu = "cpu"` takes every rate from it (plan/calibration.py
   MeasuredDevice), nothing from a datasheet.
2. A few single-process fp32 runs of different shapes, batches and recomputation train for some steps
   (`shardwise train`, eager as the CPU default), logging every step.
3. `shardwise plan calibrate` on those run directories prints, per run, the planner's step-time error
   with the measured rates alone, after fitting the one time constant (the eager pointwise fraction of
   the measured copy bandwidth) to all runs, and leave-one-out (fitted to the others); and the memory
   error of the trainer's inventory (parameters, gradients, optimizer state, activations; never fitted).
   The issue's bar: 10% step time and 5% memory, leave-one-out.

    python benchmarks/plan_accuracy.py [--steps 8] [--out benchmarks/results/plan_accuracy.json] [--smoke]

Runs take a few minutes on 2 cores; CPU timings are noisy on a shared machine (the median logged step is
used; compare within one run of this script). --smoke: two tiny runs of 3 steps and kernels.py --smoke
(its rates are not measurements).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--data.tokenizer=byte", "--model.vocab_size=2048", "--run.progress=false", "--run.tensorboard=false",
          "--checkpoint.final=false", "--train.log_every=1", "--cluster.gpu=cpu", "--cluster.num_gpus=1"]
RUNS = {
    "small mb4 s128": ["--model.preset=small", "--train.seq_len=128", "--train.micro_batch=4", "--train.global_batch=4"],
    "small mb8 s128": ["--model.preset=small", "--train.seq_len=128", "--train.micro_batch=8", "--train.global_batch=8"],
    "small mb4 s256 full recompute": ["--model.preset=small", "--train.seq_len=256", "--train.micro_batch=4",
                                      "--train.global_batch=4", "--train.recompute=full"],
    "small mb4 s128 selective": ["--model.preset=small", "--train.seq_len=128", "--train.micro_batch=4",
                                 "--train.global_batch=4", "--train.recompute=selective"],
    "small mb2 x 2 s128": ["--model.preset=small", "--train.seq_len=128", "--train.micro_batch=2", "--train.global_batch=4"],
    "wide d512 mb4 s128": ["--model.preset=small", "--model.dim=512", "--model.n_heads=8", "--model.n_kv_heads=4",
                           "--model.ffn_dim=1408", "--train.seq_len=128", "--train.micro_batch=4", "--train.global_batch=4"],
}
SMOKE_RUNS = {"tiny a": ["--model.preset=tiny", "--train.seq_len=32", "--train.micro_batch=2", "--train.global_batch=2"],
              "tiny b": ["--model.preset=tiny", "--train.seq_len=64", "--train.micro_batch=2", "--train.global_batch=2"]}


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/plan_accuracy.json (.smoke.json with --smoke)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    runs, steps = (SMOKE_RUNS, 3) if args.smoke else (RUNS, args.steps)
    out = Path(args.out or ROOT / f"benchmarks/results/plan_accuracy{'.smoke' if args.smoke else ''}.json")
    with tempfile.TemporaryDirectory(prefix="shardwise-plan-accuracy-") as tmp:
        work = Path(tmp)
        kernels = work / "kernels.json"
        _run([sys.executable, str(ROOT / "benchmarks/kernels.py"), "--device", "cpu", "--out", str(kernels)]
             + (["--smoke"] if args.smoke else []))
        dirs = []
        for name, overrides in runs.items():
            run_dir = work / name.replace(" ", "_")
            print(f"training {name} ({steps} steps)", flush=True)
            _run([sys.executable, "-m", "shardwise.cli", "train", *COMMON, *overrides, f"--train.steps={steps}",
                  f"--run.dir={run_dir}", f"--cluster.calibration={kernels}", f"--data.cache_dir={work / 'cache'}"])
            dirs.append(str(run_dir))
        table = _run([sys.executable, "-m", "shardwise.cli", "plan", "calibrate", *dirs])
        result = json.loads(_run([sys.executable, "-m", "shardwise.cli", "plan", "calibrate", *dirs, "--json"]))
        measured = json.loads(kernels.read_text())
    print(table, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"smoke": args.smoke, "steps": steps, "runs": {k: v for k, v in runs.items()},
                               "kernels": {k: measured[k] for k in ("machine", "cpu", "torch", "threads", "date")
                                           if k in measured},
                               "calibration": result}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
