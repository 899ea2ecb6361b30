"""The planner on one device with a model larger than its memory (issue 18): offload tiers ("cpu",
"nvme") priced on a shard group of one rank, the NVMe tier's disk bytes and I/O time, linear tiles'
activations against a closed form (and the real modules), the search proposing them only when nothing
else fits, and `shardwise doctor --disk`."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from shardwise.config import load_config
from shardwise.plan import constants as C
from shardwise.plan.cost import evaluate
from shardwise.plan.inventory import pipeline_ranks
from shardwise.plan.layout import Problem, check_layout
from shardwise.plan.memory import GIB, memory, model_state_bytes
from shardwise.plan.report import evaluate_text, search_json, search_text
from shardwise.plan.search import search
from shardwise.spec.layout import Layout


def setup(*overrides: str) -> tuple[Problem, Layout]:
    cfg = load_config(overrides=list(overrides))
    return Problem.from_config(cfg), Layout.from_config(cfg, cfg.cluster.num_gpus)


ONE_GPU = ("--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=1", "--train.precision=bf16", "--train.compile=false")
# llama 3.2 1B-like shape with a small vocabulary (every tensor < 64 MiB of AdamW state: the NVMe chunk)
ONE_B = ("--model.preset=llama3-8b", "--model.dim=2048", "--model.n_layers=16", "--model.n_heads=32",
         "--model.n_kv_heads=8", "--model.ffn_dim=8192", "--model.vocab_size=8192", "--train.seq_len=2048",
         "--train.global_batch=4", "--train.micro_batch=2")


def states(p: Problem, lay: Layout):
    rank = pipeline_ranks(p.shape, 1, 1, "1f1b")[0]
    return model_state_bytes(p, rank, 1, 1, lay.zero, 1, 1)


@pytest.mark.parametrize("zero", [2, 3])
def test_one_rank_offload_is_valid_and_keeps_the_states_on_the_host(zero):
    p, plain = setup(*ONE_GPU, *ONE_B)
    lay = plain.with_(zero=zero, offload=True)
    assert check_layout(p, lay) is None and lay.wrapper == "fsdp" and lay.shard_group == 1
    on_device, off = memory(p, plain), memory(p, lay)
    st = states(p, lay)
    # host: the whole model's fp32 params + grads + AdamW state (+4 B step per tensor), nothing of it on the device
    assert off.cpu_bytes == st.params + st.grads + st.optimizer == 16 * p.shape.num_params + 4 * st.tensors
    assert off.params == off.grads == off.optimizer == 0 and off.disk_bytes == 0
    assert off.total < on_device.total - 0.8 * off.cpu_bytes
    d = off.detail
    # device, by hand from the shape (dim 2048, ffn 8192, kv 512, vocab 8192, 16 layers): FSDP2's one-rank
    # path gathers one block + the root (ZeRO-3) or everything (ZeRO-2), bf16, with no prefetch
    block = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048 + 2 * 2048
    head, embedding = 8192 * 2048 + 2048, 8192 * 2048
    assert (st.block_numel, st.head_numel, st.block_largest_numel) == (block, head, 8192 * 2048)
    assert lay.accumulation(p) == 2
    assert d["fsdp_unsharded_params"] == 2 * (block + embedding + head if zero == 3 else 16 * block + embedding + head)
    # a block's backward: its bf16 gradients, the previous block's fp32 reduce-scatter input, the head's
    # bf16 gradients; ZeRO-2 with 2 micro-batches reduces at the last only: every unit's fp32 gradients.
    # The staging (one tensor's fp32 copy + its cast) precedes the gradients and is smaller.
    everything = 16 * block + embedding + head
    assert d["fsdp_unsharded_grads"] == (6 * block if zero == 3 else 4 * everything) + 2 * head
    assert 6 * 8192 * 2048 < 2 * block and d["offload_staging"] == 0
    assert "fsdp_root_reduce" not in d  # 8 B x the root (268 MB) < the block moment (~780 MB)
    assert off.host_fits and off.host_capacity == 256 * GIB * C.HOST_USABLE_FRACTION
    # time: the copies over PCIe and the CPU AdamW are in the optimizer term
    e = evaluate(p, lay)
    m = lay.accumulation(p)
    pcie = C.PCIE_GBPS["h100"] * 1e9 * C.PCIE_FRACTION
    copies = (st.params * m * (2 if zero == 3 else 1) + st.grads * (m if zero == 3 else 1)) / pcie
    assert e.detail["offload_copy_s"] == pytest.approx(copies)
    adamw = (st.optimizer - 4 * st.tensors) / 8 * C.OPTIMIZER_BYTES_PER_PARAM / (C.HOST_MEMORY_GBPS_PER_GPU * 1e9)
    assert e.breakdown_s["optimizer"] == pytest.approx(copies + adamw)


def test_offload_staging_over_ranks_and_the_root_reduce_of_a_large_vocabulary():
    """Over 4 ranks a unit's gather stages each fp32 shard, casts it and frees the copy: the unit's bf16
    shards + one fp32 shard (not the whole unit in fp32 + bf16). One rank with a 128k vocabulary: the
    root's fp32 reduce-scatter input + output at the end of backward (8 B x 525M) exceed the block moment,
    so the peak is that reduce."""
    block = 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048 + 2 * 2048
    p, plain = setup("--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=4", "--train.precision=bf16",
                     "--train.compile=false", *ONE_B)
    four = memory(p, plain.with_(dp_shard=4, zero=3, offload=True))
    assert four.detail["offload_staging"] == (2 * block + 4 * 8192 * 2048) / 4
    assert four.detail["fsdp_unsharded_params"] == 2 * (2 * block + 2 * 8192 * 2048 + 2048)  # 2 blocks + root
    p, plain = setup(*ONE_GPU, *ONE_B, "--model.vocab_size=128256")
    one = memory(p, plain.with_(zero=3, offload=True))
    root = 2 * 128256 * 2048 + 2048
    moment = 2 * (block + root) + 6 * block + 2 * (128256 * 2048 + 2048)
    assert one.detail["fsdp_root_reduce"] == 8 * root - moment > 0
    assert one.other == 8 * root + one.detail["logits_transient"]


def test_nvme_moves_the_moments_to_disk():
    p, plain = setup(*ONE_GPU, *ONE_B)
    cpu = memory(p, plain.with_(zero=3, offload=True))
    nvme = memory(p, plain.with_(zero=3, offload=True, nvme=True))
    n = p.shape.num_params
    assert nvme.disk_bytes == 8 * n  # exp_avg + exp_avg_sq, fp32, of the (one-rank) shard
    # two buffers of the largest chunk: w1 / w3 / w2 (8192 x 2048) hold 128 MiB of state each, more than a
    # 64 MiB chunk, so each is a chunk of its own
    buffers = 2 * 8 * 8192 * 2048
    assert nvme.detail["nvme_buffers"] == buffers
    assert cpu.cpu_bytes - nvme.cpu_bytes == 8 * n - buffers
    assert nvme.total == cpu.total  # the device does not see the difference
    # no tensor over 8M elements (64 MiB of state): 2 x 64 MiB
    p1, plain1 = setup(*ONE_GPU, *ONE_B, "--model.dim=1024", "--model.ffn_dim=4096", "--model.n_heads=16")
    assert memory(p1, plain1.with_(zero=3, offload=True, nvme=True)).detail["nvme_buffers"] == 2 * C.NVME_CHUNK_BYTES
    # a tensor larger than a chunk is a chunk of its own: the buffers grow to hold it (the embedding here)
    p2, plain2 = setup(*ONE_GPU, *ONE_B, "--model.vocab_size=128256")
    big = memory(p2, plain2.with_(zero=3, offload=True, nvme=True))
    assert big.detail["nvme_buffers"] == 2 * 8 * 128256 * 2048
    text = evaluate_text(p, evaluate(p, plain.with_(zero=3, offload=True, nvme=True)))
    assert "GiB of AdamW moments in parallel.offload_dir" in text and "GiB on disk" in text and "host memory" in text
    js = evaluate(p, plain.with_(zero=3, offload=True, nvme=True)).to_json()
    assert js["nvme_gib"] == round(8 * n / GIB, 3) and js["host_gib"] == round(nvme.cpu_bytes / GIB, 3)


def test_nvme_step_overlaps_disk_and_cpu_adamw():
    p, plain = setup(*ONE_GPU, *ONE_B)
    lay = plain.with_(zero=3, offload=True, nvme=True)
    n = p.shape.num_params
    e = evaluate(p, lay)
    read, write = C.NVME_READ_GBPS * 1e9 * C.NVME_FRACTION, C.NVME_WRITE_GBPS * 1e9 * C.NVME_FRACTION
    disk = 8 * n / read + 8 * n / write
    assert e.detail["nvme_disk_s"] == pytest.approx(disk) and e.detail["nvme_bytes_per_step"] == 16 * n
    adamw = e.detail["offload_adamw_s"]
    chunk_io = C.NVME_CHUNK_BYTES / read + C.NVME_CHUNK_BYTES / write
    assert e.breakdown_s["optimizer"] == pytest.approx(e.detail["offload_copy_s"] + max(disk, adamw + chunk_io))
    assert disk > adamw  # a Gen4 drive is slower than host memory: the step waits for the disk
    # cluster.disk_gbps replaces the datasheet drive (one rate both ways, already achieved); a fast disk
    # leaves the CPU AdamW plus one chunk in and out
    fast = evaluate(setup(*ONE_GPU, *ONE_B, "--cluster.disk_gbps=1000")[0], lay)
    assert fast.detail["nvme_disk_s"] == pytest.approx(16 * n / 1e12)
    assert fast.breakdown_s["optimizer"] == pytest.approx(fast.detail["offload_copy_s"] + adamw + 2 * C.NVME_CHUNK_BYTES / 1e12)
    slow = evaluate(setup(*ONE_GPU, *ONE_B, "--cluster.disk_gbps=1")[0], lay)
    assert slow.detail["nvme_disk_s"] == pytest.approx(16 * n / 1e9)


TINY = ("--model.preset=tiny", "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=4",
        "--train.micro_batch=4", "--cluster.num_gpus=1", "--train.compile=false")


@pytest.mark.parametrize("precision, drop", [
    # tiny: dim 64, ffn 192, 2 layers, 4 x 32 = 128 tokens.
    # fp32: 4 ffn-wide fp32 tensors per token: 2 x 128 x 4 x 4 x 192
    ("fp32", 2 * 128 * 4 * 4 * 192),
    # bf16 autocast: 4 x 2 x 192 + w1's and w3's two 16-bit casts of the input become one (2 x 64) per token,
    # and the MLP's three 16-bit weight copies (2 x 3 x 64 x 192) per block are not kept
    ("bf16", 2 * (128 * (4 * 2 * 192 + 2 * 64) + 2 * 3 * 64 * 192)),
])
def test_tiles_drop_the_mlp_intermediates_by_the_closed_form(precision, drop):
    p, lay = setup(*TINY, f"--train.precision={precision}")
    plain, tiled = memory(p, lay), memory(p, lay.with_(linear_tiles=4))
    assert plain.detail["activations_blocks"] - tiled.detail["activations_blocks"] == drop
    # one tile's backward working set: 6 tile-wide tensors (SwiGLU) + dx in fp32 + one dx term, per token
    a = 4 if precision == "fp32" else 2
    assert tiled.detail["recompute_working_set"] == 128 * (6 * a * 192 / 4 + (4 + a) * 64)
    assert plain.detail["recompute_working_set"] == 0


def test_tiles_under_recomputation():
    p, lay = setup(*TINY, "--train.precision=fp32")
    full, full_t = memory(p, lay.with_(recompute="full")), memory(p, lay.with_(recompute="full", linear_tiles=4))
    # full: only the block input is stored either way; the working set is the tiled block + one tile
    assert full.detail["activations_blocks"] == full_t.detail["activations_blocks"]
    rematerialized = 128 * 4 * 4 * 192
    assert full.detail["recompute_working_set"] - full_t.detail["recompute_working_set"] == \
        rematerialized - 128 * (6 * 4 * 192 / 4 + 8 * 64)
    # selective "op": the policy does not cache the tiled MLP's GEMM outputs (w1, w3, w2: 2 x 192 + 64 per token)
    op, op_t = memory(p, lay.with_(recompute="selective")), memory(p, lay.with_(recompute="selective", linear_tiles=4))
    assert op.detail["activations_blocks"] - op_t.detail["activations_blocks"] == 2 * 128 * 4 * (2 * 192 + 64)


@pytest.mark.parametrize("arch, preset", [("llama", "tiny"), ("gpt", "tiny-gpt")])
def test_tiles_closed_form_matches_the_modules_under_autocast(arch, preset):
    """The bf16-autocast delta the planner uses (activations.tiled_mlp_delta), measured on the real tiled
    MLPs (parallel/tiling.py) with the trainer's PeakActivationMeter."""
    import torch

    from shardwise.config import build_config
    from shardwise.models import build_model
    from shardwise.parallel.tiling import apply_linear_tiles
    from shardwise.plan.activations import tiled_mlp_delta
    from shardwise.train.memory_meter import PeakActivationMeter

    ref = build_model(build_config({"model": {"preset": preset, "vocab_size": 512}}).model)
    ref.init_weights(seed=0)
    tiled = copy.deepcopy(ref)
    apply_linear_tiles(tiled, 4)
    tokens = torch.randint(0, 512, (2, 16))
    peaks = []
    for model in (ref, tiled):
        with PeakActivationMeter(exclude=model) as meter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(tokens)
            out.float().sum().backward()
        peaks.append(meter.peak)
    p, _ = setup(f"--model.preset={preset}", "--model.vocab_size=512")
    delta = tiled_mlp_delta(p.shape, "autocast")
    assert peaks[0] - peaks[1] == -ref.cfg.n_layers * (delta.per_token * 32 + delta.fixed)


