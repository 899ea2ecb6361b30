"""`shardwise bench-comm` without a process group: the nccl-tests formulas, sizes, the JSON file and what
the planner does with it (cluster.calibration, plan/calibration.py)."""
from __future__ import annotations

import json
import math

import pytest

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.launch.bench_comm import main, parse_sizes, plot, table
from shardwise.plan.calibration import SCHEMA, bandwidths, bus_factor, fit_axis, load_calibration
from shardwise.plan.comm import measured_time, wire_bytes
from shardwise.plan.cost import evaluate
from shardwise.plan.layout import Problem
from shardwise.plan.report import evaluate_text
from shardwise.spec.layout import Layout

DEMO = ["--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=8"]


def test_bus_factors_are_nccl_tests_definitions():
    # nccl-tests doc/PERFORMANCE.md: 2(n-1)/n all-reduce, (n-1)/n all-gather / reduce-scatter / all-to-all, 1 p2p.
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8 and bus_factor("all_reduce", 2) == 1.0
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 8) == 7 / 8
    assert bus_factor("send_recv", 2) == 1.0
    # The same factors as the planner's ring wire bytes per byte of payload.
    for op, kind in (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("all_to_all", "all_to_all")):
        assert bus_factor(op, 4) == wire_bytes(kind, 1.0, 4)
    algbw, busbw = bandwidths("all_reduce", 4, 2_000_000_000, 2.0)  # 2 GB in 2 s
    assert algbw == pytest.approx(1.0) and busbw == pytest.approx(1.5)
    with pytest.raises(ValueError):
        bus_factor("broadcast", 2)


def test_sizes_lists_and_ranges():
    assert parse_sizes("1K:16M") == [2**10 * 4**i for i in range(8)]
    assert parse_sizes("1K:8K:2") == [1024, 2048, 4096, 8192]
    assert parse_sizes("64K,1K,4096") == [1024, 4096, 65536]
    assert parse_sizes("1G") == [2**30]
    for bad in ("abc", "16M:1K", "1K:16M:1", "0", "1K:2K:3:4"):
        with pytest.raises(ConfigError) as e:
            parse_sizes(bad)
        assert e.value.field == "--sizes"


def test_bad_input_is_refused_before_spawning():
    for argv, field in ((["--nproc", "1"], "--nproc"), (["--nproc", "2", "--parallel.tp=3"], "parallel"),
                        (["--nproc", "2", "--sizes", "x"], "--sizes"), (["--nproc", "2", "--iters", "0"], "--iters"),
                        (["--nproc", "2", "--parallel.bogus=1"], "parallel.bogus")):
        with pytest.raises(ConfigError) as e:
            main(argv)
        assert e.value.field == field, argv


def test_fit_recovers_latency_and_bandwidth():
    n, a, bus = 4, 40e-6, 12e9  # one all-reduce costs 40 us + 2(n-1)/n S / 12 GB/s
    pts = [(s, a + bus_factor("all_reduce", n) * s / bus) for s in (2**10, 2**16, 2**20, 2**24)]
    f = fit_axis("tp", n, pts)
    assert f.method == "fit" and f.ranks == 4
    assert f.bus_bytes_per_s == pytest.approx(bus) and f.hop_latency_s == pytest.approx(a / (2 * 2))  # 2 log2(4) hops
    # Noise that inverts the curve: the largest size's busbw and the smallest size's time.
    g = fit_axis("tp", 2, [(1024, 5e-3), (2**20, 1e-3)])
    assert g.method == "ends" and g.bus_bytes_per_s == pytest.approx(2**20 / 1e-3) and g.hop_latency_s == pytest.approx(5e-3 / 2)


def _results(axis: str, n: int, latency: float, bus: float) -> dict:
    rows = []
    for op in ("all_reduce", "all_gather", "send_recv"):
        for size in (4096, 2**20, 2**24):
            t = latency + bus_factor(op, n) * size / bus
            algbw, busbw = bandwidths(op, n, size, t)
            rows.append({"axis": axis, "ranks": n, "op": op, "bytes": size, "time_s": t, "algbw": algbw, "busbw": busbw})
    return {"schema": SCHEMA, "backend": "gloo", "device": "cpu", "torch": "x", "world_size": n, "layout": f"{axis}={n}",
            "iters": 3, "warmup": 1, "units": {}, "axes": {axis: n}, "results": rows}


