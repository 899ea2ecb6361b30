"""`shardwise dryrun --step` (launch/dryrun_step.py, issue 58): each rank runs the trainer's own step on its
meta tensors under the fake process group, and the payload bytes the trainer's counter sees, per mesh axis
and collective kind, must equal the planner's prediction for that rank (plan/comm.py predict_comm_bytes) to
the byte. A drift on either side (a collective the trainer adds, or one the planner stops pricing) fails here,
at a scale no CPU world reaches, in one forked process per rank.

The layouts: the shape of configs/plan-llama3-70b.toml (pp x dp_shard x tp, ZeRO-1 in bf16: FSDP2's replicate
all-reduce, ZeRO-1's broadcasts, SP, pipeline send/recv), ZeRO-3 over 256 ranks with TP and PP, and ZeRO-3 x TP
in bf16 with 2 micro-batches, on a tiny llama at 1,024 ranks; HSDP x CP (ring attention) at 64."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main

TINY = ["--model.preset=tiny", "--model.n_layers=4", "--train.seq_len=64", "--train.micro_batch=1",
        "--train.compile=false"]
LAYOUTS = {
    "pp2_tp2_zero1_bf16_1024": (128, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=-1",
                                      "--parallel.zero=1", "--train.precision=bf16", "--train.global_batch=512"]),
    "pp2_tp2_zero3_1024": (128, ["--parallel.pp=2", "--parallel.tp=2", "--parallel.dp_shard=-1", "--parallel.zero=3",
                                 "--train.precision=fp32", "--train.global_batch=512"]),
    # FSDP2 all-reduces TP's Partial gradients (norms under SP) per micro-batch in bf16 here: the planner priced
    # them in fp32 until this test's 70B counterpart found it (plan/comm.py _tp_collectives)
    "tp2_zero3_bf16_accum2_1024": (128, ["--parallel.tp=2", "--parallel.dp_shard=-1", "--parallel.zero=3",
                                         "--train.precision=bf16", "--train.global_batch=1024"]),
    "hsdp_cp2_ring_bf16_64": (8, ["--parallel.dp_replicate=4", "--parallel.dp_shard=-1", "--parallel.cp=2",
                                  "--parallel.zero=3", "--train.precision=bf16", "--train.global_batch=64"]),
}


def _rows(tmp_path, nnodes: int, extra: list[str], ranks: str = "0,last") -> list[dict]:
    out = tmp_path / "dryrun.json"
    assert main(["dryrun", "--nnodes", str(nnodes), "--nproc", "8", *TINY, *extra, "--ranks", ranks, "--step",
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())["ranks"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_counted_step_bytes_equal_the_planners_per_axis_and_kind(tmp_path, capsys, name):
    nnodes, extra = LAYOUTS[name]
    rows = _rows(tmp_path, nnodes, extra)
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r and "step_note" not in r, r
        assert r["step_s"] > 0
        assert r["counted"] == r["planned_comm"], (name, r["rank"], r["counted"], r["planned_comm"])
    text = capsys.readouterr().out
    assert "comm dp_shard" in text and "its step" in text


@pytest.mark.parametrize("extra, why", [
    (["--parallel.dp_replicate=8"], "step not run: DDP"),  # DDP reads its parameters' values when it wraps them
    (["--parallel.dp_shard=8", "--parallel.zero=3", "--parallel.offload=cpu"], "step not run: offload"),
])
def test_a_layout_that_cannot_step_on_meta_says_why_on_its_line(tmp_path, capsys, extra, why):
    """The rank is built and priced, and its comm line says why the step did not run (nothing counted, nothing
    guessed)."""
    rows = _rows(tmp_path, 1, [*extra, "--train.global_batch=8"], ranks="0")
    assert "counted" not in rows[0] and rows[0]["step_note"].startswith(why)
    assert why in capsys.readouterr().out
