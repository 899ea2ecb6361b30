"""`shardwise dryrun --config run.toml --nnodes N --nproc P [--ranks 0,last,...] [--json FILE]`: rehearse a
cluster job on one CPU (issue 58).

Every pre-flight rule runs first (preflight.py `check`, `check_batch`, at the job's world size N x P): bad
input ends there with the ConfigError line (field, problem, fix) and exit 2, as `shardwise train` would.
Then each chosen global rank is built in a process of its own, one after the other (forked from the command's
process, which imports torch once; `--spawn`: a fresh interpreter each, which imports it again):

  torch's fake process group (torch.testing._internal.distributed.fake_pg: `init_process_group("fake")` at the
  job's world size and that rank; every collective is a no-op), the DeviceMesh of parallel/mesh.py, and the
  model on the meta device through the trainer's own functions in the trainer's order (train/trainer.py):
  build_pipeline (pp > 1) or build_parallel_model, both running parallel/parallelize.py `parallelize` (FP8,
  TP/SP, CP, EP, tiles, checkpointing, compile, FSDP2 / replicate), with `on_meta=True`, the one seam: nothing
  is materialized; then the optimizer of train/optim.py build_optimizer (ZeRO-1's partition included).

What the rank holds, counted from the built modules (train/memory_meter.py, the trainer's own accounting):
  params     the storages of the local shards: FSDP2's padded shard of each parameter, TP's local tensor;
  grads      what the trainer's gradients take after a step: each parameter's local storage in its dtype
             (FSDP2's reduce-scatter output holds the padded shards; DDP / replicate the local tensors);
  optimizer  AdamW's state as its first step makes it, made by AdamW itself (init_optimizer_state) for the
             (ZeRO-1: this rank's own) optimizer on zero gradients, on meta (foreach: a fused optimizer refuses
             meta tensors; its state has the same bytes, a fp32 `step` of 4 bytes either way).
  host, disk with parallel.offload (`offloaded`): the three above as FSDP2's CPUOffloadPolicy keeps them in host
             memory; "nvme": AdamW's moments in its file (not written here) and NvmeAdamW's buffers in memory.
Beside it the planner's prediction for that rank's pipeline position (plan/memory.py rank_memory on
plan/inventory.py pipeline_rank), which is the most loaded rank of that position: a rank with a smaller
FSDP shard (the last ones, of an uneven dim 0) or a lighter ZeRO-1 partition shows a negative difference
for that reason alone (tests/unit/test_dryrun_scale.py holds such ranks to the closed form of their own shard).
Default ranks: each pipeline stage's first and last and, with EP, the two other corners of its (efsdp, ep) grid
(`expert_ranks`). launch/verify.py runs the same builds for `plan search --verify K`.

The parent measures each child's wall time, CPU time and peak RSS (os.wait4's rusage of that child; a forked child's
RSS includes the pages it shares with the parent, torch's among them).
`--step`: each rank then runs one training step of the trainer's own code on its meta tensors, its collectives'
payload bytes per mesh axis counted by the trainer's counter beside the planner's (launch/dryrun_step.py, which
also says which layouts cannot step on meta, and why). Not covered yet (issue 58): the device-side transients
(FSDP2's gathered copies, activations), and the planner's NVMe buffers are its upper bound (2 x max(64 MiB, the largest shard's
state)) where NvmeAdamW's greedy chunks all fall short of 64 MiB (-2.2 MiB on a Llama 3 8B with ffn 14000 at
dp_shard 64: the host line's difference).

Measured (2-core CPU shared with other work): Llama 3 70B, pp8 x dp_shard16 x tp8 ZeRO-1 on 1,024 ranks: each
rank 0.6-1.0 s of CPU, ~300 MiB peak RSS, the planner's bytes exactly on every stage's first rank. Llama 3 405B,
dp_replicate8 x dp_shard64 x cp4 x tp8 ZeRO-3 on 16,384 ranks: 11-13 s of CPU and 1.7 GiB peak RSS a rank, of
which ~1.4 GiB is torch's own mesh bookkeeping: DeviceMesh.__init__ keeps _flatten_rank_map, a tuple of one
Python int per rank of the world (~0.6 MB at 16,384 ranks), and FSDP2 makes two meshes per parameter (the shard
mesh sliced from the HSDP mesh, and dp x tp concatenated for a TP parameter): 11.2 MiB a block, measured with
tracemalloc on one fully_shard call, 373 -> 1,708 MiB over the 126. A real job's ranks hold the same; not worked
around here (it is torch's private state).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwise.config import Config, load_config
from shardwise.errors import EXIT_FAILED, EXIT_OK, ConfigError
from shardwise.launch.dryrun_step import WIDE, comm_lines

CATEGORIES = ("params", "grads", "optimizer")  # the model states, on the device
PLACES = ("host", "disk")  # where offload keeps them instead (offloaded)
CHILD = "--child"


# ---------------------------------------------------------------------------------------------------
# which ranks, and the job's config
# ---------------------------------------------------------------------------------------------------
def job_config(cfg: Config, nnodes: int, nproc: int) -> Config:
    """`cfg` as the job runs it: the cluster is N nodes of P processes (planned_precision)."""
    world = nnodes * nproc
    return planned_precision(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, num_gpus=world,
                                                                                  gpus_per_node=nproc)))


def planned_precision(cfg: Config) -> Config:
    """train.precision unset is what the planned device picks (plan/layout.py Problem: bf16 on a GPU that
    computes it), so the trainer's path and the planner price the same precision."""
    from shardwise.plan.layout import Problem

    if cfg.train.precision is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=Problem.from_config(cfg).precision))
    return cfg


