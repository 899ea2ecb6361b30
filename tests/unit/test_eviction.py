"""Evicting a straggler's node (run.evict_stragglers, train/eviction.py): which node every rank decides to evict
from the same window, when none may be, the record that keeps the node out for its cool-down, and the
settings refused before anything starts. The eviction itself, for real: tests/dist/test_eviction.py."""
from __future__ import annotations

import json
import time

import pytest
import torch

from shardwise.train import eviction
from shardwise.train.eviction import NodeSeat
from shardwise.train.straggler import RankTimes, StragglerWatch


def _watch(rank: int, node: int, nodes: list[int], min_nodes: int = 1) -> StragglerWatch:
    watch = StragglerWatch(1, 0.2, 2, rank=rank, group=None, device=torch.device("cpu"),
                           seat=NodeSeat(node, min_nodes, 600.0))
    watch._hosts, watch._nodes = [f"h{n}" for n in nodes], nodes  # what the first window's gather brings
    return watch


def _window(compute: list[float]) -> list[RankTimes]:
    return [RankTimes(r, f"h{r // 2}", c, 0.0, 1.0) for r, c in enumerate(compute)]


NODES = [0, 0, 1, 1, 2, 2]  # three nodes of two ranks


def test_every_rank_decides_the_same_eviction_at_the_same_step():
    slow = _window([0.01, 0.01, 0.01, 0.03, 0.01, 0.01])  # rank 3, on node 1: 3x the others
    watches = [_watch(rank, NODES[rank], NODES) for rank in range(6)]
    for step in (1, 2):
        lines = [w.judge(slow, step, 1)[1] for w in watches]
    assert all(w.eviction == watches[0].eviction for w in watches)
    decided = watches[0].eviction
    assert (decided.node, decided.host, decided.step) == (1, "h1", 2)
    assert decided.reason.startswith("straggler: rank 3 on host h1 (cpu): compute 3.00x")
    assert lines[0][-1].startswith("straggler eviction: node 1 (host h1) leaves the job after step 2's checkpoint; "
                                   "the other 2 nodes go on")
    assert watches[0].judge(slow, 3, 1)[1] == [] and watches[0].eviction == decided  # decided once


def test_node_0_is_never_evicted_and_the_minimum_is_kept():
    slow0 = _window([0.03, 0.01, 0.01, 0.01, 0.01, 0.01])
    watch = _watch(0, 0, NODES)
    watch.judge(slow0, 1, 1)
    lines = watch.judge(slow0, 2, 1)[1]
    assert watch.eviction is None and "not evicting node 0" in lines[-1] and "rendezvous" in lines[-1]
    watch = _watch(0, 0, NODES, min_nodes=3)
    slow = _window([0.01, 0.01, 0.03, 0.01, 0.01, 0.01])
    watch.judge(slow, 1, 1)
    lines = watch.judge(slow, 2, 1)[1]
    assert watch.eviction is None and lines[-1] == ("straggler eviction: not evicting node 1: 2 nodes would remain, "
                                                   "fewer than the job's minimum (3, --nnodes 3:MAX)")


def test_without_eviction_a_straggler_is_only_named():
    watch = StragglerWatch(1, 0.2, 2, rank=0, group=None, device=torch.device("cpu"))
    slow = _window([0.01, 0.01, 0.03, 0.01])
    watch.judge(slow, 1, 1)
    lines = watch.judge(slow, 2, 1)[1]
    assert len(lines) == 1 and watch.eviction is None


def test_the_record_refuses_that_host_and_node_for_the_cool_down_only(tmp_path):
    decided = eviction.Eviction(1, "h1", 40, "straggler: rank 3 on host h1 (cpu): compute 3.00x ...")
    assert eviction.refusal(tmp_path, 1, "h1") is None and eviction.count(tmp_path) == 0
    eviction.record(tmp_path, decided, cooldown_s=600)
    refused = eviction.refusal(tmp_path, 1, "h1")
    assert refused.startswith("node 1 (host h1) was evicted from this run as a straggler after step 40; it may join "
                              "again after ") and str(tmp_path / "evicted" / "node_1.json") in refused
    assert eviction.refusal(tmp_path, 1, "replacement") is None  # a new machine in its place may join
    assert eviction.refusal(tmp_path, 2, "h1") is None
    left = eviction.left_line(tmp_path, 1)
    assert left.startswith("evicted: node 1 (host h1) left the job after step 40's checkpoint as a straggler (rank 3 ")
    assert eviction.count(tmp_path) == 1
    path = tmp_path / "evicted" / "node_1.json"
    r = json.loads(path.read_text())
    path.write_text(json.dumps({**r, "until": time.time() - 1, "at": time.time() - 120}))
    assert eviction.refusal(tmp_path, 1, "h1") is None  # the cool-down has passed
    assert eviction.left_line(tmp_path, 1) is None  # an old record is not this stop's cause


@pytest.mark.parametrize("overrides, field", [
    ([("run.evict_stragglers", "true"), ("run.straggler_every", "0")], "run.evict_stragglers"),
    ([("run.evict_stragglers", "true"), ("checkpoint.every", "0"), ("checkpoint.final", "false")], "run.evict_stragglers"),
    ([("run.evict_cooldown_s", "-1")], "run.evict_cooldown_s"),
])
def test_settings_that_cannot_evict_are_refused(overrides, field):
    from shardwise.config import build_config
    from shardwise.errors import ConfigError
    from shardwise.preflight import check

    with pytest.raises(ConfigError, match=field):
        check(build_config({}, overrides), 1)


def test_an_elastic_job_that_must_keep_every_node_cannot_evict():
    from shardwise.config import build_config
    from shardwise.errors import ConfigError
    from shardwise.preflight import check_elastic

    cfg = build_config({}, [("run.evict_stragglers", "true"), ("run.max_restarts", "3"), ("parallel.dp_shard", "-1"),
                            ("parallel.zero", "3"), ("checkpoint.every", "10")])
    with pytest.raises(ConfigError, match="no node can be evicted"):
        check_elastic(cfg, 2, 2, 2)
    check_elastic(cfg, 2, 1, 2)


def test_nothing_is_evicted_after_the_last_step():
    slow = _window([0.01, 0.01, 0.01, 0.03, 0.01, 0.01])
    watch = _watch(0, 0, NODES)
    watch.last_step = 2
    watch.judge(slow, 1, 1)
    lines = watch.judge(slow, 2, 1)[1]  # named at the run's last step: the job is done, nobody leaves
    assert watch.eviction is None and len(lines) == 1 and lines[0].startswith("straggler: rank 3")
