"""plan/goodput.py: GPU-hours and price, energy, and failures / checkpoints, against hand calculations."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.plan import constants as C
from shardwise.plan.cost import evaluate
from shardwise.plan.goodput import board_power_w, checkpoint_bytes, daly_interval, mtbf_hours, overhead_fraction, run_cost
from shardwise.plan.layout import Problem
from shardwise.plan.report import evaluate_text
from shardwise.spec.hardware import DEVICES
from shardwise.spec.layout import Layout

# llama3-70b on 1,024 H100s (the config the README's planner example uses)
RUN_70B = (Path(__file__).resolve().parents[2] / "configs" / "plan-llama3-70b.toml").read_text()


@pytest.fixture()
def run_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_70B)
    return path


def plan(run_toml, *overrides: str):
    cfg = load_config(run_toml, list(overrides))
    problem = Problem.from_config(cfg)
    est = evaluate(problem, Layout.from_config(cfg, problem.cluster.num_gpus))
    return problem, est, run_cost(problem, est)


# ---------------------------------------------------------------------------------------------------
# the formulas
# ---------------------------------------------------------------------------------------------------
def test_mtbf_from_the_llama3_numbers():
    """419 unexpected interruptions in 54 days on 16,384 H100 (arXiv 2407.21783 §3.3.4): one every ~3.1 h."""
    assert C.FAILURES_PER_GPU_HOUR == pytest.approx(419 / (54 * 24 * 16384))
    assert mtbf_hours(C.FAILURES_PER_GPU_HOUR, 16384) == pytest.approx(54 * 24 / 419) == pytest.approx(3.093, abs=1e-3)
    assert mtbf_hours(C.FAILURES_PER_GPU_HOUR, 1024) == pytest.approx(16 * 54 * 24 / 419)  # 16x fewer GPUs, 16x longer
    assert mtbf_hours(0.0, 1024) == math.inf


def test_daly_interval_by_hand():
    # delta = 50 s, M = 10,000 s: x = delta / 2M = 0.0025, sqrt(2 delta M) = 1000;
    # 1000 (1 + 0.05/3 + 0.0025/9) - 50 = 966.944...
    assert daly_interval(50, 10_000) == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert daly_interval(50, 10_000) == pytest.approx(966.944, abs=1e-3)
    # Within a few percent of Young's sqrt(2 delta M) while delta << M.
    assert daly_interval(50, 10_000) == pytest.approx(math.sqrt(2 * 50 * 10_000), rel=0.05)
    # delta >= 2M: checkpoint once per MTBF.
    assert daly_interval(300, 100) == 100
    assert daly_interval(5, math.inf) == math.inf


@pytest.mark.parametrize("mtbf_min, want_min", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_reproduces_dalys_examples(mtbf_min, want_min):
    """Daly 2006 (FGCS 22(3)) Figs. 3-5: delta = 5 min (R = 10 min) -> tau_opt 117, 57 and 9.1 min."""
    assert daly_interval(5.0, mtbf_min) == pytest.approx(want_min, abs=0.5 if want_min > 10 else 0.05)


def test_overhead_is_the_closed_form_and_youngs_interval_minimises_it():
    # delta 60 s, tau 1 h, M 10 h, R 10 min: 60/3600 + 3660/72000 + 600/36000
    assert overhead_fraction(60, 3600, 36_000, 600) == pytest.approx(60 / 3600 + 3660 / 72_000 + 600 / 36_000)
    assert overhead_fraction(60, 3600, 36_000, 600) == pytest.approx(0.084167, abs=1e-6)
    young = math.sqrt(2 * 60 * 36_000)
    best = overhead_fraction(60, young, 36_000, 600)
    assert best < overhead_fraction(60, young / 2, 36_000, 600) and best < overhead_fraction(60, young * 2, 36_000, 600)
    assert overhead_fraction(60, 3600, math.inf, 600) == 0.0


def test_board_power_between_idle_and_tdp():
    assert board_power_w(700, 0.0) == pytest.approx(0.15 * 700) == pytest.approx(C.IDLE_POWER_FRACTION * 700)
    assert board_power_w(700, 1.0) == pytest.approx(700)
    assert board_power_w(700, 0.5) == pytest.approx(105 + 595 * 0.5)


def test_every_device_has_its_datasheet_tdp():
    want = {"a100-sxm-40gb": 400, "a100-sxm-80gb": 400, "a100-pcie-40gb": 250, "a100-pcie-80gb": 300,
            "h100-sxm-80gb": 700, "h100-pcie-80gb": 350, "h100-nvl-94gb": 400, "h200-sxm-141gb": 700,
            "h200-nvl-141gb": 600, "b200": 1000, "mi300x": 750}
    assert {k: d.tdp_w for k, d in DEVICES.items()} == want
    for name, dev in DEVICES.items():
        assert f"{dev.tdp_w:,.0f} W" in dev.source, name  # the source string says where the figure comes from


# ---------------------------------------------------------------------------------------------------
# one estimate
# ---------------------------------------------------------------------------------------------------
def test_gpu_hours_and_price(run_toml):
    problem, est, rc = plan(run_toml)
    assert rc.gpu_hours == pytest.approx(est.days * 24 * 1024)
    assert rc.cost is None and rc.cost_with_failures is None and rc.price_per_gpu_hour == 0.0
    assert "not priced" in evaluate_text(problem, est)
    _, est2, priced = plan(run_toml, "--cluster.price_per_gpu_hour=2.5")
    assert priced.cost == pytest.approx(est2.days * 24 * 1024 * 2.5)
    assert priced.cost_with_failures == pytest.approx(priced.gpu_hours_with_failures * 2.5)
    assert priced.cost_with_failures > priced.cost


def test_energy_is_power_times_time(run_toml):
    problem, est, rc = plan(run_toml)
    b = est.breakdown_s
    busy = (b["compute"] + b["recompute"]) / est.step_time_s
    assert rc.busy_fraction == pytest.approx(busy) and 0 < busy < 1
    watts = 700 * (0.15 + 0.85 * busy)
    assert rc.power_w_per_gpu == pytest.approx(watts)
    assert rc.energy_kwh == pytest.approx(watts * 1024 * est.days * 86400 / 3.6e6)
    # J/token: all GPUs of the job per trained token (train/power.py's energy_j_per_token) — the whole
    # run's energy over its tokens, and the power over tokens/s.
    assert rc.energy_j_per_token == pytest.approx(watts * 1024 / est.tokens_per_s)
    assert rc.energy_j_per_token == pytest.approx(rc.energy_kwh * 3.6e6 / problem.tokens)


def test_checkpoint_save_time_from_the_ranks_states(run_toml):
    problem, est, rc = plan(run_toml)
    # ZeRO-1 over 16, TP8 x PP8: the first stage holds fp32 params (replicated over dp) + its optimizer shard.
    assert rc.checkpoint_bytes_per_gpu >= est.memory.params + est.memory.optimizer
    assert rc.checkpoint_bytes_per_gpu == pytest.approx(est.memory.params + est.memory.optimizer, rel=0.02)
    assert rc.checkpoint_save_s == pytest.approx(rc.checkpoint_bytes_per_gpu / 2e9) and rc.checkpoint_source == "estimated"
    assert rc.restart_s == C.RESTART_S == 600 and rc.restart_source == "assumed"
    given = plan(run_toml, "--cluster.checkpoint_save_s=30", "--cluster.restart_s=120")[2]
    assert given.checkpoint_save_s == 30 and given.restart_s == 120 and given.checkpoint_source == "config"
    # Offloading (FSDP) moves the states to the host, not out of the checkpoint.
    fsdp = ("--parallel.zero=3", "--parallel.pp=1", "--parallel.dp_shard=128")
    on_gpu, offloaded = plan(run_toml, *fsdp)[1], plan(run_toml, *fsdp, "--parallel.offload=true")[1]
    assert offloaded.memory.params == 0 and offloaded.memory.cpu_bytes > 0
    assert checkpoint_bytes(problem, offloaded.layout) == checkpoint_bytes(problem, on_gpu.layout)
    assert checkpoint_bytes(problem, on_gpu.layout) == pytest.approx(on_gpu.memory.params + on_gpu.memory.optimizer)


def test_failure_numbers_follow_the_formulas(run_toml):
    _, est, rc = plan(run_toml, "--cluster.checkpoint_save_s=60", "--cluster.restart_s=600")
    m = 1 / (C.FAILURES_PER_GPU_HOUR * 1024) * 3600
    assert rc.mtbf_hours * 3600 == pytest.approx(m) and rc.failures_source == "Llama 3 default"
    tau = daly_interval(60, m)
    assert rc.checkpoint_interval_s == pytest.approx(tau)
    assert rc.checkpoint_every_steps == round(tau / est.step_time_s)
    overhead = 60 / tau + (tau + 60) / (2 * m) + 600 / m
    assert rc.overhead == pytest.approx(overhead) and rc.goodput == pytest.approx(1 / (1 + overhead))
    assert rc.days_with_failures == pytest.approx(est.days * (1 + overhead))
    assert rc.expected_failures == pytest.approx(rc.days_with_failures * 24 * 3600 / m)


def test_an_elastic_job_pays_its_own_restart_instead_of_a_rescheduled_jobs(run_toml):
    """Elastic (train --nnodes MIN:MAX): the same overhead formula with R = the elastic restart; the checkpoint
    interval and the lost work are the same."""
    _, _, rc = plan(run_toml, "--cluster.checkpoint_save_s=60", "--cluster.restart_s=600")
    m, tau = rc.mtbf_hours * 3600, rc.checkpoint_interval_s
    assert rc.elastic_restart_s == C.ELASTIC_RESTART_S
    assert rc.elastic_overhead == pytest.approx(60 / tau + (tau + 60) / (2 * m) + C.ELASTIC_RESTART_S / m)
    assert rc.elastic_goodput > rc.goodput and rc.elastic_days_with_failures < rc.days_with_failures
    same = plan(run_toml, "--cluster.checkpoint_save_s=60", "--cluster.restart_s=600", "--cluster.elastic_restart_s=600")[2]
    assert same.elastic_overhead == pytest.approx(same.overhead)


def test_more_failures_mean_more_days(run_toml):
    none = plan(run_toml, "--cluster.failures_per_gpu_hour=0")[2]
    llama = plan(run_toml)[2]
    worse = plan(run_toml, f"--cluster.failures_per_gpu_hour={C.FAILURES_PER_GPU_HOUR * 10}")[2]
    assert none.days_with_failures == none.days and none.overhead == 0 and none.checkpoint_every_steps is None
    assert none.days_with_failures < llama.days_with_failures < worse.days_with_failures
    assert worse.goodput < llama.goodput < none.goodput == 1
    assert worse.checkpoint_every_steps < llama.checkpoint_every_steps  # checkpoint more often


def test_text_and_json_report_the_cost_block(run_toml, capsys):
    assert main(["plan", "evaluate", "--config", str(run_toml), "--cluster.price_per_gpu_hour=2"]) == 0
    out = capsys.readouterr().out
    for text in ("GPU-hours", "per GPU-hour", "MWh for the run", "J/token", "MTBF", "Llama 3 default",
                 "checkpoint.every", "goodput", "including failures"):
        assert text in out, text
    assert out.index("days for 2T tokens") < out.index("GPU-hours") < out.index("model states (params")
    assert main(["plan", "evaluate", "--config", str(run_toml), "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    for key in ("gpu_hours", "cost", "energy_kwh", "energy_j_per_token", "power_w_per_gpu", "mtbf_hours",
                "expected_failures", "checkpoint_interval_s", "checkpoint_every_steps", "checkpoint_save_s", "restart_s",
                "overhead", "goodput", "days_with_failures"):
        assert key in cost, key
    assert cost["cost"] is None and cost["cost_with_failures"] is None  # not priced
    assert cost["days_with_failures"] > cost["days"]


@pytest.mark.parametrize("key", ["price_per_gpu_hour", "failures_per_gpu_hour", "checkpoint_save_s", "restart_s"])
def test_negative_cost_keys_exit_2(run_toml, capsys, key):
    code = main(["plan", "evaluate", "--config", str(run_toml), f"--cluster.{key}=-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: cluster.{key}: must be a finite number >= 0") and "fix:" in err
