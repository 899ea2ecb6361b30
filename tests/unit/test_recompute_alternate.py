"""train.recompute_policy = "op_alternate" (parallel/activation_checkpoint.py): of the matmuls selective "op"
keeps, only every other one of a block's forward, as torchtitan's per-op policy does. What it keeps and
recomputes is counted here from the checkpoint policy's own decisions and from the backward's GEMMs,
independently of the memory meter (whose bytes tests/dist/test_plan_validation.py compares with the
planner's, *op_alternate rows); the planner's recompute time and bytes against a hand count."""
from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from shardwise.cli import main
from shardwise.config import build_config
from shardwise.models import build_model
from shardwise.parallel import activation_checkpoint
from shardwise.parallel.activation_checkpoint import MATMUL_OPS, apply_activation_checkpointing
from shardwise.plan import activations as A
from shardwise.plan.compute_time import gemm_time
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape

PRESETS = {"llama": {"preset": "tiny", "vocab_size": 512}, "gpt": {"preset": "tiny-gpt", "vocab_size": 512}}


def _model(arch: str, fused: bool = False):
    cfg = build_config({"model": PRESETS[arch]})
    model = build_model(cfg.model)
    model.init_weights(seed=0)
    if fused:
        from shardwise.models.feed_forward import fuse_training_projections
        fuse_training_projections(model)
    return model


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMUL_OPS
        return func(*args, **(kwargs or {}))


def _step(model, tokens):
    """Forward, then backward with its matmuls counted; the gradients."""
    loss = model(tokens).float().logsumexp(-1).mean()
    with _Matmuls() as counted:
        loss.backward()
    return counted.count, {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}


def _count_decisions(monkeypatch) -> Counter:
    """The op_alternate policy's forward decisions on matmuls, counted as it makes them."""
    decisions: Counter = Counter()
    alternate = activation_checkpoint._save_alternate_matmuls

    def counting_alternate(counts, scope, ctx, op, *args, **kwargs):
        decision = alternate(counts, scope, ctx, op, *args, **kwargs)
        if not ctx.is_recompute and op in MATMUL_OPS:
            decisions[decision] += 1
        return decision

    monkeypatch.setattr(activation_checkpoint, "_save_alternate_matmuls", counting_alternate)
    return decisions


@pytest.mark.parametrize("arch,fused,recomputed", [("llama", False, 3), ("gpt", False, 2), ("llama", True, 1)],
                         ids=["llama", "gpt", "llama_fused"])
def test_gradients_are_exact_and_the_backward_reruns_every_other_matmul(arch, fused, recomputed, monkeypatch):
    """The same gradients, bit for bit, as no recomputation (a rerun matmul on the CPU gives the same bits);
    the policy keeps the 1st, 3rd, ... matmul of every block, and the eager replay reruns the others up to
    the last one backward reads (torch's early stop spares the down-projection): llama wk, wo, w3 (3), gpt
    wk, wo (2), joined projections wo (1); "op" reruns none. As plan/activations.py
    alternate_recomputed_gemms prices them."""
    decisions = _count_decisions(monkeypatch)
    ref = _model(arch, fused)
    tokens = torch.randint(0, 512, (2, 16))
    runs = {}
    for policy_name in ("none", "op", "op_alternate"):
        model = copy.deepcopy(ref)
        apply_activation_checkpointing(model, "none" if policy_name == "none" else "selective", policy_name, 1)
        runs[policy_name] = _step(model, tokens)
    layers = ref.cfg.n_layers
    for name, grad in runs["none"][1].items():
        assert torch.equal(runs["op_alternate"][1][name], grad), name
    assert runs["op_alternate"][0] - runs["op"][0] == layers * recomputed, {k: v[0] for k, v in runs.items()}
    matmuls = {("llama", False): 7, ("gpt", False): 6, ("llama", True): 4}[(arch, fused)]
    kept = (matmuls + 1) // 2
    assert decisions == {CheckpointPolicy.MUST_SAVE: layers * kept,
                         CheckpointPolicy.PREFER_RECOMPUTE: layers * (matmuls - kept)}, decisions


def test_the_planner_keeps_what_the_policy_keeps_and_reruns_what_the_backward_reads():
    """Bytes: llama drops wk's (kv), wo's (h) and w3's (ffn) outputs, gpt wk's, wo's and proj's (h), joined
    blocks wo's and w2's; a full-size partial sum under TP for the row-parallel ones. Time: eager reruns
    the replayed GEMMs, compiled only those whose outputs backward reads (wk, w3)."""
    llama = ModelShape.from_config(build_config({"model": {"preset": "llama3-8b"}}).model)
    gpt = ModelShape.from_config(build_config({"model": PRESETS["gpt"]}).model)
    h, kv, f = llama.dim, llama.kv_dim, llama.ffn_dim
    assert A.alternate_unkept_bytes(llama, "autocast", 1, False) == 2 * (kv + h + f)
    assert A.alternate_unkept_bytes(llama, "fp32", 4, False) == 4 * (kv / 4 + h + f / 4)
    assert A.alternate_unkept_bytes(gpt, "fp32", 1, False) == 4 * (gpt.kv_dim + 2 * gpt.dim)
    assert A.alternate_unkept_bytes(llama, "autocast", 1, True) == 2 * 2 * h
    assert A.alternate_recomputed_gemms(llama, False, eager=True) == (1, 3, 5)  # wk, wo, w3 of wq wk wv wo w1 w3 w2
    assert A.alternate_recomputed_gemms(llama, False, eager=False) == (1, 5)
    assert A.alternate_recomputed_gemms(gpt, False, eager=True) == (1, 3)  # wk, wo of wq wk wv wo fc proj
    assert A.alternate_recomputed_gemms(gpt, False, eager=False) == (1,)
    assert A.alternate_recomputed_gemms(llama, True, eager=True) == (1,)  # wo of wqkv wo w13 w2
    assert A.alternate_recomputed_gemms(llama, True, eager=False) == ()


