"""The communication counter against the analytic volume of each layout (docs/architecture.md §5).

Payload bytes per step and rank (see shardwise.parallel.comm_counter for the convention). For TP with a
micro-batch of b sequences of s tokens, hidden h, L blocks, fp32 activations, let A = b·s·h·4:

  without SP (Megatron f/g, Shoeybi et al. 2019 §3): forward all-reduces the output of each block's
    two row-wise projections and the vocab-parallel embedding: (2L + 1)·A; backward all-reduces the
    input gradient of each block's two TP regions and of the vocab-parallel head: (2L + 1)·A.
  with SP (Korthikanti et al. 2022 §4.2.2): each all-reduce becomes a reduce-scatter + all-gather
    pair of the same payload: all_gather = reduce_scatter = 2(2L + 1)·A.
  full recompute replays every block's forward up to the last tensor backward needs: + 2L·A of
    all_gather but only + L·A of reduce_scatter (or all-reduce without SP), because the block's
    last reduction (after the MLP) feeds only the residual add, which saves nothing, and the
    non-reentrant checkpoint stops recomputing before it (torch.utils.checkpoint early stop).
  selective "op" recompute saves reduce-scatter / all-reduce outputs, so only the SP all-gathers are
    replayed: + 2L·A all_gather.
Loss parallel adds three all-reduces of b·s fp32 values (max, sum of exp, target logit) per
micro-batch and the gradient norm one scalar: ~0.5% of A-sized traffic here, inside the 5% bound.
"""
from __future__ import annotations

import json

import pytest

from shardwise.config import build_config
from tests.harness import run_world

