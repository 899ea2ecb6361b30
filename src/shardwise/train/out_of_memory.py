"""When memory runs out: the one line of a failed allocation (errors.OutOfMemory, exit 7), and the CUDA
caching allocator's history that shows what held the memory (run.memory_snapshot).

The line: the rank, the step (or before the first), the allocator's own words, what the planner
expected on this GPU (train/planned_memory.py), the settings that lower the peak with their values, and
the history's file or how to record one. Ranks of one layout fail together and cannot agree in a
collective then: the first to claim a file prints (`first_to_report`).

The history (open the file at https://pytorch.org/memory_viz: every allocation with its Python stack,
over time) is what torchtitan's `profiling.enable_memory_snapshot` and Megatron-LM's
`--record-memory-history` give, and how the planner's memory model is checked on a GPU
(plan/fsdp_memory.py). Recording starts when the trainer does (the parameters' allocations included)
and stops at the first file: after step SNAPSHOT_AFTER_STEP, the first step that runs as every later one
does (compiled, the optimizer's state allocated), or the run's last step, whichever comes first; or when
a step runs out of memory. One file per rank under <run.dir>/memory_snapshot/. Recording takes a stack
trace at every allocation, which costs time, so it is off by default. A CPU has no such allocator: the
option says so and records nothing.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from shardwise.config import Config
from shardwise.errors import OutOfMemory, out_of_memory
from shardwise.train.planned_memory import PlannedMemory, local_world_size, planned_memory

SNAPSHOT_AFTER_STEP = 2
# Allocator events kept, a ring that drops the oldest first: PyTorch's guide to memory snapshots records
# 100,000; twice that keeps more of a deep model's start by the end of step 2.
MAX_ENTRIES = 200_000
# Python frames only. torch's default ("all") adds C++ frames, which it symbolizes when the file is written:
# torchtitan measured one dump of a 16B model at ~461 s with them and ~4 s without (pytorch/torchtitan#3628),
# and their unwinder can fail on generated code (#2991). On this CPU build, symbolizing the C++ tracebacks of
# 418 ops of two toy steps took 0.43 s, the Python ones 0.00 s; CUDA's libraries are far larger. The lines
# benchmarks/memory_peak.py names are Python lines, and the viewer shows those.
STACKS = "python"
VIEWER = "https://pytorch.org/memory_viz"


class MemorySnapshot:
    def __init__(self, enabled: bool, device: torch.device, run_dir: Path, rank: int):
        self.directory, self.rank = Path(run_dir) / "memory_snapshot", rank
        self.recording = enabled and device.type == "cuda"
        self.note = (f"run.memory_snapshot: records the CUDA caching allocator's history; {device.type} has none, "
                     "nothing is recorded") if enabled and not self.recording else None
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks=STACKS)

    def after_step(self, step: int, last: bool) -> Path | None:
        """The file written after `step` (SNAPSHOT_AFTER_STEP, or the run's last), else None."""
        if self.recording and (step >= SNAPSHOT_AFTER_STEP or last):
            return self._dump(f"rank_{self.rank}_step_{step}.pickle")
        return None

    def out_of_memory(self) -> Path | None:
        """The history up to a failed allocation, when recording."""
        return self._dump(f"rank_{self.rank}_out_of_memory.pickle") if self.recording else None

    def _dump(self, name: str) -> Path:
        # torch writes the snapshot as a pickle (the viewer's format); nothing here ever reads one back.
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / name
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        return path


def out_of_memory_line(cfg: Config, rank: int, step: int | None, device_type: str, what: str,
                       snapshot: Path | None, planned: PlannedMemory | None = None) -> str:
    """The one line of a failed allocation (errors.OutOfMemory, exit 7) in `step` (None: before the first
    step, building the model or loading its checkpoint): where, the allocator's words (`what`), what the
    planner expected (`planned`, on a GPU of its table), what lowers the peak, each setting with its value
    (the planner prices every one), and the allocator's history up to it (`snapshot`) or, on a GPU, how to
    record it."""
    t, p = cfg.train, cfg.parallel
    place = {"cuda": "GPU", "cpu": "host"}.get(device_type, device_type)
    states = f"parallel.zero=3 (now {p.zero}) over more ranks, parallel.offload=cpu (now {p.offload}) or parallel.tp (now {p.tp})"
    if step is None:  # the model states alone: activations do not exist yet
        when, fix = "before the first step (building the model or loading its checkpoint)", f"shard the model states: {states}"
    else:
        batch = f"train.micro_batch (now {t.micro_batch}; train.global_batch stays, by accumulation), " \
            if t.micro_batch > 1 else ""
        when, fix = f"in step {step}", f"{'lower ' + batch if batch else ''}set train.recompute=full (now {t.recompute}), {states}"
    history = f"; what held the memory: {snapshot} ({VIEWER})" if snapshot else \
        "; rerun with --run.memory_snapshot=true to record what held it" if device_type == "cuda" else ""
    expected = "" if planned is None else f"; the planner expected {planned.words()}" + (
        ": this layout does not fit" if not planned.fits else "")
    return (f"rank {rank} ran out of {place} memory {when}: {what}{expected}; fix: {fix}; `shardwise plan evaluate` with the same "
            f"options shows the memory by category and `shardwise plan search` a layout that fits (docs/memory.md){history}")


def first_to_report(run_dir: Path, run_id: str, line: str) -> bool:
    """Whether this rank prints the out-of-memory line: ranks run out of memory together (the same
    layout on every rank), and they cannot agree in a collective then, so the first to create
    <run_dir>/errors/out_of_memory.<run_id>.txt (exclusive create, atomic) prints it and the others stay
    quiet; one line per job on a shared run directory, one per node on local ones. Without a job id (an
    in-process run) or a writable directory, every rank prints its own."""
    if not run_id:
        return True
    path = Path(run_dir) / "errors" / f"out_of_memory.{run_id}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as f:
            f.write(line + "\n")
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def building_the_trainer(cfg: Config, rank: int, world_size: int, run_dir: Path | None = None, run_id: str = ""):
    """Around `Trainer(...)`: a failed allocation there (the model, its checkpoint) becomes errors.OutOfMemory
    (exit 7) with the line for before the first step, which the callers' RunFailure handling prints and
    records like any other; a step's own is raised by the trainer's loop."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        what = out_of_memory(e)
        if what is None:
            raise
        line = _setup_line(cfg, rank, world_size, what)
        raise OutOfMemory(line, report=first_to_report(run_dir, run_id, line) if run_dir else True) from None


def _setup_line(cfg: Config, rank: int, world_size: int, what: str) -> str:
    """The out-of-memory line before the first step (no trainer yet): this process's device, and on a GPU
    of the planner's table what it expected for the layout."""
    from shardwise.train.distributed import default_device

    device_type = default_device().type
    planned = planned_memory(cfg, world_size, local_world_size(world_size), torch.cuda.get_device_name()) \
        if device_type == "cuda" else None
    return out_of_memory_line(cfg, rank, None, device_type, what, None, planned)
