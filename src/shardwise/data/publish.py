"""Files that appear whole or not at all: written to a temporary file in the final directory, flushed to
disk, then published under the final name. A reader never sees half a file, and a killed writer leaves
only a temporary file (named `.NAME.*.tmp`), which the next preparation removes.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_SUFFIX = ".tmp"


def publish(write: Callable[[BinaryIO], Any], final: Path, replace: bool = False) -> None:
    """Write via a temp file in final's directory, then publish it atomically.

    The first publisher wins (os.link refuses to overwrite), so racing processes all read the same
    file even if their contents could differ; os.replace is the fallback where hard links are missing,
    and the rule with `replace` (a writer that holds the directory's lock). A failed write (a full disk)
    removes its temp file before the error goes on."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, final)
            return
        try:
            os.link(tmp, final)
        except FileExistsError:
            pass
        except OSError:
            os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def publish_bytes(final: Path, data: bytes, replace: bool = False) -> None:
    publish(lambda f: f.write(data), final, replace)


def sync_directory(path: Path) -> None:
    """Make the names published in `path` durable (a rename is an entry of the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
