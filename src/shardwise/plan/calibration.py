"""Measured collective bandwidth and latency per mesh axis: the `shardwise bench-comm` JSON file, read
back by the planner (`cluster.calibration`).

Pure Python: `shardwise bench-comm` (launch/bench_comm.py) measures and writes the file with these
formulas, and the planner reads it here, so plan/ never imports launch/ (docs/architecture.md §2).

Bandwidths follow NVIDIA nccl-tests' definitions (doc/PERFORMANCE.md, "Algorithm bandwidth" and "Bus
bandwidth"): algbw = S / t for the operation's size S (all-reduce: the buffer; all-gather: the
gathered output; reduce-scatter: the unsharded input; all-to-all: the send buffer; send/recv: the
buffer; the same payload convention as plan/comm.py); busbw = algbw x a factor that makes it
comparable with the link's peak whatever the rank count n: 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, reduce-scatter and all-to-all, 1 for send/recv.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

SCHEMA = "shardwise.bench-comm/1"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on n ranks (nccl-tests doc/PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown operation {op!r}")


def bandwidths(op: str, n: int, size_bytes: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes, as nccl-tests prints them) of one call of `size_bytes`."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


@dataclass(frozen=True)
class AxisCalibration:
    """One mesh axis as measured: achieved bus bandwidth (bytes/s) and per-hop latency (s), the same
    two numbers plan/comm.py's model takes from the datasheet (link x BUS_FRACTION, LATENCY_*_S)."""

    axis: str
    ranks: int             # group size it was measured on
    bus_bytes_per_s: float
    hop_latency_s: float
    method: str            # "fit" (least squares over the all-reduce points) or "ends" (largest busbw, smallest time)


def hops(n: int) -> int:
    """log2(n) steps, as plan/comm.py's latency term counts them."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0


def fit_axis(axis: str, n: int, points: list[tuple[int, float]]) -> AxisCalibration:
    """Fit t(S) = a + 2(n-1)/n S / B over all-reduce points (S bytes, t seconds): B is the bus bandwidth,
    a the latency of one all-reduce, which plan/comm.py spends as 2 log2(n) hops. Least squares; when
    timing noise makes a slope or intercept non-positive (a flat or inverted curve), fall back to the
    busbw of the largest size and the time of the smallest (the brief's second estimate)."""
    pts = sorted(points)
    f = bus_factor("all_reduce", n)
    xs, ys = [f * s for s, _ in pts], [t for _, t in pts]
    method = "ends"
    bus, lat = f * pts[-1][0] / pts[-1][1], pts[0][1]
    if len(pts) >= 2:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        intercept = my - slope * mx
        if slope > 0 and intercept > 0:
            bus, lat, method = 1.0 / slope, intercept, "fit"
    return AxisCalibration(axis, n, bus, lat / (2 * hops(n)), method)


def _read_json(path: str | Path) -> dict[str, Any]:
    """A calibration file's JSON; ConfigError (field cluster.calibration) when it is missing or not JSON."""
    p = Path(path)
    where = "cluster.calibration"
    if not p.is_file():
        raise ConfigError(where, f"file not found: {p}", "write one with `shardwise bench-comm --nproc N --out bench.json`")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(where, f"{p} is not JSON: {e}", "point it at a file written by `shardwise bench-comm --out`") from None


def _checked_results(data: Any, p: str | Path) -> dict[str, Any]:
    """`data`, checked to be a bench-comm result; ConfigError (field cluster.calibration) when it is not one."""
    where = "cluster.calibration"
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("results"), list):
        raise ConfigError(where, f"{p} is not a bench-comm result (schema {SCHEMA!r})",
                          "point it at a file written by `shardwise bench-comm --out`")
    for i, r in enumerate(data["results"]):
        ok = isinstance(r, dict) and r.get("op") in OPS and isinstance(r.get("axis"), str) and \
            all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in ("ranks", "bytes", "time_s", "algbw", "busbw"))
        if not ok:
            raise ConfigError(where, f"{p}: results[{i}] is not a measurement", "re-run `shardwise bench-comm`")
    return data


def load_calibration(path: str | Path, data: Any = None) -> tuple[AxisCalibration, ...]:
    """Per axis with all-reduce measurements, its fitted bandwidth and latency (axis order of the file);
    `data`: the file's JSON when the caller has read it already."""
    data = _checked_results(_read_json(path) if data is None else data, path)
    by_axis: dict[str, list[tuple[int, float]]] = {}
    ranks: dict[str, int] = {}
    for r in data["results"]:
        if r["op"] == "all_reduce":
            by_axis.setdefault(r["axis"], []).append((int(r["bytes"]), float(r["time_s"])))
            ranks[r["axis"]] = int(r["ranks"])
    if not by_axis:
        raise ConfigError("cluster.calibration", f"{path} has no all-reduce measurement",
                          "re-run `shardwise bench-comm` (it measures all-reduce on every axis)")
    return tuple(fit_axis(a, ranks[a], pts) for a, pts in by_axis.items())


