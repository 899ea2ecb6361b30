"""The run directory before and during a job: usable, locked to one job, resumable, restart-aware.
Used by the launcher (cli.py, before spawning) and by the workers (train/__main__.py).

Checked before anything is spawned (exit 2 with the field named): run.dir, checkpoint.dir and
data.cache_dir can be created and written; no other live job holds the run directory (a lock file,
flock'ed by the job for its lifetime: the kernel releases it when the process dies, so a stale lock
is simply taken over, with a message); the newest checkpoint was written for this model, data and
batch (train/manifest.py's fingerprint), and is not already at train.steps.

Multi-node (`shardwise train --nnodes N --node-rank K`, run.dir on a shared file system or not): every
node's launcher runs the checks (its own disks and data cache, and the resume check, read-only, so all
nodes agree whether there is anything to train); only node 0's launcher locks the run directory, clears
an earlier job's failure record and writes config.toml. The lock records the job's rendezvous id, so the
worker that ends up global rank 0 (c10d orders nodes itself: it may sit on another node) sees its own
job holding it instead of a foreign one. Without a shared file system each node keeps its own run
directory; checkpoints then need one (every rank writes its shard).

<dir>/.shardwise/ holds the lock and, when a failure no restart can fix ended a job (errors.py
NOT_RESTARTABLE), that job's exit code: workers the elastic agent restarts anyway read it and end at
once instead of failing the same way again.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from shardwise.config import dotted
from shardwise.errors import NOT_RESTARTABLE, ConfigError, rerun_to_resume
from shardwise.paths import writable_dir
from shardwise.scratch import process_alive
from shardwise.train import manifest as mf
from shardwise.train.distributed import RUN_ID  # torch is imported there only inside functions

STATE_DIR = ".shardwise"
# How long the other ranks of a restart that ends at once wait for rank 0 to have said why (say_unrestartable):
# rank 0 reads the same small record they do; past this it is taken to be gone.
SAID_WAIT_S = 10.0
__all__ = ["NOT_RESTARTABLE", "DirectoryLock", "check_cache_dir", "check_run_dirs", "lock_dirs", "lock_unless_parent_holds",
           "resume_preflight", "record_unrestartable_failure", "unrestartable_failure", "save_config",
           "clear_failure_record", "say_unrestartable", "wait_until_said"]


def checkpoint_dir(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")


def check_cache_dir(cfg) -> None:
    """data.cache_dir exists (or is created) and accepts a file: the corpus is prepared there first."""
    writable_dir(Path(os.path.expanduser(cfg.data.cache_dir)), "data.cache_dir")


def check_run_dirs(cfg) -> None:
    """run.dir and the checkpoint directory exist (or are created) and accept a file. Called after
    every other check, so a refused config creates no run directory."""
    writable_dir(Path(cfg.run.dir), "run.dir")
    if cfg.checkpoint.every > 0 or cfg.checkpoint.final:
        writable_dir(checkpoint_dir(cfg), "checkpoint.dir" if cfg.checkpoint.dir else "run.dir")


class DirectoryLock:
    """An exclusive flock on <dir>/.shardwise/lock, with the holder's pid, host and command inside."""

    def __init__(self, directory: Path, field: str):
        self.directory, self.field = directory, field
        self.path = directory / STATE_DIR / "lock"
        self.fd: int | None = None

    def _holder(self, fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self, allow_parent: bool = False, job: str | None = None) -> str | None:
        """Take the lock; returns a note when a stale one was taken over. Raises ConfigError when a
        live job holds it, unless (allow_parent) that job is this process's parent, the launcher, or
        its launcher on another node (the holder recorded this process's rendezvous id). `job` is the
        rendezvous id recorded when this lock is taken for a multi-node launch."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._holder(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            if allow_parent and (holder.get("pid") == os.getppid()
                                 or (holder.get("job") and holder["job"] == os.environ.get(RUN_ID))):
                return None
            who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
            since = f", since {holder['started']}" if holder.get("started") else ""
            raise ConfigError(self.field, f"run directory {self.directory} is in use by {who} ({holder.get('command', '?')}{since})",
                              f"wait for that job to end (or stop it), or choose another --{self.field}") from None
        previous = self._holder(fd)
        note = None
        if previous.get("pid"):
            state = "is no longer running" if not process_alive(previous["pid"]) or previous.get("host") != socket.gethostname() \
                else "no longer holds it"
            note = f"run directory {self.directory}: took over the lock of pid {previous['pid']}, which {state}"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)[:300]}
        if job:
            info["job"] = job
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return note

    def release(self) -> None:
        """Empty the lock file (a clean end leaves nothing to take over) and unlock."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _lock_targets(cfg) -> list[tuple[Path, str]]:
    run = Path(cfg.run.dir)
    out = [(run, "run.dir")]
    ckpt = checkpoint_dir(cfg)
    if cfg.checkpoint.dir and run.resolve() not in (ckpt.resolve(), *ckpt.resolve().parents):
        out.append((ckpt, "checkpoint.dir"))
    return out


