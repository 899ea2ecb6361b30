"""Run safety without a process group: manifests, safe unpickling, strict metrics, corpus sniffing,
stop signals, the run-directory lock and checks, and the launcher's choice of a root cause."""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.config import build_config
from shardwise.data.corpus import file_kind
from shardwise.data.records import iter_documents
from shardwise.errors import ConfigError
from shardwise.launch.local import report_failure
from shardwise.train import manifest as mf
from shardwise.train import rundir
from shardwise.train.checkpoint import SafeLoadPlanner, metadata_problem, read_metadata, verify_directory
from shardwise.train.control import Control
from shardwise.train.health import StepGuard
from shardwise.train.metrics import MetricsLogger, strict_record
from shardwise.train.signals import StopRequest


class _RunsCode:
    """Unpickling this runs `touch <path>`: what a crafted checkpoint file would do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _checkpoint_like(tmp_path: Path) -> Path:
    step = tmp_path / "step_00000004"
    (step / "rng").mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(os.urandom(4096))
    (step / "trainer_state.json").write_text(json.dumps({"step": 4}))
    torch.save({"cpu": torch.get_rng_state()}, step / "rng" / "rank_0.pt")  # verify loads it: a real RNG state
    files = {rel: dict(zip(("size", "sha256"), mf.file_digest(step / rel))) for rel in mf.listed_files(step)}
    mf.write_manifest(step, {"format": mf.FORMAT, "step": 4, "good": True, "files": files})
    return step


def test_manifest_detects_truncated_deleted_flipped_and_emptied_files(tmp_path):
    step = _checkpoint_like(tmp_path)
    manifest = mf.read_manifest(step)
    assert sorted(manifest["files"]) == ["__0_0.distcp", "rng/rank_0.pt", "trainer_state.json"]
    assert mf.verify_files(step, manifest) == []
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])  # 64 flipped bytes, same size
    shard.write_bytes(bytes(data))
    (step / "trainer_state.json").write_text("")
    (step / "rng" / "rank_0.pt").unlink()
    problems = {p.file: p.reason for p in mf.verify_files(step, manifest)}
    assert problems["__0_0.distcp"].startswith("checksum mismatch")
    assert problems["trainer_state.json"].startswith("size 0 bytes")
    assert problems["rng/rank_0.pt"] == "missing"
    (step / mf.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError) as e:
        mf.read_manifest(step)
    assert e.value.args[0].file == mf.MANIFEST


def test_verify_directory_reports_each_checkpoint(tmp_path):
    good = _checkpoint_like(tmp_path / "checkpoints")
    bad = shutil.copytree(good, tmp_path / "checkpoints" / "step_00000008")
    (bad / "__0_0.distcp").write_bytes(b"short")
    (tmp_path / "checkpoints" / "step_00000012.tmp").mkdir()
    odd = shutil.copytree(good, tmp_path / "checkpoints" / "step_00000010")
    (odd / "rng" / "rank_0.pt").write_bytes(b"rng")  # not a torch file: damaged even with a manifest to match
    files = {rel: dict(zip(("size", "sha256"), mf.file_digest(odd / rel))) for rel in mf.listed_files(odd)}
    mf.write_manifest(odd, {"format": mf.FORMAT, "step": 10, "good": True, "files": files})
    results = {p.name: (status, problems) for p, status, problems in verify_directory(tmp_path)}
    assert results["step_00000004"] == ("OK", [])
    assert results["step_00000008"][0] == "DAMAGED" and results["step_00000008"][1][0].file == "__0_0.distcp"
    assert results["step_00000010"][0] == "DAMAGED" and "rank 0's files" in results["step_00000010"][1][0].reason
    assert results["step_00000012.tmp"][0].startswith("INCOMPLETE")


def test_set_aside_never_overwrites(tmp_path):
    first = _checkpoint_like(tmp_path)
    assert mf.set_aside(first).name == "step_00000004.corrupt"
    second = _checkpoint_like(tmp_path)
    assert mf.set_aside(second).name == "step_00000004.corrupt.1"
    assert mf.complete_checkpoints(tmp_path) == []


def test_fingerprint_lists_what_changed(corpus_file):
    base = build_config(None, [("model.preset", "tiny")])
    wider = build_config(None, [("model.preset", "tiny"), ("model.dim", "128"), ("train.global_batch", "32")])
    relaid = build_config(None, [("model.preset", "tiny"), ("parallel.tp", "2"), ("train.lr", "1e-4"),
                                 ("train.micro_batch", "1")])
    saved = mf.fingerprint(base, 1000, "abc")
    assert mf.fingerprint_differences(saved, mf.fingerprint(relaid, 1000, "abc")) == []  # layouts reshard
    assert mf.fingerprint_differences(saved, mf.fingerprint(wider, 1000, "abc")) == [
        "model.dim: 64 -> 128", "train.global_batch: 16 -> 32"]
    assert mf.fingerprint_differences(saved, mf.fingerprint(base, 999, "abd")) == [
        "data.tokenizer_sha256: abc -> abd", "data.tokens: 1000 -> 999"]
    with pytest.raises(ConfigError) as e:
        mf.refuse_changes(Path("step_1"), saved, mf.fingerprint(wider, 1000, "abc"))
    assert e.value.field == "checkpoint.resume" and "model.dim: 64 -> 128" in e.value.problem and "resume=false" in e.value.fix


def test_dcp_metadata_reads_safely_and_crafted_pickles_run_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real"
    dcp.save({"w": torch.ones(3, 2, dtype=torch.bfloat16), "lr": 0.1}, checkpoint_id=str(real))
    metadata = read_metadata(real / ".metadata")
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 2])
    marker = tmp_path / "code-ran"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    reason = metadata_problem(crafted)
    assert reason is not None and "system" in reason
    with pytest.raises(pickle.UnpicklingError):
        SafeLoadPlanner().load_bytes(None, io.BytesIO(pickle.dumps(_RunsCode(marker))))
    assert not marker.exists(), "unpickling a crafted checkpoint ran code"


def test_metrics_records_are_strict_json():
    record = strict_record({"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1,
                            "nested": {"a": float("-inf"), "b": [1.0, float("nan")]}, "t": torch.tensor(2.5)})
    assert record["loss"] is None and record["grad_norm"] is None and record["nonfinite"] == ["loss", "grad_norm"]
    assert record["nested"] == {"a": None, "b": [1.0, None]} and record["t"] == 2.5
    json.loads(json.dumps(record, allow_nan=False), parse_constant=lambda c: pytest.fail(f"bare {c}"))


def test_metrics_logger_sets_an_earlier_run_aside_and_never_glues_to_a_torn_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    MetricsLogger(tmp_path, 5, 0, True, False, False).close()  # a run starting over at step 0
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # killed mid-write
    logger = MetricsLogger(tmp_path, 5, 1, True, False, False)  # a resumed run appends
    logger.log(2, {"loss": float("nan")})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 2, "loss": None, "nonfinite": ["loss"]}


def test_corpus_files_are_recognised_by_content(tmp_path):
    records = tmp_path / "records.json"
    records.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, "b"]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p"]}), tmp_path / "table.data")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait, a few stray bytes in real text\n".encode("latin-1"))
    assert [file_kind(p) for p in (records, array, tmp_path / "table.data", latin)] == ["jsonl", "json", "parquet", "text"]
    assert list(iter_documents([records, array], "text")) == ["doc 0", "doc 1", "doc 2", "a", "b"]
    for name, content in (("blob.txt", bytes(range(256)) * 40), ("noise.txt", bytes(range(128, 256)) * 40)):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ConfigError) as e:
            file_kind(tmp_path / name)
        assert e.value.field == "data.path" and "is not text" in e.value.problem


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 143)])
def test_stop_signals_become_a_request(signum, code):
    before = signal.getsignal(signum)
    with StopRequest() as stop:
        assert stop.exit_code == 0
        os.kill(os.getpid(), signum)
        time.sleep(0.05)
        assert stop.exit_code == code and stop.name == signal.Signals(signum).name
    assert signal.getsignal(signum) is before


def test_step_guard_skips_counts_and_stops_at_the_limit():
    guard = StepGuard(Control(False, 60), max_skipped_steps=3, stop=None)
    finite = torch.tensor(2.0)
    assert guard.verdict(finite, torch.tensor(1.0), False).skip is False
    assert guard.verdict(torch.tensor(float("nan")), finite, False).skip is True
    assert guard.verdict(finite, torch.tensor(float("inf")), False).skip is True
    assert guard.verdict(finite, finite, True).skip is True  # fp16 overflow in a gradient shard
    assert [guard.record(s, skipped) for s, skipped in ((1, True), (2, False), (3, True), (4, True), (5, True))] == \
        [False, False, False, False, True]
    assert guard.skipped_total == 4 and guard.streak_start == 3
    assert guard.weights_finite([torch.ones(2)]) and not guard.weights_finite([torch.tensor([1.0, math.inf])])


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from shardwise.train.rundir import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), "run.dir")
lock.acquire()
print("locked", flush=True)
time.sleep(60)
"""

