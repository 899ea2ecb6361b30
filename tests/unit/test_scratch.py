"""Scratch files named after their process (shardwise/scratch.py): what a killed process leaves is
removed by the next one on the same host, and nothing live or foreign is touched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardwise.scratch import owned_directory, owned_file, remove_stale


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_dead_processes_entries_go_live_and_foreign_ones_stay(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"shardwise-nvme-host-{dead}-rank0-x").mkdir()
    (tmp_path / f"shardwise-nvme-host-{dead}-y.toml").write_text("")
    (tmp_path / f"shardwise-nvme-host-{os.getpid()}-rank0-z").mkdir()  # alive: this test
    (tmp_path / f"shardwise-nvme-other_host-{dead}-w").mkdir()  # another host's pid means nothing here
    (tmp_path / f"shardwise-node-host-{dead}-v").mkdir()  # another kind
    (tmp_path / "shardwise-nvme-host-notapid-u").mkdir()
    removed = remove_stale("nvme", tmp_path, host="host")
    assert sorted(p.name for p in removed) == [f"shardwise-nvme-host-{dead}-rank0-x", f"shardwise-nvme-host-{dead}-y.toml"]
    assert sorted(p.name[-1] for p in tmp_path.iterdir()) == ["u", "v", "w", "z"]


def test_a_killed_process_not_yet_reaped_counts_as_gone(tmp_path):
    """A zombie (killed, its parent has not waited for it yet) still answers signal 0."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"shardwise-node-host-{child.pid}-a").mkdir()
        assert remove_stale("node", tmp_path, host="host") == []  # alive
        child.send_signal(signal.SIGKILL)
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        assert len(remove_stale("node", tmp_path, host="host")) == 1
    finally:
        child.kill()
        child.wait()


def test_owned_names_carry_host_and_pid(tmp_path):
    d = owned_directory("torchelastic", tmp_path, tag="rank2")
    f = owned_file("node", ".toml", tmp_path)
    for path in (d, f):
        kind, host, pid = path.name.split("-")[1:4]
        assert pid == str(os.getpid()) and "-" not in host and host
    assert "-rank2-" in d.name and d.is_dir() and f.suffix == ".toml" and f.stat().st_mode & 0o777 == 0o600


def test_what_a_killed_process_left_is_removed_by_the_next(tmp_path):
    """A real SIGKILL: the child makes its directory and file, is killed before any cleanup, and the
    next owned_directory of the same kind (this process) removes both."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from shardwise.scratch import owned_directory, owned_file; "
         f"d = owned_directory('torchelastic', {str(tmp_path)!r}); (d / 'error.json').write_text('{{}}'); "
         f"owned_file('torchelastic', '.toml', {str(tmp_path)!r}); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    mine = owned_directory("torchelastic", tmp_path)
    assert list(tmp_path.iterdir()) == [mine]
