"""A throttled host, made for real: processes held to a share of one CPU by a CFS bandwidth quota (a cgroup of the
`cpu` controller, v1 or v2), in 1 ms slices (the kernel's smallest quota) so that their work is slowed about alike
throughout (the default 100 ms period would let a short forward run at full speed and stall whole steps
instead). Root only; a test that needs it skips, saying why, where no cpu cgroup can be made."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

QUOTA_US = 1000  # the kernel's smallest CFS quota: the group runs 1 ms, then waits out the rest of its period


def _cpu_root() -> tuple[Path, str] | None:
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists():
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    if "cpu" in (v2 / "cgroup.subtree_control").read_text().split() if (v2 / "cgroup.subtree_control").exists() else False:
        return v2, "v2"
    return None


@contextmanager
def throttled(share: float) -> Iterator["Throttle"]:
    """A cgroup whose processes get at most `share` of one CPU; add() moves processes in; removed at the end
    (its processes moved back to the root group first)."""
    found = _cpu_root() if os.geteuid() == 0 else None
    if found is None:
        reason = "throttling a process needs root and a cpu cgroup (v1 cpu.cfs_quota_us or v2 cpu.max)"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    root, version = found
    group = root / f"shardwise-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    group.mkdir()
    try:
        period = int(QUOTA_US / share)
        if version == "v1":
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        else:
            (group / "cpu.max").write_text(f"{QUOTA_US} {period}")
        yield Throttle(group)
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:  # gone meanwhile
                pass
        group.rmdir()


class Throttle:
    def __init__(self, group: Path):
        self.group = group

    def add(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                (self.group / "cgroup.procs").write_text(str(pid))
            except OSError:  # exited meanwhile
                pass