def lock_dirs(cfg, log=print, job: str | None = None) -> list[DirectoryLock]:
    """Lock the run directory (and a checkpoint.dir outside it) for this job; raises ConfigError.
    `job`: a multi-node launch's rendezvous id, recorded so its workers on other nodes accept the lock."""
    locks = []
    try:
        for directory, field in _lock_targets(cfg):
            lock = DirectoryLock(directory, field)
            note = lock.acquire(job=job)
            locks.append(lock)
            if note:
                log(note)
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    return locks


class _Locks:
    """The locks a worker took itself. `own`: it took the run directory's, so no shardwise launcher
    prepared this run (plain torchrun): the worker writes config.toml and prints the data line."""

    def __init__(self, locks: list[DirectoryLock]):
        self.locks = locks
        self.own = any(lock.field == "run.dir" for lock in locks)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def lock_unless_parent_holds(cfg) -> _Locks:
    """For a worker (global rank 0): lock the run's directories unless its launcher already did."""
    locks = []
    for directory, field in _lock_targets(cfg):
        lock = DirectoryLock(directory, field)
        try:
            note = lock.acquire(allow_parent=True)
        except ConfigError:
            _Locks(locks).release()
            raise
        if lock.fd is not None:
            locks.append(lock)
        if note:
            print(note, flush=True)
    return _Locks(locks)


def save_config(cfg) -> Path:
    """The resolved config as <run.dir>/config.toml: what a later `shardwise train --config` reruns."""
    path = Path(cfg.run.dir) / "config.toml"
    cfg.save(path)
    return path


def clear_failure_record(run_dir: Path) -> None:
    """A new job starts (its launcher holds the lock): an earlier job's unrestartable-failure record
    must not end this one's restarts, even when both use the same rendezvous id (a multi-node launch
    derives it from run.dir)."""
    try:
        _failure_file(run_dir).unlink(missing_ok=True)
        _interruption_file(run_dir).unlink(missing_ok=True)  # a killed launcher's: not this job's restart reason
        for said in _failure_file(run_dir).parent.glob("failure.said.*"):
            said.unlink(missing_ok=True)
    except OSError:
        pass


def supersede_previous_run(cfg) -> str | None:
    """A fresh start (checkpoint.resume=false, not a restart of this job): move every checkpoint already
    in checkpoint.dir into a sub-directory `previous.N` (kept, never loaded), so this run's saves, its
    pruning and a later resume see only its own checkpoints. Without this a save found an older run's
    step_N, skipped it as saved, and pruning by step number deleted the new run's checkpoints. Returns
    the line that says so, or None when there was nothing to move."""
    directory = checkpoint_dir(cfg)
    found = sorted(p for p in directory.glob("step_*")) if directory.is_dir() else []
    if not found:
        return None
    n = 1
    while (directory / f"previous.{n}").exists():
        n += 1
    target = directory / f"previous.{n}"
    # Which are complete is read before they move (read after, every path named one that no longer exists).
    steps = sorted(mf.step_of(p) for p in found if mf.is_complete(p) and "." not in p.name)
    target.mkdir()
    for path in found:
        os.replace(path, target / path.name)
    mf.fsync_dir(directory)
    what = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "no complete one"
    return (f"checkpoint.resume=false: starting over; the {len(found)} checkpoint entr{'y' if len(found) == 1 else 'ies'} "
            f"already in {directory} ({what}) moved to {target} (kept, never loaded)")


