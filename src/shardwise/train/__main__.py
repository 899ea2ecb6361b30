"""Worker entry point: `torchrun --nproc_per_node N -m shardwise.train --config FILE.toml [--a.b=c ...]`.

Under torchrun (RANK / WORLD_SIZE set by it) this joins the process group — NCCL when CUDA is
present, gloo otherwise — and trains; without them it trains on one process.
"""
from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.config import load_config
from shardwise.errors import ConfigError


def init_distributed(timeout_s: float = 600) -> bool:
    """Join the default process group when launched by torchrun; return whether we did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.train")
    parser.add_argument("--config", default=None, help="TOML config file")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return 2
    from shardwise.train.data import prepare_data
    from shardwise.train.trainer import Trainer

    distributed = init_distributed()
    try:
        try:
            # Rank 0 trains and caches the tokenizer and token array; the others then hit the cache.
            data = None
            if not distributed or dist.get_rank() == 0:
                data = prepare_data(cfg.data, cfg.model.vocab_size)
            if distributed:
                dist.barrier()
            trainer = Trainer(cfg, data=data)
        except ConfigError as e:
            print(f"error: {e.render()}", file=sys.stderr)
            return 2
        trainer.train()
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
