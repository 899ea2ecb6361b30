"""A child process dies with its parent: no orphan keeps training, or writing a shard, after its launcher
is gone. Used by training workers, their data-loader workers and the corpus preparation's workers.

PR_SET_PDEATHSIG on Linux (the kernel kills the child when the process that started it exits, even by
SIGKILL); a watcher thread elsewhere. Without it a killed `shardwise train` leaves its workers training
and writing into the run directory.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from shardwise.errors import EXIT_FAILED

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
