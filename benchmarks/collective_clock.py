"""Per-axis collective time for real (train/collective_wait.py): NCCL's completion hook on a GPU.

    python benchmarks/collective_clock.py [--collectives 20] [--mib 64] [--out FILE.json] [--smoke]

On CUDA: a one-rank NCCL process group (a TCP store on loopback), the clock on it as the trainer places it,
then N all-reduces of a buffer. Checks: every collective is reported, within 10 s of the last one's end
(the hook runs on NCCL's watchdog thread), with positive device seconds that sum to no more than the wall
time around them. Without CUDA (or --smoke): gloo, and the trainer's decision that gloo is not timed (no
clock). Prints one table, writes JSON (default benchmarks/results/collective_clock.json, .smoke.json with
--smoke); exit 1 when a check fails. `make gpu-check` runs it
(row check/collective-clock); the unit tests (tests/unit/test_collective_wait.py) drive the same clock
with the hook's arguments on CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", type=int, default=20)
    ap.add_argument("--mib", type=float, default=64.0, help="all-reduce buffer size")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true", help="gloo on CPU: the decision only")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from shardwise.train.collective_wait import CollectiveClock

    cuda = torch.cuda.is_available() and not args.smoke
    backend = "nccl" if cuda else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    kw = {"device_id": torch.device("cuda", 0)} if cuda else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kw)
    result: dict = {"benchmark": "collective_clock", "smoke": args.smoke, "backend": backend,
                    "collectives": args.collectives, "checks": {}}
    try:
        clock = CollectiveClock.start([("dp", dist.group.WORLD)], dist.get_backend)
        checks = result["checks"]
        if not cuda:
            checks["gloo is not timed (no clock)"] = clock is None
        else:
            checks["the NCCL group is timed"] = clock is not None and clock.axes == ["dp"] and not clock.refused
            x = torch.ones(int(args.mib * 2 ** 20 / 4), device="cuda")
            dist.all_reduce(x)  # NCCL's communicator is made lazily: not in the timed ones
            torch.cuda.synchronize()
            time.sleep(0.5)
            clock.take()
            start = time.perf_counter()
            for _ in range(args.collectives):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            seconds, calls, deadline = 0.0, 0, time.monotonic() + 10
            while calls < args.collectives and time.monotonic() < deadline:
                s, c = clock.take()["dp"]
                seconds, calls = seconds + s, calls + c
                time.sleep(0.05)
            result.update(wall_s=wall, device_s=seconds, reported=calls,
                          bus_gbps=args.collectives * x.numel() * 4 / seconds / 1e9 if seconds > 0 else None)
            checks["every collective reported"] = calls == args.collectives
            checks["device seconds positive, within the wall time"] = 0 < seconds <= wall * 1.01
    finally:
        dist.destroy_process_group()
    ok = all(result["checks"].values())
    result["verdict"] = "pass" if ok else "fail"
    print(f"{'check':52s} result")
    for name, passed in result["checks"].items():
        print(f"{name:52s} {'pass' if passed else 'FAIL'}")
    if cuda:
        print(f"{args.collectives} all-reduces of {args.mib:g} MiB: {result['reported']} reported, "
              f"{1e3 * result['device_s']:.2f} ms on the device in {1e3 * result['wall_s']:.2f} ms of wall time")
    out = args.out or ROOT / "benchmarks" / "results" / f"collective_clock{'.smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
