"""`make gpu-check`: every one-GPU path of shardwise, run on this machine's GPU, in one report.

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--only PATTERN,...] [--out runs/gpu-check] [--list]
        [--steps 8] [--timeout 300] [--budget SECONDS] [--device cuda|cpu] [--jobs N] [--smoke]

Each row is a process of its own (a crash, an OOM or a hang fails its row, not the check; its shardwise commands
start in an interpreter that imported torch and the trainer while the row before ran: gpu_warm.py) and is one of:
  train/{eager,compiled}/{fp32,bf16,fp16,fp8}/{none,selective,full}   one-process training of the check model
  offload/{cpu,nvme}, tiles/4                                       model states off the GPU; tiled MLPs
  train/compiled/bf16/documents                                     document mask + validation rounds, priced
  train/compiled/bf16/op_alternate                                  every other matmul output kept (torchtitan's
                                                                    per-op recompute), priced
  offload-big/{cpu,nvme}                                            states larger than the GPU (only when named)
  fixture/{886m-bf16-mb8,886m-fp16-mb8,2.4b-bf16-mb2}               issue 29's H100 rows trained again (only when named)
  resume/bitwise                                                    8 steps = 4 steps, checkpoint, 4 resumed
  hf/export, hf/import                                              export -> transformers greedy ids; --hf back in
  layout/{fsdp,hsdp,tp_sp,cp_ring,cp_ulysses,ep,tp2d,pp}            2-4 processes sharing the GPU over gloo
                                                                    (run.backend=gloo), `shardwise parity`
  doctor, bench/{kernels,kernels-large,cross_entropy,throughput,decode}  the machine check and the benchmarks
  bench/fp8, bench/fp8-2.4b, bench/decode-modes                     FP8 alone (bench/throughput times it too); FP8 on
                                                                    the 2.4B; decode under max-autotune (only when named)
The measured rows (training, offload, tiles, the benchmarks) run one after another: FIRST (what the targets
read), then, after the pool, the others. The pool runs --jobs at a time (default 4 on a GPU machine, 1 on CPU),
between the two, so that nothing in it overlaps a timing: the rows that time nothing (resume, hf, doctor and
the layouts, which check placement and numbers, not speed; hf/export after resume/bitwise, whose checkpoint it
exports), and the command of each compiled row of the second part run ahead, untimed, to fill torch's compile
cache for its timed run (schedule, prewarm). A training row records pass/fail with a
one-line reason, tokens/s, MFU, peak memory and J/token from metrics.jsonl, the planner's prediction
for the same config (`shardwise plan evaluate` on the table entry of this GPU): step time and peak memory,
and their errors, and what made up step 2's peak (memory_peak.py on the allocator history each row records
in its untimed first two steps: before the step, gradients, activations). OUT/report.md (a table) and
OUT/report.json (the same rows; the format is in docs/gpu.md) are rewritten after every row, so an
interrupted check keeps what it measured. --only takes shell patterns over row names (`train/compiled/*`,
`hf/*`). Without a CUDA GPU it says so and exits 0; --device cpu runs the rows on the CPU with a tiny model: the harness's own test
(tests/dist/test_gpu_check.py), not a measurement; --smoke runs three of them so.
Runs from a checkout (PYTHONPATH=src) on whatever torch the machine has. Exit: 0 when no row failed,
1 when one did, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpu_hf_rows import hf_row
from gpu_report import Row, metrics, one_line, peak_split, planner_summary, process_times, report_md, write_report  # noqa: F401  (this folder; tests use them from here)
from gpu_schedule import COMPILE_CACHE, PREWARM, drop_autotune_choices, schedule, select  # noqa: F401  (this folder; tests use them from here)
from gpu_warm import WarmShardwise

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # a checkout runs as it is (PYTHONPATH=src on the GPU machine)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
RECOMPUTES = ("none", "selective", "full")
# The check model on a GPU: ~150M parameters, big enough for tokens/s and MFU to mean something, small
# enough for 24 training rows in minutes. On CPU (--device cpu): the tests' tiny llama.
MODELS = {
    "cuda": ["--model.preset=small", "--model.dim=1024", "--model.n_layers=8", "--model.n_heads=16",
             "--model.n_kv_heads=8", "--model.ffn_dim=2816", "--model.vocab_size=32000", "--model.max_seq_len=1024",
             "--train.seq_len=1024", "--train.micro_batch=8", "--train.global_batch=8"],
    "cpu": ["--model.preset=tiny", "--model.vocab_size=512", "--train.seq_len=32", "--train.micro_batch=4",
            "--train.global_batch=4", "--train.compile_backend=aot_eager"],
}
# Parity layouts on one GPU (run.backend=gloo, fp32 without TF32: the parity contract's tolerance), on the
# tiny llama: these rows check where tensors live and that the numbers agree, not speed.
LAYOUT_MODEL = ["--model.preset=tiny", "--model.vocab_size=512", "--train.seq_len=32", "--train.micro_batch=2",
                "--train.global_batch=8"]
# bench/throughput's variants (gpu_throughput.py): what the targets of issue 27 read (gpu_report.py TARGETS).
THROUGHPUT_VARIANTS = "shardwise+compile,shardwise+compile+fused,shardwise+compile+fp8,plain+compile"
LAYOUTS = {
    "fsdp": (2, "dp_shard=2,zero=3"), "hsdp": (4, "dp_replicate=2,dp_shard=2,zero=3"), "tp_sp": (2, "tp=2"),
    "cp_ring": (2, "cp=2,cp_mode=ring"), "cp_ulysses": (2, "cp=2,cp_mode=ulysses"),
    "ep": (2, "ep=2,dp_shard=2,zero=3,model.preset=tiny-moe"), "tp2d": (4, "tp=4,tp_mode=2d"), "pp": (2, "pp=2"),
}


@dataclass
class Ctx:
    out: Path
    device: str
    steps: int
    timeout: float
    gpu: str | None  # the planner's table entry for this GPU, None where it has none (or on CPU)
    corpus: Path
    env: dict[str, str]
    deadline: float | None = None  # time.monotonic() by which every row has ended (--budget)
    warm: WarmShardwise | None = None  # interpreters started ahead of the shardwise commands (main sets it)

    def common(self, model: list[str] | None = None) -> list[str]:
        return [f"--data.path={self.corpus}", "--data.tokenizer=byte", f"--data.cache_dir={self.out / 'cache'}",
                "--run.progress=false", "--run.tensorboard=false", "--run.loss_curve=false", "--checkpoint.resume=false",
                "--checkpoint.final=false", "--train.log_every=1", "--train.warmup_steps=2",
                *(MODELS[self.device] if model is None else model)]

    def limit(self, timeout: float | None = None) -> float:
        """Seconds a command of a row may take: its timeout (default --timeout), cut at the --budget's end."""
        timeout = timeout or self.timeout
        return timeout if self.deadline is None else max(1.0, min(timeout, self.deadline - time.monotonic()))

    def spent(self) -> bool:
        """Whether the --budget is (within a second of being) used up: a row starting now would get 1 s."""
        return self.deadline is not None and time.monotonic() >= self.deadline - 1

    def shardwise(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        """`python -m shardwise.cli ARGS`, in an interpreter that imported torch and the trainer while the row before
        ran (gpu_warm.py), except the planner's commands: pure Python, they import no torch (0.2 s)."""
        if self.warm is not None and args[0] != "plan":
            return self.warm.run(list(args), self.limit(timeout))
        return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                              cwd=self.out, env=self.env, timeout=self.limit(timeout))


