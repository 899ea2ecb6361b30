"""`shardwise bench-comm`: time the collectives on every mesh axis of a layout, as nccl-tests would.

    shardwise bench-comm --nproc N [--config run.toml] [--section.key=value ...] [--sizes 1K:16M]
                         [--iters 20] [--warmup 5] [--json] [--out bench.json] [--plot bench.png]

The parent checks every input (ConfigError, exit 2, before anything is spawned), launches N workers
through torchrun (launch/local.py) running this module with `--worker SPEC`, and prints what rank 0
wrote: a table, optionally the JSON and a figure. The JSON file is what `cluster.calibration` reads
(plan/calibration.py, which also owns the bandwidth formulas: nccl-tests doc/PERFORMANCE.md).

Each worker builds the trainer's own DeviceMeshes (parallel/mesh.py build_meshes), so an axis here is
the process group training uses: the enabled axes of ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
plus the flattened views "dp", "dp_cp", "dp_shard_cp" and the expert axes "ep", "efsdp" when the
layout has them as groups of their own (the names plan/comm.py prices). Every group of an axis runs at
once, as in training. Per operation and size: `warmup` untimed calls, a barrier on the group, `iters`
timed calls (CUDA synchronised before each clock read), and the slowest rank's mean (an all-reduce MAX
over the world), as nccl-tests reports the slowest rank. Then, on the layout's first axis at the largest
size, how much slower a GEMM loop runs beside those all-reduces than alone (`measure_overlap`): the
planner's overlap slowdown (plan/scale.py item 4), which the same file calibrates.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.paths import writable_file
from shardwise.plan.calibration import OPS, SCHEMA, bandwidths, fit_axis

# Default sizes: gloo over loopback moves ~1 GB/s, so 16 MiB keeps a run to seconds; NCCL needs large
# messages to reach its bus bandwidth plateau (nccl-tests' examples sweep up to 1-8 GB).
DEFAULT_SIZES = {"gloo": "1K:16M", "nccl": "1K:1G"}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}
ELEMENT_BYTES = 4  # float32 buffers: every backend reduces them


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m or int(m.group(1)) < 1:
        raise ConfigError("--sizes", f"cannot read {text!r} as a size", "write e.g. 4096, 64K, 16M or 1G (powers of 1024)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_sizes(text: str) -> list[int]:
    """"1K,64K,1M" (a list) or "1K:16M[:4]" (a geometric range, x4 by default, as nccl-tests' -b -e -f)."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError("--sizes", f"{text!r} is not MIN:MAX or MIN:MAX:FACTOR", "e.g. --sizes 1K:16M or 1K:16M:2")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].strip().isdigit() else (4 if len(parts) == 2 else 0)
        if factor < 2 or lo > hi:
            raise ConfigError("--sizes", f"{text!r}: need MIN <= MAX and an integer FACTOR >= 2", "e.g. --sizes 1K:16M:4")
        out = [lo]
        while out[-1] * factor <= hi:
            out.append(out[-1] * factor)
        return out
    return sorted({parse_size(p) for p in text.split(",") if p.strip()}) or [parse_size(text)]


def human(n: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{int(n)}B"


def table(data: dict[str, Any]) -> str:
    """The nccl-tests columns (size, time, algbw, busbw) per axis and operation, and the per-axis fit."""
    rows = [f"bench-comm: {data['world_size']} processes, backend {data['backend']}, layout {data['layout']}, "
            f"{data['warmup']} warm-up + {data['iters']} timed calls each, slowest rank"]
    head = f"{'axis':<12} {'ranks':>5} {'op':<15} {'size':>8} {'time us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"
    rows += [head, "-" * len(head)]
    for r in data["results"]:
        rows.append(f"{r['axis']:<12} {r['ranks']:>5} {r['op']:<15} {human(r['bytes']):>8} {r['time_s'] * 1e6:>11.1f} "
                    f"{r['algbw']:>11.3f} {r['busbw']:>11.3f}")
    rows.append("busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), 1 (send_recv): "
                "nccl-tests doc/PERFORMANCE.md")
    for axis, ranks in data["axes"].items():
        pts = [(r["bytes"], r["time_s"]) for r in data["results"] if r["axis"] == axis and r["op"] == "all_reduce"]
        if pts:
            f = fit_axis(axis, ranks, pts)
            rows.append(f"planner calibration {axis}: busbw {f.bus_bytes_per_s / 1e9:.3g} GB/s, latency "
                        f"{f.hop_latency_s * 1e6:.3g} us/hop ({f.method}); use --cluster.calibration=<this --out file>")
    o = data.get("overlap")
    if o:
        rows.append(f"compute beside comm: a {o['gemm']} GEMM loop ran {o['slowdown']:.1%} slower beside all-reduces of "
                    f"{human(o['bytes'])} on {o['axis']} than alone ({o['compute_beside_s'] * 1e3:.1f} against "
                    f"{o['compute_alone_s'] * 1e3:.1f} ms): the planner's overlap slowdown")
    return "\n".join(rows) + "\n"


def plot(path: str | Path, data: dict[str, Any]) -> None:
    """busbw against message size, one panel per axis, one line per operation (matplotlib Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    axes = list(data["axes"])
    fig = Figure(figsize=(6 * len(axes), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    for i, axis in enumerate(axes, 1):
        ax = fig.add_subplot(1, len(axes), i)
        for op in OPS:
            pts = [(r["bytes"], r["busbw"]) for r in data["results"] if r["axis"] == axis and r["op"] == op]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{axis} ({data['axes'][axis]} ranks, {data['backend']})")
        ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    from shardwise.config import load_config
    from shardwise.launch.local import check_nproc, torchrun
    from shardwise.spec.dims import ParallelDims

    parser = argparse.ArgumentParser(prog="shardwise bench-comm")
    parser.add_argument("--nproc", type=int, required=True, help="local processes to launch (>= 2)")
    parser.add_argument("--config", default=None, help="TOML whose parallel.* keys give the mesh axes")
    parser.add_argument("--sizes", default=None, help="message sizes: 1K,64K,1M or MIN:MAX[:FACTOR] "
                        f"(default {DEFAULT_SIZES['gloo']} on gloo, {DEFAULT_SIZES['nccl']} on NCCL)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per operation and size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--out", default=None, help="write the JSON here (what cluster.calibration reads)")
    parser.add_argument("--plot", default=None, help="write busbw vs size per axis to this PNG")
    args, overrides = parser.parse_known_args(argv)
    check_nproc(args.nproc)
    if args.nproc < 2:
        raise ConfigError("--nproc", f"a collective needs >= 2 processes, got {args.nproc}", "pass --nproc 2 or more")
    if args.config is None and not any(o.startswith("--parallel.") for o in overrides):
        overrides = [*overrides, "--parallel.dp_shard=-1"]  # no layout given: one axis over every process
    cfg = load_config(args.config, overrides)
    dims = ParallelDims.from_config(cfg.parallel, args.nproc)
    for name in ("iters", "warmup"):
        if getattr(args, name) < (1 if name == "iters" else 0):
            raise ConfigError(f"--{name}", f"must be >= {1 if name == 'iters' else 0}, got {getattr(args, name)}", f"e.g. --{name} 5")
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    sizes = parse_sizes(args.sizes or DEFAULT_SIZES[backend])
    for field, path in (("--out", args.out), ("--plot", args.plot)):
        if path:
            writable_file(Path(path), field)
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-comm-") as tmp:
        spec = {"dims": dims.__dict__, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
                "result": str(Path(tmp) / "result.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        code = torchrun(args.nproc, "shardwise.launch.bench_comm", ["--worker", str(Path(tmp) / "spec.json")])
        if code:
            return code
        data = json.loads(Path(spec["result"]).read_text())
    text = json.dumps(data, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.json else table(data), end="\n" if args.json else "")
    if args.plot:
        plot(args.plot, data)
    if not args.json:
        print("".join(f"wrote {p}\n" for p in (args.out, args.plot) if p), end="")
    return 0


# ---------------------------------------------------------------------------------------------------
# the worker (python -m shardwise.launch.bench_comm --worker SPEC, under torchrun)
# ---------------------------------------------------------------------------------------------------
def axis_groups(dims: Any, meshes: Any) -> dict[str, Any]:
    """Axis name -> this rank's process group, each distinct group once, in mesh order then views."""
    out = {a: meshes.root[a].get_group() for a in dims.enabled_axes()}
    for view in (meshes.batch, meshes.dp_cp, meshes.dp_shard_cp):
        # A flattened view of one non-trivial axis is that axis (parallel/mesh.py): named, and so
        # measured, once.
        if view is not None and view.mesh_dim_names[0] not in out:
            out[view.mesh_dim_names[0]] = view.get_group()
    if meshes.expert is not None:
        for a in ("efsdp", "ep"):
            if a in meshes.expert.mesh_dim_names and meshes.expert[a].size() > 1:
                out[a] = meshes.expert[a].get_group()
    return out


def _operation(op: str, elems: int, group: Any, device: Any):
    """A zero-argument call of `op` on preallocated float32 buffers and its size in nccl-tests' terms
    (all-gather: the gathered output; reduce-scatter: the unsharded input; plan/calibration.py).
    Zeros: sums stay 0, never denormal or inf, whose arithmetic would time differently on a CPU."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    full = torch.zeros(elems, device=device)
    part = torch.zeros(elems // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
    if op == "all_gather":
        return lambda: getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, full, group=group)
    if op == "all_to_all":
        out = torch.zeros_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    # send_recv: every rank sends to the next rank of its group and receives from the previous one at
    # once (nccl-tests sendrecv_perf).
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    recv = torch.zeros_like(full)

    def send_recv() -> None:
        ops = [dist.P2POp(dist.isend, full, ranks[(me + 1) % n], group=group),
               dist.P2POp(dist.irecv, recv, ranks[(me - 1) % n], group=group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return send_recv


def measure(groups: dict[str, Any], sizes: list[int], iters: int, warmup: int, device: Any) -> list[dict[str, Any]]:
    import time

    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    results = []
    for axis, group in groups.items():
        n = dist.get_world_size(group)
        for op in OPS:
            for size in sizes:
                elems = max(n, size // ELEMENT_BYTES // n * n)  # every rank's share whole
                call = _operation(op, elems, group, device)
                for _ in range(warmup):
                    call()
                sync()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                sync()
                slowest = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                seconds = float(slowest.item())
                algbw, busbw = bandwidths(op, n, elems * ELEMENT_BYTES, seconds)
                results.append({"axis": axis, "ranks": n, "op": op, "bytes": elems * ELEMENT_BYTES, "time_s": seconds,
                                "algbw": algbw, "busbw": busbw})
    return results


def _timed(fn: Any, device: Any) -> float:
    """Seconds `fn`'s work takes on this rank's compute: on a GPU between two events of the current stream,
    not a device synchronisation, which would also wait for the collectives queued on NCCL's stream (and so
    time them, not the GEMMs beside them); on a CPU the calling thread's wall clock (gloo runs on its own)."""
    import time

    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_overlap(axis: str, group: Any, size: int, device: Any, repeats: int = 3) -> dict[str, Any]:
    """How much slower a GEMM loop runs beside a stream of all-reduces of `size` bytes on `group` than alone
    (plan/scale.py item 4: the planner's compute beside hidden communication). The all-reduces are queued
    asynchronously (NCCL's stream on a GPU, gloo's thread on a CPU), enough of them to outlast the loop;
    the loop alone and beside them alternate `repeats` times; each rank's medians, averaged over the group.
    (The GEMM stands for a step's compute: a fixed shape, where a layer's own GEMMs may lose more or less.)"""
    import statistics

    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    # A square GEMM big enough to fill a GPU's SMs (8192 in bf16: ~1 ms on an H100); 512 fp32 on a CPU core.
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    _timed(lambda: torch.mm(a, b, out=out), device)  # warm-up (cuBLAS' handle and workspace)
    one = _timed(lambda: torch.mm(a, b, out=out), device)
    gemms = max(4, int(0.05 / max(one, 1e-6)))  # a loop of ~50 ms

    def loop() -> None:
        for _ in range(gemms):
            torch.mm(a, b, out=out)

    world = dist.get_world_size(group)
    elems = max(world, size // ELEMENT_BYTES // world * world)
    buf = torch.zeros(elems, device=device)
    dist.barrier(group=group)
    call = _timed(lambda: dist.all_reduce(buf, group=group), device)
    t_loop = _timed(loop, device)
    # Every rank queues the same number of all-reduces (the group's largest estimate), enough to outlast the loop.
    count = torch.tensor([float(int(1.5 * t_loop / max(call, 1e-6)) + 2)], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    alone, beside = [], []
    for _ in range(repeats):
        dist.barrier(group=group)
        alone.append(_timed(loop, device))
        dist.barrier(group=group)
        works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(int(count.item()))]
        beside.append(_timed(loop, device))
        for w in works:
            w.wait()
    times = torch.tensor([statistics.median(alone), statistics.median(beside)], dtype=torch.float64, device=device)
    dist.all_reduce(times, group=group)
    mean_alone, mean_beside = (float(t) / world for t in times.tolist())
    return {"axis": axis, "ranks": world, "bytes": elems * ELEMENT_BYTES, "gemm": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
            "gemms": gemms, "all_reduces": int(count.item()), "compute_alone_s": mean_alone,
            "compute_beside_s": mean_beside, "slowdown": max(0.0, mean_beside / mean_alone - 1.0)}


def _worker(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    from shardwise.parallel.mesh import build_meshes
    from shardwise.spec.dims import ParallelDims
    from shardwise.train.distributed import default_device, finish_distributed, init_distributed, leave

    spec = json.loads(Path(argv[1]).read_text())
    dims = ParallelDims(**spec["dims"])
    init_distributed()
    device = default_device()
    meshes = build_meshes(dims, device.type)
    groups = axis_groups(dims, meshes)
    results = measure(groups, spec["sizes"], spec["iters"], spec["warmup"], device)
    axis, group = next(iter(groups.items()))  # the layout's first axis, at the largest size measured
    overlap = measure_overlap(axis, group, max(spec["sizes"]), device)
    if dist.get_rank() == 0:
        data = {"schema": SCHEMA, "backend": dist.get_backend(), "device": str(device.type), "torch": torch.__version__,
                "world_size": dims.world_size, "layout": dims.describe(), "iters": spec["iters"], "warmup": spec["warmup"],
                "units": {"bytes": "bytes", "time_s": "seconds", "algbw": "GB/s (1e9 B/s)", "busbw": "GB/s (1e9 B/s)"},
                "axes": {a: dist.get_world_size(g) for a, g in groups.items()}, "results": results, "overlap": overlap}
        Path(spec["result"]).write_text(json.dumps(data))
    finish_distributed()
    leave(0)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        sys.exit("run `shardwise bench-comm`; this module's own entry is the worker torchrun starts")
    _worker(sys.argv[1:])
