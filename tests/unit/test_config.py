"""Config tree: strict TOML, overrides, presets, and the resolved config round-trip."""
from __future__ import annotations

import pytest

from shardwise.config import Config, all_keys, build_config, load_config, parse_overrides
from shardwise.errors import ConfigError


def test_defaults_resolve_the_tiny_preset():
    cfg = build_config()
    assert cfg.model.preset == "tiny" and cfg.model.arch == "llama" and cfg.model.dim == 64


def test_override_types_are_converted():
    cfg = load_config(overrides=["--train.lr=0.5", "--parallel.zero", "3", "--parallel.offload=true",
                                 "--data.path=/x/y", "--model.dim=128"])
    assert cfg.train.lr == 0.5 and cfg.parallel.zero == 3 and cfg.parallel.offload == "cpu"
    assert cfg.data.path == "/x/y" and cfg.model.dim == 128 and cfg.model.n_layers == 2


def test_explicit_model_keys_beat_the_preset(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\npreset = "llama3-8b"\nn_layers = 2\n')
    cfg = load_config(p)
    assert cfg.model.n_layers == 2 and cfg.model.dim == 4096


def test_int_is_accepted_for_float_fields():
    assert build_config({"train": {"lr": 1}}).train.lr == 1.0


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["--model.preset=tiny-gpt", "--train.steps=7"])
    cfg.save(tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg and isinstance(again, Config)


def test_every_key_has_documentation():
    from shardwise.config_reference import describe

    text = describe()
    for key in all_keys():
        assert key.split(".")[1] in text


@pytest.mark.parametrize("toml,field,hint", [
    ({"train": {"stpes": 3}}, "train.stpes", "train.steps"),
    ({"modle": {"dim": 3}}, "modle.dim", "model.dim"),
    ({"parallel": {"zero_stage": 3}}, "parallel.zero_stage", "parallel.zero"),
    ({"train": {"lr": "fast"}}, "train.lr", "remove the quotes"),
    ({"train": {"steps": 1.5}}, "train.steps", "int"),
    ({"parallel": {"offload": 1}}, "parallel.offload", "str"),
    ({"model": {"preset": "llama9"}}, "model.preset", "did you mean"),
])
def test_bad_toml_names_the_field_and_a_fix(toml, field, hint):
    with pytest.raises(ConfigError) as e:
        build_config(toml)
    assert e.value.field == field and hint in str(e.value)


def test_bad_overrides():
    with pytest.raises(ConfigError, match="unrecognized argument"):
        parse_overrides(["steps=3"])
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="expected true/false"):
        load_config(overrides=["--run.progress=maybe"])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(overrides=["--train.steps=abc"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_parity_layout_keys_and_their_reference():
    from shardwise.parity import parse_layout, reference_overrides

    layout = parse_layout("tp=2,model.vocab_size=509,train.micro_batch=2,train.lr=0.01")
    assert layout == [("parallel.tp", "2"), ("model.vocab_size", "509"), ("train.micro_batch", "2"), ("train.lr", "0.01")]
    # only model.* / data.* change the problem (and so the reference); train.lr is a difference to flag
    assert reference_overrides(layout) == [("model.vocab_size", "509")]


def test_preset_rope_theta_and_norm_eps_apply_unless_overridden():
    from shardwise.config import build_config

    assert build_config({}, [("model.preset", "llama3-8b")]).model.rope_theta == 500000.0
    assert build_config({}, []).model.rope_theta == 10000.0 and build_config({}, []).model.norm_eps == 1e-5
    assert build_config({}, [("model.preset", "llama3-8b"), ("model.rope_theta", "1e4")]).model.rope_theta == 1e4


@pytest.mark.parametrize("value, tier", [(True, "cpu"), (False, "none"), ("nvme", "nvme"), ("cpu", "cpu")])
def test_offload_keeps_its_old_boolean_spelling(value, tier):
    """parallel.offload was a switch and is now a tier: TOML true/false and --parallel.offload=true/false
    still work and resolve to the tier they meant (config.py aliases)."""
    assert build_config({"parallel": {"offload": value}}).parallel.offload == tier
    text = str(value).lower() if isinstance(value, bool) else value
    assert load_config(overrides=[f"--parallel.offload={text}"]).parallel.offload == tier
