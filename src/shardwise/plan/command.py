"""`shardwise plan evaluate | search | calibrate` (cli.py dispatches here): pure Python, no process group, no
torch import. `search --emit` writes the fastest layout this version's trainer runs as a config. `search
--verify K` rehearses the K best through launch/verify.py, which cli.py hands in (`verifier`): plan/ never
imports launch/ (docs/architecture.md §2), and without --verify nothing of it is imported."""
from __future__ import annotations

import argparse
import copy
from pathlib import Path

from shardwise.config import Config, load_config
from shardwise.errors import ConfigError
from shardwise.paths import writable_file


def _trainer_refusal(cfg: Config, world: int) -> str | None:
    """Why `shardwise train` would refuse this layout today (a rule marked trainer_only in
    spec/rules.py, such as EP with ZeRO-0/1 or with dp_replicate), or None: the planner also plans
    layouts later versions will train. It is the trainer's whole pre-flight check (torch-free), so
    what it accepts, `shardwise train` runs."""
    from shardwise.preflight import check

    try:
        check(cfg, world)
    except ConfigError as e:
        return f"{e.field}: {e.problem}"
    return None


def _emit(cfg: Config, problem, result, path: str, quiet: bool, verified: list | None = None) -> None:
    """Write the fastest layout this version's trainer runs (usually #1) as a config `shardwise
    train` runs unchanged; say so when #1 needs an axis that is not trained yet. If none of the
    ranked layouts is trainable, #1 is written with the reason. `verified` (--verify): the fastest of
    those the rehearsal built (one exists: plan_main refuses the search otherwise)."""
    configs = [_with_layout(cfg, problem, e) for e in result.ranked]
    refusals = [_trainer_refusal(c, problem.cluster.num_gpus) for c in configs]
    rank = next((i for i, why in enumerate(refusals) if why is None), 0)
    if verified is not None:  # pre-flight dropped what the trainer refuses, with the same reason
        rank = next(v.index - 1 for v in verified if v.dropped is None)
        refusals[0] = verified[0].dropped
    configs[rank].save(path)  # its directory made and checked writable before the search (paths.writable_file)
    load_config(path)  # what we wrote must load
    if not quiet:
        print(f"wrote {path}: #{rank + 1} {result.ranked[rank].layout.describe()}")
        if rank > 0 and verified is not None:
            print(f"note: #1 cannot be built at this size ({refusals[0]}); wrote the fastest layout --verify built")
        elif rank > 0:
            print(f"note: #1 is not trained by this version ({refusals[0]}); wrote the fastest layout it trains")
        elif refusals[0]:
            print(f"note: this version's `shardwise train` refuses this layout ({refusals[0]})")
        t, default = configs[rank].train, Config().train
        untuned = [f"train.{k} = {getattr(t, k)}" for k in ("lr", "warmup_steps") if getattr(t, k) == getattr(default, k)]
        if untuned:
            print(f"note: {', '.join(untuned)} are the defaults (set for the tiny presets), not tuned for this model: set yours")


