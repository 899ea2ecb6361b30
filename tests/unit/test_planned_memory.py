"""train/planned_memory.py: the planner's peak for the run a GPU trains, in the start-up line, the
end-of-run summary and the out-of-memory line. It must be `shardwise plan evaluate`'s number for the same
options on that GPU; decided on CPU from the GPU's name."""
from __future__ import annotations

import json

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.train.out_of_memory import out_of_memory_line
from shardwise.train.planned_memory import GIB, PlannedMemory, planned_memory
from shardwise.train.step_log import peak_words

OPTIONS = ["--model.preset=small", "--train.precision=bf16", "--train.micro_batch=8", "--train.global_batch=32",
           "--parallel.dp_shard=4", "--parallel.zero=3"]


def test_it_is_plan_evaluates_peak_on_the_gpu_the_run_has(capsys):
    planned = planned_memory(load_config(None, OPTIONS), 4, 4, "NVIDIA H100 80GB HBM3")
    assert main(["plan", "evaluate", "--json", *OPTIONS, "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=4",
                 "--cluster.gpus_per_node=4"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert planned.gpu == "h100-sxm-80gb"
    assert round(planned.total_bytes / GIB, 3) == plan["memory_gib"]["total"]
    assert round(planned.capacity_bytes / GIB, 3) == plan["memory_capacity_gib"]
    a100 = planned_memory(load_config(None, OPTIONS), 4, 4, "NVIDIA A100-SXM4-40GB")
    assert a100.gpu == "a100-sxm-40gb" and a100.capacity_bytes < planned.capacity_bytes


def test_no_prediction_off_the_table_or_for_a_config_the_planner_refuses():
    assert planned_memory(load_config(None, OPTIONS), 4, 4, "NVIDIA GeForce GTX 1080") is None
    refused = load_config(None, [*OPTIONS, "--cluster.assume_mfu=2"])  # the trainer never reads [cluster]
    assert planned_memory(refused, 4, 4, "NVIDIA H100 80GB HBM3") is None


def test_the_lines_that_show_it():
    planned = PlannedMemory(30 * GIB, 72 * GIB, "h100-sxm-80gb")
    assert planned.fits and planned.warning() is None
    assert PlannedMemory(73 * GIB, 72 * GIB, "h100-sxm-80gb").warning() == (
        "warning: the planner expects 73.00 GiB per GPU of 72.0 usable (h100-sxm-80gb), more than fits: this run will "
        "likely run out of memory (exit 7); `shardwise plan search` with the same options finds a layout that fits")
    assert planned.words() == "30.00 GiB per GPU of 72.0 usable (h100-sxm-80gb)"
    assert peak_words(int(28.5 * GIB), planned) == "peak memory 28.50 GiB on rank 0 (planned 30.00 for the most loaded rank)"
    assert peak_words(int(28.5 * GIB), None) == "peak memory 28.50 GiB on rank 0"
    cfg = load_config(None, OPTIONS)
    line = out_of_memory_line(cfg, 0, 2, "cuda", "CUDA out of memory.", None, planned)
    assert "CUDA out of memory.; the planner expected 30.00 GiB per GPU of 72.0 usable (h100-sxm-80gb); fix:" in line
    over = out_of_memory_line(cfg, 0, 2, "cuda", "CUDA out of memory.", None, PlannedMemory(90 * GIB, 72 * GIB, "h100-sxm-80gb"))
    assert "(h100-sxm-80gb): this layout does not fit; fix:" in over
