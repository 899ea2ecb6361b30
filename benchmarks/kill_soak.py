"""Kill soak: automatic restart must lose nothing and change nothing.

Each trial starts `shardwise train` (2 processes, ZeRO-3, a checkpoint every few steps,
run.max_restarts=3) and SIGKILLs one worker chosen at random — at a random step, or, every other
trial, in the middle of a checkpoint save (the moment its step_N.tmp directory appears). torchrun's
elastic agent restarts the worker group, which resumes from the newest intact checkpoint. The trial
passes when the run exits 0 and its per-step losses (the last record of each step), final loss and
final parameters are bitwise equal to an uninterrupted run of the same job.

    .venv/bin/python benchmarks/kill_soak.py [--trials 20] [--seed 0] [--steps 24] [--out FILE.json] [--smoke]

Prints a row per trial and "N/T identical"; exit status 1 when any trial is not identical (the soak is
a check as well as a measurement). `make soak` runs 20 trials, `make test` two.

--smoke checks that the script still runs end to end (tests/dist/test_benchmarks_smoke.py): 1 trial (a
kill at a random step) of the shortest job the soak accepts (--steps 10), written to
benchmarks/results/kill_soak.smoke.json unless --out is given.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "json/decoder.py")
EVERY = 4
# --smoke: one trial of the shortest job main() accepts (two checkpoints and two steps after them). Its own
# default output file, so that a smoke run never replaces a real soak's result.
SMOKE = {"trials": 1, "steps": 2 * EVERY + 2, "out": str(ROOT / "benchmarks" / "results" / "kill_soak.smoke.json")}


def job_args(work: Path, run: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", "train", "--nproc", "2", f"--data.path={work / 'corpus.txt'}",
            "--data.tokenizer=byte", f"--data.cache_dir={work / 'cache'}", "--model.vocab_size=512",
            "--train.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2", "--train.warmup_steps=2",
            f"--train.steps={steps}", "--train.log_every=1", "--parallel.dp_shard=2", "--parallel.zero=3",
            f"--checkpoint.every={EVERY}", "--checkpoint.keep=2", "--run.max_restarts=3", "--run.save_final_model=true",
            "--run.progress=false", "--run.tensorboard=false", f"--run.dir={run}"]


def losses_by_step(run: Path) -> dict[int, float]:
    """The last loss logged for each step (a restarted run logs the steps after its checkpoint again)."""
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[int(record["step"])] = record["loss"]
    return out


def final_weights(run: Path) -> dict:
    import torch

    return torch.load(run / "final_model.pt", weights_only=True)


def same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def workers(launcher: int) -> list[int]:
    """The direct children of the launcher process: its workers (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{launcher}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def max_step(run: Path) -> int:
    try:
        return max(losses_by_step(run), default=0)
    except (OSError, KeyError, ValueError):
        return 0


def trial(work: Path, index: int, steps: int, rng: random.Random) -> dict:
    run = work / f"trial_{index}"
    mid_save = index % 2 == 1
    log = open(work / f"trial_{index}.log", "w")
    proc = subprocess.Popen(job_args(work, run, steps), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ckpts = run / "checkpoints"
    if mid_save:
        target = EVERY * rng.randint(1, max(1, (steps - 1) // EVERY - 1))
        tmp = ckpts / f"step_{target:08d}.tmp"
        what = f"during the save of step {target}"
        ready = lambda: tmp.exists()  # noqa: E731
        poll = 0.002
    else:
        target = rng.randint(2, steps - 3)
        what = f"at step {target}"
        ready = lambda: max_step(run) >= target  # noqa: E731
        poll = 0.02
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll)
    victims = workers(proc.pid)
    killed = None
    if victims and proc.poll() is None:
        killed = rng.randrange(len(victims))
        os.kill(victims[killed], signal.SIGKILL)
    landed_mid_save = mid_save and (ckpts / f"step_{target:08d}.tmp").exists()
    try:
        code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = "timeout"
    log.close()
    text = (work / f"trial_{index}.log").read_text()
    return {"trial": index, "killed": what + (f", worker {killed}" if killed is not None else " (job ended first)"),
            "mid_save": landed_mid_save, "exit": code, "restarts": text.count("the worker group was restarted"),
            "run": str(run)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kill_soak.json"))
    parser.add_argument("--smoke", action="store_true",
                        help=f"does the script still run? 1 trial of {SMOKE['steps']} steps")
    args = parser.parse_args()
    if args.smoke:  # smoke sizes replace the defaults only: options given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    if args.trials < 1 or args.steps < 2 * EVERY + 2:
        print(f"error: need --trials >= 1 and --steps >= {2 * EVERY + 2}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardwise-soak-") as tmp:
        work = Path(tmp)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        (work / "corpus.txt").write_text("\n".join((stdlib / m).read_text() for m in CORPUS_MODULES))
        reference = work / "reference"
        ref = subprocess.run(job_args(work, reference, args.steps), capture_output=True, text=True)
        if ref.returncode != 0:
            print(f"error: the uninterrupted run failed:\n{ref.stderr[-3000:]}", file=sys.stderr)
            return 1
        ref_losses, ref_weights = losses_by_step(reference), final_weights(reference)
        for i in range(args.trials):
            row = trial(work, i, args.steps, rng)
            run = Path(row.pop("run"))
            ok = row["exit"] == 0 and (run / "final_model.pt").is_file()
            row["losses_identical"] = ok and losses_by_step(run) == ref_losses
            row["weights_identical"] = ok and same_weights(final_weights(run), ref_weights)
            row["identical"] = bool(row["losses_identical"] and row["weights_identical"])
            rows.append(row)
            print(f"trial {i:2d}: killed {row['killed']:38s} mid-save {'yes' if row['mid_save'] else 'no ':3s} "
                  f"restarts {row['restarts']}  exit {row['exit']}  {'identical' if row['identical'] else 'DIFFERENT'}",
                  flush=True)
            if not row["identical"]:
                print((work / f"trial_{i}.log").read_text()[-3000:], flush=True)
    same = sum(r["identical"] for r in rows)
    print(f"{same}/{len(rows)} identical")
    result = {"trials": rows, "identical": same, "steps": args.steps, "seed": args.seed}
    if args.smoke:
        result["smoke"] = True
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
