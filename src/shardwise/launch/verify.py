"""`shardwise plan search --verify K [--verify-ranks 0,last]` (issue 58): the K best layouts the search found,
each rehearsed as `shardwise dryrun` would (launch/dryrun.py: pre-flight at the cluster's size, then each
chosen rank built on the meta device under torch's fake process group, in a process of its own); a layout
that cannot be built there is dropped with one line saying why, and `--emit` writes the best one left.

Where it lives: plan/ is pure Python and never imports launch/ (docs/architecture.md §2; tests run the
planner with torch unimportable), so plan/command.py does not import this module: cli.py, the one floor
above both, hands it to plan_main, which calls it only when --verify is given (without it nothing here is
imported and the search is what it was). Importing this module imports no torch: --verify-ranks is checked
(check_ranks) before the search runs; torch is imported once, for the first layout that passes pre-flight.

Per layout: pre-flight's refusal (the line `shardwise train` would end with) or a rank whose build fails
drops it; otherwise each built rank's parameter, gradient and optimizer bytes (and offload's host / disk
bytes) are held against the planner's for its pipeline position (dryrun.planned_bytes). The planner prices
the most loaded rank of a position: the rank at coordinate 0 on every axis but pp must equal it to the byte;
another may hold less (a shorter last FSDP shard keeps smaller AdamW moments; ZeRO-1's lighter partitions),
never more. Either rule broken is a discrepancy, said on the layout's line (it is the planner's or the
trainer's fault, not the layout's, so the layout is kept).
"""
from __future__ import annotations

import dataclasses
import time

from shardwise.config import Config
from shardwise.errors import ConfigError
from shardwise.launch.dryrun import CATEGORIES, PLACES, build_ranks, parse_ranks, planned_precision, preflight, warm

DEFAULT_RANKS = "0,last"  # the first stage's first rank (the most loaded) and the last stage's last


@dataclasses.dataclass
class Verified:
    """One layout's rehearsal: `dropped` says why it cannot run at this size (None: it was built)."""

    index: int  # its place in the search's ranking, 1-based
    layout: str
    dropped: str | None = None
    rows: list[dict] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_bytes: int = 0
    differences: list[str] = dataclasses.field(default_factory=list)  # planner vs built, beyond the rules above

    @property
    def exact(self) -> bool:
        return self.dropped is None and not self.differences

    def line(self) -> str:
        head = f"  #{self.index} {self.layout}: "
        if self.dropped:
            return head + "dropped: " + self.dropped
        ranks = ", ".join(str(r["rank"]) for r in self.rows)
        built = (f"built rank{'s' * (len(self.rows) > 1)} {ranks} in {self.wall_s:.1f} s ({self.cpu_s:.1f} s of CPU, "
                 f"peak RSS {self.peak_rss_bytes / 2**20:,.0f} MiB); ")
        if self.differences:
            return head + built + "model states DIFFER from the plan: " + "; ".join(self.differences)
        return head + built + "model states as planned: " + ", ".join(_rank_summary(r) for r in self.rows)

    def to_json(self) -> dict:
        return {"index": self.index, "layout": self.layout, "dropped": self.dropped, "exact": self.exact,
                "differences": self.differences, "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3),
                "peak_rss_bytes": self.peak_rss_bytes, "ranks": self.rows}


def _diffs(row: dict) -> dict[str, float]:
    return {c: row.get(c, 0) - row["planned"].get(c, 0) for c in (*CATEGORIES, *PLACES)
            if row.get(c, 0) != row["planned"].get(c, 0)}


def _most_loaded(row: dict) -> bool:
    """The rank the planner prices for its pipeline position: coordinate 0 on every other axis."""
    return all(v == 0 for axis, v in row["coordinates"].items() if axis != "pp")


def _signed(n: float) -> str:
    """A difference in bytes below 1 MiB (a tiny model's shards), else in MiB."""
    return f"{n:+,.0f} B" if abs(n) < 2**20 else f"{n / 2**20:+,.1f} MiB"


def _rank_summary(row: dict) -> str:
    diffs = _diffs(row)
    if not diffs:
        total = sum(row.get(c, 0) for c in (*CATEGORIES, *PLACES))
        return f"rank {row['rank']} equal ({total / 2**30:.3f} GiB)"
    lighter = ", ".join(f"{c} {_signed(d)}" for c, d in diffs.items())
    return f"rank {row['rank']} {lighter} (a lighter shard than the most loaded rank's, which the plan prices)"


def differences(rows: list[dict]) -> list[str]:
    """What breaks the module doc's rules: the most loaded rank off the plan, any rank above it."""
    out = []
    for row in rows:
        diffs = _diffs(row)
        wrong = diffs if _most_loaded(row) else {c: d for c, d in diffs.items() if d > 0}
        if wrong:
            out.append(f"rank {row['rank']} " + ", ".join(f"{c} {d:+,.0f} B" for c, d in wrong.items()))
    return out


def check_ranks(text: str | None, world: int) -> None:
    """--verify-ranks read against the cluster's ranks before the search runs (ConfigError, exit 2)."""
    if text and text.strip().lower() != "default":
        parse_ranks(text, _World(world), "--verify-ranks")


@dataclasses.dataclass(frozen=True)
class _World:
    world_size: int  # all parse_ranks reads of a ParallelDims for explicit ranks


def verify_layouts(candidates: list[tuple[str, Config]], world: int, ranks: str | None, log=print) -> list[Verified]:
    """Each (label, config) of `candidates`, best first, rehearsed at `world` ranks (module doc). `ranks`:
    --verify-ranks (dryrun's syntax; "default": dryrun's own default, every stage's first and last rank and
    the expert groups'); unset: DEFAULT_RANKS."""
    text = ranks or DEFAULT_RANKS
    log(f"verify: the {len(candidates)} best layout{'s' * (len(candidates) > 1)} built at {world} ranks on the meta "
        f"device (ranks {text}, one process each; `shardwise dryrun` for the full table)")
    out, warmed = [], False
    for index, (label, cfg) in enumerate(candidates, 1):
        start = time.perf_counter()
        done = Verified(index, label)
        out.append(done)
        cfg = planned_precision(cfg)
        try:
            dims = preflight(cfg, world)
        except ConfigError as e:
            done.dropped = f"pre-flight refuses it: {e.field}: {e.problem}"
            log(done.line())
            continue
        chosen = parse_ranks(None if text.strip().lower() == "default" else text, dims, "--verify-ranks")
        if not warmed:  # torch and the model's modules, once for every layout's forked ranks
            took = warm(cfg, spawn=False)
            warmed = True
            if took is not None:
                log(f"  imports, once: {took:.1f} s")
            start = time.perf_counter()
        try:
            done.rows = build_ranks(cfg, dims, chosen, log=lambda _line: None)
        except ConfigError as e:  # a rule only the built rank checks
            done.dropped = f"rank build refused: {e.field}: {e.problem}"
            log(done.line())
            continue
        failed = [r for r in done.rows if "error" in r]
        if failed:
            done.dropped = f"rank {failed[0]['rank']} does not build: {failed[0]['error']}"
        else:
            done.differences = differences(done.rows)
        done.wall_s = time.perf_counter() - start
        done.cpu_s = sum(r["cpu_s"] for r in done.rows)
        done.peak_rss_bytes = max(r["peak_rss_bytes"] for r in done.rows)
        log(done.line())
    return out
