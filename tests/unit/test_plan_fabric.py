"""The fabric's oversubscribed pods (plan/fabric.py, issue 60 item 1): flows leaving a pod, counted by hand."""
from __future__ import annotations

import pytest

from shardwise.config import build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.plan.cost import evaluate
from shardwise.plan.fabric import pod_taper
from shardwise.plan.layout import Problem
from shardwise.plan.scale import scale_lines
from shardwise.spec.layout import Layout


def test_no_pods_or_no_taper_slows_nothing():
    assert pod_taper("ring", 64, 8, 8, 1024, 0, 7.0) == 1.0        # one non-blocking fabric
    assert pod_taper("ring", 64, 8, 8, 1024, 256, 1.0) == 1.0      # pods, but 1:1
    assert pod_taper("ring", 64, 8, 8, 1024, 2048, 7.0) == 1.0     # the job fits in one pod
    assert pod_taper("ring", 16, 8, 8, 1024, 256, 7.0) == 1.0      # every group inside one pod (128 | 256)


def test_a_ring_leaves_each_pod_once_per_group():
    """64 ranks 8 apart (one per node, 64 nodes) on 1,024 GPUs in pods of 256: 16 groups, each with 32
    members in each of its 2 pods. A pod sees 8 groups leave it, one flow each: 8 of its 256 GPUs' NIC
    rate. Up to 32:1 the uplinks carry that; at 64:1 they carry half of it."""
    assert pod_taper("ring", 64, 8, 8, 1024, 256, 7.0) == 1.0
    assert pod_taper("ring", 64, 8, 8, 1024, 256, 32.0) == 1.0
    assert pod_taper("ring", 64, 8, 8, 1024, 256, 64.0) == pytest.approx(2.0)
    # 2 members per node (stride 4): half as many groups (8), each with two inter-node rings: the same 8
    assert pod_taper("ring", 128, 4, 8, 1024, 256, 64.0) == pytest.approx(2.0)
    # in general the taper is oversubscription / (members per pod): 8 groups over pods of 8 nodes, 8
    # members each, 8 flows out of 64 GPUs
    assert pod_taper("ring", 64, 8, 8, 512, 64, 7.0) == 1.0
    assert pod_taper("ring", 64, 8, 8, 512, 64, 16.0) == pytest.approx(2.0)


def test_a_pipeline_with_one_stage_per_pod_sends_every_gpu_across():
    """pp 4 at stride 256 on 1,024 GPUs in pods of 256: each pod holds one stage of all 256 groups, so
    each of its GPUs sends across pods (forward or backward, one at a time): demand = all 256 NICs."""
    assert pod_taper("chain", 4, 256, 8, 1024, 256, 7.0) == pytest.approx(7.0)
    # two stages per pod (pods of 512): 128 groups x 2 members, one flow out each (forward or backward)
    assert pod_taper("chain", 4, 256, 8, 1024, 512, 7.0) == pytest.approx(7.0 * 256 / 512)


def test_ring_attention_sends_leave_a_pod_once_per_group():
    """cp 8 at stride 8 (one rank per node) on 128 GPUs in pods of 32 (4 nodes): 16 groups, each in 2 pods;
    a pod's 8 groups each send one K/V flow out of it: 8 of its 32 NICs, so 1:4 carries it and 1:8 halves it.
    The all-reduce's hierarchical rings on the same groups leave alike; a chain both ways leaves twice."""
    assert pod_taper("p2p_ring", 8, 8, 8, 128, 32, 4.0) == 1.0
    assert pod_taper("p2p_ring", 8, 8, 8, 128, 32, 8.0) == pytest.approx(2.0)
    assert pod_taper("ring", 8, 8, 8, 128, 32, 8.0) == pytest.approx(2.0)
    assert pod_taper("chain", 8, 8, 8, 128, 32, 8.0) == pytest.approx(2.0)  # the end pods: one way each
    # two members per node (stride 4): a K/V ring still crosses each pod boundary once, the all-reduce's
    # hierarchical rings twice
    assert pod_taper("p2p_ring", 16, 4, 8, 128, 32, 8.0) == pytest.approx(1.0)
    assert pod_taper("ring", 16, 4, 8, 128, 32, 8.0) == pytest.approx(2.0)


def test_all_to_all_sends_its_share_bound_outside():
    """ep 16 one per node on 128 GPUs in pods of 64: 8 members of each group inside, 8 outside, so each
    member sends 8/15 of its network bytes out; 8 groups x 8 members x 8/15 over 64 GPUs, x 4."""
    assert pod_taper("all_to_all", 16, 8, 8, 128, 64, 4.0) == pytest.approx(4 * 8 * 8 * 8 / 15 / 64)


def test_a_partly_filled_pod_gets_its_share_of_the_uplinks():
    """pp 4 at stride 256 on 768 GPUs in pods of 512: pod 0 holds stages 0-1 (256 groups, one flow out
    each over 512 GPUs), pod 1 the 256 GPUs of stage 2 only, each sending backward: the worst."""
    assert pod_taper("chain", 3, 256, 8, 768, 512, 7.0) == pytest.approx(7.0)


def _price(*extra: str):
    cfg = build_config(None, parse_overrides([
        "--model.preset=llama3-8b", "--train.seq_len=4096", "--train.micro_batch=1", "--train.global_batch=512",
        "--cluster.num_gpus=1024", "--parallel.tp=8", "--parallel.pp=4", "--parallel.dp_shard=32", "--parallel.zero=1",
        *extra]))
    problem = Problem.from_config(cfg)
    return problem, evaluate(problem, Layout.from_config(cfg, 1024))


def test_evaluate_slows_the_pipeline_that_crosses_oversubscribed_pods():
    """pp outermost (plan/layout.py MESH_ORDER) at 256 GPUs per stage, pods of 32 nodes: every stage
    boundary crosses pods. dp_shard (32 nodes per group, one per pod) stays inside: its time is unchanged."""
    _, flat = _price()
    problem, tapered = _price("--cluster.nodes_per_pod=32", "--cluster.oversubscription=7")
    assert tapered.breakdown_s["pp_comm"] > flat.breakdown_s["pp_comm"] > 0
    assert tapered.breakdown_s["dp_comm"] == flat.breakdown_s["dp_comm"]
    assert tapered.step_time_s > flat.step_time_s
    lines = "\n".join(scale_lines(problem, tapered))
    assert "fabric: pods of 32 nodes, 7:1 between pods" in lines
    assert "pp: 1 per node x 4 nodes, busbw 42 GB/s; leaves its pod: network time chain x7.00" in lines
    # 1:1 pods change nothing
    assert _price("--cluster.nodes_per_pod=32")[1].step_time_s == flat.step_time_s
    # the search's fast path prices the same taper
    from shardwise.plan.cost import step_seconds
    lay = tapered.layout
    assert step_seconds(problem, lay, lay.schedule, lay.virtual_stages) == pytest.approx(tapered.step_time_s)


@pytest.mark.parametrize("key, value", [("nodes_per_pod", "-1"), ("oversubscription", "0.5"), ("oversubscription", "nan")])
def test_a_bad_fabric_is_a_config_error(key, value):
    with pytest.raises(ConfigError) as e:
        _price(f"--cluster.{key}={value}")
    assert e.value.field == f"cluster.{key}"
