"""The planner against our own measured H100 runs (tests/fixtures/h100_runs.json), and `plan calibrate`.

The issue's bar: with no calibration file, every row within 10% step time and 10% peak memory; and
each row within 10% when predicted by the constant fitted to the *other* rows (leave-one-out), so
the one fitted constant (constants.EAGER_POINTWISE_HBM_FRACTION) is not simply absorbing each row.
Measured today: step time -3.5% .. +3.5% built in, -4.2% .. +4.5% leave-one-out; memory -4.8% .. +8.8%.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.plan import constants as C
from shardwise.plan.fit import calibrate, predict, runs_from_table
from shardwise.spec.layout import attention_backend

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "h100_runs.json"
STEP_RTOL = 0.10
MEMORY_RTOL = 0.10


@pytest.fixture(scope="module")
def result() -> dict:
    return calibrate(runs_from_table(FIXTURE))


def test_every_h100_row_within_ten_percent_without_calibration(result):
    assert len(result["runs"]) == 6
    for row in result["runs"]:
        assert row["eager"], row["name"]
        assert abs(row["step_error"]) <= STEP_RTOL, row
        assert abs(row["memory_error"]) <= MEMORY_RTOL, row


def test_leave_one_out_predicts_each_row_from_the_others(result):
    for row in result["runs"]:
        assert abs(row["leave_one_out_error"]) <= STEP_RTOL, row
        assert 0.4 < row["leave_one_out_fraction"] < 0.8, row  # stable: no single row decides it
    assert result["eager_pointwise_hbm_fraction"] == pytest.approx(C.EAGER_POINTWISE_HBM_FRACTION, abs=0.01)


def test_the_fp32_row_needs_the_math_attention_backend():
    """Without the math backend's s x s probabilities the fp32 row's memory was 28% low."""
    assert attention_backend("cuda", "fp32", gqa=True) == "math"
    assert attention_backend("cuda", "fp32", gqa=False) == "efficient"
    assert attention_backend("cuda", "bf16", gqa=True) == attention_backend("cpu", "fp32", gqa=True) == "flash"
    run = next(r for r in runs_from_table(FIXTURE) if "fp32" in r.name)
    _, peak, _ = predict(run)
    assert abs(peak / run.peak_bytes - 1) <= MEMORY_RTOL


def test_compiled_runs_are_not_charged_the_eager_terms():
    run = runs_from_table(FIXTURE)[0]
    eager, _, is_eager = predict(run)
    run.cfg.train.compile = True
    compiled, _, not_eager = predict(run)
    assert is_eager and not not_eager and compiled < 0.85 * eager


def test_calibrate_cli_writes_a_file_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "calib.json"
    assert main(["plan", "calibrate", "--runs", str(FIXTURE), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "leave-one-out" in text and "fp32 mb4 gb4" in text
    data = json.loads(out.read_text())
    data["eager_pointwise_hbm_fraction"] = 0.3  # a worse fraction must slow eager predictions down
    out.write_text(json.dumps(data))
    base = ["plan", "evaluate", "--json", *json.loads(FIXTURE.read_text())["base"]]
    assert main(base) == 0
    before = json.loads(capsys.readouterr().out)["step_time_s"]
    assert main(base + [f"--cluster.calibration={out}"]) == 0
    after = json.loads(capsys.readouterr().out)["step_time_s"]
    assert after > 1.2 * before
    data["eager_pointwise_hbm_fraction"] = 1.5
    out.write_text(json.dumps(data))
    assert main(base + [f"--cluster.calibration={out}"]) == 2
    assert "eager_pointwise_hbm_fraction" in capsys.readouterr().err


def test_calibrate_reads_run_directories(tmp_path, capsys):
    """A CPU run directory: parsed (median step time after the first logged step), reported and fitted as
    the eager run it was: train.compile unset means eager on a CPU (compiled on CUDA), which its records
    say (no compiled_graphs); it was read as compiled once, and `plan calibrate` then fitted nothing."""
    run = tmp_path / "run"
    assert main(["train", "--train.steps=4", "--train.log_every=1", "--train.seq_len=32", "--data.tokenizer=byte",
                 "--model.vocab_size=320", f"--run.dir={run}", "--run.progress=false", "--run.tensorboard=false"]) == 0
    capsys.readouterr()
    assert main(["plan", "calibrate", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["runs"][0]["eager"] is True and data["runs"][0]["measured_step_s"] > 0
    assert data["eager_pointwise_hbm_fraction"] is not None
    assert main(["plan", "calibrate", str(run), "--out", str(tmp_path / "c.json")]) == 0
    assert main(["plan", "calibrate", str(tmp_path)]) == 2


def _kernels_json(tmp_path: Path, gemm_flops: float = 2e11, gbps: float = 40.0, selective_s: float | None = None,
                  block: tuple[float, float, float] | None = None) -> Path:
    """A minimal benchmarks/kernels.py result (the fields plan/calibration.py reads); `block`: its real block's
    host cost per kernel (forward + backward, full checkpoint extra, selective checkpoint extra)."""
    overhead: dict = {"rows": [{"mode": "eager", "s_per_op": 2e-6}]}
    if selective_s is not None:
        overhead["rows"] += [{"mode": "eager+autograd (fwd+bwd)", "s_per_op": 4e-6},
                             {"mode": "selective checkpoint (fwd+recompute+bwd)", "s_per_op": 4e-6 + 3 * selective_s}]
    if block is not None:
        overhead["block"] = {"rows": [{"mode": mode, "s_per_kernel": s} for mode, s in zip(
            ("block forward + backward", "full checkpoint, extra", "selective checkpoint, extra"), block)]}
    data = {"benchmark": "kernels", "device_type": "cpu",
            "gemm": {"dtype": "fp32", "peak_flops": gemm_flops},
            "bandwidth": {"rows": [{"kernel": "copy", "gbps": gbps}]},
            "sdpa": {"rows": [{"requested": "default", "dtype": "fp32", "fwd_bwd_flops": 0.35 * gemm_flops}]},
            "overhead": overhead,
            "optimizer": {"rows": [{"impl": "foreach", "bytes_per_param_at_copy_bw": 100.0}]}}
    path = tmp_path / f"kernels_{gemm_flops:g}_{selective_s}_{'_'.join(f'{b:g}' for b in block or ())}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_cpu_is_planned_from_its_measured_rates_only(tmp_path, capsys):
    base = ["plan", "evaluate", "--json", "--model.preset=small", "--train.seq_len=128", "--train.micro_batch=4",
            "--train.global_batch=4", "--cluster.gpu=cpu", "--cluster.num_gpus=1"]
    assert main(base) == 2
    assert "kernels.py" in capsys.readouterr().err  # no datasheet for a CPU: how to measure it
    assert main(base + [f"--cluster.calibration={_kernels_json(tmp_path)}"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert main(base + [f"--cluster.calibration={_kernels_json(tmp_path, gemm_flops=4e11)}"]) == 0
    fast = json.loads(capsys.readouterr().out)
    # GEMMs dominate this model: twice the measured GEMM rate takes most of the compute time off.
    assert fast["breakdown_s"]["compute"] < 0.75 * slow["breakdown_s"]["compute"]
    # The optimizer step: 100 B/param at 40 GB/s (the measured AdamW), not the GPU constant.
    params = 7_149_824  # `small`: 7.15M
    assert slow["breakdown_s"]["optimizer"] == pytest.approx(params * 100 / 40e9, rel=0.02)


def test_a_cpu_pays_the_selective_checkpoints_dispatch_per_op(tmp_path, capsys):
    """Selective "op" recomputation on a CPU: every op of a block passes the policy's dispatch mode in
    forward, recompute and backward, at the measured extra cost per op (10 us here): small llama fp32 =
    4 blocks x (2 x 34 + 62) ops = 520 ops -> 5.2 ms more recompute."""
    base = ["plan", "evaluate", "--json", "--model.preset=small", "--train.seq_len=128", "--train.micro_batch=4",
            "--train.global_batch=4", "--cluster.gpu=cpu", "--cluster.num_gpus=1", "--train.recompute=selective"]
    recompute = []
    for selective_s in (None, 10e-6):
        assert main(base + [f"--cluster.calibration={_kernels_json(tmp_path, selective_s=selective_s)}"]) == 0
        recompute.append(json.loads(capsys.readouterr().out)["breakdown_s"]["recompute"])
    assert recompute[1] - recompute[0] == pytest.approx(4 * (2 * 34 + 62) * 10e-6, rel=1e-6)



def test_a_cpu_pays_a_real_blocks_host_cost_per_kernel(tmp_path, capsys):
    """With a kernels.py file that timed a real block on 1 token (block_overhead), a CPU's host cost per kernel
    is that block's, not the `x + 1` chain's, and a checkpoint adds its measured extra per forward kernel:
    small llama fp32 = 4 blocks x 34 forward kernels (plan/constants.py EAGER_BLOCK_KERNELS) x the extra.
    Before this, a selective checkpoint was priced at a fifth of what the trainer's runs measured
    (benchmarks/plan_accuracy.py: -23% built in, -14% leave-one-out; after: -13% and -0.2%)."""
    base = ["plan", "evaluate", "--json", "--model.preset=small", "--train.seq_len=128", "--train.micro_batch=4",
            "--train.global_batch=4", "--cluster.gpu=cpu", "--cluster.num_gpus=1"]
    costs = (17e-6, 50e-6, 150e-6)

    def breakdown(recompute: str, block) -> dict:
        path = _kernels_json(tmp_path, selective_s=10e-6, block=block)
        assert main(base + [f"--train.recompute={recompute}", f"--cluster.calibration={path}"]) == 0
        return json.loads(capsys.readouterr().out)["breakdown_s"]

    chain, real = breakdown("none", None), breakdown("none", costs)
    fwd_k, bwd_k = 34, 62  # plan/constants.py EAGER_BLOCK_KERNELS[("llama", "fp32")]
    rest_k = 10 + 19       # EAGER_REST_KERNELS: embedding, final norm, head, loss
    assert real["compute"] - chain["compute"] == pytest.approx((4 * (fwd_k + bwd_k) + rest_k) * (17e-6 - 2e-6), rel=1e-6)
    full = breakdown("full", costs)["recompute"] - breakdown("full", (17e-6, 0.0, 0.0))["recompute"]
    assert full == pytest.approx(4 * fwd_k * 50e-6, rel=1e-6)
    selective = breakdown("selective", costs)["recompute"] - breakdown("selective", (17e-6, 0.0, 0.0))["recompute"]
    assert selective == pytest.approx(4 * fwd_k * 150e-6, rel=1e-6)


COMPILED = Path(__file__).resolve().parents[1] / "fixtures" / "h100_runs_compiled.json"
# Rows whose peak the planner does not yet hold to 10% (issue 29 stays open on them), with the error it
# has. The measured peaks depend on the harness by up to 8.4 GiB for one config (2.4B bf16: 52.9 and
# 61.3 GiB in two passes of benchmarks/gpu_throughput.py, which did not free the previous pass first);
# fp16 read 2.8 GiB above bf16 where eager they were equal, and the CLI's 2.4B mb2 row 8 GiB below the
# planner's params + grads + optimizer + activations, as if grads and activations did not coexist.
MEMORY_OPEN = {"886M fp16 mb8 compiled": (-0.15, -0.10),
               "2.4B bf16 mb2 compiled (shardwise train CLI default on CUDA, 6 steps)": (0.10, 0.22)}


@pytest.fixture(scope="module")
def compiled_result() -> dict:
    return calibrate(runs_from_table(COMPILED))


def test_every_compiled_h100_row_within_ten_percent_in_step_time(compiled_result):
    """Before plan/compiled.py the compiled rows were predicted 26-51% slow and 9-35% high in memory."""
    rows = compiled_result["runs"]
    assert len(rows) == 10 and sum(r["eager"] for r in rows) == 1
    for row in rows:
        assert abs(row["step_error"]) <= STEP_RTOL, row
        low, high = MEMORY_OPEN.get(row["name"], (-MEMORY_RTOL, MEMORY_RTOL))
        assert low <= row["memory_error"] <= high, row


def test_compiled_rows_leave_one_out_within_five_percent_after_calibrate(compiled_result, tmp_path, capsys):
    """`plan calibrate` fits the compiled (fused) kernels' HBM fraction to the compiled rows; each row predicted
    by the fraction fitted to the other eight is within 5% (measured today: -3.3% .. +3.5%)."""
    fitted = compiled_result["compiled_pointwise_hbm_fraction"]
    assert 0.6 < fitted <= 1.0
    for row in compiled_result["runs"]:
        if not row["eager"]:
            assert abs(row["leave_one_out_error"]) <= 0.05, row
            assert 0.6 < row["leave_one_out_fraction"] <= 1.0, row
    out = tmp_path / "calib.json"
    assert main(["plan", "calibrate", "--runs", str(COMPILED), "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    data["compiled_pointwise_hbm_fraction"] = 0.3  # slower fused kernels must slow a compiled prediction down
    out.write_text(json.dumps(data))
    run = ["plan", "evaluate", "--json", *json.loads(FIXTURE.read_text())["base"], "--train.compile=true"]
    assert main(run) == 0
    before = json.loads(capsys.readouterr().out)["step_time_s"]
    assert main(run + [f"--cluster.calibration={out}"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 1.05 * before


def test_the_stack_is_a_planning_input(capsys):
    base = ["plan", "evaluate", "--json", *json.loads(FIXTURE.read_text())["base"], "--train.compile=true"]
    assert main(base) == 0
    today = json.loads(capsys.readouterr().out)
    assert today["stack"] == "compiled blocks (inductor), attention cudnn, AdamW fused, norms fused, loss compiled"
    slower = {"--cluster.attention_kernel=flash": "compute", "--cluster.attention_kernel=math": "compute",
              "--cluster.optimizer_kernel=foreach": "optimizer", "--cluster.loss_kernel=eager": "compute",
              "--train.compile=false": "compute"}
    for flag, term in slower.items():
        assert main(base + [flag]) == 0
        other = json.loads(capsys.readouterr().out)
        assert other["breakdown_s"][term] > today["breakdown_s"][term], flag
    assert main(base + ["--cluster.attention_kernel=math"]) == 0  # the s x s probabilities are saved
    assert json.loads(capsys.readouterr().out)["memory_gib"]["activations"] > today["memory_gib"]["activations"]
    eager = base + ["--train.compile=false"]
    assert main(eager) == 0
    unfused = json.loads(capsys.readouterr().out)["breakdown_s"]["compute"]
    assert main(eager + ["--cluster.norm_kernel=fused"]) == 0
    assert json.loads(capsys.readouterr().out)["breakdown_s"]["compute"] < unfused
    assert main(base[:2] + base[3:]) == 0 and "stack    compiled blocks (inductor)" in capsys.readouterr().out
    assert main(base + ["--cluster.attention_kernel=xformers"]) == 2
    assert "cluster.attention_kernel" in capsys.readouterr().err


def test_calibrate_reads_the_gpu_rows_format_with_overrides(capsys):
    assert main(["plan", "calibrate", "--runs", str(COMPILED), "--cluster.loss_kernel=compiled", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert len(rows) == 10 and all(r["measured_step_s"] > 0 for r in rows)
    assert main(["plan", "calibrate", "--runs", str(COMPILED), "stray"]) == 2


def test_a_gpu_kernels_file_calibrates_every_h100_row_within_ten_percent():
    """--cluster.calibration with the H100's own benchmarks/kernels.py result (tests/fixtures/kernels_h100.json):
    its best square GEMM sets the GEMM rate (its file's peak_flops is the datasheet's), the other dtypes
    keep their datasheet ratios, eager kernels their ratio to the copy rate, and the measured SDPA, AdamW and
    clipping rates replace the constants. Before, every peak became the bf16 datasheet figure and eager
    kernels streamed at the copy rate: -79% (fp32) .. +14% (FP8). Measured today: +1.0% .. +7.2%."""
    kernels = Path(__file__).resolve().parents[1] / "fixtures" / "kernels_h100.json"
    runs = runs_from_table(COMPILED, [f"--cluster.calibration={kernels}"])
    runs += runs_from_table(FIXTURE, [f"--cluster.calibration={kernels}"])
    for run in runs:
        step, _, _ = predict(run)
        assert abs(step / run.step_time_s - 1) <= STEP_RTOL, run.name
    # MFU stays against the datasheet peak (the measured GEMM rate prices the step, it is not the yardstick).
    from shardwise.plan.cost import evaluate
    from shardwise.plan.layout import Problem
    from shardwise.spec.layout import Layout

    run = runs[0]
    problem = Problem.from_config(run.cfg)
    est = evaluate(problem, Layout.from_config(run.cfg, 1))
    assert est.mfu == pytest.approx(est.model_tflops_per_gpu / 989.4)


# benchmarks/gpu_check.py offload-big/cpu on one H100 80GB, 2026-11-27 (bbd39f7; ../shared/gpu/h100-2026-11-27/
# gcbig_report.json): a 6.1B LLaMA whose 98 GB of model states live in host memory (ZeRO-Offload on one
# GPU), bf16 compiled, the median of step 3. The config is the row's own (gpu_check.py MODELS + offload_big).
OFFLOAD_BIG = ["--model.preset=small", "--model.dim=4096", "--model.n_layers=33", "--model.n_heads=32",
               "--model.n_kv_heads=8", "--model.ffn_dim=11008", "--model.vocab_size=32000", "--model.max_seq_len=512",
               "--train.seq_len=512", "--train.micro_batch=1", "--train.global_batch=1", "--parallel.offload=cpu",
               "--parallel.zero=3", "--train.recompute=full", "--train.precision=bf16", "--train.compile=true",
               "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=1", "--cluster.gpus_per_node=1"]
OFFLOAD_BIG_STEP_S, OFFLOAD_BIG_PEAK_GIB = 5.5770, 2.2916


def test_the_offload_row_larger_than_the_gpu_within_ten_percent(capsys):
    """The step is the host's: copies over the host link and CPU AdamW over 6.1B parameters (99% of it):
    -3.4%. Its GPU peak is FSDP2's world-size-1 transients (plan/memory.py one_rank): one block and the
    root gathered, the block's bf16 gradients, the previous block's fp32 reduce-scatter input held until
    this one reduces, the head's gradients: 2.41 GiB, +5%. Before, two gathered blocks, a block's fp32
    gradients and a whole block's fp32 + bf16 staging copy, as if they coexisted, gave 3.15 (+38%)."""
    assert main(["plan", "evaluate", "--json", *OFFLOAD_BIG]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["step_time_s"] / OFFLOAD_BIG_STEP_S - 1) <= STEP_RTOL, plan["step_time_s"]
    assert abs(plan["memory_gib"]["total"] / OFFLOAD_BIG_PEAK_GIB - 1) <= MEMORY_RTOL, plan["memory_gib"]


