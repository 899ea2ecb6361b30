"""Every calibration and efficiency constant of the planner, in one place, each with its source.

How these were chosen (docs/architecture.md §6): from microbenchmarks of the devices (published ones: no GPU was
available where this planner was written, so none of these was measured by us on a GPU) and from
first principles. None was fitted to the large published training runs (Megatron-LM, Korthikanti et
al., MegaScale, Llama 3, torchtitan) — those are kept aside to judge the planner's accuracy.
Where a number is an assumption rather than a measurement, it says so. Change them here only.
"""
from __future__ import annotations

from shardwise.spec import dims

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
# The SDPA kernels a stack may run (cluster.attention_kernel, plan/stack.py), as a speed relative to the
# default fused kernel that ATTENTION_FRACTION prices (cuDNN's on Hopper: torch 2.11 picks it for bf16).
# MEASURED on one H100 SXM (../shared/gpu/h100-2026-11-25/kernels_h100.json, benchmarks/kernels.py, bf16,
# 8 x 2048 tokens, head dim 128, forward + backward over the bf16 peak): cuDNN 0.343 (GQA 0.328),
# FlashAttention-2 0.197 (0.182), memory-efficient 0.105 -> flash 0.56, efficient 0.31 of cuDNN; the
# measured cuDNN fraction is the 0.35 above. Off Hopper the default fused kernel is FlashAttention-2
# (flash = 1.0) and the memory-efficient kernel is ASSUMED half as fast.
# FlexAttention (train.document_mask on a GPU, models/common.py) per computed tile: ASSUMED 0.87 of
# FlashAttention-2, from PyTorch's FlexAttention announcement (pytorch.org blog, 2024-08: ~90% of FA2's speed
# forward, ~85% backward, A100; 3 / (1 / 0.90 + 2 / 0.85) = 0.87 with backward twice forward's work), so
# 0.56 x 0.87 = 0.49 of cuDNN on Hopper. Not measured here yet: benchmarks/kernels.py times it on a lent GPU.
ATTENTION_KERNEL_SPEED: dict[str, dict[str, float]] = {
    "cudnn": {}, "flash": {"h100": 0.56, "h200": 0.56}, "efficient": {"h100": 0.31, "h200": 0.31},
    "flex": {"h100": 0.49, "h200": 0.49}}
ATTENTION_KERNEL_SPEED_DEFAULT: dict[str, float] = {"cudnn": 1.0, "flash": 1.0, "efficient": 0.5, "flex": 0.87}
# Fused attention kernels tile the head dim: a head dim that is not a multiple of the tile computes the
# padded width (cuDNN's and FlashAttention-3's Hopper kernels are built for d = 64, 128, 256; the profile of
# the d = 128 model shows cuDNN's 64x64x128 / 64x128x128 tiles). ASSUMED 64: the 2.4B H100 rows (d = 80,
# padded to 128: 0.625 of the work useful) were 5-7% slower than the model without it; d = 64 and 128
# (every llama3 preset) are unaffected.
ATTENTION_HEAD_DIM_TILE = 64
# FlashAttention with a causal mask skips the blocks above the diagonal: about half of the attention
# FLOPs counted by the model FLOPs (which, like PaLM, do not discount the mask) are executed.
CAUSAL_EXECUTED_FRACTION = 0.5
# The math SDPA backend (fp32 grouped-query attention on CUDA, spec/layout.py attention_backend) moves
# the s x s probabilities through memory this many times in forward: the QK^T GEMM writes them, the
# causal mask is added in place (read + write), softmax reads and writes, the PV GEMM reads them
# (aten _scaled_dot_product_attention_math, op by op). Backward is ~2x like the other kernels.
MATH_ATTENTION_PASSES = 6

