"""cluster.sp_saved_input: what a column-parallel linear keeps of its input under sequence parallelism, the
all-gathered input (the trainer's torch SP, the default) or its sequence shard, all-gathered again in the
backward (Megatron-Core and Transformer Engine; Korthikanti et al. 2022 §4.2.2). Issue 60: NVIDIA's Llama 3.1
405B recipe ran on 80 GB H100s, where the planner held 94-100 GiB per rank with the gathered inputs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardwise.config import build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.plan.comm import collectives
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.spec.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
# Llama 3 8B on 8 H100s, TP 4 with SP, one micro-batch of 4,096 tokens held at a time (no pipeline)
BASE = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=8",
        "--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.tp=4", "--train.micro_batch=1",
        "--train.global_batch=8", "--train.recompute=none", "--cluster.model_states=mixed", "--train.precision=bf16"]
SHARDED = "--cluster.sp_saved_input=sharded"


def _plan(*extra: str):
    cfg = build_config(None, parse_overrides([*BASE, *extra]))
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, problem.cluster.num_gpus)
    return problem, lay, evaluate(problem, lay)


@pytest.mark.parametrize("compiled", ["true", "false"])
def test_sharded_inputs_keep_a_tp_th_of_each_blocks_two_norm_outputs(compiled):
    """llama under 16-bit parameters: each norm's output is one 2-byte tensor per token that the linears after
    it keep; sharded, a rank keeps 1/4 of both: 32 blocks x 4,096 tokens x 2 x 2 h x 3/4 fewer bytes."""
    problem, lay, gathered = _plan(f"--train.compile={compiled}")
    _, _, sharded = _plan(f"--train.compile={compiled}", SHARDED)
    h, layers, tokens = problem.shape.dim, problem.shape.n_layers, 4096
    assert gathered.memory.activations - sharded.memory.activations == pytest.approx(layers * tokens * 2 * 2 * h * 3 / 4)
    assert (gathered.memory.params, gathered.memory.optimizer) == (sharded.memory.params, sharded.memory.optimizer)


def test_a_gpt_block_under_autocast_keeps_one_cast_per_linear_and_shards_each():
    """gpt's LayerNorm runs in fp32 under autocast, and each linear after it keeps its own 16-bit cast of the
    output: q, k, v after the first norm, fc after the second, 4 x 2 h per token, 3/4 of it sharded away."""
    gpt = ["--model.preset=gpt2-small", "--train.seq_len=1024", "--cluster.model_states=shardwise", "--train.compile=false"]
    problem, _, gathered = _plan(*gpt)
    _, _, sharded = _plan(*gpt, SHARDED)
    h, layers = problem.shape.dim, problem.shape.n_layers
    assert gathered.memory.activations - sharded.memory.activations == pytest.approx(layers * 1024 * 4 * 2 * h * 3 / 4)


def test_unset_is_gathered_and_the_key_needs_sequence_parallelism_over_tp():
    for extra in ([], ["--parallel.tp=1", "--parallel.dp_shard=8"], ["--parallel.sequence_parallel=false"]):
        problem, lay, plain = _plan(*extra)
        _, _, keyed = _plan(*extra, "--cluster.sp_saved_input=gathered")
        assert keyed.step_time_s == plain.step_time_s and keyed.memory.total == plain.memory.total
    for extra in (["--parallel.tp=1", "--parallel.dp_shard=8"], ["--parallel.sequence_parallel=false"]):
        _, _, plain = _plan(*extra)
        problem, lay, keyed = _plan(*extra, SHARDED)
        assert keyed.step_time_s == plain.step_time_s and keyed.memory.total == plain.memory.total
        assert "kept sharded" not in problem.stack_description(lay)
    problem, lay, _ = _plan(SHARDED)
    assert "SP linear inputs kept sharded" in problem.stack_description(lay)
    with pytest.raises(ConfigError) as err:
        _plan("--cluster.sp_saved_input=sliced")
    assert err.value.field == "cluster.sp_saved_input"


def _regathers(problem, lay):
    return [c for c in collectives(problem, lay) if c.unit == "sp_regather"]


def test_the_backward_gathers_the_inputs_again_beside_its_gemms():
    """Two all-gathers per block and micro-batch, of the norm output's full size; run beside the
    input-gradient GEMMs (TE v1.11 LayerNormLinear: 'Overlap input AG with dgrad'), so the exposed TP time
    stays and only the contention of compute beside communication grows."""
    problem, lay, gathered = _plan()
    _, _, sharded = _plan(SHARDED)
    problem_s, lay_s, _ = _plan(SHARDED)
    (regather,) = _regathers(problem_s, lay_s)
    assert regather.kind == "all_gather" and regather.phase == "bwd"
    assert regather.calls == 2 * problem.shape.n_layers * lay.accumulation(problem)
    assert regather.payload == 4096 * problem.shape.dim * 2
    assert not _regathers(problem, lay)
    assert sharded.breakdown_s["tp_comm"] == gathered.breakdown_s["tp_comm"]
    assert sharded.detail["comm_beside_compute_s"] > gathered.detail["comm_beside_compute_s"]
    assert sharded.breakdown_s["overlap_contention"] > gathered.breakdown_s["overlap_contention"]
    assert sharded.step_time_s - gathered.step_time_s == pytest.approx(
        sharded.breakdown_s["overlap_contention"] - gathered.breakdown_s["overlap_contention"], rel=1e-6)
    # selective "op" recomputes the norms and all-gathers their outputs again anyway: nothing more to gather
    problem_op, lay_op, _ = _plan(SHARDED, "--train.recompute=selective")
    assert not _regathers(problem_op, lay_op)


def test_nvidias_405b_recipe_fits_its_80_gb_only_with_its_inputs_kept_sharded():
    """The published row (tests/fixtures/published_runs.json, TP 8 x PP 9 x CP 2, VP 7, no recomputation) ran on
    80 GB H100s; with the trainer's gathered inputs the planner holds about 100 GiB on its first rank."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_published as pp

    rows = json.loads((ROOT / "tests" / "fixtures" / "published_runs.json").read_text())["rows"]
    row = next(r for r in rows if r["id"] == "dgxc-llama3.1-405b-tp8-pp9-cp2-576")
    assert SHARDED in row["overrides"]
    as_run = pp.price(row)
    gathered = pp.price({**row, "overrides": [o for o in row["overrides"] if o != SHARDED]})
    assert as_run["fits"] and not gathered["fits"]
    assert gathered["memory_gib"] - as_run["memory_gib"] > 25
