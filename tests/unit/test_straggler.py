"""Rank 0's verdict on a window of per-rank timings (train/straggler.py StragglerWatch.judge): who is named, for
what, when, once; a host whose every rank is slow is one line; a rank that recovers is said to have."""
from __future__ import annotations

import random
import statistics

import pytest
import torch

from shardwise.train.straggler import BlockTimer, RankTimes, StragglerWatch, medians_without_each


def _watch(every=10, margin=0.2, steps=20) -> StragglerWatch:
    return StragglerWatch(every, margin, steps, rank=0, group=None, device=torch.device("cpu"))


def _ranks(compute, data=None, step=1.0, hosts=None):
    data = data or [0.0] * len(compute)
    hosts = hosts or ["a"] * len(compute)
    return [RankTimes(r, hosts[r], c, d, step) for r, (c, d) in enumerate(zip(compute, data))]


def test_the_median_of_the_others_for_each_value():
    gen = random.Random(0)
    for n in range(1, 12):
        values = [gen.random() for _ in range(n)]
        expected = [statistics.median(values[:i] + values[i + 1:]) if n > 1 else values[i] for i in range(n)]
        assert medians_without_each(values) == expected


def test_a_slow_rank_is_named_after_the_steps_asked_once_and_recovers_once():
    watch = _watch()
    slow = _ranks([0.010, 0.010, 0.013, 0.010, 0.010, 0.010, 0.010, 0.010])  # rank 2: 1.3x the others
    record, lines = watch.judge(slow, 10, 10)
    assert lines == [] and record["straggler/slowest_rank"] == 2 and record["straggler/named"] == 0
    record, lines = watch.judge(slow, 20, 10)  # 20 steps slow: named
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 2 on host a (cpu): compute 1.30x the other ranks'")
    assert "for 20 steps" in lines[0] and record["straggler/named"] == 1
    assert watch.judge(slow, 30, 10)[1] == []  # still slow: not said again
    _, lines = watch.judge(_ranks([0.010] * 8), 40, 10)
    assert lines == ["straggler: rank 2 on host a is no longer slow (named at step 20)"]


def test_a_one_window_pause_names_nobody_and_noise_under_the_margin_neither():
    watch = _watch()
    assert watch.judge(_ranks([0.010, 0.030, 0.010, 0.010]), 10, 10)[1] == []
    assert watch.judge(_ranks([0.010, 0.010, 0.010, 0.010]), 20, 10)[1] == []
    assert watch.judge(_ranks([0.010, 0.030, 0.010, 0.010]), 30, 10)[1] == []  # not two windows in a row
    for step in (40, 50, 60):
        assert watch.judge(_ranks([0.0100, 0.0115, 0.0095, 0.0105]), step, 10)[1] == []  # within 20%


def test_a_rank_waiting_for_data_is_named_for_data():
    watch = _watch(steps=10)
    _, lines = watch.judge(_ranks([0.01] * 4, data=[0.0, 0.0, 0.5, 0.001], step=1.0), 10, 10)
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 2 on host a (cpu): waits for data 0.500 s a step")
    assert "data.num_workers" in lines[0]


def test_every_rank_of_one_host_slow_is_one_line_for_the_host():
    """A tensor-parallel group shares its slowest member's block time (its collectives run inside the block):
    when it fills a host, the host is named."""
    watch = _watch(steps=10)
    hosts = ["a", "a", "b", "b", "c", "c"]
    _, lines = watch.judge(_ranks([0.01, 0.01, 0.02, 0.02, 0.01, 0.01], hosts=hosts), 10, 10)
    assert lines == [lines[0]] and lines[0].startswith("straggler: every rank of host b (2, 3): compute 2.00x")


def test_one_rank_has_no_peers_to_be_slower_than():
    watch = _watch(steps=10)
    record, lines = watch.judge(_ranks([0.5]), 10, 10)
    assert lines == [] and record["straggler/named"] == 0


def test_the_timer_times_each_block_forward_and_nothing_else():
    blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    timer = BlockTimer(blocks, torch.device("cpu"))
    x = torch.randn(2, 4)
    for block in blocks:
        block(x)
    seconds, calls = timer.take()
    assert calls == 2 and seconds > 0
    assert timer.take() == (0.0, 0)
    timer.close()
    blocks[0](x)
    assert timer.take() == (0.0, 0)


@pytest.mark.parametrize("key, value", [("run.straggler_every", "-1"), ("run.straggler_margin", "0"),
                                        ("run.straggler_steps", "0")])
def test_bad_keys_are_refused_before_anything_starts(key, value):
    from shardwise.config import build_config
    from shardwise.errors import ConfigError
    from shardwise.preflight import check

    with pytest.raises(ConfigError, match=key):
        check(build_config({}, [(key, value)]), 1)
