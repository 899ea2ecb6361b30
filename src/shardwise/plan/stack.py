"""The software stack a step runs on, as a planning input (cluster.*_kernel; unset = what shardwise's own
trainer runs today). The same model and layout run at very different speeds on an older stack — an
unfused attention materialising the s x s scores, a multi-kernel optimizer, op-by-op norms, an eager
loss — so a planner that only knows today's kernels mis-plans the cluster a user actually has.
`plan evaluate` prints the stack it assumed (`describe`).

  compiled    train.compile (inductor, one graph per block: plan/compiled.py) or eager
  attention   cudnn | flash | efficient | math   the SDPA kernel (unset: what torch picks, spec/layout.py
              attention_backend: its fused kernel, cuDNN on Hopper, FlashAttention-2 elsewhere; math for
              grouped-query fp32 on CUDA). Times: constants.ATTENTION_KERNEL_SPEED; memory: math saves
              the s x s probabilities, the fused kernels a log-sum-exp
  optimizer   fused | foreach                    AdamW as one kernel per group or torch's foreach ops
              (unset: fused on a GPU, train/optim.py), constants.OPTIMIZER_KERNEL_BYTES
  norms       fused | unfused                    one kernel per norm, or RMSNorm's Python ops one by one
              (unset: fused when compiled, unfused eager)
  loss        compiled | eager                   the chunked cross-entropy's kernels (train/loss.py
              LossKernels; unset: compiled when the blocks are)
  grad_reduce overlapped | after_backward        data parallelism's gradient all-reduce (DDP, ZeRO-1): in
              buckets during the last backward (torch DDP, what the trainer runs; Megatron-LM since its
              --overlap-grad-reduce) or all of it after the backward (Megatron-LM's local DDP before
              that): plan/cost.py exposes all of it then. FSDP / ZeRO-2/3 reduce-scatter per layer either way.
              | distributed_optimizer: Megatron-Core's --use-distributed-optimizer --overlap-grad-reduce
              --overlap-param-gather with parallel.zero=1: bucketed reduce-scatter in the last backward and
              all-gather in the next forward, pipeline parallel or not (plan/scale.py)
  rope        fused | complex                    RoPE on q and k: real cos / sin ops (what the trainer runs:
              fused into the block's Triton kernels when compiled) or complex multiplication as Meta's
              Llama reference and torchtitan write it (view_as_complex): inductor cannot generate code for
              complex operators and runs that multiply as its eager kernel (torchtitan#15: "Performance may
              be worse than eager"), between its own cast kernels (plan/compiled.py complex_rope_bytes)
  fp8         torchao | transformer_engine       how train.precision="fp8" scales and casts (unset: torchao,
              what the trainer runs: dynamic scaling, an amax pass and a cast of each GEMM operand every
              micro-batch) or Transformer Engine's delayed scaling under Megatron-Core: casts fused with
              their transposes, the norm's output cast inside the norm, weights cast once a step
              (compute_time.te_cast_bytes)
  sp_input    gathered | sharded                 what a column-parallel linear keeps of its input under
              sequence parallelism for its weight gradient: the all-gathered input (unset: what the trainer
              runs, torch's DTensor SP; activations.py) or its sequence shard, all-gathered again in the
              backward (Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2; Megatron-Core's
              LinearWithGradAccumulationAndAsyncCommunication and Transformer Engine's LayerNormLinear start
              that all-gather before the input-gradient GEMM and wait for it after): a block keeps its two
              norm outputs at 1/tp, and the backward's two all-gathers run beside that GEMM (plan/comm.py)
  sp_gather   bf16 | fp8                        the dtype sequence parallelism's all-gathers move under
              train.precision = "fp8" with the tensorwise recipe: the compute dtype (unset: what the trainer
              runs, parallel/float8.py: its own TP styles gather bf16) or FP8, as torchao's Float8ColwiseParallel /
              Float8RowwiseParallel / PrepareFloat8ModuleInput do under torchtitan: a block's input is scaled on
              its sequence shard and all-gathered in e4m3, a row-parallel output's gradient in e5m2 (plan/comm.py)
  pp_engine   torch | deepspeed                  the pipeline engine: torch.distributed.pipelining, whose
              isend / irecv delay only the receiver (unset: what the trainer runs), or DeepSpeed's
              PipelineEngine: its send / recv hold both ends of each transfer in a lock-step 1F1B (twice the
              exposed transfers per micro-batch), and under TP each rank sends 1/tp of the boundary and the
              receiver all-gathers it over TP (plan/comm.py pp_boundary_bytes, plan/cost.py pp_p2p_seconds);
              its one training schedule is 1F1B (plan/layout.py refuses another, plan/search.py tries only it)
  selective   op | attention_core                what train.recompute = "selective" reruns: the trainer's
              per-op policies (unset: train.recompute_policy, parallel/activation_checkpoint.py) or only the
              attention core, as Megatron-LM's --recompute-granularity selective checkpoints it (Korthikanti
              et al. 2022 §5): the block keeps what no recomputation keeps but the core's own internals (a
              fused kernel's log-sum-exp), and the backward reruns the attention forward, nothing else
"""
from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KERNELS = ("cudnn", "flash", "efficient", "math")
OPTIMIZER_KERNELS = ("fused", "foreach")
NORM_KERNELS = ("fused", "unfused")
LOSS_KERNELS = ("compiled", "eager")
GRAD_REDUCE = ("overlapped", "after_backward", "distributed_optimizer")
FP8_KERNELS = ("torchao", "transformer_engine")
ROPE_KERNELS = ("fused", "complex")
SP_SAVED_INPUT = ("gathered", "sharded")
SELECTIVE_RECOMPUTE = ("op", "attention_core")
SP_GATHER = ("bf16", "fp8")
PP_ENGINE = ("torch", "deepspeed")
CHOICES = {"attention_kernel": ATTENTION_KERNELS, "optimizer_kernel": OPTIMIZER_KERNELS,
           "norm_kernel": NORM_KERNELS, "loss_kernel": LOSS_KERNELS, "grad_reduce": GRAD_REDUCE,
           "fp8_kernel": FP8_KERNELS, "rope_kernel": ROPE_KERNELS,
           "sp_saved_input": SP_SAVED_INPUT, "selective_recompute": SELECTIVE_RECOMPUTE, "sp_gather": SP_GATHER,
           "pp_engine": PP_ENGINE}


