"""The model section's unset keys, filled after the config is read (config.py build_config): from the
preset (spec/presets.py; explicit keys win) or from the Hugging Face checkpoint of model.init_from, whose
shape an explicit key may only repeat; then the fallbacks neither sets."""
from __future__ import annotations

from typing import Any

from shardwise.errors import ConfigError, did_you_mean


def resolve_model(model: Any) -> None:
    """Fill every unset model field from the preset (explicit keys win), or from the Hugging Face
    config.json of model.init_from."""
    from shardwise.spec.presets import PRESETS

    if model.init_from:
        _resolve_from_hf(model)
    if model.preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {model.preset!r}", did_you_mean(model.preset, sorted(PRESETS)))
    for key, value in PRESETS[model.preset].items():
        if key == "moe":
            for sub, v in value.items():
                if getattr(model.moe, sub) is None:
                    setattr(model.moe, sub, v)
        elif getattr(model, key) is None:
            setattr(model, key, value)
    for key, default in MOE_FALLBACKS.items():
        if getattr(model.moe, key) is None:
            setattr(model.moe, key, default)
    if model.n_kv_heads is None:
        model.n_kv_heads = model.n_heads
    for key, default in MODEL_FALLBACKS.items():
        if getattr(model, key) is None:
            setattr(model, key, default)


def _resolve_from_hf(model: Any) -> None:
    """The shape is the checkpoint's: an explicit model key may only repeat it (max_seq_len may be
    shorter: it sizes the RoPE table, not a weight); the preset is not used."""
    from shardwise.spec import hf

    directory = hf.hf_directory(model.init_from)
    fields, tied = hf.model_fields(hf.read_hf_config(directory), str(directory / "config.json"))
    hf.check_weights(directory, fields, tied)
    for key, value in fields.items():
        given = getattr(model, key)
        if given is None or (key == "max_seq_len" and given <= value):
            setattr(model, key, value if given is None else given)
        elif given != value:
            raise ConfigError(f"model.{key}", f"{given} differs from {value} in {directory / 'config.json'} "
                              f"(model.init_from)", f"drop model.{key}: an imported model keeps its shape")
    if model.moe.num_experts:
        raise ConfigError("model.moe.num_experts", "a Llama checkpoint has dense MLPs", "drop model.moe.* with model.init_from")
    model.moe.num_experts = 0


# Values for model fields that neither the config nor the preset sets.
MODEL_FALLBACKS = {"norm_eps": 1e-5, "rope_theta": 10000.0}
# MoE defaults: dense; when enabled, top-2 (Mixtral), every block, dropless, Switch's alpha = 0.01.
MOE_FALLBACKS = {"num_experts": 0, "top_k": 2, "every_k_layers": 1, "capacity_factor": 0.0, "expert_ffn_dim": 0,
                 "num_shared_experts": 0, "aux_loss_coef": 0.01, "z_loss_coef": 0.0}
