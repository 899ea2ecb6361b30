"""How the generation engine compiles its steps (infer/engine.py compile_settings): the GPU's choice is
one a CPU run never exercises, so it is tested here as a decision."""
from __future__ import annotations

from shardwise.infer.engine import compile_settings


def test_gpu_steps_are_cuda_graphs_with_combo_kernels_and_a_cpu_keeps_inductors_defaults():
    # One CUDA graph replay per step (what mode "reduce-overhead" sets), and combo kernels: 1.087x on an H200.
    assert compile_settings("cuda") == {"options": {"triton.cudagraphs": True, "combo_kernels": True}}
    assert compile_settings("cpu") == {}
    # decode.py --compile-mode / --compare-mode: a mode asked for is used as it is, on any device.
    assert compile_settings("cuda", "max-autotune") == {"mode": "max-autotune"}
    assert compile_settings("cpu", "reduce-overhead") == {"mode": "reduce-overhead"}
    # Inductor options (decode.py "k=v,k=v"): on a GPU over CUDA graphs, which a mode and options cannot both say.
    assert compile_settings("cuda", {"combo_kernels": True}) == {"options": {"triton.cudagraphs": True, "combo_kernels": True}}
    assert compile_settings("cpu", {"combo_kernels": True}) == {"options": {"combo_kernels": True}}
    # decode.py --compare-mode combo_kernels=0: the engine without them, against the default, in one run.
    assert compile_settings("cuda", {"combo_kernels": False}) == {"options": {"triton.cudagraphs": True,
                                                                             "combo_kernels": False}}


def test_the_gpu_options_are_ones_this_torch_has():
    """A renamed inductor option would fail only on a GPU, at the first compile: check the names here."""
    from torch._inductor import config as inductor_config

    for key, _ in compile_settings("cuda")["options"].items():
        node = inductor_config
        for part in key.split("."):
            assert hasattr(node, part), key
            node = getattr(node, part)
