"""benchmarks/memory_peak.py: a step's peak in a CUDA memory snapshot and what made it up. CI has no GPU, so
the snapshots are built by hand in the format torch.cuda.memory._snapshot() has (device_traces of
alloc / free_requested events with frames, segments of blocks, external_annotations of the optimizer's
record_function ranges), as in ../shared/gpu/h100-2026-11-25/memsnap_*.json.gz."""
from __future__ import annotations

import gzip
import json
import pickle
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_peak as mp  # noqa: E402

MIB = 2**20


def _frames(line: int, name: str = "forward", path: str = "/x/src/shardwise/models/llama.py") -> list[dict]:
    return [{"name": "at::native::empty_cuda", "filename": "??", "line": 0},
            {"name": name, "filename": path, "line": line},
            {"name": "train_step", "filename": "/x/src/shardwise/train/trainer.py", "line": 198}]


def _snapshot(grads_kept_from_last_step: bool = False) -> dict:
    """100 MiB allocated before recording (parameters, optimizer state); two steps, each: activations of 300
    and 200 MiB, the loss's 50 MiB transient at the peak, then the backward frees the activations as it
    makes 80 MiB of gradients, the optimizer steps, zero_grad frees the gradients (set_to_none), unless
    `grads_kept_from_last_step` (accumulation: the gradients live on into the next step's forward)."""
    trace, t, addr = [], 0, 1000
    stamps = []

    def alloc(size_mib: int, frames: list[dict]) -> int:
        nonlocal t, addr
        t += 1
        addr += 1
        trace.append({"action": "alloc", "addr": addr, "size": size_mib * MIB, "time_us": t, "frames": frames})
        return addr

    def free(a: int) -> None:
        nonlocal t
        t += 1
        trace.append({"action": "free_requested", "addr": a, "size": 0, "time_us": t, "frames": []})

    grads: list[int] = []
    for _ in range(2):
        a1, a2 = alloc(300, _frames(24)), alloc(200, _frames(37))
        loss = alloc(50, _frames(59, "backward", "/x/src/shardwise/train/loss.py"))
        free(loss)
        free(a2)
        if not grads_kept_from_last_step:
            grads = []
        grads.append(alloc(80, _frames(12, "backward", "/x/torch/autograd/graph.py")) if not grads else grads[0])
        free(a1)
        t += 1
        stamps += [("START", "Optimizer.step#AdamW.step", t), ("END", "Optimizer.step#AdamW.step", t + 1)]
        t += 2
        if not grads_kept_from_last_step:
            free(grads[0])
        stamps += [("START", "Optimizer.zero_grad#AdamW.zero_grad", t + 1), ("END", "Optimizer.zero_grad#AdamW.zero_grad", t + 2)]
        t += 3
    alive_at_end = 100 * MIB + (80 * MIB if grads_kept_from_last_step else 0)
    return {"device_traces": [trace],
            "segments": [{"blocks": [{"size": alive_at_end, "state": "active_allocated"}, {"size": 7, "state": "inactive"}]}],
            "external_annotations": [{"stage": s, "name": n, "device": 0, "time_us": ts} for s, n, ts in stamps]}


def test_each_steps_peak_splits_into_what_was_there_gradients_and_activations():
    result = mp.analyse(_snapshot(), top=2)
    assert result["unseen_gib"] == pytest.approx(100 / 1024)
    assert [s["step"] for s in result["steps"]] == [1, 2]
    for step in result["steps"]:
        # the peak is at the loss: all activations and its transient, no gradient yet
        assert step["peak_gib"] == pytest.approx(650 / 1024)
        assert step["before_step_gib"] == pytest.approx(100 / 1024)
        assert step["kept_to_optimizer_gib"] == 0.0
        assert step["freed_before_optimizer_gib"] == pytest.approx(550 / 1024)
        assert step["top"] == [("models/llama.py:24 forward", pytest.approx(300 / 1024)),
                               ("models/llama.py:37 forward", pytest.approx(200 / 1024))]


def test_gradients_that_live_on_into_the_next_forward_count_at_its_peak():
    """Accumulation (or DDP's persistent buckets): the gradients made in step 1 are alive through step 2's
    peak; they were allocated before step 2, so they are part of what was there."""
    steps = mp.analyse(_snapshot(grads_kept_from_last_step=True))["steps"]
    assert steps[0]["peak_gib"] == pytest.approx(650 / 1024)
    assert steps[1]["peak_gib"] == pytest.approx(730 / 1024)
    assert steps[1]["before_step_gib"] == pytest.approx(180 / 1024)


