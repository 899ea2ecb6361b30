"""Per-axis collective time (train/collective_wait.py): which groups are timed, what the hook adds up, and
what the straggler window makes of it. NCCL's hook cannot run here (no NCCL on CPU; gloo refuses it), so
these drive the clock the way ProcessGroupNCCL's watchdog thread does: a WorkInfo-like object per
completed collective, from another thread. benchmarks/collective_clock.py runs the real hook on a GPU
(`make gpu-check`, row check/collective-clock)."""
from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import torch

from shardwise.parallel.comm_counter import axis_names
from shardwise.train.collective_wait import CollectiveClock, mesh_axis_groups, timed
from shardwise.train.straggler import RankTimes, StragglerWatch


class _Group:
    """What CollectiveClock calls on a process group, recorded."""

    def __init__(self, backend: str):
        self.backend, self.timing, self.hooks = backend, False, []

    def _enable_collectives_timing(self):
        self.timing = True

    def _register_on_completion_hook(self, hook):
        assert self.timing, "NCCL refuses a hook before timing is on (ProcessGroupNCCL::registerOnCompletionHook)"
        self.hooks.append(hook)


def _complete(group: _Group, *seconds: float) -> None:
    """Collectives completing on another thread, as NCCL's watchdog reports them."""
    def run():
        for s in seconds:
            group.hooks[0](SimpleNamespace(active_duration=timedelta(seconds=s)))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def test_only_nccl_groups_are_timed_each_group_once():
    assert timed("nccl") and not timed("gloo") and not timed("cpu:gloo,cuda:nccl")
    tp, dp, gloo = _Group("nccl"), _Group("nccl"), _Group("gloo")
    clock = CollectiveClock.start([("tp", tp), ("dp_shard", dp), ("batch", dp), ("pp", gloo)], lambda g: g.backend)
    assert clock.axes == ["tp", "dp_shard"]  # the same group under a second name: timed once, by its first axis
    assert len(tp.hooks) == len(dp.hooks) == 1 and not gloo.hooks and not gloo.timing
    assert CollectiveClock.start([("dp", _Group("gloo"))], lambda g: g.backend) is None  # a CPU job: no clock


def test_the_clock_adds_each_axis_durations_and_take_resets_them():
    tp, dp = _Group("nccl"), _Group("nccl")
    clock = CollectiveClock.start([("tp", tp), ("dp_shard", dp)], lambda g: g.backend)
    _complete(tp, 0.25, 0.5)
    _complete(dp, 0.125)
    assert clock.take() == {"tp": (0.75, 2), "dp_shard": (0.125, 1)}
    assert clock.take() == {"tp": (0.0, 0), "dp_shard": (0.0, 0)}


def test_a_window_gathers_each_axis_mean_a_step_and_names_where_the_others_wait():
    tp = _Group("nccl")
    watch = StragglerWatch(2, 0.2, 2, rank=0, group=None, device=torch.device("cpu"),
                           clock=CollectiveClock.start([("tp", tp)], lambda g: g.backend))
    watch._hosts, watch._nodes = ["a"], [-1]
    gathered = []
    watch._gather = lambda mine: gathered.append(mine) or [RankTimes(0, "a", *mine[:3], {"tp": mine[3]})]
    watch.timer = SimpleNamespace(take=lambda: (0.01, 1))
    watch.after_step(1, 1.0, 0.0)
    _complete(tp, 0.3, 0.1)  # two steps' collectives, whenever the watchdog saw them
    watch.after_step(2, 1.0, 0.0)
    assert gathered == [[0.01, 0.0, 1.0, 0.2]]  # 0.4 s over a window of 2 steps
    # Rank 2 is slow: the others wait for it in tp collectives, it waits least.
    ranks = [RankTimes(r, "a", c, 0.0, 1.0, {"tp": w, "dp_shard": 0.05})
             for r, (c, w) in enumerate([(0.010, 0.040), (0.010, 0.042), (0.020, 0.002), (0.010, 0.041)])]
    record, lines = StragglerWatch(2, 0.2, 2, rank=0, group=None, device=torch.device("cpu")).judge(ranks, 2, 2)
    assert record["straggler/collective_tp_median_s"] == 0.0405 and record["straggler/collective_tp_max_s"] == 0.042
    assert record["straggler/collective_dp_shard_max_s"] == 0.05
    [line] = lines
    assert "; the others wait 39.0 ms a step longer in tp collectives) — a throttled GPU" in line, line


