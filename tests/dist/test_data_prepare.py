"""`shardwise data prepare` and `train`'s own preparation under real faults, through real processes: SIGKILL
(no orphan worker; the rerun finishes and is byte for byte an uninterrupted preparation), Ctrl-C (130,
resumable), a full disk (exit 4, no partial shard; free space as the line says, rerun), two preparers at once
(one prepares, the other waits and says so), bad records and changed files refused before anything spawns,
and a resume from 2 ranks onto 4 that reads the same batches."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import alive, children, interruptible, run_world, user_lines

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _corpus(path: Path, records: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    with path.open("w") as f:
        for _ in range(records):
            f.write(json.dumps({"text": " ".join(words[rng.integers(0, len(WORDS), 60)])}) + "\n")
    return path


def _prepare(corpus: Path, cache: Path, *extra: str, **kw) -> subprocess.Popen:
    args = [sys.executable, "-m", "shardwise.cli", "data", "prepare", f"--data.path={corpus}", f"--data.cache_dir={cache}",
            "--data.tokenizer=byte", "--model.vocab_size=512", "--data.shard_mb=0.25", "--workers", "2", *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _tree(cache: Path) -> dict[str, bytes]:
    [directory] = [d for d in (cache / "prepared").iterdir() if d.is_dir()]
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _shards_done(cache: Path) -> int:
    return len(list((cache / "prepared").glob("*/shards/*.json"))) if (cache / "prepared").is_dir() else 0


def _wait_for_shards(cache: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _shards_done(cache) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no shard was written in time"
        time.sleep(0.005)
    assert not list((cache / "prepared").glob("*/manifest.json")), "the preparation ended before the fault: grow the corpus"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """~25 MB of JSON lines (about 100 shards, a few seconds on 2 workers) and its uninterrupted preparation."""
    root = tmp_path_factory.mktemp("corpus")
    path = _corpus(root / "corpus.jsonl", 70_000)
    done = _prepare(path, root / "reference")
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err
    return path, _tree(root / "reference")


def test_sigkill_leaves_no_worker_and_the_rerun_is_byte_for_byte_an_uninterrupted_preparation(corpus, tmp_path):
    path, reference = corpus
    proc = _prepare(path, tmp_path / "cache")
    _wait_for_shards(tmp_path / "cache", 3, proc)
    workers = children(proc.pid)
    assert len(workers) >= 2, workers
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:  # PR_SET_PDEATHSIG: they die with it
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), "a preparation worker outlived its killed parent"
    kept = _shards_done(tmp_path / "cache")
    assert kept >= 3
    again = _prepare(path, tmp_path / "cache")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert f"{kept} of" in out and "were done by an earlier run and are kept" in out, out
    assert _tree(tmp_path / "cache") == reference  # no temporary file left, every byte the same


def test_ctrl_c_exits_130_keeps_the_finished_shards_and_the_rerun_finishes(corpus, tmp_path):
    path, reference = corpus
    proc = _prepare(path, tmp_path / "cache", preexec_fn=interruptible, start_new_session=True)
    _wait_for_shards(tmp_path / "cache", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = user_lines(err)
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGINT) while preparing corpus: "), err
    assert "shards are prepared and kept in" in lines[0] and lines[0].endswith("rerun the same command to finish the preparation")
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    again = _prepare(path, tmp_path / "cache")
    assert again.wait(timeout=600) == 0
    assert _tree(tmp_path / "cache") == reference


# Ctrl-C delivered while the main thread is halfway through concurrent.futures.wait taking its futures'
# locks (the signal sent from inside that loop, so the handler runs there): a handler that raised there left
# the locks taken held, and the pool's shutdown waited forever on a thread blocked on one.
_CTRL_C_INSIDE_WAIT = """
import os, signal, sys
import concurrent.futures._base as base
from shardwise.cli import main
calls, enter = [0], base._AcquireFutures.__enter__
def mid_loop_ctrl_c(self):
    calls[0] += 1
    if calls[0] != 3:
        return enter(self)
    for i, future in enumerate(self.futures):
        future._condition.acquire()
        if i == 1:
            os.kill(os.getpid(), signal.SIGINT)
