"""errors.out_of_memory: which failures are a failed allocation (exit 7, errors.OutOfMemory); the line the user
reads (train/out_of_memory.py out_of_memory_line); run.memory_snapshot's recording decisions. The GPU's
words are tested here on CPU (torch.OutOfMemoryError is the CUDA caching allocator's exception class; its
text below is the allocator's format); tests/dist/test_run_safety_cli.py provokes a real host-memory
failure and follows the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import EXIT_OUT_OF_MEMORY, NOT_RESTARTABLE, OutOfMemory, out_of_memory
from shardwise.train.out_of_memory import (
    MAX_ENTRIES,
    SNAPSHOT_AFTER_STEP,
    MemorySnapshot,
    allocation_failure,
    checkpoint_save_line,
    final_model_line,
    first_to_report,
    out_of_memory_line,
)

# The CUDA caching allocator's message (c10/cuda/CUDACachingAllocator.cpp, torch 2.11): one line.
CUDA_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "1.02 GiB is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the allocated "
             "memory 75.30 GiB is allocated by PyTorch, and 1.40 GiB is reserved by PyTorch but unallocated. If reserved "
             "but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
             "fragmentation.  See documentation for Memory Management  "
             "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
CUDA_WORDS = CUDA_TEXT[:CUDA_TEXT.index("  See documentation")]


def test_the_gpu_allocators_error_keeps_its_numbers_and_advice_but_not_its_link():
    """Where the memory went (free, in use, allocated, reserved but unallocated: fragmentation) and torch's
    own advice for fragmentation stay; the link to the documentation goes."""
    assert out_of_memory(torch.OutOfMemoryError(CUDA_TEXT)) == CUDA_WORDS
    assert CUDA_WORDS.endswith("1.40 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
                               "large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_the_host_allocators_error_loses_its_c10_prefix():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: refused by the host allocator (or the kernel) at once
    assert out_of_memory(caught.value).startswith("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                  "allocate 1125899906842624 bytes")
    assert out_of_memory(MemoryError()) == "Python could not allocate memory"


def test_other_failures_are_not_out_of_memory():
    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)")) is None
    assert out_of_memory(ValueError("bad value")) is None


def test_out_of_memory_is_its_own_code_and_never_restarted():
    assert OutOfMemory("x").exit_code == EXIT_OUT_OF_MEMORY == 7 and EXIT_OUT_OF_MEMORY in NOT_RESTARTABLE


def _fake_allocator(monkeypatch) -> list[tuple]:
    """torch.cuda.memory's recording and dumping, replaced by a log: the decisions run on CPU."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", max_entries=0, stacks="all", **_: calls.append(("record", enabled, max_entries, stacks)))

    def dump(path):
        calls.append(("dump", path))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def test_a_gpu_run_records_from_the_start_and_writes_after_step_two(monkeypatch, tmp_path):
    calls = _fake_allocator(monkeypatch)
    snap = MemorySnapshot(True, torch.device("cuda"), tmp_path, rank=3)
    # Python stacks only: torch's default adds C++ frames, whose symbolization at the dump can take minutes
    assert snap.note is None and calls == [("record", "all", MAX_ENTRIES, "python")]
    assert snap.after_step(1, last=False) is None
    path = snap.after_step(SNAPSHOT_AFTER_STEP, last=False)
    assert path == tmp_path / "memory_snapshot" / "rank_3_step_2.pickle" and path.read_bytes() == b"snapshot"
    assert calls[1:] == [("dump", str(path)), ("record", None, 0, "all")]  # written once, then recording stops
    assert snap.after_step(3, last=True) is None and snap.out_of_memory() is None and len(calls) == 3


def test_a_one_step_run_writes_after_it_and_an_out_of_memory_step_writes_its_history(monkeypatch, tmp_path):
    calls = _fake_allocator(monkeypatch)
    assert MemorySnapshot(True, torch.device("cuda"), tmp_path, 0).after_step(1, last=True).name == "rank_0_step_1.pickle"
    snap = MemorySnapshot(True, torch.device("cuda"), tmp_path, 1)
    path = snap.out_of_memory()
    assert path.name == "rank_1_out_of_memory.pickle" and calls[-2:] == [("dump", str(path)), ("record", None, 0, "all")]


def test_off_or_on_a_cpu_nothing_is_recorded(monkeypatch, tmp_path):
    calls = _fake_allocator(monkeypatch)
    cpu = MemorySnapshot(True, torch.device("cpu"), tmp_path, 0)
    assert "cpu has none, nothing is recorded" in cpu.note
    off = MemorySnapshot(False, torch.device("cuda"), tmp_path, 0)
    assert off.note is None
    assert [s.after_step(2, last=True) for s in (cpu, off)] == [None, None] and cpu.out_of_memory() is None
    assert calls == [] and not (tmp_path / "memory_snapshot").exists()


