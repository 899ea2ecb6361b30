"""Run-safety probes: what a user sees when a run goes wrong, one row per probe.

Each probe drives `shardwise train` (or `shardwise checkpoint verify`) as a user would — bad settings,
corrupt files, killed and stopped processes, a full disk — and records the exit code, how many
tracebacks and stderr lines were printed, and what happened to the run's files. It only uses the
command line, so it can be pointed at an older checkout to compare (`--src OLD_CHECKOUT/src`).

    .venv/bin/python benchmarks/run_safety_probes.py [--src DIR] [--only NAME ...] [--out results.json] [--smoke]

Probes that need root (a read-only or full tmpfs) are reported as skipped otherwise. Results are
printed as a table and written to benchmarks/results/run_safety_probes.json.

--smoke checks that the script still runs end to end (tests/dist/test_benchmarks_smoke.py): only the
probes in SMOKE_PROBES (one `shardwise train` each that pre-flight refuses within seconds, none needing
root), written to benchmarks/results/run_safety_probes.smoke.json unless --out is given; and, unlike a
full run, a probe that fails itself ("probe error") makes the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kill_soak import workers as children  # noqa: E402  (the launcher's direct children, from /proc)

CORPUS_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "json/decoder.py")


class Probe:
    """The shared settings of every probe: the interpreter, the tree under test and a scratch dir."""

    def __init__(self, src: Path | None, work: Path):
        self.env = dict(os.environ)
        if src is not None:
            self.env["PYTHONPATH"] = str(src)
        self.work = work
        corpus = work / "corpus.txt"
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        corpus.write_text("\n".join((stdlib / m).read_text() for m in CORPUS_MODULES))
        self.common = [f"--data.path={corpus}", "--data.tokenizer=byte", f"--data.cache_dir={work / 'cache'}",
                       "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=8",
                       "--train.micro_batch=4", "--train.warmup_steps=2", "--run.progress=false",
                       "--run.tensorboard=false"]

    def supports(self, key: str) -> bool:
        """Whether the tree under test knows a config key (an older checkout lacks the new ones)."""
        out = subprocess.run(self.command("config", f"--{key}=0"), capture_output=True, text=True, env=self.env)
        return "unknown config key" not in out.stderr

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "shardwise.cli", *args]

    def train_args(self, run: Path, *extra: str) -> list[str]:
        return self.command("train", *self.common, f"--run.dir={run}", *extra)

    def run(self, args: list[str], timeout: float = 300) -> dict:
        start = time.monotonic()
        try:
            p = subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=timeout, cwd=self.work)
            code, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = "timeout", (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
        return {"exit": code, "seconds": round(time.monotonic() - start, 1), "stdout": out, "stderr": err,
                "tracebacks": (out + err).count("Traceback (most recent call last)"),
                "stderr_lines": len([line for line in err.splitlines() if line.strip()])}

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        """A job in the background: stdout to `log`, stderr to `log`.err."""
        return subprocess.Popen(args, stdout=open(log, "w"), stderr=open(f"{log}.err", "w"), env=self.env,
                                cwd=self.work, start_new_session=True)


def outcome(log: Path) -> dict:
    """Tracebacks and stderr lines of a background job started by Probe.start."""
    out, err = log.read_text(), Path(f"{log}.err").read_text()
    return {"tracebacks": (out + err).count("Traceback (most recent call last)"),
            "stderr_lines": len([line for line in err.splitlines() if line.strip()]), "stderr": err}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def checkpoints(run: Path) -> list[str]:
    d = run / "checkpoints"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def last_metrics(run: Path) -> dict:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    return json.loads(lines[-1]) if lines else {}


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


def metrics_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip().startswith("{")]
    return max(steps, default=0)


def shard_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("*.distcp"))


# ---------------------------------------------------------------- probes


def probe_lr_divergence(p: Probe) -> dict:
    run = p.work / "lr"
    r = p.run(p.train_args(run, "--train.steps=20", "--train.lr=1e6", "--checkpoint.every=2", "--checkpoint.keep=2",
                           "--train.log_every=1"))
    text = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").is_file() else ""
    r["note"] = f"metrics has bare NaN: {'NaN' in text}; checkpoints left {checkpoints(run)}"
    return r


def probe_fp16_divergence(p: Probe) -> dict:
    run = p.work / "fp16"
    r = p.run(p.train_args(run, "--train.steps=12", "--train.lr=1e6", "--train.precision=fp16",
                           "--model.n_layers=1", "--train.log_every=1"))
    rec = last_metrics(run)
    r["note"] = f"last step {rec.get('step')}, loss scale {rec.get('loss_scale')}"
    return r


def _trained(p: Probe, name: str, steps: int = 6, every: int = 3, nproc: int = 1) -> Path:
    run = p.work / name
    extra = [f"--train.steps={steps}", f"--checkpoint.every={every}", "--checkpoint.keep=3"]
    if nproc > 1:
        extra += ["--nproc", str(nproc), "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2"]
    r = p.run(p.train_args(run, *extra))
    if r["exit"] != 0:
        raise RuntimeError(f"setup run failed: {r['stderr'][-2000:]}")
    return run


def _rerun_after(p: Probe, name: str, damage: Callable[[Path], str]) -> dict:
    run = _trained(p, name)
    newest = run / "checkpoints" / checkpoints(run)[-1]
    what = damage(newest)
    r = p.run(p.train_args(run, "--train.steps=8", "--checkpoint.every=3", "--checkpoint.keep=3"))
    text = r["stdout"] + r["stderr"]
    resumed = [line for line in text.splitlines() if "resumed from" in line]
    r["note"] = f"{what}; {resumed[0].strip() if resumed else 'no resume line'}; checkpoints {checkpoints(run)}"
    return r


def probe_truncated_shard(p: Probe) -> dict:
    def damage(step: Path) -> str:
        f = shard_files(step)[0]
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return f"truncated {f.name}"
    return _rerun_after(p, "trunc", damage)


def probe_deleted_shard(p: Probe) -> dict:
    def damage(step: Path) -> str:
        f = shard_files(step)[0]
        f.unlink()
        return f"deleted {f.name}"
    return _rerun_after(p, "deleted", damage)


def probe_empty_trainer_state(p: Probe) -> dict:
    def damage(step: Path) -> str:
        (step / "trainer_state.json").write_text("")
        return "emptied trainer_state.json"
    return _rerun_after(p, "emptystate", damage)


def probe_flipped_bytes(p: Probe) -> dict:
    def damage(step: Path) -> str:
        f = shard_files(step)[0]
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        f.write_bytes(bytes(data))
        return f"flipped 64 bytes of {f.name}"
    return _rerun_after(p, "flipped", damage)


def probe_crafted_metadata(p: Probe) -> dict:
    """A .metadata whose unpickling runs a command (creates a file): does a resume execute it?"""
    marker = p.work / "pwned"

    def damage(step: Path) -> str:
        import pickle

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        (step / ".metadata").write_bytes(pickle.dumps(Evil()))
        return "replaced .metadata with a pickle that runs `touch`"
    r = _rerun_after(p, "crafted", damage)
    r["note"] += f"; code executed: {marker.exists()}"
    return r


def probe_kill_launcher(p: Probe) -> dict:
    run = p.work / "killlauncher"
    args = p.train_args(run, "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2",
                        "--train.steps=2000", "--checkpoint.every=50")
    proc = p.start(args, p.work / "killlauncher.log")
    wait_for(lambda: metrics_step(run) >= 10 or proc.poll() is not None, 120)
    workers = children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: not any(alive(w) for w in workers), 30)
    orphan_s = round(time.monotonic() - t0, 1)
    left = [w for w in workers if alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    return {"exit": -9, "seconds": orphan_s, "tracebacks": 0, "stderr_lines": 0,
            "note": f"{len(workers)} workers; alive {orphan_s} s after the launcher died; killed by probe: {len(left)}"}


def probe_second_job_same_dir(p: Probe) -> dict:
    run = p.work / "twojobs"
    first = p.start(p.train_args(run, "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3",
                                 "--train.micro_batch=2", "--train.steps=2000", "--checkpoint.every=0"),
                    p.work / "twojobs.log")
    wait_for(lambda: metrics_step(run) >= 5 or first.poll() is not None, 120)
    r = p.run(p.train_args(run, "--train.steps=3"), timeout=120)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    r["note"] = "second job: " + ((r["stderr"].strip().splitlines() or ["(no stderr)"])[-1][:120])
    return r


def probe_sigterm_launcher(p: Probe, sig: int = signal.SIGTERM) -> dict:
    run = p.work / f"signal{sig}"
    proc = p.start(p.train_args(run, "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3",
                                "--train.micro_batch=2", "--train.steps=2000", "--checkpoint.every=0"),
                   p.work / f"signal{sig}.log")
    wait_for(lambda: metrics_step(run) >= 10 or proc.poll() is not None, 120)
    start = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"exit": proc.returncode, "seconds": round(time.monotonic() - start, 1), **outcome(p.work / f"signal{sig}.log"),
            "note": f"checkpoints after: {checkpoints(run)}"}


def probe_sigint_launcher(p: Probe) -> dict:
    return probe_sigterm_launcher(p, signal.SIGINT)


def probe_sigstop_rank(p: Probe, timeout_s: int = 20) -> dict:
    """SIGSTOP one worker; how long until the job says something and ends (limit 120 s)?"""
    run = p.work / "sigstop"
    args = p.train_args(run, "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3", "--train.micro_batch=2",
                        "--train.steps=2000", "--checkpoint.every=0")
    timeout_key = p.supports("run.collective_timeout_s")
    if timeout_key:
        args.append(f"--run.collective_timeout_s={timeout_s}")
    proc = p.start(args, p.work / "sigstop.log")
    wait_for(lambda: metrics_step(run) >= 10 or proc.poll() is not None, 120)
    workers = children(proc.pid)
    os.kill(workers[-1], signal.SIGSTOP)
    start = time.monotonic()
    try:
        proc.wait(timeout=120)
        ended = round(time.monotonic() - start, 1)
    except subprocess.TimeoutExpired:
        ended = None
        os.killpg(proc.pid, signal.SIGKILL)
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)
        proc.wait()
    left = [w for w in workers if alive(w)]
    return {"exit": proc.returncode if ended is not None else "hung", "seconds": ended if ended is not None else ">120",
            **outcome(p.work / "sigstop.log"),
            "note": f"timeout {f'{timeout_s} s' if timeout_key else 'fixed (600 s)'}; "
                    f"processes left: {len(left)}; stacks dumped: {(run / 'stall').is_dir()}"}


def probe_zero3_exit_codes(p: Probe, runs: int = 10) -> dict:
    codes = []
    for i in range(runs):
        run = p.work / f"z3_{i}"
        r = p.run(p.train_args(run, "--nproc", "2", "--parallel.dp_shard=2", "--parallel.zero=3",
                               "--train.micro_batch=2", "--train.steps=10", "--checkpoint.every=5"))
        codes.append(r["exit"])
    return {"exit": codes.count(0), "seconds": 0, "tracebacks": 0, "stderr_lines": 0,
            "note": f"{codes.count(0)}/{runs} exit 0 ({codes})"}


def _bad_dir(p: Probe, name: str, key: str, make: Callable[[Path], Path]) -> dict:
    target = make(p.work / name)
    r = p.run(p.train_args(p.work / f"{name}_run" if key != "run.dir" else target, "--train.steps=2",
                           *([f"--{key}={target}"] if key != "run.dir" else [])))
    r["note"] = (r["stderr"].strip().splitlines() or ["(no stderr)"])[0][:120]
    return r


def probe_run_dir_is_file(p: Probe) -> dict:
    def make(base: Path) -> Path:
        base.parent.mkdir(parents=True, exist_ok=True)
        base.write_text("not a directory")
        return base
    return _bad_dir(p, "runfile", "run.dir", make)


def probe_run_dir_under_file(p: Probe) -> dict:
    def make(base: Path) -> Path:
        base.write_text("not a directory")
        return base / "run"
    return _bad_dir(p, "underfile", "run.dir", make)


class ReadOnlyMount:
    """A read-only tmpfs at `path` (root only); unmounted on exit."""

    def __init__(self, path: Path, options: str = "ro"):
        self.path, self.options = path, options

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", self.options, "tmpfs", str(self.path)], check=True,
                       capture_output=True)
        return self.path

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def probe_run_dir_read_only(p: Probe) -> dict:
    if not can_mount():
        return {"exit": "skipped", "note": "needs root for a read-only tmpfs"}
    with ReadOnlyMount(p.work / "ro_run") as ro:
        r = p.run(p.train_args(ro / "run", "--train.steps=2"))
    r["note"] = (r["stderr"].strip().splitlines() or ["(no stderr)"])[0][:120]
    return r


def probe_checkpoint_dir_read_only(p: Probe) -> dict:
    if not can_mount():
        return {"exit": "skipped", "note": "needs root for a read-only tmpfs"}
    with ReadOnlyMount(p.work / "ro_ckpt") as ro:
        r = p.run(p.train_args(p.work / "ro_ckpt_run", "--train.steps=4", f"--checkpoint.dir={ro / 'ckpt'}"))
    r["note"] = f"{r['seconds']} s; " + (r["stderr"].strip().splitlines() or ["(no stderr)"])[-1][:100]
    return r


def probe_disk_full(p: Probe) -> dict:
    if not can_mount():
        return {"exit": "skipped", "note": "needs root for a small tmpfs"}
    with ReadOnlyMount(p.work / "small", "size=1200k") as small:
        ckpt = small / "ckpt"
        r = p.run(p.train_args(p.work / "small_run", "--train.steps=6", "--checkpoint.every=2", "--checkpoint.keep=5",
                               f"--checkpoint.dir={ckpt}"))
        left = sorted(x.name for x in ckpt.iterdir()) if ckpt.is_dir() else []
    r["note"] = f"left in checkpoint dir: {left}"
    return r


def probe_changed_model(p: Probe) -> dict:
    run = _trained(p, "changed_model")
    r = p.run(p.train_args(run, "--train.steps=8", "--model.dim=128"))
    r["note"] = (r["stderr"].strip().splitlines() or ["(no stderr)"])[0][:120]
    return r


def probe_changed_global_batch(p: Probe) -> dict:
    run = _trained(p, "changed_batch")
    r = p.run(p.train_args(run, "--train.steps=8", "--train.global_batch=16"))
    r["note"] = (r["stderr"].strip().splitlines() or ["(no stderr)"])[0][:120]
    return r


def probe_finished_run(p: Probe) -> dict:
    run = _trained(p, "finished")
    r = p.run(p.train_args(run, "--train.steps=6"))
    r["note"] = (r["stdout"].strip().splitlines() or [""])[-1][:120]
    return r


def probe_json_lines_named_json(p: Probe) -> dict:
    corpus = p.work / "records.json"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(300)))
    run = p.work / "jsonrun"
    r = p.run(p.train_args(run, "--train.steps=2", f"--data.path={corpus}"))
    out = r["stdout"] + r["stderr"]
    docs = [line for line in out.splitlines() if line.startswith("data:")]
    r["note"] = docs[0][:120] if docs else "no data line"
    return r


def probe_binary_corpus(p: Probe) -> dict:
    corpus = p.work / "blob.txt"
    corpus.write_bytes(bytes(range(256)) * 400)
    r = p.run(p.train_args(p.work / "binrun", "--train.steps=2", f"--data.path={corpus}"))
    r["note"] = (r["stderr"].strip().splitlines() or ["(no stderr)"])[0][:120]
    return r


PROBES = {name[len("probe_"):]: fn for name, fn in globals().items() if name.startswith("probe_")}
# --smoke: the probes that take one short command each and need no root; together they still go through the
# Probe set-up (corpus, common arguments), Probe.run and the table and JSON below.
SMOKE_PROBES = ["run_dir_is_file", "run_dir_under_file", "binary_corpus"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=None, help="src/ directory of the checkout to probe (default: this one)")
    parser.add_argument("--only", nargs="*", default=None, help=f"probes to run: {', '.join(PROBES)}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "run_safety_probes.json"))
    parser.add_argument("--smoke", action="store_true",
                        help=f"does the script still run? only {', '.join(SMOKE_PROBES)}; a probe error is exit 1")
    args = parser.parse_args()
    if args.smoke:  # smoke defaults replace the defaults only: options given explicitly still win
        parser.set_defaults(only=SMOKE_PROBES,
                            out=str(ROOT / "benchmarks" / "results" / "run_safety_probes.smoke.json"))
        args = parser.parse_args()
    names = args.only or list(PROBES)
    unknown = set(names) - set(PROBES)
    if unknown:
        print(f"error: unknown probes {sorted(unknown)}; choose from {', '.join(PROBES)}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwise-probes-") as tmp:
        p = Probe(Path(args.src).resolve() if args.src else None, Path(tmp))
        for name in names:
            try:
                row = PROBES[name](p)
            except Exception as e:  # a probe's own failure is a row, not the end of the table
                row = {"exit": "probe error", "note": f"{type(e).__name__}: {e}"[:200]}
            row = {"probe": name, **{k: v for k, v in row.items() if k not in ("stdout", "stderr")}}
            rows.append(row)
            print(f"{name:28s} exit {str(row.get('exit')):>6s}  tracebacks {row.get('tracebacks', '-')!s:>2s}  "
                  f"stderr lines {row.get('stderr_lines', '-')!s:>4s}  {row.get('seconds', '-')!s:>6s} s  {row.get('note', '')}",
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    # A full run reports a probe's own failure as a row and goes on; a smoke run exists to notice that the
    # script no longer works against the current command line, so there it is the exit status.
    errors = [r["probe"] for r in rows if r.get("exit") == "probe error"]
    if args.smoke and errors:
        print(f"smoke: probe error in {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
