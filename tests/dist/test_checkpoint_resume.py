"""Checkpoints: resume on the same layout continues bitwise; DCP reshards to another layout.

Each world size is spawned once; every case trains 4 steps straight through, saving a checkpoint after
step 2, and a fresh Trainer resumes from that checkpoint and runs steps 3-4. Two steps after a resume show
any state it lost: the first resumed step's loss is computed with the restored weights on the batch the data's
restored position gives; the second's follows the first update after the resume, which reads the optimizer's
moments and step count (Adam's bias correction) and the scheduler's lr (the 4 steps are all in the 5-step
warm-up: a different lr every step), on the next batch. Two steps before the cut make the saved moments those
of two updates, not of one gradient; a third step after the resume would read no state the second does not.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise.config import build_config
from shardwise.parity import LOSS_RTOL
from tests.harness import run_world

STEPS, CUT = 4, 2
SAME_LAYOUT = {
    1: {"single": {}},
    2: {"ddp2": {"parallel.dp_replicate": 2, "train.micro_batch": 4},
        "zero1_dp2": {"parallel.dp_shard": 2, "parallel.zero": 1, "train.micro_batch": 2},
        "zero2_dp2": {"parallel.dp_shard": 2, "parallel.zero": 2, "train.micro_batch": 4},
        "zero3_dp2_accum2": {"parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 2},
        "tp2_accum2": {"parallel.tp": 2, "train.micro_batch": 4},
        # pipeline: one stage per rank of the 2-block tiny model; V-shaped zero bubble on 4 blocks
        "pp2_1f1b": {"parallel.pp": 2, "train.micro_batch": 2},
        "pp2_zbv": {"parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.pp_virtual_stages": 2,
                    "model.n_layers": 4, "train.micro_batch": 2},
        # context parallel; ZeRO-1 with dp_shard = 1 shards the optimizer state over the cp ranks
        "cp2_ulysses_zero1": {"parallel.cp": 2, "parallel.cp_mode": "ulysses", "parallel.zero": 1},
        # expert parallelism: experts are DTensors Shard(0) over ep, outside the FSDP units
        "moe_ep2_zero3": {"model.preset": "tiny-moe", "model.vocab_size": 512, "parallel.dp_shard": 2,
                          "parallel.ep": 2, "parallel.zero": 3, "train.micro_batch": 2}},
    4: {"tp2_zero3_dp2": {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4},
        "tp2_ddp2_nosp": {"parallel.tp": 2, "parallel.dp_replicate": 2, "parallel.sequence_parallel": "false",
                          "train.micro_batch": 4},
        "pp2_tp2": {"parallel.pp": 2, "parallel.tp": 2, "train.micro_batch": 2},
        # 2-D tensor parallelism (SUMMA on a 2 x 2 grid): every parameter a DTensor on the grid mesh
        "tp4_2d": {"parallel.tp": 4, "parallel.tp_mode": "2d"},
        "pp2_zero1_dp2": {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.zero": 1, "train.micro_batch": 2},
        "cp2_ring_zero3_dp2": {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero": 3, "train.micro_batch": 4},
        # MoE x EP x TP: experts are 2-D DTensors (Shard(0) over ep, the ffn dim over tp)
        "moe_ep2_tp2_zero3": {"model.preset": "tiny-moe", "model.vocab_size": 512, "parallel.dp_shard": 2,
                              "parallel.ep": 2, "parallel.tp": 2, "parallel.zero": 3, "train.micro_batch": 2}},
}


def _cfg(base, overrides: dict, ckpt_dir: Path, resume: bool):
    extra = [(k, str(v)) for k, v in overrides.items()]
    cfg = build_config(None, base + extra + [("train.steps", str(STEPS))])
    cfg.run.dir = str(ckpt_dir.parent / f"{ckpt_dir.name}_run")
    cfg.checkpoint.dir = str(ckpt_dir)
    cfg.checkpoint.resume = resume
    cfg.checkpoint.final = False
    return cfg


def _straight_and_resumed(base, overrides: dict, root: Path) -> tuple[list[float], list[float]]:
    """The losses of an uninterrupted run of STEPS steps that saves a checkpoint after step CUT and goes on,
    and of a fresh Trainer resumed from that checkpoint (steps CUT+1 .. STEPS). The checkpoint comes from
    the straight run itself (until 2026-11-29 a third Trainer trained steps 1-CUT again to write it: the
    same steps on the same layout, a third of each case's set-up and a fifth of its steps). That saving
    leaves the run it is taken from unchanged is test_data_workers.py's check (bitwise, a run with
    checkpoint.every against one without); here a save that changed the live state, or saved another
    state than the live one, makes the two runs' steps after CUT differ."""
    from shardwise.train.trainer import Trainer

    cfg = _cfg(base, overrides, root / "ckpt", resume=False)
    cfg.checkpoint.every = CUT  # saved after step CUT only: none after the last step (checkpoint.final false)
    cfg.run.dir = str(root / "straight_run")  # the resumed run's metrics start in a directory of their own
    straight = Trainer(cfg, log=None).train()
    second = Trainer(_cfg(base, overrides, root / "ckpt", resume=True), log=None)
    assert second.step == CUT
    return straight, second.train()


