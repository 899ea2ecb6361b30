"""Every calibration and efficiency constant of the planner, in one place, each with its source.

How these were chosen (docs/architecture.md §6): from microbenchmarks of the devices (published ones: no GPU was
available where this planner was written, so none of these was measured by us on a GPU) and from
first principles. None was fitted to the large published training runs (Megatron-LM, Korthikanti et
al., MegaScale, Llama 3, torchtitan) — those are kept aside to judge the planner's accuracy.
Where a number is an assumption rather than a measurement, it says so. Change them here only.
"""
from __future__ import annotations

# ---------------------------------------------------------------------------------------------------
# Matmul (GEMM) throughput
# ---------------------------------------------------------------------------------------------------
# Maximum achievable matmul FLOP/s as a fraction of the datasheet dense bf16 peak ("MAMF"), measured
# with Stas Bekman's mamf-finder (ml-engineering, compute/accelerator/benchmarks/mamf-finder.py) over
# a sweep of large shapes; results as published in github.com/mag-/gpu_benchmark README "Stats":
#   A100 SXM 267.9 TFLOP/s / 312 = 0.859;  H100 SXM 792.1 / 989.4 = 0.801;  H100 PCIe 499.5 / 756.5 = 0.660;
#   MI300X 758.3 / 1307.4 = 0.580.
# h100-nvl, h200 and b200 have no published MAMF in our sources: ASSUMED equal to H100 SXM (same
# tensor-core generation / software stack; H200 is H100 compute with faster memory).
MAMF_FRACTION: dict[str, float] = {
    "a100-sxm-40gb": 0.859, "a100-sxm-80gb": 0.859, "a100-pcie-40gb": 0.822, "a100-pcie-80gb": 0.822,
    "h100-sxm-80gb": 0.801, "h100-pcie-80gb": 0.660, "h100-nvl-94gb": 0.801,
    "h200-sxm-141gb": 0.801, "h200-nvl-141gb": 0.801, "b200": 0.801, "mi300x": 0.580,
}  # a100-pcie: 256.4 / 312 = 0.822 (same source).
MAMF_FRACTION_DEFAULT = 0.75  # ASSUMPTION for a device without an entry.

# Streaming multiprocessors (NVIDIA) / compute units (AMD): the GEMM wave-quantization model below.
# Sources: NVIDIA A100 whitepaper (108 SMs), H100 whitepaper (132 SMs SXM5, 114 PCIe), H200 = H100
# SXM5 die, B200: NVIDIA Blackwell datasheet / whitepaper (148 SMs, 2 dies), AMD CDNA 3 white paper
# (MI300X: 304 CUs).
COMPUTE_UNITS: dict[str, int] = {
    "a100-sxm-40gb": 108, "a100-sxm-80gb": 108, "a100-pcie-40gb": 108, "a100-pcie-80gb": 108,
    "h100-sxm-80gb": 132, "h100-pcie-80gb": 114, "h100-nvl-94gb": 132, "h200-sxm-141gb": 132,
    "h200-nvl-141gb": 132, "b200": 148, "mi300x": 304,
}
COMPUTE_UNITS_DEFAULT = 132
# Output tile of one thread block in cuBLAS/hipBLASLt large GEMMs; a dimension that is not a multiple
# wastes the padded part, and tiles that do not fill the last wave of SMs idle the rest ("tile and
# wave quantization", NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background").
GEMM_TILE_M = 128
GEMM_TILE_N = 128

# Attention (FlashAttention via torch SDPA) achieved fraction of the bf16 peak, forward + backward.
# Hopper: FlashAttention-2 reaches ~35% of H100 peak (Shah et al. 2024, FlashAttention-3, arXiv
# 2407.08608 §1); Ampere: FlashAttention-2 reaches 50-73% of A100 peak forward and less backward (Dao
# 2023, arXiv 2307.08691 §4.1), 0.55 used. Blackwell and MI300X: ASSUMED like Hopper.
ATTENTION_FRACTION: dict[str, float] = {"a100": 0.55, "h100": 0.35, "h200": 0.35, "b200": 0.35, "mi300x": 0.30}
ATTENTION_FRACTION_DEFAULT = 0.35
# FlashAttention with a causal mask skips the blocks above the diagonal: about half of the attention
# FLOPs counted by the model FLOPs (which, like PaLM, do not discount the mask) are executed.
CAUSAL_EXECUTED_FRACTION = 0.5

