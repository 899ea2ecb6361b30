"""Training metrics: token rate and MFU, and the rank-0 logger (what each rank holds: train/memory_meter.py).

The definitions are the ones in docs/architecture.md §5, used by the trainer and (through the same formulas) by
the planner.
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


# ---- rates (docs/architecture.md §5) ----
def tokens_per_s_per_device(tokens: int, seconds: float, non_dp_size: int) -> float:
    """docs/architecture.md §5: tokens/s per device = tokens processed / (seconds x non-data-parallel size).

    `tokens` are the tokens one data-parallel replica processed in `seconds`; the tp x cp x pp (x ep)
    devices of that replica share them, so each device is credited with 1/non_dp_size of them.
    """
    if seconds <= 0 or non_dp_size < 1:
        raise ValueError(f"need seconds > 0 and non_dp_size >= 1, got {seconds}, {non_dp_size}")
    return tokens / (seconds * non_dp_size)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float) -> float:
    """docs/architecture.md §5: MFU = flops_per_token x tokens/s per device / peak FLOP/s of the device.

    Model FLOPs utilization as defined by Chowdhery et al. 2022 (PaLM, arXiv 2204.02311, App. B):
    model FLOPs only, so recomputation does not raise it. `peak_flops` comes from spec/hardware.py.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_token * tokens_per_s_per_device / peak_flops


# ---- memory by category ----


# ---- logging ----
def _fmt_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _json_default(o: Any) -> Any:
    """Tensors and numpy scalars in a metrics record become plain numbers."""
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record with every non-finite number replaced by null, and the names of those top-level
    keys in "nonfinite": JSON has no NaN or Infinity, and metrics.jsonl must stay readable by any
    JSON parser (a diverging step's loss is NaN)."""
    bad: list[str] = []

    def clean(value: Any, key: str | None) -> Any:
        if hasattr(value, "item") and not isinstance(value, (list, dict)):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            if key is not None:
                bad.append(key)
            return None
        if isinstance(value, dict):
            return {k: clean(v, None) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, None) for v in value]
        return value

    out = {k: clean(v, k) for k, v in record.items()}
    if bad:
        out["nonfinite"] = bad
    return out


