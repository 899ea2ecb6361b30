"""benchmarks/kernels.py's `sustained` section: one large matmul looped for --sustained-s seconds, timed in
windows of --window-s, with the SM clock, the board power and the reasons NVML gives for holding the clocks
down, read at the end of each window.

Why: the planner prices a GEMM at the datasheet peak x MAMF_FRACTION (mamf-finder's best shape, a short run)
and the tile and wave quantisation of its shape. A large model's step keeps the tensor cores busy for minutes,
and under the board's power limit the SM clock, and so the GEMM rate, can fall: random operands draw more
power than predictable ones, enough to slow an A100's 8192^3 matmul by 13% (H. He, "Strangely, Matrix
Multiplications on GPUs Run Faster When Given 'Predictable' Data!", 2024). Issue 60's published runs of large
models are 5-15% slower than the planner prices them, while this trainer's own H100 steps, a mix of GEMMs and
memory-bound kernels, are within 4%. This section measures whether a GEMM's rate after a sustained load is
below its first window's, and what the clock did meanwhile. On a CPU only the rate is timed (no NVML).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kernel_timing import Timer
from shardwise.launch.gpu_health import clock_event_reasons, held_by
from shardwise.train.power import nvml_handle


def nvml_reader(device: torch.device) -> Callable[[], dict[str, Any]] | None:
    """A reading of the GPU's SM clock (MHz), board power (W) and clock-event reasons, or None where NVML
    cannot read this GPU (a CPU, no driver, nvidia-ml-py missing)."""
    found = nvml_handle(device)
    if found is None:
        return None
    pynvml, handle = found
    try:
        top = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    except Exception:  # noqa: BLE001  (any NVMLError subclass: no reading)
        return None

    def read() -> dict[str, Any]:
        return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM), "max_sm_mhz": top,
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                "held_by": [words for _, words in held_by(pynvml, clock_event_reasons(pynvml, handle) or 0)]}
    return read


def summarize(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last window's rate over the first's (below 1: the sustained load ran slower), and the clock's range."""
    first, last = windows[0]["flops"], windows[-1]["flops"]
    out: dict[str, Any] = {"windows": len(windows), "first_flops": first, "last_flops": last,
                           "last_over_first": last / first, "min_flops": min(w["flops"] for w in windows)}
    clocks = [w["sm_mhz"] for w in windows if w.get("sm_mhz")]
    if clocks:
        out.update(first_sm_mhz=clocks[0], last_sm_mhz=clocks[-1], min_sm_mhz=min(clocks),
                   mean_power_w=sum(w["power_w"] for w in windows) / len(windows),
                   held_by=sorted({words for w in windows for words in w.get("held_by", [])}))
    return out


def sustained_section(a, device: torch.device, dtype: torch.dtype, peak: float | None) -> dict[str, Any]:
    """`a.sustained_n`^3 matmuls of randn operands for `a.sustained_s` seconds in windows of `a.window_s`."""
    n = a.sustained_n
    x, w = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    read = nvml_reader(device)
    timer = Timer(device, reps=1, warmup=0, target_s=a.window_s)  # its synchronised loop of calls

    def matmul() -> None:
        torch.mm(x, w)

    timer.elapsed(matmul, 1)  # warm-up
    calls = max(1, round(a.window_s / max(timer.elapsed(matmul, 1), 1e-9)))
    windows: list[dict[str, Any]] = []
    began = time.perf_counter()
    while not windows or time.perf_counter() - began < a.sustained_s:
        spent = timer.elapsed(matmul, calls)
        window = {"t_s": time.perf_counter() - began, "flops": 2 * n ** 3 * calls / spent}
        if peak:
            window["fraction_of_peak"] = window["flops"] / peak
        if read is not None:
            window.update(read())
        windows.append(window)
    summary = summarize(windows)
    print(f"\nsustained {n}^3 matmul, {a.sustained_s:g} s in windows of {calls} calls (~{a.window_s:g} s): "
          f"first {summary['first_flops'] / 1e12:.4g}, last {summary['last_flops'] / 1e12:.4g} TFLOP/s "
          f"(x{summary['last_over_first']:.3f})" + (f"; SM clock {summary['first_sm_mhz']} -> {summary['last_sm_mhz']} "
                                                    f"MHz (min {summary['min_sm_mhz']}), {summary['mean_power_w']:.0f} W, "
                                                    f"held by: {', '.join(summary['held_by']) or 'nothing'}"
                                                    if "first_sm_mhz" in summary else "; no NVML reading"))
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "calls_per_window": calls, "peak_flops": peak,
            "summary": summary, "windows": windows}
