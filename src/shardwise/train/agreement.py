"""Every rank of a job trains the same config on the same data: checked once, when the ranks start.

Each node of a multi-node job (and each process mpirun or srun starts) reads its own config file and
command line, so nothing made them agree. Measured on two nodes (network namespaces, 2026-11-27): node 1
started with another --train.lr trained 4 steps with exit 0, its ZeRO-3 shards updated at its own
learning rate (a model no single config describes); node 1 with another --model.n_layers hung in the
first collective for run.collective_timeout_s and node 0 then reported a stall that blamed node 1 for
not responding (exit 5, 10 minutes at the default timeout).

Here every rank hashes what it is about to train (the resolved config, and the corpus and tokenizer it
loaded) and the ranks all-gather the digests on the trainer's control channel (gloo, CPU): two tiny
collectives when they agree. When they do not, they exchange the facts themselves (JSON, nothing is
unpickled) so every rank names the same keys, values and ranks, and the job ends with exit 2 before any
weight is built.
"""
from __future__ import annotations

import hashlib
import json
import socket
from typing import Any

from shardwise.config import dotted
from shardwise.errors import ConfigError

# Paths: each machine may hold the same files under other paths (a shared file system mounted
# elsewhere, a local copy of the corpus), so they are not compared; what they hold is (data.tokens,
# data.tokens_sha256, data.tokenizer_sha256, and the model's resolved shape for model.init_from).
NODE_LOCAL = frozenset({"data.path", "data.tokenizer", "data.cache_dir", "model.init_from", "checkpoint.dir",
                        "run.dir", "parallel.offload_dir", "cluster.calibration"})
# Differing keys named in the error beyond the first, whose values it shows.
MORE_KEYS_SHOWN = 5


class SetupMismatch(ConfigError):
    """Ranks of one job started with different settings or data. Every rank raises the same error, and
    each node prints it (a node's output is often read on its own: a SLURM log per node)."""


def setup_facts(cfg, num_tokens: int, tokens_sha256: str, tokenizer_sha256: str, valid_sha256: str = "") -> dict[str, Any]:
    """What this rank will train, flattened to {"train.lr": 3e-4, ...}: the resolved config without the
    node-local paths, and the data it loaded (its token count and the digests of the token array and
    of the tokenizer, train/data.py PreparedData)."""
    facts = {key: value for key, value in dotted(cfg.to_dict()).items() if key not in NODE_LOCAL}
    # A mixture's sources without their paths (node-local like data.path); their data is in the digest.
    for key in ("data.sources", "data.valid"):
        facts[key] = [{k: v for k, v in entry.items() if k != "path"} for entry in facts.get(key, [])]
    facts.update({"data.tokens": num_tokens, "data.tokens_sha256": tokens_sha256, "data.tokenizer_sha256": tokenizer_sha256,
                  "data.valid_sha256": valid_sha256})
    return facts


def check_same_setup(facts: dict[str, Any], control) -> None:
    """Raises SetupMismatch on every rank unless all ranks hold the same `facts`, compared on the trainer's
    control channel (train/control.py): the digests first, the facts only when those differ."""
    digests = control.all_gather_json(hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    records = control.all_gather_json({"host": socket.gethostname(), "facts": facts})  # in config order
    raise mismatch([r["facts"] for r in records], [r["host"] for r in records])


def mismatch(facts_per_rank: list[dict[str, Any]], hosts: list[str]) -> SetupMismatch:
    """The error for ranks whose facts differ: the first differing key with its value on each group of
    ranks that agree (rank 0's group first), and the names of the others."""
    groups: dict[str, list[int]] = {}
    for rank, facts in enumerate(facts_per_rank):
        groups.setdefault(json.dumps(facts, sort_keys=True, default=str), []).append(rank)
    members = list(groups.values())
    keys = list(dict.fromkeys(k for facts in facts_per_rank for k in facts))  # the config's order, then the data's
    differing = [k for k in keys if len({json.dumps(facts_per_rank[m[0]].get(k), default=str) for m in members}) > 1]
    first = differing[0]
    values = ", ".join(f"{_value(first, facts_per_rank[m[0]].get(first))} on {_ranks(m)} ({_hosts(m, hosts)})" for m in members)
    more = differing[1:]
    also = ""
    if more:
        shown = ", ".join(more[:MORE_KEYS_SHOWN]) + (f" and {len(more) - MORE_KEYS_SHOWN} more" if len(more) > MORE_KEYS_SHOWN else "")
        also = f"; also {shown}"
    return SetupMismatch(first, f"the ranks of this job were started with different settings: {values}{also}",
                         "start every node with the same config file and the same --a.b=c overrides, and the same "
                         "corpus and tokenizer, then rerun every node; no step was taken")


def _value(key: str, value: Any) -> str:
    if key.endswith("_sha256") and isinstance(value, str):
        return f"sha256 {value[:12]}"  # enough to tell two digests apart
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _hosts(ranks: list[int], hosts: list[str]) -> str:
    names = list(dict.fromkeys(hosts[r] for r in ranks))
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more hosts" if len(names) > 2 else "")
