"""Find the slow rank (run.straggler_every): per-rank timing every step, gathered every few steps, and one
line that names a rank that stays slower than the others, with the part of the step that is slow.

A rank that is merely slow (a throttled GPU, a busy host, a starving data loader) costs every rank every
step, because the collectives wait for it; its own wall-clock step time is the same as everyone's. What
differs is where the time goes, so each rank measures two things of its own, neither of which waits for
another rank:

- compute: the time of its transformer blocks' forwards, from after FSDP's parameter gather (its
  pre-forward hook) to before FSDP's reshard (its post-forward hook) — CUDA events on GPUs, the wall clock
  on CPUs. It is per block call (recomputation's forwards included), so pipeline stages with different
  layer counts compare. Tensor-parallel collectives run inside a block, so the ranks of one tensor-parallel
  group share their slowest member's time: the line names them together ("every rank of host b") when
  they fill a host, which is where tensor parallelism runs.
- data: the time the step waits for its batch (the loader's queue).

Every `every` steps one small all-gather brings each rank's medians over the window to rank 0, which
compares each with the median of the other ranks (MegaScale, Jiang et al., NSDI 2024: a straggler shows
against its peers, not against an absolute bar; Megatron-LM's straggler detector reports the min / max
ranks the same way). A rank whose compute is `margin` above the others' median, or whose data wait is
`margin` of the rest of its own step more than theirs, in consecutive windows covering at least `steps`
steps, is a straggler: rank 0 prints one line for it, and one when it recovers. Every rank runs the same verdict on
the same gathered numbers (rank 0 alone prints), so that with run.evict_stragglers every rank also reaches the
same eviction at the same step without another collective (train/eviction.py).
"""
from __future__ import annotations

import math
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.train import eviction
from shardwise.train.collective_wait import CollectiveClock
from shardwise.train.eviction import Eviction, NodeSeat


@dataclass
class RankTimes:
    """One rank's window medians: a block forward's seconds, the data wait and the step's wall time."""

    rank: int
    host: str
    compute_s: float
    data_s: float
    step_s: float
    waits: dict[str, float] = field(default_factory=dict)  # axis -> its collectives' device seconds a step (NCCL)


