"""parallel.linear_tiles (parallel/tiling.py): the MLPs computed in tiles along the hidden dim.

Tolerance, fp32: relative 1e-5 (max |d| / max |reference|). Tiling changes only the order of the
summation over the ffn dim (the output is a sum of per-tile down-projections instead of one GEMM's
reduction, dx a sum of per-tile up-projection gradients); weight gradients are the same products
slice by slice. fp32 rounding of such a reordering is ~1e-7 relative (measured: <= 6e-7), so 1e-5
leaves an order of magnitude and still catches a wrong slice or a missing tile (>= 1e-2).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from shardwise.cli import main
from shardwise.config import build_config, load_config
from shardwise.errors import Violation
from shardwise.models import build_model
from shardwise.models.feed_forward import GELUMLP, SwiGLU
from shardwise.parallel.activation_checkpoint import apply_activation_checkpointing
from shardwise.parallel.tiling import TiledGELUMLP, TiledSwiGLU, apply_linear_tiles
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.shapes import ModelShape
from shardwise.train.memory_meter import ActivationMeter, PeakActivationMeter

RTOL = 1e-5
PRESETS = {"llama": {"preset": "tiny", "vocab_size": 512}, "gpt": {"preset": "tiny-gpt", "vocab_size": 512}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _model(arch: str):
    model = build_model(build_config({"model": PRESETS[arch]}).model)
    model.init_weights(seed=0)
    return model


def _run(model, tokens, autocast: bool = False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def _max_grad_rel(tiled: dict, ref: dict) -> float:
    """Max over parameters of max |d| / max |reference|, the reference floored at 1e-4 of the largest
    gradient: gpt's key biases get a gradient that is zero in exact arithmetic (softmax is invariant to
    a shift of every score), so theirs is rounding noise (~1e-12 against ~1e-2) in both runs; every other
    gradient of the tiny models is above the floor (>= 3e-4 of the largest), so it changes nothing there."""
    floor = 1e-4 * max(g.abs().max().item() for g in ref.values())
    return max((tiled[name] - g).abs().max().item() / max(g.abs().max().item(), floor) for name, g in ref.items())


@pytest.mark.parametrize("arch", ["llama", "gpt"])
@pytest.mark.parametrize("tiles", [2, 3, 4])  # 3: 192 / 3 is even, 190 below is not
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_tiled_model_matches_untiled(arch, tiles, recompute):
    ref = _model(arch)
    tiled = copy.deepcopy(ref)
    assert apply_linear_tiles(tiled, tiles) == 2  # the tiny presets have 2 blocks
    for m in (ref, tiled):
        apply_activation_checkpointing(m, recompute, "op", 1)
    # names and the state dict are those of the untiled model (checkpoint wrappers aside, both alike)
    assert list(tiled.state_dict()) == list(ref.state_dict())
    tokens = torch.randint(0, 512, (2, 16))
    out_ref, g_ref = _run(ref, tokens)
    out, g = _run(tiled, tokens)
    assert _rel(out, out_ref) <= RTOL
    assert g.keys() == g_ref.keys() and _max_grad_rel(g, g_ref) <= RTOL


@pytest.mark.parametrize("cls,tiled_cls", [(SwiGLU, TiledSwiGLU), (GELUMLP, TiledGELUMLP)])
@pytest.mark.parametrize("tiles", [3, 7])
def test_uneven_hidden_dim_and_input_gradient(cls, tiled_cls, tiles):
    """ffn 190 over 3 or 7 tiles (tensor_split: uneven tiles), gradients of x and every weight."""
    torch.manual_seed(1)
    ref = cls(32, 190)
    tiled = copy.deepcopy(ref)
    apply_linear_tiles(tiled, tiles)
    assert type(tiled) is tiled_cls and tiled.tiles == tiles
    x = torch.randn(3, 5, 32, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 32)
    y, yt = ref(x), tiled(xt)
    y.backward(g)
    yt.backward(g)
    assert _rel(yt, y) <= RTOL and _rel(xt.grad, x.grad) <= RTOL
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        assert p.grad.shape == q.shape and p.grad.is_contiguous(), name
        assert _rel(p.grad, q.grad) <= RTOL, name


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_bf16_autocast(arch):
    """Under torch.autocast(cpu, bf16) the tiles compute in bf16 like the untiled linears (the output is
    bf16), gradients come back fp32 in the parameters' dtype, and the error against fp32 is bf16's,
    no worse than the untiled model's own."""
    ref = _model(arch)
    tiled = copy.deepcopy(ref)
    apply_linear_tiles(tiled, 4)
    tokens = torch.randint(0, 512, (2, 16))
    exact, g_exact = _run(copy.deepcopy(ref), tokens)
    out_ref, g_ref = _run(ref, tokens, autocast=True)
    out, g = _run(tiled, tokens, autocast=True)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    assert all(grad.dtype == torch.float32 for grad in g.values())
    err_ref, err = _rel(out_ref, exact), _rel(out, exact)
    assert err <= 2 * err_ref + 1e-3, (err, err_ref)
    assert _max_grad_rel(g, g_exact) <= 2 * _max_grad_rel(g_ref, g_exact) + 1e-3
    assert _rel(out, out_ref) <= 2e-2 and _max_grad_rel(g, g_ref) <= 5e-2


