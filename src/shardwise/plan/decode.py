"""Inference (decode) mode of the planner, `shardwise plan evaluate --mode=decode`: memory and latency of
serving one model replica with tensor (tp) and pipeline (pp) parallelism.

What the inference runtime does, and what is priced here:
  * weights held in the compute dtype (fp32 4 B, bf16 / fp16 2 B; fp8 is planned as bf16), each rank
    holding its pipeline stage's blocks, split evenly (plan/inventory.py pipeline_rank = spec/stages.py
    even_split), the embedding on stage 0 and the final norm and head on the last stage, TP-sharded as in
    training (plan/inventory.py local_shape, from spec/shapes.py's split kinds: norms replicated);
  * a KV cache allocated once up front: per block on the rank, k and v of shape (batch, n_kv_heads / tp,
    prompt_len + max_new_tokens, head_dim) in the compute dtype (`kv_cache_bytes`, exact);
  * prefill: the left-padded prompt batch in one forward, compute-bound: the forward's FLOPs are
    ModelShape.flops_per_token / 3 (2N + 4Lsh, PaLM App. B), attention at the causal half;
  * decode: one token per sequence per step; the stages run one after another (no micro-batches), each
    reading all its weights and its KV cache once per step — decode is memory-bandwidth bound (Pope et
    al. 2022, Efficiently Scaling Transformer Inference, arXiv 2211.05102 §2) — so a stage takes
    max(bytes / bandwidth, FLOPs / peak) + its communication; per-token latency is the sum over stages.
Communication (Megatron TP with sequence parallelism off, Shoeybi et al. 2019): 2 all-reduces of the
activations per block, one after the vocab-parallel embedding, the greedy choice over the vocab shards
(two all-gathers of each rank's maximum and id per sequence; sampling would gather the logits), a pp
send between stages, and a broadcast of the next token ids from the last stage to
every rank; timed by plan/comm.py (ring / tree model with per-hop latency from the device table, or the
measured bandwidth and latency of cluster.calibration).
On a GPU of the table a decode step is one CUDA graph (what `shardwise generate --compile` runs): each of
its GEMMs and each block's other kernels add a fixed time measured on an H200 (constants.
DECODE_GEMM_KERNEL_S, DECODE_BLOCK_OTHER_S: small kernels do not reach the bandwidth).
Not modelled: eager decoding's host overhead (host-bound: 8x slower measured), sampling, the static
cache's reads beyond the context (its capacity is rounded up to 64 slots), and transient activations
and logits, which are left to the USABLE_MEMORY_FRACTION reserve (constants.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan import constants as C
from shardwise.plan.collective_time import Place
from shardwise.plan.comm import Collective, placements, time_of
from shardwise.plan.compute_time import streaming_fraction
from shardwise.plan.inventory import RankModel, local_shape, numel, pipeline_rank, rank_params
from shardwise.plan.layout import Problem
from shardwise.plan.memory import GIB
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape

TOKEN_ID_BYTES = 8  # next-token ids are int64 (what torch.argmax / torch.multinomial return)
# Serving runs one model replica: these axes belong to training (or to running more replicas).
def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads one TP rank caches: n_kv_heads / tp; with fewer KV heads than ranks each rank computes
    and caches the one head its query heads use (parallel/tensor.py ReplicatedKVColwise)."""
    return max(1, shape.n_kv_heads // tp)


def kv_cache_bytes(shape: ModelShape, tp: int, layers: int, batch: int, context: float, elt: int) -> float:
    """k and v of (batch, kv heads per rank, context, head_dim) for each of `layers` blocks."""
    return 2 * layers * batch * kv_heads_per_rank(shape, tp) * context * shape.head_dim * elt


def weight_bytes(shape: ModelShape, rank: RankModel, tp: int, elt: int) -> int:
    """The weights one TP rank of pipeline stage `rank` holds (tp rank 0: an uneven split rounds up there)."""
    return elt * sum(numel(local_shape(p, shape, tp, 1)) * copies for p, copies, _ in rank_params(shape, rank))


def weights_read_bytes(shape: ModelShape, rank: RankModel, tp: int, elt: int, tokens: int) -> float:
    """Weight bytes one forward over `tokens` tokens reads: every local weight once, except embedding
    tables (a gather: only the tokens' rows), replicated KV projections (only the rank's own head's rows)
    and stacked experts (only those some token is routed to, `experts_touched_fraction`)."""
    total = 0.0
    for p, copies, _ in rank_params(shape, rank):
        ls = local_shape(p, shape, tp, 1)
        n: float = numel(ls)
        if p.name.endswith("embeddings.weight"):
            n = min(ls[0], tokens) * ls[1]
        elif p.name.split(".")[-2] in ("wk", "wv") and tp > shape.n_kv_heads:
            n /= shape.n_kv_heads
        elif p.tp == "expert":
            n *= experts_touched_fraction(shape, tokens)
        total += n * copies
    return total * elt


def experts_touched_fraction(shape: ModelShape, tokens: int) -> float:
    """Expected fraction of an MoE layer's experts that `tokens` tokens, k choices each, route to, for
    uniform routing: 1 - (1 - k/E)^tokens (occupancy of E bins by tokens x k balls)."""
    if shape.moe is None:
        return 1.0
    return 1.0 - (1.0 - shape.moe.top_k / shape.moe.num_experts) ** tokens


def stage_forward_flops(shape: ModelShape, rank: RankModel, context: float) -> tuple[float, float]:
    """(GEMM, attention) forward FLOPs per token of one stage, whole model width (divide by tp), with
    `context` keys per query: the stage's share of ModelShape.flops_per_token(context) / 3 = 2N + 4Lsh
    (the forward third of 6N + 12Lsh; the stages sum to it exactly)."""
    matmul = rank.dense_layers * shape.block_matmul_numel(False, True)
    matmul += rank.moe_layers * shape.block_matmul_numel(True, True) if rank.moe_layers else 0
    head = shape.vocab_size * shape.dim if rank.head else 0
    return 2.0 * (matmul + head), 4.0 * rank.layers * context * shape.dim


@dataclass
class StageCost:
    """One pipeline stage (its most loaded TP rank): bytes and seconds of prefill and of one decode step."""

    stage: int
    layers: int
    embedding: bool
    head: bool
    weight_bytes: float
    kv_cache_bytes: float
    decode_read_bytes: float   # weights + KV cache at the average context, per decode step
    decode_memory_s: float
    decode_compute_s: float
    decode_comm_s: float       # TP all-reduces / gather + the pp send to the next stage
    decode_kernel_s: float     # the kernels' own fixed time in a CUDA-graph step (0 where rates are measured)
    prefill_memory_s: float
    prefill_compute_s: float
    prefill_comm_s: float

    @property
    def decode_s(self) -> float:
        return max(self.decode_memory_s, self.decode_compute_s) + self.decode_kernel_s + self.decode_comm_s

    @property
    def prefill_s(self) -> float:
        return max(self.prefill_memory_s, self.prefill_compute_s) + self.prefill_comm_s

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "decode_s": self.decode_s, "prefill_s": self.prefill_s}


