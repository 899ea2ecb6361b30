"""How a worker process reacts to signals and to the death of its launcher.

- SIGINT (Ctrl-C), SIGTERM (torchrun's agent forwarding a stop, a scheduler's preemption notice) and
  SIGUSR1 (SLURM's `--signal` warning before the time limit) do not interrupt anything: they set a stop
  request. The trainer agrees on it with every rank at the end of the current step, writes a
  checkpoint and exits 130 (SIGINT) or 143 (the others), with one line and no traceback.
- A worker dies with its launcher: exit_with_parent (orphans.py, shared with the corpus preparation's
  workers, which stand below train/).
"""
from __future__ import annotations

import signal
import threading

from shardwise.errors import interrupt_exit_code
from shardwise.orphans import exit_with_parent

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
__all__ = ["STOP_SIGNALS", "StopRequest", "exit_with_parent"]


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
