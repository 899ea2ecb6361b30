"""The communication counter's pure parts, and the ring wire bytes its payload convention feeds.
(The counts themselves are checked against analytic volumes in tests/dist/test_comm_volume.py.)"""
from __future__ import annotations

import torch

from shardwise.parallel.comm_counter import CommCounter, describe_comm
from shardwise.plan.comm import wire_bytes


def test_ring_wire_bytes():
    # ring all-reduce on n ranks: each rank sends 2(n-1)/n of the buffer; all-gather (n-1)/n
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 2) == 500
    assert wire_bytes("all_reduce", 1000, 1) == 0
    assert wire_bytes("send", 1000, 2) == 1000


def test_summary_lists_axes_and_kinds():
    text = describe_comm({"tp": {"reduce_scatter": 655360, "all_gather": 655360}, "dp_shard": {"all_reduce": 84}})
    assert text == "dp_shard: all_reduce 84 B; tp: all_gather 655.4 kB, reduce_scatter 655.4 kB"
    assert describe_comm({"pp": {"send": 4, "recv": 1443072}, "dp": {"all_reduce": 2_500_000_000}}) == \
        "dp: all_reduce 2.5 GB; pp: recv 1.4 MB, send 4 B"  # a 4-byte loss all-reduce read "0.0 kB"


def test_no_process_group_counts_nothing():
    with CommCounter({}) as counter:
        torch.ones(4).sum()
    assert counter.totals() == {}