@dataclass
class DecodeEstimate:
    tp: int
    pp: int
    batch: int
    prompt_len: int
    max_new_tokens: int
    precision: str
    bytes_per_element: int
    device: str
    memory_bandwidth_gbps: float   # achieved (datasheet x HBM_FRACTION, or as measured)
    gemm_flops_per_s: float        # achieved (peak x MAMF fraction, or as measured)
    capacity_bytes: float
    other_bytes: float             # communication buffers per rank
    token_broadcast_s: float
    stages: list[StageCost]
    notes: list[str] = field(default_factory=list)

    @property
    def context_avg(self) -> float:
        return self.prompt_len + self.max_new_tokens / 2

    @property
    def memory_stage(self) -> StageCost:
        """The stage whose ranks hold the most bytes."""
        return max(self.stages, key=lambda s: s.weight_bytes + s.kv_cache_bytes)

    @property
    def total_bytes(self) -> float:
        s = self.memory_stage
        return s.weight_bytes + s.kv_cache_bytes + self.other_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def prefill_s(self) -> float:
        return sum(s.prefill_s for s in self.stages) + self.token_broadcast_s

    @property
    def decode_s_per_token(self) -> float:
        return sum(s.decode_s for s in self.stages) + self.token_broadcast_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.decode_s_per_token

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.batch * self.prompt_len / self.prefill_s

    @property
    def generate_s(self) -> float:
        """Prefill (which yields the first new token) + max_new_tokens - 1 decode steps."""
        return self.prefill_s + (self.max_new_tokens - 1) * self.decode_s_per_token

    def to_json(self) -> dict[str, Any]:
        s = self.memory_stage
        return {
            "mode": "decode", "parallel": {"tp": self.tp, "pp": self.pp}, "batch": self.batch, "prompt_len": self.prompt_len,
            "max_new_tokens": self.max_new_tokens, "context_avg": self.context_avg, "precision": self.precision,
            "bytes_per_element": self.bytes_per_element, "device": self.device,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps, "gemm_tflops": self.gemm_flops_per_s / 1e12,
            "memory_stage": s.stage, "weights_bytes": s.weight_bytes, "kv_cache_bytes": s.kv_cache_bytes,
            "total_bytes": self.total_bytes, "memory_gib": {"weights": s.weight_bytes / GIB, "kv_cache": s.kv_cache_bytes / GIB,
                                                            "other": self.other_bytes / GIB, "total": self.total_bytes / GIB},
            "memory_capacity_gib": self.capacity_bytes / GIB, "fits": self.fits,
            "prefill_s": self.prefill_s, "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_s_per_token": self.decode_s_per_token, "decode_tokens_per_s": self.decode_tokens_per_s,
            "generate_s": self.generate_s, "token_broadcast_s": self.token_broadcast_s,
            "stages": [st.to_json() for st in self.stages], "notes": list(self.notes),
        }


