"""The exceptions a user sees, and the exit code each one means.

ConfigError is bad input: the CLI renders it without a traceback and exits 2, before any process is
spawned. RunFailure and its subclasses are failures during a run that every rank agreed on (or that
one rank hit and reports): the worker prints one line and exits with the failure's code.

Exit codes (docs/run-safety.md): 0 success, 1 an unexpected failure (a crash, a killed worker),
2 bad input, 3 diverged, 4 an I/O error (disk full, read-only), 5 a stalled collective, 6 too few nodes
(a multi-node job's nodes did not all meet; an elastic job had fewer than MIN), 7 out of memory (a rank's
allocation failed in a step or while the model was built), 130 / 143 interrupted by SIGINT / SIGTERM (or
SIGUSR1) after writing a checkpoint.
"""
from __future__ import annotations

import errno
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_IO = 4
EXIT_STALLED = 5
EXIT_TOO_FEW_NODES = 6  # fewer nodes than --nnodes N (elastic MIN:MAX: than MIN) for run.rendezvous_timeout_s
EXIT_OUT_OF_MEMORY = 7
EXIT_EVICTED = 8  # this node left an elastic job as a straggler (run.evict_stragglers), or is refused in its cool-down
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
# A restart (run.max_restarts) cannot help these: the same input, settings or disk fail the same way.
# Interruptions are not restarted either when the launcher itself was signalled (torchrun's agent
# shuts down), and a worker signalled on its own resumes from the checkpoint it just wrote.
NOT_RESTARTABLE = frozenset({EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_IO, EXIT_OUT_OF_MEMORY})


# What a rank reports when another rank died under it: consequences, not causes (gloo's and the store's words).
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "socket closed", "connection refused")


def exception_chain(error: BaseException | None):
    """`error`, then what caused it (raise ... from, or raised while handling), and so on."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def lost_peer(message: str) -> str | None:
    """The phrase of a lost peer that `message` carries (the error only follows another rank's death), or None."""
    return next((s for s in _LOST_PEER if s in message.lower()), None)


# The allocators' own words: CUDA's caching allocator (torch.OutOfMemoryError) and the host's (c10's
# DefaultCPUAllocator raises a plain RuntimeError).
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory")


def out_of_memory(error: BaseException) -> str | None:
    """The allocator's first line when `error` is a failed allocation (GPU or host), else None."""
    if isinstance(error, MemoryError):
        return "Python could not allocate memory"
    text = str(error)
    if type(error).__name__ == "OutOfMemoryError" or any(s in text for s in _OUT_OF_MEMORY):
        line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        # c10's "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: ..." prefix; the CUDA
        # allocator's closing pointer to its documentation ("See documentation for Memory Management (URL)")
        line = line.split("] ", 1)[-1].removeprefix("err == 0. ").split("See documentation for Memory")[0]
        return " ".join(line.split())
    return None


def did_you_mean(key: str, candidates: list[str]) -> str:
    """A ConfigError's fix for an unknown name: the closest candidate, else the list of them."""
    import difflib

    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"did you mean '{match[0]}'?" if match else f"valid keys: {', '.join(candidates)}"


def interrupt_exit_code(signum: int) -> int:
    """130 for SIGINT (Ctrl-C), 143 for SIGTERM and the other stop requests (SIGUSR1: SLURM's warning)."""
    return EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM


class ConfigError(ValueError):
    """A user-facing input error: which field, what was wrong, how to fix it."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        text = f"{self.field}: {self.problem}"
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


@dataclass(frozen=True)
class Violation:
    """A broken rule: `reason` is the short key the planner's search counts, (field, problem, fix)
    the ConfigError pre-flight raises (spec/rules.py). `trainer_only`: a rule of what the trainer implements today,
    not of what can run at all; the planner evaluates such layouts but reports them untrainable."""

    reason: str
    field: str
    problem: str
    fix: str
    trainer_only: bool = False

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.problem, self.fix)


class RunFailure(Exception):
    """A failure during a run: one line for the user and a distinct exit code.

    `report` says whether this rank prints the line: failures every rank agreed on are printed by
    rank 0 only; a failure one rank hit is printed by that rank."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.message = message
        self.report = report


class Diverged(RunFailure):
    """Too many consecutive non-finite steps, or non-finite weights at a checkpoint."""

    exit_code = EXIT_DIVERGED


class OutOfMemory(RunFailure):
    """An allocation failed in a training step or while the model was built: the same layout fails the same
    way, so no restart."""

    exit_code = EXIT_OUT_OF_MEMORY


class StorageFailure(RunFailure):
    """A write or read the run depends on failed (disk full, read-only file system, I/O error)."""

    exit_code = EXIT_IO


class Interrupted(RunFailure):
    """SIGINT / SIGTERM / SIGUSR1: the run stopped after a step and wrote a checkpoint."""

    def __init__(self, message: str, exit_code: int, report: bool = True):
        super().__init__(message, report)
        self.exit_code = exit_code


# errno values that mean the storage, not the program, failed.
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM})


def rerun_to_resume(resumes: bool, where: str = "", what: str = "", changing: str = "") -> str:
    """The advice that resumes a run. `resumes`: its checkpoint.resume; with false the same command starts over
    (rundir.supersede_previous_run sets the checkpoints aside), so the advice names the override that resumes.
    `changing`: what the rerun changes (a divergence's "the new value"), else it is the same command."""
    if resumes:
        return f"rerun {f'with {changing}' if changing else 'the same command'}{where} to resume{what}"
    return (f"rerun{where} with {f'{changing} and ' if changing else ''}--checkpoint.resume=true to resume{what} "
            f"(with checkpoint.resume=false the {'' if changing else 'same '}command starts over)")


def storage_failure(error: OSError, report: bool = True, then: str | None = None,
                    resumes: bool = True, directory: object = None) -> StorageFailure | None:
    """A write the run needed (metrics, logs, checkpoints) failed for a reason of the disk's: the one
    line to show, or None for other OS errors. `then`: what to do once the disk is fixed (default: resume
    the run, whose checkpoint.resume is `resumes`). `directory`: where the run writes, named when the error
    names no file (a write() to an open file that fills the disk carries no file name)."""
    if error.errno not in _STORAGE_ERRNOS:
        return None
    where = f" ({error.filename})" if error.filename else f" (under {directory})" if directory else ""
    then = then or f"then {rerun_to_resume(resumes, what=' from the newest checkpoint')}"
    return StorageFailure(f"cannot write{where}: {error.strerror}; free space or fix the permissions, {then}", report=report)


def hide_unraisable(name: str, message: Callable[[str], bool], function: str, file_suffix: str) -> None:
    """Hide one known message Python prints for an exception it could not raise ("Exception ignored in ...
    Traceback", sys.unraisablehook): a RuntimeError whose text `message` accepts, raised in `function` of a file
    ending in `file_suffix`. Every other unraisable exception still reaches the previous hook. Installed once per
    process for each `name` (launch/local.py's rendezvous timer, train/loader.py's worker deaths)."""
    previous = sys.unraisablehook
    if name in getattr(previous, "shardwise_hidden", ()):
        return

    def matches(exc: BaseException | None, tb) -> bool:
        return isinstance(exc, RuntimeError) and message(str(exc)) and any(
            frame.f_code.co_name == function and Path(frame.f_code.co_filename).as_posix().endswith(file_suffix)
            for frame, _ in traceback.walk_tb(tb))

    def hook(unraisable) -> None:
        if not matches(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    hook.shardwise_hidden = (*getattr(previous, "shardwise_hidden", ()), name)
    sys.unraisablehook = hook