CASES = {
    "tp2": {"parallel.tp": 2},
    "tp2_nosp": {"parallel.tp": 2, "parallel.sequence_parallel": False},
    "tp2_recompute_full": {"parallel.tp": 2, "train.recompute": "full"},
    "tp2_recompute_op": {"parallel.tp": 2, "train.recompute": "selective"},
    "tp2_nosp_recompute_full": {"parallel.tp": 2, "parallel.sequence_parallel": False, "train.recompute": "full"},
    "tp2_nosp_accum2": {"parallel.tp": 2, "parallel.sequence_parallel": False, "train.micro_batch": 4},
    "ddp2": {"parallel.dp_replicate": 2, "train.micro_batch": 4},
    "zero3_dp2": {"parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4},
}
CASES_4 = {"zero3_dp2_tp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4}}
# Context parallel (parallel/context.py): the cp axis and the dp_cp / dp_shard_cp gradient groups.
_CP = {"parallel.cp": 2}
_UL = {"parallel.cp_mode": "ulysses"}
CASES.update({
    "cp2_ring": dict(_CP),
    "cp2_ulysses": {**_CP, **_UL},
    "cp2_ring_recompute_full": {**_CP, "train.recompute": "full"},
    "cp2_ring_recompute_op": {**_CP, "train.recompute": "selective"},
    "cp2_ulysses_recompute_full_accum2": {**_CP, **_UL, "train.recompute": "full", "train.micro_batch": 4},
})
CASES_4.update({
    "cp4_ring": {"parallel.cp": 4},
    "cp4_ulysses": {"parallel.cp": 4, **_UL},
    "cp2_ring_zero3_dp2": {**_CP, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4},
    "cp2_ulysses_ddp2": {**_CP, **_UL, "parallel.dp_replicate": 2, "train.micro_batch": 4},
    "cp2_ring_tp2": {**_CP, "parallel.tp": 2},
})


def _train_one_step(base, overrides: dict, run_dir) -> dict:
    from shardwise.train.trainer import Trainer

    extra = [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in overrides.items()]
    cfg = build_config(None, base + extra + [("train.steps", "1"), ("train.log_every", "1")])
    cfg.run.dir = str(run_dir)
    trainer = Trainer(cfg, log=None)
    trainer.train()
    return {"comm": trainer.comm_bytes, "params": trainer.num_params, "accumulation": trainer.accumulation}


@pytest.fixture(scope="module")
def counted(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("comm")
    out = {}
    for world, cases in ((2, CASES), (4, CASES_4)):
        out.update(run_world(world, lambda rank, cases=cases: {n: _train_one_step(base_overrides, ov, root / n)
                                                               for n, ov in cases.items()})[0])
    out["metrics_line"] = json.loads((root / "tp2" / "metrics.jsonl").read_text().splitlines()[-1])
    return out


def _activation_bytes(base_overrides, micro_batch: int) -> int:
    cfg = build_config(None, base_overrides)
    return micro_batch * cfg.train.seq_len * cfg.model.dim * 4


def _tp_analytic(L: int, A: int, sp: bool, recompute: str, accumulation: int) -> dict[str, int]:
    if sp:
        ag = rs = 2 * (2 * L + 1) * A
        if recompute == "full":
            ag, rs = ag + 2 * L * A, rs + L * A
        elif recompute == "selective":
            ag += 2 * L * A
        return {"all_gather": ag * accumulation, "reduce_scatter": rs * accumulation}
    ar = 2 * (2 * L + 1) * A + (L * A if recompute == "full" else 0)
    return {"all_reduce": ar * accumulation}


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("tp")])
def test_tp_traffic_matches_analytic_volume(counted, base_overrides, name):
    ov = CASES[name]
    cfg = build_config(None, base_overrides)
    micro = ov.get("train.micro_batch", cfg.train.micro_batch)
    A = _activation_bytes(base_overrides, micro)
    L = cfg.model.n_layers
    sp = ov.get("parallel.sequence_parallel", True)
    expected = _tp_analytic(L, A, sp, ov.get("train.recompute", "none"), counted[name]["accumulation"])
    got = counted[name]["comm"]["tp"]
    total_expected, total_got = sum(expected.values()), sum(got.values())
    print(f"{name}: tp bytes/step {total_got} (analytic {total_expected}), by kind {got}")
    assert abs(total_got - total_expected) <= 0.05 * total_expected
    for kind, nbytes in expected.items():
        assert abs(got[kind] - nbytes) <= 0.05 * nbytes, f"{kind}: {got[kind]} vs analytic {nbytes}"
    # Per block: take out the vocab-parallel embedding and head (forward + backward: 2·A without SP,
    # an all-gather and a reduce-scatter each, 4·A, with SP) and divide by L.
    outer = (4 if sp else 2) * A * counted[name]["accumulation"]
    per_layer, per_layer_expected = (total_got - outer) / L, (total_expected - outer) / L
    print(f"{name}: per block {per_layer:.0f} bytes (analytic {per_layer_expected:.0f})")
    assert abs(per_layer - per_layer_expected) <= 0.05 * per_layer_expected


def test_data_parallel_traffic(counted):
    """DDP all-reduces every fp32 gradient once per step; ZeRO-3 reduce-scatters them once per
    micro-batch and all-gathers parameters in forward and (all but the root unit) in backward."""
    ddp, zero3 = counted["ddp2"], counted["zero3_dp2"]
    grads = ddp["params"] * 4
    assert abs(ddp["comm"]["dp_replicate"]["all_reduce"] - grads) <= 0.001 * grads
    assert zero3["comm"]["dp_shard"]["reduce_scatter"] == grads * zero3["accumulation"]
    assert grads < zero3["comm"]["dp_shard"]["all_gather"] < 2 * grads


def test_fsdp_tp_2d_splits_traffic_by_axis(counted):
    """FSDP x TP: the dp_shard axis moves this rank's TP shard of the parameters (about half), the
    tp axis the same activation traffic as tp2 alone at half the micro-batch."""
    two_d, zero3, tp2 = counted["zero3_dp2_tp2"], counted["zero3_dp2"], counted["tp2"]
    assert set(two_d["comm"]) >= {"dp_shard", "tp"}
    ratio = two_d["comm"]["dp_shard"]["reduce_scatter"] / zero3["comm"]["dp_shard"]["reduce_scatter"]
    assert 0.5 <= ratio < 0.7, ratio  # norms are replicated over tp, so a little over half
    tp_ratio = sum(two_d["comm"]["tp"].values()) / sum(tp2["comm"]["tp"].values())
    assert abs(tp_ratio - 0.5) < 0.02, tp_ratio


def test_metrics_report_bytes_per_axis(counted):
    line = counted["metrics_line"]
    assert line["comm_tp_bytes"] == sum(line["comm_bytes_per_step"]["tp"].values()) > 0


CP_CASES = [n for n in (*CASES, *CASES_4) if n.startswith("cp")]


def _cp_analytic(base_overrides, ov: dict, accumulation: int) -> dict[str, int]:
    """Bytes per step on the cp axis from first principles, fp32, for a rank holding b·s/cp tokens
    of each micro-batch (b sequences of s tokens), L blocks, heads of size d (4 query heads and 2 KV
    heads in the tiny preset; with tp, the local heads):
      ring: K and V (2·kv·d values per token) go cp-1 hops forward and, in backward, K/V again plus
        the dK/dV accumulators cp-1 hops (Liu et al. 2023 ring, dK/dV returned to their owners):
        3(cp-1) sends and as many receptions per block; recompute (full or per-op) replays the
        forward's cp-1.
      Ulysses: q, k, v and the output are each all-to-all'ed once forward and once backward (their
        gradients), KV heads repeated to a multiple of cp first; full recompute replays the forward."""
    import math

    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in ov.items()])
    m, cp, tp = cfg.model, cfg.parallel.cp, cfg.parallel.tp
    d = m.dim // m.n_heads
    tokens = cfg.train.micro_batch * cfg.train.seq_len // cp
    heads, kv = m.n_heads // tp, max(1, m.n_kv_heads // tp)
    # Selective "op" does not save point-to-point / all-to-all outputs: replayed like full recompute.
    replay = 1 if cfg.train.recompute in ("full", "selective") else 0
    L = m.n_layers
    if cfg.parallel.cp_mode == "ring":
        hops = (cp - 1) * (3 + replay)
        per = tokens * 2 * kv * d * 4 * hops * L * accumulation
        return {"send": per, "recv": per}
    if kv % cp:
        kv *= cp // math.gcd(kv, cp)
    per_direction = tokens * (2 * heads + 2 * kv) * d * 4 * L
    return {"all_to_all": per_direction * (2 + replay) * accumulation}


