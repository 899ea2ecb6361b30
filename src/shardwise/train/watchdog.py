"""Stall diagnosis: when a collective waits longer than run.collective_timeout_s, say who and where.

The process groups are created with that timeout, so a rank left waiting (a peer stopped, hung, or
stuck in another collective) gets a timeout error from the backend (gloo here; NCCL's own watchdog
aborts instead, with torch's flight-recorder dump). That rank becomes the reporter:

1. it asks every other rank, through the rendezvous store (a channel that does not depend on the
   stuck process groups), to dump its state: each rank's responder thread blocks on its own store key,
   so there is no polling while the run is healthy;
2. every rank that can answer writes <run.dir>/stall/rank_<r>.txt (the Python stack of every thread,
   the step, the last collectives it entered from torch's flight recorder: op, mesh axis, sequence
   number, age) and acknowledges with a one-line summary, then exits (code 5);
3. after a few seconds the reporter names the ranks that did not arrive at its collective (a lower
   sequence number on that group) and those that did not answer at all (stopped, or hung outside
   Python), kills the latter when they run on its own host (a stopped process ignores the SIGTERM the
   launcher would send, which costs the launcher's 30 s shutdown grace), prints the report and exits 5.

The job therefore ends within the timeout plus a few seconds, with no process left behind.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.errors import EXIT_STALLED

ACK_WAIT_S = 5.0
_CLOSE = "close"


def is_timeout(error: BaseException) -> bool:
    """Whether an exception from a collective is the backend's timeout."""
    return isinstance(error, RuntimeError) and "timed out" in str(error).lower()


def flight_record() -> list[dict]:
    """The collectives this process entered, oldest first (torch's flight recorder, enabled by
    TORCH_FR_BUFFER_SIZE before the process group is created; gloo records them since torch 2.7)."""
    try:
        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        return json.loads(raw).get("entries", [])
    except Exception:  # a private API: without it the report lacks the collectives, nothing else
        return []


def describe_entry(entry: dict, axes: dict[str, str] | None = None) -> dict:
    """{"op", "axis", "group", "seq", "age_s"} of a flight-recorder entry; `axes` names the groups
    (process-group name -> mesh axis, the trainer's: a 1-D mesh may run on the default group)."""
    name, desc = (entry.get("process_group") or ["?", "?"])[:2]
    axis = (axes or {}).get(name) or ("world" if desc == "default_pg" else
                                      desc[len("mesh_"):] if desc.startswith("mesh_") else desc)
    age = (time.time_ns() - entry.get("time_created_ns", 0)) / 1e9 if entry.get("time_created_ns") else None
    return {"op": entry.get("profiling_name", "?").split(":")[-1], "axis": axis or name, "group": name,
            "seq": entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id"),
            "age_s": round(age, 1) if age is not None else None}


