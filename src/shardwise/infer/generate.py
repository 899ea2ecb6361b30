"""`shardwise generate --run-dir R | --hf DIR [--prompt TEXT | --prompt-ids 1,2,3] ...`: sample from a model.

Everything a user can get wrong (the source, the prompts, the layout, the length) is checked here
before any process is spawned (exit 2); with --nproc N the same arguments go to `python -m
shardwise.infer` on N processes, which run infer/engine.py and print from rank 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import Config, build_config, parse_overrides
from shardwise.errors import ConfigError
from shardwise.preflight import check_generation_length, check_serving
from shardwise.spec.hf import HF_SCHEME

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        prog="shardwise generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="shardwise generate (--run-dir R [--step N] | --hf DIR) (--prompt TEXT | --prompt-ids 1,2,3) ... "
              "[--max-new-tokens N] [--greedy | --temperature T --top-p P --seed S] [--nproc N --parallel.tp=T "
              "--parallel.pp=P] [--json]",
        epilog="--prompt / --prompt-ids may be repeated: the prompts are decoded together (left-padded).\n"
               "layout: --parallel.tp and --parallel.pp over --nproc = tp x pp processes (no data parallelism).")
    source = out.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", help="a training run: its newest intact checkpoint (or --step N) and tokenizer")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama directory (config.json, *.safetensors, tokenizer.json)")
    out.add_argument("--step", type=int, default=None, help="with --run-dir: this step's checkpoint")
    out.add_argument("--prompt", action="append", default=[], help="prompt text (needs the model's tokenizer)")
    out.add_argument("--prompt-ids", action="append", default=[], help="prompt as comma-separated token ids")
    out.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
    out.add_argument("--greedy", action="store_true", help="take the most likely token (the default without --temperature)")
    out.add_argument("--temperature", type=float, default=None, help="sample from softmax(logits / T)")
    out.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling's probability mass")
    out.add_argument("--seed", type=int, default=0, help="with --temperature: the sampler's seed")
    out.add_argument("--eos-id", type=int, default=None, help="stop a sequence at this id (default: the model's end token)")
    out.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    out.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="compute dtype (default: bfloat16 on a GPU, float32 on CPU)")
    out.add_argument("--nproc", type=int, default=1, help="processes: parallel.tp x parallel.pp")
    out.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                     help="prefill and decode steps as compiled graphs over a static KV cache (any layout: one graph per "
                          "pipeline stage); auto: on a GPU with one process")
    out.add_argument("--json", action="store_true", help='one JSON line per prompt: {"ids", "text", "prefill_tokens_per_s", ...}')
    return out


@dataclass
class Request:
    cfg: Config
    checkpoint: Path | None  # None: the weights come from cfg.model.init_from
    tokenizer_path: Path | None
    prompts: list[list[int]]
    eos_ids: set[int]
    args: argparse.Namespace


def _ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ConfigError("--prompt-ids", f"{text!r} is not a comma-separated list of integers", "e.g. --prompt-ids 1,2,3") from None
    if not ids:
        raise ConfigError("--prompt-ids", "is empty", "give at least one token id")
    return ids


def _hf_eos(directory: Path) -> set[int]:
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((directory / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if value is not None:
            return set(value) if isinstance(value, list) else {int(value)}
    return set()


def resolve(argv: list[str], world: int | None = None) -> Request:
    """Parse and check everything (ConfigError on bad input); loads no weights. `world`: the processes
    already running (a worker), instead of --nproc."""
    args, rest = parser().parse_known_args(argv)
    if world is not None:
        args.nproc = world
    overrides = parse_overrides(rest)
    if args.hf:
        directory = Path(args.hf)
        cfg = build_config({"model": {"init_from": f"{HF_SCHEME}{directory}"}, "data": {"tokenizer": "byte"}}, overrides)
        checkpoint, tokenizer = None, directory / "tokenizer.json"
        eos = _hf_eos(directory)
    else:
        from shardwise.train.export import find_checkpoint, run_toml

        checkpoint = find_checkpoint(Path(args.run_dir), args.step)
        toml = run_toml(checkpoint / "config.toml")
        toml.pop("parallel", None)  # the training layout does not apply: serving takes tp / pp from the command line
        cfg = build_config(toml, overrides)
        tokenizer = checkpoint / "tokenizer.json"
        eos = set()
    tokenizer_path = tokenizer if tokenizer.is_file() else None
    prompts = [_ids(text) for text in args.prompt_ids]
    if args.prompt:
        if tokenizer_path is None:
            raise ConfigError("--prompt", f"no tokenizer.json with the model ({tokenizer})", "give --prompt-ids instead")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_path))
        prompts += [tok.encode(text).ids for text in args.prompt]
        if not eos and checkpoint is not None:
            from shardwise.train.data import eod_id

            try:
                eos = {eod_id(tok)}
            except ConfigError:
                eos = set()
    if not prompts:
        raise ConfigError("--prompt", "no prompt given", "pass --prompt TEXT or --prompt-ids 1,2,3")
    if any(not p for p in prompts):
        raise ConfigError("--prompt", "a prompt encodes to no token", "give a non-empty prompt")
    vocab = cfg.model.vocab_size
    if any(not 0 <= i < vocab for p in prompts for i in p):
        raise ConfigError("--prompt-ids", f"ids must be within [0, {vocab})", "use ids of the model's vocabulary")
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}", "e.g. --max-new-tokens 32")
    longest = max(len(p) for p in prompts)
    check_generation_length(cfg, longest, args.max_new_tokens)
    if args.temperature is not None and (args.greedy or args.temperature <= 0):
        raise ConfigError("--temperature", "needs a value > 0 and no --greedy", "use --greedy, or --temperature 0.8 --top-p 0.95")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"must be within (0, 1], got {args.top_p}", "e.g. --top-p 0.95")
    from shardwise.launch.local import check_nproc

    check_nproc(args.nproc)
    check_serving(cfg, args.nproc, longest)
    eos = set() if args.ignore_eos else ({args.eos_id} if args.eos_id is not None else eos)
    return Request(cfg, checkpoint, tokenizer_path, prompts, eos, args)


def run(request: Request) -> int:
    """Generate on this process's share of the layout; rank 0 prints."""
    import torch.distributed as dist

    from shardwise.infer.engine import Engine
    from shardwise.infer.sampling import Sampler
    from shardwise.train.distributed import default_device

    args = request.args
    device = default_device()
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    engine = Engine(request.cfg, device, dtype, request.checkpoint)
    sampler = Sampler(greedy=args.temperature is None, temperature=args.temperature or 1.0, top_p=args.top_p, seed=args.seed)
    # auto: compiled where it pays for its compilation and was measured, a GPU with one process
    # (benchmarks/decode.py measures the CPU: docs/generation.md). TP / PP compiled steps (--compile=on) are
    # equal to eager on CPU (tests/dist/test_hf_layouts.py); on a GPU they are gpu_check.py's generate rows.
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda" and args.nproc == 1)
    result = engine.generate(request.prompts, args.max_new_tokens, sampler, request.eos_ids, compiled=compiled)
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    tok = None
    if request.tokenizer_path is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(request.tokenizer_path))
    speed = {"prefill_tokens_per_s": round(result.prefill_tokens_per_s, 1),
             "decode_tokens_per_s": round(result.decode_tokens_per_s, 1)}
    for prompt, ids in zip(request.prompts, result.ids):
        text = tok.decode(ids) if tok is not None else None
        if args.json:
            print(json.dumps({"ids": ids, "text": text} | speed), flush=True)
        else:
            if tok is not None:  # the continuation right after its prompt, as the model reads it
                print(f"{tok.decode(prompt)}{text}", flush=True)
            else:
                print(f"{','.join(map(str, prompt))} -> {','.join(map(str, ids))}", flush=True)
    if not args.json:
        dims = engine.dims
        print(f"layout tp={dims.tp} x pp={dims.pp}, {dtype}: prefill {result.prefill_tokens} tokens in "
              f"{result.prefill_s * 1e3:.1f} ms ({speed['prefill_tokens_per_s']:,.0f} tokens/s), decode "
              f"{result.decode_tokens} tokens in {result.decode_s * 1e3:.1f} ms ({speed['decode_tokens_per_s']:,.0f} "
              f"tokens/s), KV cache {result.kv_cache_bytes / 2**20:.2f} MiB on rank 0", flush=True)
    return 0


def generate_main(argv: list[str]) -> int:
    """The CLI: check, then run here (one process) or under torchrun (`python -m shardwise.infer`)."""
    request = resolve(argv)
    if request.args.nproc == 1:
        return run(request)
    from shardwise.launch.local import torchrun

    return torchrun(request.args.nproc, "shardwise.infer", _without_nproc(argv))


def _without_nproc(argv: list[str]) -> list[str]:
    """The workers' arguments: --nproc is the launcher's (and torchrun would read it as an abbreviation of
    its own --nproc-per-node); a worker takes the world size from its process group."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def worker_main(argv: list[str] | None = None) -> int:
    """`python -m shardwise.infer ARGS` under torchrun: join the group, generate, leave."""
    from shardwise.train.distributed import finish_distributed, init_distributed, leave

    argv = list(sys.argv[1:] if argv is None else argv)
    distributed = init_distributed()
    try:
        import torch.distributed as dist

        code = run(resolve(argv, dist.get_world_size() if distributed else 1))
    except ConfigError as e:  # checked before spawning too; here only what differs on a worker
        if not distributed or dist.get_rank() == 0:
            print(f"error: {e.render()}", file=sys.stderr, flush=True)
        leave(2)
    if distributed:
        finish_distributed()
    leave(code)
