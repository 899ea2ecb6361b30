"""Accelerator table: vendor datasheet peaks, memory and link bandwidths.

docs/architecture.md §5: MFU divides achieved model FLOP/s by the *peak* FLOP/s of the device for the training
dtype. For known GPUs the peak is the vendor's published dense (no 2:4 sparsity) tensor-core number;
datasheets usually print the sparse figure with a footnote, so those are halved here. A CPU has no
meaningful datasheet peak for PyTorch, so train/peak_flops.py measures it with a short matmul probe
and labels it measured; an unknown GPU gets the same probe on the GPU.

Bandwidths are in GB/s (10^9 bytes/s). `intra_node_gbps` is the per-GPU *unidirectional* scale-up
bandwidth (NVLink / Infinity Fabric; vendors quote the bidirectional sum, halved here);
`inter_node_gbps` is the per-GPU network share of the vendor's reference platform (e.g. DGX H100:
one 400 Gb/s ConnectX-7 per GPU = 50 GB/s). The planner may override both.

`tdp_w` is the board's maximum power in watts as the same datasheets print it ("Max thermal design
power (TDP)", NVIDIA; "total board power", AMD), the configurable maximum where a range is given; the
planner's energy model (plan/goodput.py) scales it by the predicted busy fraction of a step.

This module is pure Python (the spec floor): the planner uses the table without torch.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class Device:
    """One accelerator model. `peak_tflops` maps dtype -> dense peak in TFLOP/s (10^12 FLOP/s)."""

    name: str
    peak_tflops: dict[str, float] = field(hash=False)
    memory_gib: float
    memory_bandwidth_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    source: str
    tdp_w: float = 0.0  # maximum board power, watts (datasheet, see `source`); 0 = unknown: no energy estimate

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ("fp32", "tf32", "bf16", "fp16", "fp8" or an alias)."""
        key = normalize_dtype(dtype)
        if key not in self.peak_tflops:
            raise ConfigError("train.precision", f"{self.name} has no published {key} peak",
                              f"use one of: {', '.join(self.peak_tflops)}")
        return self.peak_tflops[key] * 1e12


_A100_TFLOPS = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
_H100_SXM_TFLOPS = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_H100_NVL_TFLOPS = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}

_A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (2021; sparse TF32/BF16/FP16 halved)"
_DGX_A100_NET = "DGX A100 system: 8x 200 Gb/s HDR InfiniBand, one per GPU"
_H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023; sparse tensor-core figures halved)"
_H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024; sparse tensor-core figures halved)"