def test_tiles_add_the_recomputed_up_projections():
    p, lay = setup(*ONE_GPU, *ONE_B, "--train.compile=true")  # compiled: no eager launches on top of the GEMMs
    plain, tiled = evaluate(p, lay), evaluate(p, lay.with_(linear_tiles=4))
    assert plain.breakdown_s["recompute"] == 0 and tiled.breakdown_s["recompute"] > 0
    # 2 GEMMs of 2 x tokens x dim x ffn per block, at no better than the MAMF peak: a lower bound
    tokens, s = 2 * 2048, p.shape
    flops = s.n_layers * 2 * 2 * tokens * s.dim * s.ffn_dim * lay.accumulation(p)
    peak = p.cluster.device.peak_flops("bf16") * C.MAMF_FRACTION["h100-sxm-80gb"]
    assert flops / peak < tiled.breakdown_s["recompute"] < 1.5 * flops / peak + 0.02 * tiled.step_time_s
    # twice the tokens, about twice the recompute
    p2, lay2 = setup(*ONE_GPU, *ONE_B, "--train.micro_batch=4", "--train.global_batch=8", "--train.compile=true")
    twice = evaluate(p2, lay2.with_(linear_tiles=4)).breakdown_s["recompute"]
    assert twice == pytest.approx(2 * tiled.breakdown_s["recompute"], rel=0.1)
    assert memory(p, lay.with_(linear_tiles=1)) == memory(p, lay)  # one tile is no tiling