@pytest.mark.parametrize("name", CP_CASES)
def test_cp_traffic_matches_planner_exactly(counted, base_overrides, name):
    """The counted bytes on cp (and on the dp_cp / dp_shard_cp gradient groups) equal the planner's
    predict_comm_bytes to the byte, and the cp attention traffic equals the closed form above."""
    from shardwise.plan.comm import predict_comm_bytes

    ov = {**CASES, **CASES_4}[name]
    world = 2 if name in CASES else 4
    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in ov.items()])
    cfg.cluster.num_gpus = world
    predicted = predict_comm_bytes(cfg)
    got = counted[name]["comm"]
    analytic = _cp_analytic(base_overrides, ov, counted[name]["accumulation"])
    print(f"{name}: cp bytes/step {got['cp']} (planner {predicted['cp']}, analytic {analytic}); "
          f"gradient groups {({a: got[a] for a in got if a.startswith('dp')})}")
    assert got["cp"] == predicted["cp"]
    # With dp = 1 the cp group also carries the gradient all-reduce (the planner's dp_cp is then cp).
    assert {kind: got["cp"].get(kind) for kind in analytic} == analytic
    for axis in set(got) | set(predicted):
        if axis.startswith("dp") or axis == "cp":
            assert got.get(axis) == predicted.get(axis), f"{axis}: counted {got.get(axis)} vs planner {predicted.get(axis)}"
