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
import re
import shutil
import signal
import sys
import threading
from pathlib import Path

from shardwise.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_EVICTED,
    EXIT_FAILED,
    EXIT_IO,
    EXIT_OUT_OF_MEMORY,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_STALLED,
    EXIT_TOO_FEW_NODES,
    ConfigError,
    hide_unraisable,
    interrupt_exit_code,
    lost_peer,
)
from shardwise.launch.peer_failure import RefusalWatch, workers_started
from shardwise.launch.rendezvous import MultiNode, wait_for_rendezvous
from shardwise.scratch import owned_directory
from shardwise.train import eviction
from shardwise.train import manifest as mf
from shardwise.train.rundir import resume_hint, take_interruption, traceback_file

# When several workers failed with their own codes, the most specific wins.
_PRIORITY = (EXIT_BAD_INPUT, EXIT_IO, EXIT_OUT_OF_MEMORY, EXIT_DIVERGED, EXIT_STALLED, EXIT_SIGTERM, EXIT_SIGINT)
# Seconds the agent waits for workers to checkpoint and exit after forwarding a stop signal.
SHUTDOWN_GRACE_S = 60
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")  # gloo's "[198.18.0.1]:30119", "[fd00::1]:30119"


def lost_peer_line(message: str) -> str:
    """What a rank whose peer went away did, for the launcher's line: when no rank on this node failed of
    its own accord the cause is on another node (one killed with its node, or a network failure), which
    gloo's message ("Connection closed by peer [ADDRESS]:PORT. This is typically caused by a remote
    worker crashing ... GLHF!") names only by its address."""
    phrase = lost_peer(message)
    peer = _PEER_ADDRESS.search(message)
    at = f" at {peer.group(1)}" if peer else ""
    return (f"lost its connection to a rank{at} ({phrase}): a process there died or the network to it failed, "
            "and that node's own output names the cause")


# The logger of torchelastic's process context: its one record per failed worker group names the first
# failed worker ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", torch 2.13).
_WORKER_FAILURES = "torch.distributed.elastic.multiprocessing.api"


class _RestartCause(logging.Handler):
    """Turns torchelastic's record of a failed worker into shardwise's line, when a restart follows it
    (the last failure is the launcher's error line: report_failure): which local rank, and the signal
    or exit code, which the restarted workers cannot know."""

    def __init__(self, max_restarts: int):
        super().__init__(logging.ERROR)
        self.max_restarts, self.seen = max_restarts, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        self.seen += 1
        if self.seen > self.max_restarts:
            return
        code, local_rank, pid = record.args[:3]
        what = f"was killed by {_signal_name(-int(code))}" if int(code) < 0 else f"exited with code {code}"
        if int(code) in (EXIT_SIGTERM, EXIT_SIGINT):  # every rank stopped after a step, as a drained node's asked
            what = (f"stopped with the others after a step and a checkpoint (exit {code}: a stop signal reached the "
                    "job, e.g. a node drained, or a straggler's node evicted)")
        print(f"restart {self.seen} of {self.max_restarts}: local rank {local_rank} (pid {pid}) {what}; the worker "
              "group restarts from the newest intact checkpoint", flush=True)


