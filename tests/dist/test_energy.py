"""GPU energy summed over ranks (train/power.py), with a fake NVML counter (no GPU here): each of 2 ranks
draws 50 J per logging interval, so the job's J/token is 100 J over the interval's global tokens; and a
rank without a reading turns the meter off on every rank instead of leaving the others in a collective."""
from __future__ import annotations

import json

import pytest

from shardwise.config import build_config
from tests.harness import run_world


@pytest.mark.parametrize("readers", ["both", "rank0_only"])
def test_energy_is_summed_over_ranks(base_overrides, tmp_path, monkeypatch, readers):
    from shardwise.train import step_log

    def fake_reader(device):
        import torch.distributed as dist

        if readers == "rank0_only" and dist.get_rank() == 1:
            return None
        counter = iter(range(0, 10**6, 50))
        return lambda: float(next(counter))

    monkeypatch.setattr(step_log, "nvml_energy_reader", fake_reader)  # inherited by the forked ranks
    run = tmp_path / "run"

    def work(rank: int) -> None:
        from shardwise.train.trainer import Trainer

        cfg = build_config(None, base_overrides + [("train.steps", "4"), ("train.log_every", "2"),
                                                   ("parallel.dp_replicate", "2"), ("train.micro_batch", "4")])
        cfg.run.dir = str(run)
        Trainer(cfg, log=None).train()

    run_world(2, work)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = 2 * 8 * 32  # 2 steps of global batch 8 x seq 32 per interval
    if readers == "both":
        assert [r["energy_j_per_token"] for r in records] == [100 / tokens] * 2
        assert records[-1]["energy_kwh"] == 200 / 3.6e6
    else:
        assert not any("energy_j_per_token" in r for r in records)