def test_json_round_trip_table_and_plot(tmp_path):
    path = tmp_path / "bench.json"
    data = _results("dp_shard", 2, 1e-3, 1e9)
    path.write_text(json.dumps(data))
    (cal,) = load_calibration(path)
    assert cal.axis == "dp_shard" and cal.ranks == 2 and cal.method == "fit"
    assert cal.bus_bytes_per_s == pytest.approx(1e9) and cal.hop_latency_s == pytest.approx(1e-3 / 2)
    text = table(data)
    assert "busbw GB/s" in text and "planner calibration dp_shard" in text and text.count("send_recv") >= 3
    plot(tmp_path / "bench.png", data)
    assert (tmp_path / "bench.png").stat().st_size > 1000


@pytest.mark.parametrize("content, problem", [(None, "file not found"), ("{", "is not JSON"),
                                              ('{"schema": "other"}', "is not a bench-comm result"),
                                              ("bad_row", "is not a measurement"), ("no_ar", "no all-reduce")])
def test_bad_calibration_files_are_config_errors(tmp_path, content, problem):
    path = tmp_path / "bench.json"
    if content == "bad_row":
        data = _results("tp", 2, 1e-5, 1e9)
        data["results"][0]["busbw"] = "fast"
        content = json.dumps(data)
    elif content == "no_ar":
        data = _results("tp", 2, 1e-5, 1e9)
        data["results"] = [r for r in data["results"] if r["op"] != "all_reduce"]
        content = json.dumps(data)
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        Problem.from_config(load_config(overrides=[*DEMO, f"--cluster.calibration={path}"]))
    assert e.value.field == "cluster.calibration" and problem in e.value.problem


def _estimate(*overrides: str):
    cfg = load_config(overrides=[*DEMO, *overrides])
    problem = Problem.from_config(cfg)
    return problem, evaluate(problem, Layout.from_config(cfg, problem.cluster.num_gpus))


def test_calibration_replaces_the_datasheet_on_measured_axes_only(tmp_path):
    base_problem, base = _estimate()
    _, empty = _estimate("--cluster.calibration=")
    assert empty.breakdown_s == base.breakdown_s  # "" is no calibration
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(_results("dp_shard", 2, 1e-3, 1e9)))  # gloo-like: 1 GB/s, 1 ms per all-reduce
    problem, measured = _estimate(f"--cluster.calibration={slow}")
    assert measured.breakdown_s["dp_comm"] > 100 * base.breakdown_s["dp_comm"] > 0
    assert measured.breakdown_s["compute"] == base.breakdown_s["compute"]
    text = evaluate_text(problem, measured)
    assert f"measured {slow}: dp_shard busbw 1 GB/s" in text and "comm     measured: dp_shard; datasheet: none" in text
    assert "measured" not in evaluate_text(base_problem, base)
    # An axis the layout does not use changes nothing.
    other = tmp_path / "tp.json"
    other.write_text(json.dumps(_results("tp", 2, 1e-3, 1e9)))
    problem, unused = _estimate(f"--cluster.calibration={other}")
    assert unused.breakdown_s == base.breakdown_s
    assert "comm     measured: none; datasheet: dp_shard" in evaluate_text(problem, unused)


def test_measured_time_uses_ring_bytes_and_hops():
    cal = fit_axis("tp", 2, [(s, 1e-4 + s / 2e9) for s in (1024, 2**20, 2**24)])
    # On the 8 ranks of a plan: 2 (n-1)/n S / B + 2 log2(8) hops x per-hop latency (1e-4 / 2 hops).
    assert measured_time("all_reduce", 1e9, 8, cal) == pytest.approx(2 * 7 / 8 * 1e9 / 2e9 + 6 * 5e-5)
    assert measured_time("all_gather", 1e9, 8, cal) == pytest.approx(7 / 8 * 1e9 / 2e9 + 3 * 5e-5)
    assert measured_time("send", 1e9, 2, cal) == pytest.approx(1e9 / 2e9 + 5e-5)
    assert measured_time("all_reduce", 1e9, 1, cal) == 0.0 and math.isfinite(cal.hop_latency_s)


