"""Out of memory after the steps, as users meet it ("OOM after the last epoch"): the whole model gathered
onto rank 0 for run.save_final_model, and a checkpoint save. Provoked for real: when the run reaches that
phase (a file it writes appears), its workers are stopped, their address space is capped at what they map
now plus a margin (RLIMIT_AS, set from outside with prlimit), and they go on. glibc is told to map every
allocation of 128 KB or more on its own (MALLOC_MMAP_THRESHOLD_), so memory the steps freed is given back
and the cap holds: the phase's own allocations are what fail. Then the user does what the line says."""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness import children, process_state, processes_mentioning, user_lines

# 8 blocks of dim 512 and ffn 2048: 4 MB weights, 33M parameters (131 MB in fp32) gathered onto rank 0, far
# above the margin; training itself is unchanged by the cap (it ran before).
MODEL = ["--model.dim=512", "--model.ffn_dim=2048", "--model.n_layers=8", "--train.steps=2", "--nproc", "2",
         "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2"]
MAP_ON_ITS_OWN = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "train.micro_batch"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip] + MODEL


def _command(common, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", "train", *common, f"--run.dir={run}", *extra]


def _run_capped_from(common, run: Path, trigger: Path, margin: int, *extra: str) -> tuple[int, str, str]:
    """The job, its workers capped at their mapped size + `margin` bytes once `trigger` exists."""
    proc = subprocess.Popen(_command(common, run, *extra), stdout=open(run.parent / f"{run.name}.out", "w"),
                            stderr=open(run.parent / f"{run.name}.err", "w"), cwd=run.parent,
                            env={**os.environ, **MAP_ON_ITS_OWN})
    deadline = time.monotonic() + 200
    while not trigger.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert trigger.exists(), f"the run never reached {trigger}"
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    while not all(process_state(pid) in (None, "T") for pid in workers):  # stopped, or gone
        time.sleep(0.001)
    for pid in workers:
        mapped = int(re.search(r"VmSize:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (mapped + margin, mapped + margin))
        os.kill(pid, signal.SIGCONT)
    proc.wait(timeout=200)
    return proc.returncode, (run.parent / f"{run.name}.out").read_text(), (run.parent / f"{run.name}.err").read_text()


def _one_line(code: int, out: str, err: str) -> str:
    """The user's one line of a job that ran out of memory: exit 7, no traceback, nothing else said."""
    assert code == 7, err[-3000:]
    assert "Traceback" not in out + err
    errors = user_lines(err)
    assert len(errors) == 1, errors
    return errors[0]


def test_out_of_memory_writing_the_final_model_exits_7_and_export_gives_the_weights(common, tmp_path):
    """Before: exit 1, "rank 0 failed: RuntimeError: [enforce fail at alloc_cpu.cpp:127] ...", and advice to
    rerun (run.max_restarts would gather again). Now: exit 7, one line saying the training is complete, its
    checkpoint is intact and `shardwise export` writes the weights from it; no restart. The export then gives
    exactly the weights the gather would have written (an uncapped run of the same job: bitwise)."""
    reference = tmp_path / "reference"
    done = subprocess.run(_command(common, reference, "--run.save_final_model=true"), capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "capped"
    last = run / "checkpoints" / "step_00000002"
    code, out, err = _run_capped_from(common, run, last / "manifest.json", 32 << 20, "--run.save_final_model=true",
                                      "--run.max_restarts=1")
    line = _one_line(code, out, err)
    assert re.match(rf"error: rank [01] ran out of host memory writing the full model to {run / 'final_model.pt'} "
                    r"\(run.save_final_model\) after the last step \(2\): DefaultCPUAllocator: can't allocate memory: .*; "
                    rf"the training is complete and its checkpoint {last} is intact: write the full weights from it with "
                    rf"`shardwise export --run-dir {run} --hf OUT`", line), line
    assert out.count("not training again: this job failed with exit code 7") == 1  # the restart ended at once
    assert not (run / "final_model.pt").exists()
    assert not processes_mentioning(str(run)), "a rank outlived the run"

    from safetensors.torch import load_file

    from shardwise.spec.hf import hf_name

    exported = tmp_path / "hf"
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "export", "--run-dir", str(run), "--hf", str(exported)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    weights = load_file(exported / "model.safetensors")
    gathered = torch.load(reference / "final_model.pt", weights_only=True)
    assert len(weights) == len(gathered) == 75
    for name, tensor in gathered.items():
        assert torch.equal(weights[hf_name(name)], tensor), name


def test_out_of_memory_saving_a_checkpoint_exits_7_and_a_rerun_trains(common, tmp_path):
    """A checkpoint save that cannot allocate (4 MB over what the ranks map when it begins). Before: exit 1 and
    a traceback, or C++ enforce text. Now: exit 7, one line naming the step, what became of the partial
    checkpoint and what else is intact, and what to free. The rerun it asks for trains to the end, never
    resuming from the partial checkpoint, which its own save of that step replaces."""
    run = tmp_path / "capped"
    partial = run / "checkpoints" / "step_00000001.tmp"
    code, out, err = _run_capped_from(common, run, partial, 4 << 20, "--checkpoint.every=1")
    line = _one_line(code, out, err)
    assert re.match(r"error: checkpoint: rank [01] ran out of host memory saving step 1: .*; the partial checkpoint "
                    r"(was removed|\(step_00000001.tmp\) is never resumed from) and no earlier checkpoint exists; "
                    r"fix: free host memory on this node \(other processes hold it\) or run fewer ranks per node, then rerun$",
                    line), line
    assert not processes_mentioning(str(run)), "a rank outlived the run"
    rerun = subprocess.run(_command(common, run, "--checkpoint.every=1"), capture_output=True, text=True, timeout=240,
                           cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "done: 2 steps" in rerun.stdout and "resumed" not in rerun.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "manifest.json").is_file()) == \
        ["step_00000001", "step_00000002"]
    assert not partial.exists()
