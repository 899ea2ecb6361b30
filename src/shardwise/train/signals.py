"""How a worker process reacts to signals and to the death of its launcher.

- SIGINT (Ctrl-C), SIGTERM (torchrun's agent forwarding a stop, a scheduler's preemption notice) and
  SIGUSR1 (SLURM's `--signal` warning before the time limit) do not interrupt anything: they set a stop
  request. The trainer agrees on it with every rank at the end of the current step, writes a
  checkpoint and exits 130 (SIGINT) or 143 (the others), with one line and no traceback.
- A worker dies with its launcher: PR_SET_PDEATHSIG on Linux (the kernel kills the worker when the
  process that started it exits, even by SIGKILL), a watcher thread elsewhere. Without it a killed
  `shardwise train` leaves its workers training and writing into the run directory.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from shardwise.errors import EXIT_FAILED, interrupt_exit_code

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StopRequest:
    """`with StopRequest() as stop:` ... `stop.exit_code` is 0 until one of STOP_SIGNALS arrives, then
    130 or 143. The previous handlers come back on exit. Handlers can only be installed from the main
    thread; elsewhere (a library caller's thread) the request simply never fires."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def exit_code(self) -> int:
        return interrupt_exit_code(self.signum) if self.signum is not None else 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def exit_with_parent() -> None:
    """Make this process die when its parent (the launcher) does. Call it first thing in a worker."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the request took effect
                    os._exit(EXIT_FAILED)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent,), name="shardwise-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    """Portable fallback: once the process is re-parented, the launcher is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(EXIT_FAILED)
