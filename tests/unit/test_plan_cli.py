"""`shardwise plan evaluate | search`: tables, --json, --emit round trip, --plot, and bad input (exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.config import load_config

SRC = Path(__file__).resolve().parents[2] / "src"
RUN_70B = """
[model]
preset = "llama3-70b"

[train]
seq_len = 8192
global_batch = 512
micro_batch = 1
precision = "bf16"
tokens = 2000000000000

[parallel]
dp_replicate = 16
tp = 8
pp = 8

[cluster]
gpu = "h100-sxm-80gb"
num_gpus = 1024
gpus_per_node = 8
"""


SMALL = ["--cluster.num_gpus=64", "--train.global_batch=64"]  # the same model on 8 nodes: a quick search


@pytest.fixture()
def run_toml(tmp_path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(RUN_70B)
    return path


def test_evaluate_prints_memory_time_and_throughput(run_toml, capsys):
    assert main(["plan", "evaluate", "--config", str(run_toml)]) == 0
    out = capsys.readouterr().out
    for text in ("memory per GPU", "optimizer state", "activations", "exposed comm tp", "pipeline bubble",
                 "tokens/s", "MFU", "days for 2T tokens", "1,129 GB for the whole model"):
        assert text in out, text


def test_evaluate_json_has_the_documented_keys(run_toml, capsys):
    assert main(["plan", "evaluate", "--config", str(run_toml), "--json", "--cluster.model_states=mixed",
                 "--assume-mfu", "0.4"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "days", "fits", "memory_gib", "breakdown_s"):
        assert key in data
    assert set(data["memory_gib"]) == {"params", "grads", "optimizer", "activations", "other", "total"}
    assert {"compute", "recompute", "dp_comm", "tp_comm", "pp_comm", "cp_comm", "ep_comm", "bubble"} <= set(data["breakdown_s"])
    assert data["mfu"] == pytest.approx(0.4) and data["days_6nd"] == pytest.approx(24.2, abs=0.1)
    # 2 + 2 + 12 bytes/param on the first TP8 x PP8 stage: 19.2 GB = 17.9 GiB (see test_plan_memory).
    states = sum(data["memory_gib"][k] for k in ("params", "grads", "optimizer"))
    assert states == pytest.approx(19.22e9 / 2**30, abs=0.01)


def test_search_emits_a_toml_that_loads_with_only_existing_keys(run_toml, tmp_path, capsys):
    emitted = tmp_path / "best.toml"
    plot = tmp_path / "search.png"
    assert main(["plan", "search", "--config", str(run_toml), "--top", "3", "--emit", str(emitted),
                 "--plot", str(plot), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "top 3 layouts" in out and "why the rest lost" in out and "pruned" in out and f"wrote {emitted}" in out
    cfg = load_config(emitted)  # strict: an unknown key would raise
    assert cfg.model.preset == "llama3-70b" and cfg.cluster.num_gpus == 64
    p = cfg.parallel
    assert p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp == 64
    assert plot.stat().st_size > 10_000
    # What the plan knows, in place of the defaults: the steps of train.tokens, the Young/Daly interval
    # (plan evaluate's "checkpoint.every N"), a run directory of the model; lr and warm-up are flagged.
    t = cfg.train
    assert t.steps == -(-t.tokens // (t.global_batch * t.seq_len)) and cfg.run.dir == "runs/llama3-70b"
    assert main(["plan", "evaluate", "--config", str(emitted)]) == 0
    assert f"checkpoint.every {cfg.checkpoint.every} " in capsys.readouterr().out and cfg.checkpoint.every > 0
    assert "train.lr = 0.003, train.warmup_steps = 20 are the defaults" in out


def test_search_json(run_toml, capsys):
    assert main(["plan", "search", "--config", str(run_toml), "--top", "2", "--json", *SMALL]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["top"]) == 2 and data["best"] == data["top"][0] and data["feasible"] >= 2
    assert data["top"][0]["step_time_s"] <= data["top"][1]["step_time_s"] and data["pruned"]


def test_evaluate_plot(run_toml, tmp_path):
    assert main(["plan", "evaluate", "--config", str(run_toml), "--plot", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").stat().st_size > 5_000


@pytest.mark.parametrize("args, field", [
    (["--cluster.gpu=h999"], "cluster.gpu"),
    (["--parallel.tp=3"], "parallel"),                         # 16 x 3 x 8 != 1024
    (["--parallel.dp_replicate=1", "--parallel.pp=128"], "parallel.pp"),  # 128 stages > 80 layers
    (["--cluster.model_states=fp8"], "cluster.model_states"),
    (["--train.global_batch=100"], "train.global_batch"),
])
def test_bad_input_exits_2_with_the_field(run_toml, capsys, args, field):
    code = main(["plan", "evaluate", "--config", str(run_toml), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {field}") and "fix:" in err


def test_bad_gpu_in_a_subprocess_has_no_traceback(run_toml):
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", "evaluate", "--config", str(run_toml),
                          "--cluster.gpu=a100-sxm-96gb"], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "error: cluster.gpu: unknown device 'a100-sxm-96gb'" in out.stderr and "Traceback" not in out.stderr
    assert "did you mean" in out.stderr


def test_plan_needs_an_action(capsys):
    assert main(["plan"]) == 2 and "expected 'evaluate' or 'search'" in capsys.readouterr().err


def test_evaluate_says_whether_this_trainer_runs_the_layout(tmp_path, capsys):
    """--json says whether this trainer runs the planned layout (context parallel does now)."""
    config = tmp_path / "run.toml"
    config.write_text(RUN_70B)
    assert main(["plan", "evaluate", "--config", str(config), "--json", "--parallel.cp=2",
                 "--parallel.dp_replicate=8"]) == 0  # 8 x cp2 x tp8 x pp8 = 1024
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] is True and out["trainer_refusal"] is None
    # Pipeline layouts are trained now: TP8 x PP8 x DP16 (1F1B, 32 micro-batches) runs as planned.
    assert main(["plan", "evaluate", "--config", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] is True and out["trainer_refusal"] is None
    # ... and so does zero=1 with tp, on the same pipeline.
    assert main(["plan", "evaluate", "--config", str(config), "--json", "--parallel.dp_replicate=1",
                 "--parallel.dp_shard=16", "--parallel.zero=1", "--parallel.pp_schedule=zbv",
                 "--parallel.pp_virtual_stages=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trainable"] is True and out["parallel"]["schedule"] == "zbv"
    # The planner itself applies the trainer's schedule rules (dualpipev needs 2 x pp micro-batches).
    assert main(["plan", "evaluate", "--config", str(config), "--json", "--parallel.pp_schedule=dualpipev",
                 "--parallel.pp_virtual_stages=2", "--train.micro_batch=4"]) == 2
    assert "train.micro_batch" in capsys.readouterr().err


def test_evaluate_says_how_the_pipeline_bubble_was_priced(capsys):
    """The bubble line: the schedule's order at the lighter rank's times, and what the step's heavier rank
    fills of it (spec/stages.py rank_bubble): all of it for DualPipeV with the 70B example's head on rank 0,
    nothing for 1F1B; and no line without a pipeline."""
    example = str(Path(__file__).resolve().parents[2] / "configs" / "plan-llama3-70b.toml")
    assert main(["plan", "evaluate", "--config", example]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bubble"))
    assert "1f1b over 8 ranks, 32 micro-batches: its action order idles" in line and "fills" not in line
    v_shaped = ["--parallel.tp=2", "--parallel.cp=4", "--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual_stages=2",
                "--train.recompute=full"]
    assert main(["plan", "evaluate", "--config", example, *v_shaped, "--json"]) == 0
    bubble = json.loads(capsys.readouterr().out)["breakdown_s"]["bubble"]
    assert main(["plan", "evaluate", "--config", example, *v_shaped]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bubble"))
    assert "the step's rank (the first pipeline rank), heavier, fills" in line and bubble == 0.0
    assert main(["plan", "evaluate", "--config", example, "--parallel.pp=1", "--parallel.dp_shard=128"]) == 0
    assert not any(ln.startswith("bubble") for ln in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("asked", ["even", "balanced"])
def test_an_emitted_split_is_said_one_way(asked):
    """Issue 62: best.toml had pp_split = "even" beside an explicit pp_layers_per_stage (with a user's "balanced",
    a pair pre-flight refuses). The search's balanced variant is written as pp_split = "balanced" alone, another
    split as the explicit list with "even", an even split with neither; each prices the same layout."""
    from shardwise.plan.command import _split_keys
    from shardwise.spec.layout import Layout
    from shardwise.spec.rules import pipeline_split_rules

    example = str(Path(__file__).resolve().parents[2] / "configs" / "plan-llama3-70b.toml")
    v = ["--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual_stages=2", f"--parallel.pp_split={asked}"]
    balanced = [5] * 14 + [6, 4]
    for split, want in ((balanced, ("balanced", [])), ([6] + [5] * 14 + [4], ("even", [6] + [5] * 14 + [4])),
                        ([], ("even", []))):
        cfg = load_config(example, v)
        cfg.parallel.pp_layers_per_stage = list(split)
        _split_keys(cfg)
        assert (cfg.parallel.pp_split, cfg.parallel.pp_layers_per_stage) == want
        assert next(pipeline_split_rules(cfg.parallel, 80), None) is None
        assert list(Layout.from_config(cfg, 1024).stage_layers) == split


def test_the_bubble_line_of_a_split_layout_gives_the_tables_bubble(capsys):
    """Issue 62: `plan evaluate` of the best.toml plan search emits for the 70B example (DualPipeV over a balanced
    split) printed "its action order idles 0.106 s at the lighter pipeline rank's micro-batch times" beside a step
    table whose pipeline bubble was 0.295 s: under a split the bubble is the order replayed at every stage's times,
    and the line now gives that figure, the table's, and says so."""
    import re

    example = str(Path(__file__).resolve().parents[2] / "configs" / "plan-llama3-70b.toml")
    best = ["--parallel.dp_shard=16", "--parallel.tp=2", "--parallel.cp=4", "--parallel.zero=2", "--train.micro_batch=1",
            "--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual_stages=2", '--parallel.pp_split=balanced',
            "--train.recompute=none"]
    assert main(["plan", "evaluate", "--config", example, *best, "--json"]) == 0
    bubble = json.loads(capsys.readouterr().out)["breakdown_s"]["bubble"]
    assert main(["plan", "evaluate", "--config", example, *best]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bubble"))
    assert "blocks per stage [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 4]" in line
    figures = [float(x) for x in re.findall(r"idles ([\d.]+) s", line)]
    assert figures == [pytest.approx(bubble, abs=1e-3)] and bubble > 0.2 and "the table's pipeline bubble" in line


def test_evaluate_prices_the_trainers_own_split(capsys):
    """parallel.pp_layers_per_stage and pp_split="balanced" are priced as the trainer cuts (every pipeline rank
    sized, plan/inventory.py sized_ranks); before, `plan evaluate` priced an even split whatever was asked. An
    explicit even split is the even split; a malformed one is refused as `shardwise train` refuses it."""
    base = ["plan", "evaluate", "--json", "--model.preset=llama3-8b", "--train.seq_len=4096", "--train.global_batch=32",
            "--train.micro_batch=1", "--parallel.pp=4", "--cluster.num_gpus=4", "--cluster.gpu=h100-sxm-80gb"]

    def plan(*extra: str) -> dict:
        assert main(base + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    even = plan()
    assert plan("--parallel.pp_layers_per_stage=8,8,8,8") == even
    first_heavy = plan("--parallel.pp_layers_per_stage=11,7,7,7")  # 11 blocks and the embedding on rank 0
    assert first_heavy["memory_rank"] == "first" and first_heavy["memory_gib"]["total"] > 1.2 * even["memory_gib"]["total"]
    assert first_heavy["step_time_s"] > 1.05 * even["step_time_s"]
    balanced = plan("--parallel.pp_split=balanced")  # [8, 9, 9, 6]: the head's stage gets fewer blocks
    assert balanced["step_time_s"] < 0.95 * even["step_time_s"]
    assert main(base[:2] + base[3:] + ["--parallel.pp_layers_per_stage=11,7,7,7"]) == 0
    assert "blocks per stage [11, 7, 7, 7], priced at each stage's own times (every rank's times, spec/stages.py " \
           "looped_bubbles)" in capsys.readouterr().out
    assert first_heavy["split_notes"] == []
    uneven = ["--parallel.pp_virtual_stages=2", "--parallel.pp_layers_per_stage=3,4,4,4,4,4,4,5"]
    assert plan("--parallel.pp_schedule=interleaved_1f1b", *uneven)["split_notes"] == []  # its order replayed
    assert plan("--parallel.pp_schedule=zbv", "--train.global_batch=64", *uneven)["split_notes"] == []  # and ZB-V's
    assert main(base + ["--parallel.pp_layers_per_stage=7,9,9"]) == 2
    assert capsys.readouterr().err.startswith("error: parallel.pp_layers_per_stage: [7, 9, 9] must give each")


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_an_uneven_even_split_of_a_written_out_order_is_priced_stage_by_stage(schedule):
    """32 blocks over pp8 x 3 virtual stages: the even split gives the first 8 stages 2 blocks and the other 16
    one (spec/stages.py even_split, as the trainer cuts), so each rank's stages differ. Priced at the rank's
    average its peak was 8.2% low (interleaved: 61.17 against 66.66 GiB) and its step 2.3% fast; now as the
    same split given explicitly: every rank sized, torch's order replayed (plan/inventory.py priced_layout),
    the search's screen aside."""
    from shardwise.plan.cost import evaluate, step_seconds
    from shardwise.plan.inventory import priced_layout
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import memory
    from shardwise.plan.screen import peak_bytes
    from shardwise.spec.layout import Layout
    from shardwise.spec.stages import even_split

    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=4096", "--train.global_batch=32",
                             "--train.micro_batch=1", "--parallel.pp=8", f"--parallel.pp_schedule={schedule}",
                             "--parallel.pp_virtual_stages=3", "--cluster.num_gpus=8", "--cluster.gpu=h100-sxm-80gb"])
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, 8)
    assert lay.stage_layers == ()
    explicit = lay.with_(stage_layers=tuple(even_split(32, 24)))
    got, want = evaluate(problem, lay), evaluate(problem, explicit)
    assert got.step_time_s == want.step_time_s and got.breakdown_s == want.breakdown_s
    assert got.memory.total == want.memory.total and got.memory.rank == want.memory.rank
    # the search's screen keeps the rank's average (cheap at pp64); its shown layouts are evaluated as above
    assert peak_bytes(problem, lay, schedule, 3) <= memory(problem, lay).total
    assert step_seconds(problem, lay, schedule, 3) != got.step_time_s
    if schedule == "interleaved_1f1b":
        assert got.memory.total / 2**30 == pytest.approx(66.66, abs=0.01)
        assert peak_bytes(problem, lay, schedule, 3) / 2**30 == pytest.approx(61.17, abs=0.01)  # the rank's average
    whole = Layout.from_config(load_config(None, ["--model.preset=llama3-8b", "--parallel.pp=4", "--train.micro_batch=1",
                                                  "--train.global_batch=32", f"--parallel.pp_schedule={schedule}",
                                                  "--parallel.pp_virtual_stages=2"]), 4)
    assert priced_layout(problem.shape, whole) is whole  # 32 blocks over 8 stages: the closed forms, exact there


