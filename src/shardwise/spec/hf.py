"""Hugging Face Llama checkpoints and shardwise, as facts: config.json fields and parameter names.

Torch-free (the spec floor): `model.init_from = "hf:DIR"` is resolved in config.py from DIR/config.json
before anything is built, so pre-flight and the planner see the imported shape; models/hf.py reads the
weights with these names and `shardwise export` writes them back.

Our llama block is Hugging Face's LlamaDecoderLayer under other names: the same RMSNorm (fp32 statistics,
weight applied after the cast back), RoPE in the rotate-half form HF's checkpoints are stored in (their
conversion script permutes Meta's q/k rows into it), grouped-query SDPA with scale head_dim^-0.5, and
SwiGLU with gate = w1, up = w3, down = w2. So the weights map one to one, with no permutation.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

HF_SCHEME = "hf:"
FIELD = "model.init_from"
# Model types whose decoder layer is exactly ours once the checks in `model_fields` pass; Mistral differs
# from Llama only by its sliding window, refused below unless it is off.
SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# (our name, Hugging Face name) with {i} for the block index; every llama parameter appears once.
_BLOCK_NAMES = (
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
)
_TOP_NAMES = (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
              ("output.weight", "lm_head.weight"))
_TO_HF = dict(_TOP_NAMES) | {f"layers.{{i}}.{ours}": f"model.layers.{{i}}.{theirs}" for ours, theirs in _BLOCK_NAMES}
_FROM_HF = {theirs: ours for ours, theirs in _TO_HF.items()}
_INDEX = re.compile(r"\.(\d+)\.")


def _template(name: str) -> tuple[str, str | None]:
    match = _INDEX.search(name)
    if match is None:
        return name, None
    return name[:match.start()] + ".{i}." + name[match.end():], match.group(1)


def _rename(name: str, table: dict[str, str], direction: str) -> str:
    template, index = _template(name)
    if template not in table:
        raise KeyError(f"{name} has no {direction} name (only dense llama parameters map one to one)")
    out = table[template]
    return out if index is None else out.replace("{i}", index)


def hf_name(ours: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    return _rename(ours, _TO_HF, "Hugging Face")


def our_name(theirs: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `layers.3.attention.wq.weight`."""
    return _rename(theirs, _FROM_HF, "shardwise")


def hf_directory(init_from: str) -> Path | None:
    """DIR of `init_from = "hf:DIR"` (None when unset), checked to hold a config.json."""
    if not init_from:
        return None
    if not init_from.startswith(HF_SCHEME):
        raise ConfigError(FIELD, f"{init_from!r} is not a source shardwise reads",
                          'use "hf:DIR", DIR a Hugging Face save_pretrained directory (config.json + *.safetensors)')
    directory = Path(init_from[len(HF_SCHEME):]).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(FIELD, f"{directory} has no config.json",
                          "give the directory save_pretrained wrote (nothing is downloaded: fetch it first, e.g. "
                          "`hf download NAME --local-dir DIR`)")
    return directory


def read_hf_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(FIELD, f"cannot read {directory / 'config.json'}: {e}", "give a valid config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(FIELD, f"{directory / 'config.json'} is not a JSON object", "give a valid config.json")
    return config


def rope_theta(config: dict[str, Any], where: str) -> float:
    """The RoPE base, refusing every scaled variant: we implement plain RoPE only (Su et al. 2021).
    transformers >= 5 writes `rope_parameters`; older configs `rope_theta` and `rope_scaling`."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise ConfigError(FIELD, f"{where} uses rope_type {kind!r} (scaled RoPE), which shardwise does not implement",
                              "use a checkpoint with plain RoPE (rope_type 'default'), e.g. Llama 2 or TinyLlama; "
                              "Llama 3.1+ uses 'llama3' scaling")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def model_fields(config: dict[str, Any], where: str) -> tuple[dict[str, Any], bool]:
    """Our model.* values for a Hugging Face config, and whether its embeddings are tied.

    Everything our llama does not compute identically is refused (never silently ignored)."""
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(FIELD, f"{where} is a {kind!r} model; shardwise imports {' and '.join(SUPPORTED_MODEL_TYPES)}",
                          "import a Llama-shaped checkpoint (LlamaForCausalLM)")
    refusals = {
        "attention_bias": ("has biases in q/k/v/o", False),
        "mlp_bias": ("has biases in its MLP", False),
        "sliding_window": ("uses sliding-window attention", None),
    }
    for key, (what, plain) in refusals.items():
        if config.get(key, plain) not in (plain, False, None):
            raise ConfigError(FIELD, f"{where} {what} ({key} = {config[key]!r}); shardwise's llama has none",
                              "import a checkpoint without it")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(FIELD, f"{where} uses hidden_act {config['hidden_act']!r}; shardwise's SwiGLU uses silu",
                          "import a checkpoint with hidden_act 'silu'")
    if config.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(FIELD, f"{where} sets pretraining_tp = {config['pretraining_tp']} (sliced linears)",
                          "re-save it with pretraining_tp = 1 (the weights are the same)")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        fields = dict(arch="llama", dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                      n_kv_heads=int(config.get("num_key_value_heads") or heads),
                      ffn_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                      max_seq_len=int(config["max_position_embeddings"]),
                      norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(config, where))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(FIELD, f"{where} lacks or mistypes {e}", "give a complete Llama config.json") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise ConfigError(FIELD, f"{where} has head_dim {head_dim} x {heads} heads != hidden_size {dim}",
                          "shardwise's attention uses head_dim = hidden_size / num_attention_heads")
    return fields, bool(config.get("tie_word_embeddings", False))


def expected_shapes(fields: dict[str, Any], tied: bool) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every weight a checkpoint of this shape holds (nn.Linear: (out, in))."""
    dim, head_dim = fields["dim"], fields["dim"] // fields["n_heads"]
    q, kv, ffn, vocab = fields["n_heads"] * head_dim, fields["n_kv_heads"] * head_dim, fields["ffn_dim"], fields["vocab_size"]
    block = {"attention.wq.weight": (q, dim), "attention.wk.weight": (kv, dim), "attention.wv.weight": (kv, dim),
             "attention.wo.weight": (dim, q), "feed_forward.w1.weight": (ffn, dim), "feed_forward.w3.weight": (ffn, dim),
             "feed_forward.w2.weight": (dim, ffn), "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,)}
    out = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,)}
    if not tied:
        out["output.weight"] = (vocab, dim)
    out |= {f"layers.{i}.{name}": shape for i in range(fields["n_layers"]) for name, shape in block.items()}
    return {hf_name(name): shape for name, shape in out.items()}