def test_the_first_step_of_a_run_counts_the_parameters_it_allocates_as_kept():
    snap = _snapshot()
    trace = snap["device_traces"][0]
    trace.insert(0, {"action": "alloc", "addr": 1, "size": 40 * MIB, "time_us": 0, "frames": _frames(5, "materialize")})
    snap["segments"][0]["blocks"][0]["size"] += 40 * MIB
    first = mp.analyse(snap)["steps"][0]
    assert first["kept_to_optimizer_gib"] == pytest.approx(40 / 1024)
    assert first["peak_gib"] == pytest.approx(690 / 1024)


def test_it_reads_json_gzip_and_plain_pickles_and_refuses_a_pickle_that_names_code(tmp_path, capsys):
    snap = _snapshot()
    as_json, as_pickle, hostile = tmp_path / "s.json.gz", tmp_path / "s.pickle", tmp_path / "h.pickle"
    with gzip.open(as_json, "wt") as f:
        json.dump(snap, f)
    as_pickle.write_bytes(pickle.dumps(snap))  # torch.cuda.memory._dump_snapshot's format: a pickled dict
    hostile.write_bytes(pickle.dumps({"device_traces": [[Path("/etc")]]}))  # names pathlib.PosixPath
    for path in (as_json, as_pickle):
        assert mp.main([str(path), "--top", "1", "--json", str(tmp_path / "out.json")]) == 0
        out = capsys.readouterr().out
        assert "step 2: peak 0.63 GiB = before the step 0.10 + kept to the optimizer step 0.00" in out, out
        assert "0.293 GiB  models/llama.py:24 forward" in out
    assert mp.main([str(hostile)]) == 2
    assert "not a memory snapshot" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"device_traces": [[]], "segments": []}))
    assert mp.main([str(empty)]) == 2
    assert "no allocator history" in capsys.readouterr().err


def test_gpu_check_reports_each_training_rows_peak_split(tmp_path):
    """gpu-check's training rows record their first two steps' history; the report splits step 2's peak."""
    import gpu_report

    run = tmp_path / "run"
    (run / "memory_snapshot").mkdir(parents=True)
    (run / "memory_snapshot" / "rank_0_step_2.pickle").write_bytes(pickle.dumps(_snapshot()))
    split = gpu_report.peak_split(run)
    assert split == pytest.approx({"peak_before_step_gib": 100 / 1024, "peak_grads_gib": 0.0,
                                   "peak_activations_gib": 550 / 1024})
    assert gpu_report.peak_split(tmp_path / "no-history") == {}  # a CPU row: nothing recorded
    row = gpu_report.Row("train/eager/bf16/none", "pass", measured=split)
    header = {"device_name": "gpu", "when": "now", "torch": "2.x", "commit": "c", "steps": 8, "planner_gpu": None}
    assert "| train/eager/bf16/none | 0.63 | 0.10 | 0.00 | 0.54 |" in gpu_report.report_md([row], header)


def test_a_cpu_profilers_allocator_events_read_as_a_history():
    """torch.profiler(profile_memory=True) on a CPU: "[memory]" instants (Addr, Bytes > 0 allocated, < 0 freed)
    and the operators around them; from_profiler_trace makes the same split of them (benchmarks/peak_memory.py)."""
    def mem(ts, addr, size):
        return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "tid": 1, "ts": ts,
                "args": {"Addr": addr, "Bytes": size, "Total Allocated": 0}}

    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "tid": 1, "ts": ts, "dur": dur}

    events = [op("aten::mm", 0, 10), mem(1, 10, 300 * MIB), op("aten::linear", 0, 20), op("aten::mul", 12, 5),
              mem(13, 11, 200 * MIB), mem(30, 11, -200 * MIB), mem(31, 12, 80 * MIB), mem(32, 10, -300 * MIB),
              {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "tid": 1, "ts": 40, "dur": 5},
              mem(50, 12, -80 * MIB),
              {"ph": "X", "cat": "user_annotation", "name": "Optimizer.zero_grad#AdamW.zero_grad", "tid": 1, "ts": 49, "dur": 2}]
    snap = mp.from_profiler_trace({"traceEvents": events}, alive_before=100 * MIB)
    (step,) = mp.analyse(snap, top=2)["steps"]
    assert step["peak_gib"] == pytest.approx(600 / 1024)
    assert step["before_step_gib"] == pytest.approx(100 / 1024) and step["kept_to_optimizer_gib"] == 0.0
    assert step["top"] == [("aten::mm", pytest.approx(300 / 1024)), ("aten::mul", pytest.approx(200 / 1024))]


def test_a_history_that_cannot_be_read_leaves_the_row_without_its_split(tmp_path, capsys):
    import gpu_report

    (tmp_path / "memory_snapshot").mkdir()
    (tmp_path / "memory_snapshot" / "rank_0_step_2.pickle").write_bytes(b"not a pickle")
    assert gpu_report.peak_split(tmp_path) == {}
    assert "not split" in capsys.readouterr().err
