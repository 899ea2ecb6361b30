"""Pipeline stage logic without a process group: splits, placement, costs, bubble formulas, the chart."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.config import build_config
from shardwise.models.llama import Llama
from shardwise.spec.stages import (
    balanced_split,
    bubble_fraction,
    even_split,
    layers_per_stage,
    stage_ids,
    stage_layers,
    stage_of_parameter,
    stage_rank,
)
from shardwise.train.pipeline_chart import TIMELINE_FILE, summarize


def test_even_split_gives_the_first_stages_the_extra_blocks():
    assert even_split(8, 4) == [2, 2, 2, 2]
    assert even_split(8, 3) == [3, 3, 2]
    assert stage_layers([1, 3]) == [[0], [1, 2, 3]]


def test_placement_looped_and_v_shaped():
    assert [stage_ids("1f1b", 4, 1, r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids("interleaved_1f1b", 4, 2, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # V shape: the first and the last stage (embedding and head) on rank 0
    assert [stage_ids("dualpipev", 4, 2, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_ids("zbv", 2, 2, r) for r in range(2)] == [[0, 3], [1, 2]]
    assert stage_rank("zbv", 2, 2, 3) == 0 and stage_rank("interleaved_1f1b", 4, 2, 6) == 2


def test_balanced_split_follows_rank_speeds():
    flat = {"embedding": 0.0, "block": 1.0, "head": 0.0}
    assert balanced_split(flat, 8, [1.0, 1.0]) == [4, 4]
    assert balanced_split(flat, 8, [1.0, 3.0]) == [2, 6]      # max(2/1, 6/3) = 2 is the optimum
    assert balanced_split(flat, 8, [3.0, 1.0]) == [6, 2]


def test_balanced_split_charges_the_embedding_and_the_head():
    # A head worth 3 blocks: the last stage gets fewer blocks; every stage keeps at least one.
    assert balanced_split({"embedding": 0.0, "block": 1.0, "head": 3.0}, 9, [1.0, 1.0, 1.0]) == [4, 4, 1]
    assert balanced_split({"embedding": 2.0, "block": 1.0, "head": 0.0}, 6, [1.0, 1.0]) == [2, 4]
    assert balanced_split({"embedding": 0.0, "block": 1.0, "head": 100.0}, 4, [1.0, 1.0]) == [3, 1]


def test_model_pipeline_costs_are_not_free_at_the_ends():
    cfg = build_config(None, [("model.preset", "llama3-8b")]).model
    costs = Llama.pipeline_costs(cfg, 8192)
    # llama3-8b head: 6 V h = 6 x 128256 x 4096 FLOPs per token, plus the cross-entropy's bytes
    assert costs["head"] > 6 * 128256 * 4096
    assert 0 < costs["embedding"] < 0.02 * costs["block"]  # memory-bound: ~1.4% of a block
    # a block: 6 x (its GEMM parameters) + 12 s h (attention), PaLM's count
    per_block = 6 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 12 * 8192 * 4096
    assert costs["block"] == pytest.approx(per_block)


def test_layers_per_stage_uses_the_configured_split():
    def split(*overrides):
        cfg = build_config(None, [("model.n_layers", "8"), ("parallel.pp", "2"), *overrides])
        return layers_per_stage(cfg.parallel, cfg.model, 64, {"embedding": 0.0, "block": 1.0, "head": 0.0})

    assert split() == [4, 4]
    assert split(("parallel.pp_layers_per_stage", "[1,7]")) == [1, 7]
    assert split(("parallel.pp_split", "balanced"), ("parallel.pp_stage_speeds", "[1,3]")) == [2, 6]
    # speeds are per rank; with V placement rank 0 runs stages 0 and 3
    assert split(("parallel.pp_split", "balanced"), ("parallel.pp_stage_speeds", "[2,1]"),
                 ("parallel.pp_schedule", "zbv"), ("parallel.pp_virtual_stages", "2")) == [3, 1, 1, 3]


def test_every_parameter_has_one_stage():
    layers = [[0, 1], [2], [3]]
    assert stage_of_parameter("tok_embeddings.weight", layers) == 0
    assert stage_of_parameter("layers.2.attention.wq.weight", layers) == 1
    assert stage_of_parameter("norm.weight", layers) == 2 and stage_of_parameter("output.weight", layers) == 2


def test_theoretical_bubble():
    """The chart's theoretical share: spec/stages.py bubble_seconds with t_b = 2 t_f (F = I = W)."""
    assert bubble_fraction("1f1b", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 19)  # (p-1)/v over m + (p-1)/v
    assert bubble_fraction("zero_bubble", 4, 1, 8) == pytest.approx(3 / 27)
    assert bubble_fraction("zbv", 4, 2, 8) == pytest.approx(1.5 / 25.5)  # a chunk's input pass per rank: (p-1) t_b/4
    assert bubble_fraction("dualpipev", 4, 2, 8) == pytest.approx(1.5 / 25.5)  # (p-1) t_f/2


