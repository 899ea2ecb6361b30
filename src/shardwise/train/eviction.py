"""Evict a straggler's node from an elastic job (run.evict_stragglers), and keep it out for a cool-down.

A slow node costs every rank every step (train/straggler.py names it). In an elastic job (`--nnodes MIN:MAX`)
the job can go on without it, as it does without a node drained by SIGTERM: every rank checkpoints the same
step, the evicted node's agent ends, and the other nodes' agents restart their workers, which re-form on the
nodes left and resume from that checkpoint with the same global batch (dp_shard=-1 absorbs the change).

How the ranks agree without another collective: every rank already receives every rank's window medians
(StragglerWatch's all-gather), so each rank runs the same verdict on the same numbers and reaches the same
decision at the same step. The evicted node's local rank 0 then writes the eviction record and sends SIGTERM
to its own agent (its parent process, `shardwise train`'s torchrun) *before* the checkpoint: the agent stops
instead of restarting its workers when they exit, waits for them to finish the save (torchrun's shutdown
grace), and says `evicted: ...` with exit code 8 (launch/local.py).

Which node: the lowest-numbered node other than node 0 holding a newly named straggler, one node per window,
and only while at least MIN nodes would remain. Node 0 is never evicted: its agent serves the rendezvous
store the others re-form through (launch/rendezvous.py). A node is known by the `--node-rank` its launcher
was given (a replacement machine started with the same rank is a new node) and its host name; the record
`<run.dir>/evicted/node_<K>.json` refuses that host and rank at `shardwise train` for run.evict_cooldown_s.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeSeat:
    """Where this rank's node sits in an elastic job, as its launcher knows it (worker arguments
    --node-rank / --min-nodes, given by `shardwise train --nnodes MIN:MAX` when run.evict_stragglers is on)."""

    node_rank: int
    min_nodes: int
    cooldown_s: float


@dataclass(frozen=True)
class Eviction:
    """A decision every rank reaches alike: `node` leaves after `step`'s checkpoint."""

    node: int
    host: str
    step: int
    reason: str  # the straggler line that named it


def choose(fresh: list[int], nodes: list[int], hosts: list[str], min_nodes: int, step: int,
           lines: dict[int, str]) -> tuple[Eviction | None, str | None]:
    """The node to evict among the newly named ranks `fresh` (nodes[r]: rank r's node), and a line when one
    was named but cannot be evicted. Pure: every rank computes the same from the same inputs."""
    named = sorted({nodes[r] for r in fresh})
    if not named:
        return None, None
    candidates = [n for n in named if n != 0]
    if not candidates:
        return None, ("straggler eviction: not evicting node 0 (host " + hosts[fresh[0]] + "): it serves the job's "
                      "rendezvous; drain it by hand (SIGTERM to its `shardwise train`) if the job must go on without it")
    left = len(set(nodes)) - 1
    if left < min_nodes:
        return None, (f"straggler eviction: not evicting node {candidates[0]}: {left} node{'s' * (left != 1)} would "
                      f"remain, fewer than the job's minimum ({min_nodes}, --nnodes {min_nodes}:MAX)")
    node = candidates[0]
    first = next(r for r in fresh if nodes[r] == node)
    return Eviction(node, hosts[first], step, lines.get(first, "")), None


def announce(e: Eviction, nodes_now: int, cooldown_s: float) -> str:
    others = "the other node goes" if nodes_now == 2 else f"the other {nodes_now - 1} nodes go"
    return (f"straggler eviction: node {e.node} (host {e.host}) leaves the job after step {e.step}'s checkpoint; "
            f"{others} on from it with the same global batch; node {e.node} is refused for run.evict_cooldown_s = "
            f"{cooldown_s:g} s")


def _record_path(run_dir: Path, node: int) -> Path:
    return Path(run_dir) / "evicted" / f"node_{node}.json"


def record(run_dir: Path, e: Eviction, cooldown_s: float) -> None:
    """Written by the evicted node's local rank 0 before it stops its agent (atomically: the agent reads it)."""
    path = _record_path(run_dir, e.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"node": e.node, "host": e.host, "step": e.step, "at": now, "until": now + cooldown_s,
                               "reason": e.reason}))
    os.replace(tmp, path)


def stop_my_agent() -> None:
    """SIGTERM to this worker's parent, torchrun's agent inside `shardwise train` (module docstring)."""
    import signal

    os.kill(os.getppid(), signal.SIGTERM)


def read(run_dir: Path, node: int) -> dict | None:
    try:
        return json.loads(_record_path(run_dir, node).read_text())
    except (OSError, ValueError):
        return None


def left_line(run_dir: Path, node: int) -> str | None:
    """The evicted agent's line, when the SIGTERM that stopped it came from its own rank's eviction (the record is
    newer than a minute: an older one belongs to an earlier eviction of this node, not this stop)."""
    r = read(run_dir, node)
    if r is None or time.time() - float(r.get("at", 0)) > 60:
        return None
    return (f"evicted: node {node} (host {r['host']}) left the job after step {r['step']}'s checkpoint as a straggler "
            f"({r['reason'].removeprefix('straggler: ')}); the job goes on with the other nodes; this node may join "
            f"again after {_clock(r['until'])} (run.evict_cooldown_s)")


def refusal(run_dir: Path, node: int, host: str | None = None) -> str | None:
    """Why `shardwise train --node-rank K` may not join now: this host and node were evicted and the cool-down
    has not passed. None when it may."""
    r = read(run_dir, node)
    host = host or socket.gethostname()
    if r is None or r.get("host") != host or time.time() >= float(r.get("until", 0)):
        return None
    return (f"node {node} (host {host}) was evicted from this run as a straggler after step {r['step']}; it may join "
            f"again after {_clock(r['until'])} (run.evict_cooldown_s): start a replacement node, or remove "
            f"{_record_path(run_dir, node)} to let this one join now")


def count(run_dir: Path) -> int:
    """Evictions recorded in this run directory (the run's summary)."""
    return len(list((Path(run_dir) / "evicted").glob("node_*.json")))


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(when)))