def test_the_search_offers_no_uneven_interleaved_layout_that_needs_more_than_the_gpu():
    """--allow-uneven-pp, a 30-block Llama 3 8B on 8 A100 40GB: the search screens at the ranks' average
    (plan/screen.py peak_bytes) and showed dp_shard2 x tp2 x pp2 interleaved v4 (z2 and z3, 30 blocks over 8
    stages as [4]*6 + [3]*2), which priced stage by stage needs more than the GPU has: a job planned so would
    run out of memory. Every layout it offers now fits as the trainer's own split prices it."""
    from shardwise.plan.layout import Problem
    from shardwise.plan.memory import memory
    from shardwise.plan.search import search
    from shardwise.spec.stages import WRITTEN_OUT, even_split

    cfg = load_config(None, ["--model.preset=llama3-8b", "--model.n_layers=30", "--train.seq_len=4096",
                             "--train.global_batch=32", "--cluster.num_gpus=8", "--cluster.gpu=a100-sxm-40gb"])
    problem = Problem.from_config(cfg)
    ranked = search(problem, allow_uneven_pp=True).ranked
    repriced = [e.layout for e in ranked if e.layout.schedule in WRITTEN_OUT and e.layout.chunks_per_rank > 1
                and 30 % (e.layout.pp * e.layout.chunks_per_rank)]
    assert repriced  # uneven interleaved layouts are offered, those that fit
    for lay in repriced:
        split = tuple(even_split(30, lay.pp * lay.chunks_per_rank))
        assert memory(problem, lay.with_(stage_layers=split)).fits, lay


