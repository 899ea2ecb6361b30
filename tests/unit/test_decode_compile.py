"""How the generation engine compiles its steps (infer/engine.py compile_settings): the GPU's choice is
one a CPU run never exercises, so it is tested here as a decision."""
from __future__ import annotations

from shardwise.infer.engine import compile_settings


def test_gpu_steps_are_cuda_graphs_and_a_cpu_keeps_inductors_defaults():
    assert compile_settings("cuda") == {"mode": "reduce-overhead"}  # one CUDA graph replay per step
    assert compile_settings("cpu") == {}
    # decode.py --compile-mode / --compare-mode: a mode asked for is used as it is, on any device.
    assert compile_settings("cuda", "max-autotune") == {"mode": "max-autotune"}
    assert compile_settings("cpu", "reduce-overhead") == {"mode": "reduce-overhead"}
    # Inductor options (decode.py "k=v,k=v"): on a GPU over CUDA graphs, which a mode and options cannot both say.
    assert compile_settings("cuda", {"combo_kernels": True}) == {"options": {"triton.cudagraphs": True, "combo_kernels": True}}
    assert compile_settings("cpu", {"combo_kernels": True}) == {"options": {"combo_kernels": True}}
