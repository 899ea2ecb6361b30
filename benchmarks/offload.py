"""One device, a model larger than its memory: peak memory and step time of none / cpu / nvme / tiles.

Each mode trains the same model for a few steps in its own `shardwise train` process (one process, so
FSDP2 runs over a 1-rank mesh for the offload tiers); the process's peak resident set (ru_maxrss, from
wait4) and the median step time (metrics.jsonl, first step excluded) are measured, and printed as
ratios to the "none" run of the same invocation (this machine is shared and noisy). The planner's
prediction of the same runs (`shardwise plan evaluate --cluster.gpu=cpu --json`, plan/memory.py) is
printed beside: on a CPU the device *is* host memory, so the predicted resident bytes are device +
host bytes and the disk bytes are what "nvme" moves out of memory.

    python benchmarks/offload.py [--steps 6] [--out F.json] [--smoke]

  none   zero=0, the plain single-process trainer (foreach AdamW)
  cpu    zero=3, offload="cpu": FSDP2 CPUOffloadPolicy on one rank, fused CPU AdamW
  nvme   zero=3, offload="nvme": as cpu, the AdamW moments in a file under a temporary directory
  tiles  zero=0, linear_tiles=4: every MLP computed in 4 tiles (parallel/tiling.py)

On a CPU-only machine "cpu" cannot lower the resident set (the host memory it moves states to is
the memory the run already uses); it is here for its step time and as the base of "nvme", which must
lower it by about the optimizer state (8 bytes per parameter) minus its two I/O buffers.
--smoke (tests/dist/test_benchmarks_smoke.py): the tiny preset, two steps; its numbers are not a measurement.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# 98M parameters (fp32 states 1.57 GB, AdamW moments 785 MB) and a long enough micro-batch that the
# MLP's saved activations (4 hidden-size tensors per block, ~400 MB) are visible next to them.
MODEL = ["--model.dim=768", "--model.n_layers=12", "--model.n_heads=12", "--model.n_kv_heads=4", "--model.ffn_dim=2048",
         "--model.vocab_size=8192", "--model.max_seq_len=512", "--train.seq_len=512", "--train.global_batch=2",
         "--train.micro_batch=2"]
SMOKE_MODEL = ["--model.preset=tiny", "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=2",
               "--train.micro_batch=2"]
COMMON = ["--data.tokenizer=byte", "--run.progress=false", "--run.tensorboard=false", "--checkpoint.final=false",
          "--checkpoint.resume=false", "--train.log_every=1", "--train.warmup_steps=1"]


def modes(nvme_dir: str) -> dict[str, list[str]]:
    return {"none": ["--parallel.zero=0"],
            "cpu": ["--parallel.zero=3", "--parallel.offload=cpu"],
            "nvme": ["--parallel.zero=3", "--parallel.offload=nvme", f"--parallel.offload_dir={nvme_dir}"],
            "tiles": ["--parallel.zero=0", "--parallel.linear_tiles=4"]}


def train(args: list[str], run_dir: Path) -> dict:
    """One `shardwise train` process: its peak RSS (wait4's ru_maxrss, KiB on Linux) and step times."""
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *args, f"--run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:] or [rows[-1]["step_time_s"]]
    io = next((line for line in out.splitlines() if line.startswith("nvme offload:")), None)
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "step_time_s": statistics.median(times),
            "loss": rows[-1]["loss"], "nvme_io": io}


def runtime_floor() -> int:
    """Peak RSS of a process that imports the trainer and touches torch's CPU kernels but holds no model:
    the interpreter, torch's libraries and allocator arenas the planner does not count."""
    code = "import torch, shardwise.train.trainer; (torch.randn(256, 256) @ torch.randn(256, 256)).sum().item()"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024