def test_one_tile_changes_nothing():
    model = _model("llama")
    before = {name: type(m) for name, m in model.named_modules()}
    assert apply_linear_tiles(model, 1) == 0
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert type(model.layers[0].feed_forward) is SwiGLU and not hasattr(model.layers[0].feed_forward, "tiles")
    with pytest.raises(ValueError):
        apply_linear_tiles(model, 0)


def _block_mlp_saved(mlp, x) -> int:
    with ActivationMeter(exclude=mlp) as meter:
        mlp(x)
    return meter.bytes


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_saved_bytes_closed_form(arch):
    """One block's MLP saves x (n x dim) and 4 (SwiGLU: w1 x, silu, w3 x, product) or 2 (GELU: fc x, gelu)
    n x ffn tensors untiled; tiled, x alone. n = 2 x 16 tokens, dim 64, ffn 192 (llama) / 256 (gpt), fp32."""
    model = _model(arch)
    mlp = model.layers[0].feed_forward if arch == "llama" else model.layers[0].mlp
    n, dim, ffn = 32, model.cfg.dim, model.cfg.ffn_dim
    x = torch.randn(2, 16, dim, requires_grad=True)
    wide = 4 if arch == "llama" else 2
    assert _block_mlp_saved(mlp, x) == 4 * (n * dim + wide * n * ffn)  # llama 106496, gpt 73728
    apply_linear_tiles(mlp, 4)
    assert _block_mlp_saved(mlp, x) == 4 * n * dim  # 8192


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_measured_peak_activations_drop(arch):
    """The whole tiny model's peak of saved activations (PeakActivationMeter: every storage autograd holds
    for backward at once) drops by n_layers x the MLPs' ffn-wide tensors: x is saved by the norm anyway."""
    ref = _model(arch)
    tiled = copy.deepcopy(ref)
    apply_linear_tiles(tiled, 4)
    tokens = torch.randint(0, 512, (2, 16))
    peaks = []
    for model in (ref, tiled):
        with PeakActivationMeter(exclude=model) as meter:
            model(tokens).sum().backward()
        peaks.append(meter.peak)
    wide = 4 if arch == "llama" else 2
    assert peaks[0] - peaks[1] == ref.cfg.n_layers * wide * 32 * ref.cfg.ffn_dim * 4, peaks
    print(f"{arch}: peak saved activations {peaks[0]} -> {peaks[1]} bytes")


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_selective_op_recompute_does_not_cache_the_tiles(arch, monkeypatch):
    """Under selective "op" recomputation the checkpoint caches matmul outputs (parallel/activation_checkpoint.py);
    inside a tiled MLP it must not (the block's tiling.UncachedRegion), or every tile's ffn-wide GEMM outputs come back.
    Counted from the policy's decisions in forward: the MLP's 3 (SwiGLU) / 2 (GELU) cached GEMM outputs
    per block are gone (4 tiles would cache 12 / 8 without the check). The cost: the block's replay
    reruns the tiled forward on top of the Function's own recomputation, counted in aten.mm calls."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy

    from shardwise.parallel import activation_checkpoint

    class MatmulCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket] += 1
            return func(*args, **(kwargs or {}))

    policy, cached = activation_checkpoint._save_matmuls, Counter()

    def counting(scope, ctx, op, *args, **kwargs):
        decision = policy(scope, ctx, op, *args, **kwargs)
        cached[tiles] += not ctx.is_recompute and decision == CheckpointPolicy.MUST_SAVE
        return decision

    monkeypatch.setattr(activation_checkpoint, "_save_matmuls", counting)
    ref = _model(arch)
    tokens = torch.randint(0, 512, (2, 16))
    mms = {}
    for tiles in (1, 4):
        model = copy.deepcopy(ref)
        apply_linear_tiles(model, tiles)
        apply_activation_checkpointing(model, "selective", "op", 1)
        loss = model(tokens).sum()
        with MatmulCount() as count:
            loss.backward()
        mms[tiles] = count.calls[torch.ops.aten.mm] + count.calls[torch.ops.aten.addmm]
    mlp_gemms = 3 if arch == "llama" else 2
    assert cached[1] - cached[4] == ref.cfg.n_layers * mlp_gemms, cached
    # backward GEMMs per block: untiled the MLP's backward (llama 6, gpt 4); tiled, per tile, the replayed
    # forward (3 / 2), the Function's recomputation (2 / 1) and the same backward GEMMs (6 / 4)
    replay, recompute, bwd = (3, 2, 6) if arch == "llama" else (2, 1, 4)
    assert mms[4] - mms[1] == ref.cfg.n_layers * (4 * (replay + recompute + bwd) - bwd), mms


def test_compile_aot_eager():
    """train.compile traces the tiled MLP's Function (parallel/compile.py, aot_eager: no code generation)."""
    from shardwise.parallel.compile import apply_compile

    ref = _model("llama")
    tiled = copy.deepcopy(ref)
    apply_linear_tiles(tiled, 3)
    eager = copy.deepcopy(tiled)
    apply_compile(tiled, "aot_eager")
    tokens = torch.randint(0, 512, (2, 16))
    out_e, g_e = _run(eager, tokens)
    out, g = _run(tiled, tokens)
    out_ref, g_ref = _run(ref, tokens)
    assert _rel(out, out_e) <= RTOL and _max_grad_rel(g, g_e) <= RTOL
    assert _rel(out, out_ref) <= RTOL and _max_grad_rel(g, g_ref) <= RTOL


