"""spec/shapes.py, plan/activations.py, plan/memory.py against hand calculations and the real modules."""
from __future__ import annotations

import dataclasses

import pytest

from shardwise.config import load_config
from shardwise.plan import activations as A
from shardwise.plan.inflight import head_inflight_microbatches, inflight_microbatches
from shardwise.plan.inventory import pipeline_rank, pipeline_ranks
from shardwise.plan.layout import Problem
from shardwise.plan.memory import _zero1_most_loaded, memory, model_state_bytes
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape, MoESpec

GB = 1e9


def problem(*overrides: str) -> Problem:
    return Problem.from_config(load_config(overrides=list(overrides)))


def tiny(*overrides: str) -> tuple[Problem, Layout]:
    # fp32 unless an override says otherwise: the hand inventories below count 4-byte elements.
    cfg = load_config(overrides=["--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=8",
                                 "--cluster.gpus_per_node=1", "--train.precision=fp32", "--train.compile=false",
                                 *overrides])  # eager: the hand inventories are the eager ones (compiled: test_plan_compiled.py)
    return Problem.from_config(cfg), Layout.from_config(cfg, cfg.cluster.num_gpus)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt", "small", "llama3-8b"])
def test_parameter_inventory_is_the_real_model(preset):
    """Names, shapes and order of model.parameters() on the meta device; counts as Transformer's."""
    import torch

    from shardwise.models import ARCHS

    cfg = load_config(overrides=[f"--model.preset={preset}"]).model
    shape = ModelShape.from_config(cfg)
    with torch.device("meta"):
        model = ARCHS[cfg.arch](cfg)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(p.name, p.shape) for p in shape.params()]
    assert shape.num_params == ARCHS[cfg.arch].count_params(cfg)
    assert shape.flops_per_token(2048) == ARCHS[cfg.arch].count_flops_per_token(cfg, 2048)


def test_mixtral_shape_counts():
    """Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active per token.
    Hand count: attention 2*4096^2 + 2*4096*1024 = 41.9M, experts 8 x 3 x 4096 x 14336 = 1409.3M, router
    8 x 4096, norms 2 x 4096 -> 1451.3M per layer x 32 = 46.44B, + embedding and head 2 x 32000 x 4096
    = 0.26B -> 46.70B. Active: 2 of 8 experts -> 41.9M + 352.3M + 32.8K per layer x 32 + 0.13B head."""
    s = ModelShape("llama", 4096, 32, 32, 8, 14336, 32000, 32768, MoESpec(8, 2))
    assert s.num_params == pytest.approx(46.70e9, rel=2e-3)
    assert s.active_matmul_params + 32000 * 4096 == pytest.approx(12.9e9, rel=1e-2)


def test_textbook_70b_model_states_2_2_12():
    """A 70B LLaMA with bf16 weights and grads and fp32 AdamW (master, m, v): 2 + 2 + 12 = 16 bytes/param
    -> 70e9 x 16 = 1120 GB before activations; llama3-70b has 70.55e9 parameters -> 1128.9 GB. At TP8 x
    PP8 that is 1128.9 / 64 = 17.6 GB per GPU on average. The first stage also holds the embedding:
    (128256 x 8192 + 10 layers x 856.1M of matrices) / 8 + 10 x 2 x 8192 replicated norm gains
    = 1.2010e9 params x 16 B = 19.22 GB."""
    p = problem("--model.preset=llama3-70b", "--train.precision=bf16", "--cluster.model_states=mixed",
                "--cluster.num_gpus=1024", "--train.seq_len=8192", "--train.global_batch=512")
    total = 16 * p.shape.num_params
    assert total / GB == pytest.approx(1120, rel=0.01)
    assert total / 64 / GB == pytest.approx(17.6, abs=0.1)
    first, last = pipeline_ranks(p.shape, 8, 1, "1f1b")
    st = model_state_bytes(p, first, 8, 1, 0, 1, 1)
    matrices = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    local = (128256 * 8192 + 10 * matrices) / 8 + 10 * 2 * 8192
    assert st.params + st.grads + st.optimizer == 16 * local
    assert 16 * local / GB == pytest.approx(19.22, abs=0.01)
    assert st.params == 2 * st.local_numel and st.optimizer == 12 * st.local_numel