def _resume_other_layout(base, overrides: dict, source_ckpt: Path, root: Path) -> list[float]:
    import torch.distributed as dist

    from shardwise.train.trainer import Trainer

    if dist.get_rank() == 0:
        shutil.copytree(source_ckpt, root / "ckpt")
    dist.barrier()
    trainer = Trainer(_cfg(base, overrides, root / "ckpt", resume=True), log=None)
    assert trainer.step == CUT
    return trainer.train()


@pytest.fixture(scope="module")
def results(base_overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    out: dict[str, tuple[list[float], list[float]]] = {}
    zero3_ckpt = root / "zero3_dp2_accum2" / "ckpt"
    single_ckpt = root / "single" / "ckpt"
    def single(rank: int) -> dict:
        return {"single": _straight_and_resumed(base_overrides, {}, root / "single")}

    def two(rank: int) -> dict:
        res = {name: _straight_and_resumed(base_overrides, ov, root / name) for name, ov in SAME_LAYOUT[2].items()}
        # a one-process checkpoint resumed as ZeRO-3 / ZeRO-1 on two processes
        res["single->zero3_dp2"] = (None, _resume_other_layout(base_overrides, SAME_LAYOUT[2]["zero3_dp2_accum2"],
                                                               single_ckpt, root / "x2"))
        res["single->zero1_dp2"] = (None, _resume_other_layout(base_overrides, SAME_LAYOUT[2]["zero1_dp2"],
                                                               single_ckpt, root / "x3"))
        # DCP reshards onto tensor-parallel shards too
        res["single->tp2"] = (None, _resume_other_layout(base_overrides, {"parallel.tp": 2}, single_ckpt, root / "x4"))
        # ... and onto pipeline stages (each stage loads its own parameters by name)
        res["single->pp2"] = (None, _resume_other_layout(base_overrides, {"parallel.pp": 2, "train.micro_batch": 2},
                                                         single_ckpt, root / "x5"))
        # an ep2 checkpoint resharded onto ZeRO-3 without EP (experts keyed by their global shape)
        moe_ep1 = {k: v for k, v in SAME_LAYOUT[2]["moe_ep2_zero3"].items() if k != "parallel.ep"}
        res["moe_ep2->moe_zero3_dp2"] = (None, _resume_other_layout(base_overrides, moe_ep1,
                                                                    root / "moe_ep2_zero3" / "ckpt", root / "x6"))
        return res

    def four(rank: int) -> dict:
        res = {name: _straight_and_resumed(base_overrides, ov, root / name) for name, ov in SAME_LAYOUT[4].items()}
        # the ep2 checkpoint (2 processes) resharded onto ep2 x tp2 (experts split on the ffn dim too)
        res["moe_ep2->moe_ep2_tp2_zero3"] = (None, _resume_other_layout(base_overrides, SAME_LAYOUT[4]["moe_ep2_tp2_zero3"],
                                                                       root / "moe_ep2_zero3" / "ckpt", root / "x7"))
        return res

    def back_to_one(rank: int) -> dict:
        # a two-process ZeRO-3 checkpoint resumed on one process
        return {"zero3_dp2->single": (None, _resume_other_layout(base_overrides, {}, zero3_ckpt, root / "x1"))}

    for world, work in ((1, single), (2, two), (4, four), (1, back_to_one)):
        out.update(run_world(world, work)[0])
    return out


@pytest.mark.parametrize("name", [n for layouts in SAME_LAYOUT.values() for n in layouts])
def test_resume_same_layout_is_bitwise(results, name):
    straight, resumed = results[name]
    assert resumed == straight[CUT:], f"{name}: resumed losses differ from an uninterrupted run"


def _assert_continues(results, name: str, uninterrupted: str) -> None:
    """The losses resumed in `name` continue the uninterrupted run `uninterrupted` within the parity
    contract's tolerance (resharding changes reduction order only)."""
    reference = results[uninterrupted][0][CUT:]
    resumed = results[name][1]
    assert len(resumed) == STEPS - CUT
    worst = max(abs(a - b) / abs(b) for a, b in zip(resumed, reference))
    assert worst <= LOSS_RTOL, f"{name}: max relative |dloss| {worst:.2e}"


@pytest.mark.parametrize("target", ["moe_ep2->moe_zero3_dp2", "moe_ep2->moe_ep2_tp2_zero3"])
def test_expert_parallel_checkpoint_reshards(results, target):
    """The run resumed without EP, or with EP x TP, continues the ep2 run's losses."""
    _assert_continues(results, target, "moe_ep2_zero3")


@pytest.mark.parametrize("name", ["zero3_dp2->single", "single->zero3_dp2", "single->zero1_dp2", "single->tp2",
                                  "single->pp2"])
def test_resume_on_another_layout(results, name):
    _assert_continues(results, name, "single")