def test_complex_rope_is_an_eager_kernel_inside_a_compiled_block(capsys):
    """cluster.rope_kernel = "complex" (torchtitan's view_as_complex RoPE, plan/stack.py): compiled, inductor
    runs the multiply as its eager fallback between two casts where the fused kernels read and wrote q and k
    once, and a compiled recomputation reruns it; eager, those three kernels move half the bytes of the
    trainer's ten-pass real RoPE (20 against 40 B per element of q and k)."""
    base = ["plan", "evaluate", "--json", *json.loads(FIXTURE.read_text())["base"], "--train.recompute=selective"]

    def price(*extra: str) -> dict:
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    fused, complex_ = price("--train.compile=true"), price("--train.compile=true", "--cluster.rope_kernel=complex")
    assert complex_["stack"].endswith(", RoPE as complex multiplication")
    assert complex_["breakdown_s"]["compute"] > fused["breakdown_s"]["compute"]
    assert complex_["breakdown_s"]["recompute"] > fused["breakdown_s"]["recompute"]
    eager, eager_complex = price(), price("--cluster.rope_kernel=complex")
    assert eager_complex["breakdown_s"]["compute"] < eager["breakdown_s"]["compute"]
    # a GPT block has no RoPE: nothing to price
    gpt = ["--model.arch=gpt", "--train.compile=true"]
    assert price(*gpt)["step_time_s"] == price(*gpt, "--cluster.rope_kernel=complex")["step_time_s"]
    assert main(base + ["--cluster.rope_kernel=polar"]) == 2
    assert "cluster.rope_kernel" in capsys.readouterr().err
