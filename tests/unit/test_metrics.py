"""train/metrics.py: docs/architecture.md §5 formulas, per-category memory, activation meter, rank-0 logger."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardwise.train.memory_meter import ActivationMeter, PeakActivationMeter, memory_by_category, tensor_bytes
from shardwise.train.metrics import MetricsLogger, mfu, plot_loss_curve, read_metrics, tokens_per_s_per_device


# ---- formulas ----
def test_tokens_per_s_per_device():
    # 8192 tokens on one data-parallel replica in 2 s, shared by tp=2 x pp=2 devices -> 1024 tok/s/device
    assert tokens_per_s_per_device(8192, 2.0, 4) == 1024.0
    assert tokens_per_s_per_device(1000, 0.5, 1) == 2000.0
    with pytest.raises(ValueError):
        tokens_per_s_per_device(1, 0.0, 1)


def test_mfu_hand_numbers():
    # A 1B-parameter model at 6N = 6e9 FLOP/token, 3000 tok/s per H100 (989.4 TFLOP/s bf16 dense):
    # 6e9 * 3000 / 989.4e12 = 0.018193...
    assert mfu(6e9, 3000.0, 989.4e12) == pytest.approx(0.0181928, rel=1e-5)
    assert mfu(100.0, 10.0, 1000.0) == 1.0
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


# ---- memory ----
def test_tensor_bytes_dedupes_views_of_one_storage():
    t = torch.zeros(4, 8)
    assert tensor_bytes([t, t[0], t.view(-1), t.t(), t]) == 4 * 8 * 4
    assert tensor_bytes([t, torch.zeros(3, dtype=torch.bfloat16)]) == 128 + 6
    # A view keeps its whole storage alive, so it counts the storage, not the slice.
    assert tensor_bytes([t[1:2]]) == 128


def test_tensor_bytes_meta_counts_without_dedupe():
    m = torch.empty(10, device="meta")
    assert tensor_bytes([m, torch.empty(5, device="meta")]) == 60


def test_memory_by_category_adamw_after_one_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    numel = sum(p.numel() for p in model.parameters())  # 16*32+32 + 32*4+4 = 676
    opt = torch.optim.AdamW(model.parameters())
    assert memory_by_category(model, opt)["grads"] == 0 and memory_by_category(model, opt)["optimizer"] == 0
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    mem = memory_by_category(model, opt)
    assert mem["params"] == 4 * numel == 2704
    assert mem["grads"] == 4 * numel
    # exp_avg + exp_avg_sq (fp32, numel each) + one fp32 scalar `step` tensor per parameter tensor.
    assert mem["optimizer"] == 2 * 4 * numel + 4 * len(list(model.parameters()))
    assert mem["buffers"] == 0
    assert memory_by_category(model, None)["optimizer"] == 0


def test_memory_counts_tied_parameters_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleList([emb, head])
    assert memory_by_category(model, None)["params"] == 10 * 4 * 4


# ---- activations ----
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_activation_meter_mlp_by_hand():
    """Linear(16,32) -> ReLU -> Linear(32,4) on x of shape (8,16), fp32, x without grad:
    - Linear1 = addmm(b1, x, W1.t()) saves x for dW1 (W1.t() is saved only when x needs a grad);
    - ReLU saves its output h (threshold_backward uses the result): 8*32 floats;
    - Linear2 saves h again (same storage, counted once) for dW2 and W2.t() for dh (a parameter).
    So 4 * (8*16 + 8*32) = 1536 bytes."""
    model = _mlp()
    x = torch.randn(8, 16)
    with ActivationMeter(exclude=model.parameters()) as meter:
        model(x)
    assert meter.bytes == 4 * (8 * 16 + 8 * 32) == 1536
    with ActivationMeter(exclude=model) as meter:  # the module form: same count
        model(x)
    assert meter.bytes == 1536


def test_activation_meter_counts_a_functional_collectives_result_once():
    """A DTensor redistribution (the sequence-parallel embedding's reduce-scatter) hands back an
    AsyncCollectiveTensor, a wrapper with no storage of its own: counted by size, the first block's norm,
    which saves its input twice (pow and mul), counted it twice (the TP validation rows' -1.6%)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    x = AsyncCollectiveTensor(torch.randn(8, 16, requires_grad=True))
    with ActivationMeter() as meter:
        x.pow(2).mean(-1, keepdim=True).rsqrt() * x
    assert meter.bytes == 4 * (8 * 16 + 8)  # x once, and rsqrt


def test_activation_meter_excludes_parameters_and_dedupes_views():
    model = _mlp()
    x = torch.randn(8, 16, requires_grad=True)  # now W1.t() is saved too (for dx)
    with ActivationMeter(exclude=model) as meter:
        model(x)
    assert meter.bytes == 1536
    with ActivationMeter() as meter:  # no exclusion: W1 (16*32) and W2 (32*4) storages appear
        model(x)
    assert meter.bytes == 1536 + 4 * (16 * 32 + 32 * 4)
    # 3-D input: Linear flattens to (16,16) / (16,32) views; ReLU's (2,8,32) output and Linear2's
    # (16,32) view of it share one storage.
    with ActivationMeter(exclude=model) as meter:
        model(torch.randn(2, 8, 16))
    assert meter.bytes == 4 * (2 * 8 * 16 + 2 * 8 * 32)


def test_activation_meter_restores_autograd():
    model = _mlp()
    with ActivationMeter(exclude=model) as meter:
        loss = model(torch.randn(8, 16)).pow(2).sum()  # pow saves its input: 8*4 floats more
    loss.backward()  # hooks unpack transparently
    assert meter.bytes == 1536 + 4 * 8 * 4
    assert all(p.grad is not None for p in model.parameters())


def test_activation_meter_does_not_leak_saved_outputs():
    """ReLU saves its output; packing the tensor itself would keep its graph alive forever."""
    import gc
    import weakref

    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter() as meter:
        out = torch.relu(x)
        loss = out.sum()
    ref = weakref.ref(out)
    del out, loss
    gc.collect()
    assert meter.bytes == 4 * 8 * 16 and ref() is None


def test_peak_activation_meter_counts_what_is_alive_at_once():
    """1F1B-like order F0 F1 B0 F2 B1 B2: at most two micro-batches' 1536 bytes are alive at once;
    every saved storage is released by its backward. The unique total is still counted in `bytes`."""
    model = _mlp()
    with PeakActivationMeter(exclude=model) as meter:
        losses = {i: model(torch.randn(8, 16)).sum() for i in (0, 1)}
        assert meter.live == meter.peak == 2 * 1536
        losses.pop(0).backward()
        assert meter.live == 1536
        losses[2] = model(torch.randn(8, 16)).sum()
        losses.pop(1).backward()
        losses.pop(2).backward()
    assert meter.peak == 2 * 1536
    assert meter.live == 0
    # `bytes` dedupes by address over the whole run: a storage of F2 may reuse a freed one's address
    assert 2 * 1536 <= meter.bytes <= 3 * 1536
    assert all(p.grad is not None for p in model.parameters())


def test_peak_activation_meter_frees_a_dropped_graph_and_gpipe_order():
    model = _mlp()
    with PeakActivationMeter(exclude=model) as meter:
        loss = model(torch.randn(8, 16)).sum()
        del loss  # the graph is freed without backward: its saved tensors are released
        assert meter.live == 0
        losses = [model(torch.randn(8, 16)).sum() for _ in range(4)]  # GPipe: every forward first
        for loss in losses:
            loss.backward()
        del losses, loss
    assert meter.peak == 4 * 1536 and meter.live == 0


def test_peak_activation_meter_under_checkpoint_sees_only_the_saved_input():
    """Non-reentrant checkpointing packs the region's tensors with its own (inner) hooks, and its
    backward recomputation too: the meter sees the input the checkpoint saves (8 x 16 fp32), also at
    its peak, so the recompute working set is not part of the number."""
    from torch.utils.checkpoint import checkpoint

    model = _mlp()
    x = torch.randn(8, 16)
    with PeakActivationMeter(exclude=model) as meter:
        loss = checkpoint(model, x, use_reentrant=False).sum()
        loss.backward()
    assert meter.peak == 4 * 8 * 16
    assert meter.live == 0


# ---- logger ----
def test_metrics_logger_writes_jsonl_tensorboard_and_png(tmp_path):
    run = tmp_path / "run_a"
    logger = MetricsLogger(run, total_steps=30, start_step=0, is_writer=True, progress=False, tensorboard=True)
    for step in (10, 20, 30):
        logger.log(step, {"loss": 5.0 - step / 10, "lr": 1e-3 * step / 30, "mfu": torch.tensor(0.25)})
        logger.progress(step, 1.0, 100.0)  # progress=False: no output, no error
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # flushed per line, before close
    assert json.loads(lines[0]) == {"step": 10, "loss": 4.0, "lr": pytest.approx(1e-3 / 3), "mfu": 0.25}
    logger.close()
    logger.close()  # idempotent
    assert list((run / "tensorboard").glob("events.out.tfevents*"))
    png = run / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_non_writer_logger_writes_nothing(tmp_path, capsys):
    run = tmp_path / "rank1"
    logger = MetricsLogger(run, 10, 0, is_writer=False, progress=True, tensorboard=True)
    logger.log(1, {"loss": 1.0})
    logger.progress(1, 1.0, 1.0)
    logger.print("hello")
    logger.close()
    assert not run.exists()
    assert capsys.readouterr().out == ""


def test_plain_progress_lines_without_tty(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=20, start_step=0, is_writer=True, progress=True, tensorboard=False)
    logger.print("model: [tiny] text with brackets")
    for step in range(1, 21):
        logger.progress(step, 2.5, 1234.0)
    logger.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "model: [tiny] text with brackets"
    status = [line for line in out if line.startswith("step ")]
    assert 10 <= len(status) <= 12  # the first step, then every 10%
    assert status[-1].startswith("step 20/20 (100%) | loss 2.5000 | 1,234 tok/s")
    assert "eta 0:00:00" in status[-1]


def test_the_eta_leaves_the_slow_first_step_out(tmp_path, capsys, monkeypatch):
    """A first step 10x the others (compilation, warm-up) does not count in the ETA: after step 1 it is
    unknown, after step 2 it is the remaining steps at the later steps' pace."""
    clock = iter([0.0, 10.0, 11.0, 12.0])  # the logger's start, then the end of steps 1, 2, 3
    monkeypatch.setattr("shardwise.train.metrics.time.perf_counter", lambda: next(clock))
    logger = MetricsLogger(tmp_path, total_steps=3, start_step=0, is_writer=True, progress=True, tensorboard=False)
    for step in (1, 2, 3):
        logger.progress(step, 2.5, 1.0)
    logger.close()
    status = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert status[0].endswith("eta -:--:--") and status[1].endswith("eta 0:00:01"), status


def test_read_metrics_keeps_last_record_per_step_and_skips_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'
                    '{"step": 2, "loss": 2.4}\n{"step": 3, "lo')  # resumed at 1, crashed mid-line
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 3.0), (2, 2.4)]
    out = tmp_path / "plots" / "curve.png"
    plot_loss_curve(path, out)
    assert out.stat().st_size > 1000


