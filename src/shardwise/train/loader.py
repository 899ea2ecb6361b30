"""This rank's batches, prepared ahead of the step by `data.num_workers` background processes.

A step's batch is a pure function of the step (train/data.py TokenBatches), so the workers cannot
change what is trained: worker k of n prepares steps start+k, start+k+n, ... and torch's DataLoader
hands them back in step order. Resuming starts the workers at the resumed step; a caller that asks
for any other step than the next one (a test driving train_step by hand, a resume after the loader
started) restarts them there. With 0 workers the batch is read in the training process, as before.

torch's DataLoader is used rather than our own pool: it already watches its parent (a worker whose
rank died exits), keeps the order, pins memory for CUDA copies, and shuts down with the iterator.
Workers are forked (Linux's default): the token file is memory-mapped, so they share the page cache
with the rank and start without importing anything; on another start method the memmap travels as its
path (TokenBatches.__getstate__), never as a copy of the corpus.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.util
import signal
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.errors import hide_unraisable
from shardwise.scratch import owned_file
from shardwise.train.data import TokenBatches, split_micro_batches
from shardwise.train.signals import STOP_SIGNALS, exit_with_parent

# Batches each worker keeps ready (DataLoader's prefetch_factor): two steps per worker hides a slow read
# behind the step before it without holding many batches in shared memory.
PREFETCH_PER_WORKER = 2
# Blocked in the rank while it forks its loader workers (BatchPrefetcher._start), unblocked in each worker
# (_worker_init): the two must name the same signals.
_BLOCKED_WHILE_FORKING = (*STOP_SIGNALS, signal.SIGCHLD)
# How long a broken pipe to the workers waits for a worker's death to become visible (see
# BatchPrefetcher._worker_death): the kernel closes a dying process's sockets before its parent can
# reap it, a window of microseconds to milliseconds; a second is ample and delays only a failing rank.
WORKER_EXIT_GRACE_S = 1.0
# A batch that has not come this long after it was asked for, its workers alive, is waited for no longer: the
# workers start again at that step (a batch is a function of the step: nothing is lost or repeated), once; a
# second stall fails the rank with its own line. Seen in a full test run on a loaded 2-core machine
# (2026-11-29, tests/dist/test_run_safety_cli.py): every rank waiting for its first batch and every worker for
# work, for half an hour, with no collective pending that could time out; not reproduced alone (the cause is
# not found). A healthy batch takes milliseconds; a first one, its workers' start: seconds.
STALLED_BATCH_S = 60.0
# How long one wait for a batch lasts before the rank looks again (DataLoader's timeout): torch's own interval
# for noticing a dead worker (MP_STATUS_CHECK_INTERVAL), which a longer DataLoader timeout would stretch.
BATCH_WAIT_SLICE_S = 5.0


class _RankBatches(Dataset):
    """Item `step`: this batch rank's rows of that step's global batch."""

    def __init__(self, batches: TokenBatches, batch_rank: int, batch_size: int):
        self.batches, self.batch_rank, self.batch_size = batches, batch_rank, batch_size

    def __getitem__(self, step: int) -> torch.Tensor:
        return self.batches.local_rows(step, self.batch_rank, self.batch_size)


def _worker_init(_worker_id: int) -> None:
    """A loader worker ignores the stop signals and dies with its rank.

    torchrun signals a rank's whole process group, workers included, and torch's worker exits on a
    SIGTERM that its parent did not send; the rank would then fail with "DataLoader worker killed"
    instead of finishing the step and checkpointing (train/signals.py). The rank closes its workers
    when it stops; PR_SET_PDEATHSIG ends them at once if it dies. The signals were blocked when the
    worker was forked (BatchPrefetcher._start), so one sent meanwhile is discarded here, not fatal;
    SIGCHLD, blocked with them, is the worker's own again (a dataset may start processes)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _BLOCKED_WHILE_FORKING)
    exit_with_parent()
    _own_the_pymp_directory()


def _own_the_pymp_directory() -> None:
    """A worker sends its batches through torch's file-descriptor sharing, for which multiprocessing makes a
    `pymp-*` directory in the temp directory, removed when the worker exits cleanly. A killed run (SIGKILL, a
    node's loss: the worker dies with its rank) left one per worker behind, forever. The worker makes it now
    and names it in a file it owns (shardwise/scratch.py), which takes it along when the next run's workers on
    this host find its owner gone. (Not a directory of ours around it: the socket paths inside would grow by
    its name, and AF_UNIX paths end at 108 bytes — a test's long TMPDIR already failed so.)"""
    pymp = multiprocessing.util.get_temp_dir()
    marker = owned_file("loader", holds=[pymp])
    # After multiprocessing's own finalizer for pymp-* (exit priority -100): lower runs later.
    multiprocessing.util.Finalize(None, marker.unlink, kwargs={"missing_ok": True}, exitpriority=-200)


def hide_worker_deaths_raised_in_finalizers() -> None:
    """torch's SIGCHLD handler raises "DataLoader worker ... killed" in whatever frame the rank is in when a
    worker dies. In a finalizer (a temporary file's __del__ during a save, in CI) Python cannot raise it: it
    prints "Exception ignored in ... Traceback" (7 lines) and goes on, above the run's one line. Nothing is lost
    by hiding that one message: the loader raises the same death at the rank's next batch (torch checks its
    workers within each BATCH_WAIT_SLICE_S wait), and that error is the run's line and its traceback file. Every
    other unraisable exception still reaches the previous hook. Installed once per process."""
    hide_unraisable("loader worker death", lambda text: text.startswith("DataLoader worker"), "handler",
                    "utils/data/_utils/signal_handling.py")


