"""The refusal watch's load on node 0's rendezvous store (launch/peer_failure.py RefusalWatch): while a
multi-node job waits at the rendezvous, every waiting node asks node 0's TCPStore once a second whether a
node was refused. Does that slow the store torch's own rendezvous uses?

One TCPStore master on loopback; N clients (threads, each with its own connection, as N nodes would
have) each `check` the refusal key once a second, spread over the second; meanwhile one more client
times `set` + `get` pairs (what the rendezvous does) against the same store. It reports that latency
idle and under each N, and the poll rate the clients really reached.

    python benchmarks/store_polling.py [--clients 100,1000] [--samples 200] [--out F] [--smoke]

Loopback on one machine: it measures the store's own work per request (its event loop and the requests'
handling), not a network's latency or a real node 0's NIC. Opening a client took 0.2 s here (1000 in 196
s, one after another: torch's TCPStore connect), so the default run takes about 4 minutes, most of it
connecting. --smoke: 20 clients, 20 samples.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

try:
    import shardwise  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shardwise.launch.peer_failure import KEY  # noqa: E402  (the key the refusal watch polls)


def _client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def latency(port: int, samples: int) -> dict:
    """Median and p99 of a set + get pair, in ms, one pair every 5 ms."""
    c = _client(port)
    times = []
    for i in range(samples):
        t = time.perf_counter()
        c.set(f"probe{i % 10}", "x")
        c.get(f"probe{i % 10}")
        times.append(time.perf_counter() - t)
        time.sleep(0.005)
    times.sort()
    return {"median_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))]}


def under_polling(port: int, clients: int, samples: int) -> dict:
    stop, count = threading.Event(), [0]
    stores = [_client(port) for _ in range(clients)]

    def poll(store, offset: float) -> None:
        time.sleep(offset)
        while not stop.wait(1.0):
            store.check([KEY])
            count[0] += 1

    threads = [threading.Thread(target=poll, args=(s, i / clients), daemon=True) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # every poller past its first poll
    before, t0 = count[0], time.perf_counter()
    result = latency(port, samples)
    result["polls_per_s"] = (count[0] - before) / (time.perf_counter() - t0)
    stop.set()
    for t in threads:
        t.join(timeout=5)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,1000", help="comma-separated numbers of polling clients")
    parser.add_argument("--samples", type=int, default=200, help="set + get pairs timed per case")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/store_polling.json")
    parser.add_argument("--smoke", action="store_true", help="20 clients, 20 samples: checks the script runs")
    args = parser.parse_args(argv)
    counts = [20] if args.smoke else [int(n) for n in args.clients.split(",")]
    samples = 20 if args.smoke else args.samples
    if not counts or min(counts) < 1 or samples < 1:
        parser.error("--clients must be positive numbers and --samples >= 1")
    out = args.out or Path(__file__).parent / "results" / f"store_polling{'.smoke' if args.smoke else ''}.json"
    import torch.distributed as dist

    with socket.socket() as s:  # a free loopback port for the master
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    rows = [{"clients": 0, **latency(port, samples)}]
    for n in counts:
        rows.append({"clients": n, **under_polling(port, n, samples)})
    print(f"{'polling clients':>16s} {'polls/s':>9s} {'set+get median ms':>18s} {'p99 ms':>8s}")
    for r in rows:
        polls = f"{r['polls_per_s']:.0f}" if "polls_per_s" in r else "-"
        print(f"{r['clients']:>16d} {polls:>9s} {r['median_ms']:>18.3f} {r['p99_ms']:>8.3f}")
    if args.smoke:
        print("smoke run: checks that the benchmark runs; its numbers are not a measurement")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "store_polling", "samples": samples, "rows": rows,
                               "smoke": args.smoke}, indent=2) + "\n")
    print(f"wrote {out}")
    del master
    return 0


if __name__ == "__main__":
    sys.exit(main())
