"""Typed configuration tree: dataclasses with a doc string per field, strict TOML, --a.b=c overrides.

Every field documents itself through `metadata["doc"]` (see `opt`), so `shardwise config --keys`
lists the whole tree and error messages can suggest the nearest valid key.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
import tomllib

from shardwise.config_model import resolve_model
from shardwise.errors import ConfigError, did_you_mean


def opt(default: Any, doc: str, aliases: dict[bool, Any] | None = None) -> Any:
    """A dataclass field with a default and its documentation. `aliases` maps the booleans a field
    once took (TOML true/false, --key=true) to the values that replaced them, so old configs keep
    working after a switch became a choice (parallel.offload)."""
    meta = {"doc": doc, **({"aliases": aliases} if aliases else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class MoEConfig:
    """Mixture of experts (models/moe.py). num_experts = 0 keeps the dense MLP in every block."""

    num_experts: int | None = opt(None, "Routed experts per MoE block (unset: the preset's, else 0 = dense model, no MoE).")
    top_k: int | None = opt(None, "Experts each token is routed to (unset: the preset's, else 2; Mixtral: 2 of 8).")
    every_k_layers: int | None = opt(None, "Block i (0-based) is MoE when (i + 1) % every_k_layers == 0 (unset: the "
                                           "preset's, else 1 = every block).")
    capacity_factor: float | None = opt(None, "Expert capacity C = ceil(cf x tokens x top_k / num_experts) over a micro-batch's "
                                              "local tokens, overflow dropped (Switch, Fedus et al. 2021). Unset: the "
                                              "preset's, else 0 = dropless: no token is dropped, so the result never "
                                              "depends on how tokens are grouped across ranks.")
    expert_ffn_dim: int | None = opt(None, "Inner size of one expert's MLP (unset: the preset's, else 0 = model.ffn_dim).")
    num_shared_experts: int | None = opt(None, "Always-on shared experts, merged into one MLP of num_shared x expert_ffn_dim "
                                               "(DeepSeekMoE, Dai et al. 2024, arXiv 2401.06066); unset: the preset's, else 0.")
    aux_loss_coef: float | None = opt(None, "Load-balancing loss weight alpha (unset: the preset's, else 0.01, the Switch "
                                            "Transformer default); 0 = off.")
    z_loss_coef: float | None = opt(None, "Router z-loss weight beta (ST-MoE, Zoph et al. 2022, eq. 5; they use 1e-3). "
                                          "Unset: the preset's, else 0 = off.")

    @property
    def enabled(self) -> bool:
        return bool(self.num_experts)


@dataclass
class ModelConfig:
    preset: str = opt("tiny", "Named model shape from shardwise.spec.presets; explicit model.* keys override it.")
    arch: str | None = opt(None, '"llama" (RMSNorm, RoPE, GQA, SwiGLU) or "gpt" (LayerNorm, learned positions, GELU MLP).')
    dim: int | None = opt(None, "Hidden size h.")
    n_layers: int | None = opt(None, "Number of transformer blocks L.")
    n_heads: int | None = opt(None, "Attention (query) heads a; dim must be divisible by it.")
    n_kv_heads: int | None = opt(None, "Key/value heads for grouped-query attention; divides n_heads.")
    ffn_dim: int | None = opt(None, "Inner size of the MLP (SwiGLU for llama, GELU for gpt).")
    vocab_size: int | None = opt(None, "Embedding rows; the BPE tokenizer is trained to this size.")
    max_seq_len: int | None = opt(None, "Longest sequence the model supports (learned positions for gpt, RoPE table).")
    norm_eps: float | None = opt(None, "Epsilon of RMSNorm / LayerNorm (unset: the preset's, else 1e-5).")
    rope_theta: float | None = opt(None, "RoPE base frequency, llama only (unset: the preset's, e.g. 500000 for llama3-*, else 10000).")
    moe: MoEConfig = field(default_factory=MoEConfig,
                           metadata={"doc": "Mixture of experts ([model.moe]); the preset's values fill unset keys."})
    init_from: str = opt("", '"hf:DIR": start from the weights of a Hugging Face Llama checkpoint (DIR holds config.json '
                             "and *.safetensors, sharded or not); the shape comes from its config.json (the preset is "
                             "ignored) and each rank reads only its slices. Empty: random init from train.seed.")


@dataclass
class TrainConfig:
    seq_len: int = opt(128, "Tokens per sequence.")
    global_batch: int = opt(16, "Sequences per optimizer step, over all data-parallel ranks and micro-batches.")
    micro_batch: int = opt(4, "Sequences per forward/backward on one data-parallel rank.")
    steps: int = opt(200, "Optimizer steps to run.")
    lr: float = opt(3e-3, "Peak learning rate of AdamW.")
    min_lr_ratio: float = opt(0.1, "Final learning rate of the cosine decay, as a fraction of lr.")
    warmup_steps: int = opt(20, "Linear warm-up steps before the cosine decay.")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay (not applied to norms and biases).")
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(0.95, "AdamW beta2.")
    grad_clip: float = opt(1.0, "Clip gradients to this global L2 norm; 0 disables clipping.")
    precision: str | None = opt(None, '"fp32", "bf16", "fp16" (dynamic loss scaling) or "fp8" (bf16 with FP8 GEMMs in the '
                                      'linears of the blocks, torchao; GPUs with FP8, or emulated on CPU); master weights stay '
                                      'fp32. Unset: "bf16" on a GPU that computes it (compute capability 8.0 and newer), '
                                      '"fp32" on CPU and older GPUs; the start-up line says which.')
    tf32: bool = opt(True, "On CUDA, fp32 matmuls and convolutions run on TF32 tensor cores (10-bit mantissa; 7.4x the "
                           "fp32 peak of an H100); false keeps them in full fp32. No effect on CPU or in bf16 / fp16 "
                           "GEMMs.")
    fp8_recipe: str = opt("tensorwise", 'For precision="fp8": "tensorwise" (one scale per tensor; FSDP2 gathers the weights in '
                                        'FP8) or "rowwise" (one scale per row: more accurate, slower).')
    fp8_head: bool = opt(False, 'For precision="fp8": the output head\'s GEMMs in FP8 too (false: bf16, as torchtitan '
                                'and DeepSeek-V3 keep it; the logits and the loss stay bf16 / fp32 either way). Slower on '
                                'an H200, 0.92x: the eager head scales the gradient of the logits op by op.')
    recompute: str = opt("none", '"none", "selective" or "full" activation checkpointing.')
    recompute_policy: str = opt("op", 'For recompute="selective": "op" (keep matmul outputs, recompute the rest), "op_alternate" '
                                      '(as op, but keep only every other matmul output of a block, as torchtitan selective op '
                                      'does: less memory, more recompute; dense models) or "layer" (every k-th block).')
    recompute_every: int = opt(2, 'For recompute_policy="layer": checkpoint every k-th transformer block.')
    compile: bool | None = opt(None, "torch.compile each transformer block (unset: on for CUDA, off for CPU, where it does not "
                                     "win yet).")
    compile_backend: str = opt("inductor", '"inductor" (generated kernels) or "aot_eager" (traced and partitioned, no code '
                                           'generation: quick to compile; the CPU tests use it).')
    fuse_projections: bool = opt(False, "One GEMM for q|k|v and one for w1|w3 (SwiGLU), each over the weights of its linears "
                                        "joined at every step (as Megatron-LM does: linear_qkv, linear_fc1): fewer, larger "
                                        "kernels from the same parameters, names and checkpoints. tp = 1 only; with "
                                        "fp8, not with FSDP's FP8 all-gather (tensorwise): each weight is gathered with "
                                        "its own scale. FP8 tensorwise then scales the joined weight as one tensor. Compiled "
                                        "FP8 is slower joined on an H200, 0.95x (docs/precision.md).")
    document_mask: bool = opt(False, "Keep attention inside each document of a packed row (documents end at the "
                                     "end-of-document token): FlexAttention's block mask on GPUs, a dense SDPA mask "
                                     "elsewhere. Not with parallel.cp or tp_mode=2d yet.")
    document_positions: bool | None = opt(None, "Positions restart at 0 at each document of a packed row (RoPE, or "
                                                "gpt's learned positions); unset: as train.document_mask.")
    spike_ratio: float = opt(1.5, "A finite loss above this multiple of the median of the train.spike_window healthy "
                                   "steps before it is a spike: checkpoints written while it lasts are not good, and "
                                   "a divergence that follows is dated from it (its checkpoints are set aside). A "
                                   "spike that lasts a whole window is taken as the new level. 0 disables.")
    spike_window: int = opt(10, "Healthy steps whose median loss a spike is judged against (train.spike_ratio): few "
                                "enough that the median follows a falling loss.")
    seed: int = opt(0, "Seed for weight initialization and data order; identical for every layout.")
    log_every: int = opt(10, "Write metrics every this many steps (the progress bar updates every step).")
    tokens: int = opt(0, "Tokens to train on in total, for planning; 0 means steps x global_batch x seq_len.")
    max_skipped_steps: int = opt(5, "A step whose loss or gradient norm is not finite is skipped on every rank (weights and "
                                    "optimizer state unchanged); after this many in a row (fp16 loss-scale back-offs "
                                    "included) the run stops with exit code 3.")


@dataclass
class ParallelConfig:
    dp_replicate: int = opt(1, "Pure replication axis (DDP, or the outer axis of HSDP).")
    dp_shard: int = opt(1, "Sharded data-parallel axis; -1 means the rest of the world size.")
    zero: int = opt(0, "What is sharded over dp_shard: 0 nothing (needs dp_shard=1), 1 optimizer state, 2 + gradients, 3 + parameters "
                       "(FSDP).")
    tp: int = opt(1, "Tensor-parallel axis (Megatron-style: heads and MLP columns split over tp ranks; the innermost mesh axis).")
    sequence_parallel: bool = opt(True, "With tp > 1: shard norms and the activations between TP regions along the sequence (Korthikanti "
                                        "et al. 2022).")
    pp: int = opt(1, "Pipeline-parallel axis: the model's blocks are cut into pp x pp_virtual_stages stages.")
    cp: int = opt(1, "Context-parallel axis: every sequence is split over cp ranks (load-balanced causal chunks); "
                  "cp ranks join data parallelism for gradients and sharding.")
    cp_mode: str = opt("ring", '"ring" (K/V passed around the cp ranks, any head count) or "ulysses" (all-to-all '
                       "of heads: local heads must be divisible by cp).")
    ep: int = opt(1, "Expert-parallel axis: experts split over ep ranks folded into dp_shard x cp (needs model.moe.num_experts divisible "
                     "by ep and zero 2/3).")
    pp_schedule: str = opt("1f1b", 'Pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble" '
                           '(looped placement, any virtual stages), "zbv" (V-shaped zero bubble, 2 virtual stages), '
                           '"dualpipev" (2 virtual stages).')
    pp_virtual_stages: int = opt(1, "Pipeline stages per rank: 1 for gpipe / 1f1b, >= 2 for interleaved_1f1b, any for "
                                 "zero_bubble, 2 for zbv / dualpipev.")
    pp_split: str = opt("even", 'How blocks are cut into stages: "even", or "balanced" by each stage\'s compute (embedding '
                        'and head included) over its rank\'s speed. pp_layers_per_stage overrides both.')
    pp_layers_per_stage: list[int] = opt([], "Explicit blocks per stage, one entry per stage (pp x pp_virtual_stages), "
                                         "e.g. [1, 3]; empty: use pp_split.")
    pp_stage_speeds: list[float] = opt([], "Relative speed of each pipeline rank for pp_split=balanced (heterogeneous "
                                       "clusters), e.g. [1.0, 2.0]; empty: all equal.")
    offload: str = opt("none", '"none"; "cpu": parameters, gradients and optimizer state live in host memory (FSDP2 '
                       'CPU offload, zero 2/3, any number of ranks, 1 included) and the optimizer step runs on the CPU; '
                       '"nvme": as "cpu", with the optimizer state in files under offload_dir. true/false mean "cpu"/"none". '
                       "`shardwise train` refuses a node whose memory and swap cannot hold the states its ranks offload.",
                       aliases={True: "cpu", False: "none"})
    offload_dir: str = opt("", 'Directory on a local disk for offload="nvme" (each rank writes its optimizer state into a '
                           "fresh subdirectory, removed when the run ends).")
    grad_compression: str = opt("none", 'Compress gradients before shardwise all-reduces them over data parallelism: "none", '
                                '"bf16", "int8" (a scale per 1024 entries, error feedback), "topk" (keep grad_compression_ratio '
                                'of the entries, error feedback) or "powersgd" (rank powersgd_rank, Vogels et al. 2019).')
    grad_compression_ratio: float = opt(0.01, 'Fraction of the gradient entries grad_compression="topk" sends (0 < r <= 1).')
    powersgd_rank: int = opt(4, 'Rank of the low-rank factors of grad_compression="powersgd".')
    powersgd_warmup_steps: int = opt(10, 'Optimizer steps of plain all-reduce before PowerSGD starts (its warm-up, as in '
                                         'Vogels et al. 2019 and torch\'s PowerSGDState.start_powerSGD_iter).')
    tp_mode: str = opt("1d", '"1d": Megatron tensor parallelism over tp ranks; "2d": SUMMA on a q x q grid of the tp = q^2 '
                             "ranks (Xu & You, Colossal-AI 2-D): activations and weights both partitioned.")
    linear_tiles: int = opt(1, "Memory-centric tiling: compute every block's MLP in this many tiles along its hidden "
                               "(ffn) dim, one after another, so one tile's intermediates are live at a time and "
                               "backward recomputes them per tile (1 = off).")


@dataclass
class DataSource:
    """One source of a mixture ([[data.sources]]): its own corpus, prepared like data.path, and its share."""

    path: str = opt("", "Text, JSONL, JSON or Parquet file, directory or glob, or a Megatron-LM indexed dataset "
                        "(PREFIX, PREFIX.bin or PREFIX.idx).")
    weight: float = opt(1.0, "Share of the training tokens drawn from this source, relative to the weights of the other "
                             "sources (they need not sum to 1). May change when a run resumes: from that step on.")
    name: str = opt("", "Name in the start-up lines, metrics.jsonl (tokens_<name>) and checkpoints; default: the "
                        "path's file name without its extension.")
    max_epochs: float = opt(0.0, "The most times this source may be read over by the end of train.steps (1: no sample "
                                 "twice); a run that would need more is refused before it starts. 0: no limit.")
    text_key: str = opt("", "Field holding the text in this source's JSONL / Parquet records; empty: data.text_key.")


@dataclass
class ValidSet:
    """A named validation set ([[data.valid]]): its own files, prepared with the training tokenizer, never trained on."""

    path: str = opt("", "Text, JSONL, JSON or Parquet file, directory or glob, or a Megatron-LM indexed dataset "
                        "(PREFIX, PREFIX.bin or PREFIX.idx).")
    name: str = opt("", "Name in metrics.jsonl (valid_loss_<name>), TensorBoard and the progress line; default: the "
                        "path's file name without its extension.")
    text_key: str = opt("", "Field holding the text in this set's JSONL / Parquet records; empty: data.text_key.")


@dataclass
class DataConfig:
    path: str = opt("", "Text, JSONL, JSON or Parquet file, directory or glob, or a Megatron-LM indexed dataset "
                        "(PREFIX, PREFIX.bin or PREFIX.idx); empty = the Python standard library's source "
                        "(unless data.sources is set).")
    sources: list[DataSource] = opt([], "A weighted mixture instead of data.path: [[data.sources]] tables with path, "
                                        "weight and optionally name, max_epochs, text_key (docs/data.md).")
    valid_fraction: float = opt(0.0, "Share of each source's documents held out for validation (e.g. 0.005), never "
                                     "trained on: a document goes to the held-out part when a hash of its text (of a "
                                     "text file: its first 64 KiB and size) falls below this share, so the same "
                                     "documents on every run, layout and worker count, and copies of a document on "
                                     "the same side. Part of the prepared corpus's identity. Evaluated as a set "
                                     "named after its source ([eval]).")
    valid: list[ValidSet] = opt([], "Named validation sets: [[data.valid]] tables with path and optionally name, "
                                    "text_key, each evaluated on its own ([eval], docs/data.md).")
    tokenizer: str = opt("bpe", '"bpe" (trained on the corpus and cached), "byte", or a path to a tokenizer.json.')
    text_key: str = opt("text", "Field holding the text in JSONL / Parquet records.")
    format: str = opt("auto", '"text" (documents: data.text_key), "prompt_completion" (JSON records with prompt and '
                              'completion), "chat" (records with messages, rendered with the chat template next to '
                              'data.tokenizer); "auto": the first record of the first file decides. Fine-tuning '
                              "records are packed whole into rows (best fit, docs/finetune.md).")
    loss_on: str = opt("completion", 'Fine-tuning records: "completion" puts the loss on the completion (chat: the '
                                     'assistant turns) only, "all" on every token. Text corpora train on all tokens.')
    cache_dir: str = opt("~/.cache/shardwise", "Where trained tokenizers and prepared corpora (token shards) are kept.")
    bad_records: str = opt("error", '"error": a malformed JSON line, a record without data.text_key or an unreadable '
                                    'Parquet row group stops the preparation (exit 2) naming file and line; "skip": '
                                    "such records are skipped, counted in the manifest and printed.")
    shard_mb: float = opt(32.0, "Input megabytes per prepared shard: the unit a preparation worker tokenizes and writes, "
                                "and what a killed preparation keeps. Part of the prepared corpus's identity.")
    prepare_workers: int = opt(0, "Processes that tokenize the corpus when it is prepared (`shardwise data prepare "
                                  "--workers N`, or `train` finding it unprepared); 0: one per core. The shards are "
                                  "the same for any count.")
    num_workers: int = opt(0, "Background processes per rank that prepare the batches of the next steps (0: in the training "
                              "process). The batches are the same for any count; ~cores / ranks - 1 is plenty.")


@dataclass
class EvalConfig:
    every: int = opt(0, "Evaluate the validation sets (data.valid_fraction, [[data.valid]]) every this many steps; "
                        "0: only at the end (eval.at_end).")
    tokens: int = opt(0, "Tokens of each validation set per evaluation, rounded up to whole global batches "
                         "(train.global_batch x train.seq_len): the same windows every round; 0: the whole set.")
    at_end: bool = opt(True, "Evaluate after the last step (when there is a validation set).")


@dataclass
class CheckpointConfig:
    dir: str = opt("", "Checkpoint directory; empty = <run.dir>/checkpoints.")
    every: int = opt(0, "Save every this many steps (0: only at the end if final=true).")
    keep: int = opt(2, "Keep the newest K complete checkpoints.")
    final: bool = opt(True, "Save a checkpoint after the last step.")
    resume: bool = opt(True, "Resume from the newest complete checkpoint in dir if there is one.")


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "Run directory: resolved config, metrics.jsonl, TensorBoard events, plots, checkpoints.")
    progress: bool = opt(True, "Show a progress bar on rank 0.")
    tensorboard: bool = opt(True, "Write TensorBoard events.")
    loss_curve: bool = opt(True, "Draw <run.dir>/loss_curve.png (loss and lr against the step) when the run ends.")
    save_final_model: bool = opt(False, "Write the full (unsharded) final weights to <run.dir>/final_model.pt (used by parity).")
    max_restarts: int = opt(0, "Restart the whole worker group this many times after a worker fails (torchrun's elastic "
                               "agent); each restart resumes from the newest good checkpoint. Divergence, bad input and "
                               "I/O errors are not restarted.")
    backend: str = opt("auto", '"auto": NCCL on GPUs, gloo on CPU. "gloo": gloo on GPUs too, so that several processes '
                               'may share one GPU (device placement checks such as `make gpu-check`; not for speed: '
                               'collectives go through host memory). "nccl": NCCL (GPUs only).')
    rendezvous_timeout_s: float = opt(600.0, "How long a multi-node job's rendezvous waits for its nodes (torchrun's "
                                              "join_timeout): at the start (a node started before node 0 waits this "
                                              "long for node 0's rendezvous to answer, then exits 1), and in an elastic "
                                              "job (--nnodes MIN:MAX) for MIN nodes after losing some; then the job ends "
                                              "(exit code 6, naming the checkpoint to resume from).")
    rendezvous_last_call_s: float = opt(30.0, "An elastic job's rendezvous, once MIN nodes are there, waits this long for "
                                               "more before it starts them (torchrun's last_call_timeout): most of the "
                                               "time from a lost node to the next step; shorter can start a smaller job "
                                               "just before a restarting node is back, which then joins (one more restart).")
    memory_snapshot: bool = opt(False, "CUDA: record the caching allocator's history and write "
                                       "<run.dir>/memory_snapshot/rank_R_step_2.pickle after step 2 (and "
                                       "rank_R_out_of_memory.pickle if a step runs out of memory): every allocation "
                                       "with its stack, over time; open it at https://pytorch.org/memory_viz. Takes a "
                                       "stack trace at every allocation while recording; a CPU records nothing.")
    collective_timeout_s: float = opt(300.0, "A collective that waits longer than this fails the run (exit code 5) after "
                                             "every rank's Python stack and last collective are written to "
                                             "<run.dir>/stall/ and the ranks that did not arrive are named.")
    metrics_port: int = opt(0, "Rank 0 serves the newest logged step's metrics (every numeric key of its metrics.jsonl "
                               "record: step, loss, tokens/s, MFU, memory by category, validation loss, ...) in "
                               "Prometheus text format at http://<run.metrics_address>:PORT/metrics for the whole run "
                               "(train/live_metrics.py); 0 = off.")
    metrics_address: str = opt("127.0.0.1", "Address the run.metrics_port endpoint listens on: loopback by default (this "
                                            "machine only); a non-loopback address (e.g. 0.0.0.0, every interface) only "
                                            "when given.")
    straggler_every: int = opt(50, "Every this many steps each rank's timing (the compute of its blocks, its wait for data) "
                                   "goes to rank 0, which names a rank slower than the median of the others (train/straggler.py); "
                                   "one all-gather of three numbers a window. 0 = off.")
    straggler_margin: float = opt(0.2, "A rank is slow when its compute exceeds the median of the others by this share, or "
                                       "its data wait, as a share of the rest of its step, exceeds theirs by this much. "
                                       "0.2: well above the jitter of identical work on identical devices, and such a "
                                       "rank costs every rank a fifth.")
    straggler_steps: int = opt(100, "A rank slow for at least this many steps in a row (whole windows of "
                                    "run.straggler_every) is named: one line, and one when it recovers. 100: two "
                                    "windows, so a one-off pause (a checkpoint, a collection) names nobody.")
    evict_stragglers: bool = opt(False, "An elastic job (--nnodes MIN:MAX) drains the node of a named straggler as a "
                                        "SIGTERM drains it: every rank checkpoints the step, that node leaves (exit 8) "
                                        "and the others go on from the checkpoint with the same global batch, while at "
                                        "least MIN nodes remain; node 0, which serves the rendezvous, is never evicted "
                                        "(train/eviction.py).")
    evict_cooldown_s: float = opt(3600.0, "An evicted node (its host and --node-rank) is refused by this run for this "
                                          "long (exit 8, saying until when); then it may join again. One hour: longer "
                                          "than a thermal or noisy-neighbour episode usually lasts.")


@dataclass
class ClusterConfig:
    """Only `shardwise plan` reads this section; training ignores it."""

    gpu: str = opt("h100-sxm-80gb", "Accelerator to plan for: a name from shardwise.spec.hardware.DEVICES.")
    num_gpus: int = opt(0, "Accelerators in the job (the planner's world size); 0 = the product of the parallel.* axes.")
    gpus_per_node: int = opt(8, "Accelerators per node, joined by the intra-node fabric (NVLink / Infinity Fabric).")
    intra_node_gbps: float = opt(0.0, "Per-GPU unidirectional intra-node bandwidth in GB/s; 0 = the device's default.")
    inter_node_gbps: float = opt(0.0, "Per-GPU network bandwidth between nodes in GB/s; 0 = the device's default.")
    memory_gib: float = opt(0.0, "Memory of one accelerator in GiB, for a variant of cluster.gpu (e.g. Meta's 96 GB H100); "
                                 "0 = the device's datasheet.")
    memory_bandwidth_gbps: float = opt(0.0, "Memory (HBM) bandwidth of one accelerator in GB/s, for a variant of cluster.gpu "
                                            "(e.g. 2400 for an H100 with HBM2e); 0 = the device's datasheet.")
    peak_tflops: float = opt(0.0, "Dense bf16 tensor-core peak of one accelerator in TFLOP/s, for a variant of cluster.gpu "
                                  "that runs slower clocks (e.g. Meta's 500 W H100s: between the SXM's 989.4 and the "
                                  "NVL's 835.5; torchtitan's published runs on them fit 835.5, docs/planner.md); every "
                                  "precision's peak scales with it; 0 = the device's datasheet.")
    nodes_per_pod: int = opt(0, "Nodes under one non-blocking tier of the network (a pod, an AI zone), when the tier above "
                                "them is oversubscribed (cluster.oversubscription); e.g. 384 for Meta's 3,072-GPU pods. "
                                "0 = the whole cluster is one non-blocking fabric (plan/fabric.py).")
    oversubscription: float = opt(1.0, "Taper between pods: a pod's injection bandwidth over its uplinks to the other pods "
                                       "(7 for Meta's 1:7); 1 = non-blocking. Collectives whose flows leave a pod faster "
                                       "than its uplinks carry slow down (plan/fabric.py).")
    intra_node_latency_us: float = opt(0.0, "Per-hop collective latency inside a node in microseconds; 0 = the planner's default.")
    inter_node_latency_us: float = opt(0.0, "Per-hop collective latency between nodes in microseconds; 0 = the planner's default.")
    model_states: str = opt("shardwise", '"shardwise": fp32 params + fp32 grads + fp32 AdamW (what this trainer does, any '
                                         'precision); "mixed": bf16/fp16 params + grads, fp32 master + AdamW (2+2+12 bytes/param).')
    optimizer_state_dtype: str | None = opt(None, 'With model_states = "mixed", the dtype of AdamW\'s master copy and moments: '
                                                  '"fp32" (12 bytes/param) or "bf16" (6: Apex DistributedFusedAdam with '
                                                  "dtype=bf16, as NeMo's optim.dtype sets it); unset: fp32.")
    assume_mfu: float = opt(0.0, "Fix the MFU (e.g. 0.4) instead of predicting the step time; 0 = predict.")
    # Unset (None) rather than "": an unset key is left out of the resolved TOML (Config.to_dict), so
    # `shardwise config` and emitted configs stay as they were for everyone who does not calibrate.
    calibration: str | None = opt(None, 'Path to a `shardwise bench-comm --out` JSON: its measured bus bandwidth and latency per '
                                        'mesh axis (fitted to the all-reduce points) replace the datasheet defaults for the '
                                        'collectives on those axes, and its measured slowdown of compute beside them replaces '
                                        'the planner\'s 18.9%; unset or "" = none.')
    # What a run costs (plan/goodput.py, `plan evaluate`'s cost block): price, failures, checkpoints.
    price_per_gpu_hour: float = opt(0.0, "Price of one GPU-hour (any currency): `plan evaluate` prints GPU-hours x this; "
                                         "0 = not priced (no cost printed, null in --json).")
    failures_per_gpu_hour: float | None = opt(None, "Unexpected job interruptions per GPU-hour (job MTBF = 1 / (this x "
                                                    "num_gpus)); unset: Llama 3's 419 in 54 days on 16,384 H100 = 1.97e-5 "
                                                    "(arXiv 2407.21783 §3.3.4); 0 = no failures.")
    checkpoint_save_s: float | None = opt(None, "Seconds one checkpoint save stops training; unset: the most loaded rank's "
                                                "parameters + optimizer state at an assumed 2 GB/s per GPU "
                                                "(plan/constants.py CHECKPOINT_WRITE_GBPS_PER_GPU).")
    restart_s: float | None = opt(None, "Seconds from a failure to training again (re-schedule, start, load the checkpoint); "
                                        "unset: an assumed 600 (plan/constants.py RESTART_S).")
    elastic_restart_s: float | None = opt(None, "The same for an elastic job (`train --nnodes MIN:MAX`), which goes on on "
                                                "the nodes left instead of waiting for a replacement: the rendezvous's "
                                                "last call, start-up and the checkpoint's load; unset: 47, measured "
                                                "(plan/constants.py ELASTIC_RESTART_S).")
    # The software stack (plan/stack.py): unset = what shardwise's trainer runs; set to plan an older stack.
    attention_kernel: str | None = opt(None, 'SDPA kernel to price: "cudnn", "flash" (FlashAttention-2), "efficient" '
                                             '(memory-efficient) or "math" (unfused softmax, s x s scores in memory); '
                                             "unset: the one torch picks for the precision.")
    optimizer_kernel: str | None = opt(None, 'AdamW kernels to price: "fused" (one kernel per group) or "foreach"; '
                                             "unset: fused on a GPU, as the trainer runs it.")
    norm_kernel: str | None = opt(None, 'Norm kernels to price: "fused" (one kernel per norm) or "unfused" (op by op); '
                                        "unset: fused when compiled, unfused eager.")
    loss_kernel: str | None = opt(None, 'Chunked cross-entropy kernels to price: "compiled" (fused, 16-bit logits read '
                                        'once) or "eager" (fp32 copies op by op); unset: compiled when the blocks are.')
    grad_reduce: str | None = opt(None, 'Data parallelism\'s gradient all-reduce (DDP, ZeRO-1) to price: "overlapped" (in '
                                        'buckets during the backward) or "after_backward" (all of it after, as '
                                        "Megatron-LM's local DDP did before --overlap-grad-reduce), or "
                                        '"distributed_optimizer" (Megatron-Core\'s, with parallel.zero=1: reduce-scatter '
                                        "in the last backward, all-gather in the next forward, chunk by chunk under an "
                                        "interleaved pipeline); unset: overlapped, as the trainer runs it.")
    rope_kernel: str | None = opt(None, 'RoPE to price: "fused" (real cos / sin ops, fused into the compiled block, as '
                                        'the trainer runs it) or "complex" (complex multiplication, as Meta\'s Llama '
                                        "reference and torchtitan write it: inductor runs it as an eager kernel between "
                                        'two casts); unset: fused. Llama blocks only.')
    sp_saved_input: str | None = opt(None, 'What a column-parallel linear keeps of its input for backward under sequence '
                                           'parallelism, to price: "gathered" (the all-gathered input, as the trainer\'s '
                                           'torch SP does) or "sharded" (its sequence shard, all-gathered again in the '
                                           "backward beside the input-gradient GEMM: Megatron-Core and Transformer "
                                           "Engine, Korthikanti et al. 2022 §4.2.2); unset: gathered.")
    selective_recompute: str | None = opt(None, 'What train.recompute="selective" reruns, to price: "op" (the trainer\'s '
                                                "per-op policies, train.recompute_policy) or \"attention_core\" (only the "
                                                "attention core, as Megatron-LM's --recompute-granularity selective: "
                                                "Korthikanti et al. 2022 §5); unset: op.")
    sp_gather: str | None = opt(None, 'The dtype sequence parallelism\'s all-gathers move under train.precision="fp8" '
                                      '(tensorwise), to price: "bf16" (as the trainer\'s TP styles gather) or "fp8" '
                                      "(torchao's Float8ColwiseParallel / Float8RowwiseParallel / "
                                      "PrepareFloat8ModuleInput, as torchtitan applies them: block inputs gathered in "
                                      "e4m3, row-parallel output gradients in e5m2, half the bytes); unset: bf16.")
    pp_engine: str | None = opt(None, 'The pipeline engine, to price: "torch" (torch.distributed.pipelining\'s isend / '
                                      'irecv delay only the receiver, as the trainer runs) or "deepspeed" (DeepSpeed\'s '
                                      "PipelineEngine: blocking send / recv in a lock-step 1F1B, twice the exposed "
                                      "transfers per micro-batch; under TP each rank sends 1/tp of the boundary and the "
                                      "receiver all-gathers it; 1F1B only); unset: torch.")
    fp8_kernel: str | None = opt(None, 'How train.precision="fp8" casts, to price: "torchao" (dynamic scaling: an amax '
                                       "pass and a cast of every GEMM operand each micro-batch, as the trainer runs "
                                       'it) or "transformer_engine" (delayed scaling under Megatron-Core: casts fused '
                                       "with their transposes and into the norms, weights cast once a step); unset: "
                                       "torchao.")
    block_overhead_us: float | None = opt(None, "Time a block spends per micro-batch outside the kernels the planner "
                                                "prices (gaps between its kernels, waits on the host and on its "
                                                "collectives), forward and backward together, in microseconds, to "
                                                "price another stack; unset: 0, as the trainer's compiled blocks. "
                                                "Megatron-Core / NeMo: 1027, fitted to published runs (docs/planner.md).")
    disk_gbps: float = opt(0.0, 'Local disk bandwidth per GPU in GB/s (read and write) for parallel.offload="nvme", as '
                                "`shardwise doctor --disk DIR` measures it; 0 = a PCIe Gen4 NVMe drive per GPU "
                                "(plan/constants.py NVME_READ_GBPS / NVME_WRITE_GBPS).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Model shape."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Optimization and batch."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": "Parallel layout."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Corpus and tokenizer."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": "Validation during and after training."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Distributed checkpoints."})
    run: RunConfig = field(default_factory=RunConfig, metadata={"doc": "Outputs of a run."})
    cluster: ClusterConfig = field(default_factory=ClusterConfig, metadata={"doc": "Cluster to plan for (shardwise plan)."})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        def clean(d: dict) -> dict:
            return {k: clean(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

        return {s.name: clean(dataclasses.asdict(getattr(self, s.name))) for s in dataclasses.fields(self)}

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())


def sections() -> dict[str, type]:
    """Each top-level table ([model], [train], ...) with its dataclass."""
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _keys(prefix: str, cls: type) -> list[str]:
    out = []
    for name, hint in _field_types(cls).items():
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out += _keys(f"{prefix}{name}.", hint)
        else:
            out.append(f"{prefix}{name}")
    return out


def all_keys() -> list[str]:
    """Every settable key, three levels deep for sub-tables (model.moe.top_k)."""
    return [k for s, cls in sections().items() for k in _keys(f"{s}.", cls)]


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config tree (Config.to_dict(), a parsed config.toml) as {"train.lr": 3e-4, "model.moe.top_k": 2, ...}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _base_type(hint: Any) -> type:
    """int for `int` and for `int | None`."""
    args = typing.get_args(hint)
    return [a for a in args if a is not type(None)][0] if args and type(None) in args else hint


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check (TOML) or convert (command-line string) a value to the field's declared type."""
    base = _base_type(hint)
    if value is None:
        return value
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        if isinstance(value, str):
            value = _parse_cli_value(key, value if value.lstrip().startswith("[") else f"[{value}]", list)
        if not isinstance(value, list):
            example = '[{path = "a.jsonl", weight = 1}]' if dataclasses.is_dataclass(item) else "[1, 2]"
            raise ConfigError(key, f"expected a list of {item.__name__}, got {value!r}", f"write e.g. {key}={example}")
        if dataclasses.is_dataclass(item):
            return [_table(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        return [_coerce(key, v, item) for v in value]
    if isinstance(value, str) and base is not str:
        value = _parse_cli_value(key, value, base)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(key, f"expected {base.__name__}, got {type(value).__name__} {value!r}",
                          f"give {key} a {base.__name__} value")
    if base is float and not math.isfinite(value):
        # TOML reads nan and inf; no key means either (a NaN lr spawned workers that failed, an inf one
        # trained until it diverged).
        raise ConfigError(key, f"must be a finite number, got {value!r}", f"give {key} a finite value")
    return value


def _table(key: str, value: Any, cls: type) -> Any:
    """One table of an array of tables ([[data.sources]]) as its dataclass, strictly: every key must be
    one of its fields and of its type (`key` names the entry in errors: data.sources[1])."""
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a table of keys, got {value!r}",
                          f"write it as [[{key.split('[')[0]}]] with {', '.join(f.name for f in dataclasses.fields(cls))}")
    hints = _field_types(cls)
    out = cls()
    for name, v in value.items():
        if name not in hints:
            raise ConfigError(f"{key}.{name}", "unknown key", did_you_mean(name, list(hints)))
        setattr(out, name, _coerce(f"{key}.{name}", v, hints[name]))
    return out


def _alias(key: str, value: Any, aliases: dict[bool, Any]) -> Any:
    """A field's former boolean spelling (TOML true/false, or true/false/on/off/1/0 on the command
    line) as the value that replaced it; anything else unchanged."""
    if isinstance(value, bool):
        return aliases[value]
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return aliases[_parse_cli_value(key, value, bool)]
    return value


def _parse_cli_value(key: str, text: str, base: type) -> Any:
    if base is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(key, f"expected true/false, got {text!r}", f"use --{key}=true or --{key}=false")
    if base is float and text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return float(text)  # NaN, Inf, -Infinity: read, so that the finite check names what is wrong
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(key, f"cannot read {text!r} as {base.__name__}", f"give {key} a {base.__name__} value") from None


def _set(cfg: Config, key: str, value: Any, from_cli: bool) -> None:
    """Set `key` ("section.name" or "section.sub.name", e.g. model.moe.top_k) strictly: every part
    must name a field of the dataclass tree. A TOML sub-table ([model.moe]) arrives as a dict."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(node) or part not in _field_types(type(node)):
            raise ConfigError(key, "unknown config key", did_you_mean(key, all_keys()))
        hint = _field_types(type(node))[part]
        if depth == len(parts) - 1:
            break
        node = getattr(node, part)
    name = parts[-1]
    if len(parts) < 2:
        raise ConfigError(key, "unknown config key", did_you_mean(key, all_keys()))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"is a table of keys, got {value!r}", f"set its keys, e.g. {key}.{dataclasses.fields(hint)[0].name}=...")
        for sub, v in value.items():
            _set(cfg, f"{key}.{sub}", v, from_cli)
        return
    aliases = next(f.metadata.get("aliases") for f in dataclasses.fields(node) if f.name == name)
    if aliases:
        value = _alias(key, value, aliases)
    if not from_cli and isinstance(value, str) and _base_type(hint) is not str:
        # TOML is typed: a quoted number in a file is a mistake, not something to guess at.
        raise ConfigError(key, f"expected {_base_type(hint).__name__}, got the string {value!r}", "remove the quotes")
    setattr(node, name, _coerce(key, value, hint))


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", f"file not found: {p}", "pass the path of an existing TOML file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{p} is not valid TOML: {e}", "fix the TOML syntax") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.lr=0.1', '--parallel.zero', '3'] -> [('train.lr', '0.1'), ('parallel.zero', '3')]."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(arg, "unrecognized argument", "config overrides look like --section.key=value")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            k, v = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(arg[2:], "override has no value", f"write {arg}=VALUE")
        out.append((k, v))
        i += 1
    return out


def build_config(toml: dict[str, Any] | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Defaults <- TOML <- command-line overrides; then the model preset fills the unset model keys."""
    cfg = Config()
    for section, values in (toml or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(section, "top-level keys must be [sections]", did_you_mean(section, list(sections())))
        for name, value in values.items():
            _set(cfg, f"{section}.{name}", value, from_cli=False)
    for key, value in overrides or []:
        _set(cfg, key, value, from_cli=True)
    resolve_model(cfg.model)  # config_model.py: the preset, or the Hugging Face checkpoint's shape
    if cfg.model.init_from and cfg.data.tokenizer == "bpe":
        # A pretrained model comes with its tokenizer: training a new BPE would scramble its embeddings.
        from shardwise.spec.hf import hf_directory

        tokenizer = hf_directory(cfg.model.init_from) / "tokenizer.json"
        if tokenizer.is_file():
            cfg.data.tokenizer = str(tokenizer)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    return build_config(load_toml(path) if path else None, parse_overrides(overrides or []))