class BatchPrefetcher:
    """micro_batches(step): this rank's micro-batches of a step, in order."""

    def __init__(self, batches: TokenBatches, batch_rank: int, batch_size: int, micro_batch: int, num_workers: int,
                 total_steps: int, pin_memory: bool = False):
        self.batches, self.batch_rank, self.batch_size = batches, batch_rank, batch_size
        self.micro_batch, self.num_workers, self.total_steps = micro_batch, num_workers, total_steps
        self.pin_memory = pin_memory
        self._loader: DataLoader | None = None
        self._iterator: Iterator[torch.Tensor] | None = None
        self._workers: list[multiprocessing.Process] = []
        self._next_step = -1
        self.stalled_batch_s = STALLED_BATCH_S

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        if self.num_workers == 0 or step >= self.total_steps:
            return self.batches.local_micro_batches(step, self.batch_rank, self.batch_size, self.micro_batch)
        if self._iterator is None or step != self._next_step:
            self._start(step)
        try:
            rows = self._next_rows(step)
        except (ConnectionError, EOFError) as e:
            death = self._worker_death(WORKER_EXIT_GRACE_S)
            if death is None:
                raise
            raise RuntimeError(death) from e
        self._next_step += 1
        return split_micro_batches(rows, self.micro_batch)

    def _wait_for_rows(self) -> torch.Tensor | None:
        """The next batch, waited for in slices up to stalled_batch_s (None then); a dead worker still raises
        within a slice. After a slice's timeout the iterator is as it was (its next() asks again)."""
        waited = 0.0
        while waited < self.stalled_batch_s:
            try:
                return next(self._iterator)
            except RuntimeError as e:
                if "DataLoader timed out" not in str(e):
                    raise
            waited += self._loader.timeout
        return None

    def _next_rows(self, step: int) -> torch.Tensor:
        """The next batch; a stalled one (STALLED_BATCH_S) once more from workers started again."""
        rows = self._wait_for_rows()
        if rows is not None:
            return rows
        print(f"warning: data loader: no batch for step {step + 1} in {self.stalled_batch_s:.0f} s, its workers "
              "alive; starting them again at that step", flush=True)
        self._kill_workers()  # a stalled worker may never look at the iterator's shutdown request
        self._start(step)
        rows = self._wait_for_rows()
        if rows is not None:
            return rows
        self._kill_workers()
        raise RuntimeError(f"data loader: no batch for step {step + 1} in {self.stalled_batch_s:.0f} s, twice, from "
                           f"workers started again (data.num_workers={self.num_workers}); data.num_workers=0 reads "
                           "batches in the rank itself") from None

    def _kill_workers(self) -> None:
        """Kill stalled workers and close their iterator, SIGCHLD blocked meanwhile: torch's handler raises in
        the rank for a worker that dies while its iterator still watches it."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            for worker in self._workers:
                worker.kill()
                worker.join()
            self.close()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _start(self, step: int) -> None:
        self.close()
        hide_worker_deaths_raised_in_finalizers()
        # The first record_function of a process (DataLoader.__next__ opens one) imports
        # torch.profiler._cupti_monitor, logging any exception raised meanwhile with its traceback: a worker's
        # death, raised there by torch's SIGCHLD handler, printed 9 lines of warning beside the rank's one line
        # (a full test run of 2026-11-30, tests/dist/test_recovery.py). Opened here, before any worker exists,
        # that import is over when a worker can die.
        with torch.profiler.record_function("shardwise.loader.start"):
            pass
        # batch_size=None: each item is already a step's batch; the sampler is the steps left, in order.
        self._loader = DataLoader(_RankBatches(self.batches, self.batch_rank, self.batch_size), batch_size=None,
                                  sampler=range(step, self.total_steps), num_workers=self.num_workers,
                                  prefetch_factor=PREFETCH_PER_WORKER, pin_memory=self.pin_memory,
                                  worker_init_fn=_worker_init, timeout=min(BATCH_WAIT_SLICE_S, self.stalled_batch_s))
        # The workers are forked here: with the stop signals blocked, so that they are born blocked (and
        # ignore them once _worker_init runs); the rank receives any that arrive meanwhile on unblocking.
        # SIGCHLD too: torch's handler raises when a worker dies, and raised inside the iterator's
        # construction it left a half-built iterator whose garbage collection printed a traceback
        # ("Exception ignored in ... __del__"); blocked, the death is reported once the iterator is whole.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_WHILE_FORKING)
        try:
            others = set(multiprocessing.active_children())
            self._iterator = iter(self._loader)
            self._workers = [p for p in multiprocessing.active_children() if p not in others]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self._next_step = step

    def _worker_death(self, grace_s: float) -> str | None:
        """What to say when the pipe from the workers broke because one of them died, else None.

        A worker killed while it hands over a batch (the OOM killer, a SIGKILL) can break the pipe before
        torch sees it dead: torch's own check (DataLoader._try_get_data) then re-raises the bare
        ConnectionResetError, and the rank's one line said "Connection reset by peer" instead of naming
        the worker (1 run in 7 of tests/dist/test_recovery.py on this machine)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [p for p in self._workers if p.exitcode is not None]
            if dead:
                code = dead[0].exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"DataLoader worker (pid {dead[0].pid}) exited unexpectedly: {how}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def close(self) -> None:
        """Stop the workers now (they would also stop with the iterator's garbage collection)."""
        iterator, self._iterator, self._loader, self._workers = self._iterator, None, None, []
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()