# ---------------------------------------------------------------------------------------------------
# Eager execution (train.compile = false)
# ---------------------------------------------------------------------------------------------------
# Kernels one block launches in eager mode, (forward, backward), by architecture and regime
# (activations.regime; autocast_fp8 counted as autocast): every aten op but views, counted with a
# TorchDispatchMode on the tiny presets (tests/kernel_counts.py; tests/unit/test_plan_kernels.py holds
# this table to it). MoE blocks: (forward base, per local expert, backward base, per local expert): the
# expert loop of models/moe.py. REST: the embedding, final norm, head and loss of a forward / backward.
EAGER_BLOCK_KERNELS: dict[tuple[str, str], tuple[int, int]] = {
    ("llama", "fp32"): (34, 62), ("llama", "autocast"): (48, 82), ("llama", "lowp"): (38, 67),
    ("gpt", "fp32"): (12, 27), ("gpt", "autocast"): (28, 45), ("gpt", "lowp"): (12, 28),
}
EAGER_MOE_BLOCK_KERNELS: dict[tuple[str, str], tuple[int, int, int, int]] = {
    ("llama", "fp32"): (64, 5, 76, 16), ("llama", "autocast"): (76, 10, 94, 21), ("llama", "lowp"): (72, 5, 86, 16),
    ("gpt", "fp32"): (44, 3, 45, 9), ("gpt", "autocast"): (58, 6, 61, 12), ("gpt", "lowp"): (48, 3, 51, 9),
}
# The same under train.fuse_projections (models/feed_forward.py _JoinedLinear: a join and one GEMM per group
# instead of a GEMM per linear, the join again in backward); a MoE block joins attention's q|k|v only (its
# shared experts' w1|w3 too, not counted: no preset has them), by EAGER_FUSED_MOE_DELTA on its count above.
EAGER_FUSED_BLOCK_KERNELS: dict[tuple[str, str], tuple[int, int]] = {
    ("llama", "fp32"): (34, 60), ("llama", "autocast"): (45, 77), ("llama", "lowp"): (38, 65),
    ("gpt", "fp32"): (12, 23), ("gpt", "autocast"): (24, 37), ("gpt", "lowp"): (12, 24),
}
EAGER_FUSED_MOE_DELTA: dict[tuple[str, str], tuple[int, int]] = {
    ("llama", "fp32"): (0, -2), ("llama", "autocast"): (-2, -4), ("llama", "lowp"): (0, -2),
    ("gpt", "fp32"): (0, -4), ("gpt", "autocast"): (-4, -8), ("gpt", "lowp"): (0, -4),
}
EAGER_REST_KERNELS: dict[tuple[str, str], tuple[int, int]] = {
    ("llama", "fp32"): (10, 19), ("llama", "autocast"): (13, 22), ("llama", "lowp"): (13, 21),
    ("gpt", "fp32"): (8, 8), ("gpt", "autocast"): (11, 11), ("gpt", "lowp"): (9, 8),
}
# Kernels one tile of a tiled MLP launches (parallel.linear_tiles; parallel/tiling.py, counted statement by
# statement, casts aside): forward SwiGLU mm, mm, silu, mul, mm, add_ = 6, GELU addmm, gelu, mm, add_ = 4;
# backward SwiGLU mm x 2 (recompute), silu, mul, mm + copy_ (dw2), mm (dh), mul, silu_backward, mul,
# mm + copy_ x 2 (dw1, dw3), (mm + add_) x 2 (dx) = 17, GELU 11. Not yet held to a TorchDispatchMode count.
EAGER_TILE_KERNELS: dict[str, tuple[int, int]] = {"llama": (6, 17), "gpt": (4, 11)}
# GPU time each eager kernel adds beyond its work (launch and tail of a kernel the GPU runs one after
# another): "a few microseconds" per launch (NVIDIA Technical Blog, "Getting Started with CUDA Graphs",
# 2019: graphs exist to remove this per-kernel overhead). ASSUMED 3 us until benchmarks/kernels.py's
# per-op overhead is measured on a GPU. Compiled blocks launch a few fused kernels and are not charged.
EAGER_KERNEL_LAUNCH_S = 3e-6
# The host's cost per eager op (Python, dispatcher, launch): MEASURED 10.0 us on the H100 machine
# (kernels_h100.json, benchmarks/kernels.py "eager" chain of 1,000 tiny ops). While kernels are longer
# than that the host runs ahead and only the GPU-side gap above is paid; a loop of small kernels
# (the fp16 loss scaler's per-tensor checks) runs at this rate instead.
EAGER_HOST_OP_S = 10e-6
# Kernels a compiled block launches per step, forward + backward (the gap above is paid per kernel):
# MEASURED on the H100 trace of the 886M llama (trace_shardwise_compile.json.gz: 339 GEMM, 64 SDPA and
# 448 Triton kernels per step over 16 blocks = 53 per block, head aside), split forward : backward as
# their GEMMs (7 : 14) plus SDPA and fused groups. gpt: ASSUMED the same (a GELU MLP has one GEMM less
# and no RoPE group, and biases add reductions in backward).
COMPILED_BLOCK_KERNELS: dict[str, tuple[int, int]] = {"llama": (16, 37), "gpt": (16, 37)}
# Per optimizer step the GPU waits for the host where the step syncs: the gradient norm's .item() before
# AdamW (train/optim.py clipping, train/health.py's checks), and the next step's first launches. MEASURED
# 3.9 ms per step in gaps over 20 us on the H100 trace (1.1-1.5 ms between the norm's reduction and the
# first AdamW kernel each step); ASSUMED the same on every GPU.
STEP_HOST_SYNC_S = 3.9e-3
# Achieved fraction of HBM bandwidth of the eager pointwise kernels (activations.pointwise_forward_bytes,
# op by op: norms' reductions, casts, RoPE's cat / neg, residual adds), below the streaming
# HBM_FRACTION: FITTED to our own measured H100 runs (tests/fixtures/h100_runs.json, from
# ../shared/gpu/h100-runs.json: one H100 SXM, torch 2.11, eager), not to any published run. What the
# planner missed on those rows is proportional to the tokens (micro-batch 4 x 4 loses twice what 8 x 1
# loses) and not to the GEMM time (fp32 loses little), i.e. to the pointwise traffic. Leave-one-out over
# the six rows, each predicted by the constant fitted to the other five: docs/architecture.md §6 and
# tests/unit/test_plan_h100.py. `benchmarks/kernels.py` measures copy / reduction / triad bandwidth on a
# device; `shardwise plan calibrate` refits this from a cluster's own runs. Compiled runs keep
# HBM_FRACTION (their fused kernels stream).
EAGER_POINTWISE_HBM_FRACTION = 0.67
# fp16's dynamic loss scaler (parallel/precision.py DynamicLossScaler.unscale_): per parameter, a
# foreach multiply (read + write 4 B), isfinite (read 4 B, write a 1 B mask) and .all() over the mask (1 B).
LOSS_SCALER_BYTES_PER_PARAM = 14.0

