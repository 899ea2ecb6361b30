"""spec/hardware.py (datasheet table, name look-ups, CUDA name mapping) and train/peak_flops.py (the
matmul probe)."""
from __future__ import annotations

import math
import re
import time

import pytest

from shardwise.errors import ConfigError
from shardwise.spec.hardware import DEVICES, lookup, match_cuda_name, normalize_dtype
from shardwise.train.peak_flops import device_peak_flops, measure_cpu_peak_flops

REQUIRED = ["a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-nvl-94gb", "h200-sxm-141gb", "b200", "mi300x"]


def test_required_devices_present_and_keyed_by_their_name():
    for name in REQUIRED:
        assert name in DEVICES
    for key, dev in DEVICES.items():
        assert dev.name == key
        assert dev.source and dev.memory_gib > 0 and dev.memory_bandwidth_gbps > 0
        assert dev.intra_node_gbps > dev.inter_node_gbps > 0


def test_published_dense_peaks():
    h100 = lookup("h100-sxm-80gb").peak_tflops
    assert h100 == {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
    assert lookup("a100-sxm-80gb").peak_tflops == {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
    h200 = lookup("h200-sxm-141gb")
    assert h200.peak_tflops == h100 and h200.memory_gib == 141 and h200.memory_bandwidth_gbps == 4800
    assert lookup("mi300x").peak_tflops["bf16"] == 1307.4 and lookup("mi300x").peak_tflops["fp32"] == 163.4
    assert lookup("b200").peak_tflops["bf16"] == 2250.0
    assert lookup("h100-nvl-94gb").peak_tflops["bf16"] == pytest.approx(835, abs=1)


def test_dense_ratios_are_consistent():
    """Dense tensor-core peaks halve per doubling of width on every listed part: tf32 = bf16 / 2,
    fp16 = bf16, fp8 = 2 bf16. A sparse figure copied by mistake would break one of these."""
    for dev in DEVICES.values():
        p = dev.peak_tflops
        assert p["fp16"] == p["bf16"]
        assert p["tf32"] == pytest.approx(p["bf16"] / 2, rel=0.01), dev.name
        if "fp8" in p:
            assert p["fp8"] == pytest.approx(2 * p["bf16"], rel=0.01), dev.name
        assert p["fp32"] < p["tf32"]


def test_lookup_is_case_insensitive_and_peak_flops_in_flop_per_s():
    assert lookup(" H100-SXM-80GB ") is DEVICES["h100-sxm-80gb"]
    assert DEVICES["h100-sxm-80gb"].peak_flops("bfloat16") == pytest.approx(989.4e12)


def test_unknown_device_suggests_nearest():
    with pytest.raises(ConfigError) as e:
        lookup("h100-sxm-80g")
    assert e.value.field == "cluster.gpu"
    assert "did you mean 'h100-sxm-80gb'" in str(e.value)


def test_missing_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="fp8"):
        DEVICES["a100-sxm-80gb"].peak_flops("fp8")
    with pytest.raises(ConfigError):
        normalize_dtype("int3")
    assert normalize_dtype("torch.bfloat16") == "bf16" and normalize_dtype("half") == "fp16"


@pytest.mark.parametrize("cuda_name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie-80gb"),
    ("NVIDIA H100 NVL", "h100-nvl-94gb"),
    ("NVIDIA H200", "h200-sxm-141gb"),
    ("NVIDIA H200 NVL", "h200-nvl-141gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA B200", "b200"),
    ("AMD Instinct MI300X", "mi300x"),
    ("NVIDIA GH200 480GB", None),  # not an H200: different memory and clocks -> probe
    ("NVIDIA GB200", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_cuda_name_mapping(cuda_name, key):
    assert match_cuda_name(cuda_name) == key


def test_device_peak_flops_for_known_cuda_names():
    peak, label = device_peak_flops("cuda", "bf16", "NVIDIA H100 80GB HBM3")
    assert peak == pytest.approx(989.4e12) and "h100-sxm-80gb" in label
    peak, _ = device_peak_flops("cuda", "fp32", "NVIDIA A100-SXM4-80GB")
    assert peak == pytest.approx(19.5e12)  # TF32 matmul is off by default in PyTorch


def test_cpu_probe_is_positive_fast_cached_and_labelled():
    start = time.perf_counter()
    fp32 = measure_cpu_peak_flops("fp32")
    assert time.perf_counter() - start < 3.0
    assert math.isfinite(fp32) and fp32 > 1e8
    start = time.perf_counter()
    assert measure_cpu_peak_flops("fp32") == fp32  # lru_cache: no second probe
    assert time.perf_counter() - start < 0.01
    peak, label = device_peak_flops("cpu", "fp32")
    assert peak == fp32 and "measured" in label and re.search(r"on \d+ threads?$", label)


def test_cpu_probe_fp16_stays_short():
    start = time.perf_counter()
    assert measure_cpu_peak_flops("fp16") > 0
    assert time.perf_counter() - start < 3.0
