"""Run N local worker processes through torch's own elastic launcher, exactly as `torchrun` would.

What the user sees is shardwise's, not torchrun's: the agent's log lines and tracebacks are silenced;
a failure ends in one line and an exit code (errors.py). Workers that failed with a code of their own
(bad input, divergence, I/O, stall, interruption) have printed their line already; otherwise the
launcher names the root cause among the failed ranks: a rank killed by a signal, else the earliest
error that is not just the consequence of a lost peer (its traceback is in <run.dir>/errors/).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from shardwise.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_IO,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_STALLED,
    ConfigError,
    interrupt_exit_code,
)

# When several workers failed with their own codes, the most specific wins.
_PRIORITY = (EXIT_BAD_INPUT, EXIT_IO, EXIT_DIVERGED, EXIT_STALLED, EXIT_SIGTERM, EXIT_SIGINT)
# Seconds the agent waits for workers to checkpoint and exit after forwarding a stop signal.
SHUTDOWN_GRACE_S = 60
# What workers report when another worker died under them: consequences, not causes.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "socket closed", "connection refused")


def lost_peer(message: str) -> bool:
    return any(s in message.lower() for s in _LOST_PEER)


def _quiet_torchrun() -> None:
    """torchrun's agent logs every failure, restart and shutdown at WARNING/ERROR with its own
    traceback tables; shardwise says what happened in one line instead."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
             "torch.distributed.run", "torch.distributed.launcher"))]
    for name in ["torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def torchrun(nproc: int, module: str, module_args: list[str], log_dir: Path | None = None, max_restarts: int = 0,
             run_dir: Path | None = None, checkpoints: Path | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS...` in this process; returns an exit code.

    --standalone picks a free rendezvous port on localhost, so concurrent launches never collide.
    `max_restarts` restarts the whole worker group after a failure (the elastic agent's own restarts).
    `run_dir` / `checkpoints` let a failure report point at tracebacks and the checkpoint to resume.
    SIGUSR1 is forwarded to the workers like SIGTERM (SLURM sends it ahead of a time limit).
    """
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Split the cores between the workers (torchrun would pick 1 and warn); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    argv = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", f"--shutdown-timeout={SHUTDOWN_GRACE_S}"]
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}"]
    argv += ["-m", module, *module_args]
    _quiet_torchrun()
    try:
        torch_run.run(torch_run.get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        return report_failure(e.failures, run_dir, checkpoints)
    except SignalException as e:
        return interrupt_exit_code(e.sigval)
    return 0


def report_failure(failures: dict, run_dir: Path | None = None, checkpoints: Path | None = None) -> int:
    """The job's exit code from torchelastic's per-rank ProcessFailure records; prints the root cause
    unless a worker already printed its own line."""
    codes = sorted((f.exitcode for f in failures.values() if f.exitcode in _PRIORITY), key=_PRIORITY.index)
    if codes:
        return codes[0]
    rank, failure = _root_cause(failures)
    if failure.exitcode < 0:
        what = f"was killed by {_signal_name(-failure.exitcode)}"
    else:
        message = str(failure.message or "").strip().splitlines()
        what = f"failed: {message[0][:300] if message else f'exit code {failure.exitcode}'}"
        if run_dir is not None and (run_dir / "errors" / f"rank_{rank}.txt").is_file():
            what += f" (traceback: {run_dir / 'errors' / f'rank_{rank}.txt'})"
    others = len(failures) - 1
    tail = f"; {others} other rank(s) stopped with it" if others else ""
    print(f"error: rank {rank} (pid {failure.pid}) {what}{tail}{_resume_hint(checkpoints)}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _root_cause(failures: dict):
    """A rank killed by a signal other than the agent's own SIGTERM; else the earliest failure whose
    message is not a lost peer; else the earliest."""
    items = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for rank, f in items:
        if f.exitcode < 0 and -f.exitcode != signal.SIGTERM:
            return rank, f
    for rank, f in items:
        if not lost_peer(str(f.message or "")):
            return rank, f
    return items[0]


def _resume_hint(checkpoints: Path | None) -> str:
    if checkpoints is None:
        return ""
    from shardwise.train.manifest import complete_checkpoints

    found = complete_checkpoints(checkpoints)
    newest = found[-1] if found else None
    return (f"; newest checkpoint {newest}: rerun the same command to resume from it (run.max_restarts restarts "
            "automatically)" if newest else "; no checkpoint was written yet")


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}", "pass --nproc 1 or more")
