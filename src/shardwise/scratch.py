"""Scratch files and directories named after the process that owns them, removed once it is gone.

A process killed by SIGKILL (the OOM killer, a scheduler's hard stop, a node's loss, a fault test)
runs no `finally`: every temporary file it made stays behind. torchrun's own log directories and our
per-node config copies piled up in /tmp this way, one per killed launch. Each name here carries
its owner's host and pid (`shardwise-<kind>-<host>-<pid>-<random>`), and every new one first removes
the same kind's entries on this host whose process no longer exists. The host is in the name because
the directory may be shared (an NVMe offload directory on a network file system): another host's pid
means nothing here. A pid the kernel has reused keeps a stale entry one run longer; never a live one
removed.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path


def _host() -> str:
    # The field separator is "-": a host name's own dashes would shift the pid's field.
    return socket.gethostname().replace("-", "_")


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 probes without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: signal 0 still finds it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (macOS), or it just went
        return True


def remove_stale(kind: str, root: str | Path | None = None, host: str | None = None) -> list[Path]:
    """Remove `kind`'s entries under `root` (default: the temp directory) made on `host` (default: this
    one) by processes that no longer exist; returns what was removed."""
    root = Path(root if root is not None else tempfile.gettempdir())
    prefix = f"shardwise-{kind}-{host or _host()}-"
    removed = []
    for path in root.glob(prefix + "*"):
        pid_field = path.name[len(prefix):].split("-", 1)[0]
        if not pid_field.isdigit() or process_alive(int(pid_field)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            for held in _held(path, root):
                shutil.rmtree(held, ignore_errors=True)
                removed.append(held)
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _held(path: Path, root: Path) -> list[Path]:
    """The directories an owned file names (owned_file's `holds`), only those directly under its root."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [Path(line) for line in lines if line and Path(line).parent == root and Path(line).is_dir()
            and not Path(line).is_symlink()]


def _prefix(kind: str, tag: str) -> str:
    return f"shardwise-{kind}-{_host()}-{os.getpid()}-" + (f"{tag}-" if tag else "")


def owned_directory(kind: str, root: str | Path | None = None, tag: str = "") -> Path:
    """A new directory under `root` owned by this process (module doc); stale ones of `kind` go first."""
    remove_stale(kind, root)
    return Path(tempfile.mkdtemp(prefix=_prefix(kind, tag), dir=root))


def owned_file(kind: str, suffix: str = "", root: str | Path | None = None, holds: list[str] = ()) -> Path:
    """A new file (mode 0600) under `root` owned by this process; stale ones of `kind` go first. `holds`: directories
    directly under the same root that someone else named and made (multiprocessing's pymp-*), written in the
    file, removed with it once this process is gone."""
    remove_stale(kind, root)
    fd, name = tempfile.mkstemp(prefix=_prefix(kind, ""), suffix=suffix, dir=root)
    os.write(fd, "".join(f"{h}\n" for h in holds).encode())
    os.close(fd)
    return Path(name)
