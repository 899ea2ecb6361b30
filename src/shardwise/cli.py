"""`shardwise train | parity | config` — the command line.

Every input error surfaces here as a ConfigError before any process is spawned: printed without a
traceback, exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.config import Config, describe, load_config
from shardwise.errors import ConfigError

USAGE = """shardwise <command> [options]

commands:
  train    --config FILE.toml [--nproc N] [--section.key=value ...]   train (N local processes)
  parity   --nproc N --layout k=v,k=v [--layout ...] [--steps 20] [--config FILE.toml] [--section.key=value ...]
           compare layouts with the single-process reference
  config   [--config FILE.toml] [--section.key=value ...] [--keys]     print the resolved config (or every key)
"""


def _train(argv: list[str]) -> int:
    from shardwise.launch.local import check_nproc, torchrun
    from shardwise.preflight import check
    from shardwise.train.data import prepare_data

    parser = argparse.ArgumentParser(prog="shardwise train")
    parser.add_argument("--config", default=None, help="TOML config file (default: built-in defaults)")
    parser.add_argument("--nproc", type=int, default=1, help="local processes to launch")
    args, overrides = parser.parse_known_args(argv)
    check_nproc(args.nproc)
    cfg = load_config(args.config, overrides)
    check(cfg, args.nproc)
    data = prepare_data(cfg.data, cfg.model.vocab_size)  # data errors surface before spawning; ranks hit the cache
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.toml")
    print(f"run directory: {run_dir}  (config: {run_dir / 'config.toml'})")
    if args.nproc == 1:
        from shardwise.train.trainer import Trainer

        Trainer(cfg, data=data).train()
        return 0
    return torchrun(args.nproc, "shardwise.train", ["--config", str(run_dir / "config.toml")])


def _config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise config")
    parser.add_argument("--config", default=None)
    parser.add_argument("--keys", action="store_true", help="list every key with its documentation")
    args, overrides = parser.parse_known_args(argv)
    if args.keys:
        print(describe())
        return 0
    cfg: Config = load_config(args.config, overrides)
    print(cfg.to_toml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    commands = {"train": _train, "config": _config}
    from shardwise.parity import parity_main

    commands["parity"] = parity_main
    if command not in commands:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
