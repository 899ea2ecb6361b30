"""The command line's small promises: --version, train --help, `config --keys` as TOML, readable plan
units for tiny models, plan outputs in the run directory, the multi-node launch's checks (a loopback
rendezvous is refused before anything is spawned) and run-directory ownership across nodes."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import pytest

from shardwise.cli import main
from shardwise.errors import ConfigError
from shardwise.launch.rendezvous import MultiNode, check_multinode, split_endpoint


@pytest.mark.parametrize("endpoint", ["127.0.0.1:29400", "localhost:29400", "LOCALHOST", "127.0.1.1:1234",
                                      "[::1]:29400"])
def test_multinode_loopback_endpoint_is_refused(endpoint, capsys):
    with pytest.raises(ConfigError) as e:
        check_multinode(2, 1, endpoint, "job")
    assert e.value.field == "--rdzv-endpoint" and "loopback" in e.value.problem and "hang" in e.value.problem
    assert "reachable address" in e.value.fix
    # Through the command: exit 2, one error line, before any data is prepared or process spawned.
    code = main(["train", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint, "--nproc", "1",
                 "--data.path=/nonexistent/never-read.txt"])
    err = capsys.readouterr().err
    assert code == 2 and "loopback" in err and "Traceback" not in err and "never-read" not in err


@pytest.mark.parametrize("args,field", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "198.51.100.1:29400"], "--node-rank"),
    (["--nnodes", "2"], "--rdzv-endpoint"),
    (["--nnodes", "0"], "--nnodes"),
    (["--rdzv-endpoint", "198.51.100.1:29400"], "--rdzv-endpoint"),  # endpoint without --nnodes > 1
    (["--nnodes", "2", "--rdzv-endpoint", "198.51.100.1:http"], "--rdzv-endpoint"),
])
def test_multinode_arguments_are_checked(args, field, capsys):
    assert main(["train", "--nproc", "1", *args]) == 2
    out, err = capsys.readouterr()
    # A node whose launch arguments are wrong tells no other node (launch/peer_failure.py): it tried to reach
    # the endpoint for 30 s after a wrong --node-rank.
    assert f"error: {field}" in err and "telling" not in out, out + err


def test_multinode_torchrun_arguments():
    assert split_endpoint("[2001:db8::2]:29400") == ("2001:db8::2", 29400) and split_endpoint("node0") == ("node0", None)
    node0 = MultiNode(2, 0, "198.51.100.1:29400", "job-1").torchrun_args()
    node1 = MultiNode(2, 1, "198.51.100.1:29400", "job-1", "198.51.100.7").torchrun_args()
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=198.51.100.1:29400", "--rdzv-id=job-1"} <= set(node0)
    assert "--rdzv-conf=is_host=true" in node0 and "--rdzv-conf=is_host=false" in node1  # node 0 serves the store
    assert "--node-rank=1" in node1 and "--local-addr=198.51.100.7" in node1
    assert check_multinode(1, 0, None, "x") is None
    # Node 0 serves the rendezvous store: its endpoint must be one of its own addresses (198.51.100.0/24 is
    # TEST-NET-2, for documentation only (RFC 5737), so nobody's address; the bind proves it here).
    import socket

    try:
        with socket.socket() as s:
            s.bind(("198.51.100.123", 0))
    except OSError:
        with pytest.raises(ConfigError, match="not an address of this machine"):
            check_multinode(2, 0, "198.51.100.123:29400", "job")
    # Other nodes only dial it, once they run: the check sends nothing (a UDP connect only picks a route).
    assert check_multinode(2, 1, "198.51.100.123:29400", "job") is not None


def test_run_dir_lock_is_shared_by_the_job_across_nodes(tmp_path, monkeypatch):
    """Node 0's launcher holds the lock with the job's rendezvous id; global rank 0 may sit on another
    node (c10d orders nodes itself) and must accept it; any other job is refused."""
    from shardwise.config import build_config
    from shardwise.train import rundir

    cfg = build_config(None, [("run.dir", str(tmp_path / "run"))])
    locks = rundir.lock_dirs(cfg, job="shardwise-abc")
    try:
        assert json.loads((tmp_path / "run" / ".shardwise" / "lock").read_text())["job"] == "shardwise-abc"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "shardwise-abc")
        mine = rundir.lock_unless_parent_holds(cfg)
        assert not mine.own and mine.locks == []  # the launcher wrote config.toml and printed the data line
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")
        with pytest.raises(ConfigError, match="in use"):
            rundir.lock_unless_parent_holds(cfg)
    finally:
        for lock in locks:
            lock.release()
    # Plain torchrun (nobody holds the lock): rank 0 takes it itself and owns config.toml.
    own = rundir.lock_unless_parent_holds(cfg)
    try:
        assert own.own
        assert rundir.save_config(cfg).read_text() == cfg.to_toml()
    finally:
        own.release()


def test_clear_failure_record(tmp_path):
    from shardwise.train import rundir

    rundir.record_unrestartable_failure(tmp_path, "job", 2)
    assert rundir.unrestartable_failure(tmp_path, "job") == 2
    rundir.clear_failure_record(tmp_path)
    assert rundir.unrestartable_failure(tmp_path, "job") is None


def test_version(capsys):
    assert main(["--version"]) == 0
    from shardwise import __version__

    assert capsys.readouterr().out.strip() == f"shardwise {__version__}"


def test_train_help_lists_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--section.key=value" in out and "shardwise config --keys" in out
    assert "--nnodes" in out and "--rdzv-endpoint" in out


@pytest.mark.parametrize("argv", [["train", "--help"], ["train", "--parallel.zero=7"], ["plan", "--help"], ["trian"]])
def test_help_and_bad_input_answer_without_importing_torch(argv):
    """torch takes 1.5-3 s to import here: --help and a refused config must not wait for it."""
    import subprocess
    import sys

    probe = ("import sys; from shardwise.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip().endswith("no torch"), done.stderr[-2000:]


def test_config_keys_are_toml(capsys):
    import tomllib

    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "True" not in out and "False" not in out and "'" not in out.replace("'s", "")
    assigned = [line.strip() for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")
                and not line.strip().startswith("#")]
    assert len(assigned) > 50
    for line in assigned:  # every default line is valid TOML, pasteable into a config file
        tomllib.loads(line)
    assert "  sequence_parallel = true" in out and '  preset = "tiny"' in out and "# top_k = (unset)" in out


def test_plan_prints_tiny_models_readably(capsys):
    assert main(["plan", "evaluate", "--model.preset=tiny", "--cluster.num_gpus=2", "--cluster.gpus_per_node=2",
                 "--parallel.dp_shard=1", "--parallel.dp_replicate=2"]) == 0
    out = capsys.readouterr().out
    assert "0.00B params" not in out and "0.0 GFLOP" not in out and "0.00M tokens" not in out
    assert "K params" in out and "MFLOP/token" in out and ("┃    ms ┃" in out or "┃    µs ┃" in out)
    assert "MiB" in out and "0.000 " not in out.split("step time")[1].splitlines()[-3]  # the step row


def test_plan_outputs_default_to_the_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # nothing may land in the directory the command runs in
    try:
        assert main(["plan", "search", "--model.preset=tiny", "--cluster.num_gpus=2", "--cluster.gpus_per_node=2",
                     f"--run.dir={run}", "--top", "2", "--emit", "--plot"]) == 0
    finally:
        os.chdir(cwd)
    assert (run / "plan" / "best.toml").is_file() and (run / "plan" / "search.png").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert f"wrote {run / 'plan' / 'best.toml'}" in capsys.readouterr().out


def test_pipeline_text_chart_does_not_repeat_the_summary():
    from shardwise.train.pipeline_chart import describe, text_chart

    timeline = {"schedule": "1f1b", "pp": 2, "virtual_stages": 1, "microbatches": 2, "step": 3, "span_s": 1.0,
                "bubble_measured": 0.25, "bubble_theoretical": 0.2,
                "ranks": [{"pp_rank": r, "bubble": 0.25, "actions": [["F", r, 0, 0.0, 0.5], ["B", r, 0, 0.5, 0.75]]}
                          for r in (0, 1)]}
    text = text_chart(timeline)
    assert describe(timeline) not in text and len(text.splitlines()) == 2


def test_plan_search_explains_tiny_losers_in_milliseconds(capsys):
    """The "why the rest lost" lines and the days column of a tiny model's search say something (ms, s),
    not "+0.000 s" and "2.1e-06"."""
    assert main(["plan", "search", "--model.preset=tiny", "--cluster.num_gpus=4", "--cluster.gpus_per_node=4"]) == 0
    out = capsys.readouterr().out
    assert "step +" in out and "(+0.000 s)" not in out and " ms)" in out and "+0.000 s" not in out
    assert "e-0" not in out


@pytest.mark.parametrize("text,want", [("2", (2, 2)), ("1:4", (1, 4)), (" 2:2 ", (2, 2))])
def test_nnodes_is_a_count_or_an_elastic_range(text, want):
    from shardwise.launch.rendezvous import parse_nnodes

    assert parse_nnodes(text) == want


@pytest.mark.parametrize("args,field,words", [
    (["--nnodes", "3:1"], "--nnodes", "above"),
    (["--nnodes", "two"], "--nnodes", "not a node count"),
    # 2 processes per node, global batch 8, micro-batch 2: 6 processes (3 nodes) cannot split it.
    (["--nnodes", "1:3", "--parallel.dp_shard=-1", "--parallel.zero=3", "--train.global_batch=8", "--train.micro_batch=2"],
     "--nnodes", "does not fit 3 nodes (6 processes)"),
    (["--nnodes", "1:2", "--parallel.dp_shard=-1", "--parallel.zero=3", "--train.global_batch=8", "--train.micro_batch=2"],
     "run.max_restarts", "elastic job"),
    (["--nnodes", "1:2", "--parallel.dp_shard=-1", "--parallel.zero=3", "--train.global_batch=8", "--train.micro_batch=2",
      "--run.max_restarts=2", "--run.rendezvous_last_call_s=900"], "run.rendezvous_last_call_s", "below"),
])
def test_an_elastic_job_is_checked_at_every_size_before_anything_starts(args, field, words, capsys):
    """`--nnodes MIN:MAX` is refused (exit 2, before any data is read) when some node count in the range
    would not fit the config, naming it, or when nothing would restart the job after a loss."""
    code = main(["train", "--nproc", "2", "--node-rank", "1", "--rdzv-endpoint", "198.51.100.1:29400",
                 "--data.path=/nonexistent/never-read.txt", *args])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {field}" in err and words in err and "never-read" not in err, err


def test_a_short_rendezvous_timeout_advises_a_last_call_that_fits(capsys):
    """run.rendezvous_timeout_s=20 with the default 30 s last call is refused; the advised value (it once
    said 30 whatever the timeout) is then accepted: the same command gets past the check to the data."""
    cmd = ["train", "--nproc", "2", "--node-rank", "1", "--rdzv-endpoint", "198.51.100.1:29400", "--nnodes", "1:2",
           "--parallel.dp_shard=-1", "--parallel.zero=3", "--run.max_restarts=2", "--run.rendezvous_timeout_s=20",
           "--data.path=/nonexistent/never-read.txt"]
    assert main(cmd) == 2
    err = capsys.readouterr().err
    assert "error: run.rendezvous_last_call_s" in err, err
    advised = err.split("e.g. ")[-1].split()[0]
    assert float(advised) < 20
    assert main([*cmd, f"--run.rendezvous_last_call_s={advised}"]) == 2
    err = capsys.readouterr().err
    assert "rendezvous_last_call_s" not in err and "never-read" in err, err


def test_an_elastic_launch_passes_the_range_and_the_rendezvous_timeouts():
    args = MultiNode(2, 1, "198.51.100.1:29400", "job", None, 1, 600.0, 2.5).torchrun_args()
    assert "--nnodes=1:2" in args and "--rdzv-conf=is_host=false,join_timeout=600,last_call_timeout=3" in args
    assert "--nnodes=2" in MultiNode(2, 1, "198.51.100.1:29400", "job", None, 2).torchrun_args()  # 2:2 is not elastic


@pytest.fixture()
def listening():
    """A loopback TCP port that accepts connections (node 0's store, as far as a connect can tell)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture()
def refusing():
    """A loopback port bound (so nobody else takes it) but not listening: every connect is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("error,code,words", [
    ("RendezvousConnectionError", 1, "cannot be reached, or closed while this node waited"),
    ("RendezvousTimeoutError", 6, "fewer than 1 node(s) (--nnodes 1:2) met at the rendezvous at {} within "
                                  "run.rendezvous_timeout_s (600 s)"),
])
def test_an_elastic_node_tells_a_lost_rendezvous_from_a_timeout(error, code, words, listening, monkeypatch, tmp_path,
                                                                capsys):
    """A node that joins an elastic job just as it ends loses node 0's store (RendezvousConnectionError,
    seen when a rejoining node came a few steps too late): it was told "fewer than MIN nodes met within
    run.rendezvous_timeout_s" and exit 6, though nothing had timed out. Only a timeout is exit 6 now."""
    import torch.distributed.elastic.rendezvous.api as rdzv

    from shardwise.launch.local import torchrun

    def fail(args):
        raise getattr(rdzv, error)("store gone")

    _no_torchrun(monkeypatch, fail)
    nodes = MultiNode(2, 1, listening, "job", None, 1, 600.0, 2.5)
    assert torchrun(2, "shardwise.train", [], nodes=nodes, checkpoints=tmp_path) == code
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and words.format(listening) in err and "no checkpoint was written yet" in err, err


