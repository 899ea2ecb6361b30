"""`shardwise export --run-dir R [--step N] --hf OUT`: a checkpoint as a Hugging Face Llama directory.

What OUT holds: config.json (LlamaForCausalLM, spec/hf.py), model.safetensors (or shards of at most
--max-shard-size with model.safetensors.index.json, the layout save_pretrained writes),
generation_config.json, and the run's tokenizer (tokenizer.json + tokenizer_config.json) when it has one.
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads it with no missing or unexpected key
(tests/unit/test_hf_interop.py).

The checkpoint is read on one process without building the model: the tensors' names and shapes come
from its DCP metadata, and DCP reads one output shard's worth of weights at a time, so exporting needs
memory for one shard, not the model (DCP reassembles each weight from however many ranks saved it).
The checkpoint is verified against its manifest first; a damaged one is never exported.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from shardwise.config import Config, build_config, load_toml
from shardwise.errors import ConfigError
from shardwise.paths import writable_dir
from shardwise.spec import hf
from shardwise.train.checkpoint import _dcp, verify_directory
from shardwise.train.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_PREFIX = "model."  # the trainer saves {"model": ..., "optim": ...}; DCP flattens the keys with "."


def run_toml(path: Path) -> dict:
    """A run's (or checkpoint's) config.toml, model.init_from dropped: the resolved file names every model
    field, and the checkpoint no longer needs the files it started from."""
    toml = load_toml(path)
    toml.get("model", {}).pop("init_from", None)
    return toml


def run_config(path: Path) -> Config:
    """The config a checkpoint (or run directory) was trained with."""
    return build_config(run_toml(path))


def find_checkpoint(run_dir: Path, step: int | None, log=print) -> Path:
    """The newest intact checkpoint of a run (or step N's), verified against its manifest; `log` says so when
    newer ones are not intact (which, and why)."""
    if not run_dir.is_dir():
        raise ConfigError("--run-dir", f"{run_dir} is not a directory", "give the run.dir of a training run")
    root = run_dir
    if (run_dir / "config.toml").is_file():
        cfg = run_config(run_dir / "config.toml")
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    found = [(path, status, problems) for path, status, problems in verify_directory(root) if "." not in path.name]
    usable = [(path, status, problems) for path, status, problems in found if status == "OK" or status.startswith("UNVERIFIED")]
    if step is not None:
        wanted = [item for item in found if item[0].name == f"step_{step:08d}"]
        if not wanted:
            raise ConfigError("--step", f"{root} has no checkpoint of step {step} (it has: "
                              f"{', '.join(p.name for p, _, _ in found) or 'none'})", "pick a step it has, or leave --step out")
        path, status, problems = wanted[0]
        if (path, status, problems) not in usable:
            others = [p.name for p, _, _ in usable]
            raise ConfigError("--step", f"{path} is {status}: {'; '.join(map(str, problems))}",
                              f"pick another step with --step ({', '.join(others)} {'are' if len(others) > 1 else 'is'} "
                              "intact), or leave --step out for the newest intact one" if others else
                              "no other checkpoint of this run is intact: train again to write one")
        return path
    if not usable:
        raise ConfigError("--run-dir", f"{root} holds no intact checkpoint",
                          "train with checkpoint.final=true (the default) or checkpoint.every, then export")
    newer = [(p, status, problems) for p, status, problems in found if p.name > usable[-1][0].name]
    if newer:
        why = "; ".join(f"{p.name} is {status}" + (f" ({problems[0]})" if problems else "") for p, status, problems in newer)
        log(f"checkpoint: using {usable[-1][0].name}, the newest intact one: {why} (`shardwise checkpoint verify "
            f"{run_dir}` lists them)")
    return usable[-1][0]


def _shards(names: list[str], shapes: dict[str, torch.Size], itemsize: int, max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = shapes[name].numel() * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _write_tokenizer(step_dir: Path, out: Path, config: dict) -> list[int] | int | None:
    """The run's tokenizer and its tokenizer_config.json; returns generation_config's eos_token_id: the
    end-of-document token, and a chat template's end-of-turn token (what a chat-tuned model ends its
    answers with), so that generation stops at either."""
    eos = config.get("eos_token_id")
    source = step_dir / "tokenizer.json"
    if not source.is_file():
        return eos
    shutil.copyfile(source, out / "tokenizer.json")
    from tokenizers import Tokenizer

    from shardwise.data.chat import token_text

    tok = Tokenizer.from_file(str(source))
    special = {"eos_token": tok.id_to_token(eos)} if eos is not None else {}
    chat = _chat_config(step_dir, out)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
         "clean_up_tokenization_spaces": False} | special | chat, indent=2) + "\n")
    turn = tok.token_to_id(token_text(chat["eos_token"])) if "eos_token" in chat else None
    return eos if turn is None or turn == eos else [i for i in (eos, turn) if i is not None]


def _chat_config(step_dir: Path, out: Path) -> dict:
    """A chat-tuned run's template (its tokenizer directory's, kept by the checkpoint: data/chat.py
    chat_files) and the special tokens the template names, for the export's tokenizer_config.json."""
    kept = step_dir / "tokenizer_config.json"
    try:
        theirs = json.loads(kept.read_text()) if kept.is_file() else {}
    except ValueError:
        theirs = {}
    if (step_dir / "chat_template.jinja").is_file():
        shutil.copyfile(step_dir / "chat_template.jinja", out / "chat_template.jinja")
    keys = ("chat_template", "bos_token", "eos_token") if theirs.get("chat_template") or \
        (out / "chat_template.jinja").is_file() else ()
    return {k: theirs[k] for k in keys if theirs.get(k) is not None}


