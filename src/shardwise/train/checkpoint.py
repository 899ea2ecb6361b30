"""Distributed checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, never unsafe.

Layout of one checkpoint:  <dir>/step_00000100/
    DCP shards + .metadata     model and optimizer state, keyed by parameter FQN (reshardable)
    trainer_state.json         step, LR scheduler, loss scaler, data position, skipped-step counts
    rng/rank_<r>.pt            each rank's RNG state (tensors only; loaded with weights_only=True)
    rank_state/rank_<r>.pt     each rank's own training state, when it has one: gradient compression's
                               error-feedback residuals / PowerSGD state (parallel/grad_compression.py).
                               Per rank and meaningful only on the same layout, like the RNG: a file per
                               rank, not DCP (which dedups and reshards by key); tensors, ints and strings
                               only, loaded with weights_only=True
    tokenizer.json, config.toml
    manifest.json              written last: size and SHA-256 of every file (train/manifest.py)

Saving (every rank): step_N.tmp -> DCP -> RNG -> rank 0's files -> checksums (each rank hashes a share of
the files) -> manifest -> rename into place -> prune. Any write that fails on any rank (disk full,
read-only) fails the save on every rank: the partial .tmp is removed, older checkpoints are untouched,
and StorageFailure (exit code 4) names the error. A crash at any point leaves either the old set of
checkpoints or the old set plus the new one.

Loading: the newest complete checkpoint is verified first (every file against the manifest, the ranks
sharing the reading; DCP's pickled `.metadata` through an unpickler that only builds DCP's own metadata
classes). A damaged one is reported, renamed step_N.corrupt (never deleted) and the previous one is
tried. DCP's stock reader unpickles `.metadata` and `torch.load(weights_only=False)`s non-tensor values:
a crafted checkpoint could run code on resume, so both go through train/safe_dcp.py.
"""
from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardwise.errors import StorageFailure, exception_chain, rerun_to_resume
from shardwise.parallel.parallelize import canonical_fqn
from shardwise.train import manifest as mf
from shardwise.train.control import Control
from shardwise.train.out_of_memory import SaveOutOfMemory, allocation_failure, remains_words
from shardwise.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, metadata_problem, read_metadata  # noqa: F401

# Optimizer state keyed by parameter name throughout ("param_groups.<fqn>.lr", not "param_groups.0"):
# pipeline stages hold different parameters in their param group 0, and positional keys would make
# the stages overwrite each other's groups in the checkpoint.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
TRAINER_STATE = "trainer_state.json"
RANK_STATE = "rank_state"
RNG = "rng"
# Verification outcome per file, agreed over ranks by maximum (worst wins).
_REASONS = {1: "missing", 2: "wrong size (truncated or overwritten)", 3: "checksum mismatch (the content changed)",
            4: "unreadable", 5: "unsafe or unreadable DCP metadata", 6: "a rank's file does not load safely"}


def _dcp(fn, state: dict, path: Path, **kwargs) -> None:
    """dcp.save / dcp.load; on one process DCP warns it is 'assuming the intent is to save in a
    single process', which is exactly the reference path's intent, so that warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=str(path), **kwargs)


def _storage_error(e: CheckpointException, directory: Path) -> OSError | None:
    """The I/O error behind a failed DCP save, or None when it failed for another reason. DCP writes
    non-tensor values with torch.save, whose stream writer reports a full disk as a RuntimeError
    ("unexpected pos ..."), not an OSError: a file system left (nearly) full says what happened."""
    found = next((c for exc, _trace in e.failures.values() for c in exception_chain(exc) if isinstance(c, OSError)), None)
    if found is not None:
        return found
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free < max(1 << 20, total // 1000):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return None


def _rank_error(e: CheckpointException, rank: int) -> BaseException:
    """The error behind a failed DCP save that was neither the disk's nor memory's: this rank's own, else the
    first failing rank's. DCP wraps the ranks' errors in CheckpointException, a BaseException, which the entry
    points' `except Exception` let through as a traceback: a data-loader worker killed during a save (its
    SIGCHLD handler raises inside DCP's write) ended a one-process run so in about half the runs of
    tests/dist/test_recovery.py's one-process crash. Raised on, it is a crash like any other: one line."""
    own, _trace = e.failures.get(rank) or e.failures[min(e.failures)]
    return own


