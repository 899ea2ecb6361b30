"""`shardwise train | parity | config | plan | pipeline-chart | checkpoint verify` — the command line.

Every input error surfaces here as a ConfigError before any process is spawned: printed without a
traceback, exit code 2. A failure during a run is one line and its exit code (errors.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from shardwise.config import Config, load_config
from shardwise.config_reference import describe
from shardwise.errors import EXIT_FAILED, ConfigError, Interrupted, RunFailure, storage_failure
from shardwise.paths import writable_file

USAGE = """shardwise <command> [options]

commands:
  train    --config FILE.toml [--nproc N] [--section.key=value ...]   train (N local processes)
           [--nnodes N or MIN:MAX --node-rank K --rdzv-endpoint HOST:PORT]   multi-node (MIN:MAX: elastic)
  parity   --nproc N --layout k=v,k=v [--layout ...] [--steps 20] [--config FILE.toml] [--section.key=value ...]
           compare layouts with the single-process reference
  data     prepare [--config FILE.toml] [--workers N] [--data.path=... or [[data.sources]]] [--section.key=value ...]
           tokenize a corpus into token shards (parallel, resumable) where `train` finds them
  config   [--config FILE.toml] [--section.key=value ...] [--keys]     print the resolved config (or every key)
  plan     evaluate --config FILE.toml [--json] [--assume-mfu X] [--plot out.png] [--section.key=value ...]
           search   --config FILE.toml [--top 10] [--json] [--emit best.toml] [--plot out.png]
                    [--allow-cross-node-tp] [--allow-uneven-pp] [--assume-mfu X] [--section.key=value ...]
                    [--verify K [--verify-ranks 0,last]]   build the K best on the meta device (as dryrun), drop
                    what cannot be built at this size
           predict memory, step time, MFU and days of a layout on [cluster] (no GPU needed), or search for the best
           evaluate --mode=decode [--batch B --prompt-len P --max-new-tokens N]   serving one tp x pp replica
           calibrate RUN_DIR... [--runs FILE.json] [--out calib.json]   fit the time model to measured runs
  pipeline-chart RUN_DIR [--out chart.png] [--text]
           draw the measured pipeline schedule of a PP run (per-stage Gantt chart) with its bubble
  export   --run-dir R [--step N] --hf OUT [--dtype float32|bfloat16]
           write a checkpoint as a Hugging Face Llama directory (transformers loads it); the tokenizer too
  generate (--run-dir R [--step N] | --hf DIR) (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
           [--greedy | --temperature T --top-p P --seed S] [--nproc N --parallel.tp=T --parallel.pp=P] [--json]
           sample with a KV cache, on one process or tensor / pipeline parallel
  checkpoint verify DIR
           check every checkpoint in a run directory (or checkpoints/, or one step_N) against its
           manifest, without loading it; exit 1 if one is damaged
  bench-comm --nproc N [--config FILE.toml] [--sizes 1K:16M] [--json] [--out b.json] [--plot b.png]  busbw per mesh axis
  launch   mpirun --config FILE.toml --hosts a:8,b:8 [--export NAME=VALUE] [--section.key=value ...]  print the mpirun command
  launch   slurm --config FILE.toml --nodes N --gpus-per-node G [--partition P --time T --account A] [--out F.sbatch] [--submit]
  launch   k8s --config FILE.toml --nodes N --gpus-per-node G --image IMAGE [--kind trainjob|jobset|pytorchjob] [--pvc CLAIM]
           [--queue Q] [--out job.yaml]   a Kubernetes manifest (MIN:MAX nodes: an elastic PyTorchJob); --validate FILE
  dryrun   --config FILE.toml --nnodes N --nproc P [--ranks 0,last,...] [--json FILE] [--section.key=value ...]
           build chosen ranks of the N x P job on the meta device (torch's fake process group): their parameter,
           gradient and optimizer bytes beside the planner's, with each rank's build time and peak memory
  doctor   [--json] [--nproc N] [--disk DIR]   check this machine (devices, /dev/shm, ulimit -l, InfiniBand,
           NCCL_*) and run a test all-reduce; --disk DIR: its read/write GB/s (offload="nvme")

shardwise --version prints the version; shardwise <command> --help the command's options.

exit codes: 0 ok, 1 failed, 2 bad input, 3 diverged, 4 I/O error, 5 stalled collective, 6 too few nodes,
            130 / 143 interrupted (SIGINT / SIGTERM, SIGUSR1) after writing a checkpoint
"""


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="shardwise train", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="shardwise train [--config FILE.toml] [--nproc N] [--nnodes N --node-rank K --rdzv-endpoint HOST:PORT] "
              "[--section.key=value ...]",
        epilog="config overrides:\n  --section.key=value   any config key, after the file (e.g. --parallel.tp=2 "
               "--train.steps=100);\n                        `shardwise config --keys` lists every key with its default\n\n"
               "multi-node: run the same command on every machine, --node-rank 0..N-1, with node 0's reachable\n"
               "address as --rdzv-endpoint (a loopback address is refused); node 0 owns the run directory")
    parser.add_argument("--config", default=None, help="TOML config file (default: built-in defaults)")
    parser.add_argument("--nproc", type=int, default=1, help="processes to launch on this node")
    parser.add_argument("--nnodes", default="1", help="machines in the job (each runs this command); MIN:MAX: elastic, "
                        "the job goes on with any count in the range when a node is lost or joins (docs/clusters.md)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0..nnodes-1 (0 owns the run directory)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous, node 0's reachable address")
    parser.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: derived from run.dir)")
    args, overrides = parser.parse_known_args(argv)
    nodes = None
    try:
        # The launch's own arguments before the config: once they hold, a refusal is told to the nodes
        # waiting at the rendezvous (_tell_the_other_nodes).
        nodes = _launch_arguments(args)
        return _train_on_this_node(args, overrides, nodes)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr, flush=True)
        if nodes is not None and not nodes.elastic:
            _tell_the_other_nodes(nodes, e)
        return 2


def _launch_arguments(args):
    """--nproc, --nnodes, --node-rank and --rdzv-endpoint checked: this node's part of a multi-node launch
    (launch/rendezvous.py MultiNode, its rendezvous id still unset), or None for a single-node one."""
    from shardwise.launch.local import check_nproc
    from shardwise.launch.rendezvous import check_multinode, parse_nnodes

    check_nproc(args.nproc)
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    return check_multinode(max_nodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id or "", min_nodes)


def _tell_the_other_nodes(nodes, error: ConfigError) -> None:
    """This node of a multi-node job (not elastic), whose launch arguments held, was refused before the
    rendezvous: the nodes waiting there end now with its error instead of after run.rendezvous_timeout_s
    (launch/peer_failure.py). A node whose own --node-rank or --rdzv-endpoint is wrong tells nobody."""
    from shardwise.launch.peer_failure import TELL_WAIT_S, serve_refusal, tell_waiting_nodes

    print(f"node {nodes.node_rank}: telling the {'other nodes' if nodes.node_rank == 0 else 'nodes'} at the rendezvous "
          f"{nodes.endpoint} (up to {TELL_WAIT_S:g} s)", flush=True)
    if nodes.node_rank != 0:
        tell_waiting_nodes(nodes.endpoint, nodes.node_rank, error.render())
        return
    try:
        serve_refusal(nodes.endpoint, error.render(), readers=nodes.nnodes - 1)
    except (RuntimeError, ValueError, OSError):  # the port is another program's: the nodes will time out there
        pass


def _train_on_this_node(args, overrides: list[str], nodes) -> int:
    """`shardwise train` after its launch arguments (`nodes`: _launch_arguments): the config, data and disk
    checks, then this node's workers (or the trainer in this process)."""
    import hashlib

    # Imported after the arguments: --help and bad input answer without loading torch (train.data imports it).
    from shardwise.launch.host_memory import check_offload_fits_host
    from shardwise.launch.local import torchrun
    from shardwise.preflight import check, check_elastic
    from shardwise.scratch import owned_file
    from shardwise.train import rundir

    cfg = load_config(args.config, overrides)
    # Every node derives the same id from the same config; a rerun reuses it, hence clear_failure_record below.
    rdzv_id = args.rdzv_id or f"shardwise-{hashlib.sha256(cfg.run.dir.encode()).hexdigest()[:12]}"
    if nodes is not None:
        nodes = dataclasses.replace(nodes, rdzv_id=rdzv_id, join_timeout_s=cfg.run.rendezvous_timeout_s,
                                    last_call_s=cfg.run.rendezvous_last_call_s)
    if nodes is not None and nodes.elastic:
        check_elastic(cfg, args.nproc, nodes.min_nodes, nodes.nnodes)
    else:
        check(cfg, args.nproc * (nodes.nnodes if nodes is not None else 1))
        if cfg.run.evict_stragglers:
            raise ConfigError("run.evict_stragglers", "is on, but this job is not elastic: it cannot go on without a node",
                              "launch an elastic job (--nnodes MIN:MAX with --node-rank and --rdzv-endpoint, e.g. "
                              "--nnodes 1:2), or set run.evict_stragglers=false to have stragglers only named")
    seat = []  # the worker's node in an elastic job that evicts stragglers (train/eviction.py)
    if cfg.run.evict_stragglers:
        from shardwise.errors import EXIT_EVICTED
        from shardwise.train import eviction

        refused = eviction.refusal(Path(cfg.run.dir), nodes.node_rank)
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return EXIT_EVICTED
        seat = ["--node-rank", str(nodes.node_rank), "--min-nodes", str(nodes.min_nodes)]
    # Offloaded states against this node's memory, at the fewest nodes the job may run on (the largest shards).
    check_offload_fits_host(cfg, args.nproc * ((nodes.min_nodes or nodes.nnodes) if nodes is not None else 1), args.nproc)
    rundir.check_cache_dir(cfg)
    if nodes is None or nodes.node_rank == 0:  # rank 0's node: run.metrics_port free now, or exit 2 before spawning
        from shardwise.train.live_metrics import check_port_free

        check_port_free(cfg.run)
    import shlex

    from shardwise.train.data import check_batches, prepare_data
    from shardwise.train.evaluate import eval_sets
    from shardwise.train.manifest import file_digest

    # Data errors surface before spawning; ranks hit the cache. Files changed since their preparation are
    # named, with this command's own options as the `data prepare` that prepares them again.
    again = " ".join(["shardwise data prepare", *(["--config", shlex.quote(args.config)] if args.config else []),
                      *map(shlex.quote, overrides)])
    data = prepare_data(cfg.data, cfg.model.vocab_size, prepare_command=again)
    check_batches(data, cfg, epochs=False)  # one global batch at least, before a run directory exists
    eval_sets(data.valid_sets(), cfg)  # and each validation set (train/evaluate.py)
    rundir.check_run_dirs(cfg)
    if nodes is not None:  # compared with the other nodes' before the rendezvous (launch/peer_failure.py)
        digest = hashlib.sha256(f"{data.tokens_sha256}/{file_digest(data.tokenizer_path)[1]}".encode()).hexdigest()
        nodes = dataclasses.replace(nodes, data=f"{digest}@{data.describe()}")
    # Node 0 owns the run directory (lock, config.toml); other nodes only check it: with a shared file
    # system a second lock would refuse our own job (train/rundir.py).
    owner = nodes is None or nodes.node_rank == 0
    locks = rundir.lock_dirs(cfg, job=nodes.rdzv_id if nodes else None) if owner else []  # held until the job ends
    worker_config = None
    try:
        done = rundir.resume_preflight(cfg, data.num_tokens, file_digest(data.tokenizer_path)[1])
        if done:
            print(done)
            return 0
        # The checkpoint's data position fits this data (a mixture's sources), and no source of a mixture is read
        # over more than its max_epochs by train.steps, from where the run resumes.
        check_batches(data, cfg, rundir.newest_trainer_state(cfg))
        run_dir = Path(cfg.run.dir)
        if owner:
            rundir.clear_failure_record(run_dir)
            if not cfg.checkpoint.resume:  # a fresh start: an earlier run's checkpoints go aside, kept
                note = rundir.supersede_previous_run(cfg)
                if note:
                    print(note)
            config_path = rundir.save_config(cfg)
            print(f"run directory: {run_dir}  (config: {config_path})")
        else:  # node 0 may not have written config.toml yet: this node's workers read their own copy
            worker_config = owned_file("node", suffix=".toml")  # removed below, or by the next run if killed
            cfg.save(worker_config)
            print(f"run directory: {run_dir} (owned by node 0); node {nodes.node_rank} of {nodes.nnodes}, "
                  f"rendezvous {nodes.endpoint}")
            config_path = worker_config
        if nodes is None and args.nproc == 1 and cfg.run.max_restarts == 0:
            return _train_in_process(cfg, data)
        return torchrun(args.nproc, "shardwise.train", ["--config", str(config_path), *seat],
                        max_restarts=cfg.run.max_restarts, run_dir=run_dir, checkpoints=rundir.checkpoint_dir(cfg),
                        nodes=nodes, resumes=cfg.checkpoint.resume)
    finally:
        for lock in locks:
            lock.release()
        if worker_config is not None:
            worker_config.unlink(missing_ok=True)


def _train_in_process(cfg: Config, data) -> int:
    """One process, no launcher: the trainer runs here (a restart needs torchrun's agent)."""
    from shardwise.train import rundir
    from shardwise.train.out_of_memory import building_the_trainer
    from shardwise.train.trainer import Trainer

    try:
        try:
            with building_the_trainer(cfg, 0, 1):  # out of memory there: exit 7, not a traceback
                trainer = Trainer(cfg, data=data)
            trainer.train()
        except OSError as e:
            # disk full / read-only -> StorageFailure (exit 4); anything else as it is
            failure = storage_failure(e, resumes=cfg.checkpoint.resume, directory=cfg.run.dir)
            if failure is None:
                raise
            raise failure from e
    except RunFailure as e:
        print(("" if isinstance(e, Interrupted) else "error: ") + e.message, file=sys.stderr)
        return e.exit_code
    except ConfigError:  # bad input found while building the trainer (e.g. fp8 on this GPU): exit 2, in main
        raise
    except Exception as e:  # as a rank's crash under the launcher: one line, the traceback in errors/rank_0.txt
        print(f"error: {rundir.crash_line(cfg, e, rundir.record_crash(Path(cfg.run.dir), 0, e))}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _checkpoint(argv: list[str]) -> int:
    """`shardwise checkpoint verify DIR`: every checkpoint's files against its manifest (sizes,
    SHA-256) and its DCP metadata through the safe unpickler; nothing is loaded or changed."""
    from shardwise.train.checkpoint import verify_directory

    if not argv or argv[0] != "verify":
        raise ConfigError("checkpoint", f"expected 'verify', got {argv[0] if argv else 'nothing'!r}",
                          "run `shardwise checkpoint verify RUN_DIR`")
    parser = argparse.ArgumentParser(prog="shardwise checkpoint verify")
    parser.add_argument("dir", help="a run directory, its checkpoints/ directory, or one step_N checkpoint")
    args = parser.parse_args(argv[1:])
    results = verify_directory(Path(args.dir))
    if not results:
        raise ConfigError("DIR", f"{args.dir} holds no checkpoints",
                          "give a run directory, its checkpoints/ directory or one step_N directory")
    damaged = 0
    for path, status, problems in results:
        print(f"{path}: {status}" + "".join(f"\n    {p}" for p in problems))
        damaged += status == "DAMAGED"
    print(f"{len(results)} checked, {damaged} damaged")
    return 1 if damaged else 0


def _export(argv: list[str]) -> int:
    """`shardwise export --run-dir R [--step N] --hf OUT`: a checkpoint as a Hugging Face directory."""
    from shardwise.train.export import export_hf

    parser = argparse.ArgumentParser(prog="shardwise export")
    parser.add_argument("--run-dir", required=True, help="the run.dir of a training run (or its checkpoints/ directory)")
    parser.add_argument("--step", type=int, default=None, help="export this step's checkpoint (default: the newest intact one)")
    parser.add_argument("--hf", required=True, metavar="OUT", help="new directory for config.json, *.safetensors, tokenizer")
    parser.add_argument("--dtype", default="float32", help="float32 (the trained weights, exact), bfloat16 or float16")
    parser.add_argument("--max-shard-size", type=float, default=5.0, metavar="GIB", help="split the weights into files of at most this")
    args = parser.parse_args(argv)
    export_hf(Path(args.run_dir), Path(args.hf), args.step, args.dtype, int(args.max_shard_size * 2**30))
    return 0


def _data(argv: list[str]) -> int:
    from shardwise.data.command import data_main

    return data_main(argv)


def _generate(argv: list[str]) -> int:
    from shardwise.infer.generate import generate_main

    return generate_main(argv)


CONFIG_REFERENCE_HEADER = """# Configuration reference

[← README](../README.md)

Every key of a run's TOML file, with its default and meaning, generated by `shardwise config --markdown`
(`make docs` rewrites this page; a test fails when it is out of date). Override any key on the command line
with `--section.key=value`; `shardwise config --config FILE [overrides]` prints the resolved TOML.

"""


def _config(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardwise config")
    parser.add_argument("--config", default=None)
    parser.add_argument("--keys", action="store_true", help="list every key with its documentation")
    parser.add_argument("--markdown", action="store_true", help="the same as docs/config.md's tables (make docs)")
    args, overrides = parser.parse_known_args(argv)
    if args.keys or args.markdown:
        print(CONFIG_REFERENCE_HEADER + describe(markdown=True) if args.markdown else describe())
        return 0
    cfg: Config = load_config(args.config, overrides)
    print(cfg.to_toml(), end="")
    return 0


def _plan(argv: list[str]) -> int:
    from shardwise.plan.command import plan_main

    return plan_main(argv, verifier=_layout_verifier)


def _layout_verifier():
    """`plan search --verify`'s rehearsal (launch/verify.py), handed to plan/ from here: plan/ never imports
    launch/ (docs/architecture.md §2); imported only when --verify is given."""
    from shardwise.launch import verify

    return verify


def _pipeline_chart(argv: list[str]) -> int:
    from shardwise.train.pipeline_chart import CHART_FILE, describe, draw_chart, load_timeline, text_chart

    parser = argparse.ArgumentParser(prog="shardwise pipeline-chart")
    parser.add_argument("run_dir", help="run directory of a pipeline-parallel run (holds pipeline_timeline.json)")
    parser.add_argument("--out", default=None, help=f"PNG to write (default: RUN_DIR/{CHART_FILE})")
    parser.add_argument("--text", action="store_true", help="also print the chart as text (F/B/I/W, . idle)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.run_dir) / CHART_FILE
    if args.out:
        writable_file(out, "--out")
    timeline = load_timeline(Path(args.run_dir))
    draw_chart(timeline, out)
    print(describe(timeline))
    for r in timeline["ranks"]:
        print(f"  pp rank {r['pp_rank']}: busy {r['busy_s'] * 1e3:.1f} ms of {timeline['span_s'] * 1e3:.1f} ms, idle {r['bubble']:.1%}")
    if args.text:
        print(text_chart(timeline))
    print(f"wrote {out}")
    return 0


def _launch_command(module: str, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(f"shardwise.launch.{module}").main(rest)


def _version() -> str:
    """The installed distribution's version (pyproject.toml), else the package's own (a source checkout on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardwise")
    except PackageNotFoundError:
        from shardwise import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print(f"shardwise {_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    commands = {"train": _train, "config": _config, "plan": _plan, "pipeline-chart": _pipeline_chart,
                "checkpoint": _checkpoint, "export": _export}
    from shardwise.parity import parity_main

    commands["parity"] = parity_main
    # Cluster operations, one module each under launch/ (docs/architecture.md §2), imported on use.
    commands["doctor"] = lambda rest: _launch_command("doctor", rest)
    commands["bench-comm"] = lambda rest: _launch_command("bench_comm", rest)
    commands["launch"] = lambda rest: _launch_command("schedulers", rest)
    commands["dryrun"] = lambda rest: _launch_command("dryrun", rest)
    commands["generate"] = _generate
    commands["data"] = _data
    if command not in commands:
        import difflib

        close = difflib.get_close_matches(command, commands, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"error: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return 2
    except RunFailure as e:  # a corpus's preparation interrupted, or its disk full: one line, its exit code
        print(("" if isinstance(e, Interrupted) else "error: ") + e.message, file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a file a command reads or writes: one line, not a traceback (the disk's fault: exit 4)
        failure = storage_failure(e, then="then rerun")
        print(f"error: {failure.message if failure else f'shardwise {command}: {e}'}", file=sys.stderr)
        return failure.exit_code if failure else EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C before any worker ran (a run stopped by it says so itself)
        print(f"interrupted (SIGINT): shardwise {command} stopped"
              + (" before training started; nothing to resume" if command == "train" else ""), file=sys.stderr, flush=True)
        return 130


def console(argv: list[str] | None = None) -> int:
    """The process's entry (the `shardwise` script, `python -m shardwise.cli`): main(), then an end without
    the interpreter's final collections over torch's objects. Python's finalization collects every object
    before it clears the modules, and torch with the trainer's imports is millions of them: `import torch,
    shardwise.train.trainer` then exit took 3.80 s of user CPU, 3.16 s with gc.freeze() before the end
    (median of 3, /usr/bin/time, this repo's 2-core CPU, 2026-11-28). Frozen objects stay alive to the
    end and are freed as the modules are cleared; the young garbage, whose finalizers should run, is
    collected first; everything a command writes is closed before it returns. main() itself does not
    freeze: tests call it in their own process, which goes on."""
    import gc

    code = main(argv)
    gc.collect(1)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(console())
