"""plan/scale.py: the terms that grow with scale (issue 60) — NCCL's algorithm and latency by node count,
the distributed optimizer's overlapped reduce-scatter / all-gather, the slowest of N GPUs, compute beside hidden comm."""
from __future__ import annotations

import pytest

from shardwise.config import build_config, parse_overrides
from shardwise.plan import scale
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.spec.layout import Layout


def test_nccl_algorithm_by_node_count():
    assert scale.nccl_algorithm("all_reduce", 8, 1) == "ring"
    assert scale.nccl_algorithm("all_reduce", 8, 4) == "tree"
    assert scale.nccl_algorithm("all_gather", 8, 4) == "ring"
    assert scale.nccl_algorithm("reduce_scatter", 1, 16) == "pat"


def test_ring_latency_grows_linearly_tree_logarithmically():
    ring = [scale.nccl_latency("reduce_scatter", 8, k, 2e-6, 6e-6)[0] for k in (2, 16, 128)]
    tree = [scale.nccl_latency("all_reduce", 8, k, 2e-6, 6e-6)[0] for k in (2, 16, 128)]
    # ring: (n - k) steps at max(NVLink, network overhead) + (k - 1) network steps
    assert ring[2] == pytest.approx((1024 - 128) * 3e-6 + 127 * 6e-6)
    # tree: 2 ((g - 1) intra + log2 k inter)
    assert tree == pytest.approx([2 * (7 * 2e-6 + k * 6e-6) for k in (1, 4, 7)])
    assert ring[2] / ring[1] > 7 and tree[2] / tree[1] < 1.5


def test_slowest_of_n_gpus():
    assert scale.slowest_rank_fraction(1) == 0.0
    assert scale.expected_max_normal(1000) == pytest.approx(3.24, abs=0.02)  # exact: 3.241
    fractions = [scale.slowest_rank_fraction(n) for n in (8, 1024, 16384)]
    assert fractions == sorted(fractions) and fractions[-1] < 0.05


def test_overlapped_exposure_chunk_by_chunk():
    # one chunk: what does not fit in the pass, at least one bucket
    assert scale.overlapped_exposure(1.0, 0.1, 0.7) == pytest.approx(0.3)
    assert scale.overlapped_exposure(1.0, 0.1, 2.0) == pytest.approx(0.1)
    # 4 chunks, each 0.25 s; a chunk's pass 0.1 s, spacing pp x 0.1 = 0.8 s: only the last chunk shows
    assert scale.overlapped_exposure(1.0, 0.01, 0.4, pp=8, chunks=4) == pytest.approx(0.15)
    # spacing shorter than a chunk's collective: the backlog queues
    assert scale.overlapped_exposure(1.0, 0.01, 0.4, pp=2, chunks=4) == pytest.approx(0.15 + 3 * 0.05)


def _problem(*extra: str) -> tuple[Problem, Layout]:
    args = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=256",
            "--parallel.dp_shard=32", "--parallel.zero=1", "--parallel.tp=8", "--train.micro_batch=1",
            "--train.global_batch=256", "--train.precision=bf16", "--cluster.model_states=mixed", *extra]
    cfg = build_config(None, parse_overrides(args))
    problem = Problem.from_config(cfg)
    return problem, Layout.from_config(cfg, problem.cluster.num_gpus)


def test_distributed_optimizer_hides_what_zero1_exposes():
    plain = evaluate(*_problem("--cluster.grad_reduce=overlapped"))
    dopt = evaluate(*_problem("--cluster.grad_reduce=distributed_optimizer"))
    assert dopt.breakdown_s["dp_comm"] < plain.breakdown_s["dp_comm"]
    assert dopt.detail["dp_reduce_scatter_s"] > 0 and dopt.detail["dp_param_gather_s"] > 0
    assert "distributed optimizer" in dopt.stack
    # the slowest-GPU allowance is on the step, the same for both
    assert dopt.breakdown_s["slowest_rank"] == pytest.approx(plain.breakdown_s["slowest_rank"])


def test_compute_beside_hidden_comm_runs_slower():
    """Item 4 (Lee et al. 2025): every second of collective hidden behind compute costs the compute beside it
    OVERLAP_COMPUTE_SLOWDOWN of a second; what stays exposed, or runs after the backward, costs nothing more."""
    dopt = evaluate(*_problem("--cluster.grad_reduce=distributed_optimizer"))
    beside = dopt.detail["comm_beside_compute_s"]
    # the distributed optimizer's reduce-scatter and all-gather, less what shows (a bucket each at least)
    assert 0 < beside < dopt.detail["dp_reduce_scatter_s"] + dopt.detail["dp_param_gather_s"]
    assert dopt.breakdown_s["overlap_contention"] == pytest.approx(scale.OVERLAP_COMPUTE_SLOWDOWN * beside)
    assert dopt.step_time_s == pytest.approx(sum(dopt.breakdown_s.values()))
    after = evaluate(*_problem("--parallel.dp_replicate=32", "--parallel.dp_shard=1", "--parallel.zero=0",
                               "--cluster.grad_reduce=after_backward"))
    assert after.detail["comm_beside_compute_s"] == 0 and after.breakdown_s["overlap_contention"] == 0
    ddp = evaluate(*_problem("--parallel.dp_replicate=32", "--parallel.dp_shard=1", "--parallel.zero=0",
                             "--cluster.grad_reduce=overlapped"))
    # DDP's all-reduce and FSDP's gathers and reduce-scatters: what is not exposed (dp_comm also holds the
    # loss's and the gradient norm's all-reduces) runs beside compute
    fsdp = evaluate(*_problem("--parallel.zero=3"))
    for est, total in ((ddp, ddp.detail["ddp_allreduce_s"]), (fsdp, fsdp.detail["fsdp_comm_total_s"])):
        assert total - est.breakdown_s["dp_comm"] <= est.detail["comm_beside_compute_s"] < total


def test_contention_never_exceeds_the_compute_and_skips_a_cpu():
    from types import SimpleNamespace

    gpu, cpu = (SimpleNamespace(device_is_host=host, overlap_slowdown=None) for host in (False, True))
    assert scale.overlap_contention(gpu, 2.0, 1.0) == pytest.approx(scale.OVERLAP_COMPUTE_SLOWDOWN)
    assert scale.overlap_contention(gpu, 0.5, 1.0) == pytest.approx(0.5 * scale.OVERLAP_COMPUTE_SLOWDOWN)
    assert scale.overlap_contention(cpu, 0.5, 1.0) == 0.0  # gloo's threads are not NCCL's SMs: not priced


def test_contention_grows_under_strong_scaling():
    """At a fixed global batch, more GPUs leave a rank fewer micro-batches while its data-parallel reduction
    keeps its size: the compute slowed beside it becomes a larger part of the step (the ML rows of issue 60)."""
    shares = []
    for gpus in (256, 1024, 4096):
        est = evaluate(*_problem(f"--cluster.num_gpus={gpus}", f"--parallel.dp_shard={gpus // 8}",
                                 "--train.global_batch=1024", "--cluster.grad_reduce=distributed_optimizer"))
        shares.append(est.breakdown_s["overlap_contention"] / est.step_time_s)
    assert shares == sorted(shares) and shares[-1] > 2 * shares[0]