def stage_ranks(dims, stage: int) -> tuple[int, int]:
    """(first, last) global rank of pipeline stage `stage`: pp is the outermost mesh axis (spec/dims.py AXES)."""
    per = dims.world_size // dims.pp
    return stage * per, (stage + 1) * per - 1


def expert_ranks(dims, stage: int) -> list[int]:
    """Ranks of pipeline stage `stage` whose experts differ from what its first and last rank hold.

    parallel/mesh.py reshapes a stage's dp_shard x cp ranks row-major into (efsdp, ep), ep innermost: shard
    index s = efsdp * ep + ep_rank = dp_shard * cp + cp_rank. The ep rank picks which E/ep experts a rank
    holds (the same shapes, other tensors), the efsdp rank which FSDP2 shard of them (the last efsdp shard is
    the short one when the expert rows do not divide: FSDP2 pads its storage, not its AdamW moments). The
    stage's first rank is (efsdp 0, ep 0), its last (efsdp last, ep last): the other two corners are the last
    ep rank of the first efsdp shard and the first ep rank of the last one, each with dp_replicate, tp 0.
    None without EP; one corner fewer where efsdp is 1 (both corners are then the first and last's)."""
    if dims.ep == 1:
        return []
    efsdp, per = dims.shard_group // dims.ep, dims.world_size // dims.pp
    corners = {(0, dims.ep - 1), (efsdp - 1, 0)} - {(0, 0), (efsdp - 1, dims.ep - 1)}
    # with dp_replicate and tp at 0 a stage's rank is s x tp (spec/dims.py coordinates, row-major over AXES)
    return sorted(stage * per + (e * dims.ep + p) * dims.tp for e, p in corners)


def default_ranks(dims) -> list[int]:
    """The first and the last rank of every pipeline stage (the job's first and last among them) and, with
    EP, the ranks of each stage that hold other experts or another shard of them (expert_ranks)."""
    return sorted({r for s in range(dims.pp) for r in (*stage_ranks(dims, s), *expert_ranks(dims, s))})


def parse_ranks(text: str | None, dims, field: str = "--ranks") -> list[int]:
    """--ranks: comma-separated global ranks, `first` / `last` for 0 / world-1; unset: default_ranks."""
    if not text:
        return default_ranks(dims)
    world, out = dims.world_size, []
    for word in text.split(","):
        word = word.strip().lower()
        named = {"first": 0, "last": world - 1}
        if word in named:
            out.append(named[word])
            continue
        try:
            rank = int(word)
        except ValueError:
            raise ConfigError(field, f"{word!r} is not a rank", "give global ranks such as 0,last,17") from None
        if not 0 <= rank < world:
            raise ConfigError(field, f"rank {rank} is outside the job's {world} ranks",
                              f"use ranks 0..{world - 1} (or `last`)")
        out.append(rank)
    return sorted(set(out))