@pytest.mark.parametrize("node_rank,error,code,words", [
    (1, "RendezvousTimeoutError", 6, "error: fewer than 2 nodes (--nnodes 2) met at the rendezvous at {} within "
                                     "run.rendezvous_timeout_s (20 s): start every node, --node-rank 0 to 1, with the "
                                     "same config and --rdzv-endpoint; no checkpoint was written yet"),
    (0, "RendezvousTimeoutError", 6, "error: fewer than 2 nodes"),
    (0, "RendezvousClosedError", 1, "(are the other nodes running, with this node's address as their --rdzv-endpoint?)"),
    (1, "RendezvousClosedError", 1, "(is node 0 running, and"),
    (0, "RendezvousConnectionError", 1, "error: node 0 cannot serve the rendezvous at {}: "),  # its store failed to bind
])
def test_a_static_job_whose_nodes_never_meet_says_which_and_exits_6(node_rank, error, code, words, listening,
                                                                     monkeypatch, tmp_path, capsys):
    """--nnodes 2 with a node missing: torch's RendezvousTimeoutError has an empty message, and shardwise
    said "rendezvous failed: RendezvousTimeoutError:  (is node 0 running ...?)", exit 1, on node 0 too."""
    import torch.distributed.elastic.rendezvous.api as rdzv

    from shardwise.launch.local import torchrun

    def fail(args):
        raise getattr(rdzv, error)("")

    _no_torchrun(monkeypatch, fail)
    nodes = MultiNode(2, node_rank, listening, "job", None, None, 20.0, 10.0)
    assert torchrun(1, "shardwise.train", [], nodes=nodes, checkpoints=tmp_path) == code
    out, err = capsys.readouterr()
    assert f"node {node_rank}: waiting for all 2 nodes at the rendezvous {listening} (up to " \
           "run.rendezvous_timeout_s = 20 s)" in out, out
    assert err.count("error:") == 1 and words.format(listening) in err, err


