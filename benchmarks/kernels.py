"""Kernel microbenchmarks behind the planner's time model (plan/cost.py; constants in plan/constants.py).

Each section measures what one planner constant assumes, so the constant can cite a run of this script:
  gemm       FLOP/s of F.linear / torch.mm for squares, a transformer block's forward, dgrad (dX = dY W) and
             wgrad (dW = dY^T X) GEMMs at --gemm-tokens token counts, and skinny decode shapes (m = 1, 4, 16),
             as a fraction of the device peak: MAMF_FRACTION, tile/wave quantization (GEMM_TILE_M/N,
             COMPUTE_UNITS) and the roofline; on a GPU of spec/hardware.py's table, cost.gemm_time's prediction
             is printed beside each shape. On CPU the peak is measured (the best square matmul here or
             train/peak_flops.py's probe), and the planner prices each GEMM at the efficiency of the measured
             shapes nearest it (plan/calibration.py MeasuredDevice.gemm_shapes).
  sdpa       causal F.scaled_dot_product_attention, torch's default and each backend forced (sdpa_kernel),
             with enable_gqa as models/common.py calls it and with K/V expanded to all heads: forward and
             forward+backward FLOP/s counting the causal half, against ATTENTION_FRACTION; the backend that
             ran (the aten op dispatched, cross-checked with torch._fused_sdp_choice); the bytes autograd
             saves besides q, k, v and the output, in s x s probability matrices (a fused kernel: ~0); on
             CUDA the forward's peak memory delta too.
  sdpa_lengths  causal SDPA forward + backward per --sdpa-seqs length at the same tokens a call, torch's
             default kernel and FlashAttention-2, each length's rate over the shortest's; and one context-
             parallel rank per --sdpa-cps degree, as torch's load-balanced ring computes it at the longest
             length a rank, over that length's single call (kernel_sdpa_lengths.py).
  bandwidth  dst.copy_(src), x.sum() and torch.add(a, b, alpha=s, out=c) on tensors far larger than the
             caches, GB/s counting bytes read + written: HBM_FRACTION of the datasheet bandwidth.
  optimizer  AdamW step (foreach, fused) over N fp32 parameters in tensors of the model's shapes, and
             clip_grad_norm_: OPTIMIZER_BYTES_PER_PARAM x N / time, the planner's time (N x that constant /
             (datasheet x HBM_FRACTION); on CPU / the measured copy rate), and the bytes per parameter the
             measured time is worth at the measured copy rate.
  overhead   a chain of tiny dependent `x = x + 1` (1024 elements), time per op: eager, eager with autograd
             (forward + backward), and torch.compile'd (inductor fuses the chain; time per original op):
             the per-kernel launch/dispatch overhead of eager against compiled execution; and a real block's
             host cost per kernel on 1 token, plain and under full / selective checkpointing.
  sustained  one n^3 matmul (--sustained-n, 8192 on a GPU) looped for --sustained-s (30 s) in windows of
             --window-s, with NVML's SM clock, board power and clock-event reasons per window: whether a
             GEMM's rate under a sustained load falls below its first window's (kernel_sustained.py).
Times: the median of --reps repetitions after --warmup untimed calls; a repetition loops the call for
about --target-s and divides (best_s in the JSON is the fastest repetition); CUDA is synchronised before
and after each repetition. Small GEMM operands rotate over copies so they are not served from cache.

On a GPU machine (defaults: bf16, the 886M LLaMA of ../shared/gpu/h100-runs.json: dim 2048, ffn 5632, 16/8
heads, 16384 tokens = micro-batch 8 x seq 2048; 1 GiB tensors; 100M optimizer parameters):
    python benchmarks/kernels.py [--device auto|cuda|cpu] [--dtype bf16|fp16|fp32] [--dim --ffn --heads
        --kv-heads --tokens --seq] [--squares 4096,8192] [--gemm-tokens T,T/2,T/4] [--decode-m 1,4,16] [--sdpa-dtypes bf16,fp32]
        [--sdpa-seqs 2048,8192,32768] [--sdpa-cps 2,4,8]
        [--bytes N] [--opt-params N] [--chain-ops 1000] [--sustained-n 8192 --sustained-s 30 --window-s 1]
        [--reps 5] [--sections gemm,sdpa,...] [--no-compile]
        [--out F] [--smoke]
CPU defaults: fp32, dim 256, ffn 704, 4/2 heads, 1024 tokens (seq 256), 256 MiB tensors, 10M parameters.
--smoke: CPU, tiny sizes, 1 repetition, compile skipped: checks that it runs, not a measurement. JSON:
benchmarks/results/kernels.json (kernels.smoke.json with --smoke) or --out. Exit 0 (2: bad arguments).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import math
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kernel_overhead import overhead_section  # noqa: E402  (this folder)
from kernel_sdpa_lengths import sdpa_lengths_section  # noqa: E402  (this folder)
from kernel_sustained import sustained_section  # noqa: E402  (this folder)
from kernel_timing import DTYPES, Timer, backward, cell, reason  # noqa: E402  (this folder)
from shardwise.plan import constants as C  # noqa: E402
from shardwise.plan.cost import gemm_time  # noqa: E402
from shardwise.spec.hardware import DEVICES, match_cuda_name, normalize_dtype  # noqa: E402
from shardwise.train.peak_flops import device_peak_flops  # noqa: E402

SECTIONS = ("gemm", "sdpa", "sdpa_lengths", "bandwidth", "optimizer", "overhead", "sustained")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernels.json"
DEFAULTS = {  # per device type; any option given overrides
    "cuda": {"dtype": "bf16", "dim": 2048, "ffn": 5632, "heads": 16, "kv_heads": 8, "tokens": 16384, "seq": 2048,
             "squares": "4096,8192", "sdpa_dtypes": "bf16,fp32", "sdpa_seqs": "2048,8192,32768", "sdpa_cps": "2,4,8",
             "bytes": 2**30, "opt_params": 100_000_000,
             "flush_bytes": 256 * 2**20, "sustained_n": 8192, "sustained_s": 30.0, "window_s": 1.0},
    "cpu": {"dtype": "fp32", "dim": 256, "ffn": 704, "heads": 4, "kv_heads": 2, "tokens": 1024, "seq": 256,
            "squares": "512,1024,2048", "sdpa_dtypes": "fp32,bf16", "sdpa_seqs": "256,512", "sdpa_cps": "2",
            "bytes": 256 * 2**20, "opt_params": 10_000_000,
            "flush_bytes": 64 * 2**20, "sustained_n": 1024, "sustained_s": 3.0, "window_s": 0.5},
}
SMOKE = {"device": "cpu", "dim": 64, "ffn": 176, "heads": 4, "kv_heads": 2, "tokens": 64, "seq": 32, "squares": "128",
         "sdpa_seqs": "32,64", "sdpa_cps": "2,4",
         "decode_m": "1,4", "bytes": 4 * 2**20, "opt_params": 200_000, "chain_ops": 50, "reps": 1, "warmup": 1,
         "target_s": 0.0, "sustained_n": 64, "sustained_s": 0.05, "window_s": 0.01,
         "out": DEFAULT_OUT.with_name("kernels.smoke.json")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", choices=sorted(DTYPES), help="GEMM dtype (default bf16 on CUDA, fp32 on CPU)")
    for name in ("dim", "ffn", "heads", "kv-heads", "tokens", "seq", "bytes", "opt-params"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--squares", help="square GEMM sizes n (n x n x n), comma-separated")
    p.add_argument("--decode-m", default="1,4,16", help="rows of the skinny decode GEMMs")
    p.add_argument("--gemm-tokens", help="token counts of the block GEMMs, comma-separated (default: --tokens, "
                   "/2, /4: a CPU's planner prices each GEMM at the measured shape nearest it)")
    p.add_argument("--sdpa-dtypes", help="dtypes of the SDPA section, comma-separated")
    p.add_argument("--sdpa-seqs", help="sequence lengths of the sdpa_lengths section, comma-separated (the same "
                   "--tokens per call)")
    p.add_argument("--sdpa-cps", help="context-parallel degrees of the sdpa_lengths section's cp rows (one ring rank "
                   "holding the longest --sdpa-seqs), comma-separated")
    p.add_argument("--chain-ops", type=int, default=1000, help="length of the tiny-op chain (overhead section)")
    p.add_argument("--sustained-n", type=int, help="size n of the sustained section's n x n x n matmul")
    p.add_argument("--sustained-s", type=float, help="how long the sustained section loops it (seconds)")
    p.add_argument("--window-s", type=float, help="the sustained section's timing window (seconds)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--target-s", type=float, default=0.05, help="approximate length of one timed repetition")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile row of the overhead section")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true", help="does the script still run? (not a measurement)")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "kernels: --device cuda, but no GPU is visible (torch.cuda.is_available() is False)\n")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.gemm_tokens = args.gemm_tokens or ",".join(str(max(1, args.tokens // d)) for d in (1, 2, 4))
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not set(args.sections) <= set(SECTIONS) or args.reps < 1 or args.dim % args.heads or args.heads % args.kv_heads \
            or args.sustained_n < 1 or not args.sustained_s > 0 or not args.window_s > 0:
        p.error(f"--sections from {SECTIONS}; --reps >= 1; dim divisible by heads, heads by kv-heads; "
                "--sustained-n >= 1, --sustained-s and --window-s > 0")
    return args


# ---------------------------------------------------------------------------------------------------------------
def gemm_shapes(a) -> list[tuple[str, str, int, int, int]]:
    """(label, kind, M, N, K): output M x N, reduction K. A weight W (n, k) of the block: forward
    Y = X W^T (T, n, k); dgrad dX = dY W (T, k, n); wgrad dW = dY^T X (n, k, T)."""
    kv_dim = a.kv_heads * (a.dim // a.heads)
    weights = [("q/o proj", a.dim, a.dim), ("k/v proj", kv_dim, a.dim), ("gate/up", a.ffn, a.dim), ("down", a.dim, a.ffn)]
    rows = [(f"square {n}", "fwd", n, n, n) for n in map(int, a.squares.split(","))]
    for t in map(int, a.gemm_tokens.split(",")):
        at = f" @{t}" if t != a.tokens else ""
        for name, n, k in weights:
            rows += [(f"{name} fwd{at}", "fwd", t, n, k), (f"{name} dgrad{at}", "dgrad", t, k, n),
                     (f"{name} wgrad{at}", "wgrad", n, k, t)]
    for m in map(int, a.decode_m.split(",")):
        rows += [(f"decode m={m} {name}", "fwd", m, n, k) for name, n, k in (weights[0], weights[2], weights[3])]
    return rows


GEMM_OPS = {"fwd": F.linear, "dgrad": torch.mm, "wgrad": lambda x, w: torch.mm(x.t(), w)}


def _rotating(op, pairs: list):
    """A call of `op` on the next operand pair, round robin."""
    turn = iter(range(1 << 62))
    return lambda: op(*pairs[next(turn) % len(pairs)])


def gemm_section(a, device, dtype, timer, ctx) -> dict:
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for label, kind, m, n, k in gemm_shapes(a):
        a_shape = (k, m) if kind == "wgrad" else (m, k)   # wgrad multiplies dY^T: a transposed view
        b_shape = (n, k) if kind == "fwd" else (k, n)     # fwd runs F.linear (nn.Linear's kernel) on W (n, k)
        nbytes = elem * (m * k + k * n + m * n)
        copies = max(1, min(64, math.ceil(a.flush_bytes / nbytes)))  # rotate operands: not served from cache
        pairs = [(torch.randn(a_shape, device=device, dtype=dtype), torch.randn(b_shape, device=device, dtype=dtype))
                 for _ in range(copies)]
        t = timer(_rotating(GEMM_OPS[kind], pairs))
        rows.append({"label": label, "kind": kind, "m": m, "n": n, "k": k, **t, "flops": 2 * m * n * k / t["median_s"],
                     "operand_gbps": nbytes / t["median_s"] / 1e9, "operand_copies": copies})
    if device.type == "cpu":
        squares = [r["flops"] for r in rows if r["label"].startswith("square")]
        peak = max(squares + [device_peak_flops("cpu", a.dtype)[0]])
        label = f"measured: best square matmul here or train/peak_flops.py's probe, {torch.get_num_threads()} threads"
    else:
        peak, label = device_peak_flops("cuda", a.dtype, ctx["device"])
    for r in rows:
        r["fraction_of_peak"] = r["flops"] / peak
        r["planner_s"] = None
        if ctx["entry"] is not None:  # cost.gemm_time: MAMF x tile x wave quantization, roofline on HBM
            with contextlib.suppress(Exception):
                r["planner_s"] = gemm_time(ctx["entry"], peak, ctx["hbm_gbps"], r["m"], r["n"], r["k"], elem)
        r["measured_over_planner"] = r["median_s"] / r["planner_s"] if r["planner_s"] else None
    print(f"\nGEMM, {a.dtype}; peak {peak / 1e12:.3f} TFLOP/s ({label})")
    print(f"{'shape':26s} {'M':>6s} {'N':>6s} {'K':>6s} {'ms':>9s} {'TFLOP/s':>9s} {'of peak':>8s} {'GB/s':>8s} "
          f"{'planner ms':>10s} {'meas/plan':>9s}")
    for r in rows:
        print(f"{r['label']:26s} {r['m']:>6d} {r['n']:>6d} {r['k']:>6d} {1e3 * r['median_s']:>9.3f} "
              f"{r['flops'] / 1e12:>9.3f} {100 * r['fraction_of_peak']:>7.1f}% {r['operand_gbps']:>8.1f} "
              f"{cell(r['planner_s'], 10, '.3f', 1e3)} {cell(r['measured_over_planner'], 9, '.2f')}")
    return {"dtype": a.dtype, "peak_flops": peak, "peak_label": label, "mamf_fraction_planner":
            C.MAMF_FRACTION.get(ctx["entry"], C.MAMF_FRACTION_DEFAULT) if ctx["entry"] else None, "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
class _AtenOps(TorchDispatchMode):
    """Records the aten ops dispatched below autograd: which attention kernel SDPA chose."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _backend_of(ops: list[str]) -> str:
    for key, name in (("flash_attention", "FLASH_ATTENTION"), ("efficient_attention", "EFFICIENT_ATTENTION"),
                      ("cudnn_attention", "CUDNN_ATTENTION"), ("overrideable", "OVERRIDEABLE")):
        if any(key in op for op in ops):
            return name
    return "MATH"  # the math path decomposes into bmm / softmax


