"""The planner's eager kernel counts (plan/constants.py EAGER_*_KERNELS) are what our modules launch:
counted op by op with a TorchDispatchMode (tests/kernel_counts.py). A module change that adds or drops
an op fails here with the new count to copy into the table."""
from __future__ import annotations

import pytest

from shardwise.plan import constants as C
from tests.kernel_counts import count_kernels

PRESETS = {"llama": "tiny", "gpt": "tiny-gpt"}


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("regime", ["fp32", "autocast", "lowp"])
def test_dense_block_and_rest(arch, regime):
    c = count_kernels(PRESETS[arch], regime)
    assert (c["block_fwd"], c["block_bwd"]) == C.EAGER_BLOCK_KERNELS[(arch, regime)], c
    assert (c["rest_fwd"], c["rest_bwd"]) == C.EAGER_REST_KERNELS[(arch, regime)], c


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("regime", ["fp32", "autocast", "lowp"])
def test_moe_block_grows_per_local_expert(arch, regime):
    four, eight = count_kernels(PRESETS[arch], regime, 4), count_kernels(PRESETS[arch], regime, 8)
    fwd_e, bwd_e = (eight["block_fwd"] - four["block_fwd"]) // 4, (eight["block_bwd"] - four["block_bwd"]) // 4
    got = (four["block_fwd"] - 4 * fwd_e, fwd_e, four["block_bwd"] - 4 * bwd_e, bwd_e)
    assert got == C.EAGER_MOE_BLOCK_KERNELS[(arch, regime)], got


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("regime", ["fp32", "autocast", "lowp"])
def test_joined_projections_block(arch, regime):
    """train.fuse_projections: a dense block's counts, and what it changes in a MoE block (attention's q|k|v)."""
    c = count_kernels(PRESETS[arch], regime, fused=True)
    assert (c["block_fwd"], c["block_bwd"]) == C.EAGER_FUSED_BLOCK_KERNELS[(arch, regime)], c
    fused, plain = count_kernels(PRESETS[arch], regime, 4, fused=True), count_kernels(PRESETS[arch], regime, 4)
    delta = (fused["block_fwd"] - plain["block_fwd"], fused["block_bwd"] - plain["block_bwd"])
    assert delta == C.EAGER_FUSED_MOE_DELTA[(arch, regime)], delta
