"""`shardwise parity`: prove that layouts train like one device (docs/architecture.md §3).

The single-process reference and every layout train the same model from the same seed on the same
global batches; per-step losses and the final unsharded weights are compared. Layouts of equal world
size share one launch (one process group, several cases), so the start-up cost is paid once per size.

Tolerances (fp32): relative |dloss| <= 1e-5 per step (docs/architecture.md §3). Sharded and accumulated layouts
sum the same numbers in a different order, so fp32 rounding (~6e-8 relative per addition) makes losses
differ in the 7th digit, not bitwise; 1e-5 leaves two orders of margin yet catches any real bug
(a wrong scale, a missing shard or a skipped reduction moves the loss by >= 1e-3). Weights after N
AdamW steps may differ by a few ulps of the update size lr; max |dparam| <= 1e-4 is reported too.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from shardwise.config import Config, build_config, load_toml, parse_overrides
from shardwise.errors import ConfigError
from shardwise.paths import writable_dir

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4


# A layout may carry model.* / data.* keys (model.vocab_size=509, another preset): they define the
# problem, so such layouts get a reference of their own, trained with those keys on one process.
# Every other key is compared with the shared reference: parallel.* and micro-batching / recompute
# must not change the numbers, and any other train.* key (lr, precision) is exactly the kind of
# difference parity exists to flag.
OWN_REFERENCE_SECTIONS = ("model.", "data.")


@dataclass
class Case:
    name: str
    world_size: int
    reference: str = "reference"


def reference_overrides(layout: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The part of a layout the single-process reference must share: its model.* and data.* keys."""
    return [(k, v) for k, v in layout if k.startswith(OWN_REFERENCE_SECTIONS)]


def parse_layout(text: str) -> list[tuple[str, str]]:
    """'dp_shard=2,zero=3' -> [('parallel.dp_shard', '2'), ('parallel.zero', '3')]; keys with a
    section ('train.micro_batch=1') are taken as written."""
    out = []
    # Commas inside brackets belong to a list value: pp_layers_per_stage=[1,3].
    items = re.split(r",(?![^\[]*\])", text)
    for item in filter(None, (s.strip() for s in items)):
        if "=" not in item:
            raise ConfigError("--layout", f"{item!r} in {text!r} is not key=value", "write e.g. --layout dp_shard=2,zero=3")
        key, value = item.split("=", 1)
        out.append((key if "." in key else f"parallel.{key}", value))
    return out


def layout_world_size(cfg: Config, nproc: int) -> int:
    p = cfg.parallel
    if p.dp_shard == -1:
        return nproc
    return p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp


def parity_config(base_toml: dict, base_overrides: list[tuple[str, str]], extra: list[tuple[str, str]], run_dir: Path) -> Config:
    cfg = build_config(base_toml, base_overrides + extra)
    cfg.run.dir = str(run_dir)
    cfg.run.progress = False
    cfg.run.tensorboard = False
    cfg.run.loss_curve = False  # 0.4 s of drawing per case, a fifth of a warm case's time (nobody looks at it)
    cfg.run.save_final_model = True
    cfg.checkpoint.final = False
    cfg.checkpoint.every = 0
    cfg.checkpoint.resume = False
    return cfg


def run_cases_in_group(configs: list[Config]) -> None:
    """Worker side: train each config in turn on the already initialized process group."""
    for cfg in configs:
        train_and_record(cfg, single_process=False)


def train_and_record(cfg: Config, single_process: bool) -> None:
    """Train one case; rank 0 writes losses.json (final_model.pt comes from run.save_final_model)."""
    from shardwise.train.trainer import Trainer

    if cfg.train.compile:
        # A worker trains many cases: each starts from dynamo's empty cache, so no case's graphs or
        # recompilations count against the next one's (dynamo's per-code recompile limit is 8).
        import torch._dynamo

        torch._dynamo.reset()
    trainer = Trainer(cfg, log=None, single_process=single_process)
    losses = trainer.train()
    if trainer.rank == 0:
        (Path(cfg.run.dir) / "losses.json").write_text(json.dumps(losses))