def test_zero_partitions_of_the_mixed_states():
    """Rajbhandari et al. Fig. 1 with N_d = 64: P_os = 4Ψ + 12Ψ/N_d, P_os+g = 2Ψ + 14Ψ/N_d, P_os+g+p = 16Ψ/N_d."""
    p = problem("--model.preset=llama3-8b", "--train.precision=bf16", "--cluster.model_states=mixed", "--cluster.num_gpus=64")
    rank = pipeline_ranks(p.shape, 1, 1, "1f1b")[0]
    psi = p.shape.num_params
    states = {z: model_state_bytes(p, rank, 1, 1, z, 64, 64) for z in (0, 1, 2, 3)}
    totals = {z: st.params + st.grads + st.optimizer for z, st in states.items()}
    assert totals[0] == 16 * psi
    assert totals[1] == pytest.approx(4 * psi + 12 * psi / 64)
    assert totals[2] == pytest.approx(2 * psi + 14 * psi / 64)
    assert totals[3] == pytest.approx(16 * psi / 64)


def test_zero1_greedy_partition_by_hand():
    """tiny (vocab 512) on 2 ranks. Decay group sorted: 32768 (embedding), 32768 (head), 6 x 12288 (MLP),
    4 x 4096 (wq, wo), 4 x 2048 (wk, wv) -> each rank 32768 + 3 x 12288 + 2 x 4096 + 2 x 2048 = 81920;
    then the 5 norm gains of 64: ranks 0, 1, 0, 1, 0 -> rank 0 holds 82112 elements in 11 tensors:
    8 x 82112 + 4 x 11 = 656,940 bytes (what ZeroRedundancyOptimizer holds, see the CPU validation)."""
    p, lay = tiny("--cluster.num_gpus=2", "--parallel.dp_shard=2", "--parallel.zero=1", "--train.micro_batch=4")
    assert memory(p, lay).optimizer == 656_940
    assert _zero1_most_loaded((10, 10, 1), (), 2) == 8 * 11 + 4 * 2


def test_zero1_with_tp_partitions_the_local_shards():
    """zero=1 with tp=2 (trained since parallel/zero1.py): the partition runs over TP-local sizes.
    tiny, tp2 (n_kv 2 = tp: KV heads split): decay group local sizes 16384 (embedding rows), 16384 (head
    rows), 6 x 6144 (w1, w3 rows; w2 columns), 4 x 2048 (wq rows, wo columns), 4 x 1024 (wk, wv) -> each
    of the 2 dp_shard ranks 16384 + 3 x 6144 + 2 x 2048 + 2 x 1024 = 40960; the 5 replicated norm gains
    of 64 go to ranks 0, 1, 0, 1, 0 -> rank 0: 41152 elements in 11 tensors = 8 x 41152 + 4 x 11 =
    329,260 bytes, what the trainer's ZeroOneOptimizer holds on its most loaded rank (measured on 4
    processes). Parameters and gradients stay whole TP shards (4 x 82240 local elements)."""
    p, lay = tiny("--cluster.num_gpus=4", "--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.zero=1",
                  "--train.micro_batch=2")
    m = memory(p, lay)
    assert m.optimizer == 329_260
    assert m.params == m.grads == 4 * (16384 * 2 + 2 * (2048 * 2 + 1024 * 2 + 6144 * 3 + 2 * 64) + 64) == 328_960


def test_fsdp_pads_dim0_per_parameter():
    """vocab 510 over 4 shards: the embedding and head shards hold ceil(510/4) = 128 rows of 64."""
    p, lay = tiny("--cluster.num_gpus=4", "--parallel.dp_shard=4", "--parallel.zero=3", "--train.micro_batch=2",
                  "--model.vocab_size=510")
    # embedding 128x64 + head 128x64 + final norm 16 + 2 layers x (norms 2x16 + wq 16x64 + wk 8x64 + wv 8x64
    # + wo 16x64 + w1 48x64 + w3 48x64 + w2 16x192)
    layer = 2 * 16 + 16 * 64 + 8 * 64 + 8 * 64 + 16 * 64 + 48 * 64 + 48 * 64 + 16 * 192
    local = 2 * 128 * 64 + 16 + 2 * layer
    m = memory(p, lay)
    assert m.params == 4 * local and m.grads == 4 * local
    assert m.optimizer == 8 * local + 4 * 21


