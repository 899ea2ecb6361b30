"""Live metrics (run.metrics_port): rank 0 serves its newest metrics records over HTTP in Prometheus text
format, at http://<run.metrics_address>:<run.metrics_port>/metrics, for the whole run.

Why this design:
- What is served is the metrics.jsonl record itself (MetricsLogger.log hands each record here), not a second
  set of counters kept beside it: one account of a step, and a key a module adds to the record (validation
  losses, straggler/*, energy) is served without a change here. Each numeric key becomes a gauge named
  shardwise_<key>, sanitized (metric_name); the newest value of each key is kept, so a validation round's
  record does not hide the step's loss.
- A collector over a snapshot: the training thread swaps in a new dict (one reference assignment, atomic
  under the GIL: no lock on the step's path), and a scrape reads whichever snapshot is current.
- A CollectorRegistry of the run's own, never prometheus_client's global REGISTRY: several runs in one
  process (tests, parity) neither share nor collide, and no process metrics leak in.
- prometheus_client's WSGI app on the standard library's threading WSGI server, in a daemon thread; close()
  shuts it down, closes the socket and joins the serving thread and every request thread, so nothing outlives
  the run (MetricsLogger.close, in the trainer's `finally`). Not prometheus_client's start_http_server: its
  request threads are daemons that server_close() does not join, so a scrape's thread could still be finishing
  after close() (CI saw one); ours are joined, and a stalled scraper holds close() at most REQUEST_TIMEOUT_S.
- Loopback by default: the numbers say what a job trains; any other address only when given.
"""
from __future__ import annotations

import errno
import re
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from shardwise.errors import ConfigError

PREFIX = "shardwise_"

# HELP text of the record's main keys (docs/metrics.md describes every key); the others get a generic one.
HELP = {
    "step": "Newest logged optimizer step (1-based)",
    "loss": "Training loss of the step (mean over the global batch)",
    "lr": "Learning rate of the step",
    "grad_norm": "Gradient L2 norm before clipping",
    "tokens_per_s": "Tokens per second of the step, whole job",
    "tokens_per_s_per_device": "Tokens per second of the step per device (docs/architecture.md section 5)",
    "step_time_s": "Wall time of the step in seconds",
    "mfu": "Model FLOPs utilization of the step (fraction of the device's peak)",
    "skipped": "1 when the step was skipped (a non-finite loss or gradient norm)",
    "skipped_steps": "Steps skipped so far in this run",
    "loss_scale": "fp16 dynamic loss scale",
    "time": "Unix time when the step ended and was logged",
    "eval_time_s": "Seconds of the newest validation round",
}
_PATTERNS = [  # (key pattern, HELP template)
    (re.compile(r"mem_(.+)_bytes"), "Rank 0's memory in bytes, category {}"),
    (re.compile(r"comm_(.+)_bytes"), "Payload bytes per step on mesh axis {}, counted on one step"),
    (re.compile(r"valid_loss_(.+)"), "Validation loss (token mean) on set {}"),
    (re.compile(r"valid_ppl_(.+)"), "Validation perplexity on set {}"),
    (re.compile(r"tokens_(.+)"), "Input tokens read from source {} so far"),
]
_INVALID = re.compile(r"[^a-zA-Z0-9_]")
REQUEST_TIMEOUT_S = 10.0  # a scrape's socket timeout: Prometheus scrapes in well under a second


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = False  # server_close() joins every request thread (socketserver joins only non-daemons)

    def __init__(self, where: tuple, family: int, request_timeout_s: float):
        self.address_family, self.request_timeout_s = family, request_timeout_s  # TCPServer.__init__ reads the family
        super().__init__(where, _QuietHandler)


class _QuietHandler(WSGIRequestHandler):
    def setup(self):
        self.timeout = self.server.request_timeout_s  # StreamRequestHandler.setup applies it to the socket
        super().setup()

    def log_message(self, format, *args):  # a scrape per 15 s in the run's output would bury its lines
        pass


def metric_name(key: str) -> str:
    """A record key as a Prometheus metric name: 'straggler/slowest_rank' -> 'shardwise_straggler_slowest_rank'."""
    return PREFIX + _INVALID.sub("_", key)


def help_text(key: str) -> str:
    if key in HELP:
        return HELP[key]
    for pattern, words in _PATTERNS:
        if m := pattern.fullmatch(key):
            return words.format(m.group(1))
    return f"metrics.jsonl key {key!r} of the newest record that has it"