# A decode step replayed as one CUDA graph (`shardwise generate --compile`, infer/engine.py) runs ~7 GEMMs
# per block with one token per sequence: each is a few MB of weights, and a kernel that small does not
# reach the bandwidth; it pays a fixed time of its own (ramp-up, one wave's tail, memory latency) on top
# of bytes / bandwidth. MEASURED on one H200 (torch 2.11, 886M llama bf16, batch 1, profile of 63 graph
# replays; ../shared/gpu/h200-2026-11-26/): the step's GPU time is 1.238 ms, of which 113 GEMM kernels
# (16 x 7 + the head) take 1.000 ms for 1.64 GB of weights: at the streaming fraction below (3.84 TB/s)
# 0.427 ms, leaving 5.1 us per GEMM. The other kernels of a block (cuDNN attention 6.6 us, the fused norm,
# RoPE, cache-write and SwiGLU kernels ~1-2 us each) take 14.3 us per block beyond the KV cache's bytes.
# ASSUMED the same on every GPU until measured elsewhere. Eager decoding (no graph) is host-bound and
# not priced: 83 tokens/s measured against 720 compiled on that H200.
DECODE_GEMM_KERNEL_S = 5.1e-6
DECODE_BLOCK_OTHER_S = 14.3e-6

# ---------------------------------------------------------------------------------------------------
# Memory-bound work (norms, activations functions, RoPE, residual adds, optimizer, cross-entropy)
# ---------------------------------------------------------------------------------------------------
# Achievable fraction of the HBM datasheet bandwidth for streaming kernels: BabelStream-class copy /
# triad kernels reach ~80-90% on A100/H100/MI300X (Deakin et al., BabelStream results); 0.8 used.
HBM_FRACTION = 0.80
# MEASURED where we have it: a copy on one H100 SXM streams 3,016 of its 3,350 GB/s (0.90; reduction 0.91,
# triad 0.91; ../shared/gpu/h100-2026-11-25/kernels_h100.json). H200 is the same die with HBM3e: ASSUMED
# like the other devices until measured.
HBM_FRACTION_BY_FAMILY: dict[str, float] = {"h100": 0.90}
# AdamW (torch foreach, fp32 states): reads param, grad, exp_avg, exp_avg_sq (16 B) and writes param,
# exp_avg, exp_avg_sq (12 B) per parameter; "mixed" states add the bf16 param copy (2 B) and read the
# 16-bit grad instead of an fp32 one. Gradient clipping reads every gradient once more (4 B).
OPTIMIZER_BYTES_PER_PARAM = 28.0 + 4.0
# By kernel (cluster.optimizer_kernel, plan/stack.py), MEASURED on one H100 (kernels_h100.json: 100M
# parameters in 20 tensors, bytes per parameter at the measured copy rate): torch's fused AdamW 32.0, its
# foreach AdamW 90.4 (each foreach op reads and writes its operands again); gradient clipping
# (get_total_norm + clip_grads_with_norm_, foreach: a norm pass and an in-place scale) 14.5.
OPTIMIZER_KERNEL_BYTES: dict[str, float] = {"fused": 32.0, "foreach": 90.4}
CLIP_BYTES_PER_PARAM = 14.5

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
# Exposed boundary transfers per micro-batch and stage (cluster.pp_engine, plan/stack.py), beside the fill's
# 2 (pp - 1). "torch": torch.distributed.pipelining's isend / irecv delay only the receiver, once each
# direction: 2. "deepspeed": DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/engine.py, p2p.py: dist.send /
# dist.recv, or a two-rank broadcast before torch 1.8) holds both ends of every transfer on the compute
# stream; its TrainSchedule runs 1F1B in lock-step slots, each slot's send deferred to the next slot, so a
# stage waits on all four of its transfers per micro-batch (a send and a receive each way): 4. Both counts
# are what a discrete-event simulation of the schedule gives (tests/unit/test_plan_pipeline_engine.py).
PP_P2P_CROSSINGS_PER_MICROBATCH: dict[str, int] = {"torch": 2, "deepspeed": 4}
# DeepSpeed's PipelineEngine under tensor parallelism (its pipe_partitioned and grad_partitioned, on since
# 2020): each TP rank sends 1/tp of the boundary activation and gradient, and the receiver all-gathers the
# whole over TP. Per micro-batch a middle stage gathers its received input (forward), and its saved output
# and received gradient (backward): 3 all-gathers on the compute stream.
DEEPSPEED_PARTITIONED_GATHERS_PER_MICROBATCH = 3
# Host link for CPU offload (parallel.offload): PCIe Gen4 x16 = 32 GB/s (A100), Gen5 x16 = 64 GB/s
# (H100/H200/B200/MI300X) per direction, datasheets; 0.8 achievable (ASSUMED).
PCIE_GBPS: dict[str, float] = {"a100": 32.0, "h100": 64.0, "h200": 64.0, "b200": 64.0, "mi300x": 64.0}
PCIE_FRACTION = 0.80
# Host memory bandwidth available to one GPU's offloaded optimizer step (torch AdamW on the CPU is
# memory bound): DGX H100 has 2 sockets x 8 channels DDR5-4800 = 614 GB/s for 8 GPUs = 77 GB/s;
# ~65% achievable (STREAM-class) -> 50 GB/s. ASSUMED for every platform.
HOST_MEMORY_GBPS_PER_GPU = 50.0
# Host memory per GPU, for what offload keeps there (parameters, gradients, optimizer state): DGX H100 /
# DGX H200 have 2 TB of system memory for 8 GPUs (NVIDIA DGX H100 datasheet, "System memory 2TB"; DGX
# H200 the same), DGX A100 1 TB for 8 (DGX A100 datasheet, 1 TB standard, 2 TB optional), DGX B200
# 2 TB for 8 (DGX B200 datasheet, up to 4 TB); read as GiB per GPU. Other platforms: ASSUMED as DGX H100.
HOST_MEMORY_GIB_PER_GPU: dict[str, float] = {"a100": 128.0, "h100": 256.0, "h200": 256.0, "b200": 256.0}
HOST_MEMORY_GIB_PER_GPU_DEFAULT = 256.0
# Fraction of that usable by one rank's offloaded states: the OS, the data loader workers, pinned
# staging buffers and the page cache need the rest. ASSUMED 0.80 (no measurement here).
HOST_USABLE_FRACTION = 0.80
# parallel.offload = "nvme" (parallel/offload.py NvmeAdamW): the AdamW moments, exp_avg + exp_avg_sq in
# fp32 = 8 bytes per parameter of the rank's shard (offload.py STATE_BYTES_PER_ELEMENT), live in a file;
# each step reads and writes all of it in chunks of DEFAULT_CHUNK_BYTES = 64 MiB of state (a tensor
# larger than that is a chunk of its own), with one I/O thread and two chunk buffers in host memory.
NVME_STATE_BYTES_PER_PARAM = dims.NVME_STATE_BYTES_PER_PARAM  # one definition with the trainer's: spec/dims.py
NVME_CHUNK_BYTES = dims.NVME_CHUNK_BYTES
NVME_BUFFERS = 2
# Local NVMe bandwidth per GPU for that file, GB/s, sequential. DGX H100 ships 8x 3.84 TB U.2 NVMe data
# drives (NVIDIA DGX H100 datasheet: "Internal storage 30 TB (8x 3.84 TB) U.2 NVMe"), i.e. one PCIe Gen4
# x4 drive per GPU; a data-centre Gen4 drive of that class (Samsung PM1733 U.2 3.84 TB product brief:
# sequential read 7,000 MB/s, write 3,800 MB/s) is the per-GPU figure, when each rank's directory is on
# its own drive or the 8 are striped (DGX OS mounts them as one RAID-0 /raid). 0.80 of it achieved with
# 64 MiB buffered pread / pwrite (ASSUMED, like PCIE_FRACTION). cluster.disk_gbps (what `shardwise doctor
# --disk DIR` measures) replaces both, already achieved.
NVME_READ_GBPS = 7.0
NVME_WRITE_GBPS = 3.8
NVME_FRACTION = 0.80

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
# FITTED (one H200, torch 2.11, torchao 0.18, the 886M LLaMA compiled, 2026-11-28; ../shared/gpu/
# h200-2026-11-28/fp8.json): what two FP8 options cost beyond the bytes above, where the casts cannot fuse.
# - train.fuse_projections: per element of a joined GEMM's output (tokens x (q|k|v + w1|w3 widths)), bytes at
#   the streaming rate. Separate Float8Linears' output gradients are scaled inside the kernels that make
#   them (rotary's and SwiGLU's backward); the joined GEMM first concatenates them, then scales the join,
#   and its forward outputs are split into copies (the profile: pointwise 2.4 -> 10.1 ms a step, scale +
#   cast 38.0 -> 43.1 ms). Measured 108,646 tokens/s against 114,794 apart (0.946x) where the planner, with
#   only the scaled inputs it shares, priced a gain; held out: the 2.4B row below lands within 2%.
FP8_JOINED_OUTPUT_BYTES = 19.0
# - train.fp8_head: the head stays eager (parallel/compile.py), so torchao scales the logits' gradient op
#   by op (abs, amax, fp32 multiply, clamp, cast, and a transposed copy for the weight's gradient): bytes
#   per logit at the eager pointwise rate. Measured: the head's GEMMs 7.8 -> 2.6 ms a step, but copy +9.4
#   and pointwise +6.9 ms; 100,273 tokens/s against 108,646 with the head in bf16 (0.923x).
FP8_EAGER_HEAD_GRAD_BYTES = 100.0

