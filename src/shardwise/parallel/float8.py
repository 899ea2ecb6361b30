"""FP8 training (train.precision = "fp8", train.fp8_recipe): torchao's float8 linears in the blocks.

torchao (a well-kept PyTorch library, what torchtitan uses) swaps each selected nn.Linear for a
Float8Linear: its input, weight and output gradient are scaled and cast to float8 (e4m3 forward; the
recipe decides e4m3/e5m2 and the scale's granularity) and multiplied with torch._scaled_mm, which needs
FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell). Everything else computes in bf16
(parallel/precision.py DTYPES["fp8"]), and master weights stay fp32.

Kept in bf16, as torchtitan does:
- the output head (its logits feed the loss: the vocabulary's tail probabilities need more range
  than e4m3's 3 mantissa bits give), unless train.fp8_head: then its three GEMMs are FP8 too (issue 27
  names the head among what keeps FP8's speed-up small: 6.9% of the 886M LLaMA's FLOPs, ~10 ms of its
  186 ms H100 step in bf16), with the same tensorwise / rowwise scaling; the logits are still produced
  and reduced in bf16 / fp32 (the loss, train/loss.py), only the GEMM's operands are rounded, and the
  logits' gradient is cast to e5m2 (tests/unit/test_float8.py holds both directions' error);
- the MoE router (a top-k decision: a rounding that flips which expert a token goes to is not a small
  error);
- any linear whose dims are not multiples of 16 (torch._scaled_mm's requirement).
Recipes: "tensorwise" (one dynamic scale per tensor; with FSDP2 the weights are all-gathered in FP8,
half of bf16's bytes) and "rowwise" (one scale per row of each operand: more accurate, a little slower).

On CPU the same conversion runs with torchao's emulation (fp8_unsupported), so FP8 runs, and its
numerics are tested, without a GPU (tests/unit/test_float8.py; tests/parity).

Order (parallelize.py): first, on the plain model, before every other step sees its modules.
Tensor parallelism: the Float8Linears are split by our TP styles (parallel/tensor.py) like plain
linears, and tensorwise scales are the amax of the whole DTensor, so every tp rank casts with the same
scale a single process would (tests/dist/test_precision.py: fp8 tp2 tracks fp8 on one process). The SP
all-gathers stay bf16: torchao's float8 TP styles, which gather in FP8, would have to replace ours,
which do more than column / row splits. Where KV heads are replicated (n_kv_heads < tp), wk / wv take
our own forward (ReplicatedKVColwise) and run in bf16. EP's stacked experts are not nn.Linear: bf16.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from shardwise.errors import ConfigError
from shardwise.models.feed_forward import join_rows
from shardwise.spec.layout import fp8_gemm_fits

# The smallest compute capability with FP8 tensor cores (Ada Lovelace, sm_89).
FP8_CAPABILITY = (8, 9)
# Linears kept in bf16 by name (the last component of the module's name), see the module docstring; the
# head (HEAD) is FP8 too under train.fp8_head.
HEAD = "output"
KEEP_BF16 = (HEAD, "router")


def fp8_unsupported(device_type: str) -> str | None:
    """Why FP8 training cannot run on this device, or None when it can. A CPU runs it with torchao's
    emulation (the same scaling and float8 rounding, matmuls in higher precision): for developing and
    testing on a laptop like every other feature, not for speed. A GPU without FP8 tensor cores is
    refused: torch._scaled_mm has no kernel there, and emulating on a GPU would only be slower than bf16."""
    if device_type == "cpu":
        return None
    if device_type != "cuda" or not torch.cuda.is_available():
        return f"FP8 matmuls need a GPU with FP8 tensor cores (or the CPU's emulation), not {device_type}"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}; FP8 tensor "
                f"cores need {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
    return None


def check_fp8(device_type: str) -> None:
    """A ConfigError (exit 2, before any process is spawned when the launcher calls it) if FP8 cannot run."""
    why = fp8_unsupported(device_type)
    if why is not None:
        raise ConfigError("train.precision", f'"fp8": {why}', 'use train.precision="bf16" on this GPU')
    try:
        _import_float8()
    except ImportError as e:
        raise ConfigError("train.precision", f'"fp8" needs torchao, which does not import: {e}',
                          "pip install torchao==0.18.0 (the version pyproject.toml pins)") from e


def _import_float8():
    """torchao.float8, imported quietly: on import torchao logs a warning for each optional compiled kernel
    library its wheel carries for other CUDA builds ("Failed to load ..._C_cutlass_90a.abi3.so"), and
    torch logs one for an Enum torchao registers; neither concerns float8 training, and a user should
    not read them as errors. Only those two loggers, only during the import."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8


def convertible(module: nn.Module, fqn: str, head: bool = False) -> bool:
    """Whether the linear `fqn` becomes a Float8Linear (module docstring); `head`: train.fp8_head."""
    keep = tuple(name for name in KEEP_BF16 if not (head and name == HEAD))
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in keep:
        return False
    return fp8_gemm_fits(module.in_features, module.out_features)