_CHILD_LOCK = """
import sys
from pathlib import Path
from shardwise.train.rundir import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), "run.dir")
print("parent holds it" if lock.acquire(allow_parent=True) is None and lock.fd is None else "took it")
"""


def test_one_job_per_run_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError) as e:
            rundir.DirectoryLock(tmp_path, "run.dir").acquire()
        assert f"in use by pid {holder.pid}" in e.value.problem and e.value.field == "run.dir"
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: the kernel freed the lock, its record is stale.
    lock = rundir.DirectoryLock(tmp_path, "run.dir")
    note = lock.acquire()
    assert note is not None and f"pid {holder.pid}" in note and "no longer running" in note
    # A worker whose launcher (its parent) holds the lock does not take it again.
    child = subprocess.run([sys.executable, "-c", _CHILD_LOCK, str(tmp_path)], capture_output=True, text=True)
    assert child.stdout.strip() == "parent holds it", child.stderr
    lock.release()
    assert rundir.DirectoryLock(tmp_path, "run.dir").acquire() is None  # a clean release leaves no stale record


def _cfg(tmp_path, **keys):
    return build_config(None, [(k.replace("__", "."), str(v)) for k, v in keys.items()])


def test_run_directories_are_checked_before_spawning(tmp_path):
    (tmp_path / "file").write_text("x")
    for run_dir, phrase in ((tmp_path / "file", "exists and is not a directory"),
                            (tmp_path / "file" / "run", "cannot create")):
        with pytest.raises(ConfigError) as e:
            rundir.check_run_dirs(_cfg(tmp_path, run__dir=run_dir))
        assert e.value.field == "run.dir" and phrase in e.value.problem
    with pytest.raises(ConfigError) as e:
        rundir.check_run_dirs(_cfg(tmp_path, run__dir=tmp_path / "ok", checkpoint__dir=tmp_path / "file"))
    assert e.value.field == "checkpoint.dir"