def test_node_0_lost_during_the_run_is_not_called_a_rendezvous_this_node_waited_for(listening, monkeypatch, tmp_path,
                                                                                     capsys):
    """Node 0 SIGKILLed mid-run: node 1's agent may lose node 0's store before its workers report their lost peer
    (3 failures in 13 loaded runs of tests/dist/test_multinode.py), and it was told "the rendezvous cannot be reached, or closed while this
    node waited", though the job had trained 12 steps."""
    import torch.distributed.elastic.rendezvous.api as rdzv

    from shardwise.launch.local import torchrun

    logs = tmp_path / "logs"

    def lose_node_0(args):
        (logs / "job_x" / "attempt_0" / "0").mkdir(parents=True)  # what torch's agent makes for its workers
        raise rdzv.RendezvousConnectionError("store gone")

    _no_torchrun(monkeypatch, lose_node_0)
    nodes = MultiNode(2, 1, listening, "job", None, None, 20.0, 10.0)
    assert torchrun(1, "shardwise.train", [], log_dir=logs, nodes=nodes, checkpoints=tmp_path) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and f"error: node 0 was lost during the run (its rendezvous at {listening} " \
                                       "closed)" in err and "no checkpoint was written yet" in err, err


def _no_torchrun(monkeypatch, run=None) -> list:
    """torch's launcher replaced by `run`, or by a recorder of its arguments (returned); torchrun()'s environment
    settings for its workers undone after the test."""
    from torch.distributed import run as torch_run

    launched = []
    monkeypatch.setattr(torch_run, "run", run or launched.append)
    for name in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    return launched


