"""Throughput on one device: shardwise eager and compiled against a plain PyTorch loop eager and compiled.

Four variants train the same model class from the same seeded weights on the same batches:
  shardwise          `Trainer` with train.compile=false (one process, no parallelism)
  shardwise+compile  `Trainer` with train.compile=true (each block compiled in place)
  shardwise+compile+fused  the same with train.fuse_projections=true (q|k|v and w1|w3 as one GEMM each);
                     not in the default set: name it in --variants; +head (with --precision fp8):
                     train.fp8_head=true, the output head's GEMMs in FP8 too
  shardwise+compile+fp8  shardwise+compile with train.precision=fp8 whatever --precision says: FP8 measured
                     in the same run as bf16 and against the same plain loop (gpu-check's bench/throughput)
  plain              a hand-written loop: AdamW (fused on CUDA), autocast, F.cross_entropy(logits.float())
  plain+compile      the same loop over torch.compile(model)
Each variant is built, warmed up (compilation happens there), timed and freed in turn, so its peak
memory is its own; the variants run twice, in opposite orders (A B C D, then D C B A), and a variant's
tokens/s is the mean of its two passes, so slow drift of the machine cancels out of the ratios.
MFU = tokens/s x (6N + 12 L s h) / the datasheet peak of the device found (train/peak_flops.py;
on CPU a measured matmul peak).

    python benchmarks/gpu_throughput.py [--device auto|cuda|cpu] [--size 886m|2.4b|tiny] [--steps 20] [--warmup 5]
        [--micro-batch 8] [--seq-len 2048] [--precision bf16|fp8] [--compile-backend inductor]
        [--variants shardwise,shardwise+compile,plain,plain+compile] [--out F] [--profile DIR] [--passes 2] [--smoke]
        [--model.k=v ...]

--precision fp8: the shardwise variants train with FP8 linears (parallel/float8.py) and the plain loop
stays bf16, so "vs plain" is FP8's speed-up over a bf16 loop; MFU still counts against the bf16 peak.
Default size on CUDA: the LLaMA of the issue (886M parameters: dim 2048, 16 layers, 16/8 heads, ffn
5632, vocab 32000, seq 2048, micro-batch 8, bf16). Without a GPU and without `--device cpu` it says so
and exits 0. On CPU (`--device cpu`): the tiny preset widened to dim 128 x 4 layers, seq 128, batch 8,
fp32 — the question there is whether compiling wins on CPU (train.compile stays off on CPU until it
does). shardwise+compile compiles at its second step (its first counts the communication eagerly), so
--warmup is at least 2 for it. --profile DIR: after its first pass's timed steps, each variant runs
--profile-steps more under torch.profiler; DIR/trace_<variant>.json.gz is its Chrome trace, and the
script ends with the GPU time per step by kernel class of every variant side by side
(benchmarks/kernel_breakdown.py; also in the JSON's "profile"). --memory-snapshot (CUDA): the shardwise variants
record the allocator's history of their first pass's warm-up steps 1-2, and step 2's peak is split into what
was there before, the gradients alive at it and the activations (benchmarks/memory_peak.py; the JSON's
runs[variant][0]["peak_split"]). --smoke: CPU, 2 warm-up steps and 1 timed
step per variant, one pass (--passes 1), aot_eager, a file of its own, --profile beside it; not a measurement. The exit status
is 0 whatever the numbers (2 for bad arguments).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_breakdown import record, table  # noqa: E402  (this folder)
from memory_peak import UNREADABLE, run_step_split  # noqa: E402  (this folder)
from overhead import write_corpus  # noqa: E402  (the same fixed stdlib corpus)
from shardwise.config import Config, build_config, parse_overrides  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models import build_model  # noqa: E402
from shardwise.spec.layout import compute_precision  # noqa: E402
from shardwise.train.data import TokenBatches, split_inputs_targets  # noqa: E402
from shardwise.train.peak_flops import device_peak_flops  # noqa: E402
from shardwise.train.trainer import Trainer  # noqa: E402

VARIANTS = ("shardwise", "shardwise+compile", "plain", "plain+compile")
# Options the default set leaves off: +fused train.fuse_projections, +head train.fp8_head (--precision fp8 only),
# +fp8 train.precision=fp8 for this variant alone.
EXTRA_VARIANTS = ("shardwise+compile+fused", "shardwise+compile+head", "shardwise+compile+fused+head",
                  "shardwise+compile+fp8")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_throughput.json"
SIZES = {
    # The H100 model (../shared/gpu/h100-runs.json): 886M parameters.
    "886m": {"model": [("model.preset", "small"), ("model.dim", "2048"), ("model.n_layers", "16"),
                       ("model.n_heads", "16"), ("model.n_kv_heads", "8"), ("model.ffn_dim", "5632"),
                       ("model.vocab_size", "32000"), ("model.max_seq_len", "2048")],
             "seq_len": 2048, "micro_batch": 8, "precision": "bf16"},
    # The second FP8 model (2.4B parameters: dim 2560, 32 layers, 32/8 heads, ffn 6912), micro-batch 4.
    "2.4b": {"model": [("model.preset", "small"), ("model.dim", "2560"), ("model.n_layers", "32"),
                       ("model.n_heads", "32"), ("model.n_kv_heads", "8"), ("model.ffn_dim", "6912"),
                       ("model.vocab_size", "32000"), ("model.max_seq_len", "2048")],
             "seq_len": 2048, "micro_batch": 4, "precision": "bf16"},
    # CPU: big enough that a step is tens of ms on 2 cores (benchmarks/overhead.py's size).
    "tiny": {"model": [("model.preset", "tiny"), ("model.dim", "128"), ("model.n_layers", "4"), ("model.ffn_dim", "384"),
                       ("model.vocab_size", "2048")],
             "seq_len": 128, "micro_batch": 8, "precision": "fp32"},
}
# --smoke: one pass (the second, in reverse order, only averages drift out of a measurement, and runs the same
# run_variant again: it halves the smoke's CPU time and checks nothing more).
SMOKE = {"size": "tiny", "steps": 1, "warmup": 2, "seq_len": 32, "micro_batch": 2, "compile_backend": "aot_eager",
         "device": "cpu", "passes": 1, "out": DEFAULT_OUT.with_name("gpu_throughput.smoke.json")}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--size", default=None, choices=sorted(SIZES), help="default: 886m on CUDA, tiny on CPU")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and pass")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp8"],
                   help="fp8: the shardwise variants train with FP8 linears; the plain loop stays bf16 (the baseline)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--profile", type=Path, default=None, help="write each variant's Chrome trace here (after timing)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per variant")
    p.add_argument("--memory-snapshot", action="store_true", help="CUDA: record the allocator's history of the shardwise "
                   "variants' warm-up steps 1-2 (first pass) and split step 2's peak (memory_peak.py)")
    p.add_argument("--passes", type=int, default=2, choices=[1, 2],
                   help="2: the variants in order, then reversed (drift cancels out of the ratios); 1: in order only")
    p.add_argument("--smoke", action="store_true", help="does the script still run? (not a measurement)")
    args, rest = p.parse_known_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args, rest = p.parse_known_args(argv)
        args.profile = args.profile or args.out.with_suffix(".profile")  # --profile's path too, beside the JSON
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS + EXTRA_VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    if any(v.endswith("+head") for v in args.variants) and args.precision != "fp8":
        p.error("--variants: +head (train.fp8_head) needs --precision fp8")
    if args.steps < 1 or args.warmup < 2 or args.profile_steps < 1:
        p.error("--steps and --profile-steps must be >= 1 and --warmup >= 2 (shardwise+compile compiles at its "
                "second step)")
    try:
        overrides = parse_overrides(rest)
    except ConfigError as e:
        p.error(str(e))
    return args, overrides


def variant_precision(name: str, args, size: dict) -> str:
    """The precision a variant trains in: fp8 for a +fp8 variant, else --precision (default: the size's)."""
    return "fp8" if name.endswith("+fp8") else args.precision or size["precision"]


def make_config(args, overrides, size: dict, tmp: Path, precision: str, compiled: bool, fused: bool = False,
                head: bool = False) -> Config:
    steps = 2 * (args.warmup + args.steps) + (args.profile_steps if args.profile else 0)
    micro = args.micro_batch or size["micro_batch"]
    base = size["model"] + [
        ("train.seq_len", str(args.seq_len or size["seq_len"])), ("train.global_batch", str(micro)),
        ("train.micro_batch", str(micro)), ("train.precision", precision),
        ("train.steps", str(steps)), ("train.compile", str(compiled).lower()),
        ("train.compile_backend", args.compile_backend), ("train.log_every", str(steps)),
        ("train.fuse_projections", str(fused).lower()), ("train.fp8_head", str(head).lower()),
        ("data.path", str(tmp / "corpus.txt")), ("data.tokenizer", "byte"), ("data.cache_dir", str(tmp / "cache"))]
    cfg = build_config({}, base + overrides)
    cfg.run.dir, cfg.run.progress, cfg.run.tensorboard = str(tmp / "run"), False, False
    cfg.checkpoint.final, cfg.checkpoint.resume, cfg.checkpoint.every = False, False, 0
    return cfg


class PlainLoop:
    """A training loop as one writes it without a framework (the issue's "plain PyTorch loop")."""

    def __init__(self, cfg: Config, batches: TokenBatches, device: torch.device, compiled: bool, backend: str):
        t = cfg.train
        self.batches, self.device, self.step = batches, device, 0
        self.tokens = t.global_batch * t.seq_len
        model = build_model(cfg.model)
        model.init_weights(t.seed)
        self.model = model.to(device)
        self.forward = torch.compile(self.model, backend=backend) if compiled else self.model
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                            {"params": rest, "weight_decay": 0.0}],
                                           lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, **fused)
        # The plain loop has no FP8: under --precision fp8 it is the bf16 baseline FP8 is measured against.
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if t.precision in ("bf16", "fp8") \
            else contextlib.nullcontext
        self.max_norm = t.grad_clip

    def train_step(self) -> float:
        inputs, targets = (x.to(self.device, non_blocking=True)
                           for x in split_inputs_targets(self.batches.global_batch_at(self.step)))
        with self.autocast():
            logits = self.forward(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / self.tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(name: str, args, overrides, size: dict, tmp: Path, device: torch.device,
                profile: Path | None = None, first_pass: bool = False) -> dict:
    """Build, warm up, time `args.steps` steps, free; tokens/s, peak memory (CUDA) and the first loss.
    `profile`: then `args.profile_steps` more under torch.profiler, their Chrome trace written there and
    their kernel breakdown returned as "profile". --memory-snapshot (`first_pass`, shardwise variants, CUDA):
    the allocator's history of warm-up steps 1-2 (run.memory_snapshot), step 2's peak split as "peak_split"
    (memory_peak.py)."""
    import torch._dynamo

    torch._dynamo.reset()  # every variant compiles from scratch (inductor's on-disk cache may still help)
    # The previous variant's trainer is freed before the peak is reset: its reference cycles (and the
    # graphs dynamo held until the reset above) would otherwise still count. Without this the H100 run of
    # 2026-11-25 read 52.9 and 61.3 GiB for two passes of the same 2.4B variant (8.4 GiB left behind).
    gc.collect()
    compiled = "+compile" in name
    cfg = make_config(args, overrides, size, tmp, variant_precision(name, args, size), compiled and name.startswith("shardwise"),
                      "+fused" in name, name.endswith("+head"))
    cfg.run.memory_snapshot = args.memory_snapshot and first_pass and device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # What is still allocated here belongs to nobody of this variant: reported, so a peak can be read net.
        leftover = torch.cuda.memory_allocated() / 2**30
    start = time.perf_counter()
    if name.startswith("shardwise"):
        trainer = Trainer(cfg, log=None, single_process=True)
        num_params, flops = trainer.num_params, trainer.flops_per_token

        def step() -> float:
            loss = trainer.train_step().loss
            trainer.snapshot.after_step(trainer.step, last=False)  # writes after step 2 when recording
            return loss
    else:
        batches = TokenBatches(_tokens(cfg), cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
        loop = PlainLoop(cfg, batches, device, compiled, args.compile_backend)
        step, num_params = loop.train_step, loop.model.num_params()
        flops = loop.model.flops_per_token(cfg.train.seq_len)
    losses = [step() for _ in range(args.warmup)]
    sync(device)
    warm_s = time.perf_counter() - start
    gc.collect()
    t0 = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = args.steps * cfg.train.global_batch * cfg.train.seq_len
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    extra: dict = {}  # the profile and the peak split: after the timing, which stands whatever they do
    if profile is not None:
        try:
            extra["profile"] = record(step, args.profile_steps, profile, lambda: sync(device))
        except (RuntimeError, OSError, ValueError) as e:
            extra["profile_error"] = str(e)
    if cfg.run.memory_snapshot:  # step 2's peak, split (this variant's file: the next variant's rewrites it)
        try:
            if split := run_step_split(tmp / "run", top=5):
                extra["peak_split"] = split
        except UNREADABLE as e:
            extra["peak_split_error"] = str(e)
    return {**extra, "variant": name, "tokens_per_s": tokens / seconds, "step_s": seconds / args.steps, "peak_gib": peak,
            "allocated_before_gib": leftover if device.type == "cuda" else None,
            "first_loss": losses[0], "warmup_s": warm_s, "num_params": num_params, "flops_per_token": flops,
            "precision": cfg.train.precision, "seq_len": cfg.train.seq_len, "micro_batch": cfg.train.micro_batch}


def _tokens(cfg: Config):
    """The run's prepared corpus as TokenBatches' sources (the trainer's own data, so both sides read one stream)."""
    from shardwise.train.data import batch_sources, prepare_data

    return batch_sources(prepare_data(cfg.data, cfg.model.vocab_size), cfg.train.seq_len, cfg.data.loss_on)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "auto":
        if not torch.cuda.is_available():
            print("gpu_throughput: no GPU visible (torch.cuda.is_available() is False): nothing to measure. "
                  "Run it on a GPU machine, or pass --device cpu to compare eager and compiled on this CPU.")
            return 0
        args.device = "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_throughput: --device cuda, but no GPU is visible", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    size = SIZES[args.size or ("886m" if device.type == "cuda" else "tiny")]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="shardwise-gpu-throughput-") as tmp_name:
        tmp = Path(tmp_name)
        write_corpus(tmp / "corpus.txt")
        for order in (args.variants, list(reversed(args.variants)))[:args.passes]:
            for variant in order:
                trace = args.profile / f"trace_{variant}.json.gz" if args.profile and not results[variant] else None
                results[variant].append(run_variant(variant, args, overrides, size, tmp, device, trace,
                                                    first_pass=not results[variant]))
                r = results[variant][-1]
                print(f"  {variant:24s} {r['tokens_per_s']:>12,.0f} tok/s  step {1e3 * r['step_s']:8.1f} ms  "
                      f"first loss {r['first_loss']:.5f}  (warm-up incl. compile {r['warmup_s']:.1f} s)", flush=True)
    precision = args.precision or size["precision"]
    # MFU against the compute dtype's peak: FP8 counts against bf16's, as the trainer does (spec/layout.py); each
    # variant against its own (a +fp8 variant's may differ from the run's), each dtype's peak found once (a CPU's
    # is measured).
    @functools.cache
    def peak_of(dtype: str) -> tuple[float, str]:
        return device_peak_flops(device.type, dtype, name if device.type == "cuda" else None)

    peak_flops, peak_label = peak_of(compute_precision(precision))

    rows = []
    for variant, runs in results.items():
        tps = statistics.mean(r["tokens_per_s"] for r in runs)
        peaks = [r["peak_gib"] for r in runs if r["peak_gib"] is not None]
        rows.append({"variant": variant, "tokens_per_s": tps, "passes": [r["tokens_per_s"] for r in runs],
                     "mfu": tps * runs[0]["flops_per_token"] / peak_of(compute_precision(runs[0]["precision"]))[0],
                     "peak_gib": max(peaks) if peaks else None,
                     "first_loss": runs[0]["first_loss"], "num_params": runs[0]["num_params"],
                     "precision": runs[0]["precision"]})
    by = {r["variant"]: r for r in rows}
    first = results[args.variants[0]][0]
    print(f"\n{name}, {precision}, seq {first['seq_len']}, micro-batch {first['micro_batch']}, "
          f"{rows[0]['num_params'] / 1e6:.1f}M params; "
          f"MFU against {peak_flops / 1e12:.1f} TFLOP/s ({peak_label})")
    print(f"{'variant':24s} {'precision':>9s} {'tokens/s':>12s} {'MFU':>7s} {'peak GiB':>9s} {'vs plain':>9s} "
          f"{'vs plain+compile':>17s}")
    for r in rows:
        vs = [f"{r['tokens_per_s'] / by[b]['tokens_per_s']:.3f}" if b in by else "-" for b in ("plain", "plain+compile")]
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        print(f"{r['variant']:24s} {r['precision']:>9s} {r['tokens_per_s']:>12,.0f} {100 * r['mfu']:>6.1f}% {peak:>9s} "
              f"{vs[0]:>9s} {vs[1]:>17s}")
    for variant, runs in results.items():
        if "peak_split" in runs[0]:
            split = runs[0]["peak_split"]
            print(f"{variant}: step 2 peak {split['peak_gib']:.2f} GiB = before the step {split['before_step_gib']:.2f} + "
                  f"gradients {split['kept_to_optimizer_gib']:.2f} + activations and transients "
                  f"{split['freed_before_optimizer_gib']:.2f} (memory_peak.py)")
    profiles = {v: runs[0].pop("profile") for v, runs in results.items() if "profile" in runs[0]}
    for variant, runs in results.items():
        if "profile_error" in runs[0]:
            print(f"{variant}: not profiled ({runs[0]['profile_error']})")
    if profiles:
        print(f"\nGPU time by kernel class, {args.profile_steps} steps profiled per variant (traces in {args.profile}):")
        print(table(list(profiles.values()), list(profiles)))
    if args.smoke:
        print("smoke run: checks that the benchmark runs; its numbers are not a measurement")
    out = {"benchmark": "gpu_throughput", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": name, "device_type": device.type, "precision": precision, "peak_flops": peak_flops,
           "peak_label": peak_label, "compile_backend": args.compile_backend, "steps": args.steps,
           "warmup": args.warmup, "rows": rows, "runs": results, "torch": torch.__version__,
           "overrides": [f"--{k}={v}" for k, v in overrides], "smoke": bool(args.smoke), "profile": profiles}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
