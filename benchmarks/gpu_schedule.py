"""Which rows of `make gpu-check` (benchmarks/gpu_check.py; not a script of its own) run, and when: the rows
--only selects, and the order that keeps every timing alone on the GPU while the rows that time nothing, and
the compiled rows' commands run ahead to fill torch's compile cache, share it side by side.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

# Rows that run only when --only names them (docs/gpu.md says what each costs).
DEFAULT_EXCLUDED = ("offload-big/*", "bench/decode-modes", "bench/fp8", "bench/fp8-2.4b", "fixture/*")
# The measured rows the issues' GPU targets read (gpu_report.py TARGETS), run before the others: a check cut
# short by --budget (a lent GPU's session is shorter than the whole check) has measured these first.
FIRST = ("bench/throughput", "bench/fp8", "bench/fp8-2.4b", "bench/decode", "offload-big/cpu", "offload-big/nvme",
         "train/compiled/bf16/none", "train/compiled/fp8/none", "train/eager/bf16/none")
# Rows that report pass/fail and time nothing: they run side by side, between the FIRST rows and the other
# measured ones. On one H100 (2026-11-27) resume/bitwise took 47 s and hf/import 79 s, beside one other row.
UNTIMED = ("resume/*", "hf/*", "doctor", "layout/*", "check/*")
AFTER = {"hf/export": "resume/bitwise"}  # exports the checkpoint that row leaves
# A chain entry that runs the named training row's command ahead, untimed (prewarm), not the row itself.
PREWARM = "prewarm:"
COMPILE_CACHE = "compile-cache"  # under --out: the check's own compile cache (gpu_check.py main)


def schedule(chosen: list[str], cacheable: set[str] | frozenset[str] = frozenset(),
             jobs: int = 1) -> tuple[list[str], list[list[str]], list[str]]:
    """Three phases: the FIRST rows, one at a time; then chains run `jobs` at a time; then the other measured
    rows, one at a time. The chains are the untimed rows (a row that needs another's output, AFTER, in that
    row's chain, after it) and, for each measured row of the last phase in `cacheable` (it compiles through
    inductor: gpu_check.py compiles_with_cache), its command run ahead (PREWARM): a compiled row took 21-34 s on
    an H200 against ~12 s for an eager one (2026-11-26), and run ahead side by side with the untimed rows its
    compilation fills torch's compile cache for the timed run instead of being paid in full, one row after
    another. Only when the pool runs several at a time and has several to run: a lone run ahead would only
    repeat its row."""
    untimed = [n for n in chosen if any(fnmatch.fnmatch(n, p) for p in UNTIMED)]
    chains: list[list[str]] = []
    for name in untimed:
        first = AFTER.get(name)
        chain = next((c for c in chains if first in c), None)
        if chain is None:
            chains.append([name])
        else:
            chain.append(name)
    measured = [n for n in chosen if n not in untimed]
    first = [n for n in FIRST if n in measured]
    rest = [n for n in measured if n not in first]
    ahead = [[PREWARM + n] for n in rest if n in cacheable]
    if jobs >= 2 and len(ahead) + len(chains) >= 2:
        chains = ahead + chains  # the longest first: compilation outlasts most untimed rows
    return first, chains, rest


def select(names: list[str], only: str | None) -> list[str]:
    """Row names matching --only's comma-separated shell patterns (a bare prefix like `hf` means `hf/*`);
    every row but the opt-in ones without --only."""
    if not only:
        return [n for n in names if not any(fnmatch.fnmatch(n, p) for p in DEFAULT_EXCLUDED)]
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    return [n for n in names if any(fnmatch.fnmatch(n, p) or fnmatch.fnmatch(n, f"{p}/*") for p in patterns)]


def drop_autotune_choices(cache: Path) -> int:
    """Removes the kernel configurations inductor chose by timing them (`*.best_config` beside each generated
    kernel in the compile cache) during the runs ahead, where they were timed beside the pool's other work on
    the GPU: each timed row then times its kernels' candidates again, alone, in its own warm-up steps, and
    still loads its graphs' code from the cache. Returns how many it removed."""
    chosen = list(cache.rglob("*.best_config")) if cache.is_dir() else []
    for path in chosen:
        path.unlink(missing_ok=True)
    return len(chosen)