def is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    from shardwise.parallel.zero1 import ZeroOneOptimizer

    return isinstance(optimizer, ZeroOneOptimizer)


def _zero1_owned(model: nn.Module, optimizer) -> dict[str, nn.Parameter]:
    """FQN -> parameter for the parameters whose optimizer state this rank owns."""
    owned = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}
    return {canonical_fqn(n): p for n, p in model.named_parameters() if id(p) in owned}


def _zero1_state(model: nn.Module, optimizer, allocate: bool) -> dict:
    """ZeRO-1 optimizer state in the same {"state": {fqn: {...}}} shape as DCP's
    get_optimizer_state_dict, for the owned parameters only: each rank contributes distinct keys,
    so the checkpoint holds every parameter's full state once and loads into any layout."""
    state = {}
    for fqn, p in _zero1_owned(model, optimizer).items():
        if allocate:
            state[fqn] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)}
        else:
            state[fqn] = optimizer.optim.state[p]
    return {"state": state}


def _load_zero1_state(model: nn.Module, optimizer, loaded: dict) -> None:
    for fqn, p in _zero1_owned(model, optimizer).items():
        optimizer.optim.state[p] = loaded["state"][fqn]


def _app_state(model: nn.Module, optimizer: torch.optim.Optimizer, for_load: bool) -> dict:
    if is_zero1(optimizer):
        return {"model": get_model_state_dict(model), "optim": _zero1_state(model, optimizer, allocate=for_load)}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIM)}


