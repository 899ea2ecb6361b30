"""Issue 57's lines that said the wrong thing, one test each (the CLI-level ones are in tests/dist/test_recovery.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.config import build_config
from shardwise.errors import ConfigError
from shardwise.train import manifest as mf
from shardwise.train.metrics import MetricsLogger
from shardwise.train.rundir import supersede_previous_run


@pytest.mark.parametrize("text", ["NaN", "nan", "inf", "-Infinity"])
def test_a_non_finite_number_is_named_as_such_however_it_is_spelled(text):
    with pytest.raises(ConfigError, match="must be a finite number"):
        build_config({}, [("train.lr", text)])


def test_starting_over_names_the_complete_checkpoints_it_moves(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        (ckpt / f"step_{step:08d}").mkdir(parents=True)
        (ckpt / f"step_{step:08d}" / mf.MANIFEST).write_text("{}")
    (ckpt / "step_00000006.tmp").mkdir()
    cfg = build_config({}, [("run.dir", str(tmp_path / "run")), ("checkpoint.resume", "false")])
    line = supersede_previous_run(cfg)
    assert "the 3 checkpoint entries" in line and "(steps 2-4)" in line and "no complete one" not in line, line


def test_a_resume_moves_the_records_of_the_steps_it_trains_again_aside(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)))
    logger = MetricsLogger(tmp_path, 8, 4, True, False, False)  # resumed from step 4's checkpoint
    logger.log(5, {"loss": 0.5})
    logger.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.undone.1.jsonl").read_text().splitlines()] == [5, 6]
    assert "2 records of steps after 4 (trained again from the checkpoint) moved to metrics.undone.1.jsonl" in capsys.readouterr().out
    MetricsLogger(tmp_path, 8, 0, True, False, False).close()  # starting over: the whole file, and a line
    assert "this run starts over; the earlier run's records moved to metrics.1.jsonl" in capsys.readouterr().out


def test_a_spike_dates_the_divergence_and_marks_its_checkpoints_not_good():
    from shardwise.train.health import StepGuard

    guard = StepGuard(control=None, max_skipped_steps=2, stop=None, spike_ratio=2.0, spike_window=20)
    for step, loss in enumerate([3.0, 2.9, 2.8, 2.7, 2.6, 2.5], start=1):
        assert not guard.record(step, False, loss) and guard.healthy
    assert not guard.record(7, False, 4.0) and guard.healthy  # 1.5x the median: no spike
    assert not guard.record(8, False, 7.6) and not guard.healthy  # a spike: checkpoints from here are not good
    assert not guard.record(9, False, 7.6)
    assert not guard.record(10, True) and guard.record(11, True)  # the NaN streak ends the run...
    assert (guard.streak_start, guard.nonfinite_start) == (8, 10)  # ...dated from the spike
    assert "spiked at step 8 (7.6, 2.7x the median 2.8 of the 7 steps before" in guard.spike_words()
    restored = StepGuard(None, 2, None, 2.0, 20)
    restored.load_state_dict(guard.state_dict())
    assert restored.history == guard.history and restored.spike == guard.spike
    recovered = StepGuard(None, 2, None, 2.0, 20)
    for step, loss in enumerate([3.0, 2.9, 2.8, 2.7, 2.6, 7.0, 2.5], start=1):
        recovered.record(step, False, loss)
    assert recovered.healthy and recovered.spike is None  # a spike the run recovered from is forgotten


def test_a_full_disk_names_where_the_run_writes_when_the_error_names_no_file():
    import errno

    from shardwise.errors import storage_failure

    unnamed = OSError(errno.ENOSPC, "No space left on device")  # what file.write() raises
    assert storage_failure(unnamed, directory="runs/x").message.startswith("cannot write (under runs/x): No space left")
    named = OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl")
    assert storage_failure(named, directory="runs/x").message.startswith("cannot write (runs/x/metrics.jsonl)")


class _NotData:
    """A class a weights-only load refuses."""


def test_a_rank_file_holding_objects_is_refused_without_torch_s_advice_to_load_it_unsafely(tmp_path):
    import torch

    from shardwise.train.checkpoint import RNG, rank_file_problem

    (tmp_path / RNG).mkdir()
    torch.save({"cpu": torch.zeros(3), "extra": _NotData()}, tmp_path / RNG / "rank_0.pt")
    why = rank_file_problem(tmp_path, 0)
    assert "refused, since loading them could run code" in why and "weights_only" not in why, why


_TIMER_SELF_JOIN = """
import sys, time
from datetime import timedelta
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
if sys.argv[1] == "filtered":
    from shardwise.launch.local import ignore_rendezvous_timer_self_join
    ignore_rendezvous_timer_self_join()
