"""train/live_metrics.py: a record's keys as Prometheus metrics, the endpoint's clean close, and the bad
settings of run.metrics_port / run.metrics_address refused with exit 2 naming the key."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardwise.errors import ConfigError
from shardwise.train.live_metrics import LiveMetrics, check_port_free, help_text, metric_name, serve
from tests.harness import free_port


def _scrape(port: int) -> dict[str, tuple[float, str]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: (f.samples[0].value, f.documentation) for f in text_string_to_metric_families(body)}


def test_record_keys_map_to_metric_names():
    assert metric_name("loss") == "shardwise_loss"
    assert metric_name("straggler/slowest_rank") == "shardwise_straggler_slowest_rank"
    assert metric_name("mem_max_memory_allocated_bytes") == "shardwise_mem_max_memory_allocated_bytes"
    assert metric_name("valid_loss_wiki-en.v2") == "shardwise_valid_loss_wiki_en_v2"
    assert help_text("mem_params_bytes") == "Rank 0's memory in bytes, category params"
    assert help_text("valid_loss_held") == "Validation loss (token mean) on set held"
    assert "'straggler/slowest_rank'" in help_text("straggler/slowest_rank")


def test_endpoint_serves_numeric_keys_and_closes_without_a_trace():
    port = free_port()
    threads = set(threading.enumerate())
    live = LiveMetrics(port).start()
    try:
        assert _scrape(port) == {}  # before the first record: nothing, but served
        live.update(10, {"loss": 3.5, "tokens_per_s": 1e4, "straggler/slowest_rank": 1, "skipped": False,
                         "comm_bytes_per_step": {"dp": {"all_reduce": 8}}, "pp_bubble_order": "a", "lr": None,
                         "a_b": 1.0, "a/b": 2.0})
        live.update(10, {"valid_loss_held": 2.25, "eval_time_s": 0.5})  # a validation round keeps the step's loss
        got = _scrape(port)
        assert got["shardwise_step"][0] == 10 and got["shardwise_loss"] == (3.5, "Training loss of the step (mean over "
                                                                                "the global batch)")
        assert got["shardwise_straggler_slowest_rank"][0] == 1 and got["shardwise_valid_loss_held"][0] == 2.25
        assert got["shardwise_skipped"][0] == 0 and got["shardwise_a_b"][0] == 1.0  # a/b takes a_b's name: left out
        assert not {"shardwise_comm_bytes_per_step", "shardwise_pp_bubble_order", "shardwise_lr"} & got.keys()
        assert all(doc for _, doc in got.values())
    finally:
        live.close()
    live.close()  # twice: nothing
    assert set(threading.enumerate()) == threads
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:  # free again for the next server (as servers bind: the scrapes' TIME_WAIT allowed)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_close_joins_every_scrape_and_a_stalled_scraper_holds_it_at_most_its_timeout():
    """CI once saw a scrape's thread alive after close() (prometheus_client's request threads are daemons that
    server_close does not join). Many scrapes then close at once: no thread left. A client that connects and
    sends nothing holds close() for the request timeout, no longer, and its thread is gone too."""
    threads = set(threading.enumerate())
    for _ in range(6):  # each close waits up to serve_forever's 0.5 s poll
        port = free_port()
        live = LiveMetrics(port).start()
        live.update(1, {"loss": 1.0})
        assert _scrape(port)["shardwise_loss"][0] == 1.0
        live.close()
        assert set(threading.enumerate()) == threads
    port = free_port()
    live = LiveMetrics(port, request_timeout_s=0.5).start()
    with socket.create_connection(("127.0.0.1", port)) as stalled:
        time.sleep(0.2)  # accepted: its request thread waits for a request line
        assert len(set(threading.enumerate()) - threads) == 2
        began = time.monotonic()
        live.close()
        assert time.monotonic() - began < 3  # the 0.5 s timeout, not forever
        assert stalled.recv(1) == b""  # the server closed the connection
    assert set(threading.enumerate()) == threads


def test_port_in_use_is_a_config_error(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = type("Run", (), {"metrics_port": port, "metrics_address": "127.0.0.1"})
        with pytest.raises(ConfigError) as e:
            check_port_free(run)
        assert e.value.field == "run.metrics_port" and "already in use" in e.value.problem
        with pytest.raises(ConfigError, match="run.metrics_port"):
            LiveMetrics(port).start()
        # When the ranks start (plain torchrun; taken since the launcher's check): one line, and the run goes on.
        assert serve(run) is None
        assert capsys.readouterr().out == (f"warning: run.metrics_port: 127.0.0.1:{port} is already in use (another program, "
                                           "or another run's endpoint); this run serves no live metrics (metrics.jsonl "
                                           "has them)\n")
    check_port_free(run)  # closed: free
    with pytest.raises(ConfigError) as e:
        check_port_free(type("Run", (), {"metrics_port": port, "metrics_address": "no-such-host.invalid"}))
    assert e.value.field == "run.metrics_address"


@pytest.mark.parametrize("args, field", [(["--run.metrics_port=70000"], "run.metrics_port"),
                                         (["--run.metrics_port=-1"], "run.metrics_port"),
                                         (["--run.metrics_port=9400", "--run.metrics_address= "], "run.metrics_address")])
def test_bad_settings_exit_2_naming_the_key(args, field, tmp_path):
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", f"--run.dir={tmp_path / 'run'}", *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {field}: ") and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