def test_a_node_gives_up_on_a_silent_rendezvous_after_its_own_timeout(refusing, monkeypatch, tmp_path, capsys):
    """torch dials node 0's store for its 60 s read timeout, then once more after a random delay, whatever
    run.rendezvous_timeout_s says (64 s measured on loopback, 159 s between test hosts with a 20 s timeout).
    A node now gives up after run.rendezvous_timeout_s, in one line that says what to do, before torch
    is started."""
    from shardwise.launch.local import torchrun

    launched = _no_torchrun(monkeypatch)
    start = time.monotonic()
    code = torchrun(1, "shardwise.train", [], nodes=MultiNode(2, 1, refusing, "job", join_timeout_s=1.5),
                    checkpoints=tmp_path)
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 1 and not launched and 1.5 <= took < 10, (code, launched, took)
    assert out.count("waiting for node 0's rendezvous at " + refusing) == 1 and "Connection refused" in out, out
    assert err.count("\n") == 1 and err.startswith(f"error: nothing answered at the rendezvous {refusing} within "
                                                   "run.rendezvous_timeout_s (1.5 s; last: Connection refused): "
                                                   "start node 0 (--node-rank 0)"), err


def test_a_node_waits_for_node_0_to_come_up(monkeypatch, tmp_path, capsys):
    """Node 1 started before node 0 waits for it (and says so), then hands over to torch's launcher."""
    from shardwise.launch.local import torchrun

    launched = _no_torchrun(monkeypatch)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = []
    late = threading.Timer(1.0, lambda: server.append(socket.create_server(("127.0.0.1", port))))
    late.start()
    try:
        code = torchrun(1, "shardwise.train", [], nodes=MultiNode(2, 1, f"127.0.0.1:{port}", "job",
                                                                  join_timeout_s=30), checkpoints=tmp_path)
    finally:
        late.join()
        for s in server:
            s.close()
    out = capsys.readouterr().out
    assert code == 0 and len(launched) == 1 and f"waiting for node 0's rendezvous at 127.0.0.1:{port}" in out, out