def decode_estimate(cfg: Any, batch: int = 1, prompt_len: int | None = None, max_new_tokens: int = 128, *,
                    memory_bandwidth_gbps: float | None = None, gemm_flops_per_s: float | None = None,
                    fused_projections: bool = True) -> DecodeEstimate:
    """Serve the model of a resolved Config on parallel.tp x parallel.pp ranks of cluster.gpu.

    prompt_len defaults to train.seq_len. memory_bandwidth_gbps / gemm_flops_per_s replace the datasheet
    (x HBM_FRACTION / x MAMF fraction) with achieved numbers, used as given: a measured CPU bandwidth,
    train/peak_flops.py's matmul probe. `fused_projections`: one-process serving's q|k|v and w1|w3 GEMMs
    (decode_kernel_s); False prices the separate ones. ConfigError (exit 2 from the CLI) on an axis
    other than tp / pp."""
    p = cfg.parallel
    tp, pp = p.tp, p.pp
    prompt_len = cfg.train.seq_len if prompt_len is None else prompt_len
    for v in rules.serving_rules(ModelShape.from_config(cfg.model), p, prompt_len):
        raise v.error()
    for name, value in (("--batch", batch), ("--prompt-len", prompt_len), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value}", f"e.g. {name} 1")
    notes: list[str] = []
    if cfg.cluster.num_gpus not in (0, tp * pp):
        notes.append(f"cluster.num_gpus={cfg.cluster.num_gpus} ignored: one replica runs on tp x pp = {tp * pp} GPUs")
    cluster_cfg = replace(cfg.cluster, num_gpus=tp * pp, gpus_per_node=max(1, min(cfg.cluster.gpus_per_node, tp * pp)))
    problem = Problem.from_config(replace(cfg, cluster=cluster_cfg))
    shape = problem.shape
    if prompt_len + max_new_tokens > shape.max_seq_len:
        raise ConfigError("--max-new-tokens", f"prompt_len({prompt_len}) + max_new_tokens({max_new_tokens}) exceeds "
                          f"model.max_seq_len({shape.max_seq_len})", "shorten --prompt-len or --max-new-tokens")
    lay = Layout(tp=tp, pp=pp, sequence_parallel=False)
    if problem.precision == "fp8":
        notes.append("train.precision=fp8: weights and KV cache planned in bf16 (2 B); FP8 GEMMs not modelled")
    if p.pp_layers_per_stage or p.pp_split != "even":
        notes.append("inference splits the blocks evenly over pp (parallel.pp_split / pp_layers_per_stage ignored)")
    dev = problem.cluster.device
    kernels = memory_bandwidth_gbps is None  # a GPU of the table: its CUDA-graph step's kernel times too
    if memory_bandwidth_gbps is None:
        fraction = streaming_fraction(dev.name)
        memory_bandwidth_gbps = dev.memory_bandwidth_gbps * fraction
        notes.append(f"memory bandwidth {dev.memory_bandwidth_gbps:g} GB/s ({dev.name} datasheet) x {fraction} "
                     "achievable (constants.HBM_FRACTION_BY_FAMILY / HBM_FRACTION); a decode step is one CUDA "
                     f"graph (generate --compile), each GEMM {C.DECODE_GEMM_KERNEL_S * 1e6:g} us and each block "
                     f"{C.DECODE_BLOCK_OTHER_S * 1e6:g} us beyond its bytes (constants.DECODE_GEMM_KERNEL_S)")
    attention_flops_per_s = gemm_flops_per_s
    if gemm_flops_per_s is None:
        peak = dev.peak_flops(problem.compute_precision)
        gemm_flops_per_s = peak * C.MAMF_FRACTION.get(dev.name, C.MAMF_FRACTION_DEFAULT)
        attention_flops_per_s = peak * C.ATTENTION_FRACTION.get(C.family(dev.name), C.ATTENTION_FRACTION_DEFAULT)
    return _estimate(problem, lay, batch, prompt_len, max_new_tokens, memory_bandwidth_gbps, gemm_flops_per_s,
                     attention_flops_per_s, notes, kernels, fused_projections)


