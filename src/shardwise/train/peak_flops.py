"""The MFU denominator of a running device: the datasheet peak of a known GPU (spec/hardware.py's
table), or a measured matmul probe where there is no datasheet (the CPU, an unknown GPU). It imports
torch, so it lives with the trainer rather than in the torch-free spec floor."""
from __future__ import annotations

import functools
import time

from shardwise.errors import ConfigError
from shardwise.spec.hardware import DEVICES, match_cuda_name, normalize_dtype


def device_peak_flops(device_type: str, dtype: str, cuda_name: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s, label) of one device for the training dtype — the MFU denominator
    (docs/architecture.md §5).

    CUDA: the datasheet dense peak of the matched table entry; fp32 uses the TF32 peak when PyTorch
    is allowed to run fp32 matmuls in TF32 (`torch.backends.cuda.matmul.allow_tf32`). An unknown
    GPU is measured with the matmul probe. CPU: always measured (see `measure_cpu_peak_flops`).
    """
    key = normalize_dtype(dtype)
    if device_type == "cuda":
        import torch

        name = cuda_name if cuda_name is not None else torch.cuda.get_device_name()
        entry = match_cuda_name(name)
        if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
        if entry is not None:
            return DEVICES[entry].peak_flops(key), f"{entry} datasheet dense {key} peak, {name}"
        flops = _measure_matmul_flops(key, "cuda", 0)
        return flops, f"{name}, measured {key} matmul probe: not in spec/hardware.py"
    if device_type == "cpu":
        import torch

        flops = measure_cpu_peak_flops(key)
        threads = torch.get_num_threads()
        return flops, f"cpu, measured {key} matmul probe on {threads} thread{'s' if threads > 1 else ''}"
    raise ConfigError("device", f"no peak FLOP/s source for device type {device_type!r}", 'use "cuda" or "cpu"')


def measure_cpu_peak_flops(dtype: str) -> float:
    """Achieved FLOP/s of a square CPU matmul in `dtype` with the current thread count (< 1 s).

    Best of a few timed trials after a warm-up. The result is cached per (dtype, threads): a probe
    is a property of the machine, not of the run. tf32 has no CPU meaning and is probed as fp32.
    """
    import torch

    key = normalize_dtype(dtype)
    return _measure_matmul_flops("fp32" if key == "tf32" else key, "cpu", torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measure_matmul_flops(key: str, device_type: str, threads: int) -> float:
    """Best achieved FLOP/s of `F.linear(A, B)` for n x n matrices (2 n^3 FLOP each).

    F.linear, not torch.mm, because it is the kernel nn.Linear runs: on an AVX2-only CPU (this
    project's 2-core machine) bf16/fp16 `torch.mm` takes a ~1 GFLOP/s fallback while F.linear goes
    through oneDNN at ~15-20 GFLOP/s. n is 512 unless a 128 x 128 warm-up shows a slow kernel, in
    which case it shrinks so one product stays under ~50 ms and the whole probe well under 1 s.
    `threads` is only part of the cache key (the probe depends on torch.get_num_threads()).
    """
    import torch
    import torch.nn.functional as F

    dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if key not in dtypes:
        raise ConfigError("train.precision", f"cannot probe {key} matmuls on {device_type}",
                          'use "fp32", "bf16" or "fp16"')
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(n, n, generator=gen).to(device_type, dtypes[key]) for _ in range(2))

    def seconds(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            F.linear(a, b)
        sync()
        return max(time.perf_counter() - start, 1e-9) / reps

    with torch.no_grad():
        if device_type == "cuda":
            n = 4096
        else:
            a, b = operands(128)
            seconds(a, b, 1)  # warm-up: kernel selection, page faults, thread-pool start
            rate = 2 * 128 ** 3 / seconds(a, b, 1)
            n = next((m for m in (512, 256) if 2 * m ** 3 / rate < 0.05), 128)
        a, b = operands(n)
        once = seconds(a, b, 1)  # warm-up at the final size, also sizes the trials
        reps = max(1, min(1000, int(0.03 / once)))  # ~30 ms per trial
        best = min(seconds(a, b, reps) for _ in range(5))
    return 2.0 * n ** 3 / best