class _TorchaoContext:
    """What torchao's matmul_with_hp_or_float8_args reads and writes on its autograd context, for calling its
    forward and backward from _JoinedFloat8: its saved tensors come from us, its own save is dropped."""

    def __init__(self, saved: tuple = (), linear_mm_config=None, config=None):
        self.saved_tensors, self.linear_mm_config, self.config = saved, linear_mm_config, config

    def save_for_backward(self, *tensors) -> None:
        pass


def torchao_steps() -> tuple:
    """(forward, backward) of torchao's matmul_with_hp_or_float8_args as plain functions, taken outside any
    compiled region: torch.compile reads `Function.backward(ctx, ...)` as autograd's own call, whose ctx
    must be autograd's, not _TorchaoContext."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return tuple(vars(matmul_with_hp_or_float8_args)[step].__func__ for step in ("forward", "backward"))


class _JoinedFloat8(torch.autograd.Function):
    """torchao's FP8 GEMM (matmul_with_hp_or_float8_args, what each Float8Linear.forward applies) over
    weights joined along their rows, saving the weights themselves, not the join, which torchao's function
    would keep from forward to backward (eager: the fp32 copy; compiled: its FP8 cast; per block, and under
    FSDP of every block's unsharded weights at once: models/feed_forward.py _JoinedLinear, the plain GEMM's
    twin). Backward joins them again (feed_forward.join_rows) and runs torchao's own backward on that."""

    @staticmethod
    def forward(ctx, x, steps, linear_mm_config, config, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.steps, ctx.linear_mm_config, ctx.config = steps, linear_mm_config, config
        return steps[0](_TorchaoContext(), x, torch.cat(weights).t(), linear_mm_config, config)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        joined = join_rows(weights, weights[0].dtype)
        dx, dw_t, *_ = ctx.steps[1](_TorchaoContext((x, joined.t()), ctx.linear_mm_config, ctx.config), grad)
        return dx, None, None, None, *dw_t.t().split([w.shape[0] for w in weights])


def float8_fused_linear(x, linears: tuple[nn.Module, ...], steps: tuple | None = None):
    """train.fuse_projections over torchao Float8Linears (models/feed_forward.py fused_linear): one FP8 GEMM
    over their joined weights, by torchao's own forward and backward (_JoinedFloat8; `steps`: torchao_steps,
    which fused_linear_for takes once), as each Float8Linear.forward applies them (the input in the autocast
    dtype; the bias added after). Rowwise scales are per row of each weight, so the same as apart;
    tensorwise takes one scale over the joined weight."""
    first = linears[0]
    if torch.is_autocast_enabled():  # Float8Linear.forward's own rule: the output in the autocast dtype
        x = x.to(torch.get_autocast_gpu_dtype())
    out = _JoinedFloat8.apply(x, steps or torchao_steps(), first.linear_mm_config, first.config,
                              *(lin.weight for lin in linears))
    if first.bias is not None:
        out = out + torch.cat([lin.bias for lin in linears]).to(out.dtype)
    return out.split([lin.out_features for lin in linears], dim=-1)


def fused_linear_for(linears: tuple[nn.Module, ...]):
    """The joined GEMM for `linears`: FP8 for torchao's Float8Linears, else the plain one."""
    from shardwise.models.feed_forward import fused_linear

    if type(linears[0]).__name__ != "Float8Linear":
        return fused_linear
    return functools.partial(float8_fused_linear, steps=torchao_steps())


def apply_float8(model: nn.Module, recipe: str, fsdp: bool, emulate: bool = False, head: bool = False) -> list[str]:
    """Convert the model's eligible linears in place; returns their names. `emulate` runs the FP8
    arithmetic without FP8 hardware (torchao's emulation: for the CPU numerics tests only); `head`: the
    output head too (train.fp8_head)."""
    float8 = _import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    updates = {"emulate": emulate}
    if fsdp and recipe == "tensorwise":
        # FSDP2 all-gathers the sharded weights already cast to FP8 (one scale per tensor is what makes
        # a shard's cast agree with the whole weight's): half the bytes of a bf16 all-gather.
        updates["enable_fsdp_float8_all_gather"] = True
    config = dataclasses.replace(config, **updates)
    def is_head(module: nn.Module, fqn: str) -> bool:
        return head and fqn.rsplit(".", 1)[-1] == HEAD and convertible(module, fqn, head=True)

    def in_blocks(module: nn.Module, fqn: str) -> bool:
        return convertible(module, fqn) and not is_head(module, fqn)

    converted = [fqn for fqn, module in model.named_modules() if in_blocks(module, fqn) or is_head(module, fqn)]
    float8.convert_to_float8_training(model, config=config, module_filter_fn=in_blocks)
    if head:
        # The head (train.fp8_head) is FSDP's root unit, with the embedding and the final norm: gathered as
        # they are, not in FP8, so only its GEMMs change (and the planner's bytes of FSDP do not).
        float8.convert_to_float8_training(model, config=dataclasses.replace(config, enable_fsdp_float8_all_gather=False),
                                          module_filter_fn=is_head)
    return converted
