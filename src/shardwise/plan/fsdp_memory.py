"""FSDP2's device transients on a rank (plan/memory.py `_states`): the gathered working copies, the
gradients before their reduce-scatter and, with offload, the staging of each gather. Read from torch's
FSDP2 (torch/distributed/fsdp/_fully_shard: FSDPParamGroup, FSDPParam, foreach_reduce).

Over several ranks: ZeRO-3 holds ~2 blocks gathered (the current one and the prefetched next) plus the
root unit (embedding, final norm, head: not resharded after forward), ZeRO-2 every unit from forward to
backward; one block's fp32 gradients exist before its reduce-scatter (with accumulation, ZeRO-2, which
syncs only on the last micro-batch, keeps the whole stage's). Under a pipeline schedule ZeRO-2 and
ZeRO-3 alike end the step with the whole stage gathered, parameters and fp32 gradients (the schedule
disables resharding after backward and reduce-scatters once, at its end).

Over a one-rank group (offload on one device) FSDP2 takes torch's world-size-1 path
(FSDPParamGroup.wait_for_unshard): each parameter is copied in when its unit runs, so nothing is
prefetched. A block's backward then holds its gradients (param dtype) until its reduce, the previous
block's fp32 reduce-scatter input, which FSDP2 keeps until this block reduces (reduce_scatter_states),
and the head's gradients, reduced with the root at the end of backward. The block's own one-rank reduce
(fp32 input + output, once its working copy is freed) is no larger; the root's reduce (fp32 input +
output of embedding and head) can be, for a large vocabulary. MEASURED on one H100
(tests/unit/test_plan_h100.py OFFLOAD_BIG, 6.1B, ZeRO-3): 2.29 GiB peak, 2.41 by this model (+5%); the
several-rank model above, with a whole block's staging copy, gave 3.15 (+38%).
"""
from __future__ import annotations

from typing import Protocol

FP32 = 4  # reduce dtype (parallel/data_parallel.py fsdp_mp_policy) and offloaded master weights


class UnitSizes(Protocol):
    """The element counts of one rank's FSDP units these need (plan/memory.py StateBytes has them)."""
    unsharded_param_numel: float
    block_numel: float
    root_numel: float
    head_numel: float
    block_largest_numel: float


def working_bytes(st: UnitSizes, zero: int, param_dtype: int, accumulating: bool, pipelined: bool,
                  one_rank: bool) -> tuple[float, float]:
    """(gathered parameters, gradients before their reduce) in bytes, module doc."""
    if pipelined:
        return st.unsharded_param_numel * param_dtype, st.unsharded_param_numel * FP32
    if one_rank:
        gathered = (st.unsharded_param_numel if zero == 2 else st.block_numel + st.root_numel) * param_dtype
        if accumulating and zero == 2:  # no reduce until the last micro-batch: fp32 gradients of every unit
            return gathered, st.unsharded_param_numel * FP32 + st.head_numel * param_dtype
        return gathered, (st.block_numel + st.head_numel) * param_dtype + st.block_numel * FP32
    if zero == 2:
        return (st.unsharded_param_numel * param_dtype,
                st.unsharded_param_numel * FP32 if accumulating else st.block_numel * FP32)
    return (2 * st.block_numel + st.root_numel) * param_dtype, st.block_numel * FP32


def offload_staging_bytes(st: UnitSizes, shard: int, param_dtype: int) -> float:
    """Device bytes of the offload staging while one unit is gathered (FSDPParam.all_gather_inputs): each
    parameter's fp32 shard is copied to the device, cast to the param dtype and the copy freed, so the
    unit's cast shards wait for the gather beside one fp32 shard. Over a one-rank group each cast goes
    straight into its gathered parameter: one tensor's fp32 copy and its cast."""
    cast = param_dtype if param_dtype != FP32 else 0  # fp32 training: the device copy is the gather input
    if shard == 1:
        return st.block_largest_numel * (FP32 + cast)
    return (st.block_numel * (cast or FP32) + st.block_largest_numel * FP32 * (cast > 0)) / shard


def one_rank_excess(st: UnitSizes, param_dtype: int, block_moment: float) -> tuple[float, float]:
    """(staging, root reduce) over a one-rank group, each as its excess over the block moment
    (`block_moment`: the working bytes above): the staging of one parameter precedes its unit's
    gradients; the root's reduce comes when the blocks' copies and gradients are gone."""
    staging = max(0.0, offload_staging_bytes(st, 1, param_dtype) - st.block_numel * param_dtype)
    return staging, max(0.0, 2 * FP32 * st.root_numel - block_moment - staging)