def test_search_on_one_gpu_proposes_offload_for_a_model_too_large():
    p = setup(*ONE_GPU, "--model.preset=llama3-8b", "--train.seq_len=4096", "--train.global_batch=8")[0]
    r = search(p, top=5)
    assert r.best is not None and r.best.fits and r.needs == "offload"
    assert all(e.layout.offload and not e.layout.nvme and e.layout.shard_group == 1 for e in r.ranked)
    assert r.best.memory.cpu_bytes > p.cluster.device.memory_gib * GIB  # the states alone overflow the GPU
    assert "nothing fits without offload; these layouts need it" in search_text(p, r, 5)
    assert search_json(p, r, 5)["needs"] == "offload"
    # a model whose states overflow the host memory too: the moments go to disk
    p20 = setup(*ONE_GPU, "--model.preset=llama3-8b", "--model.n_layers=80", "--train.seq_len=2048",
                "--train.global_batch=4")[0]
    r20 = search(p20, top=3)
    assert r20.best is not None and r20.best.layout.nvme and r20.best.memory.host_fits
    assert r20.pruned["offload=cpu over host memory: nvme instead"] > 0


def test_search_never_offloads_or_tiles_when_a_plain_layout_fits():
    for p in (setup(*TINY, "--train.precision=bf16")[0],
              setup("--model.preset=llama3-8b", "--train.precision=bf16", "--cluster.num_gpus=8", "--train.seq_len=2048",
                    "--train.global_batch=16")[0]):
        r = search(p, top=5)
        assert r.best is not None and r.needs == "" and r.note == ""
        assert not any(e.layout.offload or e.layout.linear_tiles > 1 for e in r.ranked)