# ===================================================================================================
# What a run costs: power, failures, checkpoints (plan/goodput.py). Not part of the step-time model.
# ===================================================================================================
# Board power while the GPU waits (exposed communication, pipeline bubble, optimizer) as a fraction of
# its TDP (spec/hardware.py Device.tdp_w); computing, it draws the TDP: P = TDP x (f + (1 - f) x busy).
# ASSUMED 0.15: an idle H100 SXM board reads roughly 70-100 W of its 700 W in nvidia-smi (our reading of
# commonly reported figures, not measured here); a GPU waiting inside a step stays clocked up with
# NCCL kernels and HBM traffic, so it likely draws more — this is the low end. Compute at the full TDP
# is the high end (training rarely holds the power limit). train/power.py measures what a run draws.
IDLE_POWER_FRACTION = 0.15
# Unexpected interruptions per GPU-hour when cluster.failures_per_gpu_hour is unset: Llama 3's
# pre-training saw 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (Dubey et
# al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783 §3.3.4; 47 planned ones not counted), i.e. a
# job MTBF of 54 x 24 / 419 = 3.09 hours at 16,384 GPUs; they report > 90% effective training time.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_SNAPSHOT_DAYS = 54
LLAMA3_GPUS = 16384
FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_SNAPSHOT_DAYS * 24 * LLAMA3_GPUS)
# Write bandwidth from one GPU's checkpoint shard to storage (cluster.checkpoint_save_s unset: the save
# time is the most loaded rank's parameters + optimizer state over this), GB/s. ASSUMED 2 GB/s: a
# parallel file system's per-client share when every rank writes at once; no measurement here.
CHECKPOINT_WRITE_GBPS_PER_GPU = 2.0
# Time from a failure to training again (cluster.restart_s unset): detection, re-scheduling the job,
# process start-up, NCCL initialisation and loading the checkpoint. ASSUMED 10 minutes (Daly 2006 uses
# R = 10 min in his worked examples; no measured figure of ours).
RESTART_S = 600.0
# The same for an elastic job (`shardwise train --nnodes MIN:MAX`, cluster.elastic_restart_s unset), which
# re-forms on the nodes left instead of waiting for the job to be scheduled again: MEASURED 46.9 s from
# a node's SIGKILL to the next trained step (tests/dist/test_elastic.py's job, 2 x 2 CPU processes on this
# 2-core machine, torch 2.13), of which 30 s is the rendezvous's default last call for more nodes
# (run.rendezvous_last_call_s) and the rest failure detection, start-up and the checkpoint's load. A
# large job's NCCL start-up and checkpoint load take longer: set cluster.elastic_restart_s.
ELASTIC_RESTART_S = 47.0
