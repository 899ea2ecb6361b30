"""Every invalid config or layout is refused before spawning: the field, the problem, a fix.

The CLI cases run `shardwise.cli.main` in-process (exit code 2, message on stderr, no traceback);
one case runs the real console script to check the exit code a user sees.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from shardwise.cli import main

# (command-line arguments, field named in the message, phrase of the message)
BAD = [
    (["train", "--parallel.dp_shard=3", "--parallel.zero=3", "--nproc", "2"], "parallel",
     "dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) = 3 != world_size 2"),
    (["train", "--parallel.dp_shard=2", "--nproc", "2"], "parallel.zero", "zero=0 shards nothing"),
    (["train", "--parallel.zero=2", "--nproc", "1"], "parallel.zero", "dp_shard x cp, which is 1"),
    # context parallel (seq 128 by default)
    (["train", "--parallel.cp=2", "--parallel.cp_mode=striped", "--nproc", "2"], "parallel.cp_mode", "not one of"),
    (["train", "--parallel.cp=4", "--train.seq_len=36", "--nproc", "4"], "train.seq_len", "2 x cp = 8 equal chunks"),
    (["train", "--parallel.cp=2", "--parallel.tp=4", "--train.seq_len=36", "--nproc", "8"], "train.seq_len",
     "each cp shard of seq_len/cp = 18"),
    (["train", "--parallel.cp=4", "--parallel.tp=2", "--parallel.cp_mode=ulysses", "--nproc", "8"], "parallel.cp",
     "n_heads / tp = 2 is not divisible by cp=4"),
    (["train", "--parallel.zero=5"], "parallel.zero", "must be 0, 1, 2 or 3"),
    (["train", "--parallel.dp_replicate=2", "--parallel.offload=true", "--nproc", "2"], "parallel.offload", "needs FSDP"),
    # tensor parallel: the tiny preset has 4 query heads, 2 KV heads, ffn 192, seq 128 by default
    (["train", "--parallel.tp=8", "--nproc", "8"], "parallel.tp", "larger than model.n_heads=4"),
    (["train", "--parallel.tp=3", "--nproc", "3"], "parallel.tp", "n_heads=4 is not divisible by tp=3"),
    (["train", "--parallel.tp=2", "--model.dim=96", "--model.n_heads=6", "--model.n_kv_heads=3", "--nproc", "2"],
     "parallel.tp", "neither divides the other"),
    (["train", "--parallel.tp=2", "--model.ffn_dim=191", "--nproc", "2"], "parallel.tp", "ffn_dim=191 is not divisible"),
    (["train", "--parallel.tp=2", "--train.seq_len=33", "--nproc", "2"], "train.seq_len", "not divisible by it"),
    # pipeline parallel: the tiny preset has 2 blocks; global 16 / micro 4 = 4 micro-batches by default
    (["train", "--parallel.pp=4", "--nproc", "4"], "parallel.pp", "only 2 blocks"),
    (["train", "--parallel.pp=2", "--parallel.pp_virtual_stages=2", "--nproc", "2"], "parallel.pp_virtual_stages",
     "1f1b runs one stage per rank"),
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--nproc", "2"],
     "parallel.pp_virtual_stages", "needs pp_virtual_stages >= 2"),
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--model.n_layers=4", "--nproc", "2"],
     "parallel.pp_virtual_stages", "two (V-shaped) stages per rank"),
    (["train", "--parallel.pp=2", "--train.micro_batch=16", "--nproc", "2"], "train.micro_batch",
     "needs at least pp(2) micro-batches"),
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual_stages=2",
      "--model.n_layers=4", "--train.micro_batch=8", "--nproc", "2"], "train.micro_batch", "at least 2 x pp = 4"),
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2",
      "--model.n_layers=4", "--train.global_batch=10", "--train.micro_batch=2", "--nproc", "2"], "train.micro_batch",
     "not a multiple of its 2 rounds"),
    (["train", "--parallel.pp=2", "--parallel.pp_layers_per_stage=[1,2]", "--nproc", "2"],
     "parallel.pp_layers_per_stage", "sum to model.n_layers = 2"),
    (["train", "--parallel.pp=2", "--parallel.pp_layers_per_stage=[2,0]", "--nproc", "2"],
     "parallel.pp_layers_per_stage", "at least one block"),
    (["train", "--parallel.pp=2", "--parallel.pp_layers_per_stage=[1,1]", "--parallel.pp_split=balanced", "--nproc", "2"],
     "parallel.pp_layers_per_stage", "both given"),
    (["train", "--parallel.pp=2", "--parallel.pp_stage_speeds=[1,2]", "--nproc", "2"], "parallel.pp_stage_speeds",
     "cost-balanced split only"),
    (["train", "--parallel.pp=2", "--parallel.pp_split=balanced", "--parallel.pp_stage_speeds=[1,2,3]", "--nproc", "2"],
     "parallel.pp_stage_speeds", "one positive relative speed per pipeline rank (2)"),
    (["train", "--parallel.pp_split=zigzag"], "parallel.pp_split", "not one of"),
    # split-backward schedules: wrong gradients with ZeRO-3, two backwards through selective checkpoints
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=zbv", "--parallel.pp_virtual_stages=2", "--model.n_layers=4",
      "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2", "--nproc", "4"], "parallel.zero",
     "misses parameters ZeRO-3 reshards"),
    (["train", "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble", "--train.recompute=selective", "--nproc", "2"],
     "train.recompute_policy", "per-op selective recompute allows only one"),
    (["train", "--parallel.ep=3", "--parallel.dp_shard=2", "--parallel.zero=3", "--nproc", "2"], "parallel.ep", "must divide"),
    # mixture of experts / expert parallelism
    (["train", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.zero=3", "--nproc", "2"], "parallel.ep",
     "the model has none"),
    (["train", "--model.preset=tiny-moe", "--model.moe.num_experts=6", "--parallel.ep=4", "--parallel.dp_shard=4",
      "--parallel.zero=3", "--nproc", "4"], "parallel.ep", "num_experts(6) is not divisible by ep(4)"),
    (["train", "--model.preset=tiny-moe", "--model.moe.top_k=9"], "model.moe.top_k", "within 1..num_experts(8)"),
    (["train", "--model.preset=tiny-moe", "--model.moe.top_k=0"], "model.moe.top_k", "within 1..num_experts(8)"),
    (["train", "--model.preset=tiny-moe", "--model.moe.capacity_factor=-1"], "model.moe.capacity_factor", "must be >= 0"),
    (["train", "--model.preset=tiny-moe", "--model.moe.every_k_layers=0"], "model.moe.every_k_layers", "must be >= 1"),
    (["train", "--model.preset=tiny-moe", "--model.moe.every_k_layers=3"], "model.moe.every_k_layers", "no block would be MoE"),
    (["train", "--model.preset=tiny-moe", "--model.moe.aux_loss_coef=-0.1"], "model.moe.aux_loss_coef", "must be >= 0"),
    # MoE x TP: every expert's ffn dim is split over tp
    (["train", "--model.preset=tiny-moe", "--parallel.tp=2", "--model.moe.expert_ffn_dim=191", "--nproc", "2"],
     "model.moe.expert_ffn_dim", "expert ffn dim 191 is not divisible"),
    (["train", "--model.preset=tiny-moe", "--parallel.tp=4", "--model.moe.expert_ffn_dim=66", "--nproc", "4"],
     "model.moe.expert_ffn_dim", "not divisible by it"),
    (["train", "--model.preset=tiny-moe", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.zero=1", "--nproc", "2"],
     "parallel.zero", "expert parallelism needs FSDP"),
    (["train", "--model.preset=tiny-moe", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.dp_replicate=2",
      "--parallel.zero=3", "--nproc", "4"], "parallel.dp_replicate", "is not implemented"),
    (["train", "--model.preset=tiny-moe", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.zero=3",
      "--parallel.offload=true", "--nproc", "2"], "parallel.offload", "expert parallelism"),
    (["train", "--model.moe.topk=2"], "model.moe.topk", "did you mean 'model.moe.top_k'"),
    (["train", "--parallel.dp_shard=-1", "--parallel.dp_replicate=3", "--parallel.zero=3", "--nproc", "4"],
     "parallel.dp_shard", "not an integer"),
    (["train", "--parallel.pp_schedule=2f2b"], "parallel.pp_schedule", "not one of"),
    (["train", "--train.global_batch=10", "--train.micro_batch=4"], "train.global_batch", "not divisible"),
    (["train", "--parallel.dp_replicate=2", "--train.global_batch=6", "--train.micro_batch=2", "--nproc", "2"],
     "train.global_batch", "multiple of 4"),
    (["train", "--train.precision=fp4"], "train.precision", "not one of"),
    (["train", "--train.recompute=some"], "train.recompute", "not one of"),
    (["train", "--train.seq_len=4096"], "train.seq_len", "exceeds model.max_seq_len"),
    (["train", "--model.n_heads=5"], "model.n_heads", "not divisible by n_heads"),
    (["train", "--model.n_kv_heads=3"], "model.n_kv_heads", "not divisible by n_kv_heads"),
    (["train", "--model.arch=mamba"], "model.arch", "not one of"),
    (["train", "--train.lr=0"], "train.lr", "must be > 0"),
    (["train", "--train.steps=0"], "train.steps", "must be >= 1"),
    (["train", "--checkpoint.keep=0"], "checkpoint.keep", "must be >= 1"),
    (["train", "--nproc", "0"], "--nproc", "must be >= 1"),
    (["train", "--trian.steps=3"], "trian.steps", "did you mean 'train.steps'"),
    (["train", "--data.path=/no/such/corpus.txt"], "data.path", ""),
    (["train", "--data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer", ""),
    (["train", "--data.tokenizer=byte", "--model.vocab_size=100"], "model.vocab_size", ""),
    (["parity", "--nproc", "2", "--layout", "dp_shard=4,zero=3"], "--layout", "needs 4 processes"),
    (["parity", "--nproc", "2", "--layout", "dp_shard"], "--layout", "not key=value"),
    (["parity", "--nproc", "2"], "--layout", "no layout given"),
]


@pytest.mark.parametrize("argv,field,phrase", BAD, ids=[" ".join(b[0][1:3]) for b in BAD])
def test_refused_before_spawning(argv, field, phrase, capsys, tmp_path):
    code = main(argv + [f"--data.cache_dir={tmp_path}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"error: {field}:"), err
    assert phrase in err and "fix:" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), "a refused config must not create a run"


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--parallel.zero=7"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "parallel.zero" in proc.stderr and "Traceback" not in proc.stderr


def test_compile_default_follows_the_device():
    """train.compile unset: on for CUDA, off for CPU; explicit values win (parallel/compile.py)."""
    from shardwise.config import load_config
    from shardwise.parallel.compile import compile_enabled

    plain = load_config(None, ["--model.preset=tiny"])
    assert compile_enabled(plain, "cuda") and not compile_enabled(plain, "cpu")
    assert compile_enabled(load_config(None, ["--model.preset=tiny", "--train.compile=true"]), "cpu")
    assert not compile_enabled(load_config(None, ["--model.preset=tiny", "--train.compile=false"]), "cuda")


@pytest.mark.parametrize("layout,world", [([], 2), (["--parallel.tp=2"], 8), (["--parallel.pp=2", "--model.n_layers=4"], 4)])
def test_following_the_world_size_advice_works(layout, world):
    """`--nproc N` on a layout of fewer ranks: each way the fix offers passes the same pre-flight.
    (The advice was "set parallel.dp_shard=-1", which zero=0, the default, then refused in turn.)"""
    import re

    from shardwise.config import ConfigError, load_config
    from shardwise.preflight import check

    with pytest.raises(ConfigError) as refused:
        check(load_config(None, layout), world)
    fix = refused.value.fix
    replicate = re.search(r"parallel\.dp_replicate=(\d+) \(DDP\)", fix).group(1)
    sharded = ["--parallel.dp_shard=-1", *re.search(r"with (parallel\.zero)=1, 2 or 3", fix).groups()]
    fewer = int(re.search(r"\(--nproc\) to (\d+)", fix).group(1))
    check(load_config(None, [*layout, f"--parallel.dp_replicate={replicate}"]), world)
    for zero in (1, 2, 3):
        check(load_config(None, [*layout, sharded[0], f"--{sharded[1]}={zero}"]), world)
    check(load_config(None, layout), fewer)
