"""infer/engine.py serving_tf32: which fp32-matmul precision an engine asks for. Decided on CPU: the GPU's
setting is torch's process-wide switch, recorded here instead of applied."""
from __future__ import annotations

import torch

from shardwise.config import load_config
from shardwise.infer import engine as E
from shardwise.parallel.precision import set_matmul_precision


def test_16_bit_engines_allow_tf32_and_fp32_ones_keep_full_precision(monkeypatch):
    asked: list[tuple[bool, str]] = []
    monkeypatch.setattr(E, "set_matmul_precision", lambda tf32, device: asked.append((tf32, device.type)))
    cfg = load_config(None, ["--model.preset=tiny", "--model.vocab_size=512", "--data.tokenizer=byte"])
    for dtype in ("float32", "bfloat16", "float16"):
        E.Engine(cfg, torch.device("cpu"), dtype)
    assert asked == [(False, "cpu"), (True, "cpu"), (True, "cpu")]
    set_to: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", set_to.append)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)  # restored after
    for dtype in ("bfloat16", "float32"):
        set_matmul_precision(E.serving_tf32(dtype), torch.device("cuda"))
    set_matmul_precision(True, torch.device("cpu"))  # a CPU engine leaves the switch alone
    assert set_to == ["high", "highest"]
