"""Run N local worker processes through torch's own elastic launcher, exactly as `torchrun` would."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from shardwise.errors import ConfigError


def torchrun(nproc: int, module: str, module_args: list[str], log_dir: Path | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m MODULE ARGS...` in this process; returns an exit code.

    --standalone picks a free rendezvous port on localhost, so concurrent launches never collide.
    """
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Split the cores between the workers (torchrun would pick 1 and warn); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    argv = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}"]
    argv += ["-m", module, *module_args]
    try:
        torch_run.run(torch_run.get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        failures = "; ".join(f"rank {rank}: exit {f.exitcode}" for rank, f in sorted(e.failures.items()))
        print(f"error: worker processes failed ({failures})", file=sys.stderr)
        return 1
    return 0


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}", "pass --nproc 1 or more")