def predict(ctx: Ctx, run: Path) -> dict[str, float]:
    """The planner on the run's own config.toml for this GPU's table entry; {} where there is none."""
    if ctx.gpu is None:
        return {}
    p = ctx.shardwise("plan", "evaluate", "--config", str(run / "config.toml"), "--json", f"--cluster.gpu={ctx.gpu}",
                      "--cluster.num_gpus=1", "--cluster.gpus_per_node=1")
    if p.returncode != 0:
        return {"error": one_line(p)}  # type: ignore[dict-item]
    plan = json.loads(p.stdout)
    out = {"step_s": plan["step_time_s"], "peak_gib": plan["memory_gib"]["total"], "stack": plan.get("stack", "")}
    if "evaluation" in plan:  # a validation round's price (plan/evaluation.py)
        out["eval_round_s"] = plan["evaluation"]["round_s"]
    if "document_mask" in plan:  # the share of causal attention's tiles the documents leave (spec/documents.py)
        out["document_share"] = plan["document_mask"]["share"]
    return out


def train_args(ctx: Ctx, run: Path, overrides: list[str], steps: int | None = None) -> list[str]:
    """A one-process training row's command line (after `shardwise`)."""
    return ["train", "--nproc", "1", *ctx.common(), f"--train.steps={steps or ctx.steps}", "--run.memory_snapshot=true",
            *overrides, f"--run.dir={run}"]


