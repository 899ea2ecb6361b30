"""How benchmarks/kernels.py times a call and prints a cell (shared by its sections)."""
from __future__ import annotations

import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Timer:
    """Median (and best) seconds per call: `warmup` untimed calls, then `reps` repetitions of a loop of calls
    lasting about `target_s` (the loop length found by doubling it from 1 call, so one slow call cannot size it).
    CUDA: synchronised before and after each loop."""

    def __init__(self, device: torch.device, reps: int, warmup: int, target_s: float):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.reps, self.warmup, self.target_s = reps, warmup, target_s

    def elapsed(self, fn, calls: int) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return time.perf_counter() - start

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        calls, spent = 1, self.elapsed(fn, 1)
        while spent < self.target_s / 4 and calls < 10_000:
            calls *= 2
            spent = self.elapsed(fn, calls)
        calls = max(1, min(10_000, round(calls * self.target_s / max(spent, 1e-9))))
        times = sorted(self.elapsed(fn, calls) / calls for _ in range(self.reps))
        return {"median_s": statistics.median(times), "best_s": times[0], "calls_per_rep": calls}


def reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def cell(value: float | None, width: int, spec: str = ".1f", scale: float = 1.0) -> str:
    """`value * scale` formatted to `width`, or "n/a"."""
    return f"{value * scale:{width}{spec}}" if value is not None else f"{'n/a':>{width}s}"


def backward(fwd, inputs: tuple, grad_out: torch.Tensor):
    """One forward of `fwd` and its backward to `inputs`: what a section times as forward + backward."""
    return torch.autograd.grad(fwd(), inputs, grad_out)
