"""`data.num_workers` end to end: 2 ranks train bitwise alike with 0 and 2 loader workers per rank, a run
resumed with workers continues exactly like the uninterrupted one, and no worker outlives its run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import processes_mentioning

LAYOUT = ["--parallel.dp_shard=2", "--parallel.zero=1", "--train.micro_batch=2", "--train.steps=6",
          "--train.log_every=1", "--checkpoint.keep=2"]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _train(common: list[str], run: Path, *extra: str) -> None:
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--nproc", "2", *common, *LAYOUT, *extra,
                           f"--run.dir={run}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    left = processes_mentioning(str(run))
    assert not left, f"processes of {run} outlived it: {left}"



def test_the_leftover_check_sees_a_live_process(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--config", f"{tmp_path}/config.toml"])
    try:
        deadline = time.monotonic() + 30  # until the child has exec'd (before, it is a copy of pytest)
        while processes_mentioning(str(tmp_path)) != [sleeper.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_mentioning(str(tmp_path)) == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert processes_mentioning(str(tmp_path)) == []


@pytest.fixture()
def common(base_overrides) -> list[str]:
    skip = {"train.steps", "train.micro_batch", "checkpoint.resume"}
    return [f"--{k}={v}" for k, v in base_overrides if k not in skip]


def test_worker_count_and_resume_do_not_change_training(common, tmp_path):
    inline, workers, resumed = tmp_path / "inline", tmp_path / "workers", tmp_path / "resumed"
    _train(common, inline, "--data.num_workers=0", "--checkpoint.every=3", "--checkpoint.resume=false")
    _train(common, workers, "--data.num_workers=2", "--checkpoint.resume=false")
    # Resume from the step-3 checkpoint of the inline run with 2 workers per rank: steps 4-6 again.
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(inline / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    _train(common, resumed, "--data.num_workers=2", "--checkpoint.resume=true")
    expected = _losses(inline)
    print("step  0 workers             2 workers             resumed at 3, 2 workers")
    for step, loss in expected.items():
        print(f"{step:>4}  {loss!r:<20}  {_losses(workers)[step]!r:<20}  {_losses(resumed).get(step, '')!r}")
    assert sorted(expected) == list(range(1, 7))
    assert _losses(workers) == expected  # bitwise
    assert _losses(resumed) == {s: expected[s] for s in (4, 5, 6)}
