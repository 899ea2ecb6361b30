"""How Megatron-Core / NeMo keep activations and optimizer state, as the planner describes them (issue 60: the
published NeMo recipes' 405B and Nemotron-4 340B rows were planned at 77-101 GiB per rank on the 80 GB H100s
they ran on):

- cluster.sp_saved_input = "sharded": a column-parallel linear keeps the sequence shard of its input under SP
  and all-gathers it again in the backward (Megatron-Core and Transformer Engine; Korthikanti et al. 2022
  §4.2.2), where the trainer's torch SP keeps the all-gathered input (the default, "gathered");
- cluster.optimizer_state_dtype = "bf16": AdamW's master copy and moments in bf16 under "mixed" model states
  (the YAML's optim.dtype bf16, Apex DistributedFusedAdam's optimizer-state dtype): 2 + 2 + 6 bytes/param;
- cluster.selective_recompute = "attention_core": Megatron-LM's selective recomputation, which checkpoints the
  attention core alone (Korthikanti et al. 2022 §5), where the trainer's "op" policy reruns the pointwise
  ops and the SP all-gathers and keeps every matmul output;
- cluster.block_overhead_us: a stack's time per block and micro-batch outside the kernels the planner prices,
  fitted to the NeMo rows of the published set (benchmarks/plan_published.py, with its leave-one-out column)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardwise.config import build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.plan.comm import collectives
from shardwise.plan.compute_time import microbatch_times
from shardwise.plan.cost import evaluate
from shardwise.plan.inventory import pipeline_rank
from shardwise.plan.layout import Problem
from shardwise.plan.report import model_state_lines
from shardwise.spec.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
# Llama 3 8B on 8 H100s, TP 4 with SP, one micro-batch of 4,096 tokens held at a time (no pipeline)
BASE = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=8",
        "--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.tp=4", "--train.micro_batch=1",
        "--train.global_batch=8", "--train.recompute=none", "--cluster.model_states=mixed", "--train.precision=bf16"]
SHARDED = "--cluster.sp_saved_input=sharded"
CORE = "--cluster.selective_recompute=attention_core"


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
    problem_s, lay_s, sharded = _plan(SHARDED)
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


def test_a_bf16_optimizer_state_holds_half_the_master_copy_and_moments():
    problem, _, fp32 = _plan("--train.recompute=none")
    _, _, unset = _plan("--train.recompute=none", "--cluster.optimizer_state_dtype=fp32")
    problem16, _, bf16 = _plan("--train.recompute=none", "--cluster.optimizer_state_dtype=bf16")
    assert unset.memory.optimizer == fp32.memory.optimizer
    assert bf16.memory.optimizer == pytest.approx(fp32.memory.optimizer / 2)
    assert (bf16.memory.params, bf16.memory.grads) == (fp32.memory.params, fp32.memory.grads)
    # the same parameters are updated: AdamW's time (priced at the fp32 state's traffic) does not change
    assert bf16.step_time_s == fp32.step_time_s
    assert "(2 + 2 + 6 bytes/param)" in model_state_lines(problem16, bf16)[0]
    assert "(2 + 2 + 12 bytes/param)" in model_state_lines(problem, fp32)[0]


@pytest.mark.parametrize("extra, problem", [
    (["--cluster.model_states=shardwise", "--cluster.optimizer_state_dtype=bf16"], 'read with model_states = "mixed"'),
    (["--cluster.optimizer_state_dtype=fp8"], "not one of fp32, bf16"),
    (["--cluster.selective_recompute=core"], "not one of op, attention_core"),
    (["--cluster.block_overhead_us=-1"], "finite number of microseconds"),
    (["--cluster.block_overhead_us=2e6"], "finite number of microseconds"),
])
def test_a_state_dtype_or_recompute_it_cannot_price_is_refused(extra, problem):
    with pytest.raises(ConfigError) as err:
        _plan(*extra)
    assert problem in err.value.problem


def _tp_replays(problem, lay):
    return [c for c in collectives(problem, lay) if c.axis == "tp" and c.phase == "recompute"]


def test_the_attention_core_alone_is_rerun_and_its_log_sum_exp_not_kept():
    """Stored: what no recomputation keeps, less each block's log-sum-exp (4 B per head per token, cuDNN);
    working set: one block's. Time: each block's attention forward again, no GEMM, no TP collective replayed;
    the selective policy (train.recompute_policy) does not matter then."""
    problem, lay, none = _plan("--train.recompute=none")
    problem_c, lay_c, core = _plan("--train.recompute=selective", CORE)
    _, _, layer = _plan("--train.recompute=selective", "--train.recompute_policy=layer", CORE)
    s = problem.shape
    lse = 4 * s.n_heads / 4 * 4096
    assert core.memory.activations == pytest.approx(none.memory.activations - (s.n_layers - 1) * lse)
    assert (layer.memory.activations, layer.step_time_s) == (core.memory.activations, core.step_time_s)
    mb = microbatch_times(problem_c, lay_c, pipeline_rank(s, 1, 1, "1f1b", 0))
    assert mb.recompute == pytest.approx(s.n_layers * mb.attn_fwd_layer)
    assert not _tp_replays(problem_c, lay_c)
    problem_op, lay_op, op = _plan("--train.recompute=selective")
    assert _tp_replays(problem_op, lay_op)
    assert op.memory.activations < core.memory.activations < none.memory.activations
    assert none.step_time_s < core.step_time_s
    assert "attention core only" in problem_c.stack_description(lay_c)
    assert "attention core" not in problem_op.stack_description(lay_op)


def test_the_key_is_read_under_selective_recomputation_only():
    for mode in ("none", "full"):
        _, _, plain = _plan(f"--train.recompute={mode}")
        _, _, keyed = _plan(f"--train.recompute={mode}", CORE)
        assert (keyed.step_time_s, keyed.memory.total) == (plain.step_time_s, plain.memory.total)
    _, _, op = _plan("--train.recompute=selective")
    _, _, keyed = _plan("--train.recompute=selective", "--cluster.selective_recompute=op")
    assert (keyed.step_time_s, keyed.memory.total) == (op.step_time_s, op.memory.total)


def test_plan_evaluate_says_the_layouts_policy_gives_way_to_the_attention_core(capsys):
    """The layout's name keeps its recompute policy (rc-op); its line says what is priced instead."""
    from shardwise.cli import main

    base = [a for a in BASE if not a.startswith("--train.recompute")] + ["--train.recompute=selective"]
    assert main(["plan", "evaluate", *base, CORE]) == 0
    layout = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layout"))
    assert "rc-op" in layout and "attention core only, not its policy" in layout
    assert main(["plan", "evaluate", *base]) == 0
    layout = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layout"))
    assert "attention core" not in layout