def test_node_0_serves_the_rendezvous_and_does_not_wait_for_it(monkeypatch, tmp_path, capsys):
    from shardwise.launch import local, rendezvous

    launched = _no_torchrun(monkeypatch)
    monkeypatch.setattr(rendezvous.socket, "create_connection", lambda *a, **k: pytest.fail("node 0 dialled its own store"))
    assert local.torchrun(1, "shardwise.train", [], nodes=MultiNode(2, 0, "198.51.100.1:29400", "job",
                                                                    join_timeout_s=1), checkpoints=tmp_path) == 0
    assert len(launched) == 1 and "waiting for node 0's rendezvous" not in capsys.readouterr().out


def test_a_mistyped_command_gets_a_suggestion(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    assert main(["zzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_a_moe_run_prints_its_loss_once_per_step(base_overrides, tmp_path, capsys):
    """The router's line (aux loss, load, drops) follows the progress line without repeating its loss; the
    start-up line calls one process one process."""
    over = [f"--{k}={v}" for k, v in base_overrides if k not in ("model.preset", "train.steps")]
    assert main(["train", *over, "--model.preset=tiny-moe", "--train.steps=2", "--train.log_every=1",
                 f"--run.dir={tmp_path / 'moe'}"]) == 0
    out = capsys.readouterr().out
    experts = [line for line in out.splitlines() if " experts: aux loss " in line]
    assert len(experts) == 2 and not any("| loss" in line or ": loss" in line for line in experts), out
    assert "layout one process, " in out  # not "single x1"


def test_dtensor_notes_on_scalar_redistributions_are_dropped(caplog):
    """Only the two notes parallel/mesh.py names (a norm's two all-reduces, strided shards' gathers)."""
    import logging

    from shardwise.parallel.mesh import _ScalarRedistributeNote, quiet_scalar_redistribute_notes

    quiet_scalar_redistribute_notes()
    quiet_scalar_redistribute_notes()  # idempotent
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    assert sum(isinstance(f, _ScalarRedistributeNote) for f in logger.filters) == 1
    other = "While redistributing from (Shard(dim=0), Partial(sum)) to (Replicate(), Replicate()), 2 sequential ..."
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), "
                       "2 sequential all_reduce operations will be performed.")
        logger.warning("While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), "
                       "Replicate()), 2 sequential all_gather operations will be performed.")
        logger.warning(other)
    assert [r.getMessage() for r in caplog.records] == [other]


_WAITING_NODE = """
import signal, sys
from shardwise.launch.local import torchrun
from shardwise.launch.rendezvous import MultiNode
before = signal.getsignal(signal.SIGTERM)
code = torchrun(1, "shardwise.train", [], nodes=MultiNode(2, 1, sys.argv[1], "job", join_timeout_s=60))
print("restored" if signal.getsignal(signal.SIGTERM) is before else "not restored")
sys.exit(code)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_request_while_waiting_for_node_0_ends_in_one_line(stop, refusing):
    """scancel's SIGTERM (or SLURM's SIGUSR1 before a time limit) while a node waits for node 0, before torch's
    agent has handlers of its own: the launcher died of the signal (exit -15 / -10) without a word."""
    import subprocess
    import sys

    node = subprocess.Popen([sys.executable, "-c", _WAITING_NODE, refusing], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = node.stdout.readline()
    assert "waiting for node 0's rendezvous" in line, line + node.stderr.read()
    node.send_signal(stop)
    out, err = node.communicate(timeout=60)
    assert node.returncode == 143 and out.strip() == "restored", (node.returncode, out, err)
    assert err.strip() == f"interrupted ({stop.name}) while waiting at the rendezvous {refusing}, before any worker " \
                          "started", err


def test_node_0_is_refused_a_rendezvous_port_in_use_before_anything_starts(listening, monkeypatch):
    """Port 29400 held by another job on node 0: the agent started, its store failed to bind, and node 0 was told
    the rendezvous "cannot be reached ... node 0's agent is not running there". Now exit 2 before any process
    (for real between test hosts: tests/dist/test_multinode.py)."""
    from shardwise.launch import rendezvous

    host, port = listening.split(":")
    monkeypatch.setattr(rendezvous, "_loopback", lambda host: None)  # loopback stands in for node 0's address
    monkeypatch.setattr(rendezvous, "_is_local", lambda host: True)
    with pytest.raises(ConfigError) as e:
        check_multinode(2, 0, listening, "job")
    assert e.value.field == "--rdzv-endpoint" and f"port {port} of {host} is in use" in e.value.problem
    assert f"--rdzv-endpoint {host}:{int(port) + 1}" in e.value.fix and "ss -ltnp" in e.value.fix
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert not rendezvous._in_use("127.0.0.1", port)  # a port nobody holds
    assert check_multinode(2, 1, listening, "job") is not None  # node 1 only dials the port


def test_the_process_entry_ends_without_collecting_torch_and_main_does_not_freeze():
    """The `shardwise` script and `python -m shardwise.cli` end through console(), which freezes the heap
    so that the interpreter's final collections skip torch's objects (0.63 s a process, cli.py console);
    main(), which tests call in their own process, freezes nothing."""
    import gc
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    frozen = gc.get_freeze_count()
    assert main(["--version"]) == 0 and gc.get_freeze_count() == frozen
    probe = ("import gc, sys; from shardwise.cli import console\n"
             "code = console(['--version'])\nprint(gc.get_freeze_count() > 0, file=sys.stderr); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("shardwise ") and done.stderr.strip() == "True", done
    module = subprocess.run([sys.executable, "-m", "shardwise.cli", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert module.returncode == 0 and module.stdout == done.stdout
    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["shardwise"] == "shardwise.cli:console"
