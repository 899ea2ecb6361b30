"""Does gradient compression still train? The demo config (configs/demo.toml: tiny llama, BPE, seq 128,
global batch 16) on 2 processes as DDP (dp_replicate=2, zero=0), once per parallel.grad_compression,
plus the uncompressed run with a second seed to measure how far two equally good runs end apart.

    python benchmarks/grad_compression.py [--steps 300] [--out F.json] [--smoke]

Per method: the payload bytes of a steady-state step (metrics.jsonl comm_bytes_per_step, counted by the
trainer on the first step after PowerSGD's warm-up; parallel/grad_compression.py), their ratio to
"none", the planner's bytes for the same config (plan/compression.py closed forms), the final loss
(the mean of the last LAST_N steps' losses, which averages out the batch-to-batch noise of one step)
and its difference to "none".

Tolerance: a method passes when its final loss is within TOLERANCE_SEEDS x |final(none, seed 0) -
final(none, seed 1)| of "none", and at least MIN_TOLERANCE: the seed-to-seed spread is what the loss
of an uncompressed run is known to only up to; compression that moves the loss by a few times that
has not changed what training reaches. The script reports, it does not fail on a miss.
--smoke (tests/dist/test_benchmarks_smoke.py): the tiny preset on the byte tokenizer, 3 steps
(PowerSGD warms up for 2); its numbers are not a measurement.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
LAST_N = 50
TOLERANCE_SEEDS = 3.0
MIN_TOLERANCE = 0.02
DDP = ["--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--parallel.zero=0"]
COMMON = ["--run.progress=false", "--run.tensorboard=false", "--checkpoint.every=0", "--checkpoint.final=false",
          "--checkpoint.resume=false", "--train.log_every=1", "--nproc", "2"]
SMOKE = ["--model.preset=tiny", "--model.vocab_size=512", "--data.tokenizer=byte", "--train.seq_len=32",
         "--train.global_batch=4", "--train.micro_batch=2", "--train.warmup_steps=1"]
METHODS = {
    "none": [],
    "bf16": ["--parallel.grad_compression=bf16"],
    "int8": ["--parallel.grad_compression=int8"],
    "topk": ["--parallel.grad_compression=topk", "--parallel.grad_compression_ratio=0.01"],
    "powersgd": ["--parallel.grad_compression=powersgd", "--parallel.powersgd_rank=4"],
}
# Milder settings of the two lossy methods (not in --smoke): where bytes and loss trade against each other.
VARIANTS = {
    "topk10": ["--parallel.grad_compression=topk", "--parallel.grad_compression_ratio=0.1"],
    "powersgd16": ["--parallel.grad_compression=powersgd", "--parallel.powersgd_rank=16"],
}


def train(args: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--config", str(ROOT / "configs" / "demo.toml"), *args,
           f"--run.dir={run_dir}"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def planned(args: list[str]) -> int:
    """The planner's payload bytes per step for the same config (plan/comm.py predict_comm_bytes)."""
    from shardwise.config import build_config
    from shardwise.plan.comm import predict_comm_bytes

    pairs = [tuple(x[2:].split("=", 1)) for x in args if x.startswith("--") and "=" in x]
    toml = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    cfg = build_config(toml, pairs + [("cluster.num_gpus", "2")])
    return sum(sum(k.values()) for k in predict_comm_bytes(cfg).values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "grad_compression.json")
    parser.add_argument("--smoke", action="store_true")
    a = parser.parse_args()
    steps = 3 if a.smoke else a.steps
    base = DDP + COMMON + [f"--train.steps={steps}"] + (SMOKE + ["--parallel.powersgd_warmup_steps=2"] if a.smoke else [])
    last_n = 1 if a.smoke else min(LAST_N, steps // 4)
    methods = METHODS if a.smoke else {**METHODS, **VARIANTS}
    rows, start = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if a.smoke:
            base.append(f"--data.cache_dir={tmp}/cache")
        runs = {name: train(base + extra, Path(tmp) / name) for name, extra in methods.items()}
        # the seed spread (skipped by --smoke, which measures nothing)
        runs["none_seed1"] = runs["none"] if a.smoke else train(base + ["--train.seed=1"], Path(tmp) / "none_seed1")
    final = {name: statistics.fmean(r["loss"] for r in recs[-last_n:]) for name, recs in runs.items()}
    spread = abs(final["none"] - final["none_seed1"])
    tolerance = max(TOLERANCE_SEEDS * spread, MIN_TOLERANCE)
    bytes_ = {name: sum(v for k, v in recs[-1].items() if k.startswith("comm_") and k.endswith("_bytes"))
              for name, recs in runs.items()}
    for name, extra in methods.items():
        recs = runs[name]
        rows.append({"method": name, "comm_bytes_per_step": bytes_[name], "ratio_to_none": bytes_[name] / bytes_["none"],
                     "planned_bytes_per_step": planned(base + extra), "counted_step": recs[-1].get("comm_counted_step"),
                     "final_loss": final[name], "loss_diff_to_none": final[name] - final["none"],
                     "within_tolerance": abs(final[name] - final["none"]) <= tolerance,
                     "median_step_time_s": statistics.median(r["step_time_s"] for r in recs[1:] or recs)})
    print(f"demo config, DDP on 2 processes, {steps} steps; final loss = mean of the last {last_n} steps; "
          f"tolerance {tolerance:.4f} = max({TOLERANCE_SEEDS:g} x seed spread {spread:.4f}, {MIN_TOLERANCE})")
    print(f"{'method':<9} {'bytes/step':>11} {'ratio':>7} {'planned':>11} {'final loss':>10} {'diff':>8} {'ok':>3} {'step s':>7}")
    for r in rows:
        print(f"{r['method']:<9} {r['comm_bytes_per_step']:>11,} {r['ratio_to_none']:>7.4f} {r['planned_bytes_per_step']:>11,} "
              f"{r['final_loss']:>10.4f} {r['loss_diff_to_none']:>+8.4f} {'yes' if r['within_tolerance'] else 'NO':>3} "
              f"{r['median_step_time_s']:>7.3f}")
    result = {"smoke": a.smoke, "steps": steps, "last_n": last_n, "seed_spread": spread, "tolerance": tolerance,
              "none_seed1_final_loss": final["none_seed1"], "rows": rows, "seconds": time.time() - start,
              "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.platform()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