def train_row(ctx: Ctx, name: str, overrides: list[str], steps: int | None = None) -> Row:
    run = ctx.out / "runs" / name.replace("/", "_")
    shutil.rmtree(run, ignore_errors=True)
    started = time.time()
    p = ctx.shardwise(*train_args(ctx, run, overrides, steps))
    ended = time.time()
    if p.returncode != 0:
        return Row(name, "fail", one_line(p))
    row = Row(name, "pass", measured={**metrics(run), **peak_split(run), **process_times(run, started, ended)},
              predicted=predict(ctx, run))
    for key in ("step_s", "peak_gib", "eval_round_s"):
        got, want = row.measured.get(key), row.predicted.get(key)
        if isinstance(got, float) and isinstance(want, float) and got > 0:
            row.predicted[f"{key}_error"] = (want - got) / got
    return row


def resume_row(ctx: Ctx) -> Row:
    """8 steps with checkpoints at 4 and 8; a copy of the run without step 8's checkpoint resumes from step 4:
    steps 5-8 must repeat the same losses, bit for bit (same schedule: both runs are 8-step runs)."""
    name, runs = "resume/bitwise", ctx.out / "runs"
    straight, cut = runs / "resume_straight", runs / "resume_cut"
    for d in (straight, cut):
        shutil.rmtree(d, ignore_errors=True)
    base = [*ctx.common(), "--train.compile=false", "--train.steps=8", "--checkpoint.every=4", "--checkpoint.keep=2"]
    p = ctx.shardwise("train", "--nproc", "1", *base, "--checkpoint.final=true", f"--run.dir={straight}")
    if p.returncode != 0:
        return Row(name, "fail", one_line(p))
    from shardwise.train.manifest import step_dir_name

    # The cut run: the straight run's first 4 steps only (its step-8 checkpoint and metrics records gone,
    # so nothing of steps 5-8 can come from the copy).
    shutil.copytree(straight, cut)
    shutil.rmtree(cut / "checkpoints" / step_dir_name(8))
    records = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(f"{r}\n" for r in records if json.loads(r).get("step", 0) <= 4))
    p = ctx.shardwise("train", "--nproc", "1", *base, "--checkpoint.resume=true", f"--run.dir={cut}")
    if p.returncode != 0:
        return Row(name, "fail", one_line(p))

    def losses(run: Path) -> dict[int, float]:  # the last record of each step: the resumed run's
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    a, b = losses(straight), losses(cut)
    if "resum" not in p.stdout + p.stderr or any(s not in b for s in range(5, 9)):
        return Row(name, "fail", f"the second run did not resume from step 4 (steps logged: {sorted(b)})")
    worst = max(abs(a[s] - b[s]) for s in range(5, 9))
    return Row(name, "pass" if worst == 0 else "fail", "steps 5-8 bitwise after resuming from step 4" if worst == 0
               else f"steps 5-8 differ by up to {worst:.3e} after resuming from step 4", measured={"final_loss": b[8]})