# Never mutated: a module-level constant table.
DEVICES: dict[str, Device] = {
    "a100-sxm-40gb": Device("a100-sxm-40gb", _A100_TFLOPS, 40.0, 1555.0, 300.0, 25.0,
                            f"{_A100_DS}, A100 40GB SXM column (max TDP 400 W); NVLink 600 GB/s bidirectional; "
                            f"{_DGX_A100_NET}", tdp_w=400.0),
    "a100-sxm-80gb": Device("a100-sxm-80gb", _A100_TFLOPS, 80.0, 2039.0, 300.0, 25.0,
                            f"{_A100_DS}, A100 80GB SXM column (max TDP 400 W); NVLink 600 GB/s bidirectional; "
                            f"{_DGX_A100_NET}", tdp_w=400.0),
    "a100-pcie-40gb": Device("a100-pcie-40gb", _A100_TFLOPS, 40.0, 1555.0, 300.0, 25.0,
                             f"{_A100_DS}, A100 40GB PCIe column (max TDP 250 W); NVLink bridge (GPU pairs only) "
                             "600 GB/s bidirectional; network assumes one 200 Gb/s NIC per GPU", tdp_w=250.0),
    "a100-pcie-80gb": Device("a100-pcie-80gb", _A100_TFLOPS, 80.0, 1935.0, 300.0, 25.0,
                             f"{_A100_DS}, A100 80GB PCIe column (max TDP 300 W); NVLink bridge (GPU pairs only) "
                             "600 GB/s bidirectional; network assumes one 200 Gb/s NIC per GPU", tdp_w=300.0),
    "h100-sxm-80gb": Device("h100-sxm-80gb", _H100_SXM_TFLOPS, 80.0, 3350.0, 450.0, 50.0,
                            f"{_H100_DS}, H100 SXM column (max TDP up to 700 W, configurable); NVLink 900 GB/s "
                            "bidirectional; DGX H100: 8x 400 Gb/s ConnectX-7, one per GPU", tdp_w=700.0),
    "h100-pcie-80gb": Device("h100-pcie-80gb",
                             {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
                             80.0, 2000.0, 300.0, 25.0,
                             f"{_H100_DS}, H100 PCIe column (max TDP 300-350 W configurable: 350 W); NVLink bridge "
                             "(GPU pairs only) 600 GB/s bidirectional; network assumes one 200 Gb/s NIC per GPU",
                             tdp_w=350.0),
    "h100-nvl-94gb": Device("h100-nvl-94gb", _H100_NVL_TFLOPS, 94.0, 3900.0, 300.0, 50.0,
                            f"{_H100_DS}, H100 NVL column (per GPU; max TDP 2x 350-400 W configurable: 400 W); "
                            "NVLink bridge 600 GB/s bidirectional; network assumes one 400 Gb/s NIC per GPU",
                            tdp_w=400.0),
    "h200-sxm-141gb": Device("h200-sxm-141gb", _H100_SXM_TFLOPS, 141.0, 4800.0, 450.0, 50.0,
                             f"{_H200_DS}, H200 SXM column (same compute as H100 SXM; max TDP up to 700 W, "
                             "configurable); NVLink 900 GB/s bidirectional; DGX H200: 8x 400 Gb/s ConnectX-7, one per GPU",
                             tdp_w=700.0),
    "h200-nvl-141gb": Device("h200-nvl-141gb", _H100_NVL_TFLOPS, 141.0, 4800.0, 450.0, 50.0,
                             f"{_H200_DS}, H200 NVL column (max TDP up to 600 W, configurable); 2/4-way NVLink bridge "
                             "900 GB/s bidirectional; network assumes one 400 Gb/s NIC per GPU", tdp_w=600.0),
    "b200": Device("b200", {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
                   180.0, 8000.0, 900.0, 50.0,
                   "NVIDIA DGX B200 / HGX B200 specifications (8-GPU totals: 36 PF FP16/BF16, 72 PF FP8, "
                   "18 PF TF32 with sparsity, 600 TF FP32, 1,440 GB HBM3e, 64 TB/s) divided by 8, sparse "
                   "halved; NVLink 5 1.8 TB/s bidirectional; DGX B200: 8x 400 Gb/s ConnectX-7; HGX B200: up "
                   "to 1,000 W per GPU (the configuration these peaks are quoted at)", tdp_w=1000.0),
    "mi300x": Device("mi300x", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
                     192.0, 5300.0, 448.0, 50.0,
                     "AMD Instinct MI300X accelerator datasheet (dense matrix peaks); AMD CDNA 3 white "
                     "paper: 7 Infinity Fabric links x 64 GB/s per direction (full mesh, 64 GB/s to each "
                     "peer); network assumes one 400 Gb/s NIC per GPU; total board power 750 W peak (datasheet)",
                     tdp_w=750.0),
}
# cluster.gpu = "cpu": not a table entry (it has no datasheet peak PyTorch reaches). Planning one needs its
# measured numbers (cluster.calibration = benchmarks/kernels.py's JSON; plan/layout.py refuses "cpu"
# without them). Memory is the host's and not modelled: a large placeholder, so every layout "fits".
CPU = Device("cpu", {}, 1024.0, 0.0, 0.0, 0.0, "a CPU: every rate measured by benchmarks/kernels.py "
             "(--cluster.calibration=kernels.json)")

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}

# torch.cuda.get_device_name() strings -> table key. Order matters (NVL/PCIe before the plain name).
# The look-behind keeps "GH200"/"GB200" (different clocks and memory) from matching H200/B200.
_CUDA_NAME_RULES: tuple[tuple[str, str], ...] = (
    (r"(?<![A-Z0-9])H200\b.*NVL|NVL.*(?<![A-Z0-9])H200\b", "h200-nvl-141gb"),
    (r"(?<![A-Z0-9])H200\b", "h200-sxm-141gb"),
    (r"(?<![A-Z0-9])H100\b.*NVL", "h100-nvl-94gb"),
    (r"(?<![A-Z0-9])H100\b.*PCIE", "h100-pcie-80gb"),
    (r"(?<![A-Z0-9])H100\b", "h100-sxm-80gb"),
    (r"(?<![A-Z0-9])A100\b.*80GB.*PCIE|(?<![A-Z0-9])A100\b.*PCIE.*80GB", "a100-pcie-80gb"),
    (r"(?<![A-Z0-9])A100\b.*80GB", "a100-sxm-80gb"),
    (r"(?<![A-Z0-9])A100\b.*PCIE", "a100-pcie-40gb"),
    (r"(?<![A-Z0-9])A100\b", "a100-sxm-40gb"),
    (r"(?<![A-Z0-9])B200\b", "b200"),
    (r"\bMI300X\b", "mi300x"),
)


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype key ("fp32", "tf32", "bf16", "fp16", "fp8") for names and torch aliases."""
    key = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
    if key is None:
        raise ConfigError("train.precision", f"unknown dtype {dtype!r}", 'use "fp32", "bf16" or "fp16"')
    return key


def lookup(name: str) -> Device:
    """The table entry for a device name (case-insensitive); a ConfigError on `cluster.gpu` otherwise."""
    key = name.strip().lower()
    if key in DEVICES:
        return DEVICES[key]
    if key == CPU.name:
        return CPU
    match = difflib.get_close_matches(key, [*DEVICES, CPU.name], n=1, cutoff=0.0)
    hint = f"did you mean '{match[0]}'? " if match else ""
    raise ConfigError("cluster.gpu", f"unknown device {name!r}", f"{hint}valid names: {', '.join(DEVICES)}, cpu")


def match_cuda_name(cuda_name: str) -> str | None:
    """Map a `torch.cuda.get_device_name()` string (e.g. "NVIDIA H100 80GB HBM3") to a table key."""
    upper = cuda_name.upper()
    for pattern, key in _CUDA_NAME_RULES:
        if re.search(pattern, upper):
            return key
    return None
