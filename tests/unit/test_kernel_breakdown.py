"""benchmarks/kernel_breakdown.py: a step's GPU kernels by class, from a torch.profiler Chrome trace. CI has no
GPU, so the traces here are built by hand in the format torch.profiler writes (kernel events linked to the
operator that launched them by "External id", GPU ranges of record_function as gpu_user_annotation), with
the kernel names inductor and cuBLAS gave on the H100 (../shared/gpu/h100-2026-11-25/trace_*.json.gz) and
the names inductor gives torchao's FP8 casts (seen compiling a Float8Linear block on this CPU)."""
from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_breakdown as kb  # noqa: E402


@pytest.mark.parametrize("name, op, around, kind", [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "aten::mm", "", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "", "", "gemm fp8"),
    ("nvjet_sm90_ootst_128x256", "aten::_scaled_mm", "", "gemm fp8"),  # the op decides where the name does not
    ("Memset (Device)", "aten::mm", "", "gemm"),  # cuBLAS's workspace clearing is the GEMM's
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "aten::_cudnn_attention_backward", "",
     "attention"),
    ("triton_red_fused_abs_max_3", "triton_red_fused_abs_max_3", "", "fp8 scale+cast"),
    ("triton_poi_fused__to_copy_clamp_div_mul_reciprocal_4", "", "", "fp8 scale+cast"),
    # a norm inductor fused with the amax and the cast of its output (cpp_* is the CPU's name for the same)
    ("cpp_fused__to_copy_abs_add_clamp_div_max_mean_mul_pow_reciprocal_rsqrt_t_view_0", "", "", "fp8 scale+cast"),
    ("triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_5", "", "", "norm"),
    ("triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_8", "", "", "norm"),
    ("void at::native::elementwise_kernel<128, 2, sub>", "aten::sub", "_ChunkedCrossEntropyBackward", "loss"),
    ("triton_red_fused_logsumexp_2", "", "", "loss"),
    ("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", "aten::_fused_adamw_", "", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, mul>", "aten::mul", "Optimizer.step#AdamW.step", "optimizer"),
    ("triton_poi_fused__to_copy_t_6", "", "", "copy"),
    ("triton_poi_fused__to_copy__unsafe_view_add_cat_mul_neg_split_transpose_view_3", "", "", "pointwise"),  # RoPE
    ("triton_poi_fused__unsafe_view_mul_silu_7", "", "", "pointwise"),
    ("Memcpy DtoD (Device -> Device)", "aten::copy_", "", "copy"),
    ("triton_red_fused_sum_1", "", "", "reduction"),
    ("void at::native::compute_grad_weight<float, long>", "aten::embedding_dense_backward", "", "other"),
])
def test_a_kernel_is_classed_by_its_name_its_operator_and_what_encloses_that(name, op, around, kind):
    assert kb.classify(name, op, around) == kind


def _kernel(name: str, ts: float, dur: float, ext: int, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"External id": ext, "stream": stream}}


def _op(name: str, ts: float, dur: float, ext: int | None = None, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {} if ext is None else {"External id": ext}}


def _trace(steps: int = 2) -> dict:
    """Two steps, each: a 100 us GEMM, a 30 us FP8 GEMM overlapping a 10 us amax on another stream, a loss
    kernel launched inside the chunked cross-entropy's backward (another host thread), an optimizer kernel
    inside the GPU range of Optimizer.step, then 20 us idle."""
    events = []
    for s in range(steps):
        t = 1000.0 + 200.0 * s
        e = 10 * s
        events += [_op("aten::mm", t - 5, 2, e + 1), _kernel("nvjet_sm90_tst_256x128", t, 100, e + 1),
                   _op("aten::_scaled_mm", t + 95, 2, e + 2), _kernel("nvjet_fp8", t + 100, 30, e + 2),
                   _op("triton_red_fused_abs_max_0", t + 96, 1, e + 3),
                   _kernel("triton_red_fused_abs_max_0", t + 110, 10, e + 3, stream=8),
                   _op("_ChunkedCrossEntropyBackward", t + 100, 30, tid=2),
                   _op("aten::mul", t + 110, 2, e + 4, tid=2), _kernel("elementwise_kernel<mul>", t + 130, 20, e + 4),
                   _op("aten::add", t + 120, 2, e + 5), _kernel("vectorized_elementwise_kernel<add>", t + 150, 30, e + 5),
                   _op("Optimizer.step#AdamW.step", t + 149, 32, cat="gpu_user_annotation")]
    return {"traceEvents": events, "shardwise_steps": str(steps)}