def layout_row(ctx: Ctx, name: str) -> Row:
    nproc, layout = LAYOUTS[name]
    out = ctx.out / "runs" / f"layout_{name}"
    shutil.rmtree(out, ignore_errors=True)
    p = ctx.shardwise("parity", "--nproc", str(nproc), "--layout", layout, "--steps", "4", "--out", str(out),
                      *ctx.common(LAYOUT_MODEL), "--run.backend=gloo", "--train.precision=fp32", "--train.tf32=false",
                      "--train.compile=false")
    found = json.loads((out / "parity.json").read_text()) if (out / "parity.json").is_file() else []
    if name == "pp" and ctx.device == "cuda" and p.returncode == 2 and "pipeline stages" in p.stderr + p.stdout:
        return Row(f"layout/{name}", "skip", one_line(p))  # refused by design: gloo has no CUDA point-to-point
    if not found or found[0].get("verdict") == "error":
        return Row(f"layout/{name}", "fail", one_line(p))
    r = found[0]
    return Row(f"layout/{name}", r["verdict"], f"{nproc} processes on one device: max rel |dloss| "
               f"{r['max_rel_dloss']:.2e}, max |dparam| {r['max_abs_dparam']:.2e}")


def command_row(ctx: Ctx, name: str, argv: list[str], timeout: float | None = None) -> Row:
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ctx.out, env=ctx.env, timeout=ctx.limit(timeout))
    return Row(name, "pass" if p.returncode == 0 else "fail", "" if p.returncode == 0 else one_line(p))


def offload_big(ctx: Ctx, tier: str) -> list[str]:
    """A LLaMA (dim 4096, 32/8 heads, ffn 11008) whose model states, 16 B per parameter on the host, are
    1.1x this GPU's memory: it cannot train on the GPU without offload (host memory: 1.1x too)."""
    import torch

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if ctx.device == "cuda" else 0.05
    d, kv, ffn = 4096, 4096 // 4, 11008
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn  # q, o; k, v (8 of 32 heads); SwiGLU's three
    layers = max(2, math.ceil(1.1 * gib * 2**30 / 16 / per_layer))
    return [f"--model.dim={d}", f"--model.n_layers={layers}", "--model.n_heads=32", "--model.n_kv_heads=8",
            f"--model.ffn_dim={ffn}", "--train.seq_len=512", "--train.micro_batch=1", "--train.global_batch=1",
            "--model.max_seq_len=512", f"--parallel.offload={tier}", "--parallel.zero=3", "--train.recompute=full",
            *([f"--parallel.offload_dir={ctx.out / 'nvme'}"] if tier == "nvme" else [])]


# Issue 29's two open memory rows (tests/unit/test_plan_h100.py MEMORY_OPEN, measurements in doubt) and the bf16
# row they are read against, trained again as the fixture describes them (tests/fixtures/h100_runs_compiled.json,
# one H100, 2026-11-25): each in a fresh process, with step 2's peak split from its allocator history (before
# the step, gradients alive at the peak, activations), which says whether the fixture's peak was the
# harness's and whether a compiled step's peak holds the gradients. Only when named: the 886M and 2.4B models
# compile for a minute or so each. On CPU (the harness's test) the check's tiny model at the row's precision.
FIXTURES = ROOT / "tests" / "fixtures" / "h100_runs_compiled.json"
FIXTURE_ROWS = {"fixture/886m-bf16-mb8": "886M bf16 mb8 compiled", "fixture/886m-fp16-mb8": "886M fp16 mb8 compiled",
                "fixture/2.4b-bf16-mb2": "2.4B bf16 mb2 compiled (shardwise train CLI default on CUDA, 6 steps)"}


def fixture_row(ctx: Ctx, name: str) -> Row:
    fixture = next(r for r in json.loads(FIXTURES.read_text())["rows"] if r["variant"] == FIXTURE_ROWS[name])
    flags = [*fixture["command"].split(), *fixture["overrides"].split()]
    if ctx.device == "cpu":
        flags = [f for f in flags if f.startswith("--train.precision=")]
    row = train_row(ctx, name, flags)
    was = fixture["measured"]
    row.measured["fixture_peak_gib"] = was["max_memory_allocated_gib"]
    if row.status == "pass":
        row.reason = (f"the fixture's {fixture['variant']!r} (2026-11-25): {was['step_time_s']:.4f} s, "
                      f"{was['max_memory_allocated_gib']:.2f} GiB")
    return row