def test_the_loss_picture_starts_at_step_one(monkeypatch, tmp_path):
    """Issue 62: loss_curve.png started at step train.log_every (metrics.jsonl records logged steps only), so a
    short run's first loss was missing. The logger keeps step 1's loss and the picture draws it first;
    metrics.jsonl keeps its records of logged steps; a resumed run (its step 1 long done) adds nothing."""
    import json

    from shardwise.train import metrics
    from shardwise.train.metrics import loss_points

    drawn = {}
    monkeypatch.setattr(metrics, "plot_loss_curve", lambda jsonl, png, first=None: drawn.update(
        points=loss_points(read_metrics(jsonl), first)))
    logger = MetricsLogger(tmp_path / "run", total_steps=4, start_step=0, is_writer=True, progress=False,
                           tensorboard=False)
    for step, loss in ((1, 9.5), (2, 8.0), (3, 7.0), (4, 6.0)):
        logger.progress(step, loss, 1.0)
        if step % 2 == 0:
            logger.log(step, {"loss": loss})
    logger.close()
    assert drawn["points"] == [(1, 9.5), (2, 8.0), (4, 6.0)]
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    resumed = MetricsLogger(tmp_path / "run", total_steps=6, start_step=4, is_writer=True, progress=False,
                            tensorboard=False)
    resumed.progress(5, 5.0, 1.0)
    resumed.log(6, {"loss": 4.0})
    resumed.close()
    assert drawn["points"] == [(2, 8.0), (4, 6.0), (6, 4.0)]
    assert loss_points([{"step": 1, "loss": 3.0}], 9.0) == [(1, 3.0)] and loss_points([], float("nan")) == []