def test_read_only_directories_are_refused(tmp_path, read_only_dir):
    with pytest.raises(ConfigError) as e:
        rundir.check_run_dirs(_cfg(tmp_path, run__dir=read_only_dir / "run"))
    assert e.value.field == "run.dir"
    with pytest.raises(ConfigError) as e:
        rundir.check_run_dirs(_cfg(tmp_path, run__dir=tmp_path / "run", checkpoint__dir=read_only_dir))
    assert e.value.field == "checkpoint.dir" and "not writable" in e.value.problem


def test_a_restart_that_ends_at_once_waits_for_rank_0_to_say_why(tmp_path):
    """A restarted worker group that reads an unrestartable failure ends at once; the other ranks wait until
    rank 0 has printed why (the first worker to exit makes the agent stop the rest: a CI run lost rank 0's
    line so). Not longer than the wait's bound when rank 0 never says it; a new job clears what was said."""
    import time

    rundir.record_unrestartable_failure(tmp_path, "job-1", 3)
    start = time.monotonic()
    assert not rundir.wait_until_said(tmp_path, "job-1", 1, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2
    rundir.say_unrestartable(tmp_path, "job-1", 1)
    assert rundir.wait_until_said(tmp_path, "job-1", 1, timeout_s=5)
    assert not rundir.wait_until_said(tmp_path, "job-2", 1, timeout_s=0.1)  # another job's restart
    assert not rundir.wait_until_said(tmp_path, "job-1", 2, timeout_s=0.1)  # the next restart: not said yet
    rundir.clear_failure_record(tmp_path)
    assert not list((tmp_path / rundir.STATE_DIR).glob("failure*"))


def test_unrestartable_failures_are_remembered_per_job(tmp_path):
    rundir.record_unrestartable_failure(tmp_path, "job-1", 3)
    rundir.record_unrestartable_failure(tmp_path, "job-1", 1)  # restartable: not recorded
    assert rundir.unrestartable_failure(tmp_path, "job-1") == 3
    assert rundir.unrestartable_failure(tmp_path, "job-2") is None


def _failure(exitcode, message="", timestamp=0, pid=100):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp, pid=pid)


