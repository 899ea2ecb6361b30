"""The training loss alone: shardwise's chunked cross-entropy, eager and compiled, against the plain loop's
F.cross_entropy(logits.float()), forward + backward, in one run.

    python benchmarks/cross_entropy.py [--device auto|cuda|cpu] [--tokens 16384] [--vocab 32000]
        [--dtype bf16|fp32] [--reps 10] [--out F] [--smoke]

The logits are those of a micro-batch (default: the 886M LLaMA's 8 x 2048 tokens of a 32k vocabulary in
bf16, ../shared/gpu/h100-2026-11-25); each variant's time is the median of --reps forward + backward
passes after two warm-up passes (compilation happens there), and its memory the peak above the logits
(CUDA: torch.cuda.max_memory_allocated; CPU: not measured). The target (issue 27): the compiled chunked
loss at least as fast as the plain one, without the plain one's fp32 copy of every logit. CPU defaults:
4096 tokens x 32000, bf16. --smoke: CPU, tiny sizes, 1 repetition, aot_eager: checks that it runs.
JSON: benchmarks/results/cross_entropy.json (cross_entropy.smoke.json with --smoke) or --out. Exit 0
whatever the numbers (2 for bad arguments).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardwise.spec.loss import LOSS_CHUNK_BYTES  # noqa: E402
from shardwise.train.loss import LossKernels, token_cross_entropy_sum  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cross_entropy.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--tokens", type=int, default=None, help="default: 16384 on CUDA, 4096 on CPU")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="does the script still run? (not a measurement)")
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.tokens, a.vocab, a.reps, a.backend = "cpu", 96, 512, 1, "aot_eager"
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    a.tokens = a.tokens or (16384 if a.device == "cuda" else 4096)
    a.out = a.out or (DEFAULT_OUT.with_name("cross_entropy.smoke.json") if a.smoke else DEFAULT_OUT)
    if a.reps < 1 or a.tokens < 1 or a.vocab < 2:
        p.error("--reps, --tokens must be >= 1 and --vocab >= 2")
    return a


def measure(fn, logits: torch.Tensor, reps: int) -> dict:
    """Median ms of forward + backward after 2 warm-up passes, the peak memory above the logits (CUDA),
    and the loss (every variant must agree: the same sum, to fp32 rounding)."""
    cuda = logits.device.type == "cuda"
    times, peak, first = [], None, None
    for i in range(2 + reps):
        x = logits.detach().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = fn(x)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        if i >= 2:
            times.append(time.perf_counter() - start)
        first = loss.item() if first is None else first
    return {"ms": statistics.median(times) * 1e3, "peak_mib_above_logits": peak, "loss": first}


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(a.tokens, a.vocab, generator=g) * 2).to(dtype).to(device)
    targets = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(device)
    # The trainer's chunks: LOSS_CHUNK_BYTES of fp32 logits; smaller in --smoke so that several chunks run.
    chunk_bytes = 32 * 4 * a.vocab if a.smoke else LOSS_CHUNK_BYTES
    compiled = LossKernels.compiled(a.backend)
    variants = {
        "plain F.cross_entropy(logits.float())": lambda x: F.cross_entropy(x.float(), targets, reduction="sum"),
        "chunked, eager": lambda x: token_cross_entropy_sum(x, targets, chunk_bytes=chunk_bytes),
        f"chunked, compiled ({a.backend})": lambda x: token_cross_entropy_sum(x, targets, chunk_bytes=chunk_bytes,
                                                                              kernels=compiled),
    }
    rows = []
    for name, fn in variants.items():
        rows.append({"variant": name, **measure(fn, logits, a.reps)})
    plain = rows[0]["ms"]
    print(f"cross-entropy forward + backward on {a.device}: {a.tokens} tokens x vocab {a.vocab}, {a.dtype} logits, "
          f"median of {a.reps}")
    print(f"{'variant':40s} {'ms':>9s} {'vs plain':>9s} {'peak MiB':>9s}")
    for r in rows:
        r["speedup_vs_plain"] = plain / r["ms"]
        peak = "" if r["peak_mib_above_logits"] is None else f"{r['peak_mib_above_logits']:9.0f}"
        print(f"{r['variant']:40s} {r['ms']:9.2f} {r['speedup_vs_plain']:8.2f}x {peak:>9s}")
    if a.smoke:
        print("smoke run: checks that the benchmark runs; its numbers are not a measurement")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                                 "torch": torch.__version__, "tokens": a.tokens, "vocab": a.vocab, "dtype": a.dtype,
                                 "reps": a.reps, "smoke": a.smoke, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