def _quiet_torchrun(max_restarts: int = 0) -> None:
    """torchrun's agent logs every failure, restart and shutdown at WARNING/ERROR with its own
    traceback tables; shardwise says what happened in one line instead (a restart's cause included)."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
             "torch.distributed.run", "torch.distributed.launcher"))]
    for name in ["torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if max_restarts:
        failures = logging.getLogger(_WORKER_FAILURES)
        failures.setLevel(logging.ERROR)
        failures.propagate = False
        failures.handlers = [_RestartCause(max_restarts)]


def torchrun(nproc: int, module: str, module_args: list[str], log_dir: Path | None = None, max_restarts: int = 0,
             run_dir: Path | None = None, checkpoints: Path | None = None, nodes: MultiNode | None = None,
             resumes: bool = True) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS...` in this process; returns an exit code.

    --standalone picks a free rendezvous port on localhost, so concurrent launches never collide.
    `nodes` (a MultiNode from check_multinode) launches this node's share of a multi-node job instead:
    c10d rendezvous at its endpoint, every node's agent started with the same id.
    `max_restarts` restarts the whole worker group after a failure (the elastic agent's own restarts).
    `run_dir` / `checkpoints` let a failure report point at tracebacks and the checkpoint to resume;
    `resumes`: the run's checkpoint.resume (false: the same command would start over, so the advice differs).
    SIGUSR1 is forwarded to the workers like SIGTERM (SLURM sends it ahead of a time limit).
    """
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )

    # Split the cores between the workers (torchrun would pick 1 and warn); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # One node: the workers find the agent's store on loopback (torch would publish the host name's
    # fully qualified name, which resolves to a network address on many machines: traffic that never
    # needs to leave this machine would go out through its interface's address).
    if nodes is not None and nodes.elastic:
        # torch 2.13's rendezvous shares node 0's TCPStore between rounds and publishes its address in the
        # first round only: a node that joins later waits for that key in its own round and times out
        # after 60 s (pytorch/pytorch#147064's family). torch's own switch makes every round publish it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = nodes.torchrun_args() if nodes is not None else ["--standalone", "--local-addr=127.0.0.1"]
    argv += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", f"--shutdown-timeout={SHUTDOWN_GRACE_S}"]
    # torchrun's default log directory is a fresh /tmp/torchelastic_* that it never removes (one per
    # launch); the workers' error files in it are read before run() returns, so ours is removed after,
    # and, if this agent is killed first, by the next launch on this host (shardwise/scratch.py).
    own_log_dir = owned_directory("torchelastic") if log_dir is None else None
    argv += [f"--log-dir={log_dir or own_log_dir}"]
    argv += ["-m", module, *module_args]
    _quiet_torchrun(max_restarts)
    ignore_rendezvous_timer_self_join()
    before_workers = _StopBeforeWorkers(SignalException)
    watch = None
    try:
        before_workers.install()
        if nodes is not None:  # a node refused before the rendezvous, or with another --nnodes, ends the wait (peer_failure.py)
            watch = RefusalWatch(nodes.endpoint, lambda: workers_started(log_dir or own_log_dir), nodes.node_rank,
                                 nodes.spec, tell=not nodes.elastic, data=nodes.data).start()
        if nodes is not None and nodes.node_rank != 0 and not wait_for_rendezvous(nodes):
            return EXIT_FAILED
        if nodes is not None:  # the agents wait for each other without a word until the job starts or times out
            wanted = f"{nodes.min_nodes} to {nodes.nnodes}" if nodes.elastic else f"all {nodes.nnodes}"
            print(f"node {nodes.node_rank}: waiting for {wanted} nodes at the rendezvous {nodes.endpoint} (up to "
                  f"run.rendezvous_timeout_s = {nodes.timeout_s:g} s)", flush=True)
        torch_run.run(torch_run.get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        code = report_failure(e.failures, run_dir, checkpoints, every_node=nodes is not None, resumes=resumes)
        if code in (EXIT_SIGTERM, EXIT_SIGINT):  # a stop that reached the ranks (not this agent), no restart left
            say_interruption(run_dir, checkpoints, None, nodes, resumes)
        return code
    except SignalException as e:
        if watch is not None and watch.refusal and before_workers.raised(e):
            print(f"error: {watch.refusal}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        evicted = eviction.left_line(run_dir, nodes.node_rank) \
            if run_dir is not None and nodes is not None and nodes.elastic and not before_workers.raised(e) else None
        if evicted is not None:  # the SIGTERM came from this node's own rank: it is the straggler (train/eviction.py)
            print(evicted, file=sys.stderr, flush=True)
            return EXIT_EVICTED
        if before_workers.raised(e):  # no worker ran to say it stopped
            where = f" while waiting at the rendezvous {nodes.endpoint}" if nodes is not None else ""
            print(f"interrupted ({e.sigval.name}){where}, before any worker started", file=sys.stderr, flush=True)
        else:
            say_interruption(run_dir, checkpoints, e.sigval, nodes, resumes)
        return interrupt_exit_code(e.sigval)
    except RendezvousError as e:  # multi-node: the nodes never met (a node missing, the store lost, timeout)
        where = f" at {nodes.endpoint}" if nodes is not None else ""
        if isinstance(e, RendezvousConnectionError) and nodes is not None and nodes.node_rank == 0:
            # Node 0's agent serves the store: it could not (a port taken after check_multinode looked).
            cause = (str(e.__cause__ or e).splitlines() or [type(e).__name__])[0][:300]
            print(f"error: node 0 cannot serve the rendezvous{where}: {cause}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if isinstance(e, RendezvousConnectionError) and nodes is not None and workers_started(log_dir or own_log_dir):
            # Node 0 died during the run: this agent's heartbeat to its store can fail before this node's
            # workers report their lost peers (a race; either way the cause is node 0).
            print(f"error: node 0 was lost during the run (its rendezvous at {nodes.endpoint} closed): its agent "
                  "stopped or its node died, or the network to it failed, and node 0's own output names the cause"
                  f"{resume_hint(checkpoints, every_node=True, resumes=resumes)}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if isinstance(e, RendezvousConnectionError):
            # Not a timeout of run.rendezvous_timeout_s: node 0's store is gone or unreachable. A node that joins
            # a job just as it ends meets this (the store closes with node 0's agent), as does one whose node 0
            # stopped between wait_for_rendezvous and torch's own connection.
            print(f"error: the rendezvous{where} cannot be reached, or closed while this node waited: node 0's agent "
                  "is not running there (a job that ends, finished or failed, closes it) or its address is not "
                  f"reachable from this node{resume_hint(checkpoints, every_node=True, resumes=resumes)}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        if nodes is not None and nodes.elastic:
            print(f"error: fewer than {nodes.min_nodes} node(s) (--nnodes {nodes.min_nodes}:{nodes.nnodes}) met at the "
                  f"rendezvous{where} within run.rendezvous_timeout_s ({nodes.timeout_s:g} s): "
                  f"{type(e).__name__}{resume_hint(checkpoints, every_node=True, resumes=resumes)}", file=sys.stderr, flush=True)
            return EXIT_TOO_FEW_NODES
        if nodes is not None and isinstance(e, RendezvousTimeoutError):
            # A node never started, or started with another config (the rendezvous id derives from run.dir)
            # or endpoint: torch's error says nothing more (its message is empty).
            print(f"error: fewer than {nodes.nnodes} nodes (--nnodes {nodes.nnodes}) met at the rendezvous{where} "
                  f"within run.rendezvous_timeout_s ({nodes.timeout_s:g} s): start every node, --node-rank 0 to "
                  f"{nodes.nnodes - 1}, with the same config and --rdzv-endpoint"
                  f"{resume_hint(checkpoints, every_node=True, resumes=resumes)}", file=sys.stderr, flush=True)
            return EXIT_TOO_FEW_NODES
        ask = ("are the other nodes running, with this node's address as their --rdzv-endpoint?"
               if nodes is not None and nodes.node_rank == 0 else "is node 0 running, and its address reachable from "
               "this node?")
        print(f"error: rendezvous{where} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"({ask})", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if watch is not None:
            watch.stop()
        before_workers.restore()
        if own_log_dir is not None:
            shutil.rmtree(own_log_dir, ignore_errors=True)
    return 0


def say_interruption(run_dir: Path | None, checkpoints: Path | None, sigval, nodes: MultiNode | None,
                     resumes: bool) -> None:
    """The one line of a job this agent ends because of a stop signal. Rank 0 recorded it instead of printing it
    (train/rundir.py record_interruption): the same SIGTERM from the agent also re-forms the group when a node
    leaves or joins, and then the job goes on. On a node other than 0 of a multi-node job (a drained node),
    rank 0 is elsewhere: this node says that it left, and what the others do without it."""
    name = sigval.name if sigval is not None else "a stop signal"
    if nodes is not None and nodes.node_rank != 0:
        if nodes.elastic:
            found = mf.complete_checkpoints(checkpoints) if checkpoints is not None else []
            saved = f" (newest checkpoint {found[-1]})" if found else ""
            goes_on = (f"{saved}; the job goes on with the other nodes while at least {nodes.min_nodes} remain; rerun "
                       "the same command here to join it again")
        else:  # resume_hint names the newest checkpoint itself
            goes_on = f"; the job cannot go on without it{resume_hint(checkpoints, every_node=True, resumes=resumes)}"
        print(f"interrupted by {name}: node {nodes.node_rank} left the job after its ranks finished a step with the "
              f"others{goes_on}", file=sys.stderr, flush=True)
        return
    record = take_interruption(run_dir) if run_dir is not None else None
    if record is not None:
        print(record["message"], file=sys.stderr, flush=True)
    elif sigval is not None:  # the ranks ended before they could say where they stopped
        print(f"interrupted by {name}{resume_hint(checkpoints, every_node=nodes is not None, resumes=resumes)}",
              file=sys.stderr, flush=True)


def ignore_rendezvous_timer_self_join() -> None:
    """Silence one known torch message (torch 2.13, rendezvous/utils.py), and only that one, for the rest of this
    launcher process. The rendezvous handler's keep-alive _PeriodicTimer stops its thread from a weakref finalizer,
    which joins the thread; when the handler's last reference dies inside that same thread (its keep-alive call
    holds the handler while the agent shuts down, as after a SIGTERM), the join raises "cannot join current
    thread" and Python prints it as "Exception ignored in ... Traceback" under the run's one line (seen once in
    CI). The thread was told to stop before the join and ends by itself, so nothing is lost. Every other
    unraisable exception still reaches the previous hook."""
    hide_unraisable("rendezvous timer self-join", lambda text: text == "cannot join current thread", "_stop_thread",
                    "distributed/elastic/rendezvous/utils.py")


class _StopBeforeWorkers:
    """Stop requests before torch's agent has started the workers (and its own handlers, which turn them
    into SignalException): waiting for node 0 or at the rendezvous, a SIGTERM from `scancel` or SLURM's
    SIGUSR1 ahead of a time limit ended the launcher silently (exit -15 / -10, no line). They raise
    torch's SignalException here too, which its agent handles as its own (it shuts down and re-raises
    the same exception). SIGINT keeps Python's KeyboardInterrupt (cli.py says what was interrupted)."""

    SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1")

    def __init__(self, signal_exception: type):
        self.signal_exception, self.previous, self.stop = signal_exception, {}, None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread
        for name in self.SIGNALS:
            self.previous[name] = signal.signal(getattr(signal, name), self._handler)

    def _handler(self, signum: int, frame) -> None:
        self.stop = self.signal_exception(f"signal {signum} before the workers started", signal.Signals(signum))
        raise self.stop

    def raised(self, e: BaseException) -> bool:
        return e is self.stop

    def restore(self) -> None:
        for name, previous in self.previous.items():
            signal.signal(getattr(signal, name), previous)
        self.previous = {}


# torchelastic's ProcessFailure message for a worker that exited non-zero without writing its error file
# (torch/distributed/elastic/multiprocessing/errors/__init__.py): a link to its documentation.
TORCHELASTIC_NO_RECORD = "To enable traceback see:"


def report_failure(failures: dict, run_dir: Path | None = None, checkpoints: Path | None = None,
                   every_node: bool = False, resumes: bool = True) -> int:
    """The job's exit code from torchelastic's per-rank ProcessFailure records; prints the root cause
    unless a worker already printed its own line. `every_node`: a multi-node job, resumed by rerunning on
    every node."""
    codes = sorted((f.exitcode for f in failures.values() if f.exitcode in _PRIORITY), key=_PRIORITY.index)
    if codes:
        return codes[0]
    rank, failure = _root_cause(failures)
    if failure.exitcode < 0:
        what = f"was killed by {_signal_name(-failure.exitcode)}"
        if -failure.exitcode == signal.SIGKILL:  # uncatchable: the rank could print nothing itself
            what += (" (sent by the kernel when host memory runs out, by a scheduler's hard stop or by kill -9: "
                     "dmesg names an out-of-memory kill)")
    else:
        message = failure_message(failure).splitlines()
        if message and lost_peer(message[0]):  # every rank here only lost a peer: the cause is on another node
            what = lost_peer_line(message[0])
        else:
            what = f"failed: {message[0][:300]}" if message else (
                f"exited with code {failure.exitcode} and no Python error: native code crashed, or memory ran out even "
                "for reporting (its own output above says more)")
        if run_dir is not None and traceback_file(run_dir, rank).is_file():
            what += f" (traceback: {traceback_file(run_dir, rank)})"
    others = len(failures) - 1
    tail = f"; {others} other rank(s) stopped with it" if others else ""
    hint = resume_hint(checkpoints, every_node, resumes)
    print(f"error: rank {rank} (pid {failure.pid}) {what}{tail}{hint}", file=sys.stderr, flush=True)
    return EXIT_FAILED


def failure_message(failure) -> str:
    """The exception's own "Type: message" of a failed worker. torchelastic's record of a Python
    exception is a dict {"message": ..., "extraInfo": {"py_callstack": <traceback>, ...}}: printed as
    it is, the user's one line was that dict with a traceback cut mid-word (the traceback is in
    <run.dir>/errors/rank_N.txt). A worker that left no record gets torchelastic's pointer to its docs
    instead (TORCHELASTIC_NO_RECORD), which says nothing of this failure: no message."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "").strip()
    return "" if message.startswith(TORCHELASTIC_NO_RECORD) else message


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
        if not lost_peer(failure_message(f)):
            return rank, f
    return items[0]


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}", "pass --nproc 1 or more")