def test_launcher_names_the_root_cause(capsys, tmp_path):
    # Workers that printed their own line: the most specific code, nothing more printed.
    assert report_failure({0: _failure(3), 1: _failure(1, "Connection closed by peer")}) == 3
    assert report_failure({0: _failure(143), 1: _failure(4)}) == 4
    assert capsys.readouterr().err == ""
    # A killed rank is the cause, not the survivor that lost its peer (or was stopped by the agent).
    assert report_failure({0: _failure(1, "RuntimeError: Connection closed by peer", 5), 1: _failure(-9, "", 6, 42),
                           2: _failure(-15, "", 7)}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: rank 1 (pid 42) was killed by SIGKILL (sent by the kernel when host memory runs out, by a "
                   "scheduler's hard stop or by kill -9: dmesg names an out-of-memory kill); 2 other rank(s) stopped with it"]
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank_1.txt").write_text("Traceback ...")
    assert report_failure({0: _failure(1, "RuntimeError: connection reset by peer", 1),
                           1: _failure(1, "ValueError: bad shape", 2, 7)}, tmp_path) == 1
    err = capsys.readouterr().err
    assert "rank 1 (pid 7) failed: ValueError: bad shape" in err and "errors/rank_1.txt" in err
    # No error record (a native crash, or memory too short even to report): torchelastic's link to its docs
    # was the line ("failed: To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html").
    docs = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert report_failure({0: _failure(1, docs, 1, 9), 1: _failure(1, "RuntimeError: Connection closed by peer", 2)}) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: rank 0 (pid 9) exited with code 1 and no Python error: native code crashed, or memory "
                          "ran out even for reporting (its own output above says more); 1 other rank(s)"), err



GLOO_LOST = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
             "peer [198.18.0.1]:30119. This is typically caused by a remote worker crashing. Check the logs of the remote "
             "worker before reporting an error. GLHF!")