def _last_seq_per_group(entries: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        if not e.get("is_p2p"):
            out[(e.get("process_group") or ["?"])[0]] = e.get("collective_seq_id", 0)
    return out


def _fmt(c: dict | None) -> str:
    if not c:
        return "no collective recorded"
    age = f", entered {c['age_s']:.0f} s ago" if c.get("age_s") is not None else ""
    return f"{c['op']} on {c['axis']} (#{c['seq']}{age})"


class StallWatchdog:
    """One per worker process, started after the default process group exists."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, prefix: str):
        self.dir = run_dir / "stall"
        self.rank, self.world_size = rank, world_size
        self.prefix = f"shardwise/stall/{prefix}/"
        # The worker points these at its trainer once there is one: the step, and the mesh axis of
        # each process group (parallel/comm_counter.py axis_names).
        self.step = lambda: None
        self.axes: callable = lambda: {}
        # Clients of our own (a client serialises its calls): one for this thread, one for the
        # responder's blocking wait; the default group's client stays the main thread's.
        self.store, self._waiter = (dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                                  is_master=False, timeout=timedelta(seconds=30),
                                                  wait_for_workers=False) for _ in range(2))
        self.store.set(self._key(f"info/{rank}"), json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        self._thread = threading.Thread(target=self._respond, name="shardwise-stall-responder", daemon=True)
        self._thread.start()

    def _key(self, name: str) -> str:
        return self.prefix + name

    def wait_for_rank0(self, name: str, timeout_s: float = 24 * 3600) -> None:
        """Rank 0 marks `name` done; the others wait for the mark on the store (no collective: the
        wait may be long, e.g. tokenizing a new corpus)."""
        key = self._key(f"ready/{name}")
        if self.rank == 0:
            self.store.set(key, "1")
        else:
            self.store.wait([key], timedelta(seconds=timeout_s))

    def close(self) -> None:
        """Wake this rank's responder so it ends (normal shutdown)."""
        try:
            self.store.set(self._key(f"req/{self.rank}"), _CLOSE)
        except Exception:
            return
        self._thread.join(timeout=5)

    # ---- every rank ----
    def dump(self, error: BaseException | None = None) -> dict:
        """Write this rank's stacks and recent collectives; return its summary. The rank whose
        collective timed out passes the error: its traceback shows where it waited."""
        entries = flight_record()
        axes = self.axes()
        summary = {"rank": self.rank, "step": self.step(), "last": describe_entry(entries[-1], axes) if entries else None,
                   "seqs": _last_seq_per_group(entries)}
        lines = [f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}), step {summary['step']}"]
        lines.append("last collectives entered (oldest first; torch flight recorder):")
        lines += [f"  {_fmt(describe_entry(e, axes))}" for e in entries[-12:]] or ["  (none recorded)"]
        if error is not None:
            lines.append("\nwhere it waited:")
            lines += [line.rstrip() for line in traceback.format_exception(error)]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            lines.append(f"\nthread {names.get(ident, ident)}:")
            lines += [line.rstrip() for line in traceback.format_stack(frame)]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"rank_{self.rank}.txt").write_text("\n".join(lines) + "\n")
        except OSError:
            pass
        return summary

    def _respond(self) -> None:
        key = self._key(f"req/{self.rank}")
        try:
            self._waiter.wait([key], timedelta(days=365))
            reporter = self._waiter.get(key).decode()
        except Exception:  # the store went away: the job is over
            return
        if reporter == _CLOSE:
            return
        summary = self.dump()
        try:
            self._waiter.set(self._key(f"ack/{self.rank}"), json.dumps(summary))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_STALLED)  # the run is over; the main thread is stuck in a collective

    # ---- the rank whose collective timed out ----
    def report(self, error: BaseException) -> str:
        """Gather every rank's state and return the report (the first line is the summary)."""
        own = self.dump(error)
        if self.store.add(self._key("reporters"), 1) > 1:
            return ""  # another rank timed out first and reports; its request reaches our responder
        self.store.set(self._key(f"req/{self.rank}"), _CLOSE)
        others = [r for r in range(self.world_size) if r != self.rank]
        for r in others:
            self.store.set(self._key(f"req/{r}"), str(self.rank))
        acks: dict[int, dict] = {}
        deadline = time.monotonic() + ACK_WAIT_S
        while len(acks) < len(others) and time.monotonic() < deadline:
            for r in others:
                if r not in acks and self.store.check([self._key(f"ack/{r}")]):
                    acks[r] = json.loads(self.store.get(self._key(f"ack/{r}")))
            time.sleep(0.1)
        silent = [r for r in others if r not in acks]
        killed = self._kill_local(silent)
        behind = self._behind(own, acks)
        head = (f"stalled: at step {own['step']} rank {self.rank} waited longer than run.collective_timeout_s in "
                f"{_fmt(own['last'])}")
        parts = []
        if behind:
            parts.append(f"rank(s) {', '.join(map(str, behind))} did not arrive at it")
        if silent:
            parts.append(f"rank(s) {', '.join(map(str, silent))} did not respond (stopped, or hung outside Python"
                         + ("; killed" if killed else "") + ")")
        lines = [head + (": " + "; ".join(parts) if parts else "") + f"; stacks in {self.dir}/"]
        for r in sorted(acks):
            lines.append(f"  rank {r}: step {acks[r]['step']}, last collective {_fmt(acks[r]['last'])}")
        return "\n".join(lines)

    def _behind(self, own: dict, acks: dict[int, dict]) -> list[int]:
        """Answering ranks of the timed-out collective's group whose last entry there is older."""
        last = own.get("last")
        if not last:
            return []
        return sorted(r for r, a in acks.items()
                      if last["group"] in a["seqs"] and a["seqs"][last["group"]] < (last["seq"] or 0))

    def _kill_local(self, ranks: list[int]) -> bool:
        host = socket.gethostname()
        killed = False
        for r in ranks:
            try:
                info = json.loads(self.store.get(self._key(f"info/{r}")))
                if info["host"] == host:
                    os.kill(info["pid"], signal.SIGKILL)
                    killed = True
            except Exception:
                continue
        return killed
