"""The paths a command writes, checked before it does any work: bad input is exit 2 with the flag, the
problem and a fix (errors.py ConfigError), never a traceback after minutes of work.

Found by giving each command an impossible output path: `export --hf /proc/out` and `plan evaluate
--plot /proc/x.png` ended in a Python traceback, the plot one after the whole plan was printed.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from shardwise.errors import ConfigError


def writable_dir(path: Path, field: str) -> None:
    """`path` is a directory (made if missing) that accepts a new file."""
    if path.exists() and not path.is_dir():
        raise ConfigError(field, f"{path} exists and is not a directory", f"point {field} at a directory (or a new path)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(field, f"cannot create {path}: {e.strerror or e}", f"point {field} at a writable location") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".shardwise-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(field, f"{path} is not writable: {e.strerror or e}", f"point {field} at a writable location") from None


def writable_file(path: Path, field: str) -> None:
    """`path` can be written as a file: not a directory, its directory made if missing and writable. An
    existing file is left as it is (the command replaces it)."""
    if path.is_dir():
        raise ConfigError(field, f"{path} is a directory", f"give {field} a file name (e.g. {path / 'out'})")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(field, f"cannot create {path}: {path.parent} is a file", f"point {field} at a writable location")
    writable_dir(path.parent, field)