def training_rows(ctx: Ctx) -> dict[str, list[str]]:
    """The one-process training rows of the check model and their overrides (train_args)."""
    rows = {f"train/{mode}/{precision}/{recompute}": [f"--train.compile={str(mode == 'compiled').lower()}",
                                                     f"--train.precision={precision}", f"--train.recompute={recompute}"]
            for mode in ("eager", "compiled") for precision in PRECISIONS for recompute in RECOMPUTES}
    rows["offload/cpu"] = ["--parallel.offload=cpu", "--parallel.zero=3"]
    rows["offload/nvme"] = ["--parallel.offload=nvme", "--parallel.zero=3", f"--parallel.offload_dir={ctx.out / 'nvme'}"]
    rows["tiles/4"] = ["--parallel.linear_tiles=4"]
    # Selective recomputation keeping every other matmul output (train.recompute_policy, torchtitan's per-op policy):
    # its compiled recompute GEMMs and bytes, as plan/activations.py prices them, against the selective row beside it.
    rows["train/compiled/bf16/op_alternate"] = ["--train.compile=true", "--train.precision=bf16", "--train.recompute=selective",
                                                 "--train.recompute_policy=op_alternate"]
    # Issue 56 on a GPU: document masking (FlexAttention, priced on the prepared rows' tiles, plan/command.py) and
    # validation rounds (priced by plan/evaluation.py), each against the planner: step time and a round's seconds.
    rows["train/compiled/bf16/documents"] = [f"--data.path={documents_corpus(ctx.corpus)}", "--train.compile=true",
                                              "--train.precision=bf16", "--train.document_mask=true",
                                              "--data.valid_fraction=0.05", "--eval.every=4", "--eval.tokens=16384"]
    return rows


def compiles_with_cache(ctx: Ctx, overrides: list[str]) -> bool:
    """Whether a training row compiles through inductor, whose generated code torch's compile cache keeps
    across processes (on disk, keyed by the graph and its settings): the trainer's own rule (compile_enabled)
    on the row's own config, and its compile_backend (the check model's is aot_eager on CPU, with no cache)."""
    from shardwise.config import load_config
    from shardwise.parallel.compile import compile_enabled

    cfg = load_config(None, [*ctx.common(), *overrides])
    return compile_enabled(cfg, ctx.device) and cfg.train.compile_backend == "inductor"


def prewarm(ctx: Ctx, name: str, overrides: list[str]) -> dict[str, Any]:
    """The row's own command, untimed, side by side with the untimed rows, so that its timed run loads its
    compiled graphs from torch's compile cache instead of compiling them one row after another. Its outcome
    goes to report.json's header only: the timed run is the row (a failure here fails nothing)."""
    run = ctx.out / "runs" / f"prewarm_{name.replace('/', '_')}"
    shutil.rmtree(run, ignore_errors=True)
    start = time.perf_counter()
    try:
        p = ctx.shardwise(*train_args(ctx, run, overrides))
    except subprocess.TimeoutExpired as e:
        return {"status": "fail", "reason": f"timed out after {e.timeout:.0f} s", "seconds": time.perf_counter() - start}
    done = {"status": "pass" if p.returncode == 0 else "fail", "seconds": time.perf_counter() - start}
    if p.returncode != 0:
        return {**done, "reason": one_line(p)}
    m = metrics(run)
    return {**done, **{k: m[k] for k in ("warmup_s", "inductor_graphs") if k in m}}