def test_search_tiles_when_one_mlp_overflows_even_under_full_recompute():
    """A very wide MLP (ffn 131072) at 64K tokens: one block's rematerialized intermediates alone exceed the
    GPU, so full recomputation does not fit; tiles (which keep only the MLP's input) do, and win. At 32K
    selective recomputation keeping every other matmul output (w3's ffn-wide output not kept) fits, and beats
    full recomputation, which reruns the whole forward."""
    wide = (*ONE_GPU, "--model.preset=llama3-8b", "--model.dim=1024", "--model.n_heads=8", "--model.n_kv_heads=8",
            "--model.ffn_dim=131072", "--model.vocab_size=8192", "--model.n_layers=2", "--train.global_batch=1")
    fits = search(setup(*wide, "--train.seq_len=32768", "--model.max_seq_len=32768")[0], top=3)
    best = fits.best.layout
    assert fits.needs == "" and (best.recompute, best.recompute_policy, best.linear_tiles) == ("selective", "op_alternate", 1)
    assert not any(e.layout.recompute == "selective" and e.layout.recompute_policy == "op" for e in fits.ranked)
    r = search(setup(*wide, "--train.seq_len=65536", "--model.max_seq_len=65536")[0], top=3)
    assert r.best is not None and r.best.layout.linear_tiles > 1 and not r.best.layout.offload and "tiling" in r.needs
    assert all(e.layout.offload or e.layout.linear_tiles > 1 for e in r.ranked)


