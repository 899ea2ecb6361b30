"""Run a function on N local processes joined in a gloo process group — once per world size.

Fork is used because it starts a 4-process group in ~4 s instead of ~10 s with spawn (docs/architecture.md §9).
It is only safe while the parent has run no multi-threaded work, so callers run their
single-process references *after* the worlds they need; a test that profiles does so in a subprocess of
its own (tests/unit/test_kernel_breakdown.py), and a child compiles with inductor on one thread (inductor's
compile thread pool does not survive a fork: `_child`). Every child is joined or killed and every exit code
checked; a failure re-raises the child's traceback in the parent, and a child that never reports is named
with its threads' stacks (faulthandler, before the kill).

A child's result crosses to the parent as bytes (plain pickle: a tensor's data travels inside them),
never as an object on the queue: the queue's pickler would share a tensor's storage by file descriptor,
which the parent fetches from the child's resource-sharer thread when it unpickles, and a child that has
already exited leaves it `ConnectionResetError` (test_offload.py failed so about 1 run in 3).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable

PG_TIMEOUT_S = 60


def losses_by_step(run: Path) -> dict[int, float]:
    """A run's training loss per step from its metrics.jsonl, {} before the file exists; the last record of each
    step (a step trained again after a restart replaces the lost one's)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def wait_for(condition: Callable[[], bool], timeout: float, what: str, logs: Iterable[Path] = (),
             poll_s: float = 0.1) -> float:
    """Poll `condition` until it holds; its time.monotonic(). After `timeout` seconds an AssertionError naming
    `what`, with the tail of each of `logs`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            tails = "".join(f"\n--- {log.name}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")
        time.sleep(poll_s)
    return time.monotonic()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(results, rank: int, status: str, value: Any) -> None:
    """Put (rank, status, value) on `results` as self-contained bytes: readable after the sender exited."""
    results.put(pickle.dumps((rank, status, value), protocol=pickle.HIGHEST_PROTOCOL))


def receive(results, timeout: float) -> tuple[int, str, Any]:
    """The next (rank, status, value) a child reported (queue.Empty after `timeout` seconds). The bytes
    come from our own forked child, the one sender this queue has."""
    return pickle.loads(results.get(timeout=timeout))


def _child(rank: int, world_size: int, port: int, fn: Callable[[int], Any], results, stacks: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch._inductor import config as inductor_config

    from shardwise.train.network import pin_gloo_interface

    # A hang is reported with where every thread was: the parent sends SIGUSR1 before it kills (run_world).
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)  # noqa: SIM115 (lives as long as the child)
    # torch's at-fork hook resets inductor's compile process pool but not its thread pool
    # (torch/_inductor/async_compile.py after_fork; AsyncCompile.pool stays lru-cached): a child of a process
    # that compiled with inductor would queue its kernels on the parent's threads, which do not exist here,
    # and wait forever (test_harness.py test_a_world_compiles_with_inductor_after_its_parent_did). One
    # compile thread: each kernel compiles in the calling thread.
    inductor_config.compile_threads = 1
    torch.set_num_threads(1)
    code = 0
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
        pin_gloo_interface(os.environ)  # on loopback, whatever the host name resolves to
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
        report(results, rank, "ok", fn(rank))
    except BaseException:  # report every failure, including assertion errors, to the parent
        report(results, rank, "error", traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # os._exit skips atexit handlers, so flush the queue's feeder thread by hand first.
        results.close()
        results.join_thread()
    os._exit(code)


def preload() -> None:
    """Import, in the parent, the modules every child imports (_child's, the trainer's that nearly every
    world builds, and matplotlib, which a pipeline run's chart draws with): a forked child inherits them
    instead of importing them again. Measured on 2 cores: a 4-process world that imports the trainer
    cost its children 7.4 CPU-seconds and 12.5 s before this, 0.2 and 0.5 s after. An import starts no
    thread (the process has as many before and after), so the fork stays safe (module docstring); the
    pytest process imported the same modules already whenever a test in it had built a Trainer in
    process (tests/unit does), so children have run with them inherited all along."""
    import torch._inductor.config  # noqa: F401
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401
    from matplotlib.patches import Patch  # noqa: F401

    import shardwise.train.network  # noqa: F401
    import shardwise.train.trainer  # noqa: F401


def run_world(world_size: int, fn: Callable[[int], Any], timeout_s: float = 600) -> list[Any]:
    """fn(rank) runs on every rank of a fresh gloo world; returns [result of rank 0, 1, ...]."""
    import tempfile

    preload()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    stacks = Path(tempfile.mkdtemp(prefix="shardwise-world-"))
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, results, str(stacks / f"rank{r}.txt")), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, tuple[str, Any]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(collected) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = receive(results, timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                    break  # a rank died without reporting (crash, kill): stop waiting for it
                continue
            collected[rank] = (status, value)
            if status == "error":
                break  # the other ranks would only hang on collectives now
    finally:
        hung = []
        for rank, p in enumerate(procs):
            p.join(timeout=5 if len(collected) == world_size else 0.5)
            if p.is_alive():
                hung.append(rank)
                os.kill(p.pid, signal.SIGUSR1)  # faulthandler writes every thread's stack (_child)
        if hung:
            time.sleep(2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    where = "".join(f"\nrank {r} was at (its threads' stacks, most recent call first):\n"
                    + "\n".join((stacks / f"rank{r}.txt").read_text().splitlines()[:60]) for r in hung)
    shutil.rmtree(stacks, ignore_errors=True)
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(collected.items()) if s == "error"]
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    if len(collected) < world_size:
        missing = sorted(set(range(world_size)) - set(collected))
        raise RuntimeError(f"ranks {missing} did not report within {timeout_s}s "
                           f"(exit codes {[p.exitcode for p in procs]}){where}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"worker exit codes {[p.exitcode for p in procs]}")
    return [collected[r][1] for r in range(world_size)]


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text`: a rank's names its run directory (--config
    RUN/config.toml), and its data-loader workers are forks of it, so theirs does too. Used to check
    that nothing of a run outlives it."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, whichever of its threads started them (a launcher's ranks)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return out


def process_state(pid: int) -> str | None:
    """The state letter /proc gives `pid` (R, S, T stopped, Z exited but not reaped, ...), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not yet reaped, counts as gone)."""
    return process_state(pid) not in (None, "Z")


def user_lines(stderr: str) -> list[str]:
    """Lines a `shardwise train` job tells the user on stderr: everything but the C++ transport chatter gloo
    prints on its own."""
    return [line for line in stderr.splitlines() if line.strip() and "debug_logger.cc" not in line
            and "ProcessGroupGloo.cpp" not in line]


def stop_processes(pids: list[int], sig: int, timeout_s: float) -> list[int]:
    """Send `sig` to every pid, wait up to `timeout_s` for them to be gone; returns those still alive."""
    import time

    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def interruptible() -> None:
    """`preexec_fn` for a child a test sends Ctrl-C (SIGINT) to: the default disposition back, so Python
    raises KeyboardInterrupt in it as at a terminal. A test run started as a background job of a script
    (`bash .ci/run &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored: the signal
    would vanish (a run finishing with exit 0; a child sleeping on past the test's timeout)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_in_process(*args: str):
    """`shardwise ARGS` through the CLI's own main() in this process: (exit code, stdout, stderr) as a
    CompletedProcess. For the light commands a test runs between trainings (`checkpoint verify`): the same
    code, output and exit code as `python -m shardwise.cli`, without the ~5 s of CPU a new interpreter
    spends importing torch and shardwise. Not for commands that start threads or processes (train,
    generate): forked test workers need a parent that never started a thread pool (this module's note)."""
    import contextlib
    import io
    import subprocess

    from shardwise.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["shardwise", *args], code, out.getvalue(), err.getvalue())