def _timeline() -> dict:
    ranks = [{"rank": 0, "pp_rank": 0, "step_s": 4.0, "in_rank0_pipeline": True,
              "actions": [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 2.0, 4.0]]},
             {"rank": 1, "pp_rank": 1, "step_s": 3.0, "in_rank0_pipeline": True,
              "actions": [["F", 1, 0, 1.0, 1.5], ["I", 1, 0, 1.5, 2.0], ["W", 1, 0, 2.5, 3.0]]},
             {"rank": 2, "pp_rank": 0, "step_s": 9.0, "in_rank0_pipeline": False, "actions": []}]
    return summarize(ranks, "1f1b", 2, 1, 1, 3)


def test_measured_bubble_is_idle_time_over_the_pipelines_span():
    t = _timeline()
    assert t["span_s"] == 4.0 and [r["rank"] for r in t["ranks"]] == [0, 1]  # other pipelines left out
    assert [r["bubble"] for r in t["ranks"]] == [pytest.approx(0.25), pytest.approx(0.625)]
    assert t["bubble_measured"] == pytest.approx(1 - 4.5 / 8)
    assert t["bubble_theoretical"] == pytest.approx(1 / 2)
    # Replayed with no time for the sends, the order idles as much: rank 0's backward waited for rank 1's.
    assert t["bubble_order"] == pytest.approx(t["bubble_measured"])


def test_the_orders_own_bubble_leaves_out_waiting_on_a_late_send():
    """Rank 0's backward started 1 s after rank 1's input pass ended (a slow send): measured idle grows,
    the order's own (spec/stages.py replay_span at the measured action times) does not."""
    ranks = [{"rank": 0, "pp_rank": 0, "step_s": 5.0, "in_rank0_pipeline": True,
              "actions": [["F", 0, 0, 0.0, 1.0], ["B", 0, 0, 3.0, 5.0]]},
             {"rank": 1, "pp_rank": 1, "step_s": 3.0, "in_rank0_pipeline": True,
              "actions": [["F", 1, 0, 1.0, 1.5], ["I", 1, 0, 1.5, 2.0], ["W", 1, 0, 2.5, 3.0]]}]
    t = summarize(ranks, "1f1b", 2, 1, 1, 3)
    assert t["bubble_measured"] == pytest.approx(1 - 4.5 / 10) and t["bubble_order"] == pytest.approx(1 - 4.5 / 8)
    t["ranks"][1]["actions"].pop(1)  # a step whose input pass is missing cannot be replayed
    assert summarize(t["ranks"], "1f1b", 2, 1, 1, 3)["bubble_order"] is None


def test_pipeline_chart_command(tmp_path, capsys):
    (tmp_path / TIMELINE_FILE).write_text(json.dumps(_timeline()))
    assert main(["pipeline-chart", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert ("bubble measured 43.8% (the schedule's own order at these action times 43.8%, the rest waiting on "
            "sends and slower ranks), theoretical 50.0%") in out and (tmp_path / "c.png").stat().st_size > 5000
    assert main(["pipeline-chart", str(tmp_path), "--out", str(tmp_path / "c.png"), "--text"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pp")]
    rows.insert(0, "")
    # 4 s span over 100 characters: rank 0 forward 0-1 s, idle 1-2 s, backward 2-4 s
    assert rows[1] == "pp0  |" + "F" * 25 + "." * 25 + "B" * 50 + "| idle 25%"
    # rank 1: F 1-1.5 s, I 1.5-2 s, W 2.5-3 s; actions ending mid-character share it (ties may go either way)
    assert rows[2].startswith("pp1  |" + "." * 25 + "F" * 12) and rows[2].endswith("." * 25 + "| idle 62%")
    assert [rows[2].count(k) for k in "FIW"] in ([13, 12, 12], [13, 12, 13], [12, 13, 12], [12, 13, 13])
    assert main(["pipeline-chart", str(tmp_path / "nowhere")]) == 2
    assert "only pipeline-parallel runs" in capsys.readouterr().err