OVERHEAD = "--cluster.block_overhead_us=900"


@pytest.mark.parametrize("recompute, replays", [("none", 0), ("full", 1), ("selective", 0)])
def test_a_blocks_overhead_is_paid_per_block_and_micro_batch_a_third_forward(recompute, replays):
    """900 us per block and micro-batch: 300 in its forward, 600 in its backward, and 300 again in a full
    checkpoint's replay; the kernels' time and the memory do not change."""
    problem, lay, plain = _plan(f"--train.recompute={recompute}")
    problem_o, lay_o, keyed = _plan(f"--train.recompute={recompute}", OVERHEAD)
    rank = pipeline_rank(problem.shape, 1, 1, "1f1b", 0)
    a, b = microbatch_times(problem, lay, rank), microbatch_times(problem_o, lay_o, rank)
    blocks = problem.shape.n_layers
    assert b.fwd - a.fwd == pytest.approx(blocks * 300e-6)
    assert b.bwd - a.bwd == pytest.approx(blocks * 600e-6)
    assert b.recompute - a.recompute == pytest.approx(replays * blocks * 300e-6)
    assert b.block_fwd - a.block_fwd == pytest.approx(300e-6)
    micro_batches = 8 // 2  # global batch 8 over dp 2, micro-batch 1
    assert keyed.breakdown_s["outside_kernels"] == pytest.approx(micro_batches * blocks * 900e-6)
    assert keyed.breakdown_s["compute"] == pytest.approx(plain.breakdown_s["compute"])
    assert "outside_kernels" not in plain.breakdown_s
    assert keyed.memory.total == plain.memory.total
    assert "900 us per block and micro-batch" in problem_o.stack_description(lay_o)
    assert "per block and micro-batch" not in problem.stack_description(lay)


def test_unset_and_zero_overhead_price_the_same_step():
    _, _, unset = _plan()
    _, _, zero = _plan("--cluster.block_overhead_us=0")
    assert (zero.step_time_s, zero.breakdown_s) == (unset.step_time_s, unset.breakdown_s)


def test_plan_evaluate_prints_the_blocks_time_outside_their_kernels_only_when_set(capsys):
    from shardwise.cli import main

    assert main(["plan", "evaluate", *BASE, OVERHEAD]) == 0
    out = capsys.readouterr().out
    assert "blocks outside their kernels" in out and "900 us per block and micro-batch outside its kernels" in out
    assert main(["plan", "evaluate", *BASE]) == 0
    assert "outside" not in capsys.readouterr().out
