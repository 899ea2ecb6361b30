"""Install Debian packages a real-launcher test needs (Open MPI, SLURM, munge), or skip saying why.

Only as root and only with apt-get; every other case is a pytest.skip whose reason is printed, so a
skipped real test is never silent (CI installs the packages in .ci/run to keep this out of test time).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def require_commands(packages: list[str], commands: list[str]) -> dict[str, str]:
    """{command: path} for every command, installing `packages` with apt-get first when one is missing."""
    missing = [c for c in commands if not shutil.which(c)]
    if missing:
        what = f"{', '.join(missing)} not installed"
        if os.geteuid() != 0:
            _skip(f"{what} and we are not root, so {' '.join(packages)} cannot be installed: "
                  f"apt-get install {' '.join(packages)} to run this test")
        if not shutil.which("apt-get"):
            _skip(f"{what} and there is no apt-get to install {' '.join(packages)} with")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            except (OSError, subprocess.TimeoutExpired) as e:
                _skip(f"installing {' '.join(packages)} failed: {' '.join(cmd)}: {e}")
            if done.returncode != 0:
                _skip(f"installing {' '.join(packages)} failed: {' '.join(cmd)} exited {done.returncode}: "
                      f"{done.stderr.strip()[-500:]}")
    found = {c: shutil.which(c) for c in commands}
    absent = [c for c, path in found.items() if not path]
    if absent:
        _skip(f"{' '.join(packages)} installed but {', '.join(absent)} not on PATH")
    return found  # type: ignore[return-value]


def _skip(reason: str) -> None:
    print(reason)  # shown with -rs and in the captured output of the run: a skip always says why
    pytest.skip(reason)
