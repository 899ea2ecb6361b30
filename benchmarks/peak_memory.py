"""The planner's peak memory against the real peak of a training step on this CPU, and what made it up.

For each run, one process trains a few steps, then one more under torch.profiler with profile_memory=True:
the CPU allocator reports every allocation and free of that step, so its peak is exact, and
benchmarks/memory_peak.py splits it (from_profiler_trace) into what was there before the step (parameters,
optimizer state), the gradients alive at the peak and the activations and transients, with the operators
that allocated the most. Beside it, the planner's peak (plan/memory.py: parameters + gradients + optimizer
+ activations + other, the sum the planner holds to a GPU's max_memory_allocated, less NCCL's buffers, which
gloo does not have) and the same without the
gradients. It measures the question the GPU histories of 2026-11-25 raised (memory_peak.py: every eager
peak is at the loss's backward, before any block's gradient exists): does the planner count gradients
that are not there yet?

    python benchmarks/peak_memory.py [--runs NAME,...] [--out benchmarks/results/peak_memory.json] [--smoke]

The runs: one process (eager, recompute, bf16, micro-batches, chunked loss, compiled), and two processes on
loopback (ZeRO-1/2/3 and DDP over dp2, TP over tp2: the most loaded rank).

The planner is given the CPU's attention kernel (flash) and the run's eager / compiled choice, as
tests/dist/test_plan_validation.py does. A few minutes on 2 cores (the compiled run compiles with inductor);
--smoke: one tiny run. Exit 0 whatever the errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a checkout runs as it is
from memory_peak import analyse, from_profiler_trace  # noqa: E402  (this folder)
from overhead import write_corpus  # noqa: E402  (the same fixed stdlib corpus)

MIB = 2**20
BASE = [("model.preset", "tiny"), ("model.dim", "256"), ("model.n_layers", "4"), ("model.n_heads", "4"),
        ("model.n_kv_heads", "2"), ("model.ffn_dim", "768"), ("model.vocab_size", "4096"), ("model.max_seq_len", "256"),
        ("train.seq_len", "256"), ("train.micro_batch", "8"), ("train.global_batch", "8"), ("train.precision", "fp32"),
        ("train.compile", "false")]
RUNS = {
    "eager fp32": [],
    "eager fp32 recompute=full": [("train.recompute", "full")],
    "eager fp32 recompute=selective": [("train.recompute", "selective")],
    "eager bf16": [("train.precision", "bf16")],
    "eager fp32 2 micro-batches": [("train.micro_batch", "4")],
    # 2048 tokens x 40960 fp32 logits = 320 MiB, over LOSS_CHUNK_BYTES: the chunked cross-entropy (spec/loss.py)
    "eager fp32 chunked loss": [("model.vocab_size", "40960")],
    "compiled fp32 (inductor)": [("train.compile", "true")],
}
# Two processes on loopback (gloo): data and tensor parallelism's own transients (FSDP's gathered blocks and
# reduce-scatter inputs, DDP's buckets, TP's gathered activations). Global batch 8 (tp2: 4): one micro-batch of
# 4 sequences per rank.
LAYOUTS = {
    "zero3 dp2": [("parallel.dp_shard", "2"), ("parallel.zero", "3"), ("train.micro_batch", "4")],
    "zero2 dp2": [("parallel.dp_shard", "2"), ("parallel.zero", "2"), ("train.micro_batch", "4")],
    "zero1 dp2": [("parallel.dp_shard", "2"), ("parallel.zero", "1"), ("train.micro_batch", "4")],
    "ddp dp2": [("parallel.dp_replicate", "2"), ("train.micro_batch", "4")],
    "tp2": [("parallel.tp", "2"), ("train.micro_batch", "4"), ("train.global_batch", "4")],
}
SMOKE = {"tiny": [("model.dim", "64"), ("model.n_layers", "2"), ("model.ffn_dim", "192"), ("model.vocab_size", "512"),
                  ("train.seq_len", "32"), ("train.micro_batch", "2"), ("train.global_batch", "2")]}


def measure(overrides: list[tuple[str, str]], tmp: Path, world: int = 1, rank: int = 0) -> dict:
    """Train 3 steps, profile the 4th: its split peak, and the planner's peak for the same config (on
    rank `rank` of a `world`-process gloo group the caller has set up)."""
    from shardwise.config import build_config
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import memory
    from shardwise.spec.layout import Layout
    from shardwise.train.trainer import Trainer

    cfg = build_config({}, BASE + overrides + [("data.path", str(tmp / "corpus.txt")), ("data.tokenizer", "byte"),
                                               ("data.cache_dir", str(tmp / "cache")), ("train.steps", "10"),
                                               ("cluster.num_gpus", str(world)), ("cluster.gpus_per_node", str(world))])
    cfg.run.dir, cfg.run.progress, cfg.run.tensorboard = str(tmp / "run"), False, False
    cfg.checkpoint.final = cfg.checkpoint.resume = False
    trainer = Trainer(cfg, log=None, single_process=world == 1)
    for _ in range(3):
        trainer.train_step()
    held = trainer.memory()  # this rank's local shards (whatever wraps the optimizer: ZeRO-1 shards its state)
    before = held["params"] + held["buffers"] + held["optimizer"]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step()
    trace_path = tmp / f"trace_{rank}.json"
    prof.export_chrome_trace(str(trace_path))
    step = analyse(from_profiler_trace(json.loads(trace_path.read_text()), before), top=4)["steps"][0]
    problem = dataclasses.replace(Problem.from_config(cfg), attention="flash", eager=not trainer.compiled)
    plan = memory(problem, Layout.from_config(cfg, world))
    # NCCL's communication buffers (plan/constants.py COMM_BUFFER_BYTES_PER_AXIS): gloo has none on a CPU.
    total = plan.total - plan.detail.get("comm_buffers", 0.0)
    peak = step["peak_gib"] * 2**30
    return {"peak_mib": peak / MIB, "before_mib": step["before_step_gib"] * 1024,
            "grads_at_peak_mib": step["kept_to_optimizer_gib"] * 1024,
            "activations_at_peak_mib": step["freed_before_optimizer_gib"] * 1024,
            "top": [(source, gib * 1024) for source, gib in step["top"]],
            "planner_mib": total / MIB, "planner_error": (total - peak) / peak,
            "planner_grads_mib": plan.grads / MIB, "planner_without_grads_error": (total - plan.grads - peak) / peak,
            "planner_activations_mib": plan.activations / MIB, "planner_other_mib": plan.other / MIB}


def _rank(rank: int, world: int, port: int, overrides: list[tuple[str, str]], tmp: Path) -> None:
    """One process of a loopback gloo group: measure, write rank_<r>.json."""
    import os

    import torch.distributed as dist

    from shardwise.train.network import pin_gloo_interface

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    pin_gloo_interface(os.environ)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        (tmp / f"rank_{rank}.json").write_text(json.dumps(measure(overrides, tmp, world, rank)))
    finally:
        dist.destroy_process_group()


def measure_world(overrides: list[tuple[str, str]], tmp: Path, world: int) -> list[dict]:
    """`measure` on every rank of `world` processes (loopback gloo); one result per rank."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, overrides, tmp), nprocs=world)
    return [json.loads((tmp / f"rank_{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=None, help=f"comma-separated names (default: all): {', '.join(RUNS)}")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/peak_memory.json (.smoke.json)")
    p.add_argument("--smoke", action="store_true", help="one tiny run: does the script still run? (not a measurement)")
    args = p.parse_args(argv)
    runs = SMOKE if args.smoke else {**RUNS, **LAYOUTS}
    if args.runs:
        chosen = [r.strip() for r in args.runs.split(",") if r.strip()]
        unknown = [r for r in chosen if r not in runs]
        if unknown:
            p.error(f"--runs: unknown {unknown}; choose from {', '.join(runs)}")
        runs = {name: runs[name] for name in chosen}
    rows = []
    for name, overrides in runs.items():
        with tempfile.TemporaryDirectory(prefix="shardwise-peak-memory-") as tmp_name:
            tmp = Path(tmp_name)
            write_corpus(tmp / "corpus.txt")
            # the most loaded rank of a layout (every rank of these holds the same)
            row = max(measure_world(overrides, tmp, 2), key=lambda r: r["peak_mib"]) if name in LAYOUTS else measure(overrides, tmp)
            rows.append({"run": name, **row})
        r = rows[-1]
        print(f"{name}: peak {r['peak_mib']:.1f} MiB = before {r['before_mib']:.1f} + gradients {r['grads_at_peak_mib']:.1f} + "
              f"activations and transients {r['activations_at_peak_mib']:.1f}; largest: "
              + ", ".join(f"{source} {mib:.1f}" for source, mib in r["top"]), flush=True)
    print(f"\n{'run':34s} {'peak MiB':>9s} {'grads at peak':>14s} {'planner':>9s} {'error':>7s} {'no grads':>9s}")
    for r in rows:
        print(f"{r['run']:34s} {r['peak_mib']:9.1f} {r['grads_at_peak_mib']:14.1f} {r['planner_mib']:9.1f} "
              f"{r['planner_error']:+7.1%} {r['planner_without_grads_error']:+9.1%}")
    if args.smoke:
        print("smoke run: checks that the benchmark runs; its numbers are not a measurement")
    out = args.out or ROOT / "benchmarks" / "results" / f"peak_memory{'.smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "peak_memory", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               "torch": torch.__version__, "threads": torch.get_num_threads(), "base": BASE,
                               "rows": rows, "smoke": args.smoke}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
