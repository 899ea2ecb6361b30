"""Every path a command writes is checked before the command works: exit 2 with the flag, the problem and
a fix, never a traceback (paths.py). Before, `plan evaluate --plot` printed the whole plan and then a
traceback, `export --hf` a traceback; any other OS error of a command is one line too (cli.py main), and an
export that fails leaves nothing behind that a rerun would be refused for."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from shardwise.cli import main

# (argv before the bad path, the flag, argv after): each writes the flag's path.
COMMANDS = [
    (["plan", "evaluate", "--model.preset=tiny", "--plot"], "--plot", []),
    (["plan", "search", "--model.preset=tiny", "--emit"], "--emit", []),
    (["plan", "search", "--model.preset=tiny", "--plot"], "--plot", []),
    (["plan", "calibrate", "--out"], "--out", ["RUN"]),
    (["pipeline-chart", "RUN", "--out"], "--out", []),
    (["export", "--run-dir", "RUN", "--hf"], "--hf", []),
    (["parity", "--nproc", "2", "--layout", "dp_shard=2", "--out"], "--out", []),
    (["bench-comm", "--nproc", "2", "--out"], "--out", []),
    (["launch", "slurm", "--config", "CONFIG", "--nodes", "1", "--gpus-per-node", "1", "--out"], "--out", []),
]


@pytest.mark.parametrize("before, flag, after", COMMANDS, ids=[" ".join(c[0][:2]) + " " + c[1] for c in COMMANDS])
def test_an_output_path_that_cannot_be_written_is_bad_input(tmp_path, capsys, before, flag, after):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "out"  # its directory is a file: cannot be created, on any machine, as any user
    config = tmp_path / "run.toml"
    config.write_text('[model]\npreset = "tiny"\n')
    paths = {"RUN": str(tmp_path / "run"), "CONFIG": str(config)}
    argv = [paths.get(a, a) for a in [*before, str(bad), *after]]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {flag}: ") and str(blocker) in err and f"fix: point {flag} at a" in err, err
    assert "Traceback" not in err and out == "", out  # refused before anything was priced, printed or spawned


def test_an_output_path_that_is_a_directory_is_refused(tmp_path, capsys):
    assert main(["plan", "evaluate", "--model.preset=tiny", "--plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --plot: {tmp_path} is a directory")


@pytest.mark.parametrize("code, exit_code, words", [(errno.ENOSPC, 4, "free space or fix the permissions, then rerun"),
                                                    (errno.ECONNRESET, 1, "shardwise config: [Errno 104]")])
def test_any_other_os_error_of_a_command_is_one_line(monkeypatch, capsys, code, exit_code, words):
    """A command's OS error that no check foresaw: the disk's is exit 4 (as in training), any other exit 1."""
    from shardwise import cli

    def fail(_argv):
        raise OSError(code, "raised by the test", "/some/file")

    monkeypatch.setattr(cli, "_config", fail)
    assert main(["config"]) == exit_code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert "resume from the newest checkpoint" not in err  # not a training run: nothing to resume


def test_an_export_that_fills_the_disk_leaves_nothing_and_the_rerun_works(tmp_path, small_disk, base_overrides):
    """Export onto a full disk: exit 4 with one line; the half-written directory is removed, so that the
    advised rerun (after freeing space) is not refused for a non-empty --hf."""
    run = tmp_path / "run"
    trained = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *[f"--{k}={v}" for k, v in base_overrides],
                              "--train.steps=2", "--checkpoint.final=true", f"--run.dir={run}"],
                             capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    disk = os.statvfs(small_disk)
    filler = small_disk / "filler"  # all but 200 KiB of the disk: the 0.6 MiB of weights do not fit
    filler.write_bytes(b"\0" * (disk.f_bavail * disk.f_frsize - (200 << 10)))
    out = small_disk / "models" / "exported"  # models/ made by the export too: removed with it
    export = [sys.executable, "-m", "shardwise.cli", "export", "--run-dir", str(run), "--hf", str(out)]
    full = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert full.returncode == 4, full.stdout + full.stderr
    lines = full.stderr.splitlines()
    assert len(lines) == 1 and "No space left on device; free space or fix the permissions, then rerun" in lines[0], lines
    assert not (small_disk / "models").exists()
    filler.unlink()  # the advice: free space, then rerun
    again = subprocess.run(export, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