def measure_kernels(out: Path, smoke: bool) -> Path:
    """This CPU's rates for the planner (benchmarks/kernels.py): a CPU has no datasheet."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--device", "cpu", "--no-compile", "--out", str(out)]
    subprocess.run(cmd + (["--smoke"] if smoke else []), cwd=ROOT, check=True, capture_output=True)
    return out


def predict(args: list[str], kernels: Path) -> dict | None:
    """`shardwise plan evaluate --cluster.gpu=cpu --json` for the same config: bytes per place."""
    cmd = [sys.executable, "-m", "shardwise.cli", "plan", "evaluate", *args, "--cluster.gpu=cpu", "--cluster.num_gpus=1",
           f"--cluster.calibration={kernels}", "--json"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"planner: {' '.join(cmd[3:])} exited {run.returncode}: {run.stderr.strip()[-500:]}")
        return None
    return json.loads(run.stdout)


def predicted_bytes(estimate: dict | None) -> dict:
    """Device + host bytes (the resident set on a CPU, with the runtime floor added by the caller) and
    disk bytes from the planner's JSON."""
    if estimate is None:
        return {}
    gib = 2**30
    device = estimate["memory_gib"]["total"] * gib
    host = estimate.get("cpu_offload_gib", 0.0) * gib
    disk = estimate.get("nvme_gib", 0.0) * gib
    return {"predicted_resident_bytes": device + host, "predicted_disk_bytes": disk}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "offload.json")
    parser.add_argument("--smoke", action="store_true")
    a = parser.parse_args()
    steps = 2 if a.smoke else a.steps
    model = SMOKE_MODEL if a.smoke else MODEL
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwise-offload-bench-") as tmp:
        nvme_dir = Path(tmp) / "nvme"
        nvme_dir.mkdir()
        kernels = measure_kernels(Path(tmp) / "kernels.json", a.smoke)
        floor = runtime_floor()
        print(f"runtime floor (torch + shardwise imported, no model): {floor / 2**20:.0f} MiB peak RSS")
        for name, extra in modes(str(nvme_dir)).items():
            args = [*model, *COMMON, f"--train.steps={steps}", *extra]
            start = time.perf_counter()
            measured = train(args, Path(tmp) / name)
            row = {"mode": name, **measured, "wall_s": time.perf_counter() - start, **predicted_bytes(predict(args, kernels))}
            if "predicted_resident_bytes" in row:
                row["predicted_resident_bytes"] += floor
            rows.append(row)
            print(f"{name:6s} peak RSS {row['peak_rss_bytes'] / 2**20:8.0f} MiB  step {row['step_time_s']:.3f} s  "
                  f"loss {row['loss']:.4f}" + (f"  [{row['nvme_io']}]" if row["nvme_io"] else ""), flush=True)
    base = rows[0]
    print("\nmode    peak RSS MiB  vs none   step s  vs none   predicted MiB  pred/meas   saved vs none: measured / "
          "predicted MiB   disk MiB")
    for r in rows:
        r["rss_ratio"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        r["step_ratio"] = r["step_time_s"] / base["step_time_s"]
        r["rss_saved_bytes"] = base["peak_rss_bytes"] - r["peak_rss_bytes"]
        pred = r.get("predicted_resident_bytes")
        if pred is not None and base.get("predicted_resident_bytes") is not None:
            r["predicted_saved_bytes"] = base["predicted_resident_bytes"] - pred
            r["predicted_over_measured"] = pred / r["peak_rss_bytes"]
        pred_text = f"{pred / 2**20:13.0f} {r['predicted_over_measured']:10.3f}" if pred is not None else f"{'n/a':>24s}"
        saved = f"{r['rss_saved_bytes'] / 2**20:+8.0f} / {r.get('predicted_saved_bytes', 0) / 2**20:+8.0f}"
        print(f"{r['mode']:6s} {r['peak_rss_bytes'] / 2**20:12.0f} {r['rss_ratio']:8.3f} {r['step_time_s']:8.3f} "
              f"{r['step_ratio']:8.3f} {pred_text}   {saved:>30s}   {r.get('predicted_disk_bytes', 0) / 2**20:8.0f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "offload", "smoke": a.smoke, "steps": steps, "model": model,
                                 "runtime_floor_bytes": floor,
                                 "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                 "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                                 "rows": rows}, indent=2))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
