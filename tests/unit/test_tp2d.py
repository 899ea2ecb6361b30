"""2-D tensor parallelism without processes: the rules (through the CLI: exit 2 before anything
spawns), plan/tp2d.py's closed forms, and the planner's pricing of tp_mode="2d" against 1-D."""
from __future__ import annotations

import pytest

from shardwise.cli import main
from shardwise.config import build_config
from shardwise.plan import tp2d
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape

_2D = ["--parallel.tp_mode=2d"]


@pytest.mark.parametrize("argv, nproc, phrase", [
    (["--parallel.tp_mode=3d", "--parallel.tp=4"], 4, "not one of 1d, 2d"),
    ([*_2D, "--parallel.tp=2"], 2, "perfect square >= 4"),
    ([*_2D, "--parallel.tp=1"], 1, "perfect square >= 4"),
    ([*_2D, "--parallel.tp=4", "--train.micro_batch=3", "--train.global_batch=9"], 4, "micro_batch=3 is not divisible by 2"),
    ([*_2D, "--parallel.tp=4", "--model.n_kv_heads=1"], 4, "model.n_kv_heads=1 is not divisible by 2"),
    ([*_2D, "--parallel.tp=4", "--parallel.pp=2"], 8, "pp=2 is not implemented yet"),
    ([*_2D, "--parallel.tp=4", "--parallel.cp=2"], 8, "cp=2 is not implemented yet"),
    ([*_2D, "--parallel.tp=4", "--model.preset=tiny-moe"], 4, "MoE model is not implemented yet"),
    ([*_2D, "--parallel.tp=4", "--model.preset=tiny-gpt"], 4, "arch='gpt'"),
    ([*_2D, "--parallel.tp=4", "--parallel.dp_shard=2", "--parallel.zero=3"], 8, "zero=3 (ZeRO-1 / FSDP"),
    ([*_2D, "--parallel.tp=4", "--train.precision=fp8"], 4, "precision='fp8'"),
    ([*_2D, "--parallel.tp=4", "--train.compile=true"], 4, "compiled blocks is not implemented yet"),
])
def test_refused_before_spawning(argv, nproc, phrase, capsys, tmp_path):
    argv = argv if any(a.startswith("--model.preset") for a in argv) else [*argv, "--model.preset=tiny"]
    code = main(["train", *argv, "--nproc", str(nproc), f"--data.cache_dir={tmp_path}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert phrase in err and "Traceback" not in err, err


def test_accepted_layouts_and_sequence_parallel_is_not_applicable():
    from shardwise.preflight import check

    for extra in ([], [("parallel.dp_replicate", "2")], [("parallel.sequence_parallel", "false")],
                  [("train.recompute", "full")], [("train.precision", "bf16")]):
        dims = check(build_config(None, [("model.preset", "tiny"), ("parallel.tp", "4"), ("parallel.tp_mode", "2d")] + extra),
                     8 if extra and extra[0][0] == "parallel.dp_replicate" else 4)
        assert dims.tp_mode == "2d"
    lay = Layout(tp=4, tp_mode="2d")
    assert not lay.sp and "tp2d" in lay.describe()


def _shape(preset: str = "tiny", **kw) -> ModelShape:
    return ModelShape.from_config(build_config(None, [("model.preset", preset)] + [(f"model.{k}", str(v)) for k, v in kw.items()]).model)


def test_closed_form_by_hand_for_the_tiny_model():
    """tiny (h 64, kv 32, f 192, V 512, L 2), micro-batch 8 x 32 tokens, q = 2: the SUMMA terms."""
    s = _shape(vocab_size=512)
    got = tp2d.comm_bytes_per_step(s, 4, 8, 32)
    T, q = 256, 2
    ins = [64, 64, 64, 192] * 2 + [64]
    outs = [128, 64, 384, 64] * 2 + [512]
    assert got["tp_col"]["broadcast"] == sum(2 * T * i // q * 4 for i in ins)
    assert got["tp_col"]["reduce"] == got["tp_col"]["broadcast"] // 2
    assert got["tp_row"]["broadcast"] == sum(2 * i * o // q * 4 for i, o in zip(ins, outs))
    assert got["tp_row"]["all_reduce"] == 5 * 32 * 4 + 512 * 32 * 4 + 4 + 21 * 4
    assert got["tp_col"]["all_reduce"] == 5 * 2 * 128 * 4 + 3 * 128 * 4 + 21 * 4
    accum = tp2d.comm_bytes_per_step(s, 4, 4, 32, accumulation=2)
    assert accum["tp_row"]["broadcast"] == 2 * got["tp_row"]["broadcast"]  # weights move per micro-batch
    assert accum["tp_col"]["broadcast"] == got["tp_col"]["broadcast"]  # activations: the same tokens


def test_two_d_moves_less_than_one_d_at_scale_and_holds_fewer_weights():
    """llama3-8b, 4 sequences of 8192 tokens per micro-batch: activations' traffic falls by q, so 2-D
    beats 1-D's payload from tp = 16 on; weights and optimizer states per rank are ~1/tp in both (2-D's
    embedding 1/q)."""
    s = _shape("llama3-8b")
    one = tp2d.comm_bytes_1d(s, 16, 4, 8192) * 2  # with SP: all-gather + reduce-scatter of the same payload
    two = sum(sum(k.values()) for k in tp2d.comm_bytes_per_step(s, 16, 4, 8192, act_bytes=2, param_bytes=2).values())
    assert two < 0.8 * tp2d.comm_bytes_1d(s, 16, 4, 8192, act_bytes=2) * 2, (one, two)
    p1, p2 = tp2d.param_elements_1d(s, 16), tp2d.param_elements_2d(s, 16)
    assert 0.9 < p2 / p1 < 1.3  # the embedding replicated over grid rows costs V·h/q - V·h/q^2


def test_table_of_1d_2d_25d_3d():
    s = _shape("llama3-8b")
    rows = tp2d.table(s, (16, 64), 1, 8192)
    print("\n" + "\n".join(rows))  # shown with -s
    names = [(r.split("|")[1].strip(), int(r.split("|")[2])) for r in rows[2:]]
    assert names == [("1-D (Megatron + SP)", 16), ("2-D (SUMMA)", 16), ("1-D (Megatron + SP)", 64), ("2-D (SUMMA)", 64),
                     ("2.5-D (d=4)", 64), ("3-D", 64)]
    by = {(sc.name, sc.ranks): sc for p in (16, 64) for sc in tp2d.schemes(s, p, 1, 8192)}
    assert by[("2-D (SUMMA)", 64)].comm < by[("1-D (Megatron + SP)", 64)].comm  # q = 8 cuts activation traffic
    assert by[("2.5-D (d=4)", 64)].weights == 4 * by[("2-D (SUMMA)", 64)].weights  # replicated over d layers
    assert tp2d.depth_25d(16) == 0 and tp2d.depth_25d(64) == 4 and tp2d.depth_25d(8) == 2


def test_rules_are_torch_free_and_order_stable():
    s = _shape()
    got = [v.reason for v in rules.layout_rules(s, Layout(tp=9, tp_mode="2d", micro_batch=3), 32, 9)]
    assert got[0] == "tp2d split"  # dim 64 / heads 4 are not divisible by q = 3