def all_rows(ctx: Ctx) -> dict[str, Callable[[], Row]]:
    """Every row name, in the order they run, and what runs it."""
    rows: dict[str, Callable[[], Row]] = {name: (lambda n=name, o=overrides: train_row(ctx, n, o))
                                          for name, overrides in training_rows(ctx).items()}
    rows["resume/bitwise"] = lambda: resume_row(ctx)
    rows["hf/export"] = lambda: hf_row(ctx, "hf/export")
    rows["hf/import"] = lambda: hf_row(ctx, "hf/import")
    for name in LAYOUTS:
        rows[f"layout/{name}"] = lambda n=name: layout_row(ctx, n)
    rows["doctor"] = lambda: command_row(ctx, "doctor", [sys.executable, "-m", "shardwise.cli", "doctor", "--json"])
    bench = ROOT / "benchmarks"
    smoke = ["--smoke"] if ctx.device == "cpu" else []
    # Every section; sdpa_lengths times causal SDPA at 2K, 8K and 32K tokens and one CP rank of 32K at CP 2, 4, 8
    # (issue 60: torchtitan's 32K and 64K steps imply FlashAttention-2 1.2-1.4x faster than the planner's rate,
    # measured at 2K; its CP 4-8 steps slower than that rate extrapolates to).
    rows["bench/kernels"] = lambda: command_row(ctx, "bench/kernels", [sys.executable, str(bench / "kernels.py"), *smoke,
                                                                       "--out", str(ctx.out / "kernels.json")])
    # Issue 60: a large model's GEMMs, GPT-3 175B's at TP 4 (12288 x 12288 weights) on micro-batches of 2,048 and
    # 4,096 tokens, where the weight gradient's K is the token count (the published NeMo rows run 5-15% slower than
    # priced; kernels_h100.json measured K = 2,048 at 0.67-0.70 of peak where the planner gives ~0.78).
    rows["bench/kernels-large"] = lambda: command_row(
        ctx, "bench/kernels-large", [sys.executable, str(bench / "kernels.py"), *(smoke or [
            "--sections", "gemm", "--dim", "12288", "--ffn", "12288", "--heads", "96", "--kv-heads", "96", "--tokens",
            "4096", "--gemm-tokens", "4096,2048", "--squares", "8192", "--decode-m", "1"]), "--out",
                                     str(ctx.out / "kernels_large.json")])
    # Issue 59's per-axis collective time: NCCL's completion hook on a one-rank group (gloo on CPU: not timed).
    rows["check/collective-clock"] = lambda: command_row(
        ctx, "check/collective-clock", [sys.executable, str(bench / "collective_clock.py"), *smoke, "--out",
                                        str(ctx.out / "collective_clock.json")])
    rows["bench/cross_entropy"] = lambda: command_row(
        ctx, "bench/cross_entropy", [sys.executable, str(bench / "cross_entropy.py"), *smoke, "--out",
                                     str(ctx.out / "cross_entropy.json")])
    # Issue 27's speed targets: shardwise compiled, bf16 and FP8, against the plain compiled loop in bf16, in one
    # run of gpu_throughput.py (two passes each), with bf16 train.fuse_projections beside them: one plain loop
    # for both ratios, where a run of its own for FP8 (bench/fp8, now only when named) timed the same plain loop
    # again in a process of its own. FP8 joined, and with train.fp8_head, measured slower on an H200
    # (2026-11-28): not timed here. Its eager variants are the train/eager rows' paths. bench/fp8-2.4b (only when
    # named, ~150 s on an H200): the second FP8 model, 2.4B at micro-batch 4.
    # --profile: 3 more steps per variant (decode: per batch) under torch.profiler, by kernel class (kernel_breakdown.py).
    for name, out, args in (("bench/throughput", "throughput.json", ["--variants", THROUGHPUT_VARIANTS]),
                            ("bench/fp8", "fp8.json", ["--precision", "fp8", "--variants", "shardwise+compile,plain+compile"]),
                            ("bench/fp8-2.4b", "fp8_2p4b.json", ["--precision", "fp8", "--variants",
                                                                 "shardwise+compile,plain+compile", "--size", "2.4b"])):
        rows[name] = lambda n=name, o=out, a=args: command_row(
            ctx, n, [sys.executable, str(bench / "gpu_throughput.py"), *smoke, *([] if smoke else [
                *a, "--steps", "6", "--warmup", "3", "--profile", str(ctx.out / "profile" / Path(o).stem),
                "--memory-snapshot"]), "--out", str(ctx.out / o)], timeout=max(ctx.timeout, 600))
    rows["bench/decode"] = lambda: command_row(  # issue 30's decode: eager, compiled, transformers, sampled, finishing
        ctx, "bench/decode", [sys.executable, str(bench / "decode.py"), *smoke, *([] if smoke else [
            "--batches", "1,64", "--new-tokens", "128", "--transformers-batches", "1", "--finishing-batch", "8",
            "--sample", "0.8,0.95", "--profile", str(ctx.out / "profile" / "decode")]),
            "--out", str(ctx.out / "decode.json")], timeout=max(ctx.timeout, 600))
    # Batch-1 decode against max-autotune (inductor's Triton GEMM templates tried against cuBLAS per one-row GEMM).
    one = ["--batches", "1", "--new-tokens", "128", "--transformers-batches", "", "--finishing-batch", "0",
           "--profile", str(ctx.out / "profile" / "decode-modes")]
    rows["bench/decode-modes"] = lambda: command_row(ctx, "bench/decode-modes", [
        sys.executable, str(bench / "decode.py"), *(smoke or one), "--compare-mode", "max-autotune",
        "--out", str(ctx.out / "decode_modes.json")], timeout=max(ctx.timeout, 600))
    for name in FIXTURE_ROWS:
        rows[name] = lambda n=name: fixture_row(ctx, n)
    for tier in ("cpu", "nvme"):  # only when named: minutes of host-side initialisation and CPU AdamW
        rows[f"offload-big/{tier}"] = lambda t=tier: train_row(ctx, f"offload-big/{t}", offload_big(ctx, t), steps=3)
    return rows


