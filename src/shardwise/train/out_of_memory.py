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
from typing import TYPE_CHECKING, Any, Callable

import torch

from shardwise.config import Config
from shardwise.errors import OutOfMemory, exception_chain, out_of_memory, rerun_to_resume
from shardwise.spec.hf import exportable
from shardwise.spec.layout import Layout
from shardwise.spec.rules import alternate_matmuls_rule
from shardwise.spec.shapes import ModelShape
from shardwise.train.manifest import step_dir_name
from shardwise.train.planned_memory import PlannedMemory, local_world_size, planned_memory

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

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


def allocation_failure(e: "CheckpointException") -> str | None:
    """The allocator's words when a rank's part of a failed DCP save could not allocate, else None."""
    return next((what for exc, _trace in e.failures.values() for c in exception_chain(exc)
                 if (what := out_of_memory(c)) is not None), None)


class SaveOutOfMemory(Exception):
    """DCP's save could not allocate on some rank, agreed by every rank (`what`: the allocator's words on a
    rank that failed, None on the others); the partial checkpoint is removed. `saving_checkpoint` words it
    (checkpoint_save_line)."""

    def __init__(self, what: str | None):
        super().__init__(what or "out of memory on another rank")
        self.what = what


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


def allocator_place(what: str, device_type: str) -> str:
    """Which memory ran out, from the allocator's words (errors.out_of_memory): c10's DefaultCPUAllocator and
    Python's own speak of the host, whatever device trains; otherwise the training device's (CUDA's caching
    allocator: the GPU). A checkpoint save or a host-offloaded optimizer fails in host memory on a GPU too."""
    if "DefaultCPUAllocator" in what or what.startswith("Python could not"):
        return "host"
    return {"cuda": "GPU", "cpu": "host"}.get(device_type, device_type)


def _alternate_runs(cfg: Config) -> bool:
    """Whether recompute_policy "op_alternate" would run with this model and layout (spec/rules.py)."""
    p = cfg.parallel
    lay = Layout(recompute="selective", recompute_policy="op_alternate", linear_tiles=p.linear_tiles, tp_mode=p.tp_mode)
    return alternate_matmuls_rule(ModelShape.from_config(cfg.model), lay) is None


def out_of_memory_line(cfg: Config, rank: int, step: int | None, device_type: str, what: str,
                       snapshot: Path | None, planned: PlannedMemory | None = None, evaluating: bool = False) -> str:
    """The one line of a failed allocation (errors.OutOfMemory, exit 7) in `step` (None: before the first
    step, building the model or loading its checkpoint): where, the allocator's words (`what`), what the
    planner expected (`planned`, on a GPU of its table), what lowers the peak, each setting with its value
    (the planner prices every one), and the allocator's history up to it (`snapshot`) or, on a GPU, how to
    record it. `evaluating`: in the validation round after `step` (forward only: recomputation saves nothing
    there, and the checkpoint of that step is not written yet)."""
    t, p = cfg.train, cfg.parallel
    place = allocator_place(what, device_type)
    states = f"parallel.zero=3 (now {p.zero}) over more ranks, parallel.offload=cpu (now {p.offload}) or parallel.tp (now {p.tp})"
    if step is None:  # the model states alone: activations do not exist yet
        when, fix = "before the first step (building the model or loading its checkpoint)", f"shard the model states: {states}"
    else:
        batch = f"train.micro_batch (now {t.micro_batch}; train.global_batch stays, by accumulation), " \
            if t.micro_batch > 1 else ""
        # Keeping every other matmul output costs less than full recomputation, where the rule lets it run
        alternate = "train.recompute_policy=op_alternate (now op) or " if t.recompute == "selective" and \
            t.recompute_policy == "op" and _alternate_runs(cfg) else ""
        lower = f"lower {batch}" if batch else ""
        when, fix = f"in step {step}", f"{lower}set {alternate}train.recompute=full (now {t.recompute}), {states}"
        if evaluating:  # a round's micro-batches are training's, run forward only
            when, fix = f"in the validation round after step {step}", f"{lower}{states}"
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
    with reported_as_out_of_memory(lambda what: _setup_line(cfg, rank, world_size, what), run_dir, run_id):
        yield


def _setup_line(cfg: Config, rank: int, world_size: int, what: str) -> str:
    """The out-of-memory line before the first step (no trainer yet): this process's device, and on a GPU
    of the planner's table what it expected for the layout."""
    from shardwise.train.distributed import default_device

    device_type = default_device().type
    planned = planned_memory(cfg, world_size, local_world_size(world_size), torch.cuda.get_device_name()) \
        if device_type == "cuda" else None
    return out_of_memory_line(cfg, rank, None, device_type, what, None, planned)


def final_model_line(rank: int, device_type: str, what: str, path: Path, step: int, run_dir: Path,
                     final_checkpoint: Path | None, exportable: bool = True) -> str:
    """The one line of a failed allocation while `run.save_final_model` gathers the whole model onto one rank
    (exit 7, not restarted: the same gather fails the same way). The steps are done; what the user does
    next is get the weights another way: `shardwise export` reads the last step's checkpoint on one
    process, one output shard of weights in memory at a time (train/export.py), where the gather held the
    whole fp32 model on rank 0 beside its share of the training state; a model without a Hugging Face
    equivalent (`exportable` False: a GPT, an MoE) keeps them in the checkpoint, which `shardwise generate
    --run-dir` reads. Without that checkpoint (checkpoint.final=false) the last steps must run again."""
    export = f"`shardwise export --run-dir {run_dir} --hf OUT`"
    if final_checkpoint is None:
        next_step = ("no checkpoint holds the last step's weights (checkpoint.final=false): rerun with "
                     "--checkpoint.final=true --run.save_final_model=false" + (f", then {export}" if exportable else ""))
    elif exportable:
        next_step = (f"the training is complete and its checkpoint {final_checkpoint} is intact: write the full "
                     f"weights from it with {export} (one output shard in memory at a time) instead of "
                     "run.save_final_model")
    else:
        next_step = (f"the training is complete and its checkpoint {final_checkpoint} is intact, with the weights "
                     f"`shardwise generate --run-dir {run_dir}` and a resume read (this model has no Hugging Face export)")
    return (f"rank {rank} ran out of {allocator_place(what, device_type)} memory writing the full model to {path} "
            f"(run.save_final_model) after the last step ({step}): {what}; {next_step}")