def test_the_bubble_line_says_an_uneven_even_split_is_priced_rank_by_rank(capsys):
    base = ["plan", "evaluate", "--model.preset=llama3-8b", "--train.seq_len=4096", "--train.micro_batch=1",
            "--cluster.gpu=h100-sxm-80gb"]
    assert main(base + ["--parallel.pp=6", "--cluster.num_gpus=6", "--train.global_batch=36"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bubble"))
    assert "blocks per stage [6, 6, 5, 5, 5, 5], priced at each stage's own times (every rank's times, spec/stages.py " \
           "looped_bubbles)" in line and line.endswith(", the table's pipeline bubble")
    assert main(base + ["--parallel.pp=4", "--cluster.num_gpus=4", "--train.global_batch=32"]) == 0  # 32 blocks: even
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bubble"))
    assert line.endswith("(spec/stages.py rank_bubble)")


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_an_uneven_even_split_under_a_v_schedule_is_priced_by_its_order(schedule):
    """Llama 3 405B over pp32 x 2 stages: the even split of 126 blocks is [2]*62 + [1]*2. Priced with rank_bubble
    at the first and the last rank, DualPipeV idled 0 s (60.9% MFU, the best of the --allow-uneven-pp search);
    its order (spec/stages.py v_order, torch's) idles 0.756 s of a 4.824 s step. Now as the explicit split."""
    from shardwise.plan.cost import evaluate
    from shardwise.plan.layout import Problem
    from shardwise.spec.layout import Layout
    from shardwise.spec.stages import even_split

    cfg = load_config(None, ["--model.preset=llama3-405b", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=16384",
                             "--train.seq_len=8192", "--train.global_batch=2048", "--parallel.dp_shard=32", "--parallel.cp=4",
                             "--parallel.tp=4", "--parallel.pp=32", "--parallel.zero=2", "--train.micro_batch=1",
                             f"--parallel.pp_schedule={schedule}", "--parallel.pp_virtual_stages=2"])
    problem = Problem.from_config(cfg)
    lay = Layout.from_config(cfg, 16384)
    got, want = evaluate(problem, lay), evaluate(problem, lay.with_(stage_layers=tuple(even_split(126, 64))))
    assert got.step_time_s == want.step_time_s and got.memory.total == want.memory.total
    if schedule == "dualpipev":
        from shardwise.plan import cost
        from shardwise.plan.inventory import priced_layout, sized_ranks
        from shardwise.plan.memory import core_layout

        whole = priced_layout(problem.shape, lay)
        core = core_layout(whole)
        cores = [cost.rank_core(problem, core, rank) for _, rank in sized_ranks(problem.shape, whole)]
        idle = cost._split_bubbles(problem, whole, core, [cost._pipeline_times(c) for c in cores])
        assert idle[0] == pytest.approx(0.756, abs=1e-3)  # the first rank, of two 1-block stages, idles by the order
        # 4.824 s before plan/scale.py (issue 60): + 0.162 s for the slowest of 16,384 GPUs, + 0.004 s of NCCL ring
        # latency; then + 0.025 s (first rank) / 0.034 s (the others) of compute beside the hidden reduce-scatter and
        # CP ring, which makes a full rank (idle 0.336 s) finish 3 ms after the first: it decides the step.
        assert got.breakdown_s["bubble"] == pytest.approx(0.336, abs=1e-3) and got.step_time_s == pytest.approx(5.018, abs=1e-3)


def test_plot_labels_are_short_lines_and_other_is_named():
    """Issue 62: in plan.png the labels of #1-#3 ran together (the options with a 16-stage split on one line of
    60 characters) and "other", half of each bar, was not explained. Each label line is now at most 14
    characters (a split's repeats counted), and the legend says what "other" holds."""
    from shardwise.plan.report import OTHER_IN_LEGEND, _wrapped_layout

    label = _wrapped_layout("dp_shard16xcp4xtp2xpp8 z2 mb1 dualpipev/v2 split 5,5,5,5,5,5,5,5,5,5,5,5,5,5,6,4")
    assert label.splitlines() == ["dp_shard16", "cp4 x tp2", "pp8", "z2 mb1", "dualpipev/v2", "split 5x14,6,4"]
    assert _wrapped_layout("dp_shard2xpp2 z3 mb8 gpipe").splitlines() == ["dp_shard2", "pp2", "z3 mb8 gpipe"]
    assert OTHER_IN_LEGEND.startswith("other: ") and "FSDP" in OTHER_IN_LEGEND and "comm buffers" in OTHER_IN_LEGEND