PLAN_SCHEMA = "shardwise-plan-calibration/1"  # written by `shardwise plan calibrate` (plan/fit.py)


def _plan_fractions(data: dict[str, Any], p: str | Path) -> tuple[float | None, float | None]:
    """The fitted (eager, compiled) pointwise HBM fractions of a `plan calibrate` file's JSON; either may
    be absent (null: no run of that kind was fitted), not both."""
    out = []
    for key in ("eager_pointwise_hbm_fraction", "compiled_pointwise_hbm_fraction"):
        fraction = data.get(key)
        if fraction is not None and (not isinstance(fraction, (int, float)) or not 0 < fraction <= 1):
            raise ConfigError("cluster.calibration", f"{p}: {key} must be within (0, 1], got {fraction!r}",
                              "re-run `shardwise plan calibrate ... --out FILE`")
        out.append(None if fraction is None else float(fraction))
    if out == [None, None]:
        raise ConfigError("cluster.calibration", f"{p}: neither eager_pointwise_hbm_fraction nor "
                          "compiled_pointwise_hbm_fraction is set", "re-run `shardwise plan calibrate ... --out FILE`")
    return out[0], out[1]


@dataclass(frozen=True)
class MeasuredDevice:
    """A device's rates as `benchmarks/kernels.py` measured them: they replace the datasheet peaks and
    the planner's achievable fractions (MAMF, HBM, attention, launch cost, optimizer bytes) for every
    kernel class, so a CPU can be planned at all and a GPU with its own numbers."""

    device_type: str                  # "cpu" or "cuda"
    dtype: str                        # the GEMM dtype measured
    gemm_flops: float                 # best square-matmul FLOP/s: the achievable GEMM peak
    bandwidth_gbps: float             # streaming copy, read + write
    attention_fraction: float         # SDPA forward + backward (causal half) over gemm_flops, default backend
    eager_op_s: float                 # one tiny eager kernel, launch / dispatch overhead
    optimizer_bytes_per_param: float  # AdamW step (foreach on CPU, fused on CUDA: what the trainer runs) at the copy rate
    # Extra per op under selective "op" checkpointing, whose policy is a Python dispatch mode every op of a
    # checkpointed block passes through (forward, recompute, backward); 0 when the file predates it.
    selective_op_s: float = 0.0
    # torch's fused AdamW on this device (the offload tiers' CPU step, parallel/offload.py), bytes/param at the
    # copy rate; 0 when the file has no fused row (then optimizer_bytes_per_param is used).
    fused_optimizer_bytes_per_param: float = 0.0
    # Gradient clipping's bytes per parameter at the copy rate (a GPU's file; 0: not measured or a CPU, whose
    # fitted optimizer rate already stands for the step as measured).
    clip_bytes_per_param: float = 0.0
    # A real block's host cost on 1 token, per kernel of constants.EAGER_BLOCK_KERNELS (views and autograd
    # folded in): its forward + backward, and what a full / selective ("op") checkpoint adds per forward
    # kernel (benchmarks/kernels.py block_overhead); 0 when the file predates them. Used on a CPU only.
    block_kernel_s: float = 0.0
    full_checkpoint_kernel_s: float = 0.0
    selective_checkpoint_kernel_s: float = 0.0
    # Every GEMM the file measured, (M, N, K, FLOP/s over gemm_flops): a CPU's GEMMs are priced at the
    # efficiency of the measured shapes nearest theirs (compute_time.gemm_time); a GPU's by its tiles and waves.
    gemm_shapes: tuple[tuple[int, int, int, float], ...] = ()

    def as_device(self, base: Any) -> Any:
        """`base` (the table's entry for cluster.gpu) with these rates: named measured-<base> (plan/cost.py
        then applies no datasheet fraction, and still finds the base's SM count)."""
        if self.device_type == "cuda" and base.peak_tflops.get(self.dtype):
            # A GPU's file measures one GEMM dtype: every tensor-core peak keeps its datasheet ratio to it
            # (fp8 twice bf16, tf32 half), scaled by what that dtype achieved.
            scale = self.gemm_flops / 1e12 / base.peak_tflops[self.dtype]
            peaks = {key: value * scale for key, value in base.peak_tflops.items()}
        else:
            peaks = {key: self.gemm_flops / 1e12 for key in ("fp32", "tf32", "bf16", "fp16", "fp8")}
        return replace(base, name=f"measured-{base.name}", peak_tflops=peaks, memory_bandwidth_gbps=self.bandwidth_gbps,
                       source=f"measured by benchmarks/kernels.py ({self.dtype} GEMMs) on {base.name}")