def test_the_line_names_the_settings_and_the_history():
    cfg = load_config(None, ["--train.micro_batch=8", "--train.global_batch=16", "--train.recompute=selective"])
    line = out_of_memory_line(cfg, 5, 3, "cuda", CUDA_WORDS, None)
    assert line.startswith("rank 5 ran out of GPU memory in step 3: CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert "fix: lower train.micro_batch (now 8; train.global_batch stays, by accumulation), set train.recompute_policy=" \
           "op_alternate (now op) or train.recompute=full (now selective), parallel.zero=3 (now 0) over more ranks, " \
           "parallel.offload=cpu (now none) or parallel.tp (now 1);" in line
    # op_alternate is offered only where it runs: not to a MoE model, nor once chosen
    for more in (["--model.preset=tiny-moe"], ["--train.recompute_policy=op_alternate"]):
        other = load_config(None, ["--train.micro_batch=8", "--train.global_batch=16", "--train.recompute=selective", *more])
        assert "op_alternate (now" not in out_of_memory_line(other, 5, 3, "cuda", CUDA_WORDS, None)
    assert line.endswith("; rerun with --run.memory_snapshot=true to record what held it")
    snapshot = Path("runs/x/memory_snapshot/rank_5_out_of_memory.pickle")
    assert line.replace("; rerun with --run.memory_snapshot=true to record what held it", "") + \
        f"; what held the memory: {snapshot} (https://pytorch.org/memory_viz)" == \
        out_of_memory_line(cfg, 5, 3, "cuda", CUDA_WORDS, snapshot)
    one = load_config(None, ["--train.micro_batch=1"])
    host = out_of_memory_line(one, 0, 1, "cpu", "DefaultCPUAllocator: can't allocate memory", None)
    assert "host memory" in host and "micro_batch" not in host and "memory_snapshot" not in host
    # before the first step only the model states exist: neither the batch nor recomputation helps
    setup = out_of_memory_line(cfg, 0, None, "cuda", "CUDA out of memory.", None)
    assert "before the first step (building the model or loading its checkpoint): CUDA out of memory.; fix: shard " \
           "the model states: parallel.zero=3 (now 0) over more ranks, parallel.offload=cpu (now none) or parallel.tp " \
           "(now 1);" in setup and "micro_batch" not in setup and "recompute" not in setup


def test_the_first_rank_of_a_job_to_fail_prints_the_line(tmp_path):
    assert first_to_report(tmp_path, "job-a", "rank 1 ran out") and not first_to_report(tmp_path, "job-a", "rank 0 ran out")
    assert (tmp_path / "errors" / "out_of_memory.job-a.txt").read_text() == "rank 1 ran out\n"
    assert first_to_report(tmp_path, "job-b", "rank 0 ran out")  # the next job in the same directory prints again
    assert first_to_report(tmp_path, "", "x") and first_to_report(tmp_path, "", "x")  # no job id: every rank
    (tmp_path / "a-file").write_text("")
    assert first_to_report(tmp_path / "a-file", "job-a", "x")  # cannot record it: print rather than hide it


HOST_WORDS = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 16777216 bytes. Error code 12 (Cannot allocate memory)"


def test_the_allocators_words_say_which_memory_ran_out_whatever_device_trains():
    """On a GPU run a host allocation can fail too (parallel.offload=cpu's optimizer step, a checkpoint
    save): the line said "GPU memory" there, from the device alone, and offered GPU settings."""
    cfg = load_config(None, ["--parallel.offload=cpu", "--parallel.zero=3"])
    assert "rank 0 ran out of host memory in step 4: DefaultCPUAllocator" in out_of_memory_line(cfg, 0, 4, "cuda", HOST_WORDS, None)
    assert "ran out of host memory" in out_of_memory_line(cfg, 0, 4, "cuda", "Python could not allocate memory", None)
    assert "ran out of GPU memory" in out_of_memory_line(cfg, 0, 4, "cuda", CUDA_WORDS, None)


def test_the_final_models_line_points_at_the_checkpoint_or_at_writing_one(tmp_path):
    run, path = tmp_path / "run", tmp_path / "run" / "final_model.pt"
    kept = run / "checkpoints" / "step_00000100"
    line = final_model_line(0, "cuda", CUDA_WORDS, path, 100, run, kept)
    assert line.startswith(f"rank 0 ran out of GPU memory writing the full model to {path} (run.save_final_model) after "
                           "the last step (100): CUDA out of memory.")
    assert line.endswith(f"the training is complete and its checkpoint {kept} is intact: write the full weights from it "
                         f"with `shardwise export --run-dir {run} --hf OUT` (one output shard in memory at a time) "
                         "instead of run.save_final_model")
    none = final_model_line(1, "cpu", HOST_WORDS, path, 100, run, None)
    assert none.startswith("rank 1 ran out of host memory") and none.endswith(
        "no checkpoint holds the last step's weights (checkpoint.final=false): rerun with --checkpoint.final=true "
        f"--run.save_final_model=false, then `shardwise export --run-dir {run} --hf OUT`")
    gpt = final_model_line(0, "cpu", HOST_WORDS, path, 100, run, kept, exportable=False)  # no Hugging Face export
    assert gpt.endswith(f"its checkpoint {kept} is intact, with the weights `shardwise generate --run-dir {run}` and a "
                        "resume read (this model has no Hugging Face export)")
    assert final_model_line(0, "cpu", HOST_WORDS, path, 100, run, None, exportable=False).endswith(
        "rerun with --checkpoint.final=true --run.save_final_model=false")


def test_the_checkpoint_save_line_names_what_else_holds_host_memory():
    newest = Path("runs/x/checkpoints/step_00000040")
    intact = f"{newest} is intact"
    busy = load_config(None, ["--data.num_workers=4", "--parallel.offload=cpu", "--parallel.zero=3"])
    line = checkpoint_save_line(busy, 3, "cuda", HOST_WORDS, 50, newest, removed=True)
    assert line == (f"checkpoint: rank 3 ran out of host memory saving step 50: {HOST_WORDS}; the partial checkpoint was "
                    f"removed and {intact}; fix: lower what else holds this node's host memory: data.num_workers (now 4: "
                    "loader processes per rank), parallel.offload (now cpu: the model states live there), then rerun the same command "
                    "to resume")
    fresh = load_config(None, ["--checkpoint.resume=false"])  # the same command would start over: name the override
    assert checkpoint_save_line(fresh, 0, "cpu", HOST_WORDS, 50, newest, removed=True).endswith(
        "then rerun with --checkpoint.resume=true to resume (with checkpoint.resume=false the same command starts over)")
    plain = load_config(None, [])
    line = checkpoint_save_line(plain, 0, "cpu", HOST_WORDS, 1, None, removed=False)
    assert line.endswith("the partial checkpoint (step_00000001.tmp) is never resumed from and no earlier checkpoint exists; "
                         "fix: free host memory on this node (other processes hold it) or run fewer ranks per node, then rerun")
    unlisted = checkpoint_save_line(plain, 0, "cpu", HOST_WORDS, 1, None, removed=True, listed=False)
    assert unlisted.endswith("the partial checkpoint was removed and the earlier checkpoints were not touched; fix: free "
                             "host memory on this node (other processes hold it) or run fewer ranks per node, then rerun")
    gpu = checkpoint_save_line(plain, 0, "cuda", CUDA_WORDS, 7, newest, removed=True)
    assert "ran out of GPU memory saving step 7" in gpu and "`shardwise plan evaluate`" in gpu


def test_a_failed_dcp_save_is_out_of_memory_when_a_ranks_failure_was():
    """DCP gathers each rank's exception into one CheckpointException (every rank raises it): the
    allocator's words are found on the rank that failed, in the exception or what caused it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. " + HOST_WORDS)
        except RuntimeError as inner:
            raise ValueError("while writing item 3") from inner
    except ValueError as e:
        wrapped = e
    assert allocation_failure(CheckpointException("save", {1: (wrapped, None)})) == HOST_WORDS
    assert allocation_failure(CheckpointException("save", {0: (OSError(28, "No space left on device"), None)})) is None


def test_out_of_memory_in_a_validation_round_is_exit_7_with_its_own_line(base_overrides, valid_overrides, tmp_path,
                                                                          monkeypatch):
    """A round runs training's micro-batches forward only: the line names the round and offers what lowers a
    forward's peak (not recomputation); the checkpoint of the step before is kept. (A round's peak is below
    a training step's: the allocation that fails is made where the round's first batch would run.)"""
    from shardwise.config import build_config
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, [*base_overrides, *valid_overrides, ("train.steps", "4"), ("eval.every", "2"),
                              ("checkpoint.every", "1"), ("train.micro_batch", "4"), ("run.dir", str(tmp_path / "run"))])
    trainer = Trainer(cfg, log=lambda _: None)
    rounds = []

    def round_that_fails(rows):
        rounds.append(trainer.step)
        return torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the host allocator refuses it at once

    monkeypatch.setattr(trainer, "eval_batch", round_that_fails)
    with pytest.raises(OutOfMemory) as e:
        trainer.train()
    line = str(e.value)
    assert rounds == [2] and line.startswith("rank 0 ran out of host memory in the validation round after step 2: "
                                             "DefaultCPUAllocator: can't allocate memory"), line
    assert "fix: lower train.micro_batch (now 4; train.global_batch stays, by accumulation), parallel.zero=3" in line
    assert "recompute" not in line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_00000001"]