SMOKE_ROWS = "train/eager/fp32/none,resume/bitwise,layout/fsdp"  # a row of each kind of runner


def header_of(ctx: Ctx) -> dict[str, Any]:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"device_name": torch.cuda.get_device_name() if ctx.device == "cuda" else "cpu (harness test, not a measurement)",
            "device": ctx.device, "torch": torch.__version__, "commit": commit or "unknown", "steps": ctx.steps,
            "planner_gpu": ctx.gpu, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="comma-separated row patterns, e.g. 'train/compiled/*,hf'")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    p.add_argument("--list", action="store_true", help="print the rows --only would select, and exit")
    p.add_argument("--steps", type=int, default=8, help="steps per training row (the first 2 are not timed)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a row may take")
    p.add_argument("--budget", type=float, default=None, help="seconds the whole check may take: no row runs past it, "
                   "rows not started are reported as skipped (the rows the targets need run first)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when present")
    p.add_argument("--jobs", type=int, default=None, help="layout rows at a time (default 4 on a GPU, 1 on CPU)")
    p.add_argument("--smoke", action="store_true", help=f"does the check still run? --device cpu --only {SMOKE_ROWS}")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.only = "cpu", args.only or SMOKE_ROWS
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first 2 are compilation and the communication count)")
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.budget is not None and args.budget <= 0:
        p.error("--budget must be > 0 seconds")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import importlib.util

    has_torch = importlib.util.find_spec("torch") is not None
    cuda = has_torch and __import__("torch").cuda.is_available()
    device = args.device or ("cuda" if cuda else None)
    out = args.out.resolve()
    # torch's compile cache (TORCHINDUCTOR_CACHE_DIR, torch's own variable): the check's own, emptied at its
    # start (below), so that what a row compiles, and how long that takes, does not depend on what ran before.
    ctx = Ctx(out, device or "cpu", args.steps, args.timeout, None, out / "corpus.txt",
              {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               "TORCHINDUCTOR_CACHE_DIR": str(out / COMPILE_CACHE)})
    names = list(all_rows(ctx))
    chosen = select(names, args.only)
    if args.only and not chosen:
        print(f"gpu_check.py: --only {args.only!r} selects no row; rows: {', '.join(names)}", file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(chosen))
        return 0
    if not has_torch:
        print(f"gpu-check: this Python ({sys.executable}) has no torch, so no GPU to check; on a GPU machine run it "
              "with the Python that has its CUDA torch (make gpu-check PYTHON=...)")
        return 0
    if device is None:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False): nothing to check. "
              "--device cpu runs the rows on the CPU to test the check itself.")
        return 0
    if importlib.util.find_spec("tomli_w") is None:  # shardwise writes every run's config.toml with it
        print("gpu_check.py: the Python package tomli-w is missing (pip install tomli-w; on a machine without a "
              "registry carry its wheel: ../shared/gpu/README.md)", file=sys.stderr)
        return 2
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    if device == "cuda":
        from shardwise.spec.hardware import match_cuda_name

        ctx.gpu = match_cuda_name(torch.cuda.get_device_name())
    (ctx.out / "nvme").mkdir(parents=True, exist_ok=True)  # offload="nvme" rows' state directory
    _write_corpus(ctx.corpus)
    shutil.rmtree(ctx.out / COMPILE_CACHE, ignore_errors=True)
    header, rows = {**header_of(ctx), "only": args.only, "budget": args.budget}, []
    started = time.perf_counter()
    ctx.deadline = None if args.budget is None else time.monotonic() + args.budget
    print(f"gpu-check: {len(chosen)} rows on {header['device_name']}; report in {ctx.out / 'report.md'}", flush=True)
    runners = all_rows(ctx)
    jobs = args.jobs or (4 if device == "cuda" else 1)
    # The FIRST rows one at a time; the untimed rows and the compiled rows' runs ahead side by side (no timing
    # among them); the other measured rows one at a time.
    training = training_rows(ctx)
    first, chains, rest = schedule(chosen, {n for n, o in training.items() if compiles_with_cache(ctx, o)}, jobs)
    lock = threading.Lock()  # rows are recorded from the pool's threads

    def run_row(name: str) -> Row:
        start = time.perf_counter()
        if ctx.spent():
            return Row(name, "skip", f"not started: the --budget of {args.budget:.0f} s ran out")
        try:
            row = runners[name]()
        except subprocess.TimeoutExpired as e:
            row = Row(name, "skip", f"cut at the end of the --budget of {args.budget:.0f} s") if ctx.spent() else \
                Row(name, "fail", f"timed out after {e.timeout:.0f} s")
        row.seconds = time.perf_counter() - start
        return row

    def record(row: Row) -> None:
        with lock:
            rows.append(row)
            print(f"  {row.status.upper():4s} {row.name:34s} {row.seconds:6.1f} s  {row.reason}", flush=True)
            write_report(ctx.out, rows, header)

    def run_ahead(name: str) -> None:
        done = {"status": "skip", "reason": "not started: the --budget ran out"} if ctx.spent() else \
            prewarm(ctx, name, training[name])
        with lock:
            header.setdefault("prewarmed", {})[name] = done
            print(f"  {'WARM' if done['status'] == 'pass' else done['status'].upper():4s} {name:34s} "
                  f"{done.get('seconds', 0):6.1f} s  {done.get('reason', 'run ahead, untimed: its graphs are in the compile cache')}",
                  flush=True)

    def run_chain(chain: list[str]) -> None:
        for name in chain:
            if name.startswith(PREWARM):
                run_ahead(name[len(PREWARM):])
            else:
                record(run_row(name))

    ctx.warm = WarmShardwise(ctx.out, ctx.env)
    try:
        for name in first:
            record(run_row(name))
        serial = time.perf_counter() - started
        if chains:
            from concurrent.futures import ThreadPoolExecutor

            parallel = time.perf_counter()
            with ThreadPoolExecutor(max_workers=jobs) as pool:  # each row is its own processes: threads only wait
                for future in [pool.submit(run_chain, c) for c in chains]:
                    future.result()
            header["parallel_seconds"] = time.perf_counter() - parallel
            drop_autotune_choices(ctx.out / COMPILE_CACHE)
        rest_started = time.perf_counter()
        for name in rest:
            record(run_row(name))
        header["serial_seconds"] = serial + time.perf_counter() - rest_started
        rows.sort(key=lambda r: chosen.index(r.name))
    finally:
        ctx.warm.close()
    header["seconds"] = time.perf_counter() - started  # the bound of issue 27 (gpu_report.py TARGETS)
    write_report(ctx.out, rows, header)
    failed = [r.name for r in rows if r.status == "fail"]
    print(f"gpu-check: {len(rows) - len(failed)} of {len(rows)} rows passed or skipped"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _write_corpus(path: Path) -> None:
    """The tests' fixed corpus: a few standard-library modules, the same on every machine with this Python."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "json/decoder.py")
    path.write_text("\n".join((stdlib / m).read_text() for m in modules))
    # The same text as many documents (train/compiled/bf16/documents): each blank-line-separated block one JSON
    # record, so that rows pack several documents and the validation share holds whole ones.
    blocks = [b for b in path.read_text().split("\n\n") if b.strip()]
    documents_corpus(path).write_text("".join(json.dumps({"text": b}) + "\n" for b in blocks))


def documents_corpus(corpus: Path) -> Path:
    return corpus.with_name("corpus_documents.jsonl")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