holder = {}
def drop_the_last_reference():  # the timer dies in its own thread: its finalizer joins that thread
    holder.pop("timer", None)
timer = _PeriodicTimer(timedelta(seconds=0.01), drop_the_last_reference)
timer.start()
holder["timer"] = timer
del timer
time.sleep(0.5)
class Other:
    def __del__(self):
        raise ValueError("another unraisable error")
Other()
"""


@pytest.mark.parametrize("mode", ["plain", "filtered"])
def test_the_launcher_hides_torchs_keep_alive_timer_joining_itself_and_nothing_else(mode):
    """A SIGTERM'd launcher printed "Exception ignored ... RuntimeError: cannot join current thread" from torch's
    rendezvous keep-alive timer under its one line (CI). Reproduced for real: the timer's last reference dies in
    its own thread. The launcher's filter hides that message; any other unraisable error still shows."""
    out = subprocess.run([sys.executable, "-c", _TIMER_SELF_JOIN, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("cannot join current thread" in out.stderr) == (mode == "plain"), out.stderr
    assert "another unraisable error" in out.stderr


@pytest.mark.parametrize("elastic", [True, False])
def test_a_drained_node_says_it_left_and_names_the_newest_checkpoint_once(tmp_path, capsys, elastic):
    """The line of a node other than 0 that a stop signal ends (its ranks stopped with the others): elastic, the
    job goes on without it; not elastic, it cannot, and the advice is the multi-node rerun. The checkpoint is
    named once (resume_hint names it in the second case)."""
    import signal

    from shardwise.launch.local import say_interruption
    from shardwise.launch.rendezvous import MultiNode

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_00000011").mkdir(parents=True)
    (ckpt / "step_00000011" / mf.MANIFEST).write_text("{}")
    nodes = MultiNode(2, 1, "198.51.100.1:29400", "job", min_nodes=1 if elastic else None)
    say_interruption(tmp_path, ckpt, signal.SIGTERM, nodes, resumes=True)
    line = capsys.readouterr().err.strip()
    assert line.startswith("interrupted by SIGTERM: node 1 left the job after its ranks finished a step"), line
    assert line.count("step_00000011") == 1, line
    if elastic:
        assert "the job goes on with the other nodes while at least 1 remain" in line, line
    else:
        assert "the job cannot go on without it" in line and "rerun the same command on every node" in line, line


_WORKER_DIES_IN_A_FINALIZER = """
import os, signal, sys, time
from torch.utils.data import DataLoader
if sys.argv[1] == "filtered":
    from shardwise.train.loader import hide_worker_deaths_raised_in_finalizers
    hide_worker_deaths_raised_in_finalizers()
it = iter(DataLoader(range(1000), batch_size=None, num_workers=1, timeout=5))
next(it)
worker = it._workers[0]
class Finalized:
    def __del__(self):  # the worker dies while this runs: torch's SIGCHLD handler raises in this frame
        os.kill(worker.pid, signal.SIGKILL)
        time.sleep(2)
Finalized()
class Other:
    def __del__(self):
        raise ValueError("another unraisable error")
Other()
try:
    for _ in range(1000):
        next(it)
except RuntimeError as e:
    print("next batch:", e)
"""


@pytest.mark.parametrize("mode", ["plain", "filtered"])
def test_a_loader_worker_death_inside_a_finalizer_is_left_to_the_next_batch(mode):
    """A one-process run whose loader worker was killed printed "Exception ignored in: <function
    _TemporaryFileCloser.__del__ ...>" and torch's SIGCHLD handler's traceback above its one line (CI, 2026-11-29):
    the handler raised inside a finalizer. Reproduced for real: the worker is killed while a __del__ runs. The
    loader's filter hides that message and nothing else; the next batch still raises the worker's death."""
    out = subprocess.run([sys.executable, "-c", _WORKER_DIES_IN_A_FINALIZER, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("_error_if_any_worker_fails" in out.stderr) == (mode == "plain"), out.stderr
    assert "another unraisable error" in out.stderr
    assert "next batch: DataLoader worker" in out.stdout and "exited unexpectedly" in out.stdout, out.stdout