def test_activation_inventory_by_hand_fp32():
    """tiny llama, fp32, b = 8, s = 32 (256 tokens), h = 64, kv = 32, f = 192, 4 heads, vocab 512.
    Per block per token: two RMSNorms 2 x (x, rsqrt, x*rsqrt, y) = 2 x (12h + 4) = 1544; q, k, v, SDPA out
    4 x (64 + 32 + 32 + 64) = 768, LSE 4 x 4 = 16; SwiGLU 4 x 4f = 3072 -> 5400 B/token.
    Ends: embedding indices 8; final norm 12h + 4 = 772; log-softmax 4 x 512 = 2048; targets 8 -> 2836.
    Total 2 x 5400 x 256 + 2836 x 256 + RoPE tables 2 x 512 x 16 x 4 + loss scalar 4 = 3,556,356."""
    p, lay = tiny("--cluster.num_gpus=1", "--train.micro_batch=8")
    assert A.block_bytes(p.shape, "fp32", 1, False).per_token == 5400
    # On a GPU, fp32 grouped-query attention runs SDPA's math backend (spec/layout.py attention_backend):
    # per block per token 4 x (4h + heads x s) = 4 x (256 + 128) = 1536 instead of 784 (q, k, v, out, LSE):
    # +752 x 2 blocks x 256 tokens.
    assert p.attention == "math"
    assert memory(p, lay).detail["activations_stored"] == 3_556_356 + 752 * 2 * 256
    p = dataclasses.replace(p, attention="flash")  # what the CPU runs
    assert memory(p, lay).detail["activations_stored"] == 2 * 5400 * 256 + 2836 * 256 + 65536 + 4 == 3_556_356


def test_activation_inventory_autocast_adds_weight_and_input_copies():
    """bf16 autocast, fp32 params (single process): norms keep fp32 x, rsqrt, x*rsqrt (8h + 4) and each
    consuming linear casts its input (3 x 2h before q/k/v, 2 x 2h before w1/w3); attention 2 x 192 + 16;
    MLP 4 x 2f -> 900 + 772 + 400 + 1536 = 3608 B/token; + one bf16 copy of every weight per micro-batch
    2 x 49152 = 98304 B per block."""
    p, _ = tiny("--cluster.num_gpus=1", "--train.precision=bf16")
    b = A.block_bytes(p.shape, "autocast", 1, False)
    assert (b.per_token, b.fixed) == (3608, 98304)


def test_tp_and_sp_shard_the_right_tensors():
    """With TP t the head-/ffn-sharded tensors divide by t; norms divide only with SP; the gathered
    input of the column-parallel linears stays full (torch TP saves the all-gathered input)."""
    s = problem("--model.preset=llama3-70b").shape
    none = A.block_bytes(s, "lowp", 1, False).per_token
    tp8 = A.block_bytes(s, "lowp", 8, False).per_token
    sp8 = A.block_bytes(s, "lowp", 8, True).per_token
    h = s.dim
    norms = 2 * (4 * h + 4 + 2 * h)      # x.float(), rsqrt, normalized (sequence-sharded under SP)
    gathered = 2 * 2 * h                 # the two norm outputs feeding column-parallel linears
    assert none - tp8 == pytest.approx((none - norms - gathered) * 7 / 8, rel=0.01)  # 128-wide kv heads: exact up to rounding
    assert tp8 - sp8 == pytest.approx(norms * 7 / 8)


