"""Worker entry point: `torchrun --nproc_per_node N -m shardwise.train --config FILE.toml [--a.b=c ...]`,
or `mpirun -np N python -m shardwise.train ...` / `srun python -m shardwise.train ...` (ranks from the
launcher's own variables: train/distributed.py rank_env).

Under torchrun (RANK / WORLD_SIZE set by it) this joins the process group — NCCL when CUDA is
present, gloo otherwise (train/distributed.py, shared with the parity worker) — and trains; without
them it trains on one process.

What a worker guarantees (docs/run-safety.md): it dies with its launcher; a stop signal ends it after
a step and a checkpoint (exit 130 / 143); a failure every rank agrees on is printed once, by rank 0,
with its exit code (2 bad input, 3 diverged, 4 I/O); a stalled collective is diagnosed (exit 5); any
other error writes its traceback to <run.dir>/errors/rank_<r>.txt, records itself for the launcher
(torchelastic's error file: the launcher prints the root cause among the failed ranks) and exits 1.
Failure paths leave through os._exit: a process group that lost a peer cannot be torn down cleanly,
and its C++ destructors could abort the process.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from shardwise.train.distributed import (
    RESTART_COUNT,
    RUN_ID,
    agreed_attempt,
    finish_distributed,
    init_distributed,
    launcher,
    leave,
)
from shardwise.train.signals import StopRequest, exit_with_parent

# Seconds a rank that only lost a peer waits before it fails, when the agent will restart the group.
LOST_PEER_GRACE_S = 2.0


def _say(text: str, prefix: str = "error: ") -> None:
    print(f"{prefix}{text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    # Started by torchrun's agent, mpirun (or its orted) or srun: die with it (not with a shell that ran us
    # directly); a SIGKILLed mpirun would otherwise leave its local ranks training.
    if RUN_ID in os.environ or launcher(os.environ) != "single":
        exit_with_parent()
    stop = StopRequest().install()  # from here on a signal waits for the end of a step
    parser = argparse.ArgumentParser(prog="python -m shardwise.train")
    parser.add_argument("--config", default=None, help="TOML config file")
    # Given by `shardwise train --nnodes MIN:MAX` when run.evict_stragglers is on (train/eviction.py).
    parser.add_argument("--node-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--min-nodes", type=int, default=None, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    from shardwise.config import load_config
    from shardwise.errors import ConfigError

    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        _say(e.render())
        return 2
    from shardwise.train import rundir

    run_dir = Path(cfg.run.dir)
    run_id, attempt = os.environ.get(RUN_ID, ""), int(os.environ.get(RESTART_COUNT, "0"))
    if attempt:
        earlier = rundir.unrestartable_failure(run_dir, run_id)
        if earlier is not None:  # the elastic agent restarted a failure a restart cannot fix: end at once
            if os.environ.get("RANK", "0") == "0":
                print(f"restart {attempt}: not training again: this job failed with exit code {earlier}, "
                      "which a restart cannot fix", flush=True)
                rundir.say_unrestartable(run_dir, run_id, attempt)
            else:  # the first worker to exit stops the others: not before rank 0 has said why
                rundir.wait_until_said(run_dir, run_id, attempt)
            return earlier
    try:
        distributed = init_distributed(cfg.run.collective_timeout_s, cfg.run.backend)
    except ConfigError as e:  # the launcher's variables or the visible GPUs (train/distributed.py), before any rendezvous
        _say(e.render())
        return 2
    from shardwise.train.eviction import NodeSeat

    seat = NodeSeat(args.node_rank, args.min_nodes, cfg.run.evict_cooldown_s) if args.node_rank is not None else None
    code = _run(cfg, run_dir, stop, run_id, attempt, distributed, seat)
    if code or distributed:
        leave(code)
    return code


def _run(cfg, run_dir: Path, stop: StopRequest, run_id: str, attempt: int, distributed: bool, seat=None) -> int:
    import torch.distributed as dist

    from shardwise.errors import EXIT_STALLED, ConfigError, Interrupted, RunFailure, lost_peer, storage_failure
    from shardwise.train import rundir
    from shardwise.train.agreement import SetupMismatch
    from shardwise.train.data import prepare_data
    from shardwise.train.out_of_memory import building_the_trainer
    from shardwise.train.trainer import Trainer
    from shardwise.train.watchdog import StallWatchdog, is_timeout

    rank = dist.get_rank() if distributed else 0
    if distributed:
        attempt = agreed_attempt(attempt)
    # The group before this one stopped after a step and recorded where (record_interruption), and the agent
    # started this one: a node left or joined (torch's agent re-forms the group without counting a restart).
    reformed = rank == 0 and run_id and rundir.take_interruption(run_dir, run_id) is not None
    if (attempt or reformed) and rank == 0:
        world = f", now {dist.get_world_size()} processes" if distributed else ""
        what = (f"restart {attempt} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: the worker group was restarted "
                "after a failure or a change of nodes") if attempt else "the worker group was re-formed for a change of nodes"
        print(f"{what}{world}; resuming from the newest intact checkpoint", flush=True)
    watchdog = StallWatchdog(run_dir, rank, dist.get_world_size(), f"{run_id}/{attempt}") \
        if distributed and "MASTER_ADDR" in os.environ else None
    lock = None
    try:
        if rank == 0:  # plain torchrun: the launcher did not lock the run directory for us
            lock = rundir.lock_unless_parent_holds(cfg)
            if lock.own:  # no shardwise launcher (plain torchrun): do what `shardwise train` does first
                note = rundir.supersede_previous_run(cfg) if not cfg.checkpoint.resume and attempt == 0 else None
                if note:
                    print(note, flush=True)
                rundir.save_config(cfg)
        # Rank 0 trains and caches the tokenizer and token array; the others then hit the cache. They
        # wait on the store, not in a collective: a first tokenization may outlast collective_timeout_s.
        # Under `shardwise train` the launcher printed the data line already (print it once per run).
        quiet_data = lock is None or not lock.own
        data = prepare_data(cfg.data, cfg.model.vocab_size, log=(lambda _: None) if quiet_data else print) \
            if rank == 0 else None
        if watchdog is not None:
            watchdog.wait_for_rank0("data")
        elif distributed:
            dist.barrier()
        with building_the_trainer(cfg, rank, dist.get_world_size() if distributed else 1, run_dir, run_id):
            trainer = Trainer(cfg, data=data, stop=stop, run_id=run_id, restarted=attempt > 0, seat=seat)
        if watchdog is not None:
            watchdog.step, watchdog.axes = (lambda: trainer.step), (lambda: trainer.group_axes)
        trainer.train()
    except ConfigError as e:
        # Ranks that disagree on their config: every node says so (its own log is often read alone).
        if rank == 0 or (isinstance(e, SetupMismatch) and os.environ.get("LOCAL_RANK", "0") == "0"):
            _say(e.render())
            rundir.record_unrestartable_failure(run_dir, run_id, e.exit_code)
        return e.exit_code
    except RunFailure as e:
        if e.report and isinstance(e, Interrupted) and lock is not None and not lock.own:
            # Under shardwise's launcher: it prints this if the job ends; a re-formed group goes on (rundir.py).
            rundir.record_interruption(run_dir, run_id, e.message)
        elif e.report:
            _say(e.message, "" if isinstance(e, Interrupted) else "error: ")
        if rank == 0 and e.exit_code in rundir.NOT_RESTARTABLE:
            rundir.record_unrestartable_failure(run_dir, run_id, e.exit_code)
        return e.exit_code
    except Exception as e:
        # A full or read-only disk: exit 4. Any other OS error (a peer's or a loader worker's broken
        # pipe) is a crash like any exception below; re-raised from its own clause, it escaped as a
        # traceback in the terminal instead (a CI run's ConnectionResetError).
        failure = storage_failure(e, resumes=cfg.checkpoint.resume, directory=cfg.run.dir) if isinstance(e, OSError) else None
        if failure is not None:
            _say(failure.message)
            if rank == 0:
                rundir.record_unrestartable_failure(run_dir, run_id, failure.exit_code)
            return failure.exit_code
        if watchdog is not None and is_timeout(e):
            report = watchdog.report(e)
            if report and attempt < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
                # The agent restarts the group: a run that then succeeds must not end with an error line.
                print(f"{report}; the worker group restarts (restart {attempt + 1})", flush=True)
            elif report:
                _say(report)
            return EXIT_STALLED
        if lost_peer(str(e)) and attempt < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
            # Only a consequence of another rank's death. The agent's restart line names the failure it
            # saw first (torchelastic: the earliest timestamp, in whole seconds): give the real one that
            # time (a CI run named this rank instead of its SIGKILLed peer once the loss-curve plot no longer
            # delayed its exit).
            time.sleep(LOST_PEER_GRACE_S)
        written = rundir.record_crash(run_dir, rank, e)  # the launcher names the root cause among the failed ranks
        if not distributed:  # no launcher to say it: this process does
            _say(rundir.crash_line(cfg, e, written))
        return 1
    finally:
        if lock is not None:
            lock.release()
    if watchdog is not None:
        watchdog.close()
    if distributed:
        finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