def _eos_id(step_dir: Path) -> int | None:
    from shardwise.train.data import eod_id

    if not (step_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return eod_id(Tokenizer.from_file(str(step_dir / "tokenizer.json")))
    except ConfigError:
        return None


def export_hf(run_dir: Path, out: Path, step: int | None = None, dtype: str = "float32",
              max_shard_bytes: int = 5 << 30, log: Callable[[str], None] = print) -> Path:
    """Write the checkpoint as a Hugging Face directory `out`; returns the checkpoint exported.

    `out` is new or empty, and checked writable before anything is read. An export that fails (a refused
    checkpoint, a full disk, Ctrl-C) removes what it wrote: a rerun after the fix is not refused for a
    non-empty `out`, and no half-written model directory looks like a model."""
    if dtype not in DTYPES:
        raise ConfigError("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}", "use float32 (exact) or bfloat16")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("--hf", f"{out} exists and is not an empty directory", "give a new directory (nothing is overwritten)")
    created = _outermost_missing(out)  # what this export creates: removed whole if it fails
    writable_dir(out, "--hf")
    try:
        return _export_into(run_dir, out, step, dtype, max_shard_bytes, log)
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        else:  # empty before this export: everything in it is this export's
            for path in out.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        raise


def _outermost_missing(path: Path) -> Path | None:
    """The outermost directory of `path` (itself included) that does not exist yet, or None: `--hf a/b/c` with
    only `a` there creates `a/b`, and a failed export leaves no empty `a/b` behind either."""
    missing = None
    for candidate in (path, *path.absolute().parents):
        if candidate.exists():
            return missing
        missing = candidate
    return missing


def _save_safetensors(save_file: Callable, tensors: dict, path: Path) -> None:
    """safetensors reports an OS error of its writer (a full disk) as its own SafetensorError, "... (os error
    28)": raised again as the OSError it is, so that the command says it in one line (exit 4 for the disk's)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e


def _export_into(run_dir: Path, out: Path, step: int | None, dtype: str, max_shard_bytes: int,
                 log: Callable[[str], None]) -> Path:
    step_dir = find_checkpoint(run_dir, step)
    cfg = run_config(step_dir / "config.toml")
    eos = _eos_id(step_dir)
    config = hf.hf_config(cfg.model, dtype, bos_id=None, eos_id=eos)
    metadata = read_metadata(step_dir / ".metadata").state_dict_metadata
    shapes = {key[len(MODEL_PREFIX):]: meta.size for key, meta in metadata.items() if key.startswith(MODEL_PREFIX)}
    expected = {hf.our_name(name): shape for name, shape in hf.expected_shapes(
        {"dim": cfg.model.dim, "n_heads": cfg.model.n_heads, "n_kv_heads": cfg.model.n_kv_heads, "ffn_dim": cfg.model.ffn_dim,
         "vocab_size": cfg.model.vocab_size, "n_layers": cfg.model.n_layers}, tied=False).items()}
    if {k: tuple(v) for k, v in shapes.items()} != expected:
        raise ConfigError("--run-dir", f"{step_dir} does not hold the weights of its config's llama "
                          f"(differs in {sorted(set(shapes) ^ set(expected))[:4] or 'shapes'})",
                          "export a checkpoint written by `shardwise train` with that config")
    from safetensors.torch import save_file

    names = sorted(shapes, key=lambda n: (n.startswith("layers."), int(n.split(".")[1]) if n.startswith("layers.") else 0, n))
    groups = _shards(names, shapes, DTYPES[dtype].itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        state = {f"{MODEL_PREFIX}{name}": torch.empty(shapes[name], dtype=torch.float32) for name in group}
        _dcp(dcp.load, state, step_dir, storage_reader=SafeFileSystemReader(step_dir),
             planner=SafeLoadPlanner())
        file = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {hf.hf_name(name): state[f"{MODEL_PREFIX}{name}"].to(DTYPES[dtype]).contiguous() for name in group}
        _save_safetensors(save_file, tensors, out / file)
        weight_map |= {name: file for name in tensors}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    stop = _write_tokenizer(step_dir, out, config)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": stop, "max_length": cfg.model.max_seq_len} if stop is not None else {}, indent=2) + "\n")
    # safetensors writes its files owner-only (0600); give them the mode Python gave config.json (the
    # umask's), so whoever may read the model's config may read its weights, as with save_pretrained.
    mode = (out / "config.json").stat().st_mode & 0o777
    for file in set(weight_map.values()):
        (out / file).chmod(mode)
    log(f"export: {step_dir} -> {out} ({len(weight_map)} tensors, {total / 2**20:.1f} MiB {dtype}, "
        f"{len(groups)} file{'s' if len(groups) > 1 else ''}{', tokenizer' if (out / 'tokenizer.json').exists() else ''})")
    return step_dir

