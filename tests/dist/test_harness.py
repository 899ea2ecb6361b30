"""The test harness's own promises (tests/harness.py): a child's result reaches the parent whatever the
timing, and a world's gloo stays on loopback."""
from __future__ import annotations

import multiprocessing as mp
import os

import torch

from tests import harness


def _report_and_exit(results) -> None:
    harness.report(results, 0, "ok", {"weight": torch.arange(6.0).reshape(2, 3), "loss": 1.5})
    results.close()
    results.join_thread()
    os._exit(0)  # as harness._child ends: gone before the parent reads


def test_a_result_outlives_the_child_that_sent_it():
    """The parent reads only after the child has exited: the worst case of the race that made
    test_offload.py's fixture fail with ConnectionResetError (a tensor put on the queue as an object is
    shared by file descriptor, fetched from the sender when unpickled: here it fails every time)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_report_and_exit, args=(results,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    rank, status, value = harness.receive(results, timeout=10)
    assert (rank, status, value["loss"]) == (0, "ok", 1.5)
    assert value["weight"].equal(torch.arange(6.0).reshape(2, 3))


def test_world_results_and_gloo_interface():
    def fn(rank: int) -> dict:
        import torch.distributed as dist

        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        return {"sum": t, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}

    out = harness.run_world(2, fn)
    assert all(r["sum"].equal(torch.full((3,), 3.0)) for r in out)
    assert {r["gloo"] for r in out} == {"lo"}  # the loopback interface, whatever the host name resolves to


def _hang_on_rank_1(rank: int) -> int:
    import time

    while rank == 1:
        time.sleep(0.1)
    return rank


def test_a_hung_rank_is_reported_with_where_it_hung():
    """A world whose rank never reports fails after run_world's timeout with that rank's stack, not only
    its exit code: the clue a hang in CI leaves behind (faulthandler, on SIGUSR1 before the kill)."""
    import pytest

    with pytest.raises(RuntimeError) as e:
        harness.run_world(2, _hang_on_rank_1, timeout_s=5)
    text = str(e.value)
    assert "ranks [1] did not report within 5s" in text
    assert "rank 1 was at" in text and "_hang_on_rank_1" in text, text


def _compile_something_new(rank: int) -> float:
    import random

    import torch

    scale = random.Random().random() + 1.0  # a constant no earlier graph had: no cache hit, a real compile
    return float(torch.compile(lambda x: (x * scale).sin().sum(), backend="inductor")(torch.ones(64)))


def test_a_world_compiles_with_inductor_after_its_parent_did(monkeypatch):
    """A child forked from a process that has compiled with inductor compiles too. torch's at-fork hook resets
    inductor's compile process pool but not its thread pool (torch/_inductor/async_compile.py after_fork:
    AsyncCompile.pool stays cached), so a child queued its C++ kernels on the parent's threads, absent in it,
    and waited forever: the CI hang of test_hf_layouts' fixture (both ranks in codecache load_fn)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    if (inductor_config.compile_threads or inductor_config.decide_compile_threads()) <= 1:
        monkeypatch.setattr(inductor_config, "compile_threads", 2)  # one core: make the pool exist anyway
    AsyncCompile.pool().submit(lambda: 0).result()  # what any earlier in-process compile leaves behind
    assert [round(v, 3) for v in harness.run_world(2, _compile_something_new, timeout_s=120)] != []