class MetricsLogger:
    """Rank 0's metrics.jsonl, TensorBoard scalars, progress bar and loss-curve plot.

    On other ranks (`is_writer=False`) every method is a no-op, so the trainer calls it
    unconditionally. `progress` is called every step: between redraws it only updates a rich task
    (a few microseconds); rich's own thread redraws at `refresh_per_second=4`. Without a terminal
    (CI, pipes) no live bar is drawn; a plain status line is printed about every 10% of the run.
    """

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, is_writer: bool, progress: bool,
                 tensorboard: bool, loss_curve: bool = True, live: Any = None):
        """`live`: rank 0's Prometheus endpoint (train/live_metrics.py LiveMetrics): every record logged is
        served there too, and close() stops it."""
        self._live = live
        self.run_dir = Path(run_dir)
        self._loss_curve = loss_curve
        self.total_steps = total_steps
        self.start_step = start_step
        self.is_writer = is_writer
        self._show_progress = progress and is_writer
        self._t0 = self._t_first = time.perf_counter()
        self._every = max(1, math.ceil((total_steps - start_step) / 10))
        self._file = None
        self._tb = None
        self._hook = threading.excepthook
        self._bar = None
        self._task = None
        self._closed = not is_writer
        # step 1's loss, for loss_curve.png: metrics.jsonl has records of logged steps only (every
        # train.log_every), so a short run's picture started at step log_every without its first loss
        self._first_loss: float | None = None
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if start_step == 0 and path.is_file() and path.stat().st_size:
            moved = _set_aside(path)  # a run starting over keeps the earlier run's records, apart
            self.print(f"metrics: this run starts over; the earlier run's records moved to {moved.name}")
        elif start_step > 0 and path.is_file():
            # One history: the records of steps a resume undoes (after a divergence, a crash or an elastic
            # restart, the steps after the checkpoint are trained again) move aside, as their checkpoints do.
            undone, moved = _undo_records(path, start_step)
            if undone:
                self.print(f"metrics: {undone} record{'s' if undone != 1 else ''} of steps after {start_step} (trained "
                           f"again from the checkpoint) moved to {moved.name}")
        if path.is_file() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"  # a process killed mid-write: never glue a record onto that line
        else:
            torn = False
        self._file = open(path, "a", encoding="utf-8")
        if torn:
            self._file.write("\n")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events a resume undoes (those of steps after start_step).
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), flush_secs=10,
                                     purge_step=start_step + 1 if start_step > 0 else None)
            self._hook = threading.excepthook
            threading.excepthook = self._quiet_tensorboard_io
        if self._show_progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("step"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}"),
                                 TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                 auto_refresh=True, refresh_per_second=4)
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step,
                                            loss=float("nan"), tps=0.0)
            self._bar.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append {"step": step, **metrics} to metrics.jsonl (flushed, so a crash keeps it) and
        write TensorBoard scalars."""
        if self._closed or self._file is None:
            return
        self._file.write(json.dumps(strict_record({"step": step, **metrics}), allow_nan=False) + "\n")
        self._file.flush()
        if self._live is not None:
            self._live.update(step, metrics)
        if self._tb is not None:
            for name, value in metrics.items():
                value = _json_default(value) if hasattr(value, "item") else value
                if isinstance(value, (int, float)) and name != "time":  # TensorBoard keeps its own wall time
                    self._tb.add_scalar(name, value, step)

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Advance the bar to `step` (or print a plain status line about every 10% without a TTY); keep step 1's
        loss for loss_curve.png."""
        if step == 1 and self.start_step == 0 and self.is_writer:
            self._first_loss = float(loss)
        if self._closed or not self._show_progress:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
            return
        done, now = step - self.start_step, time.perf_counter()
        if done == 1:
            self._t_first = now
        if done == 1 or done % self._every == 0 or step >= self.total_steps:
            elapsed = now - self._t0
            # From the steps after the first: the first also compiles, warms the allocator and the data
            # (5x a later step on the demo), so an ETA that counts it is far off; after step 1: unknown.
            eta = (self.total_steps - step) * (now - self._t_first) / (done - 1) if done > 1 else float("nan")
            pct = 100 * step / max(1, self.total_steps)
            print(f"step {step}/{self.total_steps} ({pct:.0f}%) | loss {loss:.4f} | {tokens_per_s:,.0f} tok/s | "
                  f"elapsed {_fmt_seconds(elapsed)} | eta {_fmt_seconds(eta)}", flush=True)

    def print(self, text: str) -> None:
        """Print a line above the live bar (or plainly without one)."""
        if not self.is_writer:
            return
        if self._bar is not None and not self._closed:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def _quiet_tensorboard_io(self, args: threading.ExceptHookArgs) -> None:
        """TensorBoard writes events from a thread of its own, which dies printing a traceback when the
        disk is full or read-only; the run says that itself (metrics.jsonl fails too: exit 4, one
        line), and close() warns that the events are incomplete. Other threads' exceptions go on."""
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        self._hook(args)

    def close(self) -> None:
        """Stop the bar, close the files and write loss_curve.png (run.loss_curve). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.close()
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as e:  # the run ends with its own line (a full disk: exit 4); this one is a warning
                print(f"warning: TensorBoard events in {self.run_dir / 'tensorboard'} are incomplete: "
                      f"{e.strerror or e}", flush=True)
            threading.excepthook = self._hook
        if self._file is not None:
            self._file.close()
        if not self._loss_curve:
            return
        try:
            plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png", self._first_loss)
        except Exception as e:  # close() runs in the trainer's `finally`: never mask the real error
            print(f"warning: could not write {self.run_dir / 'loss_curve.png'}: {e}", flush=True)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _free_name(path: Path, tag: str = "") -> Path:
    """metrics.jsonl -> metrics.<tag>1.jsonl, or the next free number."""
    n = 1
    while (path.with_name(f"{path.stem}.{tag}{n}{path.suffix}")).exists():
        n += 1
    return path.with_name(f"{path.stem}.{tag}{n}{path.suffix}")


def _set_aside(path: Path) -> Path:
    """metrics.jsonl -> metrics.1.jsonl (or the next free number); returns the new path."""
    target = _free_name(path)
    path.rename(target)
    return target


def _undo_records(path: Path, start_step: int) -> tuple[int, Path]:
    """Move the records of steps after `start_step` from metrics.jsonl to metrics.undone.N.jsonl (a torn last
    line, from a killed process, is dropped); returns how many moved, and where."""
    kept, undone = [], []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        (undone if isinstance(record, dict) and record.get("step", 0) > start_step else kept).append(line.rstrip(b"\n") + b"\n")
    target = _free_name(path, "undone.")
    if undone:
        target.write_bytes(b"".join(undone))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
    return len(undone), target


def read_metrics(metrics_jsonl: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, one per step (the last wins: a resumed run re-logs the steps
    after its checkpoint), sorted by step; a validation round's record (valid_* keys) is merged into its
    step's. A torn last line from a crash is skipped."""
    by_step: dict[tuple[int, bool], dict[str, Any]] = {}
    for line in Path(metrics_jsonl).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            by_step[int(record["step"]), any(k.startswith("valid_loss_") for k in record)] = record
    steps = sorted({step for step, _ in by_step})
    return [{**by_step.get((s, False), {}), **by_step.get((s, True), {})} for s in steps]


def loss_points(records: list[dict], first_loss: float | None = None) -> list[tuple[int, float]]:
    """(step, loss) of loss_curve.png: the records' losses, step 1's first where no record has it."""
    losses = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    if first_loss is not None and math.isfinite(first_loss) and not any(step == 1 for step, _ in losses):
        losses.insert(0, (1, first_loss))
    return losses


def plot_loss_curve(metrics_jsonl: Path, out_png: Path, first_loss: float | None = None) -> None:
    """Loss vs step (and lr on a secondary axis when logged) from metrics.jsonl, as a PNG; `first_loss`: step 1's
    loss (MetricsLogger keeps it), drawn first where metrics.jsonl has no record of step 1.

    Uses matplotlib's object API with the Agg canvas (no pyplot, so no global figure state and no
    display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_jsonl = Path(metrics_jsonl)
    records = read_metrics(metrics_jsonl) if metrics_jsonl.is_file() else []
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    losses = loss_points(records, first_loss)
    if losses:
        ax.plot(*zip(*losses), color="tab:blue", label="loss")
    else:
        ax.text(0.5, 0.5, "no loss records", transform=ax.transAxes, ha="center", va="center")
    for name in sorted({k for r in records for k in r if k.startswith("valid_loss_")}):  # validation rounds
        points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
        ax.plot(*zip(*points), marker="o", markersize=3, label=f"valid {name[len('valid_loss_'):]}")
    if any(k.startswith("valid_loss_") for r in records for k in r):
        ax.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(alpha=0.3)
    lrs = [(r["step"], r["lr"]) for r in records if isinstance(r.get("lr"), (int, float))]
    if lrs:
        ax2 = ax.twinx()
        ax2.plot(*zip(*lrs), color="tab:orange", linewidth=1, label="lr")
        ax2.set_ylabel("learning rate", color="tab:orange")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_title(metrics_jsonl.resolve().parent.name)
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
