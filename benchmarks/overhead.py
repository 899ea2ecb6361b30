"""Framework overhead: shardwise's 1-process train step vs a hand-written plain PyTorch loop.

Both sides train the same model (same class, same seeded initial weights) on the same batches with
the same optimizer (AdamW, foreach, decay only on >= 2-D parameters), the same warm-up + cosine
LambdaLR, the same gradient clipping, the same micro-batch accumulation (loss = summed cross-entropy
/ tokens per step) and the same precision, in the same process with the same thread count. Rounds
alternate the two sides (the order swaps every other round, so slow drift of the machine cancels)
and the throughput ratio shardwise / reference is reported. Target: >= 0.97.

    python benchmarks/overhead.py [--preset tiny] [--seq-len 128] [--batch 8] [--micro-batch 8]
        [--precision fp32|bf16] [--rounds 7] [--steps-per-round 20] [--warmup 5] [--threads N]
        [--out benchmarks/results/overhead.json] [--smoke] [--model.dim=256 ...any config override]

Default model: preset "tiny" widened to dim 128, 4 layers, ffn 384 (1.3M parameters, vocab 2048), so a
step of 8 x 128 tokens takes tens of milliseconds on 2 CPU cores: small enough that per-step framework
overhead would show, large enough that timer and scheduler noise do not dominate. Another --preset is
taken as is; model.* overrides (e.g. --model.n_layers=2) apply on top of either.

This is a measurement, not a test: the exit status is 0 whether or not the target is met (2 for bad
arguments). Both sides must produce the same first-step loss (relative 1e-5), or they would not be
doing the same work; that check is printed and recorded.

--smoke checks that the script still runs end to end (tests/dist/test_benchmarks_smoke.py): 1 round of
1 step per side after 1 warm-up step, 2 x 32 tokens per step in 2 micro-batches, 1 thread, written to
benchmarks/results/overhead.smoke.json unless --out is given. Its ratio is not a measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.config import Config, build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.models import build_model
from shardwise.train.data import TokenBatches, split_inputs_targets
from shardwise.train.trainer import Trainer

TARGET = 0.97
LOSS_RTOL = 1e-5
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "overhead.json"
# --smoke: the fewest steps that still go through every part of the script (warm-up and loss check, one
# timed round, the table, the JSON), and 2 micro-batches so that both sides' accumulation loops run. One
# thread: a smoke run shares the machine with other tests, and on a loaded 2-core machine 2 intra-op threads
# made its steps 6-25x slower than 1 thread (300-1300 ms vs 47 ms). Its own default output file, so that a
# smoke run never replaces a real measurement.
SMOKE = {"seq_len": 32, "batch": 2, "micro_batch": 1, "rounds": 1, "steps_per_round": 1, "warmup": 1, "threads": 1,
         "out": DEFAULT_OUT.with_name("overhead.smoke.json")}
# The default preset is widened so that a step is tens of ms (the bare "tiny" is a few ms on 2 cores,
# where timer and scheduler noise would dominate).
TINY_WIDENED = [("model.dim", "128"), ("model.n_layers", "4"), ("model.ffn_dim", "384")]
# A fixed corpus: the source of a few stdlib modules (~0.5 MB of text, ~0.5M byte tokens).
CORPUS_MODULES = ("argparse", "dataclasses", "json.decoder", "json.encoder", "pathlib", "textwrap",
                  "typing", "functools", "collections", "enum", "inspect", "ast")


# ---------------------------------------------------------------- setup


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Unknown --section.key=value arguments are shardwise config overrides.")
    p.add_argument("--preset", default="tiny", help='model preset (default "tiny", widened to dim 128 x 4 layers)')
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps-per-round", type=int, default=20, help="timed steps of each side per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each side first (at least 1)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both sides (default: all available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true",
                   help="does the script still run? smallest sizes, 1 round of 1 step (not a measurement)")
    args, rest = p.parse_known_args(argv)
    if args.smoke:  # smoke sizes replace the defaults only: options given explicitly still win
        p.set_defaults(**SMOKE)
        args, rest = p.parse_known_args(argv)
    if args.precision == "fp16":
        p.exit(2, "overhead.py: --precision fp16 is not supported: fp16 needs dynamic loss scaling, which the plain "
                  "reference loop does not do, so the two sides would not do the same work. Use fp32 or bf16.\n")
    for name in ("seq_len", "batch", "micro_batch", "rounds", "steps_per_round"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch % args.micro_batch:
        p.error(f"--batch {args.batch} is not divisible by --micro-batch {args.micro_batch}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first warm-up step is also the loss check)")
    try:
        overrides = parse_overrides(rest)
    except ConfigError as e:
        p.error(str(e))
    return args, overrides


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def write_corpus(path: Path) -> None:
    """Concatenate the source of a fixed list of stdlib modules (same text on every run of one Python)."""
    import importlib

    parts = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "__file__", None):
            parts.append(Path(mod.__file__).read_text(encoding="utf-8"))
    path.write_text("\n\n".join(parts), encoding="utf-8")


def make_config(args: argparse.Namespace, overrides: list[tuple[str, str]], tmp: Path, total_steps: int) -> Config:
    base = [("model.preset", args.preset)] + (TINY_WIDENED if args.preset == "tiny" else [])
    base += [("train.seq_len", str(args.seq_len)), ("train.global_batch", str(args.batch)),
             ("train.micro_batch", str(args.micro_batch)), ("train.precision", args.precision),
             ("train.seed", str(args.seed)), ("train.steps", str(total_steps)),
             ("data.path", str(tmp / "corpus.txt")), ("data.tokenizer", "byte"), ("data.cache_dir", str(tmp / "cache"))]
    cfg = build_config({}, base + overrides)
    cfg.run.dir = str(tmp / "run")
    cfg.run.progress = False
    cfg.run.tensorboard = False
    cfg.checkpoint.final = False
    cfg.checkpoint.resume = False
    cfg.checkpoint.every = 0
    return cfg


# ---------------------------------------------------------------- the plain PyTorch reference


class Reference:
    """A hand-written training loop, as one would write it without any framework."""

    def __init__(self, cfg: Config, batches: TokenBatches):
        t = cfg.train
        self.batches = batches
        self.micro_batch = t.micro_batch
        self.tokens_per_step = t.global_batch * t.seq_len
        self.max_norm = t.grad_clip
        self.autocast: Callable[[], contextlib.AbstractContextManager] = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if t.precision == "bf16" else contextlib.nullcontext)

        self.model = build_model(cfg.model)
        self.model.init_weights(t.seed)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=True)

        warmup, total, floor = t.warmup_steps, t.steps, t.min_lr_ratio

        def schedule(step: int) -> float:  # linear warm-up, then cosine down to floor x lr
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.step = 0

    def train_step(self) -> float:
        micro = self.batches.local_micro_batches(self.step, 0, 1, self.micro_batch)
        loss_sum = torch.zeros(())
        for batch in micro:
            inputs, targets = split_inputs_targets(batch)
            with self.autocast():
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1),
                                   reduction="sum") / self.tokens_per_step
            loss.backward()
            loss_sum += loss.detach()
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum.item()


# ---------------------------------------------------------------- measurement


def timed(step: Callable[[], float], n: int, losses: list[float], step_s: list[float] | None = None) -> float:
    """Seconds for n steps; each step's loss goes to losses and, if given, its own seconds to step_s."""
    gc.collect()
    start = prev = time.perf_counter()
    for _ in range(n):
        losses.append(step())
        if step_s is not None:
            now = time.perf_counter()
            step_s.append(now - prev)
            prev = now
    return time.perf_counter() - start


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    wall_start = time.perf_counter()
    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    total_steps = args.warmup + args.rounds * args.steps_per_round

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: no table folded at 80 columns
    with tempfile.TemporaryDirectory(prefix="shardwise-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        write_corpus(tmp / "corpus.txt")
        try:
            cfg = make_config(args, overrides, tmp, total_steps)
            messages: list[str] = []
            trainer = Trainer(cfg, log=messages.append, single_process=True)
        except ConfigError as e:
            console.print(f"[red]config error:[/red] {e}")
            return 2
        reference = Reference(cfg, trainer.batches)  # the very same batch source
        m, t = cfg.model, cfg.train
        tokens_per_step = t.global_batch * t.seq_len
        model_desc = (f"{m.preset} ({m.arch}, dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, "
                      f"ffn {m.ffn_dim}, vocab {m.vocab_size}), {trainer.num_params / 1e6:.2f}M params")
        console.print(f"overhead: {model_desc}")
        console.print(f"overhead: {t.global_batch} x {t.seq_len} tokens/step, micro-batch {t.micro_batch} "
                      f"(accumulation {trainer.accumulation}), {t.precision}, {threads} threads, "
                      f"{args.rounds} rounds x {args.steps_per_round} steps per side after {args.warmup} warm-up steps")
        for msg in messages:
            console.print(f"[dim]{msg}[/dim]")
        if args.smoke:
            console.print("[yellow]smoke run: checks that the benchmark runs; its ratio is not a measurement[/yellow]")

        def sw_step() -> float:
            return trainer.train_step().loss

        sw_losses: list[float] = []
        ref_losses: list[float] = []
        # Warm-up (allocator, thread pools, the trainer's one-off activation measurement); its first
        # step on each side is the loss check: same weights, same batch, same work.
        timed(sw_step, args.warmup, sw_losses)
        timed(reference.train_step, args.warmup, ref_losses)
        first_diff = rel_diff(sw_losses[0], ref_losses[0])
        loss_ok = first_diff <= LOSS_RTOL
        console.print(f"loss check (step 0): shardwise {sw_losses[0]:.8f}, reference {ref_losses[0]:.8f}, "
                      f"relative diff {first_diff:.2e} -> "
                      + ("[green]same work[/green]" if loss_ok else f"[red]MISMATCH (> {LOSS_RTOL:g})[/red]"))

        rounds = []
        step_s: dict[str, list[float]] = {"shardwise": [], "reference": []}
        for r in range(args.rounds):
            order = ("shardwise", "reference") if r % 2 == 0 else ("reference", "shardwise")
            seconds = {}
            for side in order:
                if side == "shardwise":
                    seconds[side] = timed(sw_step, args.steps_per_round, sw_losses, step_s[side])
                else:
                    seconds[side] = timed(reference.train_step, args.steps_per_round, ref_losses, step_s[side])
            tps = {side: args.steps_per_round * tokens_per_step / s for side, s in seconds.items()}
            rounds.append({"round": r, "order": list(order),
                           "shardwise_s": seconds["shardwise"], "reference_s": seconds["reference"],
                           "shardwise_tokens_per_s": tps["shardwise"], "reference_tokens_per_s": tps["reference"],
                           "ratio": tps["shardwise"] / tps["reference"]})

        sw_lr, ref_lr = trainer.scheduler.get_last_lr()[0], reference.scheduler.get_last_lr()[0]
        ref_params = dict(reference.model.named_parameters())
        with torch.no_grad():
            max_param_diff = max((p - ref_params[name]).abs().max().item()
                                 for name, p in trainer.inner.named_parameters())
    wall = time.perf_counter() - wall_start

    sw_tps = [r["shardwise_tokens_per_s"] for r in rounds]
    ref_tps = [r["reference_tokens_per_s"] for r in rounds]
    per_round = [r["ratio"] for r in rounds]
    ratio_of_medians = statistics.median(sw_tps) / statistics.median(ref_tps)
    median_ratio = statistics.median(per_round)
    meets = ratio_of_medians >= TARGET and loss_ok  # a ratio between different work means nothing
    max_loss_diff = max(rel_diff(a, b) for a, b in zip(sw_losses, ref_losses))
    # Robust to bursts of contention from other jobs: the median single step of each side.
    sw_step_median, ref_step_median = statistics.median(step_s["shardwise"]), statistics.median(step_s["reference"])
    step_ratio = ref_step_median / sw_step_median

    table = Table(title=f"shardwise vs plain PyTorch, {tokens_per_step} tokens/step, {t.precision}, {threads} threads")
    table.add_column("round", justify="right")
    table.add_column("order")
    table.add_column("shardwise tok/s", justify="right")
    table.add_column("reference tok/s", justify="right")
    table.add_column("shardwise ms/step", justify="right")
    table.add_column("reference ms/step", justify="right")
    table.add_column("ratio", justify="right")
    for r in rounds:
        table.add_row(str(r["round"]), "sw, ref" if r["order"][0] == "shardwise" else "ref, sw",
                      f"{r['shardwise_tokens_per_s']:,.0f}", f"{r['reference_tokens_per_s']:,.0f}",
                      f"{1e3 * r['shardwise_s'] / args.steps_per_round:.1f}",
                      f"{1e3 * r['reference_s'] / args.steps_per_round:.1f}", f"{r['ratio']:.3f}")
    table.add_section()
    table.add_row("median", "", f"{statistics.median(sw_tps):,.0f}", f"{statistics.median(ref_tps):,.0f}",
                  f"{1e3 * tokens_per_step / statistics.median(sw_tps):.1f}",
                  f"{1e3 * tokens_per_step / statistics.median(ref_tps):.1f}", f"{ratio_of_medians:.3f}")
    console.print(table)
    console.print(f"throughput ratio shardwise / reference: ratio of medians [bold]{ratio_of_medians:.3f}[/bold], "
                  f"median of per-round ratios {median_ratio:.3f}, per-round min {min(per_round):.3f} / "
                  f"max {max(per_round):.3f}")
    console.print(f"median single step: shardwise {1e3 * sw_step_median:.1f} ms, reference "
                  f"{1e3 * ref_step_median:.1f} ms, ratio {step_ratio:.3f} (less sensitive to bursts of contention)")
    console.print(f"same work: {len(sw_losses)} steps, max relative loss diff {max_loss_diff:.2e}, final weights max "
                  f"|diff| {max_param_diff:.2e}, final lr shardwise {sw_lr:.6g} / reference {ref_lr:.6g}")
    verdict = "[green]MEETS[/green]" if meets else "[red]DOES NOT MEET[/red]"
    why = "" if loss_ok else ", but the loss check failed"
    console.print(f"target ratio >= {TARGET}: {verdict} (ratio of medians {ratio_of_medians:.3f}{why}); "
                  f"wall time {wall:.1f}s")

    result = {
        "benchmark": "overhead",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            # asdict, not vars(): the model config nests a MoEConfig dataclass, which json cannot encode.
            "preset": args.preset, "model": dataclasses.asdict(m), "num_params": trainer.num_params,
            "seq_len": t.seq_len, "batch": t.global_batch, "micro_batch": t.micro_batch,
            "accumulation": trainer.accumulation, "precision": t.precision, "rounds": args.rounds,
            "steps_per_round": args.steps_per_round, "warmup": args.warmup, "seed": t.seed,
            "lr": t.lr, "betas": [t.beta1, t.beta2], "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
            "warmup_steps": t.warmup_steps, "schedule_steps": t.steps, "min_lr_ratio": t.min_lr_ratio,
            "tokens_per_step": tokens_per_step, "overrides": [f"--{k}={v}" for k, v in overrides],
        },
        "rounds": rounds,
        "shardwise_tokens_per_s_median": statistics.median(sw_tps),
        "reference_tokens_per_s_median": statistics.median(ref_tps),
        "ratio_of_medians": ratio_of_medians,
        "median_of_ratios": median_ratio,
        "ratio_min": min(per_round),
        "ratio_max": max(per_round),
        "median_step_s": {"shardwise": sw_step_median, "reference": ref_step_median},
        "median_step_ratio": step_ratio,
        "step_s": step_s,
        "target": TARGET,
        "meets_target": meets,
        "meets_target_by": "ratio_of_medians >= target and loss_check.ok",
        "loss_check": {"step": 0, "shardwise": sw_losses[0], "reference": ref_losses[0], "relative_diff": first_diff,
                       "rtol": LOSS_RTOL, "ok": loss_ok, "max_relative_diff_all_steps": max_loss_diff,
                       "final_weights_max_abs_diff": max_param_diff},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpus_available": available_cpus(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "wall_s": wall,
    }
    if args.smoke:
        result["smoke"] = True  # so that nobody reads a smoke run's ratio as a measurement
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