# ---- expert parallelism ----
# tiny-moe, micro-batch 2 of 32 tokens, 2 MoE blocks, top-2, h = 64, fp32. Per MoE block and micro-batch a
# rank sends its T*k token copies (dispatch) and sends back what its experts received (combine); backward
# repeats both with the roles swapped. What one rank receives follows the routing, but over the ep group
# sent = received, so the mean over ranks is exactly 2 x T*k*h*4 per direction, plus the E int64 counts.
MOE = {"model.preset": "tiny-moe", "train.micro_batch": 2}
_Z3 = {**MOE, "parallel.zero": 3}
MOE_CASES = {2: {"moe_ep2_zero3": {**_Z3, "parallel.dp_shard": 2, "parallel.ep": 2},
                 # the experts as ordinary block parameters of the dense FSDP units
                 "moe_ep1_zero3": {**_Z3, "parallel.dp_shard": 2},
                 "moe_ep2_zero2": {**MOE, "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.zero": 2},
                 # ep folded onto cp: dp_shard 1, the dense units shard over cp
                 "moe_cp2_ep2_zero3": {**_Z3, "parallel.cp": 2, "parallel.ep": 2},
                 # MoE x TP (parallel/tensor.py MoERegion): the dense MLP's TP collectives + the router's Partial grad
                 "moe_tp2": {**MOE, "parallel.tp": 2},
                 "moe_tp2_nosp": {**MOE, "parallel.tp": 2, "parallel.sequence_parallel": False}},
             4: {"moe_ep4_zero3": {**_Z3, "parallel.dp_shard": 4, "parallel.ep": 4},
                 "moe_ep2_efsdp2_capacity1": {**_Z3, "parallel.dp_shard": 4, "parallel.ep": 2,
                                              "model.moe.capacity_factor": 1.0},
                 "moe_ep2_efsdp2_zero2": {**MOE, "parallel.dp_shard": 4, "parallel.ep": 2, "parallel.zero": 2},
                 "moe_pp2_dp2_ep2_zero3": {**_Z3, "parallel.pp": 2, "parallel.dp_shard": 2, "parallel.ep": 2},
                 "moe_ep2_tp2_zero3": {**_Z3, "parallel.dp_shard": 2, "parallel.ep": 2, "parallel.tp": 2}}}
MOE_NAMES = [n for cases in MOE_CASES.values() for n in cases]


def _moe_step(base, overrides: dict, run_dir) -> dict:
    """One counted optimizer step; under PP a steady one (the schedules' first step adds 4-byte shape
    handshakes between neighbours, not per-step traffic: tests/dist/test_plan_validation.py)."""
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, base + [(k, str(v)) for k, v in overrides.items()] + [("train.steps", "2")])
    cfg.run.dir = str(run_dir)
    trainer = Trainer(cfg, log=None)
    if trainer.dims.pp > 1:
        trainer.train_step()
        trainer.comm_bytes = None
    trainer.train_step()
    return {"comm": trainer.comm_bytes}


@pytest.fixture(scope="module")
def moe_counted(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("comm_moe")
    out = {}
    for world, cases in MOE_CASES.items():
        ranks = run_world(world, lambda rank, cases=cases: {n: _moe_step(base_overrides, ov, root / f"{n}_{rank}")
                                                            for n, ov in cases.items()})
        for name in cases:
            out[name] = [r[name] for r in ranks]
    return out


EP_NAMES = [n for w, cases in MOE_CASES.items() for n, ov in cases.items() if ov.get("parallel.ep", 1) > 1]


@pytest.mark.parametrize("name", EP_NAMES)
def test_expert_parallel_all_to_all_matches_planner(moe_counted, base_overrides, name):
    from shardwise.spec.dims import ParallelDims
    from shardwise.plan.comm import predict_comm_bytes

    world = next(w for w, cases in MOE_CASES.items() if name in cases)
    overrides = MOE_CASES[world][name]
    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in overrides.items()])
    dims = ParallelDims.from_config(cfg.parallel, world)
    # every rank of the ep group holds the same layers (under pp: one stage's ep group at a time)
    per_rank = [predict_comm_bytes(cfg, dims, rank=r)["ep"]["all_to_all"] for r in range(world)]
    assert len(set(per_rank)) == 1, per_rank
    predicted = per_rank[0]
    measured = [r["comm"]["ep"]["all_to_all"] for r in moe_counted[name]]
    mean = sum(measured) / len(measured)
    print(f"{name}: ep all_to_all bytes/step per rank {measured}, mean {mean:.0f}, planner {predicted}")
    # no expert traffic leaks into the data-parallel axes' all_to_all, and the dense axes still see theirs
    assert all("all_to_all" not in r["comm"].get("dp_shard", {}) for r in moe_counted[name])
    if cfg.model.moe.capacity_factor == 0:
        # dropless: exactly T*k*h*4 per call on average (integers: exact up to the planner's rounding)
        assert abs(mean - predicted) <= 1, (mean, predicted)
    else:
        # capacity: dropped copies are not sent; the planner's min(1, cf) * T*k is the balanced bound
        assert 0.5 * predicted < mean <= predicted