def test_a_rank_that_only_lost_its_peer_points_at_the_other_node(capsys):
    """Node 0 SIGKILLed mid-run: node 1's ranks all fail with gloo's lost-peer error, and the line was that
    error whole (a source path, "GLHF!"). It now says what happened and where to look."""
    assert report_failure({1: _failure(1, GLOO_LOST, 1, 7)}, every_node=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 1 (pid 7) lost its connection to a rank at 198.18.0.1 (connection closed by "
                          "peer): a process there died or the network to it failed, and that node's own output names "
                          "the cause"), err
    assert "GLHF" not in err and "pair.cc" not in err

def test_a_multi_node_failure_says_to_rerun_on_every_node(capsys, tmp_path):
    """One node rerun alone waits for the others at the rendezvous: a multi-node job's resume hint says
    every node (test_elastic follows it: both nodes rerun and the job resumes)."""
    from shardwise.train.manifest import MANIFEST, step_dir_name

    newest = tmp_path / step_dir_name(8)
    newest.mkdir()
    (newest / MANIFEST).write_text("{}")
    for every_node, words in ((False, "rerun the same command to resume"),
                              (True, "rerun the same command on every node to resume")):
        assert report_failure({0: _failure(-9, "", 1, 42)}, checkpoints=tmp_path, every_node=every_node) == 1
        err = capsys.readouterr().err
        assert f"newest checkpoint {newest}: {words} from it" in err, err
    # A run started with checkpoint.resume=false: its same command would start over (tests/dist/test_recovery.py
    # follows this advice); before, the hint said "rerun the same command" whatever the flag.
    for every_node, words in ((False, "rerun with --checkpoint.resume=true to resume from it"),
                              (True, "rerun on every node with --checkpoint.resume=true to resume from it")):
        assert report_failure({0: _failure(-9, "", 1, 42)}, checkpoints=tmp_path, every_node=every_node,
                              resumes=False) == 1
        err = capsys.readouterr().err
        assert f"newest checkpoint {newest}: {words} (with checkpoint.resume=false the same command starts over)" in err
        assert "the same command to resume" not in err, err


def test_a_storage_failure_advises_the_rerun_that_resumes():
    """A full disk mid-run: the advice resumes the run as it was started (checkpoint.resume true: the same
    command; false: the override), and a command that is no run says only "then rerun"."""
    import errno

    from shardwise.errors import storage_failure

    full = OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl")
    assert storage_failure(full).message.endswith("fix the permissions, then rerun the same command to resume from the "
                                                  "newest checkpoint")
    assert storage_failure(full, resumes=False).message.endswith(
        "then rerun with --checkpoint.resume=true to resume from the newest checkpoint (with checkpoint.resume=false "
        "the same command starts over)")
    assert storage_failure(full, then="then rerun").message.endswith("fix the permissions, then rerun")
    assert storage_failure(OSError(errno.ECONNRESET, "Connection reset by peer")) is None


# A rank of a one-process gloo group whose training raises `argv[2]`'s OS error; run in a process of its own
# (it initialises torch.distributed).
_RANK_RAISES_AN_OS_ERROR = """
import errno, sys
from pathlib import Path
import torch.distributed as dist
from shardwise.config import build_config
from shardwise.train import __main__ as entry, data, trainer
from shardwise.train.signals import StopRequest

class Trainer:
    def __init__(self, *args, **kwargs):
        pass

    def train(self):
        raise OSError(getattr(errno, sys.argv[2]), "raised by the test")

trainer.Trainer, data.prepare_data = Trainer, lambda *a, **k: None
distributed = sys.argv[3] == "distributed"
if distributed:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = build_config(None, [("model.preset", "tiny"), ("run.dir", sys.argv[1])])
print("exit code", entry._run(cfg, Path(sys.argv[1]), StopRequest(), "", 0, distributed))
"""


@pytest.mark.parametrize("error, code", [("ECONNRESET", 1), ("ENOSPC", 4)])
@pytest.mark.parametrize("launch", ["distributed", "alone"])
def test_a_rank_s_os_error_is_a_crash_or_a_storage_failure_never_a_traceback(tmp_path, error, code, launch):
    """A rank whose training raised an OS error that is not the disk's (a peer's or a loader worker's
    broken pipe) re-raised it from its own except clause: it escaped as a 66-line "[rank0]: Traceback" in
    the terminal and the launcher's line said "no Python error" (a CI run of 2026-11-27). Now it is a crash
    like any other, its traceback in errors/rank_0.txt; a full disk stays exit 4 with its one line.
    "alone": `python -m shardwise.train` without a launcher re-raised every crash; it now says it in one line,
    as the launcher would."""
    done = subprocess.run([sys.executable, "-c", _RANK_RAISES_AN_OS_ERROR, str(tmp_path / "run"), error, launch],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and f"exit code {code}" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    crash = tmp_path / "run" / "errors" / "rank_0.txt"
    if code == 1:
        assert "ConnectionResetError" in crash.read_text()
        said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert said == ([] if launch == "distributed" else [
            f"error: training failed: ConnectionResetError: [Errno 104] raised by the test (traceback: {crash}); "
            "no checkpoint was written yet"]), done.stderr
    else:
        assert not crash.exists() and f"cannot write (under {tmp_path / 'run'}): " in done.stderr and "free space" in done.stderr, \
            done.stderr  # the error names no file: the line names where the run writes (issue 57)


def test_a_one_process_run_s_bad_input_found_by_the_trainer_stays_exit_2(base_overrides, tmp_path, monkeypatch, capsys):
    """One process trains inside the CLI, whose crash handler turns any exception into exit 1: bad input the
    trainer itself finds (fp8 on a GPU without it, no torchao) must stay exit 2 with its field and fix."""
    from shardwise.cli import main
    from shardwise.train import trainer

    class Trainer:
        def __init__(self, *args, **kwargs):
            raise ConfigError("train.precision", '"fp8": raised by the test', 'use train.precision="bf16" on this GPU')

    monkeypatch.setattr(trainer, "Trainer", Trainer)
    argv = ["train", *[f"--{k}={v}" for k, v in base_overrides], f"--run.dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: train.precision: "fp8": raised by the test') and "training failed" not in err, err
    assert not (tmp_path / "run" / "errors").exists()
