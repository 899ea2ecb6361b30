"""parallel/float8.py: which linears become FP8, FP8's numerics against bf16 (torchao's emulation on
CPU), and the refusals."""
from __future__ import annotations

import pytest
import torch

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.models import build_model
from shardwise.parallel import float8 as F8
from shardwise.parallel.precision import autocast


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 20 log10(|ref| / |ref - got|) (torchao's compute_error)."""
    return float(20 * torch.log10(ref.float().norm() / (ref.float() - got.float()).norm()))


def _model(preset: str = "tiny"):
    cfg = load_config(None, [f"--model.preset={preset}", "--model.vocab_size=512"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights(0)
    return model


def test_blocks_linears_become_fp8_and_the_head_and_router_stay_bf16():
    model = _model("tiny-moe")
    converted = F8.apply_float8(model, "tensorwise", fsdp=False, emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert converted and all(kinds[name] == "Float8Linear" for name in converted)
    assert kinds["output"] == "Linear" and all(kinds[n] == "Linear" for n in kinds if n.endswith(".router"))
    assert any(n.endswith("attention.wq") for n in converted)


def test_fp8_head_converts_the_head_too_and_gathers_it_unconverted_under_fsdp():
    """train.fp8_head: the output head is a Float8Linear as well; the router stays bf16; with FSDP's FP8
    all-gather on (tensorwise) the blocks' weights are gathered in FP8 but the head, in FSDP's root unit with
    the embedding, is gathered as it is (so FSDP's bytes, which the planner counts, do not change)."""
    model = _model("tiny-moe")
    converted = F8.apply_float8(model, "tensorwise", fsdp=True, emulate=True, head=True)
    modules = dict(model.named_modules())
    assert "output" in converted and type(modules["output"]).__name__ == "Float8Linear"
    assert not modules["output"].config.enable_fsdp_float8_all_gather
    assert all(modules[n].config.enable_fsdp_float8_all_gather for n in converted if n != "output")
    assert all(type(m).__name__ == "Linear" for n, m in modules.items() if n.endswith(".router"))
    assert len(converted) == len(F8.apply_float8(_model("tiny-moe"), "tensorwise", fsdp=True, emulate=True)) + 1


def test_fp8_head_needs_fp8_training():
    from shardwise.preflight import check

    with pytest.raises(ConfigError) as e:
        check(load_config(None, ["--model.preset=tiny", "--train.precision=bf16", "--train.fp8_head=true"]), 1)
    assert e.value.field == "train.fp8_head" and "bf16" in e.value.problem
    check(load_config(None, ["--model.preset=tiny", "--train.precision=fp8", "--train.fp8_head=true"]), 1)


def _against_bf16(convert) -> tuple[float, dict[str, float]]:
    """SQNR (dB) of the logits and of each weight gradient of a model `convert` made FP8, against the same
    model in bf16, on the same weights and batch."""
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for fp8 in (False, True):
        model = _model()
        if fp8:
            convert(model)
        with autocast("bf16", "cpu"):
            logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (got, got_grads) = results
    return _sqnr_db(ref, got), {n: _sqnr_db(ref_grads[n], got_grads[n]) for n in ref_grads if ref_grads[n].abs().sum() > 0}


def test_fp8_head_logits_and_head_gradient_against_bf16():
    """The head alone in FP8 against bf16 (the blocks bf16 in both, so only the head's rounding shows): the
    logits and the weight gradients. The same e4m3 / e5m2 reasoning as the next test's bounds; the logits'
    gradient, cast to e5m2, feeds the head's two backward GEMMs, and through the input's gradient every
    block's. Measured (tiny llama, dim 64, 4 x 32 tokens): logits 28.5 dB (below the blocks-in-FP8 test's 33.9:
    a dot product of 64 terms averages little of its operands' rounding away), the head's weight gradient 29.3
    dB, the worst gradient 23.3 dB (layers.1.attention.wq)."""
    float8 = F8._import_float8()
    config = float8.Float8LinearConfig(emulate=True)

    def head_only(model):
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn == F8.HEAD)

    forward, grads = _against_bf16(head_only)
    print(f"fp8 head: logits {forward:.1f} dB, output.weight {grads['output.weight']:.1f} dB, worst {min(grads.values()):.1f} dB "
          f"({min(grads, key=grads.get)})")
    assert forward >= 25.0
    assert min(grads.values()) >= 15.0, grads


@pytest.mark.parametrize("recipe, forward_db, grad_db", [("tensorwise", 25.0, 15.0), ("rowwise", 25.0, 15.0)])
def test_fp8_forward_and_backward_against_bf16(recipe, forward_db, grad_db):
    """SQNR of the logits and of every weight gradient, FP8 against bf16, on the same weights and batch.
    e4m3 keeps 3 mantissa bits: one cast is ~30 dB (a relative rounding of 2^-4 uniformly spread), a GEMM of
    two cast operands ~25-28 dB, and the backward casts the output gradient to e5m2 (2 bits) or e4m3,
    so gradients through several FP8 GEMMs land lower. Measured (tiny llama, 4 x 32 tokens): logits 33.9 /
    33.6 dB, the worst weight gradient 19.4 / 21.0 dB (tensorwise / rowwise). Bounds: 25 dB forward, 15 dB
    per gradient (3% of the gradient's power as noise); a wrong scale (an amax left at 1) gives < 0 dB.
    A linear left unconverted would only raise these, which the test above catches."""
    forward, grads = _against_bf16(lambda model: F8.apply_float8(model, recipe, fsdp=False, emulate=True))
    print(f"{recipe}: logits {forward:.1f} dB, weight gradients min {min(grads.values()):.1f} dB "
          f"({min(grads, key=grads.get)})")
    assert forward >= forward_db
    assert min(grads.values()) >= grad_db, grads


def test_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as e:
        F8.check_fp8("cuda")
    assert e.value.field == "train.precision" and "A100" in e.value.problem and "8.9" in e.value.problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    F8.check_fp8("cuda")  # H100: FP8 tensor cores
    F8.check_fp8("cpu")   # emulated


def test_an_unknown_fp8_recipe_is_refused_before_spawning():
    from shardwise.preflight import check

    check(load_config(None, ["--model.preset=tiny", "--train.precision=fp8", "--parallel.tp=2"]), 2)  # TP composes
    with pytest.raises(ConfigError) as e:
        check(load_config(None, ["--model.preset=tiny", "--train.precision=fp8", "--train.fp8_recipe=blockwise"]), 1)
    assert e.value.field == "train.fp8_recipe"


@pytest.mark.parametrize("vocab, head_fp8", [(512, True), (520, False)])
def test_the_start_up_line_says_whether_the_head_is_fp8(tmp_path, vocab, head_fp8):
    """train.fp8_head converts the head only where torch._scaled_mm takes its dims (multiples of 16: vocab 520
    is 8 x 65): the trainer, the planner (Problem.head_in_fp8) and the start-up line agree on it."""
    from shardwise.plan.layout import Problem
    from shardwise.train.trainer import Trainer

    cfg = load_config(None, ["--model.preset=tiny", f"--model.vocab_size={vocab}", "--data.tokenizer=byte",
                             "--train.precision=fp8", "--train.fp8_head=true", "--train.steps=1",
                             f"--run.dir={tmp_path}", "--run.progress=false", "--run.tensorboard=false"])
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append, single_process=True)
    (line,) = [ln for ln in lines if ln.startswith("fp8:")]
    assert ("the output head included" in line) == head_fp8, line
    assert (type(trainer.inner.output).__name__ == "Float8Linear") == head_fp8
    assert Problem.from_config(cfg).head_in_fp8 == head_fp8