def test_korthikanti_table2_and_the_70_percent_saving():
    """Korthikanti et al. 2022: GPT-3 175B (a = 96, s = 2048, h = 12288) has 5as/h = 80, so selective
    recomputation removes 80 / (34 + 80) = 70% of the activation memory (their §4.2)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    full = A.korthikanti_bytes_per_layer(s, b, h, a)
    assert full == s * b * h * (34 + 80)
    assert 1 - A.korthikanti_bytes_per_layer(s, b, h, a, recompute="selective") / full == pytest.approx(0.70, abs=0.005)
    assert A.korthikanti_bytes_per_layer(s, b, h, a, t) == s * b * h * (10 + 24 / t + 80 / t)
    assert A.korthikanti_bytes_per_layer(s, b, h, a, t, sp=True, recompute="selective") == s * b * h * 34 / t
    assert A.korthikanti_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h


def test_inflight_microbatches_per_schedule():
    assert inflight_microbatches("1f1b", 8, 32, 1, True) == 8 and inflight_microbatches("1f1b", 8, 32, 1, False) == 1
    assert inflight_microbatches("gpipe", 8, 32, 1, True) == 32
    # Korthikanti §4.2.3: interleaving multiplies the first stage's memory by 1 + (p-1)/(p v): 8 x (1 + 7/16) = 11.5.
    assert inflight_microbatches("interleaved_1f1b", 8, 32, 2, True) == pytest.approx(8 * (1 + 7 / 16))
    assert inflight_microbatches("1f1b", 1, 32, 1, True) == 1


def test_zbv_inflight_follows_torchs_schedule_order():
    """ZB-V (Qi et al. 2024 §6): the peak of every rank is 1F1B's first rank's, p micro-batches = 2p
    half-size chunks, once m >= 2p - 1. The closed form min(2p, m + r + 1) chunk-micro-batches is
    checked against the order torch's ScheduleZBVZeroBubble runs (what the trainer uses): in-flight =
    forwards run - weight-gradient (W) passes run, at its maximum."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    class Order(ScheduleZBVZeroBubble):
        def __init__(self, pp: int, m: int):  # only what _calculate_single_rank_operations reads
            self.pp_group_size, self._n_microbatches, self.num_stages = pp, m, 2 * pp

    for pp in (2, 3, 4, 8):
        for m in range(pp, 3 * pp + 1):
            for r, first in ((0, True), (pp - 1, False)):
                now = peak = 0
                for a in Order(pp, m)._calculate_single_rank_operations(r):
                    if a is not None:
                        now += {_ComputationType.FORWARD: 1, _ComputationType.BACKWARD_WEIGHT: -1}.get(a.computation_type, 0)
                        peak = max(peak, now)
                assert inflight_microbatches("zbv", pp, m, 2, first) == peak / 2, (pp, m, r)
    assert inflight_microbatches("zbv", 8, 32, 2, True) == inflight_microbatches("1f1b", 8, 32, 1, True) == 8
    assert inflight_microbatches("zbv", 8, 32, 2, False) == 8  # balanced: the last rank too


def _v_schedule_peaks(cls, pp: int, m: int, r: int) -> tuple[int, int]:
    """(peak chunk-micro-batches in flight on rank r, peak of the last stage's) in the order torch's V
    schedule `cls` runs: a forward adds one, a full backward or a weight pass (W) frees one; an
    overlapped F+B runs its forward first (what the trainer's PeakActivationMeter measured)."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    class Order(cls):
        def __init__(self):  # only what _calculate_single_rank_operations reads
            self.pp_group_size, self._n_microbatches, self.num_stages = pp, m, 2 * pp

    live: dict[int, int] = {}
    peak = head = 0
    for a in Order()._calculate_single_rank_operations(r):
        if a is None:
            continue
        for sub in (a.sub_actions if a.computation_type == T.OVERLAP_F_B else (a,)):
            delta = {T.FORWARD: 1, T.FULL_BACKWARD: -1, T.BACKWARD_WEIGHT: -1}.get(sub.computation_type, 0)
            live[sub.stage_index] = live.get(sub.stage_index, 0) + delta
            peak = max(peak, sum(live.values()))
            head = max(head, live.get(2 * pp - 1, 0))
    return peak, head


def test_dualpipev_and_head_inflight_follow_torchs_schedule_order():
    """DualPipeV peaks at 2p + 1 half-size chunk-micro-batches on every rank (m >= 2p, stages.py);
    the last stage (chunk 1 of rank 0 under both V schedules) never holds more than one."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    for pp in (2, 3, 4, 8):
        for m in range(2 * pp, 3 * pp + 1):
            for r, first in ((0, True), (pp - 1, False)):
                peak, head = _v_schedule_peaks(ScheduleDualPipeV, pp, m, r)
                assert inflight_microbatches("dualpipev", pp, m, 2, first) == peak / 2 == pp + 0.5, (pp, m, r)
                if r == 0:
                    assert head == head_inflight_microbatches("dualpipev", pp, m, 2) == 1
                    assert _v_schedule_peaks(ScheduleZBVZeroBubble, pp, m, r)[1] == 1
    assert head_inflight_microbatches("gpipe", 4, 16, 1) == 16
    assert head_inflight_microbatches("1f1b", 4, 16, 1) == inflight_microbatches("1f1b", 4, 16, 1, False) == 1
    assert head_inflight_microbatches("interleaved_1f1b", 4, 16, 2) == 1