def _moe_axis_table(cfg, world: int, counted_ranks: list[dict]) -> list[tuple]:
    """(rank, axis, kind, counted, predicted) for every axis and kind either side has, but the ep
    all_to_all (routing-dependent per rank: test above)."""
    from shardwise.spec.dims import ParallelDims
    from shardwise.plan.comm import predict_comm_bytes

    dims = ParallelDims.from_config(cfg.parallel, world)
    rows = []
    for rank, r in enumerate(counted_ranks):
        got, pred = r["comm"], predict_comm_bytes(cfg, dims, rank=rank)
        for axis in sorted(set(got) | set(pred)):
            for kind in sorted(set(got.get(axis, {})) | set(pred.get(axis, {}))):
                if (axis, kind) == ("ep", "all_to_all"):
                    continue
                rows.append((rank, axis, kind, got.get(axis, {}).get(kind), pred.get(axis, {}).get(kind)))
    return rows


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_traffic_matches_planner_on_every_axis(moe_counted, base_overrides, name):
    """MoE layouts, every rank, every axis and kind (dp_shard / cp for the dense FSDP units and their
    gradient norms, efsdp for the experts' own FSDP unit, ep for the experts' gradient norms, cp for
    the router statistics and attention, pp for the boundary activations and the norm): counted ==
    predict_comm_bytes, to the byte.
    With ep > 1 the stacked experts are outside the dense units (parallel/expert.py)."""
    world = next(w for w, cases in MOE_CASES.items() if name in cases)
    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in MOE_CASES[world][name].items()])
    rows = _moe_axis_table(cfg, world, moe_counted[name])
    for row in rows:
        print(name, *row)
    assert [r for r in rows if r[3] != r[4]] == []
    axes = {r[1] for r in rows}
    ov = MOE_CASES[world][name]
    efsdp = ov.get("parallel.dp_shard", 1) * ov.get("parallel.cp", 1) // ov.get("parallel.ep", 1)
    # the layouts exercise what they are meant to: the experts' own FSDP axis only with efsdp > 1,
    # expert gradient norms on ep with ep > 1
    assert ("efsdp" in axes) == (efsdp > 1 and ov.get("parallel.ep", 1) > 1), axes
    assert (("ep", "all_reduce") in {(r[1], r[2]) for r in rows}) == (ov.get("parallel.ep", 1) > 1)


@pytest.mark.parametrize("name", ["moe_tp2", "moe_tp2_nosp"])
def test_moe_tensor_parallel_traffic_matches_planner(moe_counted, base_overrides, name):
    """A MoE block under TP is one region like the dense MLP (all-gather / reduce-scatter, or all-reduce
    without SP, at its entry and exit), plus the router's Partial gradient all-reduced over tp: the
    trainer's tp bytes per kind equal the planner's."""
    from shardwise.spec.dims import ParallelDims
    from shardwise.plan.comm import predict_comm_bytes

    overrides = MOE_CASES[2][name]
    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in overrides.items()])
    predicted = predict_comm_bytes(cfg, ParallelDims.from_config(cfg.parallel, 2))["tp"]
    for r in moe_counted[name]:
        got = r["comm"]["tp"]
        print(f"{name}: tp bytes/step by kind {got}, planner {predicted}")
        assert set(got) == set(predicted)
        for kind, nbytes in predicted.items():
            assert abs(got[kind] - nbytes) <= 0.01 * nbytes, (kind, got[kind], nbytes)