def _measured_device(data: dict[str, Any], p: str | Path) -> MeasuredDevice:
    """The rates of a benchmarks/kernels.py JSON."""
    try:
        kind = data["device_type"]
        peak = float(data["gemm"]["peak_flops"])
        if kind == "cuda":
            # On a GPU the file's peak_flops is the datasheet's; what GEMMs achieve is the best square matmul.
            squares = [float(r["flops"]) for r in data["gemm"].get("rows", []) if str(r.get("label", "")).startswith("square")]
            peak = max(squares, default=peak)
        copy = next(r for r in data["bandwidth"]["rows"] if r["kernel"] == "copy")
        sdpa = [r for r in data["sdpa"]["rows"] if r.get("requested") == "default" and r.get("fwd_bwd_flops")
                and r.get("dtype") == data["gemm"]["dtype"]]
        eager = next(r for r in data["overhead"]["rows"] if r["mode"] == "eager")
        impl = "fused" if kind == "cuda" else "foreach"
        optimizer = next(r for r in data["optimizer"]["rows"] if r["impl"] == impl)
        fused = next((r for r in data["optimizer"]["rows"] if r["impl"] == "fused" and "bytes_per_param_at_copy_bw" in r), None)
        per_op = {r["mode"]: r.get("s_per_op") for r in data["overhead"]["rows"]}
        # The chain's ops run forward, again in the recompute, and backward: 3 passes over the dispatch mode.
        selective, autograd = per_op.get("selective checkpoint (fwd+recompute+bwd)"), per_op.get("eager+autograd (fwd+bwd)")
        block = {r["mode"]: float(r["s_per_kernel"]) for r in data["overhead"].get("block", {}).get("rows", [])}
        return MeasuredDevice(kind, data["gemm"]["dtype"], peak, float(copy["gbps"]),
                              statistics.median(float(r["fwd_bwd_flops"]) for r in sdpa) / peak,
                              float(eager["s_per_op"]), float(optimizer["bytes_per_param_at_copy_bw"]),
                              max(0.0, selective - autograd) / 3 if selective and autograd else 0.0,
                              float(fused["bytes_per_param_at_copy_bw"]) if fused else 0.0,
                              float(optimizer.get("clip_bytes_per_param_at_copy_bw", 0.0)) if kind == "cuda" else 0.0,
                              block.get("block forward + backward", 0.0), block.get("full checkpoint, extra", 0.0),
                              block.get("selective checkpoint, extra", 0.0),
                              tuple((int(r["m"]), int(r["n"]), int(r["k"]), float(r["flops"]) / peak)
                                    for r in data["gemm"].get("rows", [])
                                    if all(float(r.get(key) or 0) > 0 for key in ("m", "n", "k", "flops"))))
    except (KeyError, TypeError, ValueError, StopIteration, statistics.StatisticsError) as e:
        raise ConfigError("cluster.calibration", f"{p}: an incomplete benchmarks/kernels.py result ({type(e).__name__}: {e})",
                          "re-run `python benchmarks/kernels.py --out FILE` (not --smoke)") from None


def overlap_slowdown(data: dict[str, Any], p: str | Path) -> float | None:
    """A bench-comm file's measured overlap slowdown (how much slower compute ran beside its all-reduces than
    alone: plan/scale.py item 4), None when the file predates the measurement."""
    overlap = data.get("overlap")
    if overlap is None:
        return None
    value = overlap.get("slowdown") if isinstance(overlap, dict) else None
    if not isinstance(value, (int, float)) or not 0 <= value <= 10:
        raise ConfigError("cluster.calibration", f"{p}: overlap.slowdown must be a number within [0, 10], got {value!r}",
                          "re-run `shardwise bench-comm --out FILE`")
    return float(value)


@dataclass(frozen=True)
class Calibration:
    """Everything cluster.calibration's files hold (one file or several, comma-separated)."""

    links: tuple[AxisCalibration, ...] = ()          # `shardwise bench-comm`: per mesh axis
    pointwise_hbm_fraction: float | None = None      # `shardwise plan calibrate`: eager kernels
    measured_device: MeasuredDevice | None = None    # benchmarks/kernels.py
    compiled_hbm_fraction: float | None = None       # `shardwise plan calibrate`: compiled (fused) kernels
    overlap_slowdown: float | None = None            # `shardwise bench-comm`: compute beside its all-reduces


def read_calibration(paths: str) -> Calibration:
    """Each file is read once and taken by what it is: a `plan calibrate` result (its schema), a
    benchmarks/kernels.py result (its "benchmark" key), else a bench-comm result (checked as one)."""
    links: tuple[AxisCalibration, ...] = ()
    fraction = measured = compiled = overlap = None
    for path in (part.strip() for part in paths.split(",") if part.strip()):
        data = _read_json(path)
        if isinstance(data, dict) and data.get("schema") == PLAN_SCHEMA:
            fraction, compiled = _plan_fractions(data, path)
        elif isinstance(data, dict) and data.get("benchmark") == "kernels":
            measured = _measured_device(data, path)
        else:
            links += load_calibration(path, data)
            overlap = overlap_slowdown(data, path) if overlap is None else overlap
    return Calibration(links, fraction, measured, compiled, overlap)
