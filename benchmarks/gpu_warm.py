"""gpu-check's shardwise commands (benchmarks/gpu_check.py Ctx.shardwise) start in an interpreter that was started
ahead of them: while one row's command runs, the next one's Python imports torch and the trainer, then waits
for its command line on stdin. A row is still a process of its own (a crash, an OOM or a hang fails that row
only); what it no longer waits for is the imports: 3.2 s of `import shardwise.train.trainer` on this repo's
2-core CPU machine (`python -X importtime`; a CUDA build of torch has its CUDA libraries to load too, not yet timed), and a
training row of the check model took ~12 s eager on an H200 (2026-11-26), nearly all of it outside its steps.
On this CPU (`gpu_check.py --device cpu --only 'train/eager/*'`, 12 rows, farm-bench, median of 3 pairs,
2026-11-28): 44.7 s against 61.5 s started cold (0.727x). The waiting interpreter touches no GPU: importing
torch initialises no CUDA context (torch.cuda is lazy), so it does not disturb the row it overlaps beyond a
core's worth of imports on a many-core GPU host.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

# The waiting interpreter: the imports a shardwise command pays for first, then the command from stdin, run as
# `python -m shardwise.cli` runs it. An empty stdin (the check ended without a command for it) exits 0.
PRELUDE = """import json, sys
import torch  # noqa: F401
import shardwise.train.trainer  # noqa: F401
import shardwise.cli as cli
line = sys.stdin.readline()
if not line:
    sys.exit(0)
argv = json.loads(line)
sys.argv = [cli.__file__, *argv]
sys.exit(cli.console(argv))
"""


class WarmShardwise:
    """`run(args)` is subprocess.run([python, -m, shardwise.cli, *args], capture_output, text, timeout) in an
    interpreter started before it; each call starts the next one. Thread-safe (the untimed rows call it from a
    pool); `close()` ends the one left waiting."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env = cwd, env
        self._lock = threading.Lock()
        self._waiting: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", PRELUDE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=self.cwd, env=self.env)

    def run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        with self._lock:
            proc = self._waiting or self._start()
            self._waiting = self._start()  # imports while this command runs
        try:
            out, err = proc.communicate(json.dumps(args) + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:  # as subprocess.run does: kill, collect, raise
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def waiting_pid(self) -> int | None:
        return self._waiting.pid if self._waiting else None

    def close(self) -> int | None:
        """Ends the interpreter left waiting, which ran no command: its exit code (0 once its imports are
        done), None where none was waiting."""
        with self._lock:
            proc, self._waiting = self._waiting, None
        if proc is None:
            return None
        proc.communicate()  # EOF on stdin: it exits without running a command
        return proc.returncode