def compare(ref_dir: Path, case_dir: Path) -> tuple[float, float, int]:
    """(max relative |dloss| over steps, max |dparam| at the end, steps compared)."""
    import torch

    ref_losses = json.loads((ref_dir / "losses.json").read_text())
    losses = json.loads((case_dir / "losses.json").read_text())
    if len(losses) != len(ref_losses):
        return float("inf"), float("inf"), len(losses)
    dloss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    ref = torch.load(ref_dir / "final_model.pt", weights_only=True)
    got = torch.load(case_dir / "final_model.pt", weights_only=True)
    if ref.keys() != got.keys():
        return dloss, float("inf"), len(losses)
    dparam = max((ref[k].float() - got[k].float()).abs().max().item() for k in ref)
    return dloss, dparam, len(losses)


def valid_losses(run_dir: Path) -> dict[str, float]:
    """The last validation round's loss per set in a run's metrics.jsonl ({} without one)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    out: dict[str, float] = {}
    for row in rows:
        out.update({k[len("valid_loss_"):]: v for k, v in row.items() if k.startswith("valid_loss_")})
    return out


def compare_valid(ref_dir: Path, case_dir: Path) -> float | None:
    """The largest relative |d validation loss| over the sets, None when the reference has no validation.
    Forward only, the layouts sum the same per-token losses in another order: the training loss's bound
    (LOSS_RTOL) holds, and a missing or mis-scaled shard moves it by >= 1e-3 as it does the training loss."""
    ref, got = valid_losses(ref_dir), valid_losses(case_dir)
    if not ref:
        return None
    if set(got) != set(ref):
        return float("inf")
    return max(abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in ref)


def parity_main(argv: list[str]) -> int:
    from shardwise.launch.local import check_nproc

    parser = argparse.ArgumentParser(prog="shardwise parity")
    parser.add_argument("--nproc", type=int, required=True, help="most processes a layout may use")
    parser.add_argument("--layout", action="append", default=[],
                        help="comma-separated keys, bare ones meaning parallel.*, e.g. dp_shard=2,zero=3 or "
                        "tp=2,model.vocab_size=509 (model.*/data.* keys get their own single-process reference)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    args, rest = parser.parse_known_args(argv)
    check_nproc(args.nproc)
    if not args.layout:
        raise ConfigError("--layout", "no layout given", "pass at least one, e.g. --layout dp_shard=2,zero=3")
    base_toml = load_toml(args.config) if args.config else {}
    base = parse_overrides(rest) + [("train.steps", str(args.steps))]
    if args.out:
        writable_dir(Path(args.out), "--out")
    out = Path(args.out or tempfile.mkdtemp(prefix="shardwise-parity-"))
    try:
        return _run_parity(args, base_toml, base, out)
    finally:
        if not args.out:  # a temporary directory of checkpoints-sized files: nobody would clean it up
            shutil.rmtree(out, ignore_errors=True)


def _run_parity(args: argparse.Namespace, base_toml: dict, base: list[tuple[str, str]], out: Path) -> int:
    from shardwise.launch.local import torchrun
    from shardwise.preflight import check
    from shardwise.train.data import prepare_data

    references: dict[tuple, str] = {(): "reference"}
    cases: list[tuple[Case, Config]] = []
    for i, text in enumerate(args.layout):
        layout = parse_layout(text)
        ref_key = tuple(reference_overrides(layout))
        references.setdefault(ref_key, f"reference_{len(references)}")
        cfg = parity_config(base_toml, base, layout, out / f"layout_{i}")
        world = layout_world_size(cfg, args.nproc)
        if world > args.nproc:
            raise ConfigError("--layout", f"{text!r} needs {world} processes but --nproc is {args.nproc}",
                              f"pass --nproc {world} or shrink the layout")
        check(cfg, world)  # every layout is validated before anything is spawned
        cases.append((Case(text, world, references[ref_key]), cfg))
    ref_cfgs = [parity_config(base_toml, base, list(key), out / name) for key, name in references.items()
                if any(c.reference == name for c, _ in cases)]
    for ref_cfg in ref_cfgs:
        check(ref_cfg, 1)

    for ref_cfg in ref_cfgs:
        prepare_data(ref_cfg.data, ref_cfg.model.vocab_size)
        name = Path(ref_cfg.run.dir).name
        own = f" {name} ({', '.join(f'{k}={v}' for k, v in next(k for k, n in references.items() if n == name))})" \
            if name != "reference" else ""
        print(f"parity: single-process reference{own}, {args.steps} steps, runs in {out}"
              + ("" if args.out else " (temporary: removed at the end; pass --out DIR to keep them)"))
        train_and_record(ref_cfg, single_process=True)

    failed_launch: set[str] = set()
    for world in sorted({c.world_size for c, _ in cases}):
        group = [(c, cfg) for c, cfg in cases if c.world_size == world]
        spec = out / f"world_{world}.json"
        for _, cfg in group:
            Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
            cfg.save(Path(cfg.run.dir) / "config.toml")
        spec.write_text(json.dumps([str(Path(cfg.run.dir) / "config.toml") for _, cfg in group]))
        print(f"parity: {len(group)} layout(s) on {world} processes")
        if world == 1:
            for _, cfg in group:
                train_and_record(cfg, single_process=True)
        elif torchrun(world, "shardwise.parity", ["--worker", str(spec)]) != 0:
            failed_launch.update(c.name for c, _ in group)
    return report(out, cases, failed_launch)


def report(out: Path, cases: list[tuple[Case, Config]], failed_launch: set[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parity vs single process (loss rtol {LOSS_RTOL:g}, param atol {PARAM_ATOL:g})")
    table.add_column("layout", overflow="fold")
    validated = any(valid_losses(out / case.reference) for case, _ in cases)
    for col in ("procs", "steps", "max rel |dloss|", "max |dparam|") + (("rel |d valid loss|",) if validated else ()) + ("verdict",):
        table.add_column(col, no_wrap=True)
    all_ok = True
    rows = []
    for case, cfg in cases:
        case_dir = Path(cfg.run.dir)
        if case.name in failed_launch or not (case_dir / "losses.json").exists():
            table.add_row(case.name, str(case.world_size), "-", "-", "-", *(("-",) if validated else ()), "ERROR (did not run)")
            all_ok = False
            rows.append({"layout": case.name, "verdict": "error"})
            continue
        dloss, dparam, steps = compare(out / case.reference, case_dir)
        dvalid = compare_valid(out / case.reference, case_dir)
        ok = dloss <= LOSS_RTOL and dparam <= PARAM_ATOL and (dvalid is None or dvalid <= LOSS_RTOL)
        all_ok &= ok
        shown = (("-" if dvalid is None else f"{dvalid:.2e}"),) if validated else ()
        table.add_row(case.name, str(case.world_size), str(steps), f"{dloss:.2e}", f"{dparam:.2e}", *shown, "PASS" if ok else "FAIL")
        rows.append({"layout": case.name, "reference": case.reference, "procs": case.world_size, "steps": steps, "max_rel_dloss": dloss,
                     "max_abs_dparam": dparam, "verdict": "pass" if ok else "fail"}
                    | ({"rel_dvalid_loss": dvalid} if dvalid is not None else {}))
    # Piped (a log file, CI), rich would lay the table out for 80 columns and fold layout names mid-word.
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    (out / "parity.json").write_text(json.dumps(rows, indent=1))
    return 0 if all_ok else 1


def worker_main(argv: list[str]) -> NoReturn:
    """`python -m shardwise.parity --worker SPEC.json` under torchrun."""
    from shardwise.config import load_config
    from shardwise.train.distributed import finish_distributed, init_distributed, leave
    from shardwise.train.signals import exit_with_parent

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    args = parser.parse_args(argv)
    configs = [load_config(p) for p in json.loads(Path(args.worker).read_text())]
    exit_with_parent()
    init_distributed(configs[0].run.collective_timeout_s, configs[0].run.backend)
    run_cases_in_group(configs)
    finish_distributed()
    leave(0)  # a failure above propagates: torchrun reports it, and parity marks the launch as failed


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