def test_without_per_axis_times_the_line_and_record_are_as_before():
    ranks = [RankTimes(r, "a", c, 0.0, 1.0) for r, c in enumerate([0.010, 0.010, 0.020])]
    record, [line] = StragglerWatch(2, 0.2, 2, rank=0, group=None, device=torch.device("cpu")).judge(ranks, 2, 2)
    assert not [k for k in record if "collective" in k] and "collectives" not in line


def _group(name: str, size: int):
    return SimpleNamespace(group_name=f"pg-{name}", size=lambda: size, name=name)


class _Mesh:  # a DeviceMesh as far as mesh_groups reads one: named axes, each with its group
    def __init__(self, sizes: dict[str, int], groups: dict[str, object] | None = None):
        self.mesh_dim_names = tuple(sizes)
        groups = {name: (groups or {}).get(name) or _group(name, n) for name, n in sizes.items()}
        self.axes = {name: SimpleNamespace(get_group=lambda g=group: g) for name, group in groups.items()}

    def __getitem__(self, axis):
        return self.axes[axis]

    def get_group(self):  # a 1-D view
        return self.axes[self.mesh_dim_names[0]].get_group()


def test_mesh_axis_groups_names_every_axis_of_more_than_one_rank():
    meshes = SimpleNamespace(root=_Mesh({"pp": 2, "dp_shard": 4, "tp": 1}), expert=_Mesh({"ep": 2}))
    assert [(axis, g.name) for axis, g in mesh_axis_groups(meshes)] == [("pp", "pp"), ("dp_shard", "dp_shard"),
                                                                         ("ep", "ep")]
    assert mesh_axis_groups(None) == []


def test_the_clock_times_the_flattened_and_grid_groups_and_names_them_as_the_byte_counter_does():
    """Under context parallelism FSDP reduces over the flattened dp_shard_cp group and 2-D tensor
    parallelism talks over its grid axes: groups no root axis has, which the clock once missed. A view
    that is one axis (cp = 1: dp_cp is dp_shard's group) is that axis, for the clock and the counter."""
    dp_shard = _group("dp_shard", 2)
    root = _Mesh({"dp_shard": 2, "cp": 2, "tp": 4}, {"dp_shard": dp_shard})
    meshes = SimpleNamespace(root=root, dp_shard_cp=_Mesh({"dp_shard_cp": 4}), dp_cp=_Mesh({"dp_cp": 2}, {"dp_cp": dp_shard}),
                             tp_grid=_Mesh({"tp_row": 2, "tp_col": 2}))
    timed_axes = [axis for axis, _ in mesh_axis_groups(meshes)]
    assert sorted(timed_axes) == ["cp", "dp_shard", "dp_shard_cp", "tp", "tp_col", "tp_row"]
    names = axis_names(meshes)
    assert {names[g.group_name] for _, g in mesh_axis_groups(meshes)} == set(timed_axes)
    assert names["pg-dp_shard"] == "dp_shard"


def test_a_refused_hook_reads_nan_on_that_rank_and_the_axis_is_left_out_not_the_run():
    """A process group that refuses the hook (torch raises DistBackendError, e.g. a hook already placed by
    another owner): the axis stays in the gathered vector (the same length on every rank) as NaN, and the
    window's record leaves that axis out."""
    class Refusing(_Group):
        def _register_on_completion_hook(self, hook):
            raise RuntimeError("ProcessGroupNCCL OnCompletion hook already registered")

    tp, dp = _Group("nccl"), Refusing("nccl")
    clock = CollectiveClock.start([("tp", tp), ("dp_shard", dp)], lambda g: g.backend)
    assert clock.axes == ["tp", "dp_shard"] and "already registered" in clock.refused["dp_shard"]
    _complete(tp, 0.5)
    taken = clock.take()
    assert taken["tp"] == (0.5, 1) and taken["dp_shard"][1] == 0 and taken["dp_shard"][0] != taken["dp_shard"][0]
    nan = float("nan")
    ranks = [RankTimes(r, "a", c, 0.0, 1.0, {"tp": 0.04, "dp_shard": nan if r == 1 else 0.01})
             for r, c in enumerate([0.010, 0.010, 0.020])]
    record, [line] = StragglerWatch(2, 0.2, 2, rank=0, group=None, device=torch.device("cpu")).judge(ranks, 2, 2)
    assert "straggler/collective_tp_max_s" in record and not [k for k in record if "dp_shard" in k]
    assert "collectives" not in line  # tp: the straggler waits as long as the others; dp_shard: unknown