def test_energy_meter_from_a_counter(monkeypatch, tmp_path, capsys):
    """train/power.py: joules between logging steps from NVML's energy counter (a fake one here: no GPU),
    as watts, J per trained token and a running kWh total, in metrics.jsonl and in the end-of-run
    summary line; nothing without a reading."""
    import json

    import torch

    from shardwise.config import load_config
    from shardwise.train import power, step_log
    from shardwise.train.trainer import Trainer

    meter = power.EnergyMeter(iter([1000.0, 1600.0, 2800.0, 2800.0, 2800.0, 3400.0]).__next__)
    first = meter.interval(tokens=300, seconds=2.0)
    assert first == {"power_w": 300.0, "energy_j_per_token": 2.0, "energy_kwh": 600 / 3.6e6}
    second = meter.interval(tokens=600, seconds=4.0)
    assert second["energy_j_per_token"] == 2.0 and second["energy_kwh"] == 1800 / 3.6e6
    # A counter that stood still (NVML updates it in steps) gives no figure; the next move covers the span.
    assert meter.interval(tokens=100, seconds=1.0) == {"energy_kwh": 1800 / 3.6e6}
    assert meter.interval(tokens=100, seconds=1.0) == {"energy_kwh": 1800 / 3.6e6}
    assert meter.interval(tokens=100, seconds=1.0) == {"power_w": 200.0, "energy_j_per_token": 2.0,
                                                      "energy_kwh": 2400 / 3.6e6}
    assert power.EnergyMeter(None).interval(10, 1.0) == {} and not power.EnergyMeter(None).enabled
    assert power.nvml_energy_reader(torch.device("cpu")) is None

    counter = iter(range(0, 10**6, 50))  # 50 J per reading
    monkeypatch.setattr(step_log, "nvml_energy_reader", lambda device: lambda: float(next(counter)))
    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=512", "--data.tokenizer=byte",
                             f"--data.path={tmp_path / 'corpus.txt'}", f"--data.cache_dir={tmp_path / 'cache'}",
                             "--train.seq_len=16", "--train.global_batch=4", "--train.micro_batch=4", "--train.steps=4",
                             "--train.log_every=2", f"--run.dir={tmp_path / 'run'}", "--run.progress=false",
                             "--run.tensorboard=false", "--checkpoint.final=false", "--checkpoint.resume=false"])
    (tmp_path / "corpus.txt").write_text("energy per token " * 200)
    Trainer(cfg, log=print, single_process=True).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:  # 50 J per logging interval of 2 steps x 64 tokens
        assert r["energy_j_per_token"] == 50 / 128 and r["power_w"] > 0
    assert records[-1]["energy_kwh"] == 100 / 3.6e6
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "done: 4 steps, 256 tokens in" in done[0] and "tokens/s;" in done[0]
    assert "MFU" not in done[0]  # a CPU's measured peak varies between runs: no MFU to compare
    assert f"GPU energy {100 / 3.6e6:.3g} kWh, {100 / 256:.3g} J/token (all GPUs)" in done[0]


def test_start_up_peak_reads_in_its_own_unit():
    from shardwise.train.peak_flops import device_peak_flops
    from shardwise.train.step_log import _flops

    assert _flops(989.4e12) == "989.4 TFLOP/s" and _flops(176.9e9) == "176.9 GFLOP/s"  # was "989400.0 GFLOP/s"
    flops, label = device_peak_flops("cuda", "bf16", cuda_name="NVIDIA H100 80GB HBM3")
    assert _flops(flops) == "989.4 TFLOP/s" and label == "h100-sxm-80gb datasheet dense bf16 peak, NVIDIA H100 80GB HBM3"


def test_no_loss_curve_when_turned_off(tmp_path):
    """run.loss_curve = false: the run ends without drawing (0.4 s a run; the parity matrix draws none)."""
    logger = MetricsLogger(tmp_path, 2, 0, is_writer=True, progress=False, tensorboard=False, loss_curve=False)
    logger.log(1, {"loss": 5.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "loss_curve.png").exists()