base._AcquireFutures.__enter__ = mid_loop_ctrl_c
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_inside_the_pools_wait_still_exits_130(corpus, tmp_path):
    path, _ = corpus
    args = [sys.executable, "-c", _CTRL_C_INSIDE_WAIT, "data", "prepare", f"--data.path={path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=byte", "--model.vocab_size=512",
            "--data.shard_mb=0.25", "--workers", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)  # a second's work: 120 s is a hang
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    [line] = user_lines(err)
    assert line.startswith("interrupted (SIGINT) while preparing corpus: ") and "shards are prepared and kept" in line
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_a_full_disk_exits_4_without_a_partial_shard_and_the_rerun_resumes(corpus, small_disk, tmp_path):
    """The cache on a 4 MiB tmpfs: the ~50 MB of shards cannot fit. The line says how much more is needed; the
    test frees that much (the tmpfs grown) and reruns the same command, as the line says."""
    path, reference = corpus
    proc = _prepare(path, small_disk)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 4, err
    [line] = user_lines(err)
    assert line.startswith("error: cannot write") and "No space left on device" in line, line
    assert "(no partial shard is left)" in line and "then rerun the same command to resume the preparation" in line
    assert not list(small_disk.rglob("*.tmp")) and not list(small_disk.rglob("manifest.json"))
    for shard in small_disk.rglob("shards/*.json"):  # every shard left is whole
        facts = json.loads(shard.read_text())
        assert shard.with_suffix(".bin").stat().st_size == 2 * facts["tokens"] and shard.with_suffix(".idx").is_file()
    needed = float(line.split("about ")[1].split(" GB")[0])
    size_mb = 4 + int(needed * 1000 * 1.2) + 8
    assert subprocess.run(["mount", "-o", f"remount,size={size_mb}m", str(small_disk)], capture_output=True).returncode == 0
    again = _prepare(path, small_disk)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert "were done by an earlier run and are kept" in out
    assert _tree(small_disk) == reference