def test_several_cpu_processes_are_planned_from_one_measured_link(tmp_path, capsys):
    """A CPU has no datasheet link: planning 2 processes without a measurement was a ZeroDivisionError; now a
    clear error saying what to measure, and following it works for every axis — the processes share one
    host, so the dp_shard measurement prices tp's collectives too."""
    from shardwise.cli import main as cli

    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({
        "benchmark": "kernels", "device_type": "cpu", "gemm": {"dtype": "fp32", "peak_flops": 2e11},
        "bandwidth": {"rows": [{"kernel": "copy", "gbps": 40.0}]},
        "sdpa": {"rows": [{"requested": "default", "dtype": "fp32", "fwd_bwd_flops": 7e10}]},
        "overhead": {"rows": [{"mode": "eager", "s_per_op": 2e-6}]},
        "optimizer": {"rows": [{"impl": "foreach", "bytes_per_param_at_copy_bw": 100.0}]}}))
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps(_results("dp_shard", 2, 1e-4, 1e9)))
    base = ["plan", "evaluate", "--json", "--cluster.gpu=cpu", "--model.preset=tiny", "--train.seq_len=32",
            "--train.micro_batch=2", "--train.global_batch=8", "--cluster.num_gpus=2", "--parallel.tp=2"]
    assert cli(base + [f"--cluster.calibration={kernels}"]) == 2
    err = capsys.readouterr().err
    assert "cluster.calibration" in err and "bench-comm" in err and "Traceback" not in err
    assert cli(base + [f"--cluster.calibration={kernels},{comm}"]) == 0
    tp = json.loads(capsys.readouterr().out)["breakdown_s"]["tp_comm"]
    assert 0 < tp < 1.0


def test_the_measured_overlap_slowdown_replaces_the_constant(tmp_path):
    """bench-comm's GEMM loop beside its all-reduces (plan/scale.py item 4): its slowdown prices the compute
    beside hidden communication in place of OVERLAP_COMPUTE_SLOWDOWN; a file without it keeps the constant."""
    from shardwise.plan.scale import OVERLAP_COMPUTE_SLOWDOWN, scale_lines

    _, base = _estimate()
    beside = base.detail["comm_beside_compute_s"]
    assert beside > 0 and base.breakdown_s["overlap_contention"] == pytest.approx(OVERLAP_COMPUTE_SLOWDOWN * beside)
    data = _results("tp", 2, 1e-5, 1e9)  # an axis this layout does not use: only the slowdown applies
    data["overlap"] = {"axis": "tp", "ranks": 2, "bytes": 2**24, "gemm": "512x512x512 float32", "gemms": 10,
                       "all_reduces": 4, "compute_alone_s": 0.05, "compute_beside_s": 0.075, "slowdown": 0.5}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    problem, measured = _estimate(f"--cluster.calibration={path}")
    assert problem.cluster.overlap_slowdown == 0.5
    assert measured.breakdown_s["overlap_contention"] == pytest.approx(0.5 * beside)
    assert any("runs 50.0% slower there (measured)" in line for line in scale_lines(problem, measured))
    assert "ran 50.0% slower beside all-reduces of 16M on tp" in table(data)
    for bad in (-0.1, "slow", None):
        data["overlap"]["slowdown"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as e:
            _estimate(f"--cluster.calibration={path}")
        assert e.value.field == "cluster.calibration" and "overlap.slowdown" in e.value.problem


def test_on_a_gpu_the_gemm_loop_is_timed_on_its_stream_not_the_device(monkeypatch):
    """measure_overlap queues all-reduces on NCCL's stream, then times the GEMMs beside them. A device-wide
    synchronisation would wait for the all-reduces too and time them (which is why the first version, which
    synchronised the device, would have measured the queue's length on a GPU): the loop is timed between two
    events of the current stream. CPU test of that decision, with the CUDA calls faked."""
    import torch

    from shardwise.launch.bench_comm import _timed

    log = []

    class Event:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("event sync")

        def elapsed_time(self, other):
            return 25.0  # ms

    def device_sync(*args):
        raise AssertionError("a device synchronisation also waits for the queued collectives")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", device_sync)
    assert _timed(lambda: log.append("work"), torch.device("cuda")) == 0.025
    assert log == ["record", "work", "record", "event sync"]
