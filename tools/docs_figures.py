"""Regenerate the figures the docs embed (docs/images/), from real runs of the code, not drawn by hand.

    .venv/bin/python tools/docs_figures.py          # or: make figures (about a minute on 2 cores)

Each figure is the file the command itself writes, copied: the loss curve of the demo run
(`make demo`, run.dir/loss_curve.png), the pipeline Gantt chart of an interleaved 1F1B run on 2 ranks
with 8 micro-batches (run.dir/pipeline_chart.png), and the planner's memory breakdown and search space
for the 70B example (`plan search --plot`). The runs go to a temporary directory; nothing else in the
tree changes. The loss curve and the planner's figure come out byte-identical on a rerun (fixed seeds,
no timings); the pipeline chart is a measurement and differs each time. `tests/unit/test_docs.py`
holds the docs to these files (each embedded image exists, is a PNG, is small, and each file is
embedded somewhere).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
CLI = [sys.executable, "-m", "shardwise.cli"]

# (image name, command after `shardwise`, the file it writes relative to the scratch directory)
FIGURES = [
    ("loss_curve.png",
     ["train", "--nproc", "2", "--config", str(ROOT / "configs" / "demo.toml"), "--checkpoint.every=0",
      "--checkpoint.final=false", "--run.dir=demo"],
     "demo/loss_curve.png"),
    ("pipeline_chart.png",  # wider blocks than the tiny preset's: the chart should show compute, not launch gaps
     ["train", "--nproc", "2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
      "--parallel.pp_virtual_stages=2", "--model.n_layers=4", "--model.dim=256", "--model.ffn_dim=768",
      "--train.global_batch=16", "--train.micro_batch=2", "--train.steps=6", "--train.log_every=3",
      "--checkpoint.every=0", "--checkpoint.final=false", "--run.dir=pp"],
     "pp/pipeline_chart.png"),
    ("plan_memory.png",
     ["plan", "search", "--config", str(ROOT / "configs" / "plan-llama3-70b.toml"), "--top", "5",
      "--plot", "plan.png"],
     "plan.png"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(IMAGES), help="where the PNGs go (default docs/images)")
    parser.add_argument("--only", default="", help="comma-separated image names to regenerate")
    args = parser.parse_args(argv)
    wanted = {n for n in args.only.split(",") if n}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardwise-figures-") as scratch:
        for name, command, produced in FIGURES:
            if wanted and name not in wanted:
                continue
            done = subprocess.run([*CLI, *command], cwd=scratch, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name}: `shardwise {' '.join(command)}` failed (exit {done.returncode}):\n"
                      f"{done.stderr[-2000:]}", file=sys.stderr)
                return 1
            shutil.copyfile(Path(scratch) / produced, out / name)
            print(f"{out / name}: {(out / name).stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