def remains_words(newest: Path | None) -> str:
    """What remains to resume from after a failed save, in words (`newest`: the newest intact checkpoint)."""
    return f"{newest} is intact" if newest is not None else "no earlier checkpoint exists"


def checkpoint_save_line(cfg: Config, rank: int, device_type: str, what: str, step: int, newest: Path | None,
                         removed: bool, listed: bool = True) -> str:
    """The one line of a failed allocation while a checkpoint is saved (exit 7). DCP's writer copies each
    tensor through host memory (torch.distributed.checkpoint's FileSystemWriter: a tensor's bytes at a time, a
    few MB ahead per thread), so a save that cannot allocate found host memory nearly full already: the fix
    names what else holds it. `removed`: DCP's save failed on every rank together and rank 0 removed the
    partial checkpoint; otherwise one rank failed outside it and the partial one (step_N.tmp) stays, never
    resumed from (not a checkpoint's name), until the next save of that step replaces it. `newest`: the newest
    intact checkpoint, which a rerun resumes from; `listed` False: the checkpoint directory could not be listed
    (memory short for that too), so the line says only that the earlier checkpoints were not touched."""
    place = allocator_place(what, device_type)
    holders = ([f"data.num_workers (now {cfg.data.num_workers}: loader processes per rank)"] if cfg.data.num_workers else []) + \
        ([f"parallel.offload (now {cfg.parallel.offload}: the model states live there)"] if cfg.parallel.offload != "none" else [])
    if place != "host":
        fix = "the save adds little on the GPU beyond the step's own peak: lower that as `shardwise plan evaluate` shows it"
    elif holders:
        fix = f"lower what else holds this node's host memory: {', '.join(holders)}"
    else:
        fix = "free host memory on this node (other processes hold it) or run fewer ranks per node"
    partial = "the partial checkpoint was removed" if removed else \
        f"the partial checkpoint ({step_dir_name(step)}.tmp) is never resumed from"
    kept = remains_words(newest) if listed else "the earlier checkpoints were not touched"
    rerun = f"then {rerun_to_resume(cfg.checkpoint.resume)}" if listed and newest is not None else "then rerun"
    return f"checkpoint: rank {rank} ran out of {place} memory saving step {step}: {what}; {partial} and {kept}; fix: {fix}, {rerun}"


@contextlib.contextmanager
def reported_as_out_of_memory(line_for: Callable[[str], str], run_dir: Path | None, run_id: str):
    """Around a phase outside the steps (building the trainer, a checkpoint save, the final model's gather): a
    failed allocation there becomes errors.OutOfMemory (exit 7) with `line_for(the allocator's words)`, printed
    by the first rank to fail (`first_to_report`; every rank without a run directory); in a collective the
    others meet its absence and stop with it. Anything else passes through."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        what = out_of_memory(e)
        if what is None:
            raise
        line = line_for(what)
        raise OutOfMemory(line, report=first_to_report(run_dir, run_id, line) if run_dir else True) from None


@contextlib.contextmanager
def saving_checkpoint(cfg: Config, rank: int, device_type: str, step: int, newest: Callable[[], Path | None],
                      run_dir: Path, run_id: str):
    """Around Trainer.save_checkpoint's save: out of memory in DCP's save (SaveOutOfMemory: agreed by every rank,
    the partial checkpoint removed) or outside it on one rank (DCP's planning, a state dict, the checksums)
    becomes errors.OutOfMemory with checkpoint_save_line. `newest()` (the newest intact checkpoint, or None)
    lists the checkpoint directory, only on failure (every rank, every save, would load a shared file system);
    with memory short that can fail too, and the line then says less."""
    def line(what: str, removed: bool = False) -> str:
        try:
            return checkpoint_save_line(cfg, rank, device_type, what, step, newest(), removed)
        except (OSError, MemoryError):
            return checkpoint_save_line(cfg, rank, device_type, what, step, None, removed, listed=False)
    try:
        with reported_as_out_of_memory(line, run_dir, run_id):
            yield
    except SaveOutOfMemory as e:
        text = line(e.what or "", removed=True)
        raise OutOfMemory(text, report=e.what is not None and first_to_report(run_dir, run_id, text)) from None


def saving_final_model(rank: int, device_type: str, path: Path, step: int, run_dir: Path, final_checkpoint: Path | None,
                       run_id: str, model: Any):
    """Around run.save_final_model's gather and write: out of memory there becomes errors.OutOfMemory with
    final_model_line (`model`: the ModelConfig, whether `shardwise export` writes it: spec/hf.py exportable)."""
    return reported_as_out_of_memory(lambda what: final_model_line(rank, device_type, what, path, step, run_dir, final_checkpoint,
                                                                   exportable(model)), run_dir, run_id)