def _number(value: Any) -> float | None:
    """The record's numbers (bools, ints, floats, NaN too; one-element tensors); None for the rest."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    return float(value) if isinstance(value, (bool, int, float)) else None


def families(snapshot: dict[str, float]) -> list:
    """One gauge per key; a key whose name another key took already (a/b and a_b) is left out."""
    from prometheus_client.core import GaugeMetricFamily

    out, seen = [], set()
    for key, value in snapshot.items():
        name = metric_name(key)
        if name not in seen:
            seen.add(name)
            out.append(GaugeMetricFamily(name, help_text(key), value=value))
    return out


class LiveMetrics:
    """The endpoint of one run: start() binds (a ConfigError naming the key when it cannot), update() takes
    each record, close() stops the thread and frees the port."""

    def __init__(self, port: int, address: str = "127.0.0.1", request_timeout_s: float = REQUEST_TIMEOUT_S):
        self.port, self.address, self.request_timeout_s = port, address, request_timeout_s
        self._snapshot: dict[str, float] = {}
        self._server = self._thread = None

    def collect(self):  # prometheus_client's Collector protocol, called on the server's thread
        return families(self._snapshot)

    def start(self) -> LiveMetrics:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:  # the address's first family, as check_port_free binds it (IPv6 addresses included)
            family = socket.getaddrinfo(self.address, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
            server = _Server((self.address, self.port), family, self.request_timeout_s)
        except OSError as e:
            raise bind_error(self.port, self.address, e) from None
        server.set_app(make_wsgi_app(registry))
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=f"shardwise-metrics-{self.port}",
                                        daemon=True)
        self._thread.start()
        return self

    def update(self, step: int, record: dict[str, Any]) -> None:
        new = dict(self._snapshot)
        for key, value in {"step": step, **record}.items():
            if (number := _number(value)) is not None:
                new[key] = number
        self._snapshot = new  # one assignment: a scrape sees the old or the new snapshot, whole

    def close(self) -> None:
        """Stop serving: no thread, no listening socket afterwards. Safe to call twice."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()       # serve_forever returns (within its 0.5 s poll)
        server.server_close()   # the listening socket, then joins the request threads (each within its timeout)
        self._thread.join(timeout=5)


def bind_error(port: int, address: str, e: OSError) -> ConfigError:
    where = f"{address}:{port}"
    if e.errno == errno.EADDRINUSE:
        return ConfigError("run.metrics_port", f"{where} is already in use (another program, or another run's endpoint)",
                           "choose a free port with --run.metrics_port=PORT, or 0 to serve no metrics")
    if e.errno == errno.EACCES:
        return ConfigError("run.metrics_port", f"may not listen on {where}: {e.strerror} (ports below 1024 need root)",
                           "choose a port from 1024 to 65535")
    if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
        return ConfigError("run.metrics_address", f"cannot listen on {address!r}: {e.strerror or e}",
                           "use an address of this machine, e.g. the default 127.0.0.1 (loopback)")
    return ConfigError("run.metrics_port", f"cannot listen on {where}: {e.strerror or e}",
                       "choose another --run.metrics_port, or 0 to serve no metrics")


def serve(run_cfg) -> LiveMetrics | None:
    """Rank 0's endpoint for run.metrics_port (started), or None when it is 0 or cannot listen. `shardwise train`
    refused a port in use before it started anything (check_port_free, exit 2); here, when the ranks start (plain
    torchrun, a restart on another node, a port taken since), one warning and the run trains on: ending a job, or
    a restarted one, over its monitoring would cost more than the numbers (metrics.jsonl still has them all)."""
    if not run_cfg.metrics_port:
        return None
    try:
        return LiveMetrics(run_cfg.metrics_port, run_cfg.metrics_address).start()
    except ConfigError as e:
        print(f"warning: {e.field}: {e.problem}; this run serves no live metrics (metrics.jsonl has them)", flush=True)
        return None


def check_port_free(run_cfg) -> None:
    """Before anything is spawned (`shardwise train` on node 0): the endpoint's port can be bound now."""
    port, address = run_cfg.metrics_port, run_cfg.metrics_address
    if not port:
        return
    try:  # as the server will bind: the address's first family, SO_REUSEADDR (http.server's allow_reuse_address)
        family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(where)
    except OSError as e:
        raise bind_error(port, address, e) from None