# ---------------------------------------------------------------------------------------------------
# Memory-bound work (norms, activations functions, RoPE, residual adds, optimizer, cross-entropy)
# ---------------------------------------------------------------------------------------------------
# Achievable fraction of the HBM datasheet bandwidth for streaming kernels: BabelStream-class copy /
# triad kernels reach ~80-90% on A100/H100/MI300X (Deakin et al., BabelStream results); 0.8 used.
HBM_FRACTION = 0.80
# AdamW (torch foreach, fp32 states): reads param, grad, exp_avg, exp_avg_sq (16 B) and writes param,
# exp_avg, exp_avg_sq (12 B) per parameter; "mixed" states add the bf16 param copy (2 B) and read the
# 16-bit grad instead of an fp32 one. Gradient clipping reads every gradient once more (4 B).
OPTIMIZER_BYTES_PER_PARAM = 28.0 + 4.0

# ---------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------
# Achieved bus bandwidth as a fraction of the per-GPU unidirectional link bandwidth (busbw in the
# sense of NVIDIA nccl-tests doc/PERFORMANCE.md, which makes ring all-reduce, all-gather and
# reduce-scatter comparable). ASSUMPTIONS typical of published nccl-tests runs: ring/tree collectives
# reach ~360 GB/s busbw of NVLink4's 450 GB/s on 8x H100 (0.80), and ~40-45 GB/s of a 400 Gb/s
# (50 GB/s) NDR InfiniBand port per GPU across nodes (0.85).
BUS_FRACTION_INTRA = 0.80
BUS_FRACTION_INTER = 0.85
# Per-hop latency of one collective step, and the hop count: log2(n) steps (NCCL double binary trees
# for all-reduce, Sanders et al. 2009; PAT for all-gather / reduce-scatter since NCCL 2.23). ASSUMED
# from the order of NCCL's small-message latencies (~10 us within a DGX, ~20-30 us across nodes at
# a few dozen ranks).
LATENCY_INTRA_S = 2e-6
LATENCY_INTER_S = 6e-6
# Point-to-point (pipeline send/recv): one hop.
# DDP bucket size in this codebase (parallel/data_parallel.py: bucket_cap_mb=25; torch counts MiB).
DDP_BUCKET_BYTES = 25 * 2**20
# Fraction of a tensor-parallel collective hidden behind compute. torch's TP (DTensor) runs its
# collectives on the compute stream unless async-TP / micro-pipelining is enabled, which this codebase
# does not do: 0 = fully exposed (Korthikanti et al. 2022 §3 also counts TP communication as exposed).
TP_OVERLAP_FRACTION = 0.0
# Fraction of pipeline send/recv time on the critical path: torch.distributed.pipelining posts
# isend/irecv but a stage waits for its input before computing, so each boundary transfer delays the
# receiver once per micro-batch and direction. 1.0 = no overlap (conservative).
PP_P2P_EXPOSED_FRACTION = 1.0
# Host link for CPU offload (parallel.offload): PCIe Gen4 x16 = 32 GB/s (A100), Gen5 x16 = 64 GB/s
# (H100/H200/B200/MI300X) per direction, datasheets; 0.8 achievable (ASSUMED).
PCIE_GBPS: dict[str, float] = {"a100": 32.0, "h100": 64.0, "h200": 64.0, "b200": 64.0, "mi300x": 64.0}
PCIE_FRACTION = 0.80
# Host memory bandwidth available to one GPU's offloaded optimizer step (torch AdamW on the CPU is
# memory bound): DGX H100 has 2 sockets x 8 channels DDR5-4800 = 614 GB/s for 8 GPUs = 77 GB/s;
# ~65% achievable (STREAM-class) -> 50 GB/s. ASSUMED for every platform.
HOST_MEMORY_GBPS_PER_GPU = 50.0

# ---------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------
# Fraction of device memory usable by tensors: the CUDA context (~0.5-1 GiB), NCCL buffers and
# allocator fragmentation take the rest. ASSUMED 0.90 (torch's caching allocator typically keeps
# 5-10% reserved-but-unallocated under training workloads).
USABLE_MEMORY_FRACTION = 0.90
# Communication buffers kept resident per process group: NCCL allocates ~2 x NCCL_BUFFSIZE (4 MiB)
# per channel per peer; ~32 channels on NVLink -> ~256 MiB per communicator on the fast fabric, less
# across nodes. ASSUMED 256 MiB per enabled axis.
COMM_BUFFER_BYTES_PER_AXIS = 256 * 2**20

SECONDS_PER_DAY = 86400.0


def family(device_name: str) -> str:
    """"a100", "h100", "h200", "b200", "mi300x" — the key of the per-family tables above."""
    for fam in ("a100", "h100", "h200", "b200", "mi300x"):
        if device_name.startswith(fam):
            return fam
    return device_name

# FP8 dynamic scaling (torchao float8 training, tensorwise / rowwise): per element of a GEMM operand, an
# amax pass reads the 16-bit tensor (2 B), the cast reads it again (2 B) and writes FP8 (1 B).
FP8_CAST_BYTES = 5
