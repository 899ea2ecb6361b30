"""Offloaded model states against a node's memory, before any worker starts (launch/host_memory.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launch.host_memory import GIB, check_offload_fits_host, node_memory_bytes
from shardwise.plan.layout import Problem
from shardwise.plan.memory import offloaded_state_bytes
from shardwise.spec.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
# 509M parameters (8 blocks of dim 2048, vocab 32000): 16 B each with "cpu", 8 B with "nvme" (the moments on disk),
# sharded over every rank (ZeRO-3, dp_shard = -1).
MODEL = ["--model.dim=2048", "--model.n_layers=8", "--model.n_heads=16", "--model.n_kv_heads=8", "--model.ffn_dim=5632",
         "--model.vocab_size=32000", "--parallel.zero=3", "--parallel.dp_shard=-1"]


def _cfg(*extra: str):
    return load_config(None, [*MODEL, *extra])


def test_the_states_are_the_planners_sixteen_bytes_per_parameter_shard():
    cfg = _cfg("--parallel.offload=cpu")
    params = Problem.from_config(cfg).shape.num_params
    one = offloaded_state_bytes(Problem.from_config(cfg), Layout.from_config(cfg, 1))
    assert one == pytest.approx(16 * params, rel=1e-3)  # + a 4-byte step counter per tensor
    four = offloaded_state_bytes(Problem.from_config(cfg), Layout.from_config(cfg, 4))
    assert four == pytest.approx(one / 4, rel=1e-2)  # ZeRO-3 over 4 ranks (dim 0 padded to a multiple of 4)
    nvme = _cfg("--parallel.offload=nvme", "--parallel.offload_dir=/tmp")
    assert offloaded_state_bytes(Problem.from_config(nvme), Layout.from_config(nvme, 1)) < 0.65 * one
    # (the moments on disk; two chunk buffers, each the largest tensor's 8 bytes/element, stay: +13% here)
    assert offloaded_state_bytes(Problem.from_config(_cfg()), Layout.from_config(_cfg(), 1)) == 0  # no offload


def test_a_node_too_small_is_refused_with_the_ways_out_and_each_way_passes():
    cfg = _cfg("--parallel.offload=cpu")
    need = offloaded_state_bytes(Problem.from_config(cfg), Layout.from_config(cfg, 2)) * 2  # 2 ranks on this node
    small = int(0.75 * need)
    with pytest.raises(ConfigError) as refused:
        check_offload_fits_host(cfg, world_size=2, local_ranks=2, node_bytes=small)
    e = refused.value
    assert e.field == "parallel.offload" and f"need {need / GIB:.1f} GiB on this node (2 ranks x" in e.problem
    assert f"it has {small / GIB:.1f} GiB of memory and swap" in e.problem and 'parallel.offload="nvme"' in e.fix
    # The advice, followed: the moments on disk; or a second node (the same states over 4 ranks, 2 here).
    check_offload_fits_host(_cfg("--parallel.offload=nvme", "--parallel.offload_dir=/tmp"), 2, 2, node_bytes=small)
    check_offload_fits_host(cfg, world_size=4, local_ranks=2, node_bytes=small)
    check_offload_fits_host(cfg, 2, 2, node_bytes=int(need))  # exactly enough passes
    check_offload_fits_host(_cfg(), 2, 2, node_bytes=1)  # no offload: nothing to check


def test_meminfo_is_read_with_swap(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nSwapTotal:       1024 kB\n")
    assert node_memory_bytes(info) == (24576000 + 1024) * 1024
    assert node_memory_bytes(tmp_path / "missing") is None
    if Path("/proc/meminfo").is_file():
        assert node_memory_bytes() > GIB


def test_shardwise_train_refuses_before_spawning(tmp_path):
    """A 1.2 TB offload on this machine: exit 2, the one line, no traceback, nothing started, in seconds."""
    if node_memory_bytes() is None:
        pytest.skip("no /proc/meminfo on this machine: the check does not run")
    big = ["--model.dim=8192", "--model.n_layers=96", "--model.n_heads=64", "--model.n_kv_heads=8",
           "--model.ffn_dim=28672", "--model.vocab_size=32000", "--parallel.zero=3", "--parallel.offload=cpu",
           "--data.tokenizer=byte", f"--run.dir={tmp_path / 'run'}"]
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *big], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: parallel.offload: the model states offloaded to host memory (cpu) need ")
    assert "Traceback" not in p.stderr and not (tmp_path / "run").exists()
