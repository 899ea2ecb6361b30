"""Two descriptions of torchtitan's published runs on Meta's 500 W H100s (issue 60), as the planner prices them:

- cluster.sp_gather = "fp8": with Float8 on, torchtitan's apply_tp swaps in torchao's Float8ColwiseParallel /
  Float8RowwiseParallel / PrepareFloat8ModuleInput, which scale a block's input on its sequence shard and
  all-gather it in e4m3, and a row-parallel output's gradient in e5m2: SP's all-gathers move 1 byte an element
  where the trainer's own TP styles move bf16 (parallel/float8.py); the reduce-scatters stay bf16;
- cluster.peak_tflops: a part clocked below its datasheet (a power limit) runs every precision's peak at the stated
  bf16 peak over the datasheet's; memory-bound kernels keep the stated bandwidth.
Fitted to the torchtitan rows of the published set: benchmarks/plan_published.py, with its leave-one-out column."""
from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.config import build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.plan.comm import collectives
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.spec.layout import Layout

# Llama 3 8B on 8 H100s, FSDP 2 x TP 4 with SP, FP8 (torchao tensorwise), full recomputation
BASE = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=8",
        "--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.tp=4", "--train.micro_batch=1",
        "--train.global_batch=8", "--train.recompute=full", "--train.precision=fp8", "--train.compile=true"]
FP8_GATHER = "--cluster.sp_gather=fp8"


def _plan(*extra: str):
    cfg = build_config(None, parse_overrides([*BASE, *extra]))
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, problem.cluster.num_gpus)
    return problem, lay, evaluate(problem, lay)


def _tp(problem, lay) -> dict[tuple[str, str, str], float]:
    """Bytes per step of each (kind, phase, unit) of the tp axis."""
    out: dict[tuple[str, str, str], float] = {}
    for c in collectives(problem, lay):
        if c.axis == "tp":
            out[c.kind, c.phase, c.unit] = out.get((c.kind, c.phase, c.unit), 0.0) + c.payload * c.calls
    return out


def test_fp8_gathers_halve_the_blocks_all_gathers_and_nothing_else():
    """Forward (the block inputs), backward (the row-parallel outputs' gradients) and the full replay's all-gathers
    move 1 byte where bf16 moved 2; the reduce-scatters, the head's gather and the loss are unchanged."""
    problem, lay, bf16 = _plan()
    problem8, lay8, fp8 = _plan(FP8_GATHER)
    before, after = _tp(problem, lay), _tp(problem8, lay8)
    assert set(before) == set(after)
    halved = {k for k in before if k[0] == "all_gather" and k[2] == "act"}
    assert {(p, u) for _, p, u in halved} == {("fwd", "act"), ("bwd", "act"), ("recompute", "act")}
    for key in before:
        assert after[key] == (before[key] / 2 if key in halved else before[key]), key
    assert fp8.breakdown_s["tp_comm"] < bf16.breakdown_s["tp_comm"]
    assert fp8.breakdown_s["compute"] == bf16.breakdown_s["compute"]  # the casts are priced as before
    assert "SP all-gathers in FP8" in problem8.stack_description(lay8)
    assert "SP all-gathers in FP8" not in problem.stack_description(lay)


@pytest.mark.parametrize("extra", [["--train.precision=bf16"], ["--train.fp8_recipe=rowwise"],
                                   ["--parallel.sequence_parallel=false"], ["--parallel.tp=1", "--parallel.dp_shard=8"]])
def test_fp8_gathers_need_fp8_tensorwise_and_sequence_parallelism(extra):
    """torchao's float8 TP styles gather in FP8 under tensorwise scaling only, and only SP gathers: elsewhere the
    key prices the same step as unset."""
    problem, lay, plain = _plan(*extra)
    problem8, lay8, keyed = _plan(*extra, FP8_GATHER)
    assert keyed.step_time_s == plain.step_time_s and _tp(problem, lay) == _tp(problem8, lay8)
    assert "SP all-gathers in FP8" not in problem8.stack_description(lay8)


def test_an_unknown_gather_dtype_is_refused_on_its_field(capsys):
    with pytest.raises(ConfigError) as e:
        _plan("--cluster.sp_gather=fp16")
    assert e.value.field == "cluster.sp_gather"
    assert main(["plan", "evaluate", *BASE, "--cluster.sp_gather=fp16"]) == 2
    assert "cluster.sp_gather" in capsys.readouterr().err


def test_a_lower_peak_scales_every_precision_and_slows_the_gemms_only():
    """500 W H100s at the NVL's 835.5 TFLOP/s bf16: FP8's peak scales alike, the GEMM-bound compute slows by at most
    989.4 / 835.5, memory-bound work (the optimizer step) and the communication keep their time."""
    datasheet, lay, full = _plan()
    slow, lay_s, capped = _plan("--cluster.peak_tflops=835.5")
    ratio = 835.5 / 989.4
    assert slow.cluster.device.peak_flops("bf16") == pytest.approx(835.5e12)
    assert slow.cluster.device.peak_flops("fp8") == pytest.approx(datasheet.cluster.device.peak_flops("fp8") * ratio)
    assert slow.cluster.device.name == datasheet.cluster.device.name  # the family's constants still apply
    assert slow.cluster.device.memory_bandwidth_gbps == datasheet.cluster.device.memory_bandwidth_gbps
    assert full.breakdown_s["compute"] * 1.05 < capped.breakdown_s["compute"] <= full.breakdown_s["compute"] / ratio
    assert capped.breakdown_s["optimizer"] == full.breakdown_s["optimizer"]
    assert capped.breakdown_s["tp_comm"] >= full.breakdown_s["tp_comm"]  # exposed: less compute to hide it behind
    assert _plan("--cluster.peak_tflops=0")[2].step_time_s == full.step_time_s
    assert _plan("--cluster.peak_tflops=989.4")[2].step_time_s == pytest.approx(full.step_time_s, rel=1e-12)


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_negative_or_infinite_peak_is_refused_on_its_field(value, capsys):
    with pytest.raises(ConfigError) as e:
        _plan(f"--cluster.peak_tflops={value}")
    assert e.value.field == "cluster.peak_tflops"
    assert main(["plan", "evaluate", *BASE, f"--cluster.peak_tflops={value}"]) == 2
    err = capsys.readouterr().err
    assert "cluster.peak_tflops" in err and "Traceback" not in err


def test_plan_evaluate_states_the_peak_it_priced(capsys):
    assert main(["plan", "evaluate", *BASE, "--cluster.peak_tflops=835.5"]) == 0
    assert f"{1978.9 * 835.5 / 989.4:.1f} TFLOP/s dense fp8" in capsys.readouterr().out