def test_two_preparers_at_once_one_prepares_and_the_other_waits_for_it(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", 20_000)
    first = _prepare(path, tmp_path / "cache")
    _wait_for_shards(tmp_path / "cache", 1, first)
    second = _prepare(path, tmp_path / "cache")
    out2, err2 = second.communicate(timeout=600)
    out1, err1 = first.communicate(timeout=600)
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert f"data: waiting for pid {first.pid} on" in out2 and "which is preparing" in out2, out2
    assert "data: prepared c:" in out1 and "data: prepared c:" not in out2 and "(prepared by another process" in out2
    assert len(list((tmp_path / "cache/prepared").glob("*/manifest.json"))) == 1


def _train(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def _train_args(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [f"--data.path={corpus}", "--data.tokenizer=byte", f"--data.cache_dir={tmp_path / 'cache'}",
            "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=4",
            "--train.steps=2", f"--run.dir={tmp_path / 'run'}", "--run.progress=false", "--run.tensorboard=false",
            "--run.loss_curve=false", "--checkpoint.final=false", *extra]


def test_train_refuses_a_bad_record_before_anything_starts_and_trains_with_skip(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "word " * 30}) + "\n" for _ in range(40)) + "{broken\n")
    bad = _train(_train_args(corpus, tmp_path), tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert user_lines(bad.stderr)[0] == f"error: data.path: {corpus}:41 is not valid JSON (Expecting property name " \
                                        "enclosed in double quotes)"
    assert not (tmp_path / "run").exists()  # nothing spawned, no run directory
    ok = _train(_train_args(corpus, tmp_path, "--data.bad_records=skip"), tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "skipped 1 bad records (1 not valid JSON), first: " in ok.stdout and "done: 2 steps" in ok.stdout


def test_train_names_changed_files_and_the_advice_it_gives_works(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(40)))
    assert _train(_train_args(corpus, tmp_path), tmp_path).returncode == 0
    with corpus.open("a") as f:
        f.write(json.dumps({"text": "one more record " * 20}) + "\n")
    changed = _train(_train_args(corpus, tmp_path, "--checkpoint.resume=false"), tmp_path)
    assert changed.returncode == 2, changed.stderr
    lines = user_lines(changed.stderr)
    assert lines[0].startswith(f"error: data.path: {corpus} changed since it was prepared into ") and "c.jsonl (size" in lines[0]
    advice = lines[1].split("`")[1]  # fix: prepare it again: `shardwise data prepare <this command's options>`
    assert advice.startswith(f"shardwise data prepare --data.path={corpus} --data.tokenizer=byte"), advice
    prepared = subprocess.run([sys.executable, "-m", "shardwise.cli", *shlex.split(advice)[1:]],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert prepared.returncode == 0, prepared.stderr
    again = _train(_train_args(corpus, tmp_path, "--checkpoint.resume=false"), tmp_path)
    assert again.returncode == 0, again.stderr


def _batches_after_resume(rank: int, cfg_overrides: list, save: bool, step: int) -> dict:
    """In a world of 2 or 4: resume the trainer's data state at `step` and return this rank's rows of the next steps."""
    import torch.distributed as dist

    from shardwise.config import build_config
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, cfg_overrides + [("parallel.dp_shard", str(dist.get_world_size())), ("parallel.zero", "3")])
    trainer = Trainer(cfg, log=None)
    if save:
        trainer.train()
    rows = {s: trainer.loader.micro_batches(s) for s in range(trainer.step, trainer.step + 3)}
    return {"step": trainer.step, "rows": {s: torch.cat(r).tolist() for s, r in rows.items()}}


def test_a_resume_on_4_ranks_reads_the_batches_2_ranks_would_have(base_overrides, tmp_path):
    """Trained 3 steps on 2 ranks with a 2-source mixture, resumed on 4: the next steps' global batches (every
    rank's rows, in rank order) equal those the 2 ranks read when they go on, and one process's."""
    a, b = _corpus(tmp_path / "a.jsonl", 300, seed=1), _corpus(tmp_path / "b.jsonl", 300, seed=2)
    sources = f'[{{path="{a}", weight=0.7}}, {{path="{b}", weight=0.3}}]'
    skip = {"data.path", "train.steps", "checkpoint.resume", "checkpoint.final"}
    overrides = [(k, v) for k, v in base_overrides if k not in skip] + [
        ("data.sources", sources), ("data.cache_dir", str(tmp_path / "cache")), ("train.steps", "3"),
        ("train.micro_batch", "2"), ("run.dir", str(tmp_path / "run")), ("checkpoint.every", "3"),
        ("checkpoint.resume", "true"), ("data.shard_mb", "0.01")]
    from shardwise.config import build_config
    from shardwise.train.data import TokenBatches, batch_sources, prepare_data

    data = prepare_data(build_config(None, overrides).data, 512, log=lambda _: None)
    two = run_world(2, lambda rank: _batches_after_resume(rank, overrides, True, 3))
    four = run_world(4, lambda rank: _batches_after_resume(rank, overrides, False, 3))
    goes_on = run_world(2, lambda rank: _batches_after_resume(rank, overrides, False, 3))
    reference = TokenBatches(batch_sources(data, 32), 32, 8, seed=0)
    assert two[0]["step"] == four[0]["step"] == goes_on[0]["step"] == 3  # trained to 3; resumed there
    for step in range(3, 6):
        rows4 = [row for r in four for row in r["rows"][step]]
        rows2 = [row for r in goes_on for row in r["rows"][step]]
        assert rows4 == rows2 == reference.global_batch_at(step).tolist()


def test_a_mixture_trains_reports_each_source_and_changes_weights_on_resume(tmp_path):
    """Through `shardwise train`: tokens_<name> in metrics.jsonl and the summary; a resume with other weights
    names the change at start-up, and each source's count goes on from where it was (no sample twice)."""
    a, b = _corpus(tmp_path / "a.jsonl", 200, seed=1), _corpus(tmp_path / "b.jsonl", 200, seed=2)

    def run(weights: tuple[float, float], steps: int) -> subprocess.CompletedProcess:
        sources = f'[{{path="{a}", weight={weights[0]}}}, {{path="{b}", weight={weights[1]}, name="second"}}]'
        args = _train_args(a, tmp_path, f"--data.sources={sources}", f"--train.steps={steps}", "--train.log_every=1",
                           "--checkpoint.every=4", "--checkpoint.final=true")
        return _train([x for x in args if not x.startswith("--data.path=")], tmp_path)

    first = run((0.75, 0.25), 4)
    assert first.returncode == 0, first.stderr
    assert "tokens read by source: a 384 (75.0%), second 128 (25.0%)" in first.stdout, first.stdout
    second = run((0.25, 0.75), 8)
    assert second.returncode == 0, second.stderr
    assert ("data: mixture weights changed at step 4 (shares of the samples: a 0.75 -> 0.25, second 0.25 -> 0.75); each "
            "source goes on where it was, nothing read again or skipped (samples read so far: a 12, second 4)") in second.stdout
    assert "data.sources[second].weight 0.25 -> 0.75" in second.stdout  # with the other changed settings
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    per_step = [(r["step"], r["tokens_a"], r["tokens_second"]) for r in records]
    assert per_step[3] == (4, 384, 128) and per_step[-1] == (8, 384 + 128, 128 + 384), per_step  # 4 steps of 4 at 1:3
    assert all(x[1] + x[2] == 128 * x[0] for x in per_step)  # every step's 4 x 32 tokens, from one source or the other
