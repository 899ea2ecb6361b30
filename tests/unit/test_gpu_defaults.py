"""The defaults a GPU user gets without asking, decided on CPU (issue 27): train.precision unset is bf16
on a GPU with native bf16 and fp32 elsewhere, fp32 on CUDA multiplies in TF32 unless train.tf32=false,
and the planner prices exactly what the trainer picks. On the H100 (2026-11-25) an unset precision
trained in fp32 with TF32 off: 33% of the fp32 peak, and inductor warned about it."""
from __future__ import annotations

import torch

from shardwise.config import build_config
from shardwise.parallel.precision import resolve_precision, set_matmul_precision
from shardwise.plan.layout import Problem
from shardwise.spec.layout import compute_precision, default_precision
from shardwise.train.step_log import _precision_words

CUDA = torch.device("cuda", 0)


def test_default_precision_by_device():
    assert default_precision("cuda", has_bf16=True) == "bf16"
    assert default_precision("cuda", has_bf16=False) == "fp32"  # V100 and older: no bf16 tensor cores
    assert default_precision("cpu", has_bf16=True) == "fp32"  # CPU references stay fp32
    assert compute_precision("fp32", tf32=True) == "tf32" and compute_precision("fp32") == "fp32"
    assert compute_precision("fp8", tf32=True) == "bf16" and compute_precision("bf16", tf32=True) == "bf16"


def test_the_trainer_resolves_an_unset_precision_for_its_device(monkeypatch):
    cfg = build_config(None, [])
    assert cfg.train.precision is None and cfg.train.tf32 is True
    assert resolve_precision(cfg, torch.device("cpu")).train.precision == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    resolved = resolve_precision(cfg, CUDA)
    assert resolved.train.precision == "bf16" and cfg.train.precision is None  # a copy: the caller's config unchanged
    # Emulated bf16 (a pre-Ampere GPU) does not count: fp32 there.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_precision(cfg, CUDA).train.precision == "fp32"
    explicit = build_config(None, [("train.precision", "fp16")])
    assert resolve_precision(explicit, CUDA) is explicit


def test_tf32_is_switched_on_cuda_only():
    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision(True, torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before  # a CPU run is left alone
        set_matmul_precision(True, CUDA)
        assert torch.get_float32_matmul_precision() == "high"
        set_matmul_precision(False, CUDA)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = True


def test_the_planner_prices_what_the_trainer_picks():
    gpu = Problem.from_config(build_config(None, [("cluster.gpu", "h100-sxm-80gb"), ("cluster.num_gpus", "8")]))
    assert gpu.precision == "bf16" and gpu.compute_precision == "bf16"
    fp32 = Problem.from_config(build_config(None, [("cluster.gpu", "h100-sxm-80gb"), ("train.precision", "fp32")]))
    assert fp32.compute_precision == "tf32"
    strict = Problem.from_config(build_config(None, [("cluster.gpu", "h100-sxm-80gb"), ("train.precision", "fp32"),
                                                     ("train.tf32", "false")]))
    assert strict.compute_precision == "fp32"


def test_the_startup_line_names_the_choice():
    assert _precision_words("bf16", True, CUDA) == "bf16 (train.precision unset: bf16 on this GPU)"
    assert _precision_words("fp32", True, torch.device("cpu")) == "fp32 (train.precision unset: fp32 on this device)"
    assert _precision_words("fp16", False, torch.device("cpu")) == "fp16"


def test_run_backend_lets_ranks_share_a_gpu_over_gloo():
    """run.backend: auto is NCCL on CUDA; gloo lets several ranks use one GPU (gloo carries CUDA tensors in
    collectives and FSDP2: measured on the H100), which cuda_index otherwise refuses; pipelines need
    point-to-point CUDA transfers gloo lacks, so they are refused there with the fix."""
    import pytest

    from shardwise.errors import ConfigError
    from shardwise.parallel.pipeline import check_stage_transport
    from shardwise.train.distributed import cuda_index, process_group_backend

    assert process_group_backend("auto", cuda=True) == "nccl" and process_group_backend("auto", cuda=False) == "gloo"
    assert process_group_backend("gloo", cuda=True) == "gloo"
    with pytest.raises(ConfigError, match="needs CUDA"):
        process_group_backend("nccl", cuda=False)
    with pytest.raises(ConfigError, match="--run.backend=gloo"):
        cuda_index(1, 2, 1, None)  # two ranks, one GPU, NCCL: refused, and the fix names the way to share
    assert [cuda_index(r, 4, 1, None, shared=True) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ConfigError, match="pipeline stages"):
        check_stage_transport(2, "gloo", "cuda")
    check_stage_transport(2, "gloo", "cpu")
    check_stage_transport(2, "nccl", "cuda")
    check_stage_transport(1, "gloo", "cuda")