def _safetensors_header(path: Path) -> dict[str, Any]:
    """A .safetensors file's header: 8 bytes little-endian length, then JSON (name -> dtype, shape,
    offsets); read without torch and without touching the tensors."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= 100 << 20:
            raise ValueError("not a safetensors file (bad header length)")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def weight_shapes(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Hugging Face name -> (the .safetensors file holding it, its shape), from the files' headers (a
    sharded checkpoint's files each hold some; a directory of only .bin files is refused: pickle)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(FIELD, f"{directory} holds no .safetensors file"
                          + (" (only PyTorch .bin files, which are pickles shardwise does not load)"
                             if any(directory.glob("*.bin")) else ""),
                          "save it with save_pretrained(DIR, safe_serialization=True)")
    out = {}
    for path in files:
        try:
            header = _safetensors_header(path)
        except (OSError, ValueError) as e:
            raise ConfigError(FIELD, f"cannot read {path}: {e}", "re-download or re-save the checkpoint") from None
        out |= {name: (path, tuple(meta["shape"])) for name, meta in header.items()}
    return out


def weight_files(directory: Path) -> dict[str, Path]:
    """Hugging Face name -> the .safetensors file holding it."""
    return {name: path for name, (path, _) in weight_shapes(directory).items()}


def check_weights(directory: Path, fields: dict[str, Any], tied: bool) -> None:
    """Every weight the model needs is in DIR with its shape, and nothing else is (a weight we would
    ignore means an architecture we do not compute). Reads the files' headers only."""
    shapes = {name: shape for name, (_, shape) in weight_shapes(directory).items()}
    # Older transformers versions saved RoPE's inv_freq buffer; it is recomputed from rope_theta.
    shapes = {name: shape for name, shape in shapes.items() if not name.endswith("rotary_emb.inv_freq")}
    expected = expected_shapes(fields, tied)
    if tied:
        shapes.pop("lm_head.weight", None)  # some writers store the tied copy as well
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(name for name in set(expected) & set(shapes) if shapes[name] != expected[name])
    for problem, names in (("lacks", missing), ("has weights shardwise's llama does not have:", unexpected),
                           ("has weights of the wrong shape:", wrong)):
        if names:
            shown = ", ".join(f"{n} {shapes.get(n, '')}".strip() for n in names[:4]) + (" ..." if len(names) > 4 else "")
            raise ConfigError(FIELD, f"{directory} {problem} {shown} ({len(names)} in all)",
                              "give a complete Llama checkpoint whose config.json matches its weights")


def exportable(model: Any) -> bool:
    """Whether our ModelConfig `model` has a transformers equivalent (`shardwise export` writes it): a dense llama."""
    return model.arch == "llama" and not model.moe.enabled


def hf_config(model: Any, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict[str, Any]:
    """config.json of LlamaForCausalLM for our resolved ModelConfig `model` (untied: our head is its own
    parameter). Written by `shardwise export`."""
    if not exportable(model):
        raise ConfigError("model", f"a {'MoE ' if model.moe.enabled else ''}{model.arch} model has no Llama "
                          "equivalent in transformers", "export a dense llama model")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": model.dim, "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.dim // model.n_heads,
        "intermediate_size": model.ffn_dim, "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "rope_theta": model.rope_theta, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "dtype": dtype,
    }