def test_uneven_pipeline_split_and_v_shapes():
    s = problem("--model.preset=llama3-405b").shape
    first, last = pipeline_ranks(s, 16, 1, "1f1b")           # 126 = 14 x 8 + 2 x 7
    assert (first.layers, last.layers, first.embedding, last.head) == (8, 7, True, True)
    for schedule in ("zbv", "dualpipev"):
        v_first, v_last = pipeline_ranks(s, 4, 2, schedule)
        assert v_first.embedding and v_first.head              # the V puts chunk 0 and chunk 2p-1 on rank 0
        assert not (v_last.embedding or v_last.head)
        # 126 blocks in 8 chunks (6 x 16 + 2 x 15): rank 0 holds chunks 0 and 7 (16 + 15), rank 1 chunks
        # 1 and 6 (16 + 15), rank 3 chunks 3 and 4 (16 + 16).
        assert (v_first.layers, pipeline_rank(s, 4, 2, schedule, 1).layers, v_last.layers) == (31, 31, 32)
    looped = pipeline_ranks(s, 4, 2, "zero_bubble")[0]        # zero_bubble keeps the looped placement
    assert looped.embedding and not looped.head


def test_zero2_keeps_unsharded_params_and_accumulated_grads():
    """FSDP2 ZeRO-2 holds every unsharded (param_dtype) parameter from forward to backward, and with
    accumulation the unsharded fp32 gradients; ZeRO-3 holds two blocks plus the root unit."""
    p, lay = tiny("--cluster.num_gpus=2", "--parallel.dp_shard=2", "--parallel.zero=2", "--train.micro_batch=2")
    full = 164_160  # tiny, vocab 512
    m = memory(p, lay)
    assert m.detail["fsdp_unsharded_params"] == 4 * full and m.detail["fsdp_unsharded_grads"] == 4 * full
    z3 = memory(p, lay.with_(zero=3))
    assert z3.detail["fsdp_unsharded_params"] == 4 * (2 * 49_280 + 65_600)


def test_fsdp_under_a_pipeline_schedule_ends_the_step_unsharded():
    """pp2 x dp_shard2 on a 4-block tiny: the pipeline schedule turns resharding after backward off and
    reduce-scatters only at the end of the step, so by the last backward the whole stage (embedding
    32768 + 2 blocks x 49280 elements on the first rank) is unsharded, with its fp32 gradients —
    for ZeRO-3 as for ZeRO-2 (without PP, ZeRO-3 holds two blocks and the root)."""
    p, lay = tiny("--cluster.num_gpus=4", "--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.pp=2",
                  "--model.n_layers=4", "--train.micro_batch=1")
    stage = 32768 + 2 * 49280
    for zero in (2, 3):
        d = memory(p, lay.with_(zero=zero)).detail
        assert d["fsdp_unsharded_params"] == 4 * stage and d["fsdp_unsharded_grads"] == 4 * stage
    assert memory(p, lay.with_(pp=1, dp_shard=4)).detail["fsdp_unsharded_params"] == 4 * (2 * 49280 + 65600)


def test_offload_moves_states_to_the_host():
    p, lay = tiny("--cluster.num_gpus=2", "--parallel.dp_shard=2", "--parallel.zero=3", "--parallel.offload=true",
                  "--train.micro_batch=4")
    m = memory(p, lay)
    assert m.params == m.grads == m.optimizer == 0 and m.cpu_bytes == 328_320 * 2 + 656_724