def _tiles_layout(tiles: int, **kw) -> Layout:
    return Layout(linear_tiles=tiles, **kw)


def _violations(model: dict, lay: Layout, precision: str | None = None) -> list[Violation]:
    shape = ModelShape.from_config(build_config({"model": model}).model)
    return list(rules.linear_tiles_rules(shape, lay, precision))


def test_rules():
    tiny = PRESETS["llama"]
    assert _violations(tiny, _tiles_layout(1, tp=2), "fp8") == []  # tiles 1: nothing to check
    assert _violations(tiny, _tiles_layout(192)) == []
    too_many = _violations(tiny, _tiles_layout(193))
    assert [v.field for v in too_many] == ["parallel.linear_tiles"] and "ffn_dim=192" in too_many[0].problem
    assert not too_many[0].trainer_only
    for lay, model, precision, phrase in [(_tiles_layout(2, tp=2), tiny, "bf16", "tp=2"),
                                          (_tiles_layout(2), tiny, "fp8", "fp8"),
                                          (_tiles_layout(2), {"preset": "tiny-moe"}, "bf16", "MoE")]:
        (v,) = _violations(model, lay, precision)
        assert phrase in v.problem and "not implemented yet" in v.problem and v.fix and v.trainer_only
    assert _violations(tiny, _tiles_layout(2), None) == []  # precision unknown (the planner): no fp8 rule
    assert _violations(tiny, _tiles_layout(0))[0].problem == "must be >= 1, got 0"


@pytest.mark.parametrize("args,phrase", [
    (["--parallel.linear_tiles=0"], "must be >= 1"),
    (["--parallel.linear_tiles=193"], "model.ffn_dim=192"),
    (["--parallel.linear_tiles=2", "--parallel.tp=2", "--nproc", "2"], "tp=2 is not implemented yet"),
    (["--parallel.linear_tiles=2", "--train.precision=fp8"], "fp8\" is not implemented yet"),
    (["--parallel.linear_tiles=2", "--model.preset=tiny-moe"], "MoE model"),
], ids=["zero", "more_than_ffn", "tp", "fp8", "moe"])
def test_cli_refuses_before_spawning(args, phrase, capsys, tmp_path):
    code = main(["train", *args, f"--data.cache_dir={tmp_path}", f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: parallel.linear_tiles:") and phrase in err and "fix:" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_trainer_losses_match(tmp_path):
    """A whole single-process Trainer run (parallelize() applies the tiles) with linear_tiles=4 gives the
    losses of linear_tiles=1 within 1e-5 relative, and the same parameter names."""
    from shardwise.train.trainer import Trainer

    (tmp_path / "corpus.txt").write_text("memory-centric tiling of the feed-forward blocks " * 200)

    def train(tiles: int) -> tuple[list[float], list[str]]:
        cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=512", "--data.tokenizer=byte",
                                 f"--data.path={tmp_path / 'corpus.txt'}", f"--data.cache_dir={tmp_path / 'cache'}",
                                 "--train.seq_len=16", "--train.global_batch=4", "--train.micro_batch=4",
                                 "--train.steps=4", "--train.log_every=1", f"--run.dir={tmp_path / f'run{tiles}'}",
                                 "--run.progress=false", "--run.tensorboard=false", "--checkpoint.final=false",
                                 "--checkpoint.resume=false", f"--parallel.linear_tiles={tiles}"])
        trainer = Trainer(cfg, log=None, single_process=True)
        tiled = [m for m in trainer.inner.modules() if isinstance(m, TiledSwiGLU)]
        assert len(tiled) == (2 if tiles > 1 else 0)
        names = [name for name, _ in trainer.inner.named_parameters()]
        return trainer.train(), names

    ref, ref_names = train(1)
    losses, names = train(4)
    assert names == ref_names and len(losses) == len(ref) == 4
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    print(f"trainer, 4 steps: losses {losses}, max rel |dloss| vs linear_tiles=1 {worst:.1e}")
    assert worst <= RTOL, (losses, ref)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run4" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 4
