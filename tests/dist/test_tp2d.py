"""2-D tensor parallelism (parallel/tensor2d.py): the bytes the communication counter sees in one
training step equal plan/tp2d.py's closed form of SUMMA (per grid axis and kind), with and without
gradient accumulation. Parity with one process is tests/parity/matrix.py TP2D_FAMILY."""
from __future__ import annotations

import pytest

from shardwise.config import build_config
from shardwise.plan.tp2d import comm_bytes_per_step
from shardwise.spec.shapes import ModelShape
from tests.harness import run_world

CASES = {"tp4_2d": {"parallel.tp": 4, "parallel.tp_mode": "2d"},
         "tp4_2d_accum2": {"parallel.tp": 4, "parallel.tp_mode": "2d", "train.micro_batch": 4}}


def _one_step(base, overrides: dict, run_dir) -> dict:
    from shardwise.train.trainer import Trainer

    cfg = build_config(None, base + [(k, str(v)) for k, v in overrides.items()] + [("train.steps", "1"), ("train.log_every", "1")])
    cfg.run.dir = str(run_dir)
    trainer = Trainer(cfg, log=None)
    trainer.train()
    return {"comm": trainer.comm_bytes, "accumulation": trainer.accumulation}


@pytest.fixture(scope="module")
def counted(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2d_comm")
    return run_world(4, lambda rank: {n: _one_step(base_overrides, ov, root / n) for n, ov in CASES.items()})


@pytest.mark.parametrize("name", list(CASES))
def test_summa_traffic_matches_closed_form(counted, base_overrides, name):
    ov = CASES[name]
    cfg = build_config(None, base_overrides + [(k, str(v)) for k, v in ov.items()])
    shape = ModelShape.from_config(cfg.model)
    for rank, runs in enumerate(counted):
        got = runs[name]
        expected = comm_bytes_per_step(shape, 4, cfg.train.micro_batch, cfg.train.seq_len, got["accumulation"])
        comm = {axis: kinds for axis, kinds in got["comm"].items() if axis in ("tp_row", "tp_col")}
        if rank == 0:
            print(f"{name}: counted {comm}\n{' ' * len(name)}  closed form {expected}")
        assert set(got["comm"]) == {"tp_row", "tp_col"}, got["comm"]  # nothing on tp or world
        assert comm == expected, f"rank {rank}: counted {comm} != closed form {expected}"