def test_a_cpu_device_offloads_nothing(tmp_path):
    data = {"benchmark": "kernels", "device_type": "cpu", "gemm": {"dtype": "fp32", "peak_flops": 2e11},
            "bandwidth": {"rows": [{"kernel": "copy", "gbps": 40.0}]},
            "sdpa": {"rows": [{"requested": "default", "dtype": "fp32", "fwd_bwd_flops": 0.7e11}]},
            "overhead": {"rows": [{"mode": "eager", "s_per_op": 2e-6}]},
            "optimizer": {"rows": [{"impl": "foreach", "bytes_per_param_at_copy_bw": 100.0},
                                   {"impl": "fused", "bytes_per_param_at_copy_bw": 40.0}]}}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(data))
    p, lay = setup(*TINY, "--cluster.gpu=cpu", f"--cluster.calibration={path}")
    off = lay.with_(zero=3, offload=True)
    m, e = memory(p, off), evaluate(p, off)
    assert m.cpu_bytes == 0 and m.params > 0 and m.optimizer > 0  # nothing leaves the (host) memory
    assert e.detail["offload_copy_s"] == 0  # no host link
    # the measured fused AdamW (40 B/param at the copy rate), not foreach's 100 (the trainer's offload step is fused)
    assert e.detail["offload_adamw_s"] == pytest.approx(states(p, off).optimizer / 8 * 40.0 / 40e9)
    nvme = memory(p, off.with_(nvme=True))
    assert nvme.disk_bytes == 8 * p.shape.num_params and nvme.cpu_bytes == 0
    assert "host and device are the same memory" in evaluate_text(p, e)


def test_doctor_measures_a_disk(tmp_path, capsys):
    from shardwise.launch.doctor import disk_bandwidth, main

    r = disk_bandwidth(tmp_path, mib=4)
    assert r["bytes"] == 4 << 20 and r["read_gbps"] > 0 and r["write_gbps"] > 0
    assert min(r["read_gbps"], r["write_gbps"]) <= r["effective_gbps"] <= max(r["read_gbps"], r["write_gbps"])
    assert r["planner_flag"].startswith("--cluster.disk_gbps=") and not list(tmp_path.iterdir())
    assert main(["--disk", str(tmp_path), "--disk-mib", "2"]) == 0
    assert "--cluster.disk_gbps=" in capsys.readouterr().out
    assert float(r["planner_flag"].split("=")[1]) > 0
    assert not list(Path(tmp_path).iterdir())