def decode_kernel_s(shape: ModelShape, rank: RankModel, fused: bool = True) -> float:
    """The fixed time of a CUDA-graph decode step's kernels on one stage, beyond their bytes: one GEMM
    per weight matrix of its blocks and its head (constants.DECODE_GEMM_KERNEL_S), the rest of each
    block (DECODE_BLOCK_OTHER_S). `fused`: q|k|v and w1|w3 run as one GEMM each, as one-process serving
    does (models/feed_forward.py fuse_linears): wk, wv and w3 add no kernel of their own. A MoE block
    counts its router and every expert's matrices: an upper bound (a step runs the routed experts')."""
    merged = ("attention.wk.weight", "attention.wv.weight", "feed_forward.w3.weight") if fused else ()
    gemms = sum(copies for p, copies, in_block in rank_params(shape, rank)
                if len(p.shape) >= 2 and (in_block or p.name.startswith("output")) and not p.name.endswith(merged))
    return gemms * C.DECODE_GEMM_KERNEL_S + rank.layers * C.DECODE_BLOCK_OTHER_S


def _estimate(problem: Problem, lay: Layout, batch: int, prompt: int, new: int, gbps: float, gemm: float,
              attention: float, notes: list[str], kernels: bool = False, fused: bool = True) -> DecodeEstimate:
    shape, cluster, tp, pp = problem.shape, problem.cluster, lay.tp, lay.pp
    elt = problem.compute_bytes  # 4 B for fp32, else 2 (fp8 computes and is held in bf16)
    bandwidth = gbps * 1e9
    place = placements(lay, cluster)
    world = tp * pp
    place["world"] = Place(min(world, cluster.gpus_per_node), math.ceil(world / cluster.gpus_per_node), {})

    def comm(axis: str, kind: str, payload: float, calls: float = 1) -> float:
        return time_of(Collective(axis, kind, payload, calls, "fwd"), place, cluster) if calls else 0.0

    def stage_comm(rank: RankModel, last: bool, tokens: int) -> float:
        act = tokens * shape.dim * elt
        t = comm("tp", "all_reduce", act, 2 * rank.layers + rank.embedding)  # row-parallel outputs + embedding
        # Greedy (generate's default) picks from the vocab shards: each rank's fp32 maximum and int64 id per
        # sequence (infer/engine.py vocab_parallel_argmax), where sampling would gather b x vocab logits.
        if rank.head:  # payloads as gathered (all ranks' pairs)
            t += comm("tp", "all_gather", tp * batch * 4) + comm("tp", "all_gather", tp * batch * TOKEN_ID_BYTES)
        return t + (0.0 if last else comm("pp", "send", act))

    context = prompt + new / 2  # decode's average context over the generated tokens
    stages = []
    for r in range(pp):
        rank = pipeline_rank(shape, pp, 1, "1f1b", r)
        last = r == pp - 1
        kv_full = kv_cache_bytes(shape, tp, rank.layers, batch, prompt + new, elt)
        read = weights_read_bytes(shape, rank, tp, elt, batch) + kv_cache_bytes(shape, tp, rank.layers, batch, context, elt)
        g_dec, a_dec = stage_forward_flops(shape, rank, context)
        g_pre, a_pre = stage_forward_flops(shape, rank, prompt)
        prefill_bytes = weights_read_bytes(shape, rank, tp, elt, batch * prompt) + \
            kv_cache_bytes(shape, tp, rank.layers, batch, prompt, elt)  # weights read once, the prompt's K/V written
        prefill_compute = batch * prompt * (g_pre / gemm + a_pre * C.CAUSAL_EXECUTED_FRACTION / attention) / tp
        stages.append(StageCost(
            r, rank.layers, rank.embedding, rank.head, float(weight_bytes(shape, rank, tp, elt)), kv_full, read,
            read / bandwidth, batch * (g_dec / gemm + a_dec / attention) / tp, stage_comm(rank, last, batch),
            decode_kernel_s(shape, rank, fused and tp == 1) if kernels else 0.0,
            prefill_bytes / bandwidth, prefill_compute, stage_comm(rank, last, batch * prompt)))
    broadcast = comm("world", "broadcast", batch * TOKEN_ID_BYTES) if world > 1 else 0.0
    other = C.COMM_BUFFER_BYTES_PER_AXIS * ((tp > 1) + (pp > 1))
    capacity = cluster.device.memory_gib * GIB * C.USABLE_MEMORY_FRACTION
    return DecodeEstimate(tp, pp, batch, prompt, new, problem.precision, elt, cluster.device.name, gbps, gemm,
                          capacity, other, broadcast, stages, notes)
