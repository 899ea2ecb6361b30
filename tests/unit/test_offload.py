"""The NVMe tier's optimizer (parallel/offload.py NvmeAdamW) on its own, and the offload config rules.

NvmeAdamW must be torch's fused AdamW with the moments in a file: the same parameters bit for bit,
whatever the chunking, with only its two chunk buffers resident. Runs of the whole trainer (one and
two processes, resume, a full disk, a killed run) are in tests/dist/test_offload.py.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from shardwise.parallel.offload import STATE_BYTES_PER_ELEMENT, NvmeAdamW


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8))


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 4) -> None:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


@pytest.mark.parametrize("chunk_bytes", [1, 600, 64 << 20])
def test_nvme_adamw_is_fused_adamw_bitwise(tmp_path, chunk_bytes):
    """Chunking (one parameter per chunk, a few, or everything in one) and the file round trip change
    nothing: AdamW is element-wise, and the moments are stored as the fp32 they are."""
    reference, offloaded = _model(), _model()
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _train(reference, torch.optim.AdamW(_groups(reference), fused=True, **kwargs))
    optimizer = NvmeAdamW(_groups(offloaded), tmp_path, chunk_bytes=chunk_bytes, **kwargs)
    assert len(optimizer.chunks) == (6 if chunk_bytes == 1 else 1 if chunk_bytes > 2**20 else len(optimizer.chunks))
    _train(offloaded, optimizer)
    for a, b in zip(reference.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
    numel = sum(p.numel() for p in offloaded.parameters())
    assert optimizer.path.stat().st_size == numel * STATE_BYTES_PER_ELEMENT
    assert optimizer.stats.read_bytes == optimizer.stats.write_bytes == 4 * numel * STATE_BYTES_PER_ELEMENT
    # Resident: the two chunk buffers and the step counters, not the moments.
    largest = max(sum(p.numel() for p in c) for c in optimizer.chunks)
    assert optimizer.resident_bytes() == 2 * 2 * largest * 4 + 6 * 4
    directory = optimizer.directory
    optimizer.close()
    assert not directory.exists()


def test_state_dict_round_trips_through_the_file(tmp_path):
    """state_dict() shows the moments as ordinary tensors (views of the mapped file, what DCP saves);
    load_state_dict() of another optimizer's state writes it into the file, and the next steps are
    those of plain fused AdamW resumed from the same state."""
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    reference = _model()
    ref_opt = torch.optim.AdamW(_groups(reference), fused=True, **kwargs)
    _train(reference, ref_opt, steps=2)
    offloaded = _model()
    offloaded.load_state_dict(reference.state_dict())
    optimizer = NvmeAdamW(_groups(offloaded), tmp_path, chunk_bytes=600, **kwargs)
    optimizer.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch's load shares the step tensors
    p = next(offloaded.parameters())
    assert optimizer.state[p]["exp_avg"].data_ptr() == optimizer._views(p)[0].data_ptr()  # lives in the file
    saved = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(saved, ref_opt.state_dict()["state"][0]["exp_avg"])
    for opt, model in ((ref_opt, reference), (optimizer, offloaded)):
        torch.manual_seed(5)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
    for a, b in zip(reference.parameters(), offloaded.parameters()):
        assert torch.equal(a, b)
    optimizer.close()


def test_state_directory_is_owned_by_its_process(tmp_path):
    """The moments' directory is named after this process (shardwise/scratch.py), so the next run on
    this host removes it if this one is killed; close() removes it otherwise."""
    optimizer = NvmeAdamW(nn.Linear(4, 4).parameters(), tmp_path, rank=3, lr=1e-3)
    assert optimizer.directory.parent == tmp_path
    assert optimizer.directory.name.startswith("shardwise-nvme-") and f"-{os.getpid()}-rank3-" in optimizer.directory.name
    optimizer.close()
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_an_error_before_training(tmp_path):
    """The moments are reserved with posix_fallocate when the optimizer is built: no space is a clear
    OSError (a storage failure, exit code 4 in a run) naming the file, and nothing is left behind."""
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount (a 64 KiB tmpfs) to fill a disk")
    try:
        model = nn.Linear(256, 256)  # 65,792 parameters x 8 B = 514 KiB of moments > 64 KiB
        with pytest.raises(OSError) as e:
            NvmeAdamW(model.parameters(), tmp_path, lr=1e-3)
        assert e.value.errno == 28 and "adamw_state.bin" in e.value.filename and "offload" in e.value.strerror
        assert list(tmp_path.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(tmp_path)], capture_output=True)


@pytest.mark.parametrize("args, field, text", [
    (["--parallel.offload=nvme"], "parallel.offload_dir", "needs a directory"),
    (["--parallel.offload=nvme", "--parallel.offload_dir=/does/not/exist"], "parallel.offload_dir", "not a directory"),
    (["--parallel.offload=disk"], "parallel.offload", "disk"),
    (["--parallel.offload=cpu", "--parallel.zero=0"], "parallel.offload", "needs FSDP"),
    (["--parallel.zero=3"], "parallel.zero", "offload=cpu"),
])
def test_bad_offload_settings_exit_2_before_anything_runs(args, field, text):
    run = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--train.steps=1", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert field in run.stderr and text in run.stderr and "Traceback" not in run.stderr


def test_offload_materializes_parameters_on_the_cpu_for_a_cuda_device():
    """FSDP2's CPUOffloadPolicy needs the parameters materialised on the CPU; on CUDA they were put on
    the GPU and the first forward raised (H100, 2026-11-25). Decided here for a CUDA device, on CPU."""
    from shardwise.parallel.parallelize import state_devices
    from shardwise.spec.dims import ParallelDims

    cuda = torch.device("cuda", 0)
    offloaded = ParallelDims(1, 1, 1, 1, 1, 1, 1, offload=True)
    assert state_devices(offloaded, cuda) == (torch.device("cpu"), cuda)  # buffers (RoPE) where the forward runs
    assert state_devices(ParallelDims(1, 1, 1, 1, 1, 1, 1), cuda) == (cuda, cuda)
    assert state_devices(offloaded, torch.device("cpu")) == (torch.device("cpu"), torch.device("cpu"))


def test_materialize_puts_buffers_apart_from_parameters():
    """Parameters on one device, buffers on another (meta stands in for the GPU here): the values of
    the parameters are those of a one-device materialisation."""
    from shardwise.config import build_config
    from shardwise.models import build_model
    from shardwise.models.weights import weight_source
    from shardwise.parallel.parallelize import materialize

    cfg = build_config(None, [("model.preset", "tiny"), ("model.vocab_size", "64")])
    models = []
    for buffers_on in (None, torch.device("meta")):
        with torch.device("meta"):
            model = build_model(cfg.model)
        materialize(model, torch.device("cpu"), weight_source(model, cfg.model.init_from, cfg.train.seed), buffers_on)
        models.append(model)
    one, split = models
    assert all(p.device.type == "cpu" for p in split.parameters())
    buffers = dict(split.named_buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers.values())
    assert set(buffers) == {n for n, _ in one.named_buffers()}  # the same buffers, persistence kept
    assert set(split.state_dict()) == set(one.state_dict())
    assert all(p.equal(q) for p, q in zip(one.parameters(), split.parameters()))