@dataclass(frozen=True)
class Stack:
    compiled: bool
    attention: str     # the kernel family priced; "flash" also stands for torch's default fused kernel off Hopper
    optimizer: str
    norms: str
    loss: str
    grad_reduce: str = "overlapped"
    fp8: str = "torchao"  # read under train.precision = "fp8" only
    rope: str = "fused"
    sp_input: str = "gathered"  # read under sequence parallelism only
    selective: str = "op"  # read under train.recompute = "selective" only
    sp_gather: str = "bf16"  # read under FP8 (tensorwise) with sequence parallelism only
    pp_engine: str = "torch"  # read under pipeline parallelism only

    def describe(self) -> str:
        return (f"{'compiled blocks (inductor)' if self.compiled else 'eager'}, attention {self.attention}, "
                f"AdamW {self.optimizer}, norms {self.norms}, loss {self.loss}"
                + (", DDP all-reduce after the backward" if self.grad_reduce == "after_backward" else "")
                + (", Megatron distributed optimizer (overlapped reduce-scatter and all-gather)"
                   if self.grad_reduce == "distributed_optimizer" else "")
                + (", RoPE as complex multiplication" if self.rope == "complex" else ""))


def resolve(choices: dict[str, str | None], compiled: bool, attention_default: str, device_type: str) -> Stack:
    """The stack from cluster.*_kernel (None: today's default) for a step compiled or not."""
    attention = choices.get("attention_kernel") or attention_default
    return Stack(compiled, attention,
                 choices.get("optimizer_kernel") or ("fused" if device_type == "cuda" else "foreach"),
                 choices.get("norm_kernel") or ("fused" if compiled else "unfused"),
                 choices.get("loss_kernel") or ("compiled" if compiled else "eager"),
                 choices.get("grad_reduce") or "overlapped", choices.get("fp8_kernel") or "torchao",
                 choices.get("rope_kernel") or "fused", choices.get("sp_saved_input") or "gathered",
                 choices.get("selective_recompute") or "op", choices.get("sp_gather") or "bf16",
                 choices.get("pp_engine") or "torch")