# ---------------------------------------------------------------------------------------------------
# the planner's side
# ---------------------------------------------------------------------------------------------------
def planned_bytes(cfg: Config, world: int, rank: int) -> dict[str, float]:
    """The planner's params / grads / optimizer bytes for `rank`'s pipeline position (module doc)."""
    from shardwise.plan.inventory import pipeline_rank, priced_layout
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import rank_memory
    from shardwise.spec.dims import ParallelDims
    from shardwise.spec.layout import Layout

    problem = Problem.from_config(cfg)
    lay = priced_layout(problem.shape, Layout.from_config(cfg, world))
    pp_rank = ParallelDims.from_config(cfg.parallel, world).coordinates(rank)["pp"]
    held = pipeline_rank(problem.shape, lay.pp, lay.chunks_per_rank, lay.schedule, pp_rank, lay.stage_layers)
    label = "only" if lay.pp == 1 else {0: "first", lay.pp - 1: "last"}.get(pp_rank, f"rank {pp_rank}")
    mem = rank_memory(problem, lay, held, label, pp_rank == 0, pp_rank)
    return {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "host": mem.cpu_bytes,
            "disk": mem.disk_bytes}


# ---------------------------------------------------------------------------------------------------
# the built rank (in the child process)
# ---------------------------------------------------------------------------------------------------
def build_rank(cfg: Config, world: int, rank: int, step: bool = False) -> dict:
    """Build `rank` of a `world`-rank job on the meta device under the fake process group (module doc);
    returns its bytes by category and what it holds; `step`: then one training step, its collectives'
    bytes per axis counted (launch/dryrun_step.py). Call it in a process of its own: it initialises the
    default process group."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.launch.dryrun_step import step_bytes
    from shardwise.models import build_model
    from shardwise.parallel.data_parallel import unwrap, zero1_group
    from shardwise.parallel.mesh import build_meshes
    from shardwise.parallel.parallelize import build_parallel_model, build_pipeline
    from shardwise.plan.layout import Problem
    from shardwise.preflight import check, check_batch
    from shardwise.train.memory_meter import memory_by_category, tensor_bytes
    from shardwise.train.optim import build_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = check(cfg, world)
        check_batch(cfg, dims)
        # The device the job's decisions are made for (compile, fused optimizer, fp8): the planned one. The
        # mesh is a CPU one: the fake group is device-agnostic and this torch may have no CUDA. FP8 on a CPU
        # build: torchao's emulated Float8Linears, the same parameters (parallel/float8.py).
        kind = Problem.from_config(cfg).device_type
        if cfg.train.precision == "fp8" and not torch.cuda.is_available():
            kind = "cpu"
        device = torch.device(kind)
        mesh = build_meshes(dims, "cpu")
        pp_rank = dims.coordinates(rank)["pp"]
        parts = None
        if dims.pp > 1:
            parts = build_pipeline(dims, mesh, cfg, device, pp_rank, on_meta=True)
            model = parts.model
        else:
            with torch.device("meta"):
                model = build_model(cfg.model)
            model = build_parallel_model(model, dims, mesh, cfg, device, on_meta=True)
        inner = unwrap(model)
        zero1 = zero1_group(mesh, dims) if cfg.parallel.zero == 1 else None
        optimizer = build_optimizer(inner, cfg.train, zero1, fused=False)  # fused refuses meta (module doc)
        params = [p for p in inner.parameters() if p.requires_grad]
        grads = tensor_bytes(p for p in params)  # the gradients' storages are the parameters' (module doc)
        for p in params:
            p.grad = torch.zeros_like(p)
        init_optimizer_state(getattr(optimizer, "optim", optimizer))  # ZeRO-1: its own AdamW (the rank's share)
        mem = memory_by_category(inner, optimizer)
        held = offloaded(cfg, {"params": mem["params"], "grads": grads, "optimizer": mem["optimizer"]}, optimizer)
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in params)
        expert = getattr(mesh, "expert", None)
        counted = step_bytes(cfg, dims, mesh, model, parts, optimizer, rank) if step else {}
        return {"rank": rank, "coordinates": dims.coordinates(rank), **held, "buffers": mem["buffers"], **counted,
                "tensors": len(params), "local_numel": local,
                "expert_coordinates": dict(zip(expert.mesh_dim_names, expert.get_coordinate())) if expert else {},
                "blocks": sorted(int(n) for n, _ in inner.named_blocks()) if hasattr(inner, "named_blocks") else []}
    finally:
        dist.destroy_process_group()


def offloaded(cfg: Config, held: dict[str, int], optimizer) -> dict[str, int]:
    """`held` (params / grads / optimizer bytes of the built rank) where the trainer keeps them, with "host"
    and "disk" added. parallel.offload "cpu" / "nvme" (FSDP2's CPUOffloadPolicy): the sharded parameters, their
    gradients and AdamW's state, created on the parameters' device, all live in host memory: the device
    categories are then 0. "nvme" (parallel/offload.py NvmeAdamW, as the trainer builds it): the two moments
    are in a file of 8 bytes per local element ("disk"), and memory keeps the step counters and two I/O
    buffers of the largest chunk's state, cut from the same parameter order by NvmeAdamW's own `_cut` (the
    file itself is not written). Where the planned device is the CPU itself, nothing moves to "host" (it is
    the device's memory), as the planner counts it (plan/memory.py)."""
    from shardwise.parallel.offload import DEFAULT_CHUNK_BYTES, STATE_BYTES_PER_ELEMENT, NvmeAdamW, _local
    from shardwise.plan.layout import Problem
    from shardwise.spec.dims import offload_tier

    tier = offload_tier(cfg.parallel)
    held = {**held, "host": 0, "disk": 0}
    if tier == "nvme":
        ordered = [p for g in getattr(optimizer, "optim", optimizer).param_groups for p in g["params"]]
        chunks = NvmeAdamW._cut(ordered, DEFAULT_CHUNK_BYTES)
        largest = max((sum(_local(p).numel() for p in chunk) for chunk in chunks), default=0)
        # NvmeAdamW.resident_bytes: two fp32 buffers of 2 x the largest chunk's elements, a 4-byte step each
        held["optimizer"] = 2 * (2 * largest * 4) + 4 * len(ordered)
        held["disk"] = sum(_local(p).numel() for p in ordered) * STATE_BYTES_PER_ELEMENT
    if tier != "none" and not Problem.from_config(cfg).cluster.device_is_host:
        held["host"] = held["params"] + held["grads"] + held["optimizer"]
        held.update(params=0, grads=0, optimizer=0)
    return held


def init_optimizer_state(optimizer) -> None:
    """The state AdamW makes on its first step, made by AdamW itself (torch.optim.Adam._init_group: the lazy
    init of exp_avg, exp_avg_sq and `step` for every parameter with a gradient), without the step's arithmetic:
    a foreach step over DTensors propagates shardings op by op over every tensor, 150 s of CPU on a Llama 3
    405B rank at 16,384 (measured), where the init takes one zeros_like per tensor. A torch without that
    method takes the step."""
    init = getattr(optimizer, "_init_group", None)
    if init is None:
        optimizer.step()
        return
    for group in optimizer.param_groups:
        init(group, [], [], [], [], [], [])


def _child(argv: list[str]) -> int:
    """python -m shardwise.launch.dryrun --child CONFIG WORLD RANK OUT [--step]: build_rank, its result (or
    its ConfigError) as JSON in OUT."""
    config, world, rank, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    try:
        stepping = {"step": True} if "--step" in argv[4:] else {}  # build_rank(cfg, world, rank) otherwise
        result = build_rank(load_config(config), world, rank, **stepping)
    except ConfigError as e:
        out.write_text(json.dumps({"config_error": [e.field, e.problem, e.fix]}))
        return 2
    out.write_text(json.dumps(result))
    return 0


def warm_imports(compiled: bool) -> float:
    """Import, once in this process, what build_rank imports (torch, the model, parallelize, the fake group;
    `compiled`: dynamo and inductor, which torch.compile's wrapper imports on first use, 3-5 s of CPU): each
    forked child inherits them, so its time is its rank's build. Returns the seconds it took."""
    start = time.perf_counter()
    if compiled:
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
    import torch
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    # The first op on the meta device imports its kernels (torch._meta_registrations, refs, decompositions:
    # ~1.7 s); a meta op starts no thread pool, so forking after it is safe.
    torch.empty(1, device="meta").normal_()

    import shardwise.models  # noqa: F401
    import shardwise.parallel.parallelize  # noqa: F401
    import shardwise.train.memory_meter  # noqa: F401
    import shardwise.train.optim  # noqa: F401
    return time.perf_counter() - start


def _forked(config_path: Path, world: int, rank: int, out: Path, err: Path, step: bool) -> int:
    """The child's pid, forked from this process (warm_imports ran: module doc): it runs _child and
    ends with os._exit, so nothing of the parent's (atexit, pytest, buffered files) runs twice."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)  # the child's stderr (a traceback) to `err`; its stdout is silenced
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        # sys.stderr too: the parent's may be no file at all (pytest's capture, any embedding), and a failed
        # build's last line, which run_rank reports, would go there instead of to `err`
        sys.stderr = open(2, "w", closefd=False)
        code = _child([str(config_path), str(world), str(rank), str(out), *(["--step"] if step else [])])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _spawned(config_path: Path, world: int, rank: int, out: Path, err: Path, step: bool) -> int:
    """The child's pid, a fresh interpreter (`python -m shardwise.launch.dryrun --child ...`)."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the child imports this shardwise (a source checkout too)
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    with open(err, "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-m", "shardwise.launch.dryrun", CHILD, str(config_path), str(world),
                                  str(rank), str(out), *(["--step"] if step else [])], stdout=subprocess.DEVNULL,
                                 stderr=stderr, env=env)
    child.returncode = 0  # reaped by run_rank's os.wait4: Popen must not wait for it again
    return child.pid


def run_rank(config_path: Path, world: int, rank: int, scratch: Path, spawn: bool = False, step: bool = False) -> dict:
    """build_rank in a process of its own: forked from this one (torch imported once, here), or with `spawn` a
    fresh interpreter; its result with the child's wall time and peak RSS (os.wait4: that child's rusage)."""
    out, err = scratch / f"rank{rank}.json", scratch / f"rank{rank}.err"
    start = time.perf_counter()
    pid = (_spawned if spawn or not hasattr(os, "fork") else _forked)(config_path, world, rank, out, err, step)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    result = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    if "config_error" in result:
        raise ConfigError(*result["config_error"])
    if code != 0 or not result:
        lines = err.read_text(errors="replace").strip().splitlines() if err.exists() else []
        result = {"rank": rank, "error": lines[-1] if lines else f"exit code {code}"}
    # ru_maxrss is in KiB on Linux; CPU seconds (user + system) do not grow with other load on the machine
    result.update(wall_s=round(wall, 3), cpu_s=round(usage.ru_utime + usage.ru_stime, 3),
                  peak_rss_bytes=usage.ru_maxrss * 1024)
    return result


# ---------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def table(rows: list[dict]) -> str:
    """One line per rank and category: built, planned, difference (bytes and GiB), then time and memory.
    With offload the "host" (and "nvme"'s "disk") lines too, where either side holds bytes there; with
    --step a "comm AXIS" line per mesh axis: the step's counted payload bytes and the planner's."""
    head = (f"{'rank':>6} {'pp':>3} {'category':<{WIDE}} {'built B':>16} {'planned B':>16} {'diff B':>14} "
            f"{'built GiB':>10} {'planned':>8} {'wall s':>7} {'CPU s':>6} {'peak RSS MiB':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        pp = r.get("coordinates", {}).get("pp", "")
        if "error" in r:
            lines.append(f"{r['rank']:>6} {pp:>3} failed: {r['error']}")
            continue
        shown = [*CATEGORIES, *(c for c in PLACES if r.get(c) or r["planned"].get(c))]
        for i, c in enumerate(shown):
            built, planned = r.get(c, 0), r["planned"].get(c, 0)
            tail = f" {r['wall_s']:>7.1f} {r['cpu_s']:>6.1f} {r['peak_rss_bytes'] / 2**20:>12.0f}" if i == 0 else ""
            lines.append(f"{r['rank'] if i == 0 else '':>6} {pp if i == 0 else '':>3} {c:<{WIDE}} {built:>16,} "
                         f"{planned:>16,.0f} {built - planned:>+14,.0f} {_gib(built):>10} {_gib(planned):>8}{tail}")
        lines += comm_lines(r)
    return "\n".join(lines)


def preflight(cfg: Config, world: int):
    """Every pre-flight rule at `world` ranks (preflight.py check, check_batch): the job's ParallelDims, or the
    ConfigError `shardwise train` would end with."""
    from shardwise.preflight import check, check_batch

    dims = check(cfg, world)
    check_batch(cfg, dims)
    return dims


def warm(cfg: Config, spawn: bool) -> float | None:
    """warm_imports for `cfg`'s ranks when they are forked (seconds), None when each is spawned."""
    if spawn or not hasattr(os, "fork"):
        return None
    from shardwise.parallel.compile import compile_enabled
    from shardwise.plan.layout import Problem

    return warm_imports(compile_enabled(cfg, Problem.from_config(cfg).device_type))


def build_ranks(cfg: Config, dims, chosen: list[int], log=print, spawn: bool = False, step: bool = False) -> list[dict]:
    """Each of `chosen` built (run_rank) and priced (planned_bytes), one after the other; `cfg` passed
    pre-flight at dims.world_size ranks. `step`: each also runs a training step, its counted collective
    bytes beside the planner's (plan/comm.py predict_comm_bytes)."""
    from shardwise.plan.comm import predict_comm_bytes

    rows, world = [], dims.world_size
    with tempfile.TemporaryDirectory(prefix="shardwise-dryrun-") as scratch:
        config_path = Path(scratch) / "config.toml"
        cfg.save(config_path)
        for rank in chosen:
            row = run_rank(config_path, world, rank, Path(scratch), spawn, step)
            row["planned"] = planned_bytes(cfg, world, rank)
            if step:
                row["planned_comm"] = predict_comm_bytes(cfg, dims, rank)
            row.setdefault("coordinates", dims.coordinates(rank))
            rows.append(row)
            if "error" not in row:
                ran = f", its step {row['step_s']:.1f} s of it" if "step_s" in row else ""
                log(f"  rank {rank}: built in {row['wall_s']:.1f} s ({row['cpu_s']:.1f} s of CPU{ran}), "
                    f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB")
    return rows


def run(cfg: Config, nnodes: int, nproc: int, ranks: str | None, log=print, spawn: bool = False,
        step: bool = False) -> list[dict]:
    """Pre-flight at N x P ranks, then every chosen rank built and priced (module doc)."""
    cfg = job_config(cfg, nnodes, nproc)
    world = nnodes * nproc
    dims = preflight(cfg, world)
    chosen = parse_ranks(ranks, dims)
    log(f"dryrun: {world} ranks ({nnodes} nodes x {nproc}), layout {dims.describe()}; building rank"
        f"{'s' * (len(chosen) > 1)} {', '.join(map(str, chosen))} on the meta device, one process each")
    took = warm(cfg, spawn)
    if took is not None:
        log(f"  imports, once, for every rank: {took:.1f} s (not in a rank's time)")
    return build_ranks(cfg, dims, chosen, log, spawn, step)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardwise dryrun", usage="shardwise dryrun --config FILE.toml --nnodes N --nproc P [--ranks 0,last,...] "
                                       "[--step] [--json FILE] [--section.key=value ...]",
        description="Build chosen ranks of an N x P job on the meta device under torch's fake process group, "
                    "and hold their parameter, gradient and optimizer bytes (with --step: each collective's bytes per step) "
                    "against the planner's.")
    parser.add_argument("--config", default=None, help="TOML config file (default: built-in defaults)")
    parser.add_argument("--nnodes", type=int, required=True, help="nodes of the job")
    parser.add_argument("--nproc", type=int, required=True, help="processes (GPUs) per node")
    parser.add_argument("--ranks", default=None, help="global ranks to build, comma-separated (`last` for the last); "
                        "default: the first and last rank of every pipeline stage, and with EP the ranks holding other "
                        "experts or another shard of them")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--spawn", action="store_true", help="build each rank in a fresh interpreter (its time then "
                        "includes importing torch) instead of a process forked from this one")
    parser.add_argument("--step", action="store_true", help="also run one training step on each rank (meta tensors) "
                        "and hold its collectives' bytes per mesh axis, counted by the trainer's counter, against the "
                        "planner's")
    args, overrides = parser.parse_known_args(argv)
    for name in ("nnodes", "nproc"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name}", f"must be >= 1, got {getattr(args, name)}", "e.g. --nnodes 128 --nproc 8")
    if args.json:
        from shardwise.paths import writable_file

        writable_file(Path(args.json), "--json")
    rows = run(load_config(args.config, overrides), args.nnodes, args.nproc, args.ranks, spawn=args.spawn,
               step=args.step)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"nnodes": args.nnodes, "nproc": args.nproc, "ranks": rows}, indent=1))
        print(f"wrote {args.json}")
    return EXIT_FAILED if any("error" in r for r in rows) else EXIT_OK


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        sys.exit(_child(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
