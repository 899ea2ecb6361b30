"""Training metrics: token rate and MFU, per-rank memory by category, and the rank-0 logger.

The definitions are the ones in docs/architecture.md §5, used by the trainer and (through the same formulas) by
the planner. Memory is counted from the tensors a rank actually holds: docs/architecture.md §9 notes that RSS does
not show sharding, so DTensors are counted by their local shard and every storage only once.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.tensors import local_shard


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


def _storage_key(t: torch.Tensor) -> tuple[Hashable | None, int]:
    """(key, bytes) of the storage behind `t`. Views of one storage share a key, so it is counted
    once, in full: a view keeps its whole storage alive. Key None means "cannot dedupe" (meta or
    storage-less tensors), which then count by their own size."""
    t = local_shard(t)
    try:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, t.nelement() * t.element_size()
    if ptr == 0:
        return None, nbytes
    # nbytes in the key: an address freed and reused for a different-sized storage is a new storage.
    return (str(t.device), ptr, nbytes), nbytes


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages behind `tensors` (DTensors by their local shard)."""
    seen: set[Hashable] = set()
    total = 0
    for t in tensors:
        key, nbytes = _storage_key(t)
        if key is None or key not in seen:
            total += nbytes
            if key is not None:
                seen.add(key)
    return total


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor in the optimizer state this rank holds. ZeroOneOptimizer keeps its
    local shard's state in the wrapped `optimizer.optim.state` (ZeRO-1, arXiv 1910.02054)."""
    inner = getattr(optimizer, "optim", None)
    state = inner.state if isinstance(inner, torch.optim.Optimizer) else optimizer.state
    for per_param in state.values():
        yield from _tensors_in(per_param)


def memory_by_category(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds for "params", "grads", "optimizer" state and "buffers" (docs/architecture.md §5/§6;
    the categories of the model-state count 2Ψ+2Ψ+12Ψ in Rajbhandari et al. 2019, arXiv 1910.02054)."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(optimizer_state_tensors(optimizer)) if optimizer is not None else 0,
        "buffers": tensor_bytes(model.buffers()),
    }


def cuda_memory(device: torch.device | int | None = None) -> dict[str, int]:
    """Peak allocated / reserved CUDA bytes on this rank ({} without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device)}


class ActivationMeter:
    """Bytes of the unique storages autograd saves for backward during one forward.

    Uses `torch.autograd.graph.saved_tensors_hooks`: the pack hook sees every tensor saved for
    backward. Parameters (and views of them, e.g. the `weight.t()` that addmm saves) are not
    activations, so their storages are excluded. Pass the model itself as `exclude` to also exclude
    parameters that appear only during forward (FSDP2's unsharded parameters): a forward pre-hook on
    every submodule then adds the parameters registered at call time. Autocast's low-precision weight
    copies are new storages and count as activations (they are held until backward).
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] = (), cached_regions: Iterable[nn.Module] = (),
                 cached_ops: frozenset = frozenset()):
        """`cached_regions` / `cached_ops`: under selective "op" recomputation torch's checkpoint keeps
        the outputs of `cached_ops` (matmuls, SDPA: parallel/activation_checkpoint.py) run inside those
        modules in a cache of its own, where saved-tensor hooks cannot see them; a dispatch mode counts
        their storages instead (they are kept until the block's backward, like any saved tensor)."""
        self.bytes = 0
        self._regions, self._cached_ops = list(cached_regions), cached_ops
        self._depth = 0
        self._mode: Any = None
        self._module = exclude if isinstance(exclude, nn.Module) else None
        self._excluded: set[Hashable] = set()
        self._excluded_by: dict[Hashable, torch.Tensor] = {}
        self._seen: set[Hashable] = set()
        self._exclude(exclude.parameters() if self._module is not None else exclude)
        self._handles: list[Any] = []
        self._hooks: Any = None

    def _exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key, _ = _storage_key(t)
            if key is not None:
                self._excluded.add(key)
                self._excluded_by[key] = t

    def _still_excluded(self, key: Hashable) -> bool:
        """An excluded key is stale once its parameter's storage has moved or been freed: FSDP2 frees
        the unsharded parameters after forward (ZeRO-3), and the allocator may hand the address to
        an activation of the same size, which must then be counted."""
        param = self._excluded_by.get(key)
        if param is None or _storage_key(param)[0] == key:
            return True
        self._excluded.discard(key)
        del self._excluded_by[key]
        return False

    def _pre_forward(self, module: nn.Module, _args: Any) -> None:
        self._exclude(module.parameters())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            key, nbytes = _storage_key(t)
            if key is None:
                self.bytes += nbytes
            elif not (key in self._excluded and self._still_excluded(key)) and key not in self._seen:
                self._seen.add(key)
                self.bytes += nbytes
        # A detached alias, not `t`: for a saved output (ReLU, SDPA out, ...) `t` holds its own
        # grad_fn, and autograd keeping it would be a reference cycle through the C++ graph: the
        # measured micro-batch's graph (and those storages) would never be freed.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _count(self, t: torch.Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key is None or key not in self._seen:
            self._seen.add(key)
            self.bytes += nbytes

    def _enter_region(self, *_: Any) -> None:
        self._depth += 1

    def _leave_region(self, *_: Any) -> None:
        self._depth -= 1

    def __enter__(self) -> ActivationMeter:
        self.bytes = 0
        self._seen.clear()
        if self._module is not None:
            self._handles = [m.register_forward_pre_hook(self._pre_forward) for m in self._module.modules()]
        for region in self._regions:
            self._handles += [region.register_forward_pre_hook(self._enter_region),
                              region.register_forward_hook(self._leave_region)]
        if self._cached_ops and self._regions:
            self._mode = _CachedOutputs(self)
            self._mode.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []


class _CachedOutputs(TorchDispatchMode):
    """ActivationMeter's count of what selective checkpointing caches (see ActivationMeter.__init__)."""

    def __init__(self, meter: ActivationMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.meter._depth and func in self.meter._cached_ops:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.meter._count(t)
        return out


class _SavedActivation:
    """What PeakActivationMeter's pack hook gives autograd in place of a saved tensor (a detached
    alias: the tensor itself would, for a saved output, hold its own grad_fn, a reference cycle
    through autograd's C++ graph that never frees the graph; unpacking re-attaches it). Autograd keeps
    it as long as the saved tensor: it drops it when the node's backward has run (retain_graph=False;
    a split backward's input pass retains it until the weight pass) or when the graph is freed. The
    finalizer then releases the storage from the meter's live set."""

    __slots__ = ("tensor", "key", "nbytes", "meter")

    def __init__(self, tensor: torch.Tensor, key: Hashable | None, nbytes: int, meter: PeakActivationMeter):
        self.tensor, self.key, self.nbytes, self.meter = tensor, key, nbytes, meter

    def __del__(self) -> None:
        self.meter._release(self.key, self.nbytes)


class PeakActivationMeter(ActivationMeter):
    """The peak, over everything run inside it, of the bytes of the unique storages autograd holds
    saved for backward at once (the exclusion rules of ActivationMeter: parameters, and with a module
    as `exclude` the parameters its submodules hold at call time).

    Under a pipeline schedule a rank runs the forwards and backwards of several micro-batches
    interleaved, so what it needs is the peak of the activations alive at once (1F1B: rank r holds
    p - r micro-batches; GPipe: all m). The pack hook returns a holder (`_SavedActivation`) instead
    of the tensor and the storage counts as live while any holder of it exists (a refcount per
    storage key); `peak` is the maximum of the live bytes; `bytes` counts unique storage keys over the whole run
    (an address freed and reused makes it undercount: use `peak`).
    A live storage cannot be freed, so its address key cannot be reused while it is counted.

    Limits (the same as ActivationMeter's): tensors saved inside a non-reentrant checkpoint region
    (train.recompute = full, selective "layer") are packed by the checkpoint's own inner hooks, so only
    the checkpoint's saved block inputs are seen, and the recomputation in backward (also under the
    checkpoint's hooks) is not; the outputs selective "op" recomputation caches are invisible.
    saved_tensors_hooks are thread-local: the meter must wrap the calls that run the forwards (the
    pipelining schedule runs them on the calling thread); a holder may be released on an autograd
    worker thread, hence the lock.
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] = ()):
        super().__init__(exclude)
        self.live = 0
        self.peak = 0
        self._refs: dict[Hashable, int] = {}
        self._lock = threading.RLock()

    def _pack(self, t: torch.Tensor) -> Any:  # type: ignore[override]
        if isinstance(t, nn.Parameter):
            return t
        key, nbytes = _storage_key(t)
        if key is not None and key in self._excluded and self._still_excluded(key):
            return t
        with self._lock:
            if key is None:
                self.bytes += nbytes
                self.live += nbytes
            else:
                if key not in self._seen:
                    self._seen.add(key)
                    self.bytes += nbytes
                count = self._refs.get(key, 0)
                self._refs[key] = count + 1
                if count == 0:
                    self.live += nbytes
            self.peak = max(self.peak, self.live)
        return _SavedActivation(t.detach(), key, nbytes, self)

    def _release(self, key: Hashable | None, nbytes: int) -> None:
        with self._lock:
            if key is None:
                self.live -= nbytes
                return
            count = self._refs.pop(key) - 1
            if count:
                self._refs[key] = count
            else:
                self.live -= nbytes

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _SavedActivation) else saved

    def __enter__(self) -> PeakActivationMeter:
        super().__enter__()
        with self._lock:
            self.peak = self.live
        return self


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
                 tensorboard: bool):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.start_step = start_step
        self.is_writer = is_writer
        self._show_progress = progress and is_writer
        self._t0 = time.perf_counter()
        self._every = max(1, math.ceil((total_steps - start_step) / 10))
        self._file = None
        self._tb = None
        self._bar = None
        self._task = None
        self._closed = not is_writer
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if start_step == 0 and path.is_file() and path.stat().st_size:
            _set_aside(path)  # a run starting over keeps the earlier run's records, apart
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

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), flush_secs=10)
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
        if self._tb is not None:
            for name, value in metrics.items():
                value = _json_default(value) if hasattr(value, "item") else value
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(name, value, step)

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Advance the bar to `step` (or print a plain status line about every 10% without a TTY)."""
        if self._closed or not self._show_progress:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
            return
        done = step - self.start_step
        if done == 1 or done % self._every == 0 or step >= self.total_steps:
            elapsed = time.perf_counter() - self._t0
            eta = (self.total_steps - step) * elapsed / done if done > 0 else float("nan")
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

    def close(self) -> None:
        """Stop the bar, close the files and write loss_curve.png. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
        try:
            plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png")
        except Exception as e:  # close() runs in the trainer's `finally`: never mask the real error
            print(f"warning: could not write {self.run_dir / 'loss_curve.png'}: {e}", flush=True)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _set_aside(path: Path) -> None:
    """metrics.jsonl -> metrics.1.jsonl (or the next free number)."""
    n = 1
    while (path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(path.with_name(f"{path.stem}.{n}{path.suffix}"))


def read_metrics(metrics_jsonl: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl, one per step (the last wins: a resumed run re-logs the steps
    after its checkpoint), sorted by step. A torn last line from a crash is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(metrics_jsonl).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_loss_curve(metrics_jsonl: Path, out_png: Path) -> None:
    """Loss vs step (and lr on a secondary axis when logged) from metrics.jsonl, as a PNG.

    Uses matplotlib's object API with the Agg canvas (no pyplot, so no global figure state and no
    display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_jsonl = Path(metrics_jsonl)
    records = read_metrics(metrics_jsonl) if metrics_jsonl.is_file() else []
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    losses = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    if losses:
        ax.plot(*zip(*losses), color="tab:blue", label="loss")
    else:
        ax.text(0.5, 0.5, "no loss records", transform=ax.transAxes, ha="center", va="center")
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
