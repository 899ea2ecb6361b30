"""Two things NVIDIA's Nemotron-4 340B recipe runs that the planner could not describe until issue 60 found its
128- and 512-GPU rows "not fitting" the 80 GB they ran on (101 and 77 GiB planned):

- cluster.optimizer_state_dtype = "bf16": AdamW's master copy and moments in bf16 under "mixed" model states
  (the YAML's optim.dtype bf16, Apex DistributedFusedAdam's optimizer-state dtype): 2 + 2 + 6 bytes/param;
- cluster.selective_recompute = "attention_core": Megatron-LM's selective recomputation, which checkpoints the
  attention core alone (Korthikanti et al. 2022 §5), where the trainer's "op" policy reruns the pointwise
  ops and the SP all-gathers and keeps every matmul output."""
from __future__ import annotations

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

# Llama 3 8B on 8 H100s, TP 4 with SP, ZeRO-1 over 2, one micro-batch of 4,096 tokens held at a time (no pipeline)
BASE = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=8",
        "--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.tp=4", "--train.micro_batch=1",
        "--train.global_batch=8", "--cluster.model_states=mixed", "--train.precision=bf16"]
CORE = "--cluster.selective_recompute=attention_core"


def _plan(*extra: str):
    cfg = build_config(None, parse_overrides([*BASE, *extra]))
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, problem.cluster.num_gpus)
    return problem, lay, evaluate(problem, lay)


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
    _, _, core = _plan("--train.recompute=selective", CORE)
    _, _, layer = _plan("--train.recompute=selective", "--train.recompute_policy=layer", CORE)
    s = problem.shape
    lse = 4 * s.n_heads / 4 * 4096
    assert core.memory.activations == pytest.approx(none.memory.activations - (s.n_layers - 1) * lse)
    assert (layer.memory.activations, layer.step_time_s) == (core.memory.activations, core.step_time_s)
    problem_c, lay_c, _ = _plan("--train.recompute=selective", CORE)
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