# What a resume may not change is refused before this (manifest.py fingerprint: the model, the data and
# the batch stream); every other key may change, and each takes effect: the optimizer's hyper-parameters
# are re-applied after loading (optim.py apply_hyperparameters), the rest is read from the config as the
# run goes. Differences in these keys are expected from one launch to the next and not reported.
_NOT_REPORTED = {"checkpoint.resume"}


def _sources_by_name(flat: dict) -> dict:
    """A mixture's [[data.sources]] as keys of their own (data.sources[web].weight), so that a changed weight
    reads as one."""
    out = {k: v for k, v in flat.items() if k != "data.sources"}
    for i, source in enumerate(flat.get("data.sources") or []):
        name = source.get("name") or f"{i}"
        out.update({f"data.sources[{name}].{k}": v for k, v in source.items() if k != "name"})
    return out


def resume_changes(saved_config: Path, cfg) -> list[str]:
    """["train.lr 0.003 -> 0.001", ...]: the keys whose values differ between the config a checkpoint was
    written under (its own config.toml) and this run's. [] when that file is missing or unreadable."""
    import tomllib

    try:
        saved = dotted(tomllib.loads(saved_config.read_text()))
    except (OSError, tomllib.TOMLDecodeError):
        return []
    saved, now = _sources_by_name(saved), _sources_by_name(dotted(cfg.to_dict()))
    keys = sorted((set(saved) | set(now)) - _NOT_REPORTED)
    return [f"{k} {saved.get(k, '(unset)')} -> {now.get(k, '(unset)')}" for k in keys if saved.get(k) != now.get(k)]


def resume_preflight(cfg, num_tokens: int, tokenizer_sha256: str) -> str | None:
    """Before spawning: refuse a checkpoint written for another model / data / batch (ConfigError
    with the differing keys), and return a note when the newest checkpoint already reached
    train.steps (there is nothing to train)."""
    if not cfg.checkpoint.resume:
        return None
    found = mf.complete_checkpoints(checkpoint_dir(cfg))
    if not found:
        return None
    try:
        manifest = mf.read_manifest(found[-1])
    except ValueError:
        return None  # damaged or from before manifests: the trainer verifies it and falls back
    saved = manifest.get("config")
    if saved is not None:
        mf.refuse_changes(found[-1], saved, mf.fingerprint(cfg, num_tokens, tokenizer_sha256))
    if manifest.get("step", 0) >= cfg.train.steps:
        return (f"{found[-1]} is at step {manifest['step']} and train.steps is {cfg.train.steps}: nothing to train "
                "(raise --train.steps to continue it, or choose another --run.dir)")
    return None