class CheckpointManager:
    """Saves and loads checkpoints under `directory`; every method is collective over `control`."""

    def __init__(self, directory: Path, keep: int, control: Control, log: Callable[[str], None] = print,
                 resumes: bool = True):
        self.directory = directory
        self.resumes = resumes  # checkpoint.resume: what a failed save's line tells the user to rerun
        self.keep = keep
        self.control = control
        self.log = log
        # Steps this run wrote or resumed from: the only complete step_N a save may take as already done.
        self.written: set[int] = set()

    @property
    def rank(self) -> int:
        return self.control.rank

    def latest(self) -> Path | None:
        found = mf.complete_checkpoints(self.directory)
        return found[-1] if found else None

    # ---- save ----
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             extra_files: dict[str, Path], manifest: dict, rank_state: dict | None = None) -> tuple[Path, bool]:
        """(the checkpoint of `step`, whether this call wrote it): a step this run saved or resumed from is on
        disk already (a final save right after a periodic one, a run resumed at its last step, a stop just after
        a save), and is not written twice."""
        final = self.directory / mf.step_dir_name(step)
        if step in self.written and self.control.max([float(mf.is_complete(final))])[0]:
            return final, False
        # Anything else under that name is not this run's state (another trajectory's, or a checkpoint
        # that lost its manifest): set aside, never skipped over as if saved, never deleted.
        if self.rank == 0 and final.exists():
            why = "superseded" if mf.is_complete(final) else "corrupt"
            aside = mf.set_aside(final, why)
            self.log(f"checkpoint: {final} was not written by this run ({'complete' if why == 'superseded' else 'no manifest'})"
                     f"; set aside as {aside.name}")
        tmp = final.with_name(f"{final.name}.tmp")

        def start() -> None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
                tmp.mkdir(parents=True)
        self._on_every_rank(start, step, tmp)
        try:
            _dcp(dcp.save, _app_state(model, optimizer, for_load=False), tmp)
        except CheckpointException as e:
            # Every rank gets the same exception; whether it is the disk's fault, or memory's, is agreed
            # too (the free space one rank sees changes as soon as rank 0 removes the partial checkpoint).
            error, memory = _storage_error(e, self.directory), allocation_failure(e)
            storage, short = self.control.max([float(error is not None), float(memory is not None)])
            if storage:
                self._failed(error, step, tmp, report=self.rank == 0)
            self._remove_partial(tmp)  # never resumed (no manifest), and on a full disk its bytes count
            if not short:
                raise _rank_error(e, self.rank) from e
            raise SaveOutOfMemory(memory) from None

        def local_files() -> None:
            _write_rank_file(tmp, RNG, self.rank, _rng_state())
            if rank_state is not None:
                _write_rank_file(tmp, RANK_STATE, self.rank, rank_state)
            if self.rank == 0:
                (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
                for name, src in extra_files.items():
                    if src.is_file():
                        shutil.copyfile(src, tmp / name)
        self._on_every_rank(local_files, step, tmp)
        files = self._checksums(tmp, step)

        def publish() -> None:
            if self.rank == 0:
                mf.write_manifest(tmp, {**manifest, "format": mf.FORMAT, "step": step, "files": files,
                                        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                os.replace(tmp, final)
                mf.fsync_dir(self.directory)
        self._on_every_rank(publish, step, tmp)
        self.written.add(step)
        if self.rank == 0:
            self._prune()
        self.control.barrier()
        return final, True

    def _checksums(self, tmp: Path, step: int) -> dict[str, dict]:
        """{relative path: {size, sha256}} of every file in `tmp`; each rank hashes every world_size-th."""
        names = self.control.broadcast_json(mf.listed_files(tmp) if self.rank == 0 else None)
        rows = torch.zeros(len(names), 33, dtype=torch.int64)  # 32 digest bytes + the size

        def hash_share() -> None:
            for i in range(self.rank, len(names), self.control.world_size):
                size, digest = mf.file_digest(tmp / names[i])
                rows[i, :32] = torch.tensor(list(bytes.fromhex(digest)))
                rows[i, 32] = size
        self._on_every_rank(hash_share, step, tmp)
        rows = self.control.sum(rows)
        return {name: {"size": int(row[32]), "sha256": bytes(row[:32].tolist()).hex()} for name, row in zip(names, rows)}

    def _on_every_rank(self, action: Callable[[], None], step: int, tmp: Path) -> None:
        """Run a local write step on every rank; when it failed on any, fail the save everywhere."""
        error = None
        try:
            action()
        except OSError as e:
            error = e
        first = self.control.first_failure(error is not None)
        if first is not None:
            self._failed(error, step, tmp, report=self.rank == first)

    def _remove_partial(self, tmp: Path) -> None:
        """A failed save's partial checkpoint, removed by rank 0 (every rank wrote into the one directory)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _failed(self, error: OSError | None, step: int, tmp: Path, report: bool) -> None:
        self._remove_partial(tmp)
        what = f"{error.strerror or error}" + (f" ({error.filename})" if getattr(error, "filename", None) else "") \
            if error is not None else "failed on another rank"
        kept = remains_words(self.latest())
        raise StorageFailure(f"checkpoint: cannot write step {step} to {self.directory}: {what}; the partial "
                             f"checkpoint was removed and {kept}. Free space, then {rerun_to_resume(self.resumes)} "
                             "(a new checkpoint.dir resumes only once the checkpoints are copied there)", report=report)

    def _prune(self) -> None:
        mf.remove_leftovers(self.directory)
        for old in mf.to_prune(mf.complete_checkpoints(self.directory), self.keep):
            mf.remove(old)

    # ---- load ----
    def load_newest(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    accept: Callable[[Path, dict], bool] = lambda path, manifest: True) -> tuple[Path, dict] | None:
        """Load the newest intact checkpoint that `accept(path, manifest)` takes, a good one first (written
        after a finite step: one from a streak of skipped steps would bring the streak back); damaged
        and incomplete ones are set aside on the way, and the checkpoints after the one loaded too
        (.superseded: the resumed run writes those steps again). Returns (path, trainer state) or None."""
        if self.rank == 0:
            for path in mf.incomplete_checkpoints(self.directory):
                aside = mf.set_aside(path)
                self.log(f"checkpoint: {path} has no manifest (incomplete or damaged); set aside as {aside.name}")
            found = mf.complete_checkpoints(self.directory)
            good = [p for p in found if mf.is_good(p)]
            order = [p.name for p in reversed(good)] + [p.name for p in reversed(found) if p not in good]
        names = self.control.broadcast_json(order if self.rank == 0 else None)
        for name in names:
            path = self.directory / name
            manifest, problems = self._verify(path)
            if problems:
                if self.rank == 0:
                    aside = mf.set_aside(path)
                    self.log(f"checkpoint: {path} is damaged ({'; '.join(map(str, problems))}); set aside as "
                             f"{aside.name}, trying the previous one")
                self.control.barrier()
                continue
            if not accept(path, manifest):
                continue
            state = self._load(path, model, optimizer)
            self.written.add(mf.step_of(path))
            self._supersede_after(mf.step_of(path))
            return path, state
        if names and self.rank == 0:
            self.log(f"checkpoint: none of the {len(names)} checkpoint(s) in {self.directory} could be resumed; "
                     "training starts from step 0")
        return None

    def set_aside_from(self, step: int, why: str) -> list[Path]:
        """On rank 0 (the others get []): rename every complete checkpoint of `step` or later to
        step_N.<why> (mf.set_aside); returns the checkpoints it renamed, by their old paths."""
        if self.rank != 0:
            return []
        later = [p for p in mf.complete_checkpoints(self.directory) if mf.step_of(p) >= step]
        for path in later:
            mf.set_aside(path, why)
        return later

    def _supersede_after(self, step: int) -> None:
        """Set aside (.superseded) every checkpoint after `step`: the resumed run writes those steps anew."""
        later = self.set_aside_from(step + 1, "superseded")
        if later:
            self.log(f"checkpoint: resuming from step {step}; the later checkpoint(s) of steps "
                     f"{', '.join(str(mf.step_of(p)) for p in later)} were set aside as step_N.superseded")
        self.control.barrier()

    def _verify(self, path: Path) -> tuple[dict, list[mf.Problem]]:
        """(manifest, problems) agreed by every rank; legacy checkpoints (no manifest) are not verified."""
        if not (path / mf.MANIFEST).is_file() and (path / mf.LEGACY_MARKER).is_file():
            if self.rank == 0:
                self.log(f"checkpoint: {path} predates manifests; loading it unverified")
            return {}, []
        local_problem = None
        try:
            manifest = mf.read_manifest(path)
        except ValueError as e:
            manifest, local_problem = {"files": {}}, e.args[0]
        if self.control.max([float(local_problem is not None)])[0]:
            return manifest, [local_problem or mf.Problem(mf.MANIFEST, "unreadable on another rank")]
        names = sorted(manifest["files"])
        codes = [0.0] * (len(names) + 1)
        details: dict[int, str] = {}
        for i in range(self.rank, len(names), self.control.world_size):
            reason = mf.check_file(path, names[i], manifest["files"][names[i]])
            if reason is not None:
                codes[i] = 1.0 if reason == "missing" else 2.0 if reason.startswith("size") else \
                    3.0 if reason.startswith("checksum") else 4.0
                details[i] = reason
        if self.rank == 0 and ".metadata" in manifest["files"]:
            reason = metadata_problem(path)
            if reason is not None:
                codes[-1], details[len(names)] = 5.0, reason
        # This rank's own files (RNG, rank_state), as loading will read them: a file can match its
        # checksum and still not load (a crafted pickle with a manifest to match, a wrong structure).
        own = rank_file_problem(path, self.rank)
        codes.append(6.0 if own is not None else 0.0)
        agreed = self.control.max(codes)
        problems = [mf.Problem(names[i] if i < len(names) else ".metadata", details.get(i, _REASONS[int(c)]))
                    for i, c in enumerate(agreed[:-1]) if c]
        if agreed[-1]:
            problems.append(mf.Problem(f"{RNG}/ or {RANK_STATE}/",
                                       own or "a rank's file does not load safely (`shardwise checkpoint verify` names it)"))
        return manifest, problems

    def _load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Load model + optimizer in place; return the trainer state (step, scheduler, ...)."""
        state = _app_state(model, optimizer, for_load=True)
        _dcp(dcp.load, state, path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        set_model_state_dict(model, state["model"])
        if is_zero1(optimizer):
            _load_zero1_state(model, optimizer, state["optim"])
        else:
            set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT_OPTIM)
        rng = _read_rank_file(path, RNG, self.rank)
        if rng is not None:
            _set_rng_state(rng)
        return json.loads((path / TRAINER_STATE).read_text())


def _write_rank_file(directory: Path, kind: str, rank: int, state: dict) -> None:
    """`state` (tensors, ints, strings) as <directory>/<kind>/rank_<rank>.pt."""
    buf = io.BytesIO()
    torch.save(state, buf)
    (directory / kind).mkdir(exist_ok=True)
    (directory / kind / f"rank_{rank}.pt").write_bytes(buf.getvalue())


def _read_rank_file(path: Path, kind: str, rank: int) -> dict | None:
    """What _write_rank_file wrote for `rank` in checkpoint `path` (verified with the rest before
    loading), through the weights-only unpickler; None if it has no such file."""
    file = path / kind / f"rank_{rank}.pt"
    return torch.load(file, weights_only=True) if file.is_file() else None


def rank_file_problem(path: Path, rank: int) -> str | None:
    """None when `rank`'s RNG and rank_state files in checkpoint `path` load (weights only) and the RNG
    one has the state resuming sets; else why not."""
    try:
        rng = _read_rank_file(path, RNG, rank)
        if rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor)):
            return f"{RNG}/rank_{rank}.pt: not an RNG state"
        state = _read_rank_file(path, RANK_STATE, rank)
        if state is not None and not isinstance(state, dict):
            return f"{RANK_STATE}/rank_{rank}.pt: not a rank state"
    except Exception as e:  # any way of failing to load it is a reason not to resume from it
        if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e):
            # torch's own text goes on to advise re-running torch.load with weights_only=False: the unsafe thing.
            return (f"rank {rank}'s files hold Python objects other than tensors and plain data: refused, since "
                    "loading them could run code (a checkpoint shardwise writes never holds any)")
        return f"rank {rank}'s files: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def read_rank_state(path: Path, rank: int) -> dict | None:
    """This rank's rank_state file of checkpoint `path` (gradient compression's state), or None."""
    return _read_rank_file(path, RANK_STATE, rank)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_model_weights(path: Path, model: nn.Module) -> None:
    """A checkpoint's weights only (no optimizer or trainer state) into `model`, whatever its layout:
    DCP reads each rank's part of every tensor (generation, infer/engine.py)."""
    state = {"model": get_model_state_dict(model)}
    _dcp(dcp.load, state, path, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    set_model_state_dict(model, state["model"])


def verify_directory(root: Path) -> list[tuple[Path, str, list[mf.Problem]]]:
    """(path, status, problems) for every checkpoint under `root` (a run directory, a checkpoints
    directory or one checkpoint). Status: OK, DAMAGED, UNVERIFIED (no manifest: written before
    manifests), INCOMPLETE (a save that did not finish), SET ASIDE (found damaged earlier)."""
    if (root / mf.MANIFEST).is_file() or (root / mf.LEGACY_MARKER).is_file():
        targets = [root]
    else:
        base = root if any(root.glob("step_*")) else root / "checkpoints"
        targets = sorted((p for p in base.glob("step_*") if p.is_dir()), key=lambda p: (p.name.split(".")[0], p.name))
    out = []
    for path in targets:
        suffix = path.name.partition(".")[2]
        if suffix.startswith("corrupt"):
            out.append((path, "SET ASIDE (found damaged earlier; never loaded)", []))
        elif suffix.startswith("superseded"):
            out.append((path, "SET ASIDE (another trajectory's: a fresh start or a resume from an earlier step; "
                              "never loaded)", []))
        elif suffix:
            out.append((path, "INCOMPLETE (a save that did not finish; never loaded, removed by the next save)", []))
        elif (path / mf.MANIFEST).is_file():
            try:
                manifest = mf.read_manifest(path)
                problems = mf.verify_files(path, manifest)
                reason = metadata_problem(path) if ".metadata" in manifest["files"] else None
                if reason is not None:
                    problems.append(mf.Problem(".metadata", reason))
                ranks = {int(n.rsplit("_", 1)[1].split(".")[0]) for n in manifest["files"]
                         if n.startswith((f"{RNG}/rank_", f"{RANK_STATE}/rank_"))}
                if not problems:  # files as written: do they also load?
                    problems += [mf.Problem(f"{RNG}/ or {RANK_STATE}/", why) for r in sorted(ranks)
                                 if (why := rank_file_problem(path, r)) is not None]
            except ValueError as e:
                problems = [e.args[0]]
            out.append((path, "DAMAGED" if problems else "OK", problems))
        elif (path / mf.LEGACY_MARKER).is_file():
            out.append((path, "UNVERIFIED (no manifest: written before manifests)", []))
        else:
            out.append((path, "DAMAGED", [mf.Problem(mf.MANIFEST, "missing (the checkpoint is incomplete; the next run "
                                                                  "sets it aside and resumes from an earlier one)")]))
    return out