def sdpa_section(a, device, timer, peak_of, attention_fraction: float | None) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {int(v): k for k, v in SDPBackend.__members__.items()}
    batch, (h, kv, s, d) = max(1, a.tokens // a.seq), (a.heads, a.kv_heads, a.seq, a.dim // a.heads)
    fwd_flops = 4.0 * batch * h * s * s * d * C.CAUSAL_EXECUTED_FRACTION  # QK^T and PV, causal half executed
    backends = [("default", None)] + [(n, getattr(SDPBackend, n)) for n in
                                      ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")]
    rows = []
    for dtype_name in a.sdpa_dtypes.split(","):
        dtype = DTYPES[dtype_name]
        peak = peak_of(dtype_name)
        for gqa in (True, False):
            q = torch.randn(batch, h, s, d, device=device, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(batch, kv if gqa else h, s, d, device=device, dtype=dtype, requires_grad=True)
                    for _ in range(2))
            fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=gqa)
            fwd_bwd = functools.partial(backward, fwd, (q, k, v), torch.randn_like(q))
            for label, backend in backends:
                row = {"dtype": dtype_name, "enable_gqa": gqa, "requested": label, "batch": batch, "heads": h,
                       "kv_heads": kv if gqa else h, "seq": s, "head_dim": d}
                try:
                    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                        with _AtenOps() as seen:
                            fwd()
                        row["backend"] = _backend_of(seen.ops)
                        with contextlib.suppress(Exception):
                            row["fused_sdp_choice"] = names.get(int(torch._fused_sdp_choice(
                                q, k, v, is_causal=True, enable_gqa=gqa)))
                        row.update(_attention_memory(fwd, (q, k, v), device))
                        f, fb = timer(fwd), timer(fwd_bwd)
                except RuntimeError as e:
                    rows.append({**row, "backend": None, "unsupported": reason(e)})
                    continue
                row.update({"fwd_s": f["median_s"], "fwd_bwd_s": fb["median_s"], "fwd_best_s": f["best_s"],
                            "fwd_bwd_best_s": fb["best_s"], "fwd_flops": fwd_flops / f["median_s"],
                            "fwd_bwd_flops": 3 * fwd_flops / fb["median_s"]})  # backward = 2 x forward (cost.py)
                row["probs_copies_saved"] = row["saved_extra_bytes"] / (batch * h * s * s * q.element_size())
                row["fwd_bwd_fraction_of_peak"] = row["fwd_bwd_flops"] / peak if peak else None
                rows.append(row)
            if device.type == "cuda" and gqa:  # train.document_mask's kernel (plan/constants.py "flex": assumed)
                rows.append(_flex_row(q, k, v, timer, fwd_flops, peak, {
                    "dtype": dtype_name, "enable_gqa": gqa, "requested": "FLEX (causal block mask)", "batch": batch,
                    "heads": h, "kv_heads": kv, "seq": s, "head_dim": d}))
    print(f"\nSDPA, causal, batch {batch} x {h} heads ({kv} KV heads with GQA) x seq {s} x head_dim {d}; "
          f"backend = aten op dispatched; FLOP/s count the causal half, fwd+bwd counts 3 x fwd")
    print(f"{'dtype':5s} {'gqa':>5s} {'requested':19s} {'backend ran':19s} {'fwd ms':>8s} {'f+b ms':>8s} "
          f"{'fwd TF/s':>8s} {'f+b TF/s':>8s} {'of peak':>7s} {'s x s saved':>11s} {'fwd peak MiB':>12s}")
    for r in rows:
        head = f"{r['dtype']:5s} {str(r['enable_gqa']):>5s} {r['requested']:19s}"
        if r["backend"] is None:
            print(f"{head} unsupported ({r['unsupported'][:90]})")
            continue
        print(f"{head} {r['backend']:19s} {1e3 * r['fwd_s']:8.3f} {1e3 * r['fwd_bwd_s']:8.3f} {r['fwd_flops'] / 1e12:8.3f} "
              f"{r['fwd_bwd_flops'] / 1e12:8.3f} {cell(r['fwd_bwd_fraction_of_peak'], 7, '.1%')} "
              f"{r['probs_copies_saved']:11.2f} {cell(r['fwd_peak_bytes'], 12, '.1f', 2**-20)}")
    default = {f"{r['dtype']}{' gqa' if r['enable_gqa'] else ''}": r["backend"] for r in rows if r["requested"] == "default"}
    print("torch's default choice: " + ", ".join(f"{k}: {v}" for k, v in default.items()))
    return {"detection": "aten op dispatched under a TorchDispatchMode (flash / efficient / cudnn attention op, "
                         "else MATH); fused_sdp_choice = torch._fused_sdp_choice for the same call",
            "default_backend": default, "attention_fraction_planner": attention_fraction, "rows": rows}


def _flex_row(q, k, v, timer, fwd_flops: float, peak: float | None, row: dict) -> dict:
    """Compiled FlexAttention with a causal block mask: the same tiles as causal SDPA, so its FLOP/s beside the
    SDPA rows is the per-tile speed the planner assumes for document masking (ATTENTION_KERNEL_SPEED["flex"])."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        mask = create_block_mask(lambda _b, _h, qi, ki: ki <= qi, None, None, q.shape[2], k.shape[2], device=q.device)
        flex = torch.compile(flex_attention, dynamic=False)
        fwd = functools.partial(flex, q, k, v, block_mask=mask, enable_gqa=True)
        fwd_bwd = functools.partial(backward, fwd, (q, k, v), torch.randn_like(q))
        fwd_bwd()  # compiles forward and backward outside the timing
        f, fb = timer(fwd), timer(fwd_bwd)
    except Exception as e:  # noqa: BLE001 - inductor / triton failures vary; the row says why
        return {**row, "backend": None, "unsupported": reason(e)}
    row.update({"backend": "FLEX", "fwd_s": f["median_s"], "fwd_bwd_s": fb["median_s"], "fwd_best_s": f["best_s"],
                "fwd_bwd_best_s": fb["best_s"], "fwd_flops": fwd_flops / f["median_s"],
                "fwd_bwd_flops": 3 * fwd_flops / fb["median_s"], "probs_copies_saved": 0.0, "fwd_peak_bytes": None})
    row["fwd_bwd_fraction_of_peak"] = row["fwd_bwd_flops"] / peak if peak else None
    return row


def _attention_memory(fwd, inputs, device) -> dict:
    """Bytes autograd saves for backward other than the inputs and the output (saved-tensor hooks, distinct
    storages), and on CUDA the forward's peak allocation above what was allocated before it."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fwd()
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    for t in (*inputs, out):
        saved.pop(t.untyped_storage().data_ptr(), None)
    return {"saved_extra_bytes": sum(saved.values()), "fwd_peak_bytes": peak}


# ---------------------------------------------------------------------------------------------------------------
def bandwidth_section(a, device, timer, datasheet_gbps) -> dict:
    n = a.bytes // 4
    x, y, z = (torch.rand(n, device=device) for _ in range(3))
    kernels = [("copy  dst.copy_(src)", lambda: z.copy_(x), 2), ("read  x.sum()", lambda: x.sum(), 1),
               ("triad torch.add(a, b, alpha=s, out=c)", lambda: torch.add(x, y, alpha=0.5, out=z), 3)]
    rows = []
    for label, fn, touches in kernels:
        t = timer(fn)
        gbps = touches * 4 * n / t["median_s"] / 1e9
        rows.append({"kernel": label.split()[0], "call": label.split(None, 1)[1], "bytes_per_tensor": 4 * n,
                     "bytes_moved": touches * 4 * n, **t, "gbps": gbps,
                     "fraction_of_datasheet": gbps / datasheet_gbps if datasheet_gbps else None})
    ref = f"datasheet {datasheet_gbps:.0f} GB/s, planner assumes {C.HBM_FRACTION:.0%} of it" if datasheet_gbps \
        else "no datasheet for this device"
    print(f"\nmemory bandwidth, fp32 tensors of {4 * n / 2**20:.0f} MiB; bytes read + written ({ref})")
    print(f"{'kernel':40s} {'ms':>9s} {'GB/s':>9s} {'of datasheet':>12s}")
    for r in rows:
        print(f"{r['kernel'] + ' ' + r['call']:40s} {1e3 * r['median_s']:9.3f} {r['gbps']:9.1f} "
              f"{cell(r['fraction_of_datasheet'], 12, '.1%')}")
    return {"datasheet_gbps": datasheet_gbps, "hbm_fraction_planner": C.HBM_FRACTION, "rows": rows}


def optimizer_section(a, device, timer, stream_gbps, datasheet_gbps) -> dict:
    kv_dim = a.kv_heads * (a.dim // a.heads)
    shapes = [(a.dim, a.dim), (kv_dim, a.dim), (kv_dim, a.dim), (a.dim, a.dim), (a.ffn, a.dim), (a.ffn, a.dim),
              (a.dim, a.ffn), (a.dim,), (a.dim,)]  # one block: q k v o, gate up down, two norms
    sizes, total = [], 0
    while total < a.opt_params:
        shape = shapes[len(sizes) % len(shapes)]
        sizes.append(shape)
        total += math.prod(shape)
    rows = []
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(0.02 * torch.randn(shape, device=device)) for shape in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        row = {"impl": name, "params": total, "tensors": len(params)}
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kw)
            step = timer(opt.step)
        except (RuntimeError, ValueError) as e:
            rows.append({**row, "unavailable": reason(e)})
            continue
        clip = timer(functools.partial(torch.nn.utils.clip_grad_norm_, params, 1.0, foreach=True))
        row.update({"step_s": step["median_s"], "step_best_s": step["best_s"], "clip_s": clip["median_s"],
                    "planner_bytes_per_s": C.OPTIMIZER_BYTES_PER_PARAM * total / step["median_s"]})
        for key, t in (("bytes_per_param_at_copy_bw", step), ("clip_bytes_per_param_at_copy_bw", clip)):
            row[key] = t["median_s"] * stream_gbps * 1e9 / total if stream_gbps else None  # what the time is worth
        hbm = datasheet_gbps * C.HBM_FRACTION if datasheet_gbps else stream_gbps
        row["planner_s"] = total * C.OPTIMIZER_BYTES_PER_PARAM / (hbm * 1e9) if hbm else None
        rows.append(row)
        del opt, params
        gc.collect()
    basis = (f"datasheet x HBM_FRACTION = {datasheet_gbps * C.HBM_FRACTION:.0f} GB/s" if datasheet_gbps
             else "the measured copy bandwidth")
    print(f"\nAdamW step, {total / 1e6:.1f}M fp32 params in {len(sizes)} tensors of the model's shapes; "
          f"planner: {C.OPTIMIZER_BYTES_PER_PARAM:g} B/param at {basis}")
    print(f"{'impl':8s} {'step ms':>9s} {'planner ms':>10s} {'N x B/param / step, GB/s':>24s} "
          f"{'B/param @copy':>13s} {'clip ms':>8s} {'clip B/param @copy':>18s}")
    for r in rows:
        if "unavailable" in r:
            print(f"{r['impl']:8s} unavailable ({r['unavailable']})")
            continue
        print(f"{r['impl']:8s} {1e3 * r['step_s']:9.2f} {cell(r['planner_s'], 10, '.2f', 1e3)} "
              f"{r['planner_bytes_per_s'] / 1e9:24.1f} {cell(r['bytes_per_param_at_copy_bw'], 13)} "
              f"{1e3 * r['clip_s']:8.2f} {cell(r['clip_bytes_per_param_at_copy_bw'], 18)}")
    return {"optimizer_bytes_per_param_planner": C.OPTIMIZER_BYTES_PER_PARAM, "copy_gbps": stream_gbps, "rows": rows}


# ---------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    entry = match_cuda_name(name) if device.type == "cuda" else None
    datasheet_gbps = DEVICES[entry].memory_bandwidth_gbps if entry else None
    ctx = {"device": name, "entry": entry, "hbm_gbps": datasheet_gbps}
    timer = Timer(device, a.reps, a.warmup, a.target_s)
    print(f"{name} ({device.type}{', table entry ' + entry if entry else ''}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {a.reps} repetition(s) after {a.warmup} warm-up call(s)")
    out: dict = {"benchmark": "kernels", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "machine": platform.platform(), "cpu": platform.processor(), "device": name,
                 "device_type": device.type, "device_entry": entry, "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "dtype": a.dtype, "smoke": bool(a.smoke), "reps": a.reps,
                 "warmup": a.warmup, "timing": "median seconds per call over reps; best_s = fastest rep",
                 "model": {k: getattr(a, k) for k in ("dim", "ffn", "heads", "kv_heads", "tokens", "seq")}}
    if "gemm" in a.sections:
        with torch.no_grad():
            out["gemm"] = gemm_section(a, device, dtype, timer, ctx)

    def peak_of(dtype_name: str) -> float | None:
        if device.type == "cpu" and dtype_name == a.dtype and "gemm" in out:
            return out["gemm"]["peak_flops"]
        try:
            return device_peak_flops(device.type, normalize_dtype(dtype_name), name)[0]
        except Exception:  # noqa: BLE001 - e.g. no published fp32 peak: fractions are left out
            return None

    attention_fraction = C.ATTENTION_FRACTION.get(C.family(entry), C.ATTENTION_FRACTION_DEFAULT) if entry else None
    if "sdpa" in a.sections:
        out["sdpa"] = sdpa_section(a, device, timer, peak_of, attention_fraction)
    if "sdpa_lengths" in a.sections:
        out["sdpa_lengths"] = sdpa_lengths_section(a, device, timer, peak_of)
    if "bandwidth" in a.sections:
        with torch.no_grad():
            out["bandwidth"] = bandwidth_section(a, device, timer, datasheet_gbps)
    copy_gbps = next((r["gbps"] for r in out.get("bandwidth", {}).get("rows", []) if r["kernel"] == "copy"), None)
    if "optimizer" in a.sections:
        out["optimizer"] = optimizer_section(a, device, timer, copy_gbps, datasheet_gbps)
    if "overhead" in a.sections:
        out["overhead"] = overhead_section(a, device, timer)
    if "sustained" in a.sections:
        with torch.no_grad():
            out["sustained"] = sustained_section(a, device, dtype, peak_of(a.dtype))
    if a.smoke:
        print("smoke run: checks that the benchmark runs; its numbers are not a measurement")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
