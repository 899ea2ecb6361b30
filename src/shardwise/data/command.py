"""`shardwise data prepare`: tokenize a corpus (or every source of a mixture) into token shards under
data.cache_dir, where `shardwise train` with the same [data] and model.vocab_size keys finds them."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from shardwise.config import load_config
from shardwise.errors import ConfigError

USAGE = "shardwise data prepare [--config FILE.toml] [--workers N] [--data.path=...] [--section.key=value ...]"


def data_main(argv: list[str]) -> int:
    if not argv or argv[0] != "prepare":
        raise ConfigError("data", f"expected 'prepare', got {argv[0] if argv else 'nothing'!r}", f"run `{USAGE}`")
    parser = argparse.ArgumentParser(
        prog="shardwise data prepare", usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize the corpus of data.path (or every [[data.sources]] entry) into token shards under "
                    "data.cache_dir, in parallel and resumably: a rerun after a kill, Ctrl-C or a full disk finishes "
                    "what is missing. `shardwise train` with the same data.* and model.vocab_size keys uses them.",
        epilog="config overrides: any config key, after the file (e.g. --data.path=corpus/ --model.vocab_size=32000)")
    parser.add_argument("--config", default=None, help="TOML config file (its [data] and [model] sections are read)")
    parser.add_argument("--workers", type=int, default=0, help="processes that tokenize (default: data.prepare_workers, "
                        "0 = one per core)")
    args, overrides = parser.parse_known_args(argv[1:])
    if args.workers < 0:
        raise ConfigError("--workers", f"must be >= 0, got {args.workers}", "give a number of processes, or 0 for one per core")
    cfg = load_config(args.config, overrides)
    from shardwise.data.sources import prepare_data
    from shardwise.paths import writable_dir

    writable_dir(Path(os.path.expanduser(cfg.data.cache_dir)), "data.cache_dir")
    data = prepare_data(cfg.data, cfg.model.vocab_size, workers=args.workers, refuse_changed=False)
    if len(data.sources) > 1:
        print(f"data: a mixture of {len(data.sources)} sources, {data.num_tokens / 1e6:,.1f}M tokens in all; "
              f"tokenizer {data.tokenizer_path}")
    return 0
