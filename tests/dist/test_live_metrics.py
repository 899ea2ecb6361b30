"""run.metrics_port in real runs: rank 0 of a 2-process `shardwise train` serves its metrics while it trains,
read by a real client (urllib over 127.0.0.1, prometheus_client's parser); the step, loss and tokens/s
advance, and the port is closed when the run ends. A port in use is refused before anything starts (exit 2)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import free_port

ZERO3 = ["--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=4"]
MAIN = {"shardwise_step", "shardwise_loss", "shardwise_tokens_per_s", "shardwise_step_time_s", "shardwise_mfu",
        "shardwise_lr", "shardwise_grad_norm", "shardwise_mem_params_bytes"}


def _scrape(port: int) -> dict[str, float] | None:
    """The endpoint's gauges, or None while nothing listens."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(body)}


def _common(base_overrides, run: Path, port: int) -> list[str]:
    skip = {"train.steps", "train.micro_batch"}
    return ([f"--{k}={v}" for k, v in base_overrides if k not in skip]
            + [f"--run.dir={run}", "--train.steps=16", "--train.log_every=1", f"--run.metrics_port={port}"])


def test_rank0_serves_the_run_while_it_trains(base_overrides, tmp_path):
    port = free_port()
    run = tmp_path / "run"
    out, err = open(tmp_path / "out", "w"), open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", *ZERO3, *_common(base_overrides, run, port)],
                            stdout=out, stderr=err, cwd=tmp_path)
    seen, latencies = [], []
    try:
        while proc.poll() is None:
            t0 = time.perf_counter()
            got = _scrape(port)
            if got and "shardwise_step" in got:
                latencies.append(time.perf_counter() - t0)
                if not seen or got["shardwise_step"] != seen[-1]["shardwise_step"]:
                    seen.append(got)
            time.sleep(0.02)
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(seen) >= 2, f"read {len(seen)} distinct steps during the run"
    assert MAIN <= seen[-1].keys(), sorted(seen[-1])
    steps = [g["shardwise_step"] for g in seen]
    assert steps == sorted(steps) and steps[-1] > steps[0]
    assert all(g["shardwise_tokens_per_s"] > 0 and g["shardwise_loss"] > 0 for g in seen)
    assert len({g["shardwise_loss"] for g in seen}) > 1 and len({g["shardwise_tokens_per_s"] for g in seen}) > 1
    print(f"{len(latencies)} scrapes during the run, median {sorted(latencies)[len(latencies) // 2] * 1e3:.1f} ms; "
          f"steps seen {steps}")
    assert _scrape(port) is None  # nothing listens after the run


def test_in_process_run_stops_its_thread_and_frees_the_port(base_overrides, tmp_path):
    """A run in this process (as tests and `shardwise train --nproc 1` train): its server thread is gone and the
    port closed when train() returns, while the process goes on."""
    from shardwise.config import load_config
    from shardwise.train.trainer import Trainer

    port = free_port()
    cfg = load_config(None, _common(base_overrides, tmp_path / "run", port) + ["--train.steps=6"])
    threads = set(threading.enumerate())
    seen: list[float] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            if (got := _scrape(port)) and "shardwise_step" in got:
                seen.append(got["shardwise_step"])
            time.sleep(0.01)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        Trainer(cfg, single_process=True).train()
    finally:
        done.set()
        reader.join()
    assert len(set(seen)) >= 2 and seen == sorted(seen)  # read while it trained (the last step may end first)
    assert set(threading.enumerate()) == threads, set(threading.enumerate()) - threads
    assert _scrape(port) is None


def test_a_port_in_use_is_refused_before_anything_starts(base_overrides, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *ZERO3, *_common(base_overrides, tmp_path / "run", port)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: run.metrics_port: 127.0.0.1:{port} is already in use") and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