def newest_trainer_state(cfg) -> dict | None:
    """The trainer state (step, data position, ...) of the newest complete checkpoint a resume would start
    from, read without torch; None when there is none or it cannot be read (the trainer then falls back)."""
    if not cfg.checkpoint.resume:
        return None
    found = mf.complete_checkpoints(checkpoint_dir(cfg))
    if not found:
        return None
    try:
        return json.loads((found[-1] / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None


def _failure_file(run_dir: Path) -> Path:
    return run_dir / STATE_DIR / "failure.json"


def record_unrestartable_failure(run_dir: Path, run_id: str, exit_code: int) -> None:
    if not run_id or exit_code not in NOT_RESTARTABLE:
        return
    try:
        path = _failure_file(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_id": run_id, "exit_code": exit_code}))
    except OSError:
        pass  # then a restart fails the same way once more


def _interruption_file(run_dir: Path) -> Path:
    return run_dir / STATE_DIR / "interrupted.json"


def record_interruption(run_dir: Path, run_id: str, message: str) -> None:
    """Rank 0 under shardwise's launcher: the "interrupted ... after step N" line goes to the launcher, not the
    terminal. torch's elastic agent stops its workers with SIGTERM both when the job stops and when it only
    re-forms the group (a node drained, a node joining): printed by the worker, the line said "rerun the same
    command to resume" and the job then went on by itself. The launcher prints it if it ends (take_interruption);
    the next group of the same job (same run id) takes it as the sign that it was re-formed (train/__main__.py)."""
    try:
        path = _interruption_file(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": run_id, "message": message}))
        os.replace(tmp, path)
    except OSError:
        pass  # then the launcher ends with the exit code and its own line


def take_interruption(run_dir: Path, run_id: str | None = None) -> dict | None:
    """The recorded interruption ({"run_id", "message"}), removed; None if there is none (or it is
    another job's, when `run_id` is given)."""
    path = _interruption_file(run_dir)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if run_id is not None and record.get("run_id") != run_id:
        return None
    path.unlink(missing_ok=True)
    return record


def _said_file(run_dir: Path, attempt: int) -> Path:
    return _failure_file(run_dir).with_name(f"failure.said.{attempt}")


def say_unrestartable(run_dir: Path, run_id: str, attempt: int) -> None:
    """Rank 0 has printed why restart `attempt` ends at once (train/__main__.py): the other ranks, which
    read the same record, wait for this before they exit (`wait_until_said`). The first worker to exit
    makes the elastic agent stop the others, so a rank 1 that was faster stopped rank 0 before its line,
    and that restart ended without a word (seen in a CI run)."""
    try:
        _said_file(run_dir, attempt).write_text(run_id)
    except OSError:
        pass


def wait_until_said(run_dir: Path, run_id: str, attempt: int, timeout_s: float = SAID_WAIT_S) -> bool:
    """Whether rank 0 said it (`say_unrestartable`) within `timeout_s`; a rank 0 that died first is not waited for longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _said_file(run_dir, attempt).read_text() == run_id:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def unrestartable_failure(run_dir: Path, run_id: str) -> int | None:
    """The exit code of this job's earlier unrestartable failure, if any."""
    try:
        record = json.loads(_failure_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return int(record["exit_code"]) if run_id and record.get("run_id") == run_id else None


def traceback_file(run_dir: Path, rank: int) -> Path:
    """Where a rank's crash leaves its traceback (record_crash); the launcher's line names it."""
    return run_dir / "errors" / f"rank_{rank}.txt"


def record_crash(run_dir: Path, rank: int, error: BaseException) -> Path | None:
    """The traceback to <run_dir>/errors/rank_<r>.txt (None if it cannot be written), and the root cause to
    torchelastic's error file (the launcher picks the first failure by its timestamp)."""
    text = "".join(traceback.format_exception(error))
    path = None
    try:
        path = traceback_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}\n")
    except OSError:
        path = None
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    return path


def crash_line(cfg, error: BaseException, written: Path | None) -> str:
    """A run without a launcher crashed: its one line, as the launcher says a rank's (launch/local.py
    report_failure): the exception's "Type: message", where its traceback was `written` (record_crash), and
    the checkpoint to resume from."""
    message = (str(error).strip().splitlines() or [""])[0]
    where = f" (traceback: {written})" if written is not None else ""
    return (f"training failed: {type(error).__name__}{': ' if message else ''}{message}"[:300] + where
            + resume_hint(checkpoint_dir(cfg), resumes=cfg.checkpoint.resume))


def resume_hint(checkpoints: Path | None, every_node: bool = False, resumes: bool = True) -> str:
    """Where to resume from. A multi-node job resumes only when every node reruns (`every_node`): one node
    rerun alone waits for the others at the rendezvous."""
    if checkpoints is None:
        return ""
    found = mf.complete_checkpoints(checkpoints)
    if not found:
        return "; no checkpoint was written yet"
    advice = rerun_to_resume(resumes, " on every node" if every_node else "", " from it")
    return f"; newest checkpoint {found[-1]}: {advice}" + (" (run.max_restarts restarts automatically)" if resumes else "")