class BlockTimer:
    """Times every block forward of this rank (module docstring): hooks placed inside FSDP's, so a block's
    time is its compute, not its wait for parameters."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds, self.calls = 0.0, 0
        self._open: list = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pool: list[torch.cuda.Event] = []  # read events, recorded again: none created after the first step
        self._handles = []
        # Compiled blocks (train.compile: nn.Module.compile compiles the call, hooks included) run these hooks
        # eagerly: a clock read or a list append in the graph would be a constant or a break in its middle; at
        # the frame's two ends the block's own graph stays whole (one more graph per block, measured).
        start, stop = torch.compiler.disable(self._start), torch.compiler.disable(self._stop)
        for block in blocks:
            # FSDP2 prepends its pre-forward hook (the all-gather's wait) and appends its post-forward hook
            # (reshard): appended / prepended here, these run inside them.
            self._handles.append(block.register_forward_pre_hook(start))
            self._handles.append(block.register_forward_hook(stop, prepend=True))

    def _start(self, _module, _args) -> None:
        if self.cuda:
            event = self._event()
            event.record()
            self._open.append(event)
        else:
            self._open.append(time.perf_counter())

    def _stop(self, _module, _args, _out) -> None:
        if not self._open:  # a forward that began before the hooks were placed
            return
        begin = self._open.pop()
        self.calls += 1
        if self.cuda:
            end = self._event()
            end.record()
            self._events.append((begin, end))
        else:
            self.seconds += time.perf_counter() - begin

    def _event(self) -> torch.cuda.Event:
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def take(self) -> tuple[float, int]:
        """(seconds, block calls) since the last take; on CUDA after the step's own host sync, so every event
        has completed and reading them waits for nothing."""
        if self._events:
            self.seconds += sum(b.elapsed_time(e) for b, e in self._events) / 1e3
            self._pool.extend(event for pair in self._events for event in pair)
            self._events.clear()
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class StragglerWatch:
    """Each rank's timing of each step; every `every` steps the window's medians to rank 0 and its verdict."""

    every: int
    margin: float
    steps: int
    rank: int
    group: object | None
    device: torch.device
    timer: BlockTimer | None = None
    host: str = field(default_factory=socket.gethostname)
    _window: list[tuple[float, float, float]] = field(default_factory=list)  # per step: block forward, data, step
    _slow_windows: dict[int, int] = field(default_factory=dict)  # rank -> consecutive slow windows
    named: dict[int, int] = field(default_factory=dict)  # rank -> the step it was named at
    _hosts: list[str] = field(default_factory=list)
    seat: NodeSeat | None = None  # this rank's node in an elastic job that evicts stragglers, else None
    _nodes: list[int] = field(default_factory=list)  # rank -> its node (seat.node_rank), with seat
    eviction: Eviction | None = None  # decided at the end of a window: every rank stops after this step
    last_step: int = 0  # the run's last step, after which nothing is evicted (the job is done); 0: no limit
    clock: CollectiveClock | None = None  # per-axis collective time (train/collective_wait.py), NCCL only

    @classmethod
    def start(cls, run_cfg, blocks: list[torch.nn.Module], rank: int, group, device: torch.device,
              seat: NodeSeat | None = None, last_step: int = 0, axis_groups=()) -> "StragglerWatch | None":
        """`axis_groups`: (mesh axis, process group) pairs whose collectives are timed where the backend can."""
        if run_cfg.straggler_every <= 0:
            return None
        return cls(run_cfg.straggler_every, run_cfg.straggler_margin, run_cfg.straggler_steps, rank, group, device,
                   BlockTimer(blocks, device), seat=seat, last_step=last_step,
                   clock=CollectiveClock.start(axis_groups, dist.get_backend))

    def after_step(self, step: int, step_s: float, data_s: float) -> tuple[dict, list[str]] | None:
        """Record step `step`; at the end of a window (every rank calls this: it is a collective) rank 0
        gets the window's metrics and the lines to print, the other ranks None."""
        seconds, calls = self.timer.take()
        self._window.append((seconds / max(1, calls), data_s, step_s))
        if step % self.every:
            return None
        # Each figure's median over the window's steps: a one-off pause (a collection, a page fault storm)
        # moves a mean, not the median.
        mine = [statistics.median(values) for values in zip(*self._window)]
        window = len(self._window)
        self._window.clear()
        if self.clock is not None:  # a mean a step (collective_wait.py: durations land as the watchdog sees them)
            mine += [seconds / window for seconds, _ in self.clock.take().values()]
        ranks = self._gather(mine)
        verdict = self.judge(ranks, step, window)  # on every rank: the same numbers give the same eviction
        return verdict if self.rank == 0 else None

    def _gather(self, mine: list[float]) -> list[RankTimes]:
        """Every rank's window medians (one all-gather of three floats a window); hosts once, on the first."""
        if not self._hosts:
            node = self.seat.node_rank if self.seat is not None else -1
            if self.group is None:
                seats = [(self.host, node)]
            else:
                seats = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(seats, (self.host, node), group=self.group)
            self._hosts = [str(h) for h, _ in seats]
            self._nodes = [int(n) for _, n in seats]
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        if self.group is None:
            rows = [local]
        else:
            rows = [torch.zeros_like(local) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, local, group=self.group)
        axes = self.clock.axes if self.clock is not None else []
        return [RankTimes(r, self._hosts[r], *values[:3], dict(zip(axes, values[3:])))
                for r, values in enumerate(row.tolist() for row in rows)]

    def judge(self, ranks: list[RankTimes], step: int, window: int) -> tuple[dict, list[str]]:
        """Rank 0's verdict on one window: the metrics record and the lines to print (module docstring)."""
        compute = statistics.median(r.compute_s for r in ranks)
        data = statistics.median(r.data_s for r in ranks)
        # Each rank against the median of the others (with two ranks, the other one: a median that includes the
        # straggler itself would halve what it shows). Data: its wait as a share of the rest of its own step,
        # so a rank waiting margin x its own work for batches is slow by margin, as a compute straggler is.
        others_compute = medians_without_each([r.compute_s for r in ranks])
        waits = [r.data_s / max(1e-9, r.step_s - r.data_s) for r in ranks]
        others_wait = medians_without_each(waits)
        slow: dict[int, tuple[str, float, float]] = {}  # rank -> (component, its figure, the others' median)
        for r, ref, wait, ref_wait in zip(ranks, others_compute, waits, others_wait) if len(ranks) > 1 else ():
            over_compute = r.compute_s / ref - 1 if ref > 0 else 0.0
            over_data = wait - ref_wait
            if max(over_compute, over_data) > self.margin:
                slow[r.rank] = ("compute", r.compute_s, ref) if over_compute >= over_data else ("data", wait, ref_wait)
        lines = []
        needed = -(-self.steps // self.every)  # windows: at least `steps` steps slow in a row
        for r in ranks:
            if r.rank in slow:
                self._slow_windows[r.rank] = self._slow_windows.get(r.rank, 0) + 1
            else:
                self._slow_windows.pop(r.rank, None)
                if r.rank in self.named:
                    since = self.named.pop(r.rank)
                    lines.append(f"straggler: rank {r.rank} on host {r.host} is no longer slow (named at step {since})")
        fresh = [rank for rank in slow if self._slow_windows[rank] >= needed and rank not in self.named]
        self.named.update((rank, step) for rank in fresh)
        named_lines = self._lines(fresh, ranks, slow, needed * self.every)  # rank -> the line naming it
        lines += list(dict.fromkeys(named_lines.values()))  # a whole host's line once
        if self.seat is not None and fresh and self.eviction is None and not 0 < self.last_step <= step:
            self.eviction, why_not = eviction.choose(fresh, self._nodes, self._hosts, self.seat.min_nodes, step,
                                                     named_lines)
            if self.eviction is not None:
                lines.append(eviction.announce(self.eviction, len(set(self._nodes)), self.seat.cooldown_s))
            elif why_not:
                lines.append(why_not)
        worst = max(ranks, key=lambda r: r.compute_s)
        record = {"straggler/slowest_rank": worst.rank,
                  "straggler/compute_spread": worst.compute_s / compute if compute > 0 else 1.0,
                  "straggler/compute_median_s": compute, "straggler/data_wait_max_s": max(r.data_s for r in ranks),
                  "straggler/data_wait_median_s": data, "straggler/named": len(self.named),
                  "straggler/window_steps": window}
        for axis in ranks[0].waits:  # NCCL: each axis's collective time a step, the median rank's and the longest
            waits_on_axis = [r.waits[axis] for r in ranks]
            if any(math.isnan(w) for w in waits_on_axis):  # a rank could not time it (collective_wait.py)
                continue
            record[f"straggler/collective_{axis}_median_s"] = statistics.median(waits_on_axis)
            record[f"straggler/collective_{axis}_max_s"] = max(waits_on_axis)
        return record, lines

    def _lines(self, fresh: list[int], ranks: list[RankTimes], slow: dict, steps: int) -> dict[int, str]:
        """The line naming each newly named straggler; a host whose every rank is named gets one line for all."""
        by_host: dict[str, list[RankTimes]] = {}
        for r in ranks:
            by_host.setdefault(r.host, []).append(r)
        lines: dict[int, str] = {}
        for rank in fresh:
            if rank in lines:
                continue
            r = ranks[rank]
            component, own, ref = slow[rank]
            peers = by_host[r.host]
            whole = len(ranks) > len(peers) and all(p.rank in self.named for p in peers)
            covered = [p.rank for p in peers] if whole else [rank]
            if whole:
                who = f"every rank of host {r.host} ({', '.join(str(p.rank) for p in peers)})"
            else:
                who = f"rank {rank} on host {r.host} ({self.device.type})"
            if component == "compute":
                what = (f"compute {own / ref:.2f}x the other ranks' median for {steps} steps (a block forward "
                        f"{1e3 * r.compute_s:.2f} ms against {1e3 * ref:.2f} ms{waited_words(ranks, rank)}) — a throttled "
                        "GPU or a busy host? "
                        f"`shardwise doctor` on {r.host} names clocks, temperatures and link speed")
            else:
                what = (f"waits for data {r.data_s:.3f} s a step, {own:.2f}x the "
                        f"rest of its step (the other ranks' median {ref:.2f}x), for {steps} steps — a slow disk or too few "
                        f"loader workers? raise data.num_workers, check the disk of {r.host}")
            lines.update((covered_rank, f"straggler: {who}: {what}") for covered_rank in covered)
        return lines

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()


def waited_words(ranks: list[RankTimes], rank: int) -> str:
    """"; the others wait 41.2 ms a step longer in tp collectives" — the axis where the other ranks' median
    collective time exceeds this rank's own by most (they wait for it there; it waits least), or "" without
    per-axis times (gloo) or when no axis shows it."""
    own = ranks[rank].waits
    others = [r for r in ranks if r.rank != rank]
    if not own or not others:
        return ""
    gaps = {axis: statistics.median(r.waits[axis] for r in others) - seconds for axis, seconds in own.items()}
    gaps = {axis: gap for axis, gap in gaps.items() if not math.isnan(gap)}
    axis = max(gaps, key=gaps.__getitem__) if gaps else None
    return f"; the others wait {1e3 * gaps[axis]:.1f} ms a step longer in {axis} collectives" if axis and gaps[axis] > 0 else ""


def medians_without_each(values: list[float]) -> list[float]:
    """For each value, the median of all the others (O(n log n): one sort, then an index per value); a lone
    value's is itself."""
    n = len(values)
    if n < 2:
        return list(values)
    order = sorted(range(n), key=values.__getitem__)
    ordered = [values[i] for i in order]
    position = {i: p for p, i in enumerate(order)}
    m = n - 1

    def other(p: int, k: int) -> float:  # the k-th smallest of the others when position p is left out
        return ordered[k] if k < p else ordered[k + 1]

    out = []
    for i in range(n):
        p = position[i]
        out.append(other(p, m // 2) if m % 2 else (other(p, m // 2 - 1) + other(p, m // 2)) / 2)
    return out
