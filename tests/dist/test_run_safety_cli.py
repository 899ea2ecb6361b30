"""Run safety as a user meets it: `shardwise train` in real subprocesses, faults provoked for real
(signals to the launcher and the workers, a stopped rank, killed processes, full and read-only disks,
damaged checkpoints). Each failure must end in one line, a distinct exit code, no traceback, no process
left behind, and no lost checkpoint."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.harness import alive, children, cli_in_process, processes_mentioning, user_lines

ZERO3 = ["--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2"]


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "checkpoint.final", "checkpoint.resume", "train.micro_batch"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip] + ["--train.micro_batch=4"]


def _train(common, run: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # 600 s: a limit on a hang, not a time tested; under a load of 25 on the 2 cores a 30-step ZeRO-3 run
    # took 314 s of wall time (46 s of CPU).
    cwd = next(d for d in run.parents if d.is_dir())
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *common, f"--run.dir={run}", *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _start(common, run: Path, *extra: str, own_group: bool = False) -> subprocess.Popen:
    """A job in the background; its stdout and stderr go to files (a pipe nobody reads can fill up).
    own_group: in a process group of its own, as a terminal's foreground job is (Ctrl-C signals it all)."""
    run.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", *common, f"--run.dir={run}", *extra],
                            stdout=open(run.parent / f"{run.name}.out", "w"),
                            stderr=open(run.parent / f"{run.name}.err", "w"), cwd=run.parent,
                            start_new_session=own_group)
    proc.err_path = run.parent / f"{run.name}.err"
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for a background job; its stderr. (300 s: a limit on a hang, not a time the test measures; on a
    loaded 2-core machine a job's start-up alone has taken over 120 s.)"""
    proc.wait(timeout=timeout)
    return proc.err_path.read_text()


def _steps(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `run` logged `step` (300 s, a limit on a hang: a one-process run under a load of 16 on 2 cores
    took over 120 s to reach step 2)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if max(_steps(run), default=0) >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}")




@pytest.mark.parametrize("precision, fresh", [("fp32", False), ("fp16", True)])
def test_divergence_exits_3_with_one_line_and_strict_metrics(common, tmp_path, precision, fresh):
    """lr=1e6: the loss or gradient norm stops being finite within a few steps. Before, fp32 ran on
    with NaN losses and exit 0, and fp16 backed its loss scale off forever, also exit 0."""
    run = tmp_path / "diverge"
    p = _train(common, run, "--train.lr=1e6", "--train.steps=30", "--checkpoint.every=2", "--checkpoint.keep=1",
               "--train.log_every=1", f"--train.precision={precision}", "--model.n_layers=1",
               f"--checkpoint.resume={'false' if fresh else 'true'}")
    assert p.returncode == 3, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    errors = user_lines(p.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: training diverged: 5 steps in a row"), errors
    # The advice resumes as the run was started (test_recovery follows it); with checkpoint.resume=false the
    # rerun with a lower lr alone would start over, so the line names the override.
    advice = ("then rerun with the new value and --checkpoint.resume=true to resume from it (with checkpoint.resume=false "
              "the command starts over)") if fresh else "then rerun with the new value to resume from it"
    assert errors[0].endswith(advice), errors
    records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records[-5:]] == [1] * 5
    assert all(r["nonfinite"] for r in records if r["skipped"] and precision == "fp32")
    assert records[-1]["skipped_steps"] >= 5
    # Whatever was checkpointed holds finite weights only.
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (run / "checkpoints").glob("step_*"):
        dcp_to_torch_save(step, tmp_path / "weights.pt")
        weights = torch.load(tmp_path / "weights.pt", weights_only=False)["model"]
        assert all(torch.isfinite(w).all() for w in weights.values()), f"{step.name} holds non-finite weights"


def test_divergence_is_not_restarted(common, tmp_path):
    """run.max_restarts restarts crashes, not a deterministic divergence: the restarted workers read the
    job's recorded failure and end at once, with the same code and no second message."""
    run = tmp_path / "diverge2"
    p = _train(common, run, "--train.lr=1e6", "--train.steps=30", *ZERO3, "--run.max_restarts=2")
    assert p.returncode == 3, p.stderr[-3000:]
    errors = user_lines(p.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: training diverged:"), errors
    assert p.stdout.count("not training again: this job failed with exit code 3") == 2  # ended at once, twice
    assert "the worker group was restarted" not in p.stdout


def test_out_of_memory_exits_7_with_the_fix_and_the_fix_trains(common, tmp_path):
    """A step that cannot allocate, on both ranks of a ZeRO-3 job: each worker's address space is capped
    (RLIMIT_AS, 3 GB; a worker maps ~1.4 GB) and a micro-batch's logits need 16 x 512 x 65,536 x 4 B =
    2 GiB at once. Before, the launcher named a RuntimeError's first line (C++ enforce text) with exit 1,
    and run.max_restarts ran the same step again. Now: exit 7, one line (from the first rank to fail)
    with the allocator's words and the settings that lower the peak, no restart. Then the user does what
    it says: a smaller micro-batch, the same global batch."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000))

    shape = ["--model.vocab_size=65536", "--train.seq_len=512", "--train.global_batch=32", "--train.steps=1",
             "--data.tokenizer=byte", "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3"]
    run = tmp_path / "oom"
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *common, *shape, f"--run.dir={run}"]
    p = subprocess.run([*cmd, "--train.micro_batch=16", "--run.max_restarts=1", "--run.memory_snapshot=true"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path, preexec_fn=cap)
    assert p.returncode == 7, p.stderr[-3000:]
    assert "run.memory_snapshot: records the CUDA caching allocator's history; cpu has none" in p.stdout
    assert "Traceback" not in p.stdout + p.stderr
    errors = user_lines(p.stderr)
    assert len(errors) == 1, errors
    assert re.match(r"error: rank [01] ran out of host memory in step 1: DefaultCPUAllocator: can't allocate memory: "
                    r"you tried to allocate 2147483648 bytes", errors[0]), errors
    assert "lower train.micro_batch (now 16; train.global_batch stays, by accumulation)" in errors[0]
    assert p.stdout.count("not training again: this job failed with exit code 7") == 1  # the restart ended at once
    p = subprocess.run([*cmd, "--train.micro_batch=2"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       preexec_fn=cap)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: 1 steps, 16,384 tokens" in p.stdout


def test_out_of_memory_under_selective_recompute_offers_op_alternate_and_it_trains(common, tmp_path):
    """The out-of-memory line of a selective ("op") run offers recompute_policy=op_alternate before full
    recomputation; followed, it trains. A wide MLP (ffn 16,384, 4 blocks, 16 x 256 tokens) makes w3's
    outputs, which op_alternate does not keep, 256 MiB a block. Address space capped at 3.8 GB (RLIMIT_AS):
    measured here, "op" fails at 4.0 GB and fits at 4.4, op_alternate fits at 3.5 (peak RSS 3.62 against
    2.83 GB); the margins, 0.2 and 0.3 GB, are several times a run-to-run difference."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3_800_000_000, 3_800_000_000))

    shape = ["--model.ffn_dim=16384", "--model.n_layers=4", "--train.seq_len=256", "--train.micro_batch=16",
             "--train.global_batch=16", "--train.steps=1", "--train.recompute=selective", "--checkpoint.final=false"]
    cmd = [sys.executable, "-m", "shardwise.cli", "train", *common, *shape]
    p = subprocess.run([*cmd, f"--run.dir={tmp_path / 'op'}"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       preexec_fn=cap)
    assert p.returncode == 7, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    errors = user_lines(p.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 ran out of host memory in step 1"), errors
    assert "set train.recompute_policy=op_alternate (now op) or train.recompute=full (now selective)" in errors[0]
    p = subprocess.run([*cmd, "--train.recompute_policy=op_alternate", f"--run.dir={tmp_path / 'alternate'}"],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path, preexec_fn=cap)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: 1 steps, 4,096 tokens" in p.stdout


@pytest.mark.parametrize("layout", [["--nproc", "1"], ["--nproc", "2", "--parallel.dp_replicate=2"]],
                         ids=["in-process", "two-ranks"])
def test_out_of_memory_while_building_the_model_exits_7_with_one_line(common, tmp_path, layout):
    """Parameters alone larger than a worker may map (a 131k x 2048 embedding and head, 1 GiB each, under
    the 3 GB RLIMIT_AS of the test above): before, a traceback (one process) or exit 1 naming C++ enforce
    text (torchrun). Now: exit 7 and one line that says it happened before the first step and offers only
    what shards the model states (the batch and recomputation do not matter yet)."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000))

    big = ["--model.dim=2048", "--model.vocab_size=131072", "--train.seq_len=64", "--train.micro_batch=2",
           f"--train.global_batch={2 * int(layout[1])}", "--train.steps=1", "--data.tokenizer=byte"]
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *common, *big, *layout,
                        f"--run.dir={tmp_path / 'big'}"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       preexec_fn=cap)
    assert p.returncode == 7, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    errors = user_lines(p.stderr)
    assert len(errors) == 1, errors
    assert re.match(r"error: rank [01] ran out of host memory before the first step \(building the model or loading "
                    r"its checkpoint\): DefaultCPUAllocator: can't allocate memory: .*; fix: shard the model states: "
                    r"parallel.zero=3 \(now 0\) over more ranks", errors[0]), errors
    assert "micro_batch" not in errors[0] and "recompute" not in errors[0]


def test_sigterm_to_the_launcher_checkpoints_and_resumes_bitwise(common, tmp_path):
    # 20 steps, stopped after step 8: 12 steps of margin before the run would end on
    # its own, and the resumed run still trains the steps after the stop against the reference, bitwise.
    args = [*ZERO3, "--train.steps=20", "--train.log_every=1", "--checkpoint.every=0"]
    reference = _train(common, tmp_path / "reference", *args)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "stopped"
    # With loader workers (data.num_workers): torchrun signals them too, and they must not end the rank.
    args += ["--data.num_workers=2"]
    proc = _start(common, run, *args)
    _wait_for_step(run, 8, proc)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    lines = user_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGTERM after step "), lines
    stopped_at = int(lines[0].split("after step ")[1].split(":")[0])
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "manifest.json").is_file()
    assert not processes_mentioning(str(run)), "a rank or loader worker outlived the run"
    resumed = _train(common, run, *args)
    assert resumed.returncode == 0 and f"at step {stopped_at}" in resumed.stdout, resumed.stderr[-3000:]
    assert _steps(run) == _steps(tmp_path / "reference")


@pytest.mark.parametrize("sig,code,target", [(signal.SIGINT, 130, "launcher"), (signal.SIGUSR1, 143, "worker"),
                                             (signal.SIGINT, 130, "group")])
def test_other_stop_signals(common, tmp_path, sig, code, target):
    """"group": the signal reaches the launcher's whole process group at once, as Ctrl-C in a terminal does.
    That run starts with --checkpoint.resume=false, with which the same command would start over: the line
    advises the override that resumes (it said "rerun the same command" whatever the flag)."""
    run = tmp_path / "run"
    fresh = ["--checkpoint.resume=false"] if target == "group" else []
    proc = _start(common, run, *ZERO3, "--train.steps=2000", "--checkpoint.every=0", "--train.log_every=1",
                  "--data.num_workers=2", *fresh, own_group=target == "group")
    _wait_for_step(run, 5, proc)
    if target == "group":
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid if target == "launcher" else children(proc.pid)[-1], sig)
    err = _finish(proc)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and len(user_lines(err)) == 1, err
    advice = "rerun with --checkpoint.resume=true to resume" if fresh else "rerun the same command to resume"
    assert advice in user_lines(err)[0], err
    assert list((run / "checkpoints").glob("step_*/manifest.json"))
    assert not processes_mentioning(str(run)), "a rank or loader worker outlived the run"


def test_killed_launcher_leaves_no_workers_and_frees_the_run_directory(common, tmp_path, monkeypatch, request):
    """Also the loader workers' temp files (issue 57 item 5): multiprocessing's pymp-* directories, which a killed
    run left in the temp directory forever, are named in a file each worker owns: the next run removes both."""
    run = tmp_path / "run"
    # A short temp directory: the workers' sockets live under it, and a Unix socket path ends at 107 bytes
    # (pytest's tmp_path under xdist on a machine with many runs is 76 bytes: pre-flight refuses it).
    scratch = Path(tempfile.mkdtemp(prefix="sw-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(scratch))
    loaders = ["--data.num_workers=2"]
    proc = _start(common, run, *ZERO3, "--train.steps=2000", "--checkpoint.every=0", "--train.log_every=1", *loaders)
    _wait_for_step(run, 3, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), "workers outlived their launcher"
    left = list(scratch.glob("pymp-*"))  # one per loader worker (2 ranks x 2), each named by its owner's file
    assert left and len(left) == len(list(scratch.glob("shardwise-loader-*"))), list(scratch.iterdir())
    again = _train(common, run, "--train.steps=2", *loaders)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "took over the lock" in again.stdout + again.stderr
    assert not list(scratch.glob("pymp-*")) and not list(scratch.glob("shardwise-loader-*")), list(scratch.iterdir())


def test_a_second_job_on_the_same_run_directory_is_refused(common, tmp_path):
    run = tmp_path / "run"
    # One process: the run directory's lock is taken by the `shardwise train` process
    # before anything is spawned (train/rundir.py), the same with or without workers, and the second job is
    # refused by it before spawning; the workers only cost their start-up.
    first = _start(common, run, "--train.steps=2000", "--checkpoint.every=0", "--train.log_every=1")
    try:
        _wait_for_step(run, 2, first)
        second = _train(common, run, "--train.steps=3")
        assert second.returncode == 2
        assert second.stderr.startswith(f"error: run.dir: run directory {run} is in use by pid {first.pid}"), second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        _finish(first)


def test_a_stopped_rank_is_diagnosed_and_the_job_ends(common, tmp_path):
    timeout_s = 10
    run = tmp_path / "run"
    proc = _start(common, run, *ZERO3, "--train.steps=2000", "--checkpoint.every=0", "--train.log_every=1",
                  f"--run.collective_timeout_s={timeout_s}")
    _wait_for_step(run, 5, proc)
    workers = children(proc.pid)
    os.kill(workers[-1], signal.SIGSTOP)
    start = time.monotonic()
    try:
        err = _finish(proc, timeout_s + 60)
    finally:
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)
    elapsed = time.monotonic() - start
    assert proc.returncode == 5, err[-3000:]
    assert elapsed <= timeout_s + 30, f"the job took {elapsed:.0f} s to end"
    assert "Traceback" not in err
    lines = user_lines(err)
    assert lines[0].startswith("error: stalled: at step ") and "rank(s) 1 did not respond" in lines[0], lines
    # Where rank 0 waits depends on where SIGSTOP caught rank 1: a ZeRO-3 all-gather / reduce-scatter on
    # dp_shard, or the step's agreement flag on the control group (train/control.py).
    assert re.search(r"longer than run\.collective_timeout_s in \w+ on (dp_shard|control) ", lines[0]), lines
    dump = (run / "stall" / "rank_0.txt").read_text()
    assert "where it waited:" in dump and "torch flight recorder" in dump and "#" in dump
    assert not any(alive(w) for w in workers), "a process was left behind"


def test_bad_directories_are_refused_before_spawning(common, tmp_path, read_only_dir):
    (tmp_path / "a_file").write_text("x")
    cases = [(tmp_path / "a_file", [], "run.dir", "exists and is not a directory"),
             (tmp_path / "a_file" / "run", [], "run.dir", "cannot create"),
             (read_only_dir / "run", [], "run.dir", ""),
             (tmp_path / "ok", [f"--checkpoint.dir={read_only_dir}"], "checkpoint.dir", "not writable")]
    for run, extra, field, phrase in cases:
        p = _train(common, run, "--train.steps=2", *ZERO3, *extra)
        assert p.returncode == 2 and p.stderr.startswith(f"error: {field}: ") and phrase in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and "model:" not in p.stdout  # nothing was spawned


def test_a_full_disk_exits_4_keeps_the_older_checkpoint_and_its_advice_resumes(common, tmp_path, small_disk):
    """Both advices, followed one after the other, on one ZeRO-3 job. A run started with checkpoint.resume=false starts over
    if rerun as it was, so its line names the override; following it on the still full disk resumes from the
    intact step 2 and fills the disk again at step 4, and that run (resume=true) advises the same command,
    which resumes from step 2 once the disk has grown."""
    ckpt = small_disk / "checkpoints"
    command = [*ZERO3, "--train.steps=8", "--checkpoint.every=2", "--checkpoint.keep=5", f"--checkpoint.dir={ckpt}"]
    for resume in (False, True):
        p = _train(common, tmp_path / "run", *command, f"--checkpoint.resume={str(resume).lower()}")
        assert p.returncode == 4, p.stderr[-3000:]
        lines = user_lines(p.stderr)
        assert len(lines) == 1 and "No space left on device" in lines[0] and "step_00000002 is intact" in lines[0], lines
        assert sorted(x.name for x in ckpt.glob("step_*")) == ["step_00000002"]
        verify = cli_in_process("checkpoint", "verify", str(ckpt))
        assert verify.returncode == 0 and "step_00000002: OK" in verify.stdout
        advice = "rerun the same command to resume" if resume else "rerun with --checkpoint.resume=true to resume"
        assert f"Free space, then {advice}" in lines[0], lines
        if resume:  # the first line's advice followed: it resumed from step 2
            assert "resumed from" in p.stdout and "at step 2" in p.stdout, p.stdout[-2000:]
    # What the user does next: free space (here the disk grows), then what the line says.
    assert subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], capture_output=True).returncode == 0
    rerun = _train(common, tmp_path / "run", *command, "--checkpoint.resume=true")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stdout and "at step 2" in rerun.stdout, rerun.stdout[-2000:]


def test_resume_refuses_another_model_and_says_when_a_run_is_finished(common, tmp_path):
    run = tmp_path / "run"
    assert _train(common, run, "--train.steps=4", "--checkpoint.final=true").returncode == 0
    config = (run / "config.toml").read_text()
    changed = _train(common, run, "--train.steps=8", "--model.dim=128", "--train.global_batch=16")
    assert changed.returncode == 2 and changed.stderr.startswith("error: checkpoint.resume: "), changed.stderr
    assert "model.dim: 64 -> 128" in changed.stderr and "train.global_batch: 8 -> 16" in changed.stderr
    assert "--checkpoint.resume=false" in changed.stderr and "Traceback" not in changed.stderr
    done = _train(common, run, "--train.steps=4", "--checkpoint.final=true")
    assert done.returncode == 0 and "nothing to train" in done.stdout, done.stdout
    assert (run / "config.toml").read_text() == config, "a refused or finished rerun rewrote config.toml"


def test_damaged_and_crafted_checkpoints_are_set_aside(common, tmp_path):
    run = tmp_path / "run"
    assert _train(common, run, *ZERO3, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.final=true").returncode == 0
    newest = run / "checkpoints" / "step_00000004"
    marker = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (newest / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    verify = cli_in_process("checkpoint", "verify", str(run))
    assert verify.returncode == 1 and "step_00000004: DAMAGED" in verify.stdout and ".metadata" in verify.stdout
    resumed = _train(common, run, *ZERO3, "--train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000004 is damaged" in resumed.stdout and "resumed from" in resumed.stdout
    assert "at step 2" in resumed.stdout and (run / "checkpoints" / "step_00000004.corrupt").is_dir()
    assert not marker.exists(), "a crafted .metadata ran code"


def test_corpus_files_are_read_by_content(common, tmp_path):
    records = tmp_path / "records.json"
    records.write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(200)))
    ok = _train([c for c in common if not c.startswith("--data.path")], tmp_path / "json", f"--data.path={records}",
                "--train.steps=2")
    assert ok.returncode == 0 and ", 200 docs," in ok.stdout, ok.stdout + ok.stderr
    blob = tmp_path / "blob.txt"
    blob.write_bytes(bytes(range(256)) * 400)
    bad = _train([c for c in common if not c.startswith("--data.path")], tmp_path / "bin", f"--data.path={blob}",
                 "--train.steps=2")
    assert bad.returncode == 2 and bad.stderr.startswith("error: data.path: ") and "is not text" in bad.stderr


def test_loader_workers_outlast_stop_signals(common, tmp_path):
    """torchrun stops a rank by signalling its whole process group, loader workers included, as SLURM's
    --signal does a step's processes. torch's worker exits on such a SIGTERM and the rank then failed with
    "DataLoader worker ... killed by signal" instead of checkpointing: the workers must ignore it."""
    run = tmp_path / "run"
    proc = _start(common, run, *ZERO3, "--train.steps=2000", "--checkpoint.every=0", "--train.log_every=1",
                  "--data.num_workers=2")
    _wait_for_step(run, 5, proc)
    workers = [w for rank in children(proc.pid) for w in children(rank)]
    assert len(workers) == 4, workers  # 2 ranks x 2 loader workers
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        for w in workers:
            os.kill(w, sig)
    _wait_for_step(run, max(_steps(run)) + 10, proc)  # still training, on the same workers
    assert all(alive(w) for w in workers) and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 143 and len(user_lines(err)) == 1, err[-3000:]
    assert not processes_mentioning(str(run)), "a rank or loader worker outlived the run"