def _with_layout(cfg: Config, problem, estimate) -> Config:
    """`cfg` with the estimate's layout, and what the plan knows in place of the keys left at their
    defaults: the steps that train train.tokens, the Young/Daly checkpoint interval, a run directory
    named after the model (the user's own values stay)."""
    from shardwise.plan.goodput import run_cost

    out, default = copy.deepcopy(cfg), Config()
    for section, values in estimate.layout.config_values(problem).items():
        for key, value in values.items():
            setattr(getattr(out, section), key, value)
    _split_keys(out)
    t = out.train
    if t.tokens and t.steps == default.train.steps:
        t.steps = -(-t.tokens // (t.global_batch * t.seq_len))
    every = run_cost(problem, estimate).checkpoint_every_steps
    if out.checkpoint.every == default.checkpoint.every and every is not None:
        out.checkpoint.every = min(every, t.steps)
    if out.run.dir == default.run.dir:
        out.run.dir = f"runs/{out.model.preset or out.model.arch}"
    return out


def _split_keys(cfg: Config) -> None:
    """One way of saying the pipeline split in an emitted config: pp_split = "balanced" alone where the trainer's
    balanced cut is the layout's split (the search's split variants are), else the explicit
    pp_layers_per_stage with pp_split = "even" (which it overrides) and no pp_stage_speeds; an even split
    leaves both at their defaults. Before, an explicit split was written beside pp_split = "even" (or the
    user's "balanced", which pre-flight refuses beside it), and an even split under the user's "balanced"
    would have been cut balanced by the trainer."""
    from shardwise.spec.stages import trainer_split

    p = cfg.parallel
    split = tuple(p.pp_layers_per_stage)
    if split:
        p.pp_split, p.pp_layers_per_stage = "balanced", []
        if trainer_split(p, cfg.model, cfg.train.seq_len) == split:
            return
        p.pp_layers_per_stage = list(split)
    p.pp_split, p.pp_stage_speeds = "even", []


def measure_document_share(cfg: Config):
    """train.document_mask's share of causal attention tiles (spec/documents.py) on the run's prepared data, and
    a line saying what was measured or why the mask is priced as causal attention (share 1.0). Reads the data
    only if it is prepared already: planning prepares nothing (data/sources.py prepare_data cached_only)."""
    from shardwise.data.packing import sampled_document_starts, source_rows
    from shardwise.data.sources import prepare_data
    from shardwise.spec.documents import DocumentShare, document_share

    t = cfg.train
    causal = "priced as causal attention over the whole row (an upper bound)"
    try:
        data = prepare_data(cfg.data, cfg.model.vocab_size, lambda _line: None, refuse_changed=False, cached_only=True)
    except ConfigError as e:  # e.g. data the planning machine does not have
        return None, f"document mask: {causal}: the data cannot be read here ({e.field}: {e.problem})"
    if data is None:
        return None, (f"document mask: {causal}: the data is not prepared here (`shardwise data prepare` with this "
                      "config measures its documents)")
    shares, weights = [], []
    for s in data.sources:
        rows = source_rows(s.corpus.stream, s.corpus.finetune, t.seq_len, cfg.data.loss_on, data.eod_id)
        starts = sampled_document_starts(rows, t.seq_len, data.eod_id)
        if starts:
            shares.append(document_share(starts, t.seq_len))
            weights.append(s.spec.weight)
    if not shares:
        return None, f"document mask: {causal}: no row of train.seq_len={t.seq_len} tokens in the data"
    total = sum(weights)  # a mixture: each source's share by its weight (data/mixture.py draws rows so)
    share = DocumentShare(sum(w * sh.share for w, sh in zip(weights, shares)) / total, sum(sh.rows for sh in shares),
                          sum(sh.documents for sh in shares), t.seq_len)
    return share, share.line()


def plan_main(argv: list[str], verifier=None) -> int:
    """`shardwise plan evaluate | search`: pure Python, no process group, no torch import. `verifier`: a
    callable returning launch/verify.py (cli.py's), called only for --verify (module doc)."""
    import json

    from shardwise.plan.cost import evaluate
    from shardwise.plan.evaluation import eval_price
    from shardwise.plan.layout import Problem, check_layout
    from shardwise.plan.report import eval_line, evaluate_text, plot, search_json, search_text
    from shardwise.plan.scale import scale_lines, scale_terms
    from shardwise.plan.search import search
    from shardwise.spec.layout import Layout
    from shardwise.spec.rules import pipeline_split_rules

    if argv and argv[0] == "calibrate":  # fit the planner to measured runs (plan/fit.py)
        from shardwise.plan.fit import calibrate_main

        return calibrate_main(argv[1:])
    if not argv or argv[0] not in ("evaluate", "search"):
        raise ConfigError("plan", f"expected 'evaluate' or 'search', got {argv[0] if argv else 'nothing'!r}",
                          "run `shardwise plan evaluate --config run.toml` or `shardwise plan search --config run.toml`")
    action = argv[0]
    parser = argparse.ArgumentParser(prog=f"shardwise plan {action}")
    parser.add_argument("--config", default=None, help="TOML config file (model / train / parallel / cluster)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--assume-mfu", type=float, default=None, help="fix MFU (e.g. 0.4) instead of predicting it")
    # A bare --plot / --emit writes into the config's run directory (<run.dir>/plan/), not wherever the
    # command happens to run (often the repository root); a path given is used as written.
    parser.add_argument("--plot", nargs="?", const="", default=None,
                        help="write the memory / search-space figure to this PNG (no value: <run.dir>/plan/ACTION.png)")
    if action == "search":
        parser.add_argument("--top", type=int, default=10, help="layouts to show")
        parser.add_argument("--emit", nargs="?", const="", default=None,
                            help="write the best layout as a TOML `shardwise train` runs (no value: <run.dir>/plan/best.toml)")
        parser.add_argument("--allow-cross-node-tp", action="store_true", help="let tp span nodes")
        parser.add_argument("--allow-uneven-pp", action="store_true", help="allow n_layers not divisible by pp x virtual stages")
        parser.add_argument("--verify", type=int, default=None, metavar="K",
                            help="build ranks of the K best layouts on the meta device (shardwise dryrun's way) and drop "
                                 "any that cannot be built at this size; --emit then writes the best one left")
        parser.add_argument("--verify-ranks", default=None, metavar="RANKS",
                            help="--verify's ranks of each layout, comma-separated (`last` for the last; `default`: "
                                 "dryrun's, every stage's first and last and the expert groups'); default 0,last")
    if action == "evaluate":  # --mode=decode: serving one tp x pp replica (plan/decode.py)
        parser.add_argument("--mode", choices=("train", "decode"), default="train", help="plan a training step or serving")
        parser.add_argument("--batch", type=int, default=1, help="--mode=decode: sequences decoded together")
        parser.add_argument("--prompt-len", type=int, default=None, help="--mode=decode: prompt tokens (default train.seq_len)")
        parser.add_argument("--max-new-tokens", type=int, default=128, help="--mode=decode: tokens generated per sequence")
        parser.add_argument("--straggler", type=float, default=None, metavar="S",
                            help="price one rank S times slower (e.g. 1.3), and evicting its node (plan/straggler.py)")
    args, overrides = parser.parse_known_args(argv[1:])
    if args.assume_mfu is not None:
        overrides.append(f"--cluster.assume_mfu={args.assume_mfu}")
    cfg = load_config(args.config, overrides)
    if getattr(args, "mode", "train") == "decode":
        from shardwise.plan.decode import decode_estimate
        from shardwise.plan.report import decode_text

        if args.plot is not None:
            raise ConfigError("--plot", "--mode=decode draws no figure", "drop --plot")
        decode = decode_estimate(cfg, args.batch, args.prompt_len, args.max_new_tokens)
        print(json.dumps(decode.to_json(), indent=2) if args.json else decode_text(decode), end="\n" if args.json else "")
        return 0
    problem = Problem.from_config(cfg)
    documents = None
    if problem.document_share is not None:  # train.document_mask: priced on the data's own documents
        import dataclasses

        documents, documents_line = measure_document_share(cfg)
        if documents is not None:
            problem = dataclasses.replace(problem, document_share=documents.share)
        if not args.json:
            print(documents_line)
    if args.plot == "":
        args.plot = str(Path(cfg.run.dir) / "plan" / f"{action}.png")
    if getattr(args, "emit", None) == "":
        args.emit = str(Path(cfg.run.dir) / "plan" / "best.toml")
    for field, path in (("--plot", args.plot), ("--emit", getattr(args, "emit", None))):
        if path:  # before the plan is priced and printed: not a traceback after it
            writable_file(Path(path), field)
    if action == "evaluate":
        layout = Layout.from_config(cfg, problem.cluster.num_gpus)
        violation = check_layout(problem, layout) or next(pipeline_split_rules(cfg.parallel, problem.shape.n_layers), None)
        if violation is not None:
            raise violation.error()
        est = evaluate(problem, layout)
        refusal = _trainer_refusal(cfg, problem.cluster.num_gpus)
        evaluation = eval_price(cfg, est.breakdown_s, est.detail, layout.pp, layout.chunks_per_rank)
        straggler = None
        if args.straggler is not None:
            from shardwise.plan.straggler import straggler_price

            straggler = straggler_price(cfg, problem, est, args.straggler)
        if args.json:
            from shardwise.plan.goodput import run_cost

            print(json.dumps({**est.to_json(), "cost": run_cost(problem, est).to_json(), "trainable": refusal is None,
                              **({"evaluation": evaluation.to_json()} if evaluation else {}),
                              **({"straggler": straggler.to_json()} if straggler else {}),
                              **({"document_mask": documents.to_json() if documents else {"share": 1.0, "measured": False}}
                                 if problem.document_share is not None else {}),
                              "scale": scale_terms(problem, est), "trainer_refusal": refusal,
                              # every split is priced by its schedule's order now; kept for --json readers
                              "split_notes": []}, indent=2))
        else:
            print(evaluate_text(problem, est), end="")
            print("\n".join(scale_lines(problem, est)))
            if evaluation is not None:
                print(eval_line(evaluation, est.days))
            if straggler is not None:
                print(straggler.line())
            refused = [f"this version's `shardwise train` refuses this layout ({refusal})"] if refusal else []
            print("".join(f"note: {n}\n" for n in refused), end="")
        if args.plot:
            plot(args.plot, problem, [est])
        return 0
    if args.top < 1:
        raise ConfigError("--top", f"must be >= 1, got {args.top}", "e.g. --top 10")
    rehearse = _verifier(args, verifier, problem.cluster.num_gpus)
    result = search(problem, top=args.top, allow_cross_node_tp=args.allow_cross_node_tp, allow_uneven_pp=args.allow_uneven_pp)
    if result.best is None:
        print(json.dumps(search_json(problem, result, args.top), indent=2) if args.json else search_text(problem, result, args.top))
        raise ConfigError("cluster", f"no layout of {cfg.model.preset} fits {problem.cluster.num_gpus} x {problem.cluster.device.name}",
                          "add GPUs, use a device with more memory, or shorten train.seq_len / train.global_batch")
    if not args.json:
        print(search_text(problem, result, args.top), end="")
    verified = None
    if rehearse is not None:
        import sys

        # each layout's line as it is built; on stderr under --json, whose stdout is one JSON object
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
        verified = rehearse.verify_layouts([(e.layout.describe(), _with_layout(cfg, problem, e))
                                            for e in result.ranked[:args.verify]],
                                           problem.cluster.num_gpus, args.verify_ranks, log)
    if args.json:
        print(json.dumps({**search_json(problem, result, args.top),
                          **({"verify": [v.to_json() for v in verified]} if verified is not None else {})}, indent=2))
    if verified is not None and all(v.dropped for v in verified):
        raise ConfigError("--verify", f"none of the {len(verified)} best layouts can be built at "
                          f"{problem.cluster.num_gpus} ranks (the lines above say why)",
                          f"verify more of them (--verify {len(verified) * 2}), or change what the lines name")
    if args.emit:
        _emit(cfg, problem, result, args.emit, quiet=args.json, verified=verified)
    if args.plot:
        plot(args.plot, problem, result.ranked[:args.top], result.points)
    return 0


def _verifier(args, verifier, world: int):
    """launch/verify.py for --verify K (its --verify-ranks read against the cluster first), or None."""
    if args.verify is None:
        if args.verify_ranks is not None:
            raise ConfigError("--verify-ranks", "is given without --verify", "add --verify K (e.g. --verify 3)")
        return None
    if args.verify < 1:
        raise ConfigError("--verify", f"must be >= 1, got {args.verify}", "e.g. --verify 3 (the 3 best layouts)")
    if verifier is None:
        raise ConfigError("--verify", "this entry point cannot build layouts (plan_main without a verifier)",
                          "run `shardwise plan search --verify K`")
    rehearse = verifier()
    rehearse.check_ranks(args.verify_ranks, world)
    return rehearse
