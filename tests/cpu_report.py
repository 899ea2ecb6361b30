"""Where the suite's CPU goes, per test file: `pytest -p tests.cpu_report --cpu-report=DIR ...` makes each
process (each xdist worker) write DIR/cpu-<worker>.json; `python -m tests.cpu_report DIR [N]` prints the files
(the N first) by CPU seconds. `make test` is bound by its CPU work on 2 cores (the Makefile says so), so a file's CPU, not its
wall time, is what it costs the suite: a file's wall time grows with whatever the other worker runs beside it.

A test's CPU is this process's user + system time over the test's protocol (module fixtures' set-up counted in
the file's first test) plus that of the child processes it waited for (torchrun agents, their workers, worlds
of tests/harness.py): resource.getrusage(RUSAGE_CHILDREN) counts a child once it has been waited for."""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-report", default=None, metavar="DIR",
                     help="write each process's CPU seconds per test file to DIR/cpu-<worker>.json")


def pytest_configure(config) -> None:
    out = config.getoption("--cpu-report")
    if out:
        config.pluginmanager.register(_Meter(Path(out)), "cpu_report_meter")


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _Meter:
    def __init__(self, out: Path):
        self.out = out
        self.files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        cpu, wall = _cpu_s(), time.monotonic()
        yield
        entry = self.files[item.location[0]]
        entry[0] += _cpu_s() - cpu
        entry[1] += time.monotonic() - wall
        entry[2] += 1

    def pytest_sessionfinish(self, session) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")  # xdist's own name for this worker
        rows = {f: {"cpu_s": c, "wall_s": w, "tests": n} for f, (c, w, n) in self.files.items()}
        if rows:
            (self.out / f"cpu-{worker}.json").write_text(json.dumps(rows, indent=1))


def summary(directory: Path, top: int | None = None) -> str:
    files: dict[str, dict[str, float]] = {}
    for path in sorted(directory.glob("cpu-*.json")):
        for name, row in json.loads(path.read_text()).items():
            into = files.setdefault(name, {"cpu_s": 0.0, "wall_s": 0.0, "tests": 0})
            for key in into:
                into[key] += row[key]
    total = sum(r["cpu_s"] for r in files.values()) or 1.0
    lines = [f"{'CPU s':>8} {'share':>6} {'wall s':>8} {'tests':>6}  file"]
    for name, r in sorted(files.items(), key=lambda kv: -kv[1]["cpu_s"])[:top]:
        lines.append(f"{r['cpu_s']:8.0f} {r['cpu_s'] / total:6.1%} {r['wall_s']:8.0f} {r['tests']:6d}  {name}")
    lines.append(f"{total:8.0f} CPU s in all, {len(files)} files")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None))