def test_breakdown_sums_each_class_per_step_and_counts_overlap_once_in_the_busy_time():
    got = kb.breakdown(_trace(), top=1)
    assert got["steps"] == 2
    ms = {k: v["ms"] for k, v in got["classes"].items()}
    assert ms == pytest.approx({"gemm": 0.1, "gemm fp8": 0.03, "fp8 scale+cast": 0.01, "loss": 0.02, "optimizer": 0.03})
    assert got["classes"]["gemm"]["top"] == [("nvjet_sm90_tst_256x128", pytest.approx(0.1))]
    assert got["busy_ms"] == pytest.approx(0.18)  # 100 + 30 (the amax runs under the FP8 GEMM) + 20 + 30
    assert got["wall_ms"] == pytest.approx((200 + 180) / 2 / 1e3)  # first kernel to last, per step
    assert got["idle_ms"] == pytest.approx(got["wall_ms"] - got["busy_ms"])


def test_a_window_keeps_only_the_kernels_inside_its_gpu_ranges():
    trace = _trace()
    got = kb.breakdown(trace, window="Optimizer.step#AdamW.step")
    assert list(got["classes"]) == ["optimizer"] and got["wall_ms"] == pytest.approx(0.032)
    with pytest.raises(ValueError, match="no GPU range named 'shardwise.decode'"):
        kb.breakdown(trace, window="shardwise.decode")


def test_the_step_count_comes_from_the_trace():
    trace = _trace(3)
    assert kb.steps_of(trace) == 3
    del trace["shardwise_steps"]
    assert kb.steps_of(trace) == 1  # nothing marks the steps: the whole trace is one
    trace["traceEvents"] += [_op(f"ProfilerStep#{i}", 0, 1, cat="user_annotation") for i in range(4)]
    assert kb.steps_of(trace) == 4


def test_the_table_puts_traces_side_by_side_with_their_difference(tmp_path, capsys):
    a, b = tmp_path / "bf16.json", tmp_path / "fp8.json.gz"
    trace = _trace()
    a.write_text(json.dumps(trace))
    for e in trace["traceEvents"]:
        if e.get("name") == "nvjet_sm90_tst_256x128":
            e["dur"] = 40.0
    with gzip.open(b, "wt") as f:
        json.dump(trace, f)
    assert kb.main([str(a), str(b), "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    gemm = next(line for line in out.splitlines() if re.match(r"gemm +\d", line))
    assert gemm.split()[1:4] == ["0.10", "0.04", "-0.06"], out
    assert set(json.loads((tmp_path / "out.json").read_text())) == {"bf16", "fp8"}
    with pytest.raises(SystemExit) as e:
        kb.main([str(tmp_path / "missing.json")])
    assert e.value.code == 2


# Run in a process of its own: torch.profiler leaves threads behind, and the test processes that later fork
# gloo worlds (tests/harness.py) must not have run multi-threaded work (a fork then can inherit a held lock).
_RECORD = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import kernel_breakdown as kb
from shardwise.config import load_config
from shardwise.infer.engine import Engine
from shardwise.infer.sampling import Sampler
engine = Engine(load_config(None, ["--model.preset=tiny", "--data.tokenizer=byte"]), torch.device("cpu"))
got = kb.record(lambda: engine.generate([[1, 2, 3]], 4, Sampler()), 2, __import__("pathlib").Path(sys.argv[1]),
                lambda: None, steps_per_call=3)
print(json.dumps({"steps": got["steps"], "classes": got["classes"]}))
"""


def test_record_writes_a_trace_with_its_step_count_and_the_engine_marks_its_phases(tmp_path):
    """On this CPU: the trace is written (gzip) with the steps in its metadata, and a generation's prefill and
    decode are the named ranges decode.py --profile selects on a GPU."""
    import subprocess

    from shardwise.infer.engine import DECODE_MARK, PREFILL_MARK

    path = tmp_path / "decode.json.gz"
    p = subprocess.run([sys.executable, "-c", _RECORD, str(path), str(ROOT / "benchmarks")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"steps": 6, "classes": {}}  # no kernels on a CPU
    trace = kb.load(path)
    assert int(trace["shardwise_steps"]) == 6  # the JSON value as written
    ranges = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert ranges.count(PREFILL_MARK) == 2 and ranges.count(DECODE_MARK) == 2, ranges


def test_a_trace_without_the_windows_gpu_range_is_counted_whole_and_says_so(tmp_path):
    """A benchmark must not lose its row to the profile: a trace with kernels but no GPU range of the window's
    name is counted whole, and says so."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    got = kb.summarize(path, window="shardwise.decode")
    assert "no GPU range named 'shardwise.decode'" in got["note"] and got["classes"]["gemm"]["ms"] > 0
    assert "note" not in kb.summarize(path)