def _plan_args(policy: str, compiled: bool) -> list[str]:
    return ["plan", "evaluate", "--json", "--model.preset=llama3-8b", "--train.seq_len=8192", "--cluster.gpu=h100-sxm-80gb",
            "--cluster.num_gpus=8", "--parallel.dp_shard=8", "--parallel.zero=3", "--train.micro_batch=2",
            "--train.global_batch=16", "--train.recompute=selective", f"--train.recompute_policy={policy}",
            "--train.precision=bf16", f"--train.compile={'true' if compiled else 'false'}"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_the_recompute_time_is_the_forward_gemms_rerun(compiled, capsys):
    """Llama 3 8B, 8 H100s, 2 x 8192 tokens a rank: op_alternate's recompute over op's is the forward time
    of the rerun GEMMs (compiled wk and w3, 28.8% of the block's linear FLOPs; eager wo too, 36.5%) at the
    planner's GEMM rate, over 32 blocks."""
    seconds = {}
    for policy in ("op", "op_alternate"):
        assert main(_plan_args(policy, compiled)) == 0
        seconds[policy] = json.loads(capsys.readouterr().out)["breakdown_s"]["recompute"]
    tokens, h, kv, f = 16384, 4096, 1024, 14336
    one = {"wk": (tokens, kv, h), "wo": (tokens, h, h), "w3": (tokens, f, h)}
    rerun = ("wk", "w3") if compiled else ("wk", "wo", "w3")
    expected = 32 * sum(gemm_time("h100-sxm-80gb", 989.4e12, 3350, *one[g], 2, ()) for g in rerun)
    assert seconds["op_alternate"] - seconds["op"] == pytest.approx(expected, rel=1e-9)
    flops = {g: 2 * m * n * k for g, (m, n, k) in one.items()}
    linear = 2 * tokens * h * (2 * h + 2 * kv + 3 * f)
    assert sum(flops[g] for g in rerun) / linear == pytest.approx(0.288 if compiled else 0.365, abs=0.001)


def _layout(**kw) -> Layout:
    return Layout(recompute="selective", recompute_policy="op_alternate", **kw)


def test_rules_refuse_what_it_does_not_price():
    dense = ModelShape.from_config(build_config({"model": PRESETS["llama"]}).model)
    moe = ModelShape.from_config(build_config({"model": {"preset": "tiny-moe"}}).model)
    assert rules.alternate_matmuls_rule(dense, _layout()) is None
    assert rules.alternate_matmuls_rule(moe, Layout(recompute="selective")) is None  # "op": any model
    for shape, lay, phrase in [(moe, _layout(), "MoE"), (dense, _layout(linear_tiles=2), "linear_tiles=2"),
                               (dense, _layout(tp=2, tp_mode="2d"), "2-D")]:
        v = rules.alternate_matmuls_rule(shape, lay)
        assert v.field == "train.recompute_policy" and phrase in v.problem and v.fix and not v.trainer_only


def test_cli_refuses_a_moe_model_before_spawning(capsys, tmp_path):
    code = main(["train", "--model.preset=tiny-moe", "--train.recompute=selective", "--train.recompute_policy=op_alternate",
                 f"--data.cache_dir={tmp_path}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: train.recompute_policy:") and "MoE" in err and "fix:" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_fp8_linears_alternate_as_the_bf16_ones(monkeypatch):
    """On a GPU the FP8 linears run torch._scaled_mm; the policy must still see each as one matmul, or
    op_alternate would keep (or drop) every FP8 GEMM. torchao's Float8 tensors dispatch aten.mm to the policy
    before their own _scaled_mm: checked with the non-emulated path, which this CPU's torch also runs."""
    from shardwise.parallel import float8 as F8

    decisions = _count_decisions(monkeypatch)
    model = _model("llama")
    assert len(F8.apply_float8(model, "tensorwise", fsdp=False, emulate=False)) == 7 * model.cfg.n_layers
    apply_activation_checkpointing(model, "selective", "op_alternate", 1)
    model(torch.randint(0, 512, (2, 16))).float().logsumexp(-1).mean().backward()
    layers = model.cfg.n_layers
    assert decisions == {CheckpointPolicy.MUST_SAVE: 4 * layers, CheckpointPolicy.PREFER_RECOMPUTE: 3 * layers}, decisions
